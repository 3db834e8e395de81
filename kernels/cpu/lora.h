// Batched LoRA for decoding-sized batches: y[r] += (x[r] A[s]^T) B[s]^T with each row's own
// adapter slot s = row_slots[r] (-1: the base model, untouched), every row and every shard of a
// fused projection in one call per layer. Torch spends a handful of small ops per (adapter,
// shard) group here -- gathers, two GEMMs, a scatter-add -- each paying dispatch and thread
// start-up costs larger than its arithmetic at these sizes.
//
// Layout (llmkit/lora/punica.py, StackedLoRA): A [slots, S*R, in] (shard s's rank-R rows at
// s*R), B^T [slots, R, out] (shard s's outputs out_offsets[s]..out_offsets[s+1] multiply
// t[s*R ..]); ranks [slots, S] int32 (0 = no weights for that shard: nothing is computed).
// Rows that share a slot go in tiles (each A and B vector loaded once per tile); per row the
// shrink sums each rank row in one vector accumulator, the expand is rank axpys along the
// output (contiguous in B^T), accumulated in float32 and rounded to y's dtype once. Tiles are
// split between threads only when there is enough work to pay for it.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <vector>

#include "linear.h"
#include "thread_pool.h"
#include "vec.h"

namespace llmkit_cpu {

// Multiply-adds below which one thread does the whole call (a parallel region's start and
// barrier cost more than they save, and on a busy machine a descheduled thread stalls all).
constexpr int64_t kLoraParallelWork = int64_t(1) << 18;

// Rows per tile of lora_add_ (rows of one slot computed together): 4 rows x 2 rank rows of
// accumulators, their inputs and a weight vector fill AVX2's 16 registers.
constexpr int64_t kLoraTileRows = 4;

// shrink for n <= kLoraTileRows rows xf[q*k ..] against rank rows of A (as, row stride k):
// t[q*ts + j] = xf_q . A_j, each (row, j) summed in dot1's order (one vector accumulator
// along k, then its lanes), so a row's result does not depend on its tile.
template <typename T>
inline void lora_shrink_tile(const float* xf, int64_t n, int64_t k, const T* as, int64_t rank,
                             float* t, int64_t ts) {
  for (int64_t j = 0; j < rank; j += 2) {
    const bool two = j + 1 < rank;
    const T* a0 = as + j * k;
    const T* a1 = two ? a0 + k : a0;
    Vec c0[kLoraTileRows], c1[kLoraTileRows];
    for (int64_t q = 0; q < kLoraTileRows; ++q) c0[q] = c1[q] = Vec(0.f);
    int64_t i = 0;
    for (; i + kLanes <= k; i += kLanes) {
      const Vec w0 = load(a0 + i), w1 = load(a1 + i);
      for (int64_t q = 0; q < n; ++q) {
        const Vec xv = load(xf + q * k + i);
        c0[q] = at::vec::fmadd(xv, w0, c0[q]);
        c1[q] = at::vec::fmadd(xv, w1, c1[q]);
      }
    }
    if (i < k) {
      const int64_t m = k - i;
      const Vec w0 = load(a0 + i, m), w1 = load(a1 + i, m);
      for (int64_t q = 0; q < n; ++q) {
        const Vec xv = load(xf + q * k + i, m);
        c0[q] = at::vec::fmadd(xv, w0, c0[q]);
        c1[q] = at::vec::fmadd(xv, w1, c1[q]);
      }
    }
    for (int64_t q = 0; q < n; ++q) {
      t[q * ts + j] = lane_sum(c0[q]);
      if (two) t[q * ts + j + 1] = lane_sum(c1[q]);
    }
  }
}

// expand for the same rows: y_q[o] += sum_j t_q[j] B^T[j, o] over outputs o0..o1, accumulated in
// float32 from y's value in j order and rounded to y's type once (the per-row order of the
// row-at-a-time kernel this replaced, so the bits are the same).
template <typename T>
inline void lora_expand_tile(const float* t, int64_t ts, int64_t n, int64_t rank, const T* bs,
                             int64_t n_out, int64_t o0, int64_t o1, T* yp, int64_t y_stride,
                             const int64_t* rows) {
  int64_t o = o0;
  for (; o + kLanes <= o1; o += kLanes) {
    Vec acc[kLoraTileRows];
    for (int64_t q = 0; q < n; ++q) acc[q] = load(yp + rows[q] * y_stride + o);
    for (int64_t j = 0; j < rank; ++j) {
      const Vec b = load(bs + j * n_out + o);
      for (int64_t q = 0; q < n; ++q) acc[q] = at::vec::fmadd(Vec(t[q * ts + j]), b, acc[q]);
    }
    for (int64_t q = 0; q < n; ++q) store(yp + rows[q] * y_stride + o, acc[q]);
  }
  for (; o < o1; ++o) {
    for (int64_t q = 0; q < n; ++q) {
      T* yo = yp + rows[q] * y_stride + o;
      float a = static_cast<float>(*yo);
      for (int64_t j = 0; j < rank; ++j) a += t[q * ts + j] * static_cast<float>(bs[j * n_out + o]);
      *yo = static_cast<T>(a);
    }
  }
}

inline void lora_add_(at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a,
                      const at::Tensor& lora_b, const at::Tensor& row_slots,
                      const at::Tensor& ranks, at::IntArrayRef out_offsets) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "lora_add_: x must be [rows, in] with "
              "contiguous rows");
  TORCH_CHECK(y.dim() == 2 && y.stride(1) == 1 && y.size(0) == x.size(0) &&
              y.scalar_type() == x.scalar_type(), "lora_add_: y must be [rows, out] of x's "
              "dtype with contiguous rows");
  TORCH_CHECK(lora_a.dim() == 3 && lora_a.is_contiguous() && lora_a.size(2) == x.size(1) &&
              lora_a.scalar_type() == x.scalar_type(),
              "lora_add_: lora_a must be [slots, S*R, in] contiguous, of x's dtype");
  TORCH_CHECK(lora_b.dim() == 3 && lora_b.is_contiguous() && lora_b.size(0) == lora_a.size(0) &&
              lora_b.size(2) == y.size(1) && lora_b.scalar_type() == x.scalar_type(),
              "lora_add_: lora_b must be B^T [slots, R, out] contiguous, of x's dtype");
  const int64_t num_shards = static_cast<int64_t>(out_offsets.size()) - 1;
  TORCH_CHECK(num_shards >= 1 && out_offsets[0] == 0 && out_offsets[num_shards] == y.size(1),
              "lora_add_: out_offsets must run from 0 to out");
  const int64_t R = lora_b.size(1);
  TORCH_CHECK(lora_a.size(1) == num_shards * R, "lora_add_: lora_a has ", lora_a.size(1),
              " rows per slot, expected shards * R = ", num_shards * R);
  TORCH_CHECK(row_slots.scalar_type() == at::kInt && row_slots.is_contiguous() &&
              row_slots.numel() == x.size(0), "lora_add_: row_slots must be int32 [rows]");
  TORCH_CHECK(ranks.scalar_type() == at::kInt && ranks.is_contiguous() &&
              ranks.numel() == lora_a.size(0) * num_shards,
              "lora_add_: ranks must be int32 [slots, shards]");
  const int64_t rows = x.size(0), k = x.size(1), n_out = y.size(1), SR = num_shards * R;
  const int64_t num_slots = lora_a.size(0);
  const int32_t* slot_of = row_slots.const_data_ptr<int32_t>();
  const int32_t* rank_of = ranks.const_data_ptr<int32_t>();
  int64_t lora_rows = 0;
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(slot_of[r] < num_slots, "lora_add_: row ", r, " names slot ", slot_of[r],
                " of ", num_slots);
    lora_rows += slot_of[r] >= 0;
  }
  if (lora_rows == 0) return;
  std::vector<int64_t> offs(out_offsets.begin(), out_offsets.end());
  // Tiles of up to kLoraTileRows rows that share a slot, so each A and B vector is loaded
  // once per tile instead of once per row: decoding rows of 4 adapters round robin read the
  // adapters' weights (~1 MiB a layer for SmolLM2 at rank 16) from far cache for every row.
  std::vector<int64_t> order;
  order.reserve(lora_rows);
  for (int32_t s = 0; s < num_slots; ++s)
    for (int64_t r = 0; r < rows; ++r)
      if (slot_of[r] == s) order.push_back(r);
  std::vector<int64_t> tile_start;  // into order; tiles never span two slots
  for (int64_t i = 0; i < lora_rows;) {
    tile_start.push_back(i);
    const int32_t s = slot_of[order[i]];
    int64_t n = 0;
    while (i < lora_rows && n < kLoraTileRows && slot_of[order[i]] == s) ++i, ++n;
  }
  tile_start.push_back(lora_rows);
  const int64_t num_tiles = static_cast<int64_t>(tile_start.size()) - 1;
  LLMKIT_DISPATCH_FLOAT(x.scalar_type(), "lora_add_", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* ap = lora_a.const_data_ptr<scalar_t>();
    const scalar_t* bp = lora_b.const_data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    const auto body = [&](int64_t t0, int64_t t1) {
      std::vector<float> xf(kLoraTileRows * k), t(kLoraTileRows * SR);
      for (int64_t tile = t0; tile < t1; ++tile) {
        const int64_t* tr = order.data() + tile_start[tile];
        const int64_t n = tile_start[tile + 1] - tile_start[tile];
        const int32_t slot = slot_of[tr[0]];
        for (int64_t q = 0; q < n; ++q) {
          const scalar_t* xr = xp + tr[q] * x.stride(0);
          for (int64_t i = 0; i < k; ++i) xf[q * k + i] = static_cast<float>(xr[i]);
        }
        for (int64_t s = 0; s < num_shards; ++s) {
          const int64_t rank = rank_of[slot * num_shards + s];
          if (rank == 0) continue;
          const scalar_t* as = ap + (slot * SR + s * R) * k;
          lora_shrink_tile(xf.data(), n, k, as, rank, t.data() + s * R, SR);
          lora_expand_tile(t.data() + s * R, SR, n, rank, bp + slot * R * n_out, n_out,
                           offs[s], offs[s + 1], yp, y.stride(0), tr);
        }
      }
    };
    if (lora_rows * (SR * k + R * n_out) < kLoraParallelWork || num_tiles == 1) {
      body(0, num_tiles);
    } else {
      llmkit_cpu::parallel_for(0, num_tiles, 1, body);
    }
  });
}

