// bf16 decode attention for one KV head's group of query heads in the AVX-512 tiers: bf16 dot
// products straight from the cache's rows (no widened copy), two passes over the context (all
// scores, one max-subtracted softmax, then P.V), K and V each read once for the whole group.
//
// These tiers' own bits (fixed per tier, never timed): q.k sums two bf16 products a float32
// lane (`vdpbf16ps`, emulated by two fused multiply-adds of the widened halves in the tiers
// without AVX512-BF16), each score's sixteen lanes then added in a tree; exp is a degree-6
// polynomial; the probabilities are rounded to bf16 (as SDPA's P) and their float32 sum
// (unrounded, as SDPA's) divides the output. Each head's and each token's arithmetic is its own:
// a row's output does not depend on the batch, on the group split, or on where its context
// lies in the cache. The AVX2 tier keeps torch's flash-SDPA order (decode_head_sdpa_order).
#pragma once

#if defined(LLMKIT_AVX512)

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "vec.h"

namespace llmkit_cpu {
namespace attn512 {

// acc + a.pair * b.pair per float lane, the odd bf16 product first (vdpbf16ps's order).
inline __m512 dot_pairs(__m512 acc, __m512i a, __m512i b) {
#if defined(LLMKIT_AVX512_BF16)
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
#else
  const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(a, hi)),
                        _mm512_castsi512_ps(_mm512_and_si512(b, hi)), acc);
  return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)),
                         _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)), acc);
#endif
}

// Sixteen floats rounded to the nearest even bf16 (NaN kept).
inline __m256i to_bf16(__m512 x) {
#if defined(LLMKIT_AVX512_BF16)
  return (__m256i)_mm512_cvtneps_pbh(x);
#else
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(r);
#endif
}

// exp(x) for x <= 0 (scores minus their maximum): Cephes' expf polynomial on x - n ln 2, scaled
// by 2^n. Below ~-104 it is 0; NaN stays NaN.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-104.f), x);  // max_ps returns its second operand on NaN
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// Lane i of the result: the sum of v[i]'s sixteen lanes (a fixed tree per vector).
inline __m512 lane_sums16(__m512* v) {
  __m512 w[8], u[4], z[2];
  for (int i = 0; i < 8; ++i)  // 256-bit halves
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit quarters: quarter k of u[i] holds v[4i + k]'s four sums
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    z[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
  // lane 4k + j: v[4j + k]'s sum
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88),
                                 _mm512_shuffle_ps(z[0], z[1], 0xDD));
  return _mm512_permutexvar_ps(
      _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}

constexpr int64_t kTile = 16;  // context rows whose scores come out in one vector

// The context's rows lie scattered over the cache (a block's rows of this KV head 1/kv_heads
// of its bytes): their first touch, not the arithmetic, bounds the kernel unless the loads are
// asked for ahead (K a tile ahead into L1 and V into L2 measured best of the variants tried,
// docs/cpu-speed.md). n rows from rows[0], each of bytes bytes.
template <_mm_hint kHint>
inline void prefetch_rows(const bf16* const* rows, int64_t n, int64_t bytes) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t b = 0; b < bytes; b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(rows[t]) + b, kHint);
}

// Scores of kTile rows (krows[0 .. 15]) for one head: (q . k) * scale. C: the head's 32-value
// chunks when known at compile time (0: `chunks`), so that the sixteen rows' short chains of
// dot products are unrolled side by side instead of one row's chain waiting on the previous
// product; each row's chain is the same either way.
template <int C = 0>
inline void score_tile(const __m512i* qv, const bf16* const* krows, int64_t chunks, float scale,
                       float* p) {
  const int64_t n = C > 0 ? C : chunks;
  __m512 acc[kTile];
#pragma GCC unroll 16
  for (int64_t t = 0; t < kTile; ++t) {
    __m512 a = _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int64_t c = 0; c < n; ++c)
      a = dot_pairs(a, _mm512_loadu_si512(krows[t] + 32 * c), qv[c]);
    acc[t] = a;
  }
  _mm512_storeu_ps(p, _mm512_mul_ps(lane_sums16(acc), _mm512_set1_ps(scale)));
}

// score_tile for the common head sizes (64, 128, 256) unrolled, any other through the loop.
inline void score_tile_any(const __m512i* qv, const bf16* const* krows, int64_t chunks,
                           float scale, float* p) {
  switch (chunks) {
    case 2: return score_tile<2>(qv, krows, chunks, scale, p);
    case 4: return score_tile<4>(qv, krows, chunks, scale, p);
    case 8: return score_tile<8>(qv, krows, chunks, scale, p);
    default: return score_tile<0>(qv, krows, chunks, scale, p);
  }
}

