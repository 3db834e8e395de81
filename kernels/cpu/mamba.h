// Mamba-2's selective-state update for one token per row (decode), in place on each row's
// state block: state = state * exp(dt A) + (dt B) x, y = state . C + D x, with
// dt = clamp(softplus(dt_raw + dt_bias), dt_min, dt_max) (the torch reference:
// llmkit/ops/mamba.py ssm_state_update). One pass over the state instead of the reference's
// gather, five elementwise ops, scatter and bmm. Float32 throughout (the state is float32;
// the caller widens a bf16 model's inputs, a few hundred values a row).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>

#include "thread_pool.h"

namespace llmkit_cpu {

// torch's softplus (beta 1, threshold 20): x above the threshold passes unchanged.
inline float softplus_f(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }

// x [R, H, P], dt [R, H], B/C [R, G, N], A/D/dt_bias [H] (all float32, contiguous);
// ssm_state [num_blocks, H, P, N] float32, contiguous within a block (any block stride);
// state_indices [R] int64. Returns y [R, H, P] float32.
inline at::Tensor ssm_state_update(const at::Tensor& x, const at::Tensor& dt,
                                   const at::Tensor& A, const at::Tensor& B,
                                   const at::Tensor& C, const at::Tensor& D,
                                   const at::Tensor& dt_bias, at::Tensor& ssm_state,
                                   const at::Tensor& state_indices, double dt_min,
                                   double dt_max) {
  for (const at::Tensor* t : {&x, &dt, &A, &B, &C, &D, &dt_bias}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat, "ssm_state_update: float32 tensors only");
    TORCH_CHECK(t->is_contiguous(), "ssm_state_update: contiguous inputs only");
  }
  TORCH_CHECK(ssm_state.scalar_type() == at::kFloat, "ssm_state_update: a float32 state only");
  TORCH_CHECK(state_indices.scalar_type() == at::kLong, "ssm_state_update: int64 indices");
  const int64_t rows = x.size(0), heads = x.size(1), hdim = x.size(2);
  const int64_t groups = B.size(1), dstate = B.size(2);
  TORCH_CHECK(ssm_state.dim() == 4 && ssm_state.size(1) == heads &&
                  ssm_state.size(2) == hdim && ssm_state.size(3) == dstate,
              "ssm_state_update: state must be [blocks, heads, head_dim, d_state]");
  TORCH_CHECK(ssm_state.stride(3) == 1 && ssm_state.stride(2) == dstate &&
                  ssm_state.stride(1) == hdim * dstate,
              "ssm_state_update: a block's state must be contiguous");
  TORCH_CHECK(heads % groups == 0, "ssm_state_update: heads must be a multiple of groups");
  const int64_t per_group = heads / groups, block_stride = ssm_state.stride(0);
  const int64_t num_blocks = ssm_state.size(0);
  at::Tensor y = at::empty({rows, heads, hdim}, x.options());
  const float* xp = x.const_data_ptr<float>();
  const float* dtp = dt.const_data_ptr<float>();
  const float* ap = A.const_data_ptr<float>();
  const float* bp = B.const_data_ptr<float>();
  const float* cp = C.const_data_ptr<float>();
  const float* dp = D.const_data_ptr<float>();
  const float* biasp = dt_bias.const_data_ptr<float>();
  const int64_t* idx = state_indices.const_data_ptr<int64_t>();
  float* sp = ssm_state.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(idx[r] >= 0 && idx[r] < num_blocks, "ssm_state_update: block ", idx[r],
                " outside the state of ", num_blocks);
  const float lo = static_cast<float>(dt_min), hi = static_cast<float>(dt_max);
  const bool clamp = lo > 0.f || std::isfinite(hi);
  llmkit_cpu::parallel_for(0, rows * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t rh = begin; rh < end; ++rh) {
      const int64_t r = rh / heads, h = rh % heads, g = h / per_group;
      float d = softplus_f(dtp[rh] + biasp[h]);
      if (clamp) d = std::min(std::max(d, lo), hi);
      const float decay = std::exp(d * ap[h]);
      const float* b = bp + (r * groups + g) * dstate;
      const float* c = cp + (r * groups + g) * dstate;
      float* state = sp + idx[r] * block_stride + h * hdim * dstate;
      const float* xr = xp + rh * hdim;
      float* yr = yp + rh * hdim;
      for (int64_t p = 0; p < hdim; ++p) {
        float* s = state + p * dstate;
        const float xv = xr[p];
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t n = 0; n < dstate; ++n) {
          const float v = s[n] * decay + (d * b[n]) * xv;
          s[n] = v;
          acc += v * c[n];
        }
        yr[p] = acc + xv * dp[h];
      }
    }
  });
  return y;
}

}  // namespace llmkit_cpu