// The token embedding's LoRA delta for decoding-sized batches: y[r] += A[s][id_r] B[s]^T with
// s = row_slots[r] (-1: untouched). A is stored transposed ([slots, vocab, R]), so the shrink
// is a row lookup (exact); the expand is lora_expand_tile's, so eager steps and step graphs
// (which call this same op) give the same bits on every CPU.
inline void lora_embedding_add_(at::Tensor& y, const at::Tensor& ids, const at::Tensor& lora_a,
                                const at::Tensor& lora_b, const at::Tensor& row_slots,
                                const at::Tensor& ranks) {
  TORCH_CHECK(y.dim() == 2 && y.stride(1) == 1, "lora_embedding_add_: y must be [rows, hidden] "
              "with contiguous rows");
  TORCH_CHECK(ids.dim() == 1 && ids.numel() == y.size(0) &&
              (ids.scalar_type() == at::kLong || ids.scalar_type() == at::kInt),
              "lora_embedding_add_: ids must be int64 or int32 [rows]");
  TORCH_CHECK(lora_a.dim() == 3 && lora_a.is_contiguous() && lora_a.scalar_type() == y.scalar_type(),
              "lora_embedding_add_: lora_a must be A^T [slots, vocab, R] contiguous, of y's dtype");
  TORCH_CHECK(lora_b.dim() == 3 && lora_b.is_contiguous() && lora_b.size(0) == lora_a.size(0) &&
              lora_b.size(1) == lora_a.size(2) && lora_b.size(2) == y.size(1) &&
              lora_b.scalar_type() == y.scalar_type(),
              "lora_embedding_add_: lora_b must be B^T [slots, R, hidden] contiguous, of y's dtype");
  TORCH_CHECK(row_slots.scalar_type() == at::kInt && row_slots.is_contiguous() &&
              row_slots.numel() == y.size(0), "lora_embedding_add_: row_slots must be int32 [rows]");
  TORCH_CHECK(ranks.scalar_type() == at::kInt && ranks.is_contiguous() &&
              ranks.numel() == lora_a.size(0), "lora_embedding_add_: ranks must be int32 [slots, 1]");
  const int64_t rows = y.size(0), vocab = lora_a.size(1), R = lora_a.size(2), hidden = y.size(1);
  const int64_t num_slots = lora_a.size(0);
  const int32_t* slot_of = row_slots.const_data_ptr<int32_t>();
  const int32_t* rank_of = ranks.const_data_ptr<int32_t>();
  const at::Tensor ids64 = ids.to(at::kLong).contiguous();
  const int64_t* id_of = ids64.const_data_ptr<int64_t>();
  LLMKIT_DISPATCH_FLOAT(y.scalar_type(), "lora_embedding_add_", [&] {
    const scalar_t* ap = lora_a.const_data_ptr<scalar_t>();
    const scalar_t* bp = lora_b.const_data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    std::vector<float> t(R);
    for (int64_t r = 0; r < rows; ++r) {
      const int32_t slot = slot_of[r];
      if (slot < 0) continue;
      TORCH_CHECK(slot < num_slots, "lora_embedding_add_: row ", r, " names slot ", slot,
                  " of ", num_slots);
      TORCH_CHECK(id_of[r] >= 0 && id_of[r] < vocab, "lora_embedding_add_: token id ",
                  id_of[r], " outside the vocabulary of ", vocab);
      const int64_t rank = rank_of[slot];
      if (rank == 0) continue;
      const scalar_t* a_row = ap + (slot * vocab + id_of[r]) * R;
      for (int64_t j = 0; j < rank; ++j) t[j] = static_cast<float>(a_row[j]);
      lora_expand_tile(t.data(), R, 1, rank, bp + slot * R * hidden, hidden, 0, hidden, yp,
                       y.stride(0), &r);
    }
  });
}

}  // namespace llmkit_cpu
