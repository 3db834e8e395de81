// RMSNorm, and RMSNorm fused with the residual add before it, as Hugging Face's Llama computes
// them: sum of squares in float32, x * rsqrt(mean + eps) rounded to the model's dtype, then
// multiplied by the weight (rounded again).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>

#include "row_split.h"
#include "thread_pool.h"
#include "vec.h"

namespace llmkit_cpu {

// torch's cascade sum (ATen SumKernel.cpp, multi_row_sum): NR interleaved partial sums over
// ``size`` items; every 2^level_power items, level 0 is carried into level 1, and so on.
template <typename Acc, int NR, typename Load>
inline void cascade_partials(int64_t size, const Load& load, Acc* out) {
  constexpr int levels = 4;
  int64_t log2 = 0;
  while ((int64_t(1) << log2) < size) ++log2;
  const int64_t power = std::max<int64_t>(4, log2 / levels);
  const int64_t step = int64_t(1) << power, mask = step - 1;
  Acc acc[levels][NR];
  for (int l = 0; l < levels; ++l)
    for (int k = 0; k < NR; ++k) acc[l][k] = Acc(0.f);
  int64_t i = 0;
  while (i + step <= size) {
    for (int64_t j = 0; j < step; ++j, ++i)
      for (int k = 0; k < NR; ++k) acc[0][k] = acc[0][k] + load(i * NR + k);
    for (int l = 1; l < levels; ++l) {
      for (int k = 0; k < NR; ++k) {
        acc[l][k] = acc[l][k] + acc[l - 1][k];
        acc[l - 1][k] = Acc(0.f);
      }
      if ((i & (mask << (l * power))) != 0) break;
    }
  }
  for (; i < size; ++i)
    for (int k = 0; k < NR; ++k) acc[0][k] = acc[0][k] + load(i * NR + k);
  for (int l = 1; l < levels; ++l)
    for (int k = 0; k < NR; ++k) acc[0][k] = acc[0][k] + acc[l][k];
  for (int k = 0; k < NR; ++k) out[k] = acc[0][k];
}

// torch's row_sum: four interleaved cascades, the leftover items into the first, then the
// four added in order.
template <typename Acc, typename Load>
inline Acc torch_row_sum(int64_t size, const Load& load) {
  Acc partial[4];
  const int64_t size_ilp = size / 4;
  cascade_partials<Acc, 4>(size_ilp, load, partial);
  for (int64_t i = size_ilp * 4; i < size; ++i) partial[0] = partial[0] + load(i);
  for (int k = 1; k < 4; ++k) partial[0] = partial[0] + partial[k];
  return partial[0];
}

// The sum of squares of a row, in the order torch's h.pow(2).sum(-1) adds them (float32
// math): with it, mean and rsqrt -- hence the normalised row -- have the bits of Hugging
// Face's RMSNorm.
template <typename T>
inline float sum_of_squares(const T* x, int64_t n) {
  if (n < kLanes) {
    return torch_row_sum<float>(n, [x](int64_t i) {
      const float v = static_cast<float>(x[i]);
      return v * v;
    });
  }
  const int64_t vecs = n / kLanes;
  const Vec acc = torch_row_sum<Vec>(vecs, [x](int64_t i) {
    const Vec v = load(x + i * kLanes);
    return v * v;
  });
  float sum = 0.f;
  for (int64_t i = vecs * kLanes; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    sum += v * v;
  }
  alignas(32) float lanes[kLanes];
  acc.store(lanes);
  for (int64_t l = 0; l < kLanes; ++l) sum += lanes[l];
  return sum;
}

template <typename T>
inline void rms_norm_row(T* out, const T* x, const T* w, int64_t n, float eps) {
  const float sum = sum_of_squares(x, n);
  const Vec r(1.f / std::sqrt(sum / static_cast<float>(n) + eps));
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    store(out + i, load(w + i) * round_as<T>(load(x + i) * r));
  if (i < n) store(out + i, load(w + i, n - i) * round_as<T>(load(x + i, n - i) * r), n - i);
}

inline void check_rows(const at::Tensor& x, const at::Tensor& weight, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, ": x must be [rows, hidden] with "
              "contiguous rows");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) &&
              weight.scalar_type() == x.scalar_type(), name, ": weight must be [hidden] of x's "
              "dtype");
}

inline int64_t row_grain(int64_t hidden) { return row_split_grain(hidden); }

// out = rms_norm(x) * weight, x [rows, hidden].
inline at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, weight, "rms_norm");
  auto out = at::empty(x.sizes(), x.options());
  const int64_t rows = x.size(0), n = x.size(1), xs = x.stride(0);
  LLMKIT_DISPATCH_FLOAT(x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* wp = weight.const_data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    llmkit_cpu::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        rms_norm_row(op + r * n, xp + r * xs, wp, n, static_cast<float>(eps));
    });
  });
  return out;
}

// residual += x (rounded to the dtype, in place); returns rms_norm(residual) * weight.
inline at::Tensor fused_add_rms_norm(const at::Tensor& x, at::Tensor& residual,
                                     const at::Tensor& weight, double eps) {
  check_rows(x, weight, "fused_add_rms_norm");
  TORCH_CHECK(residual.dim() == 2 && residual.stride(1) == 1 && residual.sizes() == x.sizes() &&
              residual.scalar_type() == x.scalar_type(),
              "fused_add_rms_norm: residual must match x");
  auto out = at::empty(x.sizes(), x.options());
  const int64_t rows = x.size(0), n = x.size(1), xs = x.stride(0), rs = residual.stride(0);
  LLMKIT_DISPATCH_FLOAT(x.scalar_type(), "fused_add_rms_norm", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* wp = weight.const_data_ptr<scalar_t>();
    scalar_t* rp = residual.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    llmkit_cpu::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* res = rp + r * rs;
        const scalar_t* xr = xp + r * xs;
        int64_t i = 0;
        for (; i + kLanes <= n; i += kLanes) store(res + i, load(res + i) + load(xr + i));
        if (i < n) store(res + i, load(res + i, n - i) + load(xr + i, n - i), n - i);
        rms_norm_row(op + r * n, res, wp, n, static_cast<float>(eps));
      }
    });
  });
  return out;
}

}  // namespace llmkit_cpu
