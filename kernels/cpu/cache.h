// Writes a step's new K and V rows into the paged cache at their slots (slot = block *
// block_size + offset); slot -1 marks a token whose K/V is not kept (skipped).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstring>

#include "vec.h"

namespace llmkit_cpu {

template <typename I>
inline void copy_rows(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                      const I* slots) {
  const int64_t tokens = key.size(0), heads = key.size(1), dim = key.size(2);
  const int64_t slot_elems = heads * dim;
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  const size_t row_bytes = dim * key.element_size();
  char* kc = static_cast<char*>(kv_cache.data_ptr());
  char* vc = kc + num_slots * slot_elems * key.element_size();
  const char* kp = static_cast<const char*>(key.const_data_ptr());
  const char* vp = static_cast<const char*>(value.const_data_ptr());
  const int64_t es = key.element_size();
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t slot = static_cast<int64_t>(slots[t]);
    if (slot < 0) continue;
    TORCH_CHECK(slot < num_slots, "reshape_and_cache: slot ", slot, " outside the cache of ",
                num_slots);
    for (int64_t h = 0; h < heads; ++h) {
      char* dst = (slot * slot_elems + h * dim) * es + kc;
      std::memcpy(dst, kp + (t * key.stride(0) + h * key.stride(1)) * es, row_bytes);
      std::memcpy(dst + (vc - kc), vp + (t * value.stride(0) + h * value.stride(1)) * es,
                  row_bytes);
    }
  }
}

// key, value [tokens, kv_heads, head_dim] (contiguous head_dim), kv_cache [2, num_blocks,
// block_size, kv_heads, head_dim] contiguous, slot_mapping [tokens] int32/int64.
inline void reshape_and_cache(const at::Tensor& key, const at::Tensor& value,
                              at::Tensor& kv_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && key.stride(2) == 1 && value.sizes() == key.sizes() &&
              value.stride(2) == 1, "reshape_and_cache: key and value must be "
              "[tokens, kv_heads, head_dim] with a contiguous head_dim");
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() == 5 && kv_cache.size(0) == 2 &&
              kv_cache.size(3) == key.size(1) && kv_cache.size(4) == key.size(2) &&
              kv_cache.scalar_type() == key.scalar_type() &&
              value.scalar_type() == key.scalar_type(),
              "reshape_and_cache: kv_cache must be [2, blocks, block_size, kv_heads, head_dim] "
              "of key's dtype");
  TORCH_CHECK(slot_mapping.is_contiguous() && slot_mapping.numel() == key.size(0),
              "reshape_and_cache: slot_mapping must be [tokens]");
  if (slot_mapping.scalar_type() == at::kLong)
    copy_rows(key, value, kv_cache, slot_mapping.const_data_ptr<int64_t>());
  else if (slot_mapping.scalar_type() == at::kInt)
    copy_rows(key, value, kv_cache, slot_mapping.const_data_ptr<int32_t>());
  else
    TORCH_CHECK(false, "reshape_and_cache: slot_mapping must be int32 or int64");
}

}  // namespace llmkit_cpu
