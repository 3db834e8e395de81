// Activations quantized to eight bits per 32-input block for the integer dot products of
// quant_linear.h (llama.cpp's Q8_1 with float32 scales): q = round-half-even(x * (127 / amax)),
// d = amax / 127, both in float32 as written (the torch reference computes the same bits);
// besides q and d each block keeps the integer sums of q over each half (the formats centred
// on 8 or 32 subtract them, Q4_1 / Q4_K's minimums multiply d times their total) and s, the
// float32 sum of its inputs (the float-activation kernels' offsets multiply it). Inputs past k
// are zeros.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "quant_blocks.h"
#include "row_split.h"
#include "thread_pool.h"
#include "vec.h"

namespace llmkit_cpu::quant {

struct ActBlock {
  float d;       // the block's scale: amax / 127
  float s;       // the float32 sum of its inputs (in the order of block_sum)
  int16_t b0;    // sum of q over inputs 0..15
  int16_t b1;    // and 16..31
  int32_t sum8;  // 8 * (b0 + b1): what Q4_0's centring subtracts
  float sq;      // d * (b0 + b1): the block's sum of the quantized inputs (minimums multiply it)
};

// The sum of 32 floats in one fixed order (the AVX2 code's): l = (v[l] + v[8+l]) +
// (v[16+l] + v[24+l]) per lane, then ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)).
inline float block_sum(const float* v) {
  float l[8];
  for (int i = 0; i < 8; ++i) l[i] = (v[i] + v[8 + i]) + (v[16 + i] + v[24 + i]);
  return ((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7]));
}

inline void quantize_block_portable(const float* v, int8_t* q, ActBlock* m) {
  float amax = 0.f;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[i]));
  const float id = amax != 0.f ? 127.f / amax : 0.f;
  int b0 = 0, b1 = 0;
  for (int i = 0; i < 32; ++i) {
    q[i] = static_cast<int8_t>(std::nearbyint(v[i] * id));
    (i < 16 ? b0 : b1) += q[i];
  }
  m->d = amax / 127.f;
  m->s = block_sum(v);
  m->b0 = static_cast<int16_t>(b0);
  m->b1 = static_cast<int16_t>(b1);
  m->sum8 = 8 * (b0 + b1);
  m->sq = m->d * static_cast<float>(b0 + b1);
}

#if defined(CPU_CAPABILITY_AVX2)
inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline int hsum_epi32x8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
  return _mm_cvtsi128_si32(s);
}

inline void quantize_block_avx2(const float* v, int8_t* q, ActBlock* m) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 x[4];
  for (int i = 0; i < 4; ++i) x[i] = _mm256_loadu_ps(v + 8 * i);
  const __m256 amax8 = _mm256_max_ps(
      _mm256_max_ps(_mm256_andnot_ps(sign, x[0]), _mm256_andnot_ps(sign, x[1])),
      _mm256_max_ps(_mm256_andnot_ps(sign, x[2]), _mm256_andnot_ps(sign, x[3])));
  const float amax = hmax8(amax8);
  const float id = amax != 0.f ? 127.f / amax : 0.f;
  const __m256 idv = _mm256_set1_ps(id);
  __m256i qi[4];
  for (int i = 0; i < 4; ++i)
    qi[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(x[i], idv),
                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  m->d = amax / 127.f;
  {
    const __m256 l = _mm256_add_ps(_mm256_add_ps(x[0], x[1]), _mm256_add_ps(x[2], x[3]));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, l);
    m->s = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) +
           ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
  }
  m->b0 = static_cast<int16_t>(hsum_epi32x8(_mm256_add_epi32(qi[0], qi[1])));
  m->b1 = static_cast<int16_t>(hsum_epi32x8(_mm256_add_epi32(qi[2], qi[3])));
  m->sum8 = 8 * (m->b0 + m->b1);
  m->sq = m->d * static_cast<float>(m->b0 + m->b1);
  // int32 -> int8 in input order (the packs work within 128-bit halves).
  const __m256i p01 = _mm256_packs_epi32(qi[0], qi[1]);
  const __m256i p23 = _mm256_packs_epi32(qi[2], qi[3]);
  const __m256i p = _mm256_packs_epi16(p01, p23);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}
