// SiLU-and-mul over a fused gate/up projection: silu(gate) rounded to the dtype, times up
// (rounded again), as torch's F.silu(gate) * up computes it.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include "vec.h"

namespace llmkit_cpu {

template <typename T>
inline Vec silu_mul(const Vec& g, const Vec& u) {
  // torch's own vectorised silu: x / (1 + exp(-x)), exp to 1 ulp (Sleef).
  return round_as<T>(g / (Vec(1.f) + g.neg().exp())) * u;
}

// x [rows, 2d] -> silu(x[:, :d]) * x[:, d:], [rows, d].
inline at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "silu_and_mul: x must be [rows, 2d] with contiguous rows");
  const int64_t rows = x.size(0), d = x.size(1) / 2, xs = x.stride(0);
  auto out = at::empty({rows, d}, x.options());
  LLMKIT_DISPATCH_FLOAT(x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / d), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* g = xp + r * xs;
        const scalar_t* u = g + d;
        scalar_t* o = op + r * d;
        int64_t i = 0;
        for (; i + kLanes <= d; i += kLanes)
          store(o + i, silu_mul<scalar_t>(load(g + i), load(u + i)));
        if (i < d)
          store(o + i, silu_mul<scalar_t>(load(g + i, d - i), load(u + i, d - i)), d - i);
      }
    });
  });
  return out;
}

}  // namespace llmkit_cpu
