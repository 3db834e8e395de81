// The quantized KV cache rows (llmkit.kernels.kv_quant has the format and its torch reference):
// a row is one token's K or V of one KV head, `dim` one-byte codes then the row's float32 scale
// (4 bytes). int8 caches hold int8 codes, uint8 caches e4m3fn bytes. The numerics are the
// reference's step for step: scale = amax / qmax; code = rne(clamp(x / scale)) (int8) or
// e4m3fn(clamp(x / scale)) (c10's conversion, torch's); value = float(code) * scale.
// Also the plain float rows of a cache whose dtype differs from the model's (bf16 KV under a
// float32 model): converted on write and read.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace llmkit_cpu {

constexpr int64_t kScaleBytes = 4;

enum class KVRows { kInt8, kFp8E4M3, kFloat32, kBFloat16, kFloat16 };

// The row format a cache tensor holds (its dtype says it).
inline KVRows kv_rows_of(const at::Tensor& kv_cache) {
  switch (kv_cache.scalar_type()) {
    case at::kChar: return KVRows::kInt8;
    case at::kByte: return KVRows::kFp8E4M3;
    case at::kFloat: return KVRows::kFloat32;
    case at::kBFloat16: return KVRows::kBFloat16;
    case at::kHalf: return KVRows::kFloat16;
    default:
      TORCH_CHECK(false, "KV cache of dtype ", kv_cache.scalar_type(), " is not supported "
                  "(float32, bfloat16, float16, int8 or uint8 = fp8 e4m3 codes)");
  }
}

inline bool is_quantized(KVRows f) { return f == KVRows::kInt8 || f == KVRows::kFp8E4M3; }

// Elements of a cache row for a head of `dim` values.
inline int64_t row_width(KVRows f, int64_t dim) { return is_quantized(f) ? dim + kScaleBytes : dim; }

// src [dim] -> one cache row at dst.
template <typename T>
inline void write_row(const T* src, int64_t dim, KVRows f, void* dst) {
  if (!is_quantized(f)) {
    for (int64_t d = 0; d < dim; ++d) {
      const float x = static_cast<float>(src[d]);
      if (f == KVRows::kFloat32) static_cast<float*>(dst)[d] = x;
      else if (f == KVRows::kBFloat16) static_cast<c10::BFloat16*>(dst)[d] = c10::BFloat16(x);
      else static_cast<c10::Half*>(dst)[d] = c10::Half(x);
    }
    return;
  }
  float amax = 0.f;
  for (int64_t d = 0; d < dim; ++d) amax = std::max(amax, std::abs(static_cast<float>(src[d])));
  const float qmax = f == KVRows::kInt8 ? 127.f : 448.f;
  const float scale = amax / qmax;
  const float div = scale > 0.f ? scale : 1.f;
  uint8_t* out = static_cast<uint8_t*>(dst);
  for (int64_t d = 0; d < dim; ++d) {
    const float y = std::min(std::max(static_cast<float>(src[d]) / div, -qmax), qmax);
    if (f == KVRows::kInt8)
      out[d] = static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(y)));
    else
      out[d] = c10::Float8_e4m3fn(y).x;
  }
  std::memcpy(out + dim, &scale, sizeof(float));
}

// One cache row at src -> float32 [dim].
inline void read_row(const void* src, int64_t dim, KVRows f, float* dst) {
  switch (f) {
    case KVRows::kInt8: {
      const int8_t* c = static_cast<const int8_t*>(src);
      float s;
      std::memcpy(&s, c + dim, sizeof(float));
      for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<float>(c[d]) * s;
      return;
    }
    case KVRows::kFp8E4M3: {
      // e4m3fn -> float32 through float16, exactly: a code's exponent+mantissa shifted left
      // by 7 is a float16 of the code's value times 2**-8 (subnormals included), widened
      // by F16C 8 at a time; the 2**8 goes into the scale (a power of two: the product
      // rounds once, as code * scale does). No NaN codes (writes clamp to +-448); tests
      // check all 256 codes against torch's conversion.
      const uint8_t* c = static_cast<const uint8_t*>(src);
      float s;
      std::memcpy(&s, c + dim, sizeof(float));
      const float s8 = s * 256.f;
      int64_t d = 0;
#if defined(CPU_CAPABILITY_AVX2)
      const __m256 vs = _mm256_set1_ps(s8);
      for (; d + 8 <= dim; d += 8) {
        const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + d)));
        const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7),
                                       _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8));
        _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_cvtph_ps(h), vs));
      }
#endif
      for (; d < dim; ++d) {
        const uint16_t h = static_cast<uint16_t>(((c[d] & 0x7Fu) << 7) | ((c[d] & 0x80u) << 8));
        dst[d] = static_cast<float>(c10::Half(h, c10::Half::from_bits())) * s8;
      }
      return;
    }
    case KVRows::kFloat32:
      std::memcpy(dst, src, dim * sizeof(float));
      return;
    case KVRows::kBFloat16: {
      const c10::BFloat16* c = static_cast<const c10::BFloat16*>(src);
      for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<float>(c[d]);
      return;
    }
    case KVRows::kFloat16: {
      const c10::Half* c = static_cast<const c10::Half*>(src);
      for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<float>(c[d]);
      return;
    }
  }
}

}  // namespace llmkit_cpu
