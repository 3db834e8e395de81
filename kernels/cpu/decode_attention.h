// Decode attention over the paged KV cache: one query token per sequence reads its K/V rows in
// place through the block table (no gathered copy of the context). A sliding window (W > 0)
// starts each row's context at len - W: the rows' pointers begin there, so no block before the
// window is read (a freed window's table entries may hold anything). A soft cap c > 0 maps the
// scaled scores to c * tanh(s / c) before the softmax (Gemma 2). One task per (sequence, KV
// head), or per query head when those are too few to fill the threads: the block table is read
// once into the head's row pointers, and a task's query heads share every K/V row they load.
// Consecutive rows that read the same context (a speculative verify step's 1 + K rows of one
// sequence: shared_context_runs) share a task, and with it each K/V row's load (and a
// quantized cache's dequantization); every row still gets the bits it gets alone.
// bf16 follows torch's bf16 flash SDPA step by step (decode_head_sdpa_order) in the AVX2
// tiers and for head sizes that are not a multiple of 32; the AVX-512 tiers run their own
// bf16 dot products instead (decode_attention_avx512.h: other bits, fixed per tier). float32
// is plain float32 math (scores, an exact max-subtracted softmax, the weighted sum of V).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "kv_quant.h"
#include "linear.h"
#include "thread_pool.h"
#include "vec.h"

