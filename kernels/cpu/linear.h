// y = x W^T + b for a few rows of x (decoding at small batch): the weight streams from memory
// once, four output features at a time, in its own dtype (bf16 weights are widened to float32
// in registers, so a bf16 model reads half the bytes of a float32 copy). Products accumulate in
// float32 per output, like torch's GEMV; the result is rounded once to x's dtype.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>

#include <functional>
#include <type_traits>
#include <vector>

#include "thread_pool.h"
#include "tuning.h"
#include "vec.h"

namespace llmkit_cpu {

// Four outputs (rows w0..w3 of W) for one input row xf (float32, length k).
template <typename T>
inline void dot4(const float* xf, const T* w0, int64_t ws, int64_t k, float* out,
                 bool prefetch_next) {
  const T* w1 = w0 + ws;
  const T* w2 = w1 + ws;
  const T* w3 = w2 + ws;
  Vec a0(0.f), a1(0.f), a2(0.f), a3(0.f);
  int64_t i = 0;
  for (; i + kLanes <= k; i += kLanes) {
    if (prefetch_next) {
      // The next tile's rows while this one computes: DRAM streams at full rate only with
      // enough requests in flight.
      __builtin_prefetch(w0 + 4 * ws + i);
      __builtin_prefetch(w1 + 4 * ws + i);
      __builtin_prefetch(w2 + 4 * ws + i);
      __builtin_prefetch(w3 + 4 * ws + i);
    }
    const Vec xv = load(xf + i);
    a0 = at::vec::fmadd(xv, load(w0 + i), a0);
    a1 = at::vec::fmadd(xv, load(w1 + i), a1);
    a2 = at::vec::fmadd(xv, load(w2 + i), a2);
    a3 = at::vec::fmadd(xv, load(w3 + i), a3);
  }
  if (i < k) {
    const int64_t n = k - i;
    const Vec xv = load(xf + i, n);
    a0 = at::vec::fmadd(xv, load(w0 + i, n), a0);
    a1 = at::vec::fmadd(xv, load(w1 + i, n), a1);
    a2 = at::vec::fmadd(xv, load(w2 + i, n), a2);
    a3 = at::vec::fmadd(xv, load(w3 + i, n), a3);
  }
  out[0] = lane_sum(a0);
  out[1] = lane_sum(a1);
  out[2] = lane_sum(a2);
  out[3] = lane_sum(a3);
}

// dot4 for two input rows at once (float32 weights): each weight vector is loaded once for
// both, which keeps a few rows of decoding bound by memory rather than by those loads. Per
// (weight row, input row) the same order as dot4, so a row's outputs do not depend on whether
// it was paired.
template <typename T>
inline void dot4_rows2(const float* x0, const float* x1, const T* w0, int64_t k, float* out0,
                       float* out1, bool prefetch_next) {
  const T* w1 = w0 + k;
  const T* w2 = w1 + k;
  const T* w3 = w2 + k;
  Vec a0(0.f), a1(0.f), a2(0.f), a3(0.f), b0(0.f), b1(0.f), b2(0.f), b3(0.f);
  int64_t i = 0;
  for (; i + kLanes <= k; i += kLanes) {
    if (prefetch_next && ((i * int64_t(sizeof(T))) & 63) == 0) {
      __builtin_prefetch(w0 + 4 * k + i);
      __builtin_prefetch(w1 + 4 * k + i);
      __builtin_prefetch(w2 + 4 * k + i);
      __builtin_prefetch(w3 + 4 * k + i);
    }
    const Vec xa = load(x0 + i), xb = load(x1 + i);
    Vec w = load(w0 + i);
    a0 = at::vec::fmadd(xa, w, a0);
    b0 = at::vec::fmadd(xb, w, b0);
    w = load(w1 + i);
    a1 = at::vec::fmadd(xa, w, a1);
    b1 = at::vec::fmadd(xb, w, b1);
    w = load(w2 + i);
    a2 = at::vec::fmadd(xa, w, a2);
    b2 = at::vec::fmadd(xb, w, b2);
    w = load(w3 + i);
    a3 = at::vec::fmadd(xa, w, a3);
    b3 = at::vec::fmadd(xb, w, b3);
  }
  if (i < k) {
    const int64_t n = k - i;
    const Vec xa = load(x0 + i, n), xb = load(x1 + i, n);
    Vec w = load(w0 + i, n);
    a0 = at::vec::fmadd(xa, w, a0);
    b0 = at::vec::fmadd(xb, w, b0);
    w = load(w1 + i, n);
    a1 = at::vec::fmadd(xa, w, a1);
    b1 = at::vec::fmadd(xb, w, b1);
    w = load(w2 + i, n);
    a2 = at::vec::fmadd(xa, w, a2);
    b2 = at::vec::fmadd(xb, w, b2);
    w = load(w3 + i, n);
    a3 = at::vec::fmadd(xa, w, a3);
    b3 = at::vec::fmadd(xb, w, b3);
  }
  out0[0] = lane_sum(a0);
  out0[1] = lane_sum(a1);
  out0[2] = lane_sum(a2);
  out0[3] = lane_sum(a3);
  out1[0] = lane_sum(b0);
  out1[1] = lane_sum(b1);
  out1[2] = lane_sum(b2);
  out1[3] = lane_sum(b3);
}

// How far ahead of the rows being read the weight is prefetched (tuning::prefetch_bytes, in
// bytes of its contiguous stream; 0: not at all). The hardware prefetchers stop at 4 KiB pages
// and ramp up slowly on each of the ~120 short streams a decode step reads; requesting both
// cache lines of every 64-element block ahead sped a decode step's linears up
// (docs/cpu-speed.md has the figures). The platform times the distance per machine.

// The pairwise tree over dot_torch_order's eight accumulators (into acc[0]).
inline void torch_order_tree(Vec* acc) {
  for (int offset = 4; offset >= 1; offset /= 2)
    for (int r = 0; r < offset; ++r) acc[r] = acc[r] + acc[offset + r];
}

// The rest of dot_torch_order given its eight accumulators: the tree, the lane reduction,
// the tail.
template <typename T>
inline float torch_order_finish(Vec* acc, const float* xf, const T* w, int64_t k) {
  torch_order_tree(acc);
  float sum = at::vec::vec_reduce_all<float>(std::plus<Vec>(), acc[0]);
  const int64_t chunks = k & ~int64_t(15);
  Vec tail(0.f);
  for (int64_t j = k & ~int64_t(63); j < chunks; j += 16) {
    tail = at::vec::fmadd(load(xf + j), load(w + j), tail);
    tail = at::vec::fmadd(load(xf + j + 8), load(w + j + 8), tail);
  }
  sum += at::vec::vec_reduce_all<float>(std::plus<Vec>(), tail);
  for (int64_t j = chunks; j < k; ++j) sum += xf[j] * static_cast<float>(w[j]);
  return sum;
}

// Prefetches run the tuned distance ahead while below ``prefetch_end`` (nullptr: none).
inline void prefetch_ahead(const void* at, const char* prefetch_end) {
  const int64_t distance = tuning::prefetch_bytes();
  const char* ahead = static_cast<const char*>(at) + distance;
  if (prefetch_end != nullptr && distance > 0 && ahead < prefetch_end) {
    __builtin_prefetch(ahead);
    __builtin_prefetch(ahead + 64);
  }
}

#if defined(LLMKIT_AVX512)
// dot_torch_order of a bf16 row in 512-bit registers: accumulators 2q and 2q + 1 are the low
// and high halves of register q. Each lane runs the same chain of fused multiply-adds over the
// same elements in the same order, so the bits are dot_torch_order's with half the
// instructions (at one row the 256-bit loop's loads, widenings and FMAs, not the memory, set
// the pace on a fast AVX-512 core).
inline float dot_torch_order_512(const float* xf, const bf16* w, int64_t k,
                                 const char* prefetch_end) {
  __m512 acc[4];
  for (int q = 0; q < 4; ++q) acc[q] = _mm512_setzero_ps();
  const int64_t main = k & ~int64_t(63);
  for (int64_t j = 0; j < main; j += 64) {
    prefetch_ahead(w + j, prefetch_end);
    for (int q = 0; q < 4; ++q) {
      const __m512 xv = _mm512_loadu_ps(xf + j + 16 * q);
      const __m256i wb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j + 16 * q));
      const __m512 wv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(wb), 16));
      acc[q] = _mm512_fmadd_ps(xv, wv, acc[q]);
    }
  }
  Vec parts[8];
  for (int q = 0; q < 4; ++q) {
    parts[2 * q] = Vec(_mm512_castps512_ps256(acc[q]));
    parts[2 * q + 1] =
        Vec(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[q]), 1)));
  }
  return torch_order_finish(parts, xf, w, k);
}
#endif