// P.V of NG heads over 32 outputs (column c0 .. c0 + 31) of `pairs` pairs of context rows:
// token pairs (t, t + 1) interleaved per output and multiplied by the pair of bf16
// probabilities, added to each head's running sums lo[g], hi[g] (lane order: lo lane 4k + j =
// output 8k + j, hi lane 4k + j = output 8k + 4 + j). pb[g] and vrows start at the first pair.
template <int NG>
inline void pv_pairs(const uint16_t* const* pb, const bf16* const* vrows, int64_t pairs,
                     int64_t c0, __m512* lo, __m512* hi) {
  for (int64_t i = 0; i < pairs; ++i) {
    const __m512i a = _mm512_loadu_si512(vrows[2 * i] + c0);
    const __m512i b = _mm512_loadu_si512(vrows[2 * i + 1] + c0);
    const __m512i l = _mm512_unpacklo_epi16(a, b), h = _mm512_unpackhi_epi16(a, b);
    for (int g = 0; g < NG; ++g) {
      uint32_t pp;
      std::memcpy(&pp, pb[g] + 2 * i, sizeof(pp));
      const __m512i pv = _mm512_set1_epi32(static_cast<int>(pp));
      lo[g] = dot_pairs(lo[g], l, pv);
      hi[g] = dot_pairs(hi[g], h, pv);
    }
  }
}

// A head's two running sums, in output order, at out + c0 .. out + c0 + 31.
inline void pv_store(__m512 lo, __m512 hi, int64_t c0, float* out) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29,
                                           30, 31);
  _mm512_storeu_ps(out + c0, _mm512_permutex2var_ps(lo, first, hi));
  _mm512_storeu_ps(out + c0 + 16, _mm512_permutex2var_ps(lo, second, hi));
}

// P.V of NG heads over 32 outputs of the context's first `pairs` row pairs, from zero.
template <int NG>
inline void pv_chunk(const uint16_t* const* pb, const bf16* const* vrows, int64_t pairs,
                     int64_t c0, float* const* out) {
  __m512 lo[NG], hi[NG];
  for (int g = 0; g < NG; ++g) lo[g] = hi[g] = _mm512_setzero_ps();
  pv_pairs<NG>(pb, vrows, pairs, c0, lo, hi);
  for (int g = 0; g < NG; ++g) pv_store(lo[g], hi[g], c0, out[g]);
}

// One head's scores s[0, len) -> its probabilities: soft cap, the padding rows up to `padded`
// at -inf, the maximum, exp of each score minus it (pb: rounded to bf16); their float32 sum.
inline float softmax_scores(float* s, int64_t len, int64_t padded, float cap, uint16_t* pb) {
  soft_cap_scores(s, len, cap);
  for (int64_t t = len; t < padded; ++t) s[t] = -std::numeric_limits<float>::infinity();
  __m512 m = _mm512_loadu_ps(s);
  for (int64_t t = kTile; t < padded; t += kTile) m = _mm512_max_ps(m, _mm512_loadu_ps(s + t));
  const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m));
  __m512 total = _mm512_setzero_ps();
  for (int64_t t = 0; t < padded; t += kTile) {
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + t), mx));
    total = _mm512_add_ps(total, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + t), to_bf16(e));
  }
  return _mm512_reduce_add_ps(total);
}

// out = acc / sum, rounded to bf16 (dim outputs).
inline void scale_out(const float* acc, float sum, int64_t dim, bf16* out) {
  const __m512 inv = _mm512_set1_ps(1.f / sum);
  for (int64_t d = 0; d < dim; d += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + d),
                        to_bf16(_mm512_mul_ps(_mm512_loadu_ps(acc + d), inv)));
}

}  // namespace attn512