namespace llmkit_cpu {

// The sums of four vectors' lanes.
inline void hsum4(const Vec& a0, const Vec& a1, const Vec& a2, const Vec& a3, float* out) {
#if defined(CPU_CAPABILITY_AVX2)
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
#else
  out[0] = lane_sum(a0);
  out[1] = lane_sum(a1);
  out[2] = lane_sum(a2);
  out[3] = lane_sum(a3);
#endif
}

// Gemma 2's attention-logit soft-capping of n scaled scores (cap <= 0: none).
inline void soft_cap_scores(float* p, int64_t n, float cap) {
  if (cap <= 0.f) return;
  for (int64_t i = 0; i < n; ++i) p[i] = std::tanh(p[i] / cap) * cap;
}

// *std::max_element(p, p + n) (n >= 1), vectorised: max is exact whatever the order, and the
// sign of a zero maximum does not reach any output (scores minus it go through exp). Only NaN,
// where max_element's answer depends on where it lies, takes max_element itself.
inline float max_score(const float* p, int64_t n) {
#if defined(CPU_CAPABILITY_AVX2)
  if (n >= 8) {
    __m256 m = _mm256_loadu_ps(p), nan = _mm256_cmp_ps(m, m, _CMP_UNORD_Q);
    int64_t i = 8;
    for (; i + 8 <= n; i += 8) {
      const __m256 x = _mm256_loadu_ps(p + i);
      m = _mm256_max_ps(m, x);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, m);
    float best = lanes[0];
    for (int l = 1; l < 8; ++l) best = std::max(best, lanes[l]);
    for (; i < n; ++i) {
      if (std::isnan(p[i])) return *std::max_element(p, p + n);
      best = std::max(best, p[i]);
    }
    if (_mm256_movemask_ps(nan) == 0) return best;
  }
#endif
  return *std::max_element(p, p + n);
}

// Vectors of one head's output accumulated in registers at a time (64 floats with AVX2).
constexpr int64_t kChunk = 8;

// torch's CPU flash attention splits the context into blocks of this many rows (one query row).
constexpr int64_t kSdpaKvBlock = 512;

// Eight K rows' scores at once, each the bits of dot_torch_order(qf, k, dim) * scale (dim a
// multiple of 64, so no tail): the eight lane sums run side by side instead of one by one.
inline void scores8_torch_order(const float* qf, const bf16* const* k, int64_t dim, float scale,
                                float* p) {
  Vec v[8];
  for (int l = 0; l < 8; ++l) {
    Vec acc[8];
    for (int r = 0; r < 8; ++r) acc[r] = Vec(0.f);
    for (int64_t j = 0; j < dim; j += 64)
      for (int r = 0; r < 8; ++r)
        acc[r] = at::vec::fmadd(load(qf + j + 8 * r), load(k[l] + j + 8 * r), acc[r]);
    torch_order_tree(acc);
    v[l] = acc[0];
  }
  // dot_torch_order adds its (empty) tail's sum, +0.0f, before the caller scales.
  store(p, (lane_sums8_aten_order(v) + Vec(0.f)) * Vec(scale));
}

// One query head over its context in the order and roundings of torch's CPU flash attention
// for bf16 inputs at one query token -- what Hugging Face's bf16 model runs through SDPA: per
// 512-row block, q.k in the bf16 GEMM's dot-product order, the max, exp (ATen's exp_u20 for
// whole vectors, std::exp for the tail) with the probabilities rounded to bf16, the running max
// and sum rescaled, P.V in four interleaved float32 partial sums per output; the output times
// the reciprocal of the sum, rounded once. Measured against SDPA on random inputs: 82-96% of the
// bf16 outputs bit-equal (the rest one step apart) vs 57-73% for float32 math throughout.
// krows / vrows: the context's K and V rows of this head, in order.
// exp(p - max) over a block of scores, each rounded to bf16 as SDPA's P is; their sum (before
// rounding).
inline float exp_scores_bf16(float* p, int64_t nl, float new_max) {
  Vec vsum(0.f);
  const int64_t whole = nl - nl % kLanes;
  for (int64_t l = 0; l < whole; l += kLanes) {
    const Vec e = (load(p + l) - Vec(new_max)).exp_u20();
    vsum = vsum + e;
    store(p + l, round_as<bf16>(e));
  }
  float block_sum = at::vec::vec_reduce_all<float>(std::plus<Vec>(), vsum);
  for (int64_t l = whole; l < nl; ++l) {
    const float e = std::exp(p[l] - new_max);
    block_sum += e;
    p[l] = static_cast<float>(bf16(e));
  }
  return block_sum;
}

inline void decode_head_sdpa_order(const float* qf, const bf16* const* krows,
                                   const bf16* const* vrows, int64_t len, float scale,
                                   int64_t dim, float* p, float* acc, bf16* dst, float cap) {
  float run_max = -std::numeric_limits<float>::infinity(), run_sum = 0.f;
  std::fill(acc, acc + dim, 0.f);
  for (int64_t n0 = 0; n0 < len; n0 += kSdpaKvBlock) {
    const int64_t nl = std::min(kSdpaKvBlock, len - n0);
    int64_t l = 0;
    if (dim % 64 == 0)
      for (; l + 8 <= nl; l += 8) scores8_torch_order(qf, krows + n0 + l, dim, scale, p + l);
    for (; l < nl; ++l) p[l] = dot_torch_order(qf, krows[n0 + l], dim, nullptr) * scale;
    soft_cap_scores(p, nl, cap);
    const float new_max = std::max(max_score(p, nl), run_max);
    const float block_sum = exp_scores_bf16(p, nl, new_max);
    const float rescale = std::exp(run_max - new_max);
    run_max = new_max;
    if (n0 > 0)
      for (int64_t d = 0; d < dim; ++d) acc[d] = acc[d] * rescale;
    run_sum = run_sum * rescale + block_sum;
    const int64_t nl4 = nl & ~int64_t(3);
    for (int64_t d = 0; d < dim; d += kLanes) {
      const int64_t n = std::min<int64_t>(kLanes, dim - d);
      Vec s0(0.f), s1(0.f), s2(0.f), s3(0.f);
      for (int64_t l = 0; l < nl4; l += 4) {
        s0 = s0 + load_n(vrows[n0 + l] + d, n) * Vec(p[l]);
        s1 = s1 + load_n(vrows[n0 + l + 1] + d, n) * Vec(p[l + 1]);
        s2 = s2 + load_n(vrows[n0 + l + 2] + d, n) * Vec(p[l + 2]);
        s3 = s3 + load_n(vrows[n0 + l + 3] + d, n) * Vec(p[l + 3]);
      }
      for (int64_t l = nl4; l < nl; ++l) s0 = s0 + load_n(vrows[n0 + l] + d, n) * Vec(p[l]);
      const Vec dotv = ((s0 + s1) + s2) + s3;
      store_n(acc + d, n0 > 0 ? load_n(acc + d, n) + dotv : dotv, n);
    }
  }
  const Vec inv(len > 0 ? 1.f / run_sum : 0.f);
  for (int64_t d = 0; d < dim; d += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, dim - d);
    store_n(dst + d, load_n(acc + d, n) * inv, n);
  }
}

}  // namespace llmkit_cpu