// One bf16 weight row's dot product in the order of torch's own bf16 GEMV (ATen's
// ReducedPrecisionFloatGemvFastPathKernel, "dot_with_fp32_arith"): eight float32 accumulators
// over 64-element blocks, element 8r + lane of each block into accumulator r, then a pairwise
// tree over the accumulators and ATen's lane reduction; a tail of whole 16-element chunks into
// one more accumulator, then scalars. Same order, same bits: a bf16 model decoding one row
// gets the linear outputs Hugging Face's bf16 model gets.
template <typename T>
inline float dot_torch_order(const float* xf, const T* w, int64_t k, const char* prefetch_end) {
#if defined(LLMKIT_AVX512)
  if constexpr (std::is_same_v<T, bf16>) return dot_torch_order_512(xf, w, k, prefetch_end);
#endif
  Vec acc[8];
  for (int r = 0; r < 8; ++r) acc[r] = Vec(0.f);
  const int64_t main = k & ~int64_t(63);
  for (int64_t j = 0; j < main; j += 64) {
    prefetch_ahead(w + j, prefetch_end);
    for (int r = 0; r < 8; ++r)
      acc[r] = at::vec::fmadd(load(xf + j + 8 * r), load(w + j + 8 * r), acc[r]);
  }
  return torch_order_finish(acc, xf, w, k);
}

