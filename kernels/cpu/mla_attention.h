// Multi-head latent attention (MLA, DeepSeek-V2/V3) at decode over the paged latent cache, in
// the absorbed form (llmkit/ops/mla.py): each cached token is one latent row [c_kv | k_pe]
// (kv_lora_rank + rope values) shared by every head; head h scores a row as
// scale * ([q_latent_h | q_pe_h] . row) and outputs the softmax-weighted sum of the rows' c_kv.
//
// A task is one sequence's group of heads: each latent row is loaded once (and, for bf16,
// widened to float32 once) and serves every head of the group -- MLA's point, one row for all
// H heads. Rows go in tiles of kMlaTile with an online softmax (running max and sum per head,
// float32), so a tile's rows stay cache-resident between the scores and the weighted sum.
// Heads are split into groups only when the sequences are too few to busy the threads; each
// head's arithmetic is the same whichever group it is in, so a sequence's result does not
// depend on its batch. Writes are a row copy (write_latent_cache).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "decode_attention.h"  // hsum4
#include "thread_pool.h"
#include "vec.h"

namespace llmkit_cpu {

// Latent rows per tile of the online softmax (fixed: part of every result's rounding).
constexpr int64_t kMlaTile = 32;

// One task: heads [h0, h0 + group) of one sequence over its len context rows (rows[t]: the
// float32 latent row of position t, dim wide). qf [group, dim] float32 queries; scores
// [group, kMlaTile], acc [group, rank] scratch; dst [group] rows of rank outputs (stride ds).
template <typename T>
inline void mla_decode_group(const float* qf, const float* const* rows, int64_t len,
                             int64_t group, int64_t rank, int64_t dim, float scale,
                             float* scores, float* acc, T* dst, int64_t ds) {
  std::vector<float> run_max(group, -std::numeric_limits<float>::infinity());
  std::vector<float> run_sum(group, 0.f), alpha(group);
  std::fill(acc, acc + group * rank, 0.f);
  for (int64_t t0 = 0; t0 < len; t0 += kMlaTile) {
    const int64_t nt = std::min(kMlaTile, len - t0);
    const float* const* tile = rows + t0;
    for (int64_t g = 0; g < group; ++g) {
      // Scores: per head and row one dot over dim (lane-wise fmadd, the lanes summed last).
      const float* q = qf + g * dim;
      float* s = scores + g * kMlaTile;
      for (int64_t i0 = 0; i0 < nt; i0 += 4) {
        // Four rows at a time: four independent chains (a short tile repeats its last row).
        const float* k[4];
        for (int64_t j = 0; j < 4; ++j) k[j] = tile[std::min<int64_t>(i0 + j, nt - 1)];
        Vec a0(0.f), a1(0.f), a2(0.f), a3(0.f);
        for (int64_t d = 0; d < dim; d += kLanes) {
          const int64_t n = std::min<int64_t>(kLanes, dim - d);
          const Vec qv = load_n(q + d, n);
          a0 = at::vec::fmadd(qv, load_n(k[0] + d, n), a0);
          a1 = at::vec::fmadd(qv, load_n(k[1] + d, n), a1);
          a2 = at::vec::fmadd(qv, load_n(k[2] + d, n), a2);
          a3 = at::vec::fmadd(qv, load_n(k[3] + d, n), a3);
        }
        float dots[4];
        hsum4(a0, a1, a2, a3, dots);
        for (int64_t j = 0; j < std::min<int64_t>(4, nt - i0); ++j) s[i0 + j] = dots[j] * scale;
      }
      // Online softmax: what came before is rescaled to the new running max.
      const float m = std::max(run_max[g], *std::max_element(s, s + nt));
      alpha[g] = std::exp(run_max[g] - m);  // 0 on the first tile
      float sum = 0.f;
      for (int64_t i = 0; i < nt; ++i) {
        s[i] = std::exp(s[i] - m);
        sum += s[i];
      }
      run_sum[g] = run_sum[g] * alpha[g] + sum;
      run_max[g] = m;
    }
    // Values: c_kv one vector of columns at a time, every head over it while it is in L1.
    // (Four vectors of columns at a time where they fit: four independent chains; each
    // column's arithmetic is the same on either path.)
    for (int64_t d0 = 0; d0 < rank; d0 += 4 * kLanes) {
      const int64_t width = std::min<int64_t>(4 * kLanes, rank - d0);
      for (int64_t g = 0; g < group; ++g) {
        const float* p = scores + g * kMlaTile;
        float* ag = acc + g * rank + d0;
        const Vec al(alpha[g]);
        if (width == 4 * kLanes) {
          Vec a0 = load(ag) * al, a1 = load(ag + kLanes) * al;
          Vec a2 = load(ag + 2 * kLanes) * al, a3 = load(ag + 3 * kLanes) * al;
          for (int64_t i = 0; i < nt; ++i) {
            const Vec pi(p[i]);
            const float* c = tile[i] + d0;
            a0 = at::vec::fmadd(pi, load(c), a0);
            a1 = at::vec::fmadd(pi, load(c + kLanes), a1);
            a2 = at::vec::fmadd(pi, load(c + 2 * kLanes), a2);
            a3 = at::vec::fmadd(pi, load(c + 3 * kLanes), a3);
          }
          a0.store(ag);
          a1.store(ag + kLanes);
          a2.store(ag + 2 * kLanes);
          a3.store(ag + 3 * kLanes);
        } else {
          for (int64_t d = 0; d < width; d += kLanes) {
            const int64_t n = std::min<int64_t>(kLanes, width - d);
            Vec a = load_n(ag + d, n) * al;
            for (int64_t i = 0; i < nt; ++i)
              a = at::vec::fmadd(Vec(p[i]), load_n(tile[i] + d0 + d, n), a);
            store_n(ag + d, a, n);
          }
        }
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const Vec inv(len > 0 ? 1.f / run_sum[g] : 0.f);
    for (int64_t d = 0; d < rank; d += kLanes) {
      const int64_t n = std::min<int64_t>(kLanes, rank - d);
      store_n(dst + g * ds + d, load_n(acc + g * rank + d, n) * inv, n);
    }
  }
}

// The smallest head split that gives every thread work (1 when the sequences alone do): it
// divides heads, so groups are equal.
inline int64_t mla_head_parts(int64_t batch, int64_t heads) {
  const int64_t threads = at::get_num_threads();
  for (int64_t parts = 1; parts < heads; ++parts)
    if (heads % parts == 0 && batch * parts >= threads) return parts;
  return heads;
}

template <typename T, typename I>
void mla_decode_impl(const at::Tensor& q_latent, const at::Tensor& q_pe,
                     const at::Tensor& cache, const I* table, int64_t table_stride,
                     const int64_t* lens, float scale, at::Tensor& out) {
  const int64_t batch = q_latent.size(0), heads = q_latent.size(1), rank = q_latent.size(2);
  const int64_t rope = q_pe.size(2), dim = rank + rope, block_size = cache.size(1);
  const T* cp = cache.const_data_ptr<T>();
  const T* ql = q_latent.const_data_ptr<T>();
  const T* qr = q_pe.const_data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t ls0 = q_latent.stride(0), ls1 = q_latent.stride(1);
  const int64_t rs0 = q_pe.stride(0), rs1 = q_pe.stride(1);
  const int64_t parts = mla_head_parts(batch, heads), per_part = heads / parts;
  llmkit_cpu::parallel_for(0, batch * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(per_part * dim), acc(per_part * rank), scores(per_part * kMlaTile);
    std::vector<float> widened;  // bf16 rows as float32, each widened once for all heads
    std::vector<const float*> rows;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / parts, h0 = task % parts * per_part, len = lens[b];
      for (int64_t g = 0; g < per_part; ++g) {
        const T* a = ql + b * ls0 + (h0 + g) * ls1;
        const T* r = qr + b * rs0 + (h0 + g) * rs1;
        for (int64_t d = 0; d < rank; ++d) qf[g * dim + d] = static_cast<float>(a[d]);
        for (int64_t d = 0; d < rope; ++d) qf[g * dim + rank + d] = static_cast<float>(r[d]);
      }
      const I* blocks = table + b * table_stride;
      rows.resize(len);
      if constexpr (std::is_same_v<T, float>) {
        for (int64_t t = 0; t < len; ++t)
          rows[t] = cp + (static_cast<int64_t>(blocks[t / block_size]) * block_size +
                          t % block_size) * dim;
      } else {
        widened.resize(len * dim);
        for (int64_t t = 0; t < len; ++t) {
          const T* src = cp + (static_cast<int64_t>(blocks[t / block_size]) * block_size +
                               t % block_size) * dim;
          float* w = widened.data() + t * dim;
          for (int64_t d = 0; d < dim; d += kLanes) {
            const int64_t n = std::min<int64_t>(kLanes, dim - d);
            store_n(w + d, load_n(src + d, n), n);
          }
          rows[t] = w;
        }
      }
      mla_decode_group(qf.data(), rows.data(), len, per_part, rank, dim, scale, scores.data(),
                       acc.data(), op + (b * heads + h0) * rank, rank);
    }
  });
}

// q_latent [batch, heads, rank], q_pe [batch, heads, rope] (each a contiguous last dim, of one
// dtype: float32 or bfloat16), latent_cache [blocks, block_size, rank + rope] contiguous of
// that dtype, block_table [batch, >= ceil(len / block_size)] int32/int64, seq_lens [batch]
// (context length including the query token, whose latent row is already written). One
// query token per sequence: it sees the whole context. Returns [batch, heads, rank].
inline at::Tensor mla_decode_attention(const at::Tensor& q_latent, const at::Tensor& q_pe,
                                       const at::Tensor& latent_cache,
                                       const at::Tensor& block_table,
                                       const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q_latent.dim() == 3 && q_pe.dim() == 3 && q_latent.stride(2) == 1 &&
              q_pe.stride(2) == 1 && q_pe.size(0) == q_latent.size(0) &&
              q_pe.size(1) == q_latent.size(1),
              "mla_decode_attention: q_latent [batch, heads, rank] and q_pe [batch, heads, "
              "rope] with contiguous last dims");
  TORCH_CHECK(latent_cache.dim() == 3 && latent_cache.is_contiguous() &&
              latent_cache.size(2) == q_latent.size(2) + q_pe.size(2),
              "mla_decode_attention: latent_cache must be [blocks, block_size, rank + rope] "
              "contiguous");
  TORCH_CHECK(latent_cache.scalar_type() == q_latent.scalar_type() &&
              q_pe.scalar_type() == q_latent.scalar_type(),
              "mla_decode_attention: q_latent, q_pe and latent_cache must share a dtype");
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == q_latent.size(0) &&
              block_table.stride(1) == 1 && seq_lens.numel() == q_latent.size(0) &&
              seq_lens.is_contiguous(),
              "mla_decode_attention: block_table [batch, blocks] and seq_lens [batch]");
  TORCH_CHECK(block_table.scalar_type() == at::kInt || block_table.scalar_type() == at::kLong,
              "mla_decode_attention: block_table must be int32 or int64");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt || seq_lens.scalar_type() == at::kLong,
              "mla_decode_attention: seq_lens must be int32 or int64");
  const int64_t batch = q_latent.size(0);
  std::vector<int64_t> lens(batch);
  for (int64_t b = 0; b < batch; ++b) {
    lens[b] = seq_lens.scalar_type() == at::kInt ? seq_lens.const_data_ptr<int32_t>()[b]
                                                 : seq_lens.const_data_ptr<int64_t>()[b];
    TORCH_CHECK(lens[b] >= 0 && lens[b] <= block_table.size(1) * latent_cache.size(1),
                "mla_decode_attention: seq_lens[", b, "] = ", lens[b],
                " exceeds its block table");
  }
  auto out = at::empty({batch, q_latent.size(1), q_latent.size(2)}, q_latent.options());
  const float s = static_cast<float>(scale);
  const int64_t ts = block_table.stride(0);
  LLMKIT_DISPATCH_FLOAT(q_latent.scalar_type(), "mla_decode_attention", [&] {
    if (block_table.scalar_type() == at::kInt)
      mla_decode_impl<scalar_t>(q_latent, q_pe, latent_cache,
                                block_table.const_data_ptr<int32_t>(), ts, lens.data(), s, out);
    else
      mla_decode_impl<scalar_t>(q_latent, q_pe, latent_cache,
                                block_table.const_data_ptr<int64_t>(), ts, lens.data(), s, out);
  });
  return out;
}