// The AVX-512 tiers' own bf16 path (decode_group_bf16_avx512), after the helpers it shares.
#include "decode_attention_avx512.h"

namespace llmkit_cpu {

// The float32 path for one KV head's group of query heads (qf [group, dim]); p holds
// group * len scores, acc group * dim outputs.
inline void decode_group_float32(const float* qf, const float* const* krows,
                                 const float* const* vrows, int64_t len, int64_t group,
                                 int64_t dim, float scale, float* p, float* acc, float* dst,
                                 float cap) {
  if (len == 0) {  // no context: zeros (and no maximum of no scores to read)
    std::fill(dst, dst + group * dim, 0.f);
    return;
  }
  for (int64_t t0 = 0; t0 < len; t0 += 4) {
    // Four context rows at a time: four independent accumulation chains per head.
    const int64_t nt = std::min<int64_t>(4, len - t0);
    const float* k[4];
    for (int64_t j = 0; j < 4; ++j) k[j] = krows[t0 + std::min<int64_t>(j, nt - 1)];
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = qf + g * dim;
      Vec a0(0.f), a1(0.f), a2(0.f), a3(0.f);
      for (int64_t d = 0; d < dim; d += kLanes) {
        const int64_t n = std::min<int64_t>(kLanes, dim - d);
        const Vec qv = load_n(qg + d, n);
        a0 = at::vec::fmadd(qv, load_n(k[0] + d, n), a0);
        a1 = at::vec::fmadd(qv, load_n(k[1] + d, n), a1);
        a2 = at::vec::fmadd(qv, load_n(k[2] + d, n), a2);
        a3 = at::vec::fmadd(qv, load_n(k[3] + d, n), a3);
      }
      float dots[4];
      hsum4(a0, a1, a2, a3, dots);
      for (int64_t j = 0; j < nt; ++j) p[g * len + t0 + j] = dots[j] * scale;
    }
  }
  soft_cap_scores(p, group * len, cap);
  for (int64_t g = 0; g < group; ++g) {
    float* s = p + g * len;
    const float m = *std::max_element(s, s + len);
    Vec total(0.f);
    for (int64_t t = 0; t < len; t += kLanes) {
      const int64_t n = std::min<int64_t>(kLanes, len - t);
      Vec e = (load_n(s + t, n) - Vec(m)).exp();
      if (n < kLanes) e = Vec::set(Vec(0.f), e, n);  // the padding lanes add nothing
      store_n(s + t, e, n);
      total = total + e;
    }
    const float* pg = s;
    float* ag = acc + g * dim;
    for (int64_t d0 = 0; d0 < dim; d0 += kChunk * kLanes) {
      const int64_t width = std::min<int64_t>(kChunk * kLanes, dim - d0);
      if (width == kChunk * kLanes) {
        // Accumulators stay in registers across the whole context.
        Vec a[kChunk];
        for (int64_t j = 0; j < kChunk; ++j) a[j] = Vec(0.f);
        for (int64_t t = 0; t < len; ++t) {
          const Vec pt(pg[t]);
          for (int64_t j = 0; j < kChunk; ++j)
            a[j] = at::vec::fmadd(pt, load(vrows[t] + d0 + j * kLanes), a[j]);
        }
        for (int64_t j = 0; j < kChunk; ++j) a[j].store(ag + d0 + j * kLanes);
      } else {
        std::fill(ag + d0, ag + d0 + width, 0.f);
        for (int64_t t = 0; t < len; ++t)
          for (int64_t d = 0; d < width; d += kLanes) {
            const int64_t n = std::min<int64_t>(kLanes, width - d);
            store_n(ag + d0 + d, load_n(ag + d0 + d, n) + Vec(pg[t]) * load_n(vrows[t] + d0 + d, n),
                    n);
          }
      }
    }
    const Vec inv(len > 0 ? 1.f / lane_sum(total) : 0.f);
    for (int64_t d = 0; d < dim; d += kLanes) {
      const int64_t n = std::min<int64_t>(kLanes, dim - d);
      store_n(dst + g * dim + d, load_n(ag + d, n) * inv, n);
    }
  }
}