// dot_torch_order for two input rows, each weight vector widened once for both. A row's eight
// accumulators are independent chains over the blocks, so computing them four at a time (two
// passes over the weight row, the second from L1) keeps every sum in torch's order: each row
// gets the bits it gets alone, so a batch of bf16 rows decodes as each would alone.
template <typename T>
inline void dot_torch_order_rows2(const float* x0, const float* x1, const T* w, int64_t k,
                                  const char* prefetch_end, float* out) {
  Vec acc0[8], acc1[8];
  const int64_t main = k & ~int64_t(63);
  for (int half = 0; half < 2; ++half) {
    Vec a0[4], a1[4];
    for (int q = 0; q < 4; ++q) a0[q] = a1[q] = Vec(0.f);
    for (int64_t j = 0; j < main; j += 64) {
      if (half == 0) prefetch_ahead(w + j, prefetch_end);
      for (int q = 0; q < 4; ++q) {
        const int64_t at = j + 8 * (4 * half + q);
        const Vec wv = load(w + at);
        a0[q] = at::vec::fmadd(load(x0 + at), wv, a0[q]);
        a1[q] = at::vec::fmadd(load(x1 + at), wv, a1[q]);
      }
    }
    for (int q = 0; q < 4; ++q) {
      acc0[4 * half + q] = a0[q];
      acc1[4 * half + q] = a1[q];
    }
  }
  out[0] = torch_order_finish(acc0, x0, w, k);
  out[1] = torch_order_finish(acc1, x1, w, k);
}

template <typename T>
inline float dot1(const float* xf, const T* w, int64_t k) {
  Vec a(0.f);
  int64_t i = 0;
  for (; i + kLanes <= k; i += kLanes) a = at::vec::fmadd(load(xf + i), load(w + i), a);
  if (i < k) a = at::vec::fmadd(load(xf + i, k - i), load(w + i, k - i), a);
  return lane_sum(a);
}