// One KV head's group of query heads over its context. q [group][dim] bf16 (rows qstride
// apart); krows / vrows the context's len rows in order, krows padded to a multiple of 16 rows
// and vrows to a multiple of 2 with more pointers to rows that can be read (their
// probabilities are 0); dim a multiple of 32, at most 512. Scratch: p (group * round_up(len,
// 16) floats), pb (as many bf16), acc (group * dim floats), sums (group floats).
inline void decode_group_bf16_avx512(const bf16* q, int64_t qstride, const bf16* const* krows,
                                     const bf16* const* vrows, int64_t len, float scale,
                                     int64_t dim, int64_t group, float* p, uint16_t* pb,
                                     float* acc, float* sums, bf16* dst, float cap) {
  using namespace attn512;
  if (len == 0) {
    std::fill(dst, dst + group * dim, bf16(0.f));
    return;
  }
  const int64_t chunks = dim / 32, padded = (len + kTile - 1) / kTile * kTile;
  const int64_t row_bytes = dim * static_cast<int64_t>(sizeof(bf16));
  for (int64_t g = 0; g < group; ++g) {
    __m512i qv[16];
    for (int64_t c = 0; c < chunks; ++c) qv[c] = _mm512_loadu_si512(q + g * qstride + 32 * c);
    float* s = p + g * padded;
    for (int64_t t0 = 0; t0 < len; t0 += kTile) {
      if (g == 0) {  // the first head's pass asks for the next tile's K and this tile's V
        if (t0 + kTile < padded) prefetch_rows<_MM_HINT_T0>(krows + t0 + kTile, kTile, row_bytes);
        prefetch_rows<_MM_HINT_T1>(vrows + t0, kTile, row_bytes);
      }
      score_tile_any(qv, krows + t0, chunks, scale, s + t0);
    }
    sums[g] = softmax_scores(s, len, padded, cap, pb + g * padded);
  }
  // P.V, three heads at a time (their V loads and interleaving shared), 32 outputs at a time.
  const int64_t pairs = (len + 1) / 2;
  for (int64_t g0 = 0; g0 < group; g0 += 3) {
    const int64_t ng = std::min<int64_t>(3, group - g0);
    const uint16_t* pbs[3];
    float* outs[3];
    for (int64_t j = 0; j < ng; ++j) {
      pbs[j] = pb + (g0 + j) * padded;
      outs[j] = acc + (g0 + j) * dim;
    }
    for (int64_t c0 = 0; c0 < dim; c0 += 32) {
      if (ng == 3) pv_chunk<3>(pbs, vrows, pairs, c0, outs);
      else if (ng == 2) pv_chunk<2>(pbs, vrows, pairs, c0, outs);
      else pv_chunk<1>(pbs, vrows, pairs, c0, outs);
    }
  }
  for (int64_t g = 0; g < group; ++g) scale_out(acc + g * dim, sums[g], dim, dst + g * dim);
}

// Scratch of decode_rows_bf16_avx512 (kept by a task across its calls).
struct RowsScratch {
  std::vector<float> p, acc, sums;
  std::vector<uint16_t> pb;
  std::vector<__m512i> qv;
  std::vector<__m512> lo, hi;
  std::vector<const bf16*> tail;
};

namespace attn512 {

// pv_pairs for a run-time number of heads (1 .. kRowHeads) whose sums are kept in lo / hi.
constexpr int64_t kRowHeads = 6;  // 12 sums + the V pair in registers

inline void pv_pairs_n(int64_t ng, const uint16_t* const* pb, const bf16* const* vrows,
                       int64_t pairs, int64_t c0, __m512* lo, __m512* hi) {
  switch (ng) {
    case 6: return pv_pairs<6>(pb, vrows, pairs, c0, lo, hi);
    case 5: return pv_pairs<5>(pb, vrows, pairs, c0, lo, hi);
    case 4: return pv_pairs<4>(pb, vrows, pairs, c0, lo, hi);
    case 3: return pv_pairs<3>(pb, vrows, pairs, c0, lo, hi);
    case 2: return pv_pairs<2>(pb, vrows, pairs, c0, lo, hi);
    default: return pv_pairs<1>(pb, vrows, pairs, c0, lo, hi);
  }
}

}  // namespace attn512