// A batch whose context rows (summed over its sequences, within the window) are at most this
// runs its few KV-head tasks on the calling thread (see paged_decode_impl). Off: measured alone,
// a batch-1 decode step was slower with one sequence's tasks on the calling thread than spread
// over the threads (docs/cpu-speed.md); under load, with the other core busy, it had looked
// faster. Which thread runs a task changes none of its bits.
constexpr int64_t kSerialDecodeRows = 0;

inline int64_t context_rows(const int64_t* lens, int64_t batch, int64_t window) {
  int64_t rows = 0;
  for (int64_t b = 0; b < batch; ++b) rows += window > 0 ? std::min(lens[b], window) : lens[b];
  return rows;
}

// ``f(0, n)`` here, or split over the threads by llmkit_cpu::parallel_for (a task each at least).
template <typename F>
void run_decode_tasks(int64_t n, bool serial, const F& f) {
  if (serial)
    f(0, n);
  else
    llmkit_cpu::parallel_for(0, n, 1, f);
}

// The most batch rows one read of a context serves (a verify step has 1 + K <= 16).
constexpr int64_t kMaxRunRows = 16;

// Runs of consecutive batch rows that read the same context rows: a row joins the run before
// it when it has the same window start, at least its length, and the same block-table entries
// over every block the shorter row reads -- so each row's context is a prefix of the run's
// last row's. A speculative verify step's 1 + K rows of one sequence (one row per token, the
// block-table row repeated: attention_max_expanded_query_len) form one run, whose K/V rows
// are then read (and dequantized) once for all of them; each row's math is its own, so
// grouping changes no bit. Returns the runs' first rows, then batch.
template <typename I>
std::vector<int64_t> shared_context_runs(const I* table, int64_t stride, const int64_t* lens,
                                         int64_t batch, int64_t window, int64_t block_size) {
  std::vector<int64_t> starts;
  const auto first = [&](int64_t b) {
    return window > 0 ? std::max<int64_t>(0, lens[b] - window) : int64_t(0);
  };
  for (int64_t b = 0; b < batch; ++b) {
    bool join = b > 0 && b - starts.back() < kMaxRunRows && first(b) == first(b - 1) &&
                lens[b] >= lens[b - 1];
    if (join) {
      const int64_t end = (lens[b - 1] + block_size - 1) / block_size;
      for (int64_t j = first(b - 1) / block_size; join && j < end; ++j)
        join = table[b * stride + j] == table[(b - 1) * stride + j];
    }
    if (!join) starts.push_back(b);
  }
  starts.push_back(batch);
  return starts;
}

// One KV head's context rows of batch row b (positions first .. first + len - 1) as row
// pointers, padded to a multiple of 16 with the first row (the AVX-512 path reads whole tiles
// and pairs of rows and gives the padding probability 0).
template <typename T, typename I>
void context_row_pointers(const T* kc, const T* vc, const I* blocks, int64_t first, int64_t len,
                          int64_t block_size, int64_t block, int64_t row, int64_t offset,
                          std::vector<const T*>& krows, std::vector<const T*>& vrows) {
  const int64_t padded = (len + 15) / 16 * 16;
  krows.resize(padded);
  vrows.resize(padded);
  // Block by block: no division per row.
  for (int64_t t = 0, pos = first; t < len;) {
    const int64_t in_block = pos % block_size, n = std::min(block_size - in_block, len - t);
    const int64_t at = static_cast<int64_t>(blocks[pos / block_size]) * block +
                       in_block * row + offset;
    for (int64_t i = 0; i < n; ++i, ++t) {
      krows[t] = kc + at + i * row;
      vrows[t] = vc + at + i * row;
    }
    pos += n;
  }
  for (int64_t t = len; t < padded; ++t) {
    krows[t] = krows[0];
    vrows[t] = vrows[0];
  }
}

