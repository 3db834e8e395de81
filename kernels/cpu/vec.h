// Loads and stores between float32 vectors and a tensor's element type (float or bfloat16).
//
// Every kernel computes in float32 and rounds to the tensor's type exactly where the eager
// torch ops it replaces round (round-to-nearest-even, NaN kept, like c10::BFloat16), so a fused
// kernel gives the bits of the op sequence in Hugging Face's implementation.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>

#include <cstdint>

#if defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace llmkit_cpu {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();
using bf16 = c10::BFloat16;

inline Vec load(const float* p) { return Vec::loadu(p); }
inline Vec load(const float* p, int64_t n) { return Vec::loadu(p, n); }
inline void store(float* p, const Vec& v) { v.store(p); }
inline void store(float* p, const Vec& v, int64_t n) { v.store(p, n); }
inline Vec round_to(const Vec& v, float*) { return v; }

// Partial vectors (row tails) go through a float buffer one element at a time.
inline Vec load(const bf16* p, int64_t n) {
  alignas(32) float tmp[kLanes] = {};
  for (int64_t i = 0; i < n; ++i) tmp[i] = static_cast<float>(p[i]);
  return Vec::loadu(tmp);
}
inline void store(bf16* p, const Vec& v, int64_t n) {
  alignas(32) float tmp[kLanes];
  v.store(tmp);
  for (int64_t i = 0; i < n; ++i) p[i] = bf16(tmp[i]);
}

#if defined(CPU_CAPABILITY_AVX2)
// bfloat16 -> float32 is exact: the 16 bits become the high half of the float.
inline Vec load(const bf16* p) {
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return Vec(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16)));
}
// float32 bits rounded to the nearest even bfloat16, in the high half (NaN -> 0x7fc0).
inline __m256i rounded_bits(const Vec& v) {
  __m256 f = v;
  __m256i u = _mm256_castps_si256(f);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  r = _mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xffff0000u)));
  __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc00000), nan);
}
inline void store(bf16* p, const Vec& v) {
  __m256i hi = _mm256_srli_epi32(rounded_bits(v), 16);
  __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(hi, hi), 0b11011000);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
inline Vec round_to(const Vec& v, bf16*) { return Vec(_mm256_castsi256_ps(rounded_bits(v))); }
#else
inline Vec load(const bf16* p) { return load(p, kLanes); }
inline void store(bf16* p, const Vec& v) { store(p, v, kLanes); }
inline Vec round_to(const Vec& v, bf16*) {
  alignas(32) float tmp[kLanes];
  v.store(tmp);
  for (int64_t i = 0; i < kLanes; ++i) tmp[i] = static_cast<float>(bf16(tmp[i]));
  return Vec::loadu(tmp);
}
#endif

#if defined(LLMKIT_AVX512)
// Sixteen float32 lanes, in the tiers with 512-bit vectors, for element-wise kernels (no sum
// whose order the 8-lane Vec fixes): loads widen, stores round as the 8-lane ones do. The
// masked forms read and write only the lanes in m (the others load as 0).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const bf16* p) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}
inline __m512 load16(const bf16* p, __mmask16 m) {
  const __m256i b = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}
// float32 bits rounded to the nearest even bfloat16, in the high half (NaN -> 0x7fc0).
inline __m512i rounded_bits16(__m512 f) {
  const __m512i u = _mm512_castps_si512(f);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  r = _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q),
                               _mm512_set1_epi32(0x7fc00000));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline __m256i bf16_halves16(__m512 v) {
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded_bits16(v), 16));
}
inline void store16(bf16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_halves16(v));
}
inline void store16(bf16* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, bf16_halves16(v));
}
#endif

// A full vector when n == kLanes (the fast path), else a partial one.
template <typename T>
inline Vec load_n(const T* p, int64_t n) { return n == kLanes ? load(p) : load(p, n); }
template <typename T>
inline void store_n(T* p, const Vec& v, int64_t n) {
  if (n == kLanes) store(p, v); else store(p, v, n);
}

// The sum of a vector's lanes: ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)).
inline float lane_sum(const Vec& v) {
  alignas(32) float l[kLanes];
  v.store(l);
  float s = 0.f;
  for (int64_t i = 0; i < kLanes / 2; i += 2)
    s += (l[i] + l[i + kLanes / 2]) + (l[i + 1] + l[i + 1 + kLanes / 2]);
  return s;
}

// The lane sums of eight vectors, each in the order of ATen's vec_reduce_all for float
// (((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))), computed side by side: out[i] is v[i]'s.
inline Vec lane_sums8_aten_order(const Vec* v) {
#if defined(CPU_CAPABILITY_AVX2)
  // Halves added: s_j = l_j + l_(j+4), two vectors per register.
  __m256 u[4];
  for (int i = 0; i < 4; ++i) {
    const __m256 a = v[2 * i], b = v[2 * i + 1];
    u[i] = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  }
  // t0 = s0 + s2, t1 = s1 + s3.
  const __m256 t01 = _mm256_add_ps(_mm256_shuffle_ps(u[0], u[1], 0x44),
                                   _mm256_shuffle_ps(u[0], u[1], 0xEE));
  const __m256 t23 = _mm256_add_ps(_mm256_shuffle_ps(u[2], u[3], 0x44),
                                   _mm256_shuffle_ps(u[2], u[3], 0xEE));
  // t0 + t1, in the order v0, v2, v4, v6 | v1, v3, v5, v7; then back to v0..v7.
  const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(t01, t23, 0x88),
                                 _mm256_shuffle_ps(t01, t23, 0xDD));
  return Vec(_mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
  alignas(32) float out[kLanes];
  for (int64_t i = 0; i < kLanes; ++i)
    out[i] = at::vec::vec_reduce_all<float>(std::plus<Vec>(), v[i]);
  return Vec::loadu(out);
#endif
}

// ``v`` rounded through the element type T (identity for float).
template <typename T>
inline Vec round_as(const Vec& v) { return round_to(v, static_cast<T*>(nullptr)); }

// Calls ``fn.template operator()<T>()`` with T the C++ type of a float32 or bfloat16 tensor.
#define LLMKIT_DISPATCH_FLOAT(dtype, name, ...)                                          \
  [&] {                                                                                  \
    if ((dtype) == at::kFloat) { using scalar_t = float; return __VA_ARGS__(); }         \
    if ((dtype) == at::kBFloat16) { using scalar_t = c10::BFloat16; return __VA_ARGS__(); } \
    TORCH_CHECK(false, name ": float32 or bfloat16 expected, got ", (dtype));            \
  }()

}  // namespace llmkit_cpu
