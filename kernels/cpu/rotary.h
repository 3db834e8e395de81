// Rotary position embedding in place, neox ("rotate half") layout, as Hugging Face's
// q * cos + rotate_half(q) * sin computes it in the model's dtype: each product rounded, then
// the sum.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <type_traits>

#include "row_split.h"
#include "thread_pool.h"
#include "vec.h"

namespace llmkit_cpu {

// x [tokens, heads, head_dim] (any token/head strides, contiguous head_dim); cos_sin
// [tokens, head_dim] of x's dtype: each token's cos (first half) and sin (second half).
inline void rotary_embedding_(at::Tensor& x, const at::Tensor& cos_sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rotary_embedding_: x must be "
              "[tokens, heads, head_dim] with a contiguous head_dim");
  TORCH_CHECK(cos_sin.is_contiguous() && cos_sin.dim() == 2 && cos_sin.size(0) == x.size(0) &&
              cos_sin.size(1) == x.size(2) && x.size(2) % 2 == 0 &&
              cos_sin.scalar_type() == x.scalar_type(),
              "rotary_embedding_: cos_sin must be [tokens, head_dim] of x's dtype");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  const int64_t ts = x.stride(0), hs = x.stride(1);
  LLMKIT_DISPATCH_FLOAT(x.scalar_type(), "rotary_embedding_", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* cache = cos_sin.const_data_ptr<scalar_t>();
    llmkit_cpu::parallel_for(0, tokens, row_split_grain(heads * dim),
                     [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* cs = cache + t * dim;
        for (int64_t h = 0; h < heads; ++h) {
          scalar_t* p = xp + t * ts + h * hs;
#if defined(LLMKIT_AVX512)
          // sixteen lanes where the tier has them: element-wise, the same bits
          constexpr bool kBf16 = std::is_same_v<scalar_t, bf16>;
          const auto round = [](__m512 v) {
            return kBf16 ? _mm512_castsi512_ps(rounded_bits16(v)) : v;
          };
          for (int64_t i = 0; i < half; i += 16) {
            const int64_t n = std::min<int64_t>(16, half - i);
            const __mmask16 m = static_cast<__mmask16>((1u << n) - 1);
            const __m512 x1 = load16(p + i, m), x2 = load16(p + half + i, m);
            const __m512 c = load16(cs + i, m), s = load16(cs + half + i, m);
            store16(p + i, _mm512_sub_ps(round(_mm512_mul_ps(x1, c)),
                                         round(_mm512_mul_ps(x2, s))), m);
            store16(p + half + i, _mm512_add_ps(round(_mm512_mul_ps(x2, c)),
                                                round(_mm512_mul_ps(x1, s))), m);
          }
#else
          for (int64_t i = 0; i < half; i += kLanes) {
            const int64_t n = std::min<int64_t>(kLanes, half - i);
            Vec x1 = load_n(p + i, n), x2 = load_n(p + half + i, n);
            Vec c = load_n(cs + i, n), s = load_n(cs + half + i, n);
            store_n(p + i, round_as<scalar_t>(x1 * c) - round_as<scalar_t>(x2 * s), n);
            store_n(p + half + i, round_as<scalar_t>(x2 * c) + round_as<scalar_t>(x1 * s), n);
          }
#endif
        }
      }
    });
  });
}

}  // namespace llmkit_cpu