template <typename T, typename I>
void paged_decode_impl(const at::Tensor& q, const at::Tensor& kv_cache, const I* table,
                       int64_t table_stride, const int64_t* lens, float scale,
                       int64_t window, float cap, at::Tensor& out) {
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = kv_cache.size(3), block_size = kv_cache.size(2);
  const int64_t group = heads / kv_heads;
  const int64_t row = kv_heads * dim, block = block_size * row;
  const T* kc = kv_cache.const_data_ptr<T>();
  const T* vc = kc + kv_cache.size(1) * block;
  const T* qp = q.const_data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const std::vector<int64_t> starts =
      shared_context_runs(table, table_stride, lens, batch, window, block_size);
  const int64_t runs = static_cast<int64_t>(starts.size()) - 1;
  // A task is one KV head's group of query heads over one run of rows (they share every K/V
  // row loaded) -- or, with too few of those to keep the threads evenly busy (one sequence:
  // 3 KV heads on 2 threads), one query head, or a part of the run's rows. Each row's and
  // head's math is the same either way, so neither choice changes a bit. Where a group runs
  // at once (bf16 on the AVX-512 tiers: its K/V rows loaded once, not per head), splitting it
  // costs more than the idle thread gains: few groups stay whole.
  bool grouped = false;
#if defined(LLMKIT_AVX512)
  grouped = std::is_same_v<T, bf16> && dim % 32 == 0 && dim <= 512;  // decode_group_bf16_avx512
#endif
  const bool few = runs * kv_heads < 2 * at::get_num_threads();
  const int64_t parts = few && !grouped ? group : 1;
  // Too few (run, KV head) tasks for the threads (a batch-1 verify step: 3 KV heads on 2
  // threads) split each run's rows into parts, each part reading its KV head's context again.
  const int64_t row_parts =
      few && grouped && runs < batch
          ? std::min<int64_t>(kMaxRunRows, (2 * at::get_num_threads() + runs * kv_heads - 1) /
                                               (runs * kv_heads))
          : 1;
  const int64_t per_part = group / parts;
  const bool serial = few && grouped && context_rows(lens, batch, window) <= kSerialDecodeRows;
  run_decode_tasks(runs * kv_heads * parts * row_parts, serial, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(per_part * dim), acc(per_part * dim), scores, sums(per_part);
    std::vector<uint16_t> probs;  // the AVX-512 bf16 path's bf16 probabilities
    std::vector<const T*> krows, vrows;
    std::vector<int64_t> rel;  // a run's lengths from its window start
#if defined(LLMKIT_AVX512)
    RowsScratch rows_scratch;
#endif
    for (int64_t task = begin; task < end; ++task) {
      const int64_t run = task / (kv_heads * parts * row_parts);
      const int64_t kvh = task / (parts * row_parts) % kv_heads;
      const int64_t rp = task / parts % row_parts;
      const int64_t h0 = kvh * group + task % parts * per_part;
      const int64_t n0 = starts[run + 1] - starts[run];
      const int64_t b0 = starts[run] + n0 * rp / row_parts;
      const int64_t nrows = starts[run] + n0 * (rp + 1) / row_parts - b0;
      if (nrows == 0) continue;
      const int64_t last = b0 + nrows - 1;  // the run's longest row: its context holds the rest
      const int64_t first = window > 0 ? std::max<int64_t>(0, lens[last] - window) : 0;
      const int64_t len = lens[last] - first;  // the rows read: positions first .. lens - 1
      context_row_pointers(kc, vc, table + last * table_stride, first, len, block_size, block,
                           row, kvh * dim, krows, vrows);
      const int64_t padded = static_cast<int64_t>(krows.size());
      rel.resize(nrows);
      for (int64_t r = 0; r < nrows; ++r) rel[r] = lens[b0 + r] - first;
      const T* qsrc = qp + b0 * qs0 + h0 * qs1;
      T* dst = op + (b0 * heads + h0) * dim;
      if constexpr (std::is_same_v<T, bf16>) {
#if defined(LLMKIT_AVX512)
        if (dim % 32 == 0 && dim <= 512) {
          if (nrows > 1) {
            decode_rows_bf16_avx512(qsrc, qs0, qs1, krows.data(), vrows.data(), rel.data(),
                                    nrows, scale, dim, per_part, rows_scratch, dst,
                                    heads * dim, cap);
            continue;
          }
          scores.resize(per_part * padded);
          probs.resize(per_part * padded);
          decode_group_bf16_avx512(qsrc, qs1, krows.data(), vrows.data(), len, scale, dim,
                                   per_part, scores.data(), probs.data(), acc.data(),
                                   sums.data(), dst, cap);
          continue;
        }
#endif
        // The SDPA-order path reads each row's K/V in place for every row of a run (its
        // pointers built once): widening the run's rows once into float32 first was slower
        // (docs/cpu-speed.md), the float copy twice the bytes the cache holds.
        scores.resize(std::min(len, kSdpaKvBlock));
        for (int64_t r = 0; r < nrows; ++r)
          for (int64_t g = 0; g < per_part; ++g) {
            for (int64_t d = 0; d < dim; ++d)
              qf[d] = static_cast<float>(qsrc[r * qs0 + g * qs1 + d]);
            decode_head_sdpa_order(qf.data(), krows.data(), vrows.data(), rel[r], scale, dim,
                                   scores.data(), acc.data(), dst + r * heads * dim + g * dim,
                                   cap);
          }
      } else {
        scores.resize(per_part * len);
        for (int64_t r = 0; r < nrows; ++r) {  // float32 rows: read in place, nothing to widen
          for (int64_t g = 0; g < per_part; ++g)
            for (int64_t d = 0; d < dim; ++d)
              qf[g * dim + d] = static_cast<float>(qsrc[r * qs0 + g * qs1 + d]);
          decode_group_float32(qf.data(), krows.data(), vrows.data(), rel[r], per_part, dim,
                               scale, scores.data(), acc.data(), dst + r * heads * dim, cap);
        }
      }
    }
  });
}

