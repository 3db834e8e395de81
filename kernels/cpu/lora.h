// Batched LoRA for a few rows (decoding): y[r] += (x[r] A[s]^T) B[s]^T with each row's own
// adapter slot s = row_slots[r] (-1: the base model, untouched), in one call per layer for
// every row and every shard of a fused projection. Torch would spend a handful of small ops per
// (adapter, shard) group here -- gathers, two GEMMs, a scatter-add -- each paying dispatch
// overhead larger than its arithmetic at these sizes.
//
// Layout (llmkit/lora/layers.py): A [slots, S*R, in] (shard s's rank-R rows at s*R), B
// [slots, out, R] (shard s's outputs out_offsets[s]..out_offsets[s+1] multiply t[s*R..]);
// ranks [slots, S] (int32; 0 = no weights for that shard, so nothing is computed). Products
// accumulate in float32; y is rounded once, after the add.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <vector>

#include "linear.h"
#include "vec.h"

namespace llmkit_cpu {

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
              lora_b.size(1) == y.size(1) && lora_b.scalar_type() == x.scalar_type(),
              "lora_add_: lora_b must be [slots, out, R] contiguous, of x's dtype");
  const int64_t num_shards = static_cast<int64_t>(out_offsets.size()) - 1;
  TORCH_CHECK(num_shards >= 1 && out_offsets[0] == 0 && out_offsets[num_shards] == y.size(1),
              "lora_add_: out_offsets must run from 0 to out");
  const int64_t R = lora_b.size(2);
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
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(slot_of[r] < num_slots, "lora_add_: row ", r, " names slot ", slot_of[r],
                " of ", num_slots);
  std::vector<int64_t> offs(out_offsets.begin(), out_offsets.end());
  LLMKIT_DISPATCH_FLOAT(x.scalar_type(), "lora_add_", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* ap = lora_a.const_data_ptr<scalar_t>();
    const scalar_t* bp = lora_b.const_data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    std::vector<float> xf(rows * k);
    for (int64_t r = 0; r < rows; ++r) {
      if (slot_of[r] < 0) continue;
      for (int64_t i = 0; i < k; ++i) xf[r * k + i] = static_cast<float>(xp[r * x.stride(0) + i]);
    }
    // shrink: t[r, s*R + j] = x[r] . A[slot, s*R + j]
    std::vector<float> t(rows * SR, 0.f);
    at::parallel_for(0, rows * SR, std::max<int64_t>(1, 16384 / k), [&](int64_t b, int64_t e) {
      for (int64_t item = b; item < e; ++item) {
        const int64_t r = item / SR, s = (item % SR) / R, j = item % R;
        const int32_t slot = slot_of[r];
        if (slot < 0 || j >= rank_of[slot * num_shards + s]) continue;
        t[item] = dot1(xf.data() + r * k, ap + (slot * SR + s * R + j) * k, k);
      }
    });
    // expand: y[r, o] += t[r, s*R : s*R + rank] . B[slot, o, :rank]
    at::parallel_for(0, n_out, std::max<int64_t>(1, 4096 / std::max<int64_t>(1, rows * R)),
                     [&](int64_t b, int64_t e) {
      int64_t s = 0;
      while (offs[s + 1] <= b) ++s;
      for (int64_t o = b; o < e; ++o) {
        while (offs[s + 1] <= o) ++s;
        for (int64_t r = 0; r < rows; ++r) {
          const int32_t slot = slot_of[r];
          if (slot < 0) continue;
          const int32_t rank = rank_of[slot * num_shards + s];
          if (rank == 0) continue;
          const float d = dot1(t.data() + r * SR + s * R, bp + (slot * n_out + o) * R, rank);
          scalar_t& out = yp[r * y.stride(0) + o];
          out = static_cast<scalar_t>(static_cast<float>(out) + d);
        }
      }
    });
  });
}

}  // namespace llmkit_cpu
