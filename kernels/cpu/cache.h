// Writes a step's new K and V rows into the paged cache at their slots (slot = block *
// block_size + offset); slot -1 marks a token whose K/V is not kept (skipped). Into a cache of
// the keys' dtype rows are copied; into another (int8/fp8 codes, or another float type) each
// row is quantized or converted on the way (kv_quant.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstring>

#include "kv_quant.h"
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

// A cache of another dtype than key's: each row converted, or quantized with its scale
// (kv_quant.h), one row per (token, KV head).
template <typename T, typename I>
inline void convert_rows(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                         const I* slots) {
  const int64_t tokens = key.size(0), heads = key.size(1), dim = key.size(2);
  const KVRows f = kv_rows_of(kv_cache);
  const int64_t width = kv_cache.size(4), es = kv_cache.element_size();
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  char* kc = static_cast<char*>(kv_cache.data_ptr());
  char* vc = kc + num_slots * heads * width * es;
  const T* kp = key.const_data_ptr<T>();
  const T* vp = value.const_data_ptr<T>();
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t slot = static_cast<int64_t>(slots[t]);
    if (slot < 0) continue;
    TORCH_CHECK(slot < num_slots, "reshape_and_cache: slot ", slot, " outside the cache of ",
                num_slots);
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t at = (slot * heads + h) * width * es;
      write_row(kp + t * key.stride(0) + h * key.stride(1), dim, f, kc + at);
      write_row(vp + t * value.stride(0) + h * value.stride(1), dim, f, vc + at);
    }
  }
}

// key, value [tokens, kv_heads, head_dim] (contiguous head_dim), kv_cache [2, num_blocks,
// block_size, kv_heads, width] contiguous (width = head_dim, or head_dim + 4 for the rows of
// a quantized cache: kv_quant.h), slot_mapping [tokens] int32/int64.
inline void reshape_and_cache(const at::Tensor& key, const at::Tensor& value,
                              at::Tensor& kv_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && key.stride(2) == 1 && value.sizes() == key.sizes() &&
              value.stride(2) == 1 && value.scalar_type() == key.scalar_type(),
              "reshape_and_cache: key and value must be [tokens, kv_heads, head_dim] of one "
              "dtype with a contiguous head_dim");
  const bool as_is = kv_cache.scalar_type() == key.scalar_type();
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() == 5 && kv_cache.size(0) == 2 &&
              kv_cache.size(3) == key.size(1) &&
              kv_cache.size(4) == (as_is ? key.size(2)
                                         : row_width(kv_rows_of(kv_cache), key.size(2))),
              "reshape_and_cache: kv_cache must be [2, blocks, block_size, kv_heads, head_dim] "
              "(head_dim + 4 for a quantized cache)");
  TORCH_CHECK(slot_mapping.is_contiguous() && slot_mapping.numel() == key.size(0),
              "reshape_and_cache: slot_mapping must be [tokens]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong || slot_mapping.scalar_type() == at::kInt,
              "reshape_and_cache: slot_mapping must be int32 or int64");
  const bool i64 = slot_mapping.scalar_type() == at::kLong;
  if (as_is) {
    if (i64) copy_rows(key, value, kv_cache, slot_mapping.const_data_ptr<int64_t>());
    else copy_rows(key, value, kv_cache, slot_mapping.const_data_ptr<int32_t>());
    return;
  }
  LLMKIT_DISPATCH_FLOAT(key.scalar_type(), "reshape_and_cache", [&] {
    if (i64) convert_rows<scalar_t>(key, value, kv_cache, slot_mapping.const_data_ptr<int64_t>());
    else convert_rows<scalar_t>(key, value, kv_cache, slot_mapping.const_data_ptr<int32_t>());
  });
}

}  // namespace llmkit_cpu