// A cache of another dtype than q's -- int8/fp8 codes with their row scales, or another float
// type (kv_quant.h): a task first reads its KV head's context rows into float32 (dequantized:
// code * scale, one rounding, as the torch reference), then runs the float32 path over them.
// Memory traffic is the cache's bytes (1 per value for int8/fp8); the float copy stays in the
// task's cache-resident scratch.
template <typename T, typename I>
void paged_decode_converted_impl(const at::Tensor& q, const at::Tensor& kv_cache,
                                 const I* table, int64_t table_stride, const int64_t* lens,
                                 float scale, int64_t window, float cap, at::Tensor& out) {
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = kv_cache.size(3), block_size = kv_cache.size(2);
  const int64_t width = kv_cache.size(4), es = kv_cache.element_size();
  const KVRows f = kv_rows_of(kv_cache);
  const int64_t group = heads / kv_heads;
  const int64_t row = kv_heads * width * es, block = block_size * row;  // bytes
  const char* kc = static_cast<const char*>(kv_cache.const_data_ptr());
  const char* vc = kc + kv_cache.size(1) * block;
  const T* qp = q.const_data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  // Tasks as paged_decode_impl's (runs of rows that share their context, per KV head or per
  // query head): a run's rows are dequantized once for all its rows.
  const std::vector<int64_t> starts =
      shared_context_runs(table, table_stride, lens, batch, window, block_size);
  const int64_t runs = static_cast<int64_t>(starts.size()) - 1;
  const int64_t parts = runs * kv_heads >= 2 * at::get_num_threads() ? 1 : group;
  const int64_t per_part = group / parts;
  llmkit_cpu::parallel_for(0, runs * kv_heads * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(per_part * dim), acc(per_part * dim), o(per_part * dim), scores;
    std::vector<float> kf, vf;
    std::vector<const float*> krows, vrows;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t run = task / (kv_heads * parts), kvh = task / parts % kv_heads;
      const int64_t h0 = kvh * group + task % parts * per_part;
      const int64_t last = starts[run + 1] - 1;  // the run's longest row
      const int64_t first = window > 0 ? std::max<int64_t>(0, lens[last] - window) : 0;
      const int64_t len = lens[last] - first;  // the rows read: positions first .. lens - 1
      const I* blocks = table + last * table_stride;
      kf.resize(len * dim);
      vf.resize(len * dim);
      krows.resize(len);
      vrows.resize(len);
      for (int64_t t = 0; t < len; ++t) {
        const int64_t pos = first + t;
        const int64_t at = static_cast<int64_t>(blocks[pos / block_size]) * block +
                           (pos % block_size) * row + kvh * width * es;
        read_row(kc + at, dim, f, kf.data() + t * dim);
        read_row(vc + at, dim, f, vf.data() + t * dim);
        krows[t] = kf.data() + t * dim;
        vrows[t] = vf.data() + t * dim;
      }
      scores.resize(per_part * len);
      for (int64_t b = starts[run]; b <= last; ++b) {
        for (int64_t g = 0; g < per_part; ++g) {
          const T* src = qp + b * qs0 + (h0 + g) * qs1;
          for (int64_t d = 0; d < dim; ++d) qf[g * dim + d] = static_cast<float>(src[d]);
        }
        decode_group_float32(qf.data(), krows.data(), vrows.data(), lens[b] - first, per_part,
                             dim, scale, scores.data(), acc.data(), o.data(), cap);
        T* dst = op + (b * heads + h0) * dim;
        for (int64_t i = 0; i < per_part * dim; ++i) dst[i] = static_cast<T>(o[i]);
      }
    }
  });
}