#endif

// Activations of ``rows`` rows, each padded to ``kp`` inputs: the int8 values, the blocks'
// metadata, and (for the float-activation kernels) the float32 inputs.
struct QuantizedActivations {
  int64_t rows = 0, kp = 0, nb = 0;
  std::vector<int8_t> q;
  std::vector<ActBlock> meta;
  std::vector<float> xf;

  const int8_t* q_row(int64_t i) const { return q.data() + i * kp; }
  const ActBlock* meta_row(int64_t i) const { return meta.data() + i * nb; }
  const float* xf_row(int64_t i) const { return xf.empty() ? nullptr : xf.data() + i * kp; }
};

// x: [rows, k] float32 or bfloat16 with contiguous rows. ``keep_float``: also keep the float32
// inputs (xf) for the float-activation kernels.
inline void quantize_activations(const at::Tensor& x, int64_t kp, bool portable, bool keep_float,
                                 QuantizedActivations& out) {
  const int64_t rows = x.size(0), k = x.size(1);
  out.rows = rows;
  out.kp = kp;
  out.nb = kp / kBlock;
  out.q.resize(rows * kp);
  out.meta.resize(rows * out.nb);
  out.xf.resize(keep_float ? rows * kp : 0);
  LLMKIT_DISPATCH_FLOAT(x.scalar_type(), "quantized linear", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const int64_t stride = x.stride(0);
    llmkit_cpu::parallel_for(0, rows, row_split_grain(kp), [&](int64_t begin, int64_t end) {
      std::vector<float> row(keep_float ? 0 : kp);
      for (int64_t i = begin; i < end; ++i) {
        float* f = keep_float ? out.xf.data() + i * kp : row.data();
        for (int64_t c = 0; c < k; ++c) f[c] = static_cast<float>(xp[i * stride + c]);
        for (int64_t c = k; c < kp; ++c) f[c] = 0.f;
        int8_t* q = out.q.data() + i * kp;
        ActBlock* m = out.meta.data() + i * out.nb;
        for (int64_t b = 0; b < out.nb; ++b) {
#if defined(CPU_CAPABILITY_AVX2)
          if (!portable) {
            quantize_block_avx2(f + b * kBlock, q + b * kBlock, m + b);
            continue;
          }
#endif
          quantize_block_portable(f + b * kBlock, q + b * kBlock, m + b);
        }
      }
    });
  });
}

// Gives back a large batch's buffers (a prefill's) instead of keeping them for the next call.
inline void trim(QuantizedActivations& a) {
  constexpr size_t kKeepBytes = 8 << 20;
  if (a.q.capacity() + a.xf.capacity() * sizeof(float) > kKeepBytes) a = QuantizedActivations();
}

// The op: (q int8 [rows, kp], d float32 [rows, nb], s float32 [rows, nb]) for tests.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_activations_q8(
    const at::Tensor& x, bool portable) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "quantize_activations_q8: x must be [rows, k] "
              "with contiguous rows");
  const int64_t kp = div_up(x.size(1), kBlock) * kBlock;
  QuantizedActivations a;
  quantize_activations(x, kp, portable, false, a);
  auto q = at::empty({a.rows, kp}, x.options().dtype(at::kChar));
  auto d = at::empty({a.rows, a.nb}, x.options().dtype(at::kFloat));
  auto s = at::empty({a.rows, a.nb}, x.options().dtype(at::kFloat));
  std::copy(a.q.begin(), a.q.end(), q.data_ptr<int8_t>());
  for (int64_t i = 0; i < a.rows * a.nb; ++i) {
    d.data_ptr<float>()[i] = a.meta[i].d;
    s.data_ptr<float>()[i] = a.meta[i].s;
  }
  return {q, d, s};
}

}  // namespace llmkit_cpu::quant