// Consecutive query rows of one sequence (a speculative verify step's 1 + K tokens) for one KV
// head's group of query heads: row r attends to the first lens[r] context rows (lens
// non-decreasing), and every K and V row is loaded, and each V pair interleaved, once for all
// rows and heads. Each row gets the bits decode_group_bf16_avx512 gives it alone: a score
// depends only on its q and its K row; each row's softmax runs over its own scores as there;
// its P.V sums add the same pairs in the same order -- the pairs inside every row's context
// together, then the row's own last pairs (its odd row paired with the padding row vrows[0],
// as alone) -- kept exactly in memory between the two.
// q: row r's head g at q + r * qrow + g * qstride; dst: row r at dst + r * drow; krows / vrows
// the longest row's context, padded as decode_group_bf16_avx512's.
inline void decode_rows_bf16_avx512(const bf16* q, int64_t qrow, int64_t qstride,
                                    const bf16* const* krows, const bf16* const* vrows,
                                    const int64_t* lens, int64_t rows, float scale,
                                    int64_t dim, int64_t group, RowsScratch& w, bf16* dst,
                                    int64_t drow, float cap) {
  using namespace attn512;
  for (; rows > 0 && lens[0] == 0; --rows, ++lens, q += qrow, dst += drow)
    std::fill(dst, dst + group * dim, bf16(0.f));  // no context: zeros, as alone
  if (rows == 0) return;
  const int64_t chunks = dim / 32, combos = rows * group, len_max = lens[rows - 1];
  const int64_t pu = (len_max + kTile - 1) / kTile * kTile;
  const int64_t row_bytes = dim * static_cast<int64_t>(sizeof(bf16));
  w.p.resize(combos * pu);
  w.pb.resize(combos * pu);
  w.acc.resize(combos * dim);
  w.sums.resize(combos);
  w.qv.resize(combos * chunks);
  w.lo.resize(combos * chunks);
  w.hi.resize(combos * chunks);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < group; ++g)
      for (int64_t c = 0; c < chunks; ++c)
        w.qv[(r * group + g) * chunks + c] =
            _mm512_loadu_si512(q + r * qrow + g * qstride + 32 * c);
  // Scores, a tile of K rows at a time for every row that reads it.
  for (int64_t t0 = 0; t0 < len_max; t0 += kTile) {
    if (t0 + kTile < pu) prefetch_rows<_MM_HINT_T0>(krows + t0 + kTile, kTile, row_bytes);
    prefetch_rows<_MM_HINT_T1>(vrows + t0, kTile, row_bytes);
    for (int64_t r = rows - 1; r >= 0 && lens[r] > t0; --r)
      for (int64_t g = 0; g < group; ++g) {
        const int64_t c = r * group + g;
        score_tile_any(w.qv.data() + c * chunks, krows + t0, chunks, scale,
                       w.p.data() + c * pu + t0);
      }
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < group; ++g) {
      const int64_t c = r * group + g;
      const int64_t padded = (lens[r] + kTile - 1) / kTile * kTile;  // as alone
      w.sums[c] = softmax_scores(w.p.data() + c * pu, lens[r], padded, cap, w.pb.data() + c * pu);
    }
  // P.V over the pairs inside every row's context, kRowHeads (row, head)s at a time.
  const int64_t shared = lens[0] / 2;
  const uint16_t* pbs[kRowHeads];
  for (int64_t c = 0; c < combos; c += kRowHeads) {
    const int64_t ng = std::min(kRowHeads, combos - c);
    for (int64_t j = 0; j < ng; ++j) pbs[j] = w.pb.data() + (c + j) * pu;
    for (int64_t ci = 0; ci < chunks; ++ci) {
      __m512 lo[kRowHeads], hi[kRowHeads];
      for (int64_t j = 0; j < ng; ++j) lo[j] = hi[j] = _mm512_setzero_ps();
      pv_pairs_n(ng, pbs, vrows, shared, 32 * ci, lo, hi);
      for (int64_t j = 0; j < ng; ++j) {
        w.lo[(c + j) * chunks + ci] = lo[j];
        w.hi[(c + j) * chunks + ci] = hi[j];
      }
    }
  }
  // Each row's own last pairs.
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t extra = (lens[r] + 1) / 2 - shared;
    if (extra <= 0) continue;
    w.tail.resize(2 * extra);
    for (int64_t k = 0; k < 2 * extra; ++k) {
      const int64_t pos = 2 * shared + k;
      w.tail[k] = pos < lens[r] ? vrows[pos] : vrows[0];
    }
    for (int64_t g0 = 0; g0 < group; g0 += kRowHeads) {
      const int64_t ng = std::min(kRowHeads, group - g0), c = r * group + g0;
      for (int64_t j = 0; j < ng; ++j) pbs[j] = w.pb.data() + (c + j) * pu + 2 * shared;
      for (int64_t ci = 0; ci < chunks; ++ci) {
        __m512 lo[kRowHeads], hi[kRowHeads];
        for (int64_t j = 0; j < ng; ++j) {
          lo[j] = w.lo[(c + j) * chunks + ci];
          hi[j] = w.hi[(c + j) * chunks + ci];
        }
        pv_pairs_n(ng, pbs, w.tail.data(), extra, 32 * ci, lo, hi);
        for (int64_t j = 0; j < ng; ++j) {
          w.lo[(c + j) * chunks + ci] = lo[j];
          w.hi[(c + j) * chunks + ci] = hi[j];
        }
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < group; ++g) {
      const int64_t c = r * group + g;
      float* acc = w.acc.data() + c * dim;
      for (int64_t ci = 0; ci < chunks; ++ci)
        pv_store(w.lo[c * chunks + ci], w.hi[c * chunks + ci], 32 * ci, acc);
      scale_out(acc, w.sums[c], dim, dst + r * drow + g * dim);
    }
}

}  // namespace llmkit_cpu

#endif  // LLMKIT_AVX512