// q [batch, heads, head_dim] (contiguous head_dim), kv_cache [2, blocks, block_size, kv_heads,
// head_dim] contiguous (of q's dtype, of another float dtype, or int8/uint8 rows of head_dim
// codes + a float32 scale: kv_quant.h), block_table [batch, >= ceil(len / block_size)] int32/int64, seq_lens
// [batch] (context length including the query token, whose K/V is already written);
// sliding_window > 0: each row attends to its last sliding_window positions only; soft_cap > 0:
// Gemma 2's tanh soft-capping of the scores.
inline at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                                         const at::Tensor& block_table,
                                         const at::Tensor& seq_lens, double scale,
                                         int64_t sliding_window, double soft_cap) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "paged_decode_attention: q must be "
              "[batch, heads, head_dim] with a contiguous head_dim");
  const bool as_is = kv_cache.scalar_type() == q.scalar_type();
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() == 5 && kv_cache.size(0) == 2 &&
              kv_cache.size(4) == (as_is ? q.size(2)
                                         : row_width(kv_rows_of(kv_cache), q.size(2))) &&
              q.size(1) % kv_cache.size(3) == 0,
              "paged_decode_attention: kv_cache must be [2, blocks, block_size, kv_heads, "
              "head_dim] (head_dim + 4 for a quantized cache), kv_heads dividing q's heads");
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == q.size(0) &&
              block_table.stride(1) == 1 && seq_lens.numel() == q.size(0),
              "paged_decode_attention: block_table [batch, blocks] and seq_lens [batch]");
  TORCH_CHECK(seq_lens.is_contiguous() && (seq_lens.scalar_type() == at::kInt ||
              seq_lens.scalar_type() == at::kLong),
              "paged_decode_attention: seq_lens must be contiguous int32 or int64");
  // Read in place: a converted copy per layer cost more than the attention of a short context.
  std::vector<int64_t> lens(q.size(0));
  for (int64_t b = 0; b < q.size(0); ++b)
    lens[b] = seq_lens.scalar_type() == at::kInt ? seq_lens.const_data_ptr<int32_t>()[b]
                                                 : seq_lens.const_data_ptr<int64_t>()[b];
  const int64_t* lp = lens.data();
  for (int64_t b = 0; b < q.size(0); ++b)
    TORCH_CHECK(lp[b] >= 0 && lp[b] <= block_table.size(1) * kv_cache.size(2),
                "paged_decode_attention: seq_lens[", b, "] = ", lp[b],
                " exceeds its block table");
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  TORCH_CHECK(block_table.scalar_type() == at::kInt || block_table.scalar_type() == at::kLong,
              "paged_decode_attention: block_table must be int32 or int64");
  const bool i32 = block_table.scalar_type() == at::kInt;
  TORCH_CHECK(sliding_window >= 0 && soft_cap >= 0,
              "paged_decode_attention: sliding_window and soft_cap must be >= 0 (0: none)");
  const float s = static_cast<float>(scale), cap = static_cast<float>(soft_cap);
  const int64_t ts = block_table.stride(0), w = sliding_window;
  LLMKIT_DISPATCH_FLOAT(q.scalar_type(), "paged_decode_attention", [&] {
    if (as_is && i32)
      paged_decode_impl<scalar_t>(q, kv_cache, block_table.const_data_ptr<int32_t>(), ts, lp,
                                  s, w, cap, out);
    else if (as_is)
      paged_decode_impl<scalar_t>(q, kv_cache, block_table.const_data_ptr<int64_t>(), ts, lp,
                                  s, w, cap, out);
    else if (i32)
      paged_decode_converted_impl<scalar_t>(q, kv_cache, block_table.const_data_ptr<int32_t>(),
                                            ts, lp, s, w, cap, out);
    else
      paged_decode_converted_impl<scalar_t>(q, kv_cache, block_table.const_data_ptr<int64_t>(),
                                            ts, lp, s, w, cap, out);
  });
  return out;
}

}  // namespace llmkit_cpu