// x [rows, in] (contiguous rows), weight [out, in] contiguous, bias [out] or undefined; all of
// one dtype (float32 or bfloat16). Returns [rows, out] in that dtype.
inline at::Tensor linear(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "linear: x must be [rows, in] with contiguous "
              "rows");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(1) == x.size(1) &&
              weight.scalar_type() == x.scalar_type(),
              "linear: weight must be [out, in] contiguous, of x's dtype");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == weight.size(0) &&
                bias->scalar_type() == x.scalar_type(), "linear: bias must be [out] of x's dtype");
  const int64_t rows = x.size(0), k = x.size(1), n_out = weight.size(0);
  auto out = at::empty({rows, n_out}, x.options());
  LLMKIT_DISPATCH_FLOAT(x.scalar_type(), "linear", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* wp = weight.const_data_ptr<scalar_t>();
    const scalar_t* bp = has_bias ? bias->const_data_ptr<scalar_t>() : nullptr;
    scalar_t* op = out.data_ptr<scalar_t>();
    std::vector<float> xf(rows * k);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < k; ++i) xf[r * k + i] = static_cast<float>(xp[r * x.stride(0) + i]);
    // Chunks of whole 4-row tiles; each thread streams its own part of the weight (how many
    // threads share it changes no output: tuning.h).
    const int64_t tiles = (n_out + 3) / 4;
    const int64_t grain = tuning::grain(4 * k * int64_t(sizeof(scalar_t)));
    llmkit_cpu::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
      float acc[8];
      // This thread's part of the weight: prefetching past it would fetch the other's rows.
      const char* prefetch_end =
          reinterpret_cast<const char*>(wp + std::min(end * 4, n_out) * k);
      const auto emit = [&](int64_t r, int64_t o, int64_t n, const float* a) {
        for (int64_t j = 0; j < n; ++j) {
          const float y = bp ? a[j] + static_cast<float>(bp[o + j]) : a[j];
          op[r * n_out + o + j] = static_cast<scalar_t>(y);
        }
      };
      for (int64_t tile = begin; tile < end; ++tile) {
        const int64_t o = tile * 4;
        const int64_t n = std::min<int64_t>(4, n_out - o);
        if constexpr (std::is_same_v<scalar_t, bf16>) {
          // bf16: torch's GEMV order for every row, so decoding matches HF's bits at one row
          // and a row's outputs do not depend on the rest of its batch.
          int64_t r = 0;
          float pair[2];
          for (; r + 2 <= rows; r += 2) {
            for (int64_t j = 0; j < n; ++j) {
              dot_torch_order_rows2(xf.data() + r * k, xf.data() + (r + 1) * k,
                                    wp + (o + j) * k, k, r == 0 ? prefetch_end : nullptr, pair);
              acc[j] = pair[0];
              acc[4 + j] = pair[1];
            }
            emit(r, o, n, acc);
            emit(r + 1, o, n, acc + 4);
          }
          if (r < rows) {
            for (int64_t j = 0; j < n; ++j)
              acc[j] = dot_torch_order(xf.data() + r * k, wp + (o + j) * k, k,
                                       r == 0 ? prefetch_end : nullptr);
            emit(r, o, n, acc);
          }
        } else {
          int64_t r = 0;
          if (n == 4) {
            for (; r + 2 <= rows; r += 2) {
              dot4_rows2(xf.data() + r * k, xf.data() + (r + 1) * k, wp + o * k, k, acc,
                         acc + 4, r == 0 && o + 8 <= n_out);
              emit(r, o, 4, acc);
              emit(r + 1, o, 4, acc + 4);
            }
          }
          for (; r < rows; ++r) {
            const float* xr = xf.data() + r * k;
            if (n == 4) {
              dot4(xr, wp + o * k, k, k, acc, r == 0 && o + 8 <= n_out);
            } else {
              for (int64_t j = 0; j < n; ++j) acc[j] = dot1(xr, wp + (o + j) * k, k);
            }
            emit(r, o, n, acc);
          }
        }
      }
    });
  });
  return out;
}

}  // namespace llmkit_cpu
