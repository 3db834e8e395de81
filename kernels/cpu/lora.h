// Batched LoRA for decoding-sized batches: y[r] += (x[r] A[s]^T) B[s]^T with each row's own
// adapter slot s = row_slots[r] (-1: the base model, untouched), every row and every shard of a
// fused projection in one call per layer. Torch spends a handful of small ops per (adapter,
// shard) group here -- gathers, two GEMMs, a scatter-add -- each paying dispatch and thread
// start-up costs larger than its arithmetic at these sizes.
//
// Layout (llmkit/lora/punica.py, StackedLoRA): A [slots, S*R, in] (shard s's rank-R rows at
// s*R), B^T [slots, R, out] (shard s's outputs out_offsets[s]..out_offsets[s+1] multiply
// t[s*R ..]); ranks [slots, S] int32 (0 = no weights for that shard: nothing is computed).
// Per row: the shrink four A rows at a time (dot4: independent accumulators), the expand as
// rank axpys along the output (contiguous in B^T), accumulated in float32 and rounded to y's
// dtype once. Rows are split between threads only when there is enough work to pay for it.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <vector>

#include "linear.h"
#include "vec.h"

namespace llmkit_cpu {

// Multiply-adds below which one thread does the whole call (a parallel region's start and
// barrier cost more than they save, and on a busy machine a descheduled thread stalls all).
constexpr int64_t kLoraParallelWork = int64_t(1) << 18;

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
  LLMKIT_DISPATCH_FLOAT(x.scalar_type(), "lora_add_", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* ap = lora_a.const_data_ptr<scalar_t>();
    const scalar_t* bp = lora_b.const_data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    const auto body = [&](int64_t r0, int64_t r1) {
      std::vector<float> xf(k), t(SR), acc(n_out);
      for (int64_t r = r0; r < r1; ++r) {
        const int32_t slot = slot_of[r];
        if (slot < 0) continue;
        const scalar_t* xr = xp + r * x.stride(0);
        for (int64_t i = 0; i < k; ++i) xf[i] = static_cast<float>(xr[i]);
        scalar_t* yr = yp + r * y.stride(0);
        for (int64_t s = 0; s < num_shards; ++s) {
          const int64_t rank = rank_of[slot * num_shards + s];
          if (rank == 0) continue;
          // shrink: t[j] = x . A[slot, s*R + j]
          float* ts = t.data() + s * R;
          const scalar_t* as = ap + (slot * SR + s * R) * k;
          int64_t j = 0;
          for (; j + 4 <= rank; j += 4) dot4(xf.data(), as + j * k, k, k, ts + j, false);
          for (; j < rank; ++j) ts[j] = dot1(xf.data(), as + j * k, k);
          // expand: y[o] += sum_j t[j] B^T[slot, j, o] over this shard's outputs
          const int64_t o0 = offs[s], o1 = offs[s + 1];
          for (int64_t o = o0; o < o1; ++o) acc[o] = static_cast<float>(yr[o]);
          for (j = 0; j < rank; ++j) {
            const Vec tj(ts[j]);
            const scalar_t* bj = bp + (slot * R + j) * n_out;
            int64_t o = o0;
            for (; o + kLanes <= o1; o += kLanes)
              store(acc.data() + o, at::vec::fmadd(tj, load(bj + o), load(acc.data() + o)));
            for (; o < o1; ++o) acc[o] += ts[j] * static_cast<float>(bj[o]);
          }
          for (int64_t o = o0; o < o1; ++o) yr[o] = static_cast<scalar_t>(acc[o]);
        }
      }
    };
    if (lora_rows * (SR * k + R * n_out) < kLoraParallelWork || lora_rows == 1) {
      body(0, rows);
    } else {
      at::parallel_for(0, rows, 1, body);
    }
  });
}

}  // namespace llmkit_cpu