// latent [tokens, dim] (contiguous rows) into latent_cache [blocks, block_size, dim] of its
// dtype at slot_mapping [n <= tokens] (int64 or int32; -1 = skip).
inline void write_latent_cache(const at::Tensor& latent, at::Tensor& latent_cache,
                               const at::Tensor& slot_mapping) {
  TORCH_CHECK(latent.dim() == 2 && latent.stride(1) == 1 && latent_cache.dim() == 3 &&
              latent_cache.is_contiguous() && latent.size(1) == latent_cache.size(2) &&
              latent.scalar_type() == latent_cache.scalar_type(),
              "write_latent_cache: latent [tokens, dim] and latent_cache [blocks, block_size, "
              "dim] of one dtype");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.is_contiguous() &&
              slot_mapping.size(0) <= latent.size(0) &&
              (slot_mapping.scalar_type() == at::kLong || slot_mapping.scalar_type() == at::kInt),
              "write_latent_cache: slot_mapping [n <= tokens] int32/int64");
  const int64_t n = slot_mapping.size(0), dim = latent.size(1);
  const int64_t num_slots = latent_cache.size(0) * latent_cache.size(1);
  const int64_t es = latent.element_size();
  const char* src = static_cast<const char*>(latent.const_data_ptr());
  char* dst = static_cast<char*>(latent_cache.data_ptr());
  for (int64_t t = 0; t < n; ++t) {
    const int64_t slot = slot_mapping.scalar_type() == at::kLong
                             ? slot_mapping.const_data_ptr<int64_t>()[t]
                             : slot_mapping.const_data_ptr<int32_t>()[t];
    if (slot < 0) continue;
    TORCH_CHECK(slot < num_slots, "write_latent_cache: slot ", slot, " outside the cache of ",
                num_slots);
    std::memcpy(dst + slot * dim * es, src + t * latent.stride(0) * es, dim * es);
  }
}

}  // namespace llmkit_cpu
