// SiLU-and-mul over a fused gate/up projection: silu(gate) rounded to the dtype, times up
// (rounded again), as torch's F.silu(gate) * up computes it.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <type_traits>

#include "row_split.h"
#include "thread_pool.h"
#include "vec.h"

namespace llmkit_cpu {

template <typename T>
inline Vec silu_mul(const Vec& g, const Vec& u) {
  // torch's own vectorised silu: x / (1 + exp(-x)), exp to 1 ulp (Sleef).
  return round_as<T>(g / (Vec(1.f) + g.neg().exp())) * u;
}

#if defined(LLMKIT_AVX512)
// silu_mul sixteen lanes at a time, in the tiers with 512-bit vectors: the same operations
// lane by lane, so the same bits (element-wise: no sum to reorder). Sleef's 16-lane exp gives
// its 8-lane one's bits for every float32 input (all 2^32 compared on an AVX-512 machine).
inline __m512 silu_mul16_f32(__m512 g, __m512 u, bool round_bf16) {
  const __m512 e = Sleef_expf16_u10(_mm512_xor_ps(g, _mm512_set1_ps(-0.f)));
  __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e));
  if (round_bf16) s = _mm512_castsi512_ps(rounded_bits16(s));
  return _mm512_mul_ps(s, u);
}

// Rows of float or bfloat16: whole vectors, then the tail under a mask (its other lanes 0).
template <typename T>
inline void silu_and_mul_row16(const T* g, const T* u, T* o, int64_t d) {
  constexpr bool kBf16 = std::is_same_v<T, bf16>;
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) store16(o + i, silu_mul16_f32(load16(g + i), load16(u + i), kBf16));
  if (i < d) {
    const __mmask16 m = static_cast<__mmask16>((1u << (d - i)) - 1);
    store16(o + i, silu_mul16_f32(load16(g + i, m), load16(u + i, m), kBf16), m);
  }
}
#endif

// x [rows, 2d] -> silu(x[:, :d]) * x[:, d:], [rows, d].
inline at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "silu_and_mul: x must be [rows, 2d] with contiguous rows");
  const int64_t rows = x.size(0), d = x.size(1) / 2, xs = x.stride(0);
  auto out = at::empty({rows, d}, x.options());
  LLMKIT_DISPATCH_FLOAT(x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    llmkit_cpu::parallel_for(0, rows, row_split_grain(d), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* g = xp + r * xs;
        const scalar_t* u = g + d;
        scalar_t* o = op + r * d;
#if defined(LLMKIT_AVX512)
        silu_and_mul_row16(g, u, o, d);
#else
        int64_t i = 0;
        for (; i + kLanes <= d; i += kLanes)
          store(o + i, silu_mul<scalar_t>(load(g + i), load(u + i)));
        if (i < d)
          store(o + i, silu_mul<scalar_t>(load(g + i, d - i), load(u + i, d - i)), d - i);
#endif
      }
    });
  });
  return out;
}

}  // namespace llmkit_cpu
