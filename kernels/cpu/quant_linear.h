// y = x W^T (+ b) with W kept in a packed quantized layout (quant_blocks.h), for any number of
// rows: one kernel serves decoding (1-8 rows: a GEMV that streams the packed weight once) and
// prefill (a GEMM: each eight-row weight group, a few KiB, stays in L1 while every row of a
// chunk of activations passes over it).
//
// Integer formats (q4_0, q4_1, q4_k, q6_k, q8_0, int8) take the activations quantized to eight
// bits per 32-input block (quant_activation.h) and multiply them with the weights' integers by
// AVX2's u8 x s8 -> i16 pair products (maddubs) and i16 -> i32 pair sums (madd), or VNNI's
// u8 x s8 -> i32 quad sums (vpdpbusd) in the tiers that have it (the same integers); a block's
// integer sum is then scaled in float32 once per block for all eight rows at once; Q4_1's and
// Q4_K's minimums multiply the block's sum of the quantized inputs. So every integer format
// computes the dot product of the exact (GGUF-dequantized) weights with the quantized
// activations, up to float32 rounding -- the activations' rounding then weighs with the weights
// themselves, which are about zero-mean in a block (applying the offsets to the unquantized
// sums instead weighs it with the weights' distance from the offset, measured worse on
// SmolLM2). fp8 takes float32 activations (the weights widen to float32 through fp16,
// exactly). Q4_0/Q4_1 can also take float32 activations (``float_activations``) to compare
// exactness and speed.
//
// Per output the float32 work is one fixed chain of FMAs over the blocks, the same in the AVX2
// and the portable code (``portable``), so both give the same bits.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "amx_quant_linear.h"
#include "linear.h"
#include "quant_activation.h"
#include "quant_blocks.h"
#include "quant_repack.h"
#include "thread_pool.h"
#include "vec.h"

// Fixed-count loops over a tile's rows are unrolled before GCC decides where the arrays of
// accumulators live: otherwise it keeps them in registers *and* stores them every iteration.
#define LLMKIT_UNROLL _Pragma("GCC unroll 16")
// An empty asm that "changes" v: integer adds are associative to GCC, which otherwise turns a
// row's chain of sums into a tree and computes all 32 products of a tile first (spilling them).
#define LLMKIT_KEEP(v) asm("" : "+x"(v))

namespace llmkit_cpu::quant {

// Activation rows per micro-tile: each row keeps its own sums and accumulators in registers
// (the same chain per row at any tile size, so the same bits). AVX-512's 32 vector registers
// hold eight rows' (a speculative verify step at batch 1 is 1 + K rows: one pass over each
// weight group instead of two); AVX2's 16 spill past four.
#if defined(CPU_CAPABILITY_AVX2) && defined(__AVX512VL__)
constexpr int kMaxTileRows = 8;
#else
constexpr int kMaxTileRows = 4;
#endif
constexpr int64_t kRowChunk = 64;   // activation rows that pass over a weight group together

// The activation rows of one micro-tile.
struct TileRows {
  const int8_t* q[kMaxTileRows];
  const ActBlock* meta[kMaxTileRows];
  const float* xf[kMaxTileRows];
};

// Prefetch a packed block's bytes the tuned distance ahead (tuning.h), while below ``end``
// (nullptr: none).
inline void prefetch_block(const uint8_t* p, int64_t bytes, const char* end) {
  const int64_t distance = tuning::prefetch_bytes();
  if (end == nullptr || distance == 0) return;
  const char* ahead = reinterpret_cast<const char*>(p) + distance;
  for (int64_t off = 0; off < bytes && ahead + off < end; off += 64)
    __builtin_prefetch(ahead + off);
}

// ---- portable kernels: the same integer sums and the same float32 FMA chain, per lane ----
namespace portable {

// sum q * qx over a 4-bit block (Q4_0: centred, sum (q - 8) * qx).
inline int q4_isum(const uint8_t (*qs)[kRows][4], int64_t r, const int8_t* xq, const ActBlock& m,
                   bool centre) {
  int s = 0;
  for (int i = 0; i < 32; ++i) s += detail::get_nibble(qs, r, i) * xq[i];
  return centre ? s - m.sum8 : s;
}

inline int q8_isum(const int8_t (*qs)[kRows][4], int64_t r, const int8_t* xq) {
  int s = 0;
  for (int i = 0; i < 32; ++i) s += qs[i / 4][r][i % 4] * xq[i];
  return s;
}

// A 4-bit block with float activations: sum of (q - 8) * x over inputs in the AVX2 code's order
// (for each quad j: inputs 4j..4j+3, then 16+4j..16+4j+3).
inline float q4_fsum(const uint8_t (*qs)[kRows][4], int64_t r, const float* x) {
  float a = 0.f;
  for (int j = 0; j < 4; ++j)
    for (int h = 0; h < 2; ++h)
      for (int t = 0; t < 4; ++t) {
        const int i = 16 * h + 4 * j + t;
        a = std::fma(static_cast<float>(detail::get_nibble(qs, r, i) - 8), x[i], a);
      }
  return a;
}

template <Format F, bool kFloatAct>
void tile(const uint8_t* group, int64_t nbk, int mr, const TileRows& rows, float (*res)[kRows]) {
  for (int i = 0; i < mr; ++i) {
    for (int64_t r = 0; r < kRows; ++r) {
      float acc = 0.f;
      for (int64_t blk = 0; blk < nbk; ++blk) {
        const uint8_t* p = group + blk * static_cast<int64_t>(sizeof(packed_block_t<F>));
        if constexpr (F == Format::Q4_0 || F == Format::Q4_1) {
          const auto* b = reinterpret_cast<const packed_block_t<F>*>(p);
          const ActBlock& m = rows.meta[i][blk];
          const float dw = half_to_float(b->d[r]);
          if constexpr (kFloatAct) {
            // float activations: sum (q - 8) x, the offset m + 8 d on the block's exact sum
            acc = std::fma(dw, q4_fsum(b->qs, r, rows.xf[i] + blk * kBlock), acc);
            if constexpr (F == Format::Q4_1)
              acc = std::fma(half_to_float(b->m[r]) + 8.f * dw, m.s, acc);
          } else {
            const float t = m.d * static_cast<float>(q4_isum(b->qs, r, rows.q[i] + blk * kBlock, m,
                                                             F == Format::Q4_0));
            acc = std::fma(dw, t, acc);
            if constexpr (F == Format::Q4_1) acc = std::fma(half_to_float(b->m[r]), m.sq, acc);
          }
        } else if constexpr (F == Format::Q4_K) {
          const auto* b = reinterpret_cast<const Q4_Kx8*>(p);
          const float d = half_to_float(b->d[r]), dmin = half_to_float(b->dmin[r]);
          for (int s = 0; s < 8; ++s) {
            const ActBlock& m = rows.meta[i][blk * 8 + s];
            const float dw = d * static_cast<float>(b->sc[s][r]);
            const float mn = dmin * static_cast<float>(b->m[s][r]);
            const float t = m.d * static_cast<float>(
                q4_isum(b->qs[s], r, rows.q[i] + (blk * 8 + s) * kBlock, m, false));
            acc = std::fma(dw, t, acc);
            acc = std::fma(-mn, m.sq, acc);
          }
        } else if constexpr (F == Format::Q8_0) {
          const auto* b = reinterpret_cast<const Q8_0x8*>(p);
          const float t = rows.meta[i][blk].d *
                          static_cast<float>(q8_isum(b->qs, r, rows.q[i] + blk * kBlock));
          acc = std::fma(half_to_float(b->d[r]), t, acc);
        } else if constexpr (F == Format::INT8) {
          const auto* b = reinterpret_cast<const I8x8*>(p);
          acc = std::fma(rows.meta[i][blk].d,
                         static_cast<float>(q8_isum(b->qs, r, rows.q[i] + blk * kBlock)), acc);
        } else if constexpr (F == Format::Q6_K) {
          const auto* b = reinterpret_cast<const Q6_Kx8*>(p);
          const float d = half_to_float(b->d[r]);
          for (int s = 0; s < 8; ++s) {
            const int8_t* xq = rows.q[i] + (blk * 8 + s) * kBlock;
            int isum = 0;
            for (int e = 0; e < 32; ++e) {
              const int h = e / 16, u = (e % 16) / 4, t = e % 4;
              const int q = detail::get_nibble(b->ql[s], r, e) |
                            (((b->qh[s][h][r][t] >> (2 * u)) & 3) << 4);
              isum += b->sc[s][r][h] * (q - 32) * xq[e];
            }
            const float t = rows.meta[i][blk * 8 + s].d * static_cast<float>(isum);
            acc = std::fma(d, t, acc);
          }
        } else if constexpr (F == Format::FP8) {
          const auto* b = reinterpret_cast<const F8x8*>(p);
          const float* x = rows.xf[i] + blk * kBlock;
          for (int e = 0; e < 32; ++e)
            acc = std::fma(half_to_float(e4m3_to_half_bits_scaled(b->qs[e][r])), x[e], acc);
        }
      }
      res[i][r] = acc;
    }
  }
}

}  // namespace portable

#if defined(CPU_CAPABILITY_AVX2)
namespace avx2 {

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
inline __m256 half8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 u8x8_to_float(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

#if defined(LLMKIT_VNNI)
// u8 x s8 products summed four at a time into int32 lanes, added to acc (vpdpbusd). The
// operands here never reach maddubs' int16 saturation, so these are exactly the sums of the
// maddubs + madd pairs below: the tiers give the same bits.
inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#endif
}
#endif

// Eight rows' integer sums of one 4-bit block (Q4_0 order) for MR activation rows: isum[i]
// lane r = sum over the block's 32 inputs of q * qx (kCentre: of (q - 8) * qx).
template <int MR, bool kCentre>
inline void q4_isums(const uint8_t* qs, const TileRows& rows, int64_t blk, __m256i* isum) {
  const __m256i mask = _mm256_set1_epi8(0x0F);
#if defined(LLMKIT_VNNI)
  LLMKIT_UNROLL for (int i = 0; i < MR; ++i) isum[i] = _mm256_setzero_si256();
  LLMKIT_UNROLL for (int j = 0; j < 4; ++j) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
    const __m256i lo = _mm256_and_si256(raw, mask);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
    LLMKIT_UNROLL for (int i = 0; i < MR; ++i) {
      const int8_t* xq = rows.q[i] + blk * kBlock;
      isum[i] = dot_u8s8(isum[i], lo, bcast4(xq + 4 * j));
      isum[i] = dot_u8s8(isum[i], hi, bcast4(xq + 16 + 4 * j));
      LLMKIT_KEEP(isum[i]);
    }
  }
  if constexpr (kCentre) {
    LLMKIT_UNROLL for (int i = 0; i < MR; ++i)
      isum[i] = _mm256_sub_epi32(isum[i], _mm256_set1_epi32(rows.meta[i][blk].sum8));
  }
#else
  __m256i s16[MR];
  LLMKIT_UNROLL for (int i = 0; i < MR; ++i) s16[i] = _mm256_setzero_si256();
  LLMKIT_UNROLL for (int j = 0; j < 4; ++j) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
    const __m256i lo = _mm256_and_si256(raw, mask);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
    LLMKIT_UNROLL for (int i = 0; i < MR; ++i) {
      // u4 x s8 pairs stay within +-3810; eight of them within int16.
      const int8_t* xq = rows.q[i] + blk * kBlock;
      s16[i] = _mm256_add_epi16(s16[i], _mm256_maddubs_epi16(lo, bcast4(xq + 4 * j)));
      s16[i] = _mm256_add_epi16(s16[i], _mm256_maddubs_epi16(hi, bcast4(xq + 16 + 4 * j)));
      LLMKIT_KEEP(s16[i]);
    }
  }
  const __m256i ones = _mm256_set1_epi16(1);
  LLMKIT_UNROLL for (int i = 0; i < MR; ++i) {
    [[maybe_unused]] const ActBlock& m = rows.meta[i][blk];
    isum[i] = _mm256_madd_epi16(s16[i], ones);
    if constexpr (kCentre) isum[i] = _mm256_sub_epi32(isum[i], _mm256_set1_epi32(m.sum8));
  }
#endif
}

// Float activations: lane r = sum of (q - 8) * x over the block, in portable::q4_fsum's order.
template <int MR>
inline void q4_fsums(const uint8_t* qs, const TileRows& rows, int64_t blk, __m256* fsum) {
  const __m256i mask = _mm256_set1_epi8(0x0F), byte = _mm256_set1_epi32(0xFF);
  const __m256i eight = _mm256_set1_epi32(8);
  LLMKIT_UNROLL for (int i = 0; i < MR; ++i) fsum[i] = _mm256_setzero_ps();
  LLMKIT_UNROLL for (int j = 0; j < 4; ++j) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
    const __m256i half[2] = {_mm256_and_si256(raw, mask),
                             _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask)};
    LLMKIT_UNROLL for (int h = 0; h < 2; ++h)
      LLMKIT_UNROLL for (int t = 0; t < 4; ++t) {
        const __m256 w = _mm256_cvtepi32_ps(_mm256_sub_epi32(
            _mm256_and_si256(_mm256_srli_epi32(half[h], 8 * t), byte), eight));
        LLMKIT_UNROLL for (int i = 0; i < MR; ++i)
          fsum[i] = _mm256_fmadd_ps(
              w, _mm256_broadcast_ss(rows.xf[i] + blk * kBlock + 16 * h + 4 * j + t), fsum[i]);
      }
  }
}

// Signed int8 weights (eight rows x 32 inputs, quad-major) times int8 activations.
template <int MR>
inline void q8_isums(const int8_t* qs, const TileRows& rows, int64_t blk, __m256i* isum) {
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
  LLMKIT_UNROLL for (int i = 0; i < MR; ++i) isum[i] = _mm256_setzero_si256();
  for (int j = 0; j < 8; ++j) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
    const __m256i aw = _mm256_sign_epi8(w, w);  // |w| (as unsigned: -128 -> 128)
    LLMKIT_UNROLL for (int i = 0; i < MR; ++i) {
      const __m256i sx = _mm256_sign_epi8(bcast4(rows.q[i] + blk * kBlock + 4 * j), w);
#if defined(LLMKIT_VNNI)
      isum[i] = dot_u8s8(isum[i], aw, sx);
#else
      isum[i] = _mm256_add_epi32(isum[i], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), ones));
#endif
      LLMKIT_KEEP(isum[i]);
    }
  }
}

// Q6_K, one 32-input block (two 16-input sub-blocks): lane r = sum of sc * (q - 32) * qx.
template <int MR>
inline void q6_isums(const Q6_Kx8* b, int s, const TileRows& rows, int64_t blk, __m256i* isum) {
  const __m256i mask = _mm256_set1_epi8(0x0F), high = _mm256_set1_epi8(0x30);
  const __m256i pair = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b->sc[s])));
  const __m256i sca = _mm256_shuffle_epi8(pair, _mm256_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13,
                                                                 0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13));
  const __m256i scb = _mm256_shuffle_epi8(pair, _mm256_setr_epi8(2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15,
                                                                 2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15));
  const __m256i h0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qh[s][0]));
  const __m256i h1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qh[s][1]));
  LLMKIT_UNROLL for (int i = 0; i < MR; ++i) isum[i] = _mm256_setzero_si256();
  // Quads j, j+1 at a time: u6 x s8 pairs stay within +-16002, two of them within int16, so
  // each pair of products is scaled by one madd.
  LLMKIT_UNROLL for (int j = 0; j < 4; j += 2) {
    __m256i lo[2], hi[2];
    LLMKIT_UNROLL for (int h = 0; h < 2; ++h) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->ql[s][j + h]));
      // The high bits of quad j+h (bits 2(j+h), 2(j+h)+1 of each byte) moved to bits 4, 5.
      __m256i ha, hb;
      switch (j + h) {
        case 0: ha = _mm256_slli_epi16(h0, 4); hb = _mm256_slli_epi16(h1, 4); break;
        case 1: ha = _mm256_slli_epi16(h0, 2); hb = _mm256_slli_epi16(h1, 2); break;
        case 2: ha = h0; hb = h1; break;
        default: ha = _mm256_srli_epi16(h0, 2); hb = _mm256_srli_epi16(h1, 2); break;
      }
      lo[h] = _mm256_or_si256(_mm256_and_si256(raw, mask), _mm256_and_si256(ha, high));
      hi[h] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), mask),
                              _mm256_and_si256(hb, high));
    }
    LLMKIT_UNROLL for (int i = 0; i < MR; ++i) {
      const int8_t* xq = rows.q[i] + blk * kBlock;
      const __m256i pa = _mm256_add_epi16(_mm256_maddubs_epi16(lo[0], bcast4(xq + 4 * j)),
                                          _mm256_maddubs_epi16(lo[1], bcast4(xq + 4 * j + 4)));
      const __m256i pb = _mm256_add_epi16(_mm256_maddubs_epi16(hi[0], bcast4(xq + 16 + 4 * j)),
                                          _mm256_maddubs_epi16(hi[1], bcast4(xq + 20 + 4 * j)));
      isum[i] = _mm256_add_epi32(isum[i], _mm256_add_epi32(_mm256_madd_epi16(pa, sca),
                                                           _mm256_madd_epi16(pb, scb)));
      LLMKIT_KEEP(isum[i]);
    }
  }
  LLMKIT_UNROLL for (int i = 0; i < MR; ++i) {
    const ActBlock& m = rows.meta[i][blk];
    const int32_t sums = static_cast<int32_t>((static_cast<uint32_t>(static_cast<uint16_t>(m.b1)) << 16) |
                                              static_cast<uint16_t>(m.b0));
    const __m256i offset = _mm256_slli_epi32(_mm256_madd_epi16(pair, _mm256_set1_epi32(sums)), 5);
    isum[i] = _mm256_sub_epi32(isum[i], offset);
  }
}

// acc[i] = fma(dw, d_x * isum[i], acc[i])
template <int MR>
inline void scale_add(const __m256i* isum, __m256 dw, const TileRows& rows, int64_t blk, __m256* acc) {
  LLMKIT_UNROLL for (int i = 0; i < MR; ++i) {
    const __m256 t = _mm256_mul_ps(_mm256_set1_ps(rows.meta[i][blk].d), _mm256_cvtepi32_ps(isum[i]));
    acc[i] = _mm256_fmadd_ps(dw, t, acc[i]);
  }
}
// acc[i] = fma(c, s_x, acc[i]) (float activations: the exact block sums)
template <int MR>
inline void offset_add(__m256 c, const TileRows& rows, int64_t blk, __m256* acc) {
  LLMKIT_UNROLL for (int i = 0; i < MR; ++i) acc[i] = _mm256_fmadd_ps(c, _mm256_set1_ps(rows.meta[i][blk].s), acc[i]);
}
// acc[i] = fma(m, d_x * sum q_x, acc[i]) (a minimum times the quantized inputs' block sum)
template <int MR>
inline void min_add(__m256 m, const TileRows& rows, int64_t blk, __m256* acc) {
  LLMKIT_UNROLL for (int i = 0; i < MR; ++i) acc[i] = _mm256_fmadd_ps(m, _mm256_set1_ps(rows.meta[i][blk].sq), acc[i]);
}

template <Format F, bool kFloatAct, int MR>
void tile(const uint8_t* group, int64_t nbk, const TileRows& rows, float (*res)[kRows],
          const char* prefetch_end) {
  constexpr int64_t bytes = sizeof(packed_block_t<F>);
  __m256 acc[MR];
  LLMKIT_UNROLL for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
  __m256i isum[MR];
  for (int64_t blk = 0; blk < nbk; ++blk) {
    const uint8_t* p = group + blk * bytes;
    prefetch_block(p, bytes, prefetch_end);
    if constexpr (F == Format::Q4_0 || F == Format::Q4_1) {
      const auto* b = reinterpret_cast<const packed_block_t<F>*>(p);
      const __m256 dw = half8(b->d);
      if constexpr (kFloatAct) {
        __m256 fsum[MR];
        q4_fsums<MR>(&b->qs[0][0][0], rows, blk, fsum);
        LLMKIT_UNROLL for (int i = 0; i < MR; ++i) acc[i] = _mm256_fmadd_ps(dw, fsum[i], acc[i]);
        if constexpr (F == Format::Q4_1) {
          const __m256 c = _mm256_fmadd_ps(_mm256_set1_ps(8.f), dw,
                                           half8(b->m));
          offset_add<MR>(c, rows, blk, acc);
        }
      } else {
        q4_isums<MR, F == Format::Q4_0>(&b->qs[0][0][0], rows, blk, isum);
        scale_add<MR>(isum, dw, rows, blk, acc);
        if constexpr (F == Format::Q4_1) min_add<MR>(half8(b->m), rows, blk, acc);
      }
    } else if constexpr (F == Format::Q4_K) {
      const auto* b = reinterpret_cast<const Q4_Kx8*>(p);
      const __m256 d = half8(b->d), dmin = half8(b->dmin);
      for (int s = 0; s < 8; ++s) {
        const __m256 dw = _mm256_mul_ps(d, u8x8_to_float(b->sc[s]));
        const __m256 mn = _mm256_mul_ps(dmin, u8x8_to_float(b->m[s]));
        q4_isums<MR, false>(&b->qs[s][0][0][0], rows, blk * 8 + s, isum);
        scale_add<MR>(isum, dw, rows, blk * 8 + s, acc);
        // acc - mn * sq, as the portable fma(-mn, sq, acc)
        min_add<MR>(_mm256_xor_ps(mn, _mm256_set1_ps(-0.f)), rows, blk * 8 + s, acc);
      }
    } else if constexpr (F == Format::Q8_0) {
      const auto* b = reinterpret_cast<const Q8_0x8*>(p);
      q8_isums<MR>(&b->qs[0][0][0], rows, blk, isum);
      scale_add<MR>(isum, half8(b->d), rows, blk, acc);
    } else if constexpr (F == Format::INT8) {
      const auto* b = reinterpret_cast<const I8x8*>(p);
      q8_isums<MR>(&b->qs[0][0][0], rows, blk, isum);
      LLMKIT_UNROLL for (int i = 0; i < MR; ++i)
        acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(rows.meta[i][blk].d), _mm256_cvtepi32_ps(isum[i]), acc[i]);
    } else if constexpr (F == Format::Q6_K) {
      const auto* b = reinterpret_cast<const Q6_Kx8*>(p);
      const __m256 d = half8(b->d);
      for (int s = 0; s < 8; ++s) {
        q6_isums<MR>(b, s, rows, blk * 8 + s, isum);
        scale_add<MR>(isum, d, rows, blk * 8 + s, acc);
      }
    } else if constexpr (F == Format::FP8) {
      const auto* b = reinterpret_cast<const F8x8*>(p);
      const __m256i sign = _mm256_set1_epi16(0x4000);
      for (int e = 0; e < 32; e += 2) {
        const __m256i t = _mm256_slli_epi16(
            _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b->qs[e]))), 7);
        const __m256i h = _mm256_add_epi16(t, _mm256_and_si256(t, sign));
        const __m256 w0 = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
        const __m256 w1 = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
        LLMKIT_UNROLL for (int i = 0; i < MR; ++i) {
          const float* x = rows.xf[i] + blk * kBlock + e;
          acc[i] = _mm256_fmadd_ps(w0, _mm256_broadcast_ss(x), acc[i]);
          acc[i] = _mm256_fmadd_ps(w1, _mm256_broadcast_ss(x + 1), acc[i]);
        }
      }
    }
  }
  LLMKIT_UNROLL for (int i = 0; i < MR; ++i) _mm256_storeu_ps(res[i], acc[i]);
}

// fp8 prefill: two groups' weights widened once into a float32 tile [kp][16] (exactly the
// values the GEMV path computes), then six activation rows at a time against it: twelve
// independent FMA chains per input, two weight loads and six broadcasts for twelve FMAs. Each
// output's chain is the GEMV's (input by input), so the bits do not depend on the path.
constexpr int kFloatTileRows = 6;

inline void fp8_group_to_float(const uint8_t* group, int64_t nbk, float* tile, int64_t half) {
  const __m256i sign = _mm256_set1_epi16(0x4000);
  for (int64_t blk = 0; blk < nbk; ++blk) {
    const auto* b = reinterpret_cast<const F8x8*>(group + blk * sizeof(F8x8));
    float* t = tile + blk * kBlock * 2 * kRows + half * kRows;
    for (int e = 0; e < 32; e += 2) {
      const __m256i v = _mm256_slli_epi16(
          _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b->qs[e]))), 7);
      const __m256i h = _mm256_add_epi16(v, _mm256_and_si256(v, sign));
      _mm256_storeu_ps(t + e * 2 * kRows, _mm256_cvtph_ps(_mm256_castsi256_si128(h)));
      _mm256_storeu_ps(t + (e + 1) * 2 * kRows, _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
    }
  }
}

template <int MR>
void float_tile(const float* tile, int64_t kp, const float* const* x, float (*res)[2 * kRows]) {
  __m256 acc0[MR], acc1[MR];
  LLMKIT_UNROLL for (int i = 0; i < MR; ++i) acc0[i] = acc1[i] = _mm256_setzero_ps();
  for (int64_t c = 0; c < kp; ++c) {
    const __m256 w0 = _mm256_loadu_ps(tile + c * 2 * kRows);
    const __m256 w1 = _mm256_loadu_ps(tile + c * 2 * kRows + kRows);
    LLMKIT_UNROLL for (int i = 0; i < MR; ++i) {
      const __m256 xb = _mm256_broadcast_ss(x[i] + c);
      acc0[i] = _mm256_fmadd_ps(w0, xb, acc0[i]);
      acc1[i] = _mm256_fmadd_ps(w1, xb, acc1[i]);
    }
  }
  LLMKIT_UNROLL for (int i = 0; i < MR; ++i) {
    _mm256_storeu_ps(res[i], acc0[i]);
    _mm256_storeu_ps(res[i] + kRows, acc1[i]);
  }
}

inline void float_tile_rows(int mr, const float* tile, int64_t kp, const float* const* x,
                            float (*res)[2 * kRows]) {
  switch (mr) {
    case 1: return float_tile<1>(tile, kp, x, res);
    case 2: return float_tile<2>(tile, kp, x, res);
    case 3: return float_tile<3>(tile, kp, x, res);
    case 4: return float_tile<4>(tile, kp, x, res);
    case 5: return float_tile<5>(tile, kp, x, res);
    default: return float_tile<6>(tile, kp, x, res);
  }
}

#if defined(LLMKIT_VNNI) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
// Two weight groups at once (sixteen outputs: group g's eight, then g + 1's) in 512-bit lanes:
// each lane runs exactly the 256-bit tile's operations for its output (the same exact integer
// block sums, the same float32 chain), so the same bits, with half the instructions per row --
// the small-batch linear is bound by them once a few rows share each weight load.
#define LLMKIT_GROUP_PAIRS 1
#define LLMKIT_KEEPV(v) asm("" : "+v"(v))

inline __m512i load_pair(const void* a, const void* b) {
  return _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
}
inline __m512 half16(const uint16_t* a, const uint16_t* b) {
  return _mm512_cvtph_ps(_mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)),
                                          _mm_loadu_si128(reinterpret_cast<const __m128i*>(a))));
}
inline __m512i bcast4_512(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

template <Format F>
constexpr bool kPairFormat = F == Format::Q4_0 || F == Format::Q4_1 || F == Format::Q8_0;

template <Format F, int MR>
void tile_pair(const uint8_t* g0, const uint8_t* g1, int64_t nbk, const TileRows& rows,
               float (*res)[2 * kRows], const char* prefetch_end) {
  constexpr int64_t bytes = sizeof(packed_block_t<F>);
  __m512 acc[MR];
  LLMKIT_UNROLL for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  __m512i isum[MR];
  const __m512i mask = _mm512_set1_epi8(0x0F);
  for (int64_t blk = 0; blk < nbk; ++blk) {
    const uint8_t* p0 = g0 + blk * bytes;
    const uint8_t* p1 = g1 + blk * bytes;
    prefetch_block(p0, bytes, prefetch_end);
    prefetch_block(p1, bytes, prefetch_end);
    const auto* b0 = reinterpret_cast<const packed_block_t<F>*>(p0);
    const auto* b1 = reinterpret_cast<const packed_block_t<F>*>(p1);
    LLMKIT_UNROLL for (int i = 0; i < MR; ++i) isum[i] = _mm512_setzero_si512();
    if constexpr (F == Format::Q4_0 || F == Format::Q4_1) {
      LLMKIT_UNROLL for (int j = 0; j < 4; ++j) {
        const __m512i raw = load_pair(&b0->qs[j][0][0], &b1->qs[j][0][0]);
        const __m512i lo = _mm512_and_si512(raw, mask);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask);
        LLMKIT_UNROLL for (int i = 0; i < MR; ++i) {
          const int8_t* xq = rows.q[i] + blk * kBlock;
          isum[i] = _mm512_dpbusd_epi32(isum[i], lo, bcast4_512(xq + 4 * j));
          isum[i] = _mm512_dpbusd_epi32(isum[i], hi, bcast4_512(xq + 16 + 4 * j));
          LLMKIT_KEEPV(isum[i]);
        }
      }
      if constexpr (F == Format::Q4_0) {
        LLMKIT_UNROLL for (int i = 0; i < MR; ++i)
          isum[i] = _mm512_sub_epi32(isum[i], _mm512_set1_epi32(rows.meta[i][blk].sum8));
      }
    } else {  // Q8_0: |w| x (x with w's sign), as q8_isums (a zero w's product is zero either way)
      const __m512i zero = _mm512_setzero_si512();
      for (int j = 0; j < 8; ++j) {
        const __m512i w = load_pair(&b0->qs[j][0][0], &b1->qs[j][0][0]);
        const __m512i aw = _mm512_abs_epi8(w);  // as unsigned: -128 -> 128
        const __mmask64 neg = _mm512_movepi8_mask(w);
        LLMKIT_UNROLL for (int i = 0; i < MR; ++i) {
          const __m512i x = bcast4_512(rows.q[i] + blk * kBlock + 4 * j);
          isum[i] = _mm512_dpbusd_epi32(isum[i], aw, _mm512_mask_sub_epi8(x, neg, zero, x));
          LLMKIT_KEEPV(isum[i]);
        }
      }
    }
    const __m512 dw = half16(b0->d, b1->d);
    LLMKIT_UNROLL for (int i = 0; i < MR; ++i) {
      const __m512 t = _mm512_mul_ps(_mm512_set1_ps(rows.meta[i][blk].d), _mm512_cvtepi32_ps(isum[i]));
      acc[i] = _mm512_fmadd_ps(dw, t, acc[i]);
    }
    if constexpr (F == Format::Q4_1) {
      const __m512 mw = half16(b0->m, b1->m);
      LLMKIT_UNROLL for (int i = 0; i < MR; ++i)
        acc[i] = _mm512_fmadd_ps(mw, _mm512_set1_ps(rows.meta[i][blk].sq), acc[i]);
    }
  }
  LLMKIT_UNROLL for (int i = 0; i < MR; ++i) _mm512_storeu_ps(res[i], acc[i]);
}

template <Format F>
void run_tile_pair(const uint8_t* g0, const uint8_t* g1, int64_t nbk, int mr, const TileRows& rows,
                   float (*res)[2 * kRows], const char* prefetch_end) {
  switch (mr) {
    case 1: return tile_pair<F, 1>(g0, g1, nbk, rows, res, prefetch_end);
    case 2: return tile_pair<F, 2>(g0, g1, nbk, rows, res, prefetch_end);
    case 3: return tile_pair<F, 3>(g0, g1, nbk, rows, res, prefetch_end);
    case 4: return tile_pair<F, 4>(g0, g1, nbk, rows, res, prefetch_end);
    case 5: return tile_pair<F, 5>(g0, g1, nbk, rows, res, prefetch_end);
    case 6: return tile_pair<F, 6>(g0, g1, nbk, rows, res, prefetch_end);
    case 7: return tile_pair<F, 7>(g0, g1, nbk, rows, res, prefetch_end);
    default: return tile_pair<F, 8>(g0, g1, nbk, rows, res, prefetch_end);
  }
}
#endif

}  // namespace avx2
#endif

template <Format F, bool kFloatAct>
void run_tile(const uint8_t* group, int64_t nbk, int mr, const TileRows& rows,
              float (*res)[kRows], const char* prefetch_end, bool use_portable) {
#if defined(CPU_CAPABILITY_AVX2)
  if (!use_portable) {
    switch (mr) {
      case 1: return avx2::tile<F, kFloatAct, 1>(group, nbk, rows, res, prefetch_end);
      case 2: return avx2::tile<F, kFloatAct, 2>(group, nbk, rows, res, prefetch_end);
      case 3: return avx2::tile<F, kFloatAct, 3>(group, nbk, rows, res, prefetch_end);
#if defined(__AVX512VL__)
      case 4: return avx2::tile<F, kFloatAct, 4>(group, nbk, rows, res, prefetch_end);
      case 5: return avx2::tile<F, kFloatAct, 5>(group, nbk, rows, res, prefetch_end);
      case 6: return avx2::tile<F, kFloatAct, 6>(group, nbk, rows, res, prefetch_end);
      case 7: return avx2::tile<F, kFloatAct, 7>(group, nbk, rows, res, prefetch_end);
      default: return avx2::tile<F, kFloatAct, 8>(group, nbk, rows, res, prefetch_end);
#else
      default: return avx2::tile<F, kFloatAct, 4>(group, nbk, rows, res, prefetch_end);
#endif
    }
  }
#endif
  (void)prefetch_end;
  portable::tile<F, kFloatAct>(group, nbk, mr, rows, res);
}

template <Format F, bool kFloatAct, typename T>
void quant_linear_impl(const QuantizedActivations& a, const uint8_t* packed, int64_t n_out,
                       const float* scales, const T* bias, T* out, bool use_portable) {
  const FormatInfo& info = format_info(F);
  const int64_t nbk = a.kp / info.block_k;
  const int64_t group_stride = nbk * info.group_bytes;
  const int64_t groups = div_up(n_out, kRows);
  const int64_t rows = a.rows;
  bool float_tile = false;
#if defined(CPU_CAPABILITY_AVX2)
  float_tile = F == Format::FP8 && !use_portable && rows > 8;
#endif
  // Threads split the weight into contiguous runs of groups; each streams its own (how many
  // threads share it changes no output: tuning.h).
  const int64_t grain = tuning::grain(group_stride);
  llmkit_cpu::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
    const char* prefetch_end = reinterpret_cast<const char*>(packed + end * group_stride);
    float res[kMaxTileRows][kRows];
    // Row r of group g's results: its scale (int8, fp8) and bias, stored in T.
    const auto emit = [&](int64_t g, int64_t row, const float* v) {
      const int64_t o = g * kRows, n = std::min<int64_t>(kRows, n_out - o);
      T* y = out + row * n_out + o;
      for (int64_t r = 0; r < n; ++r) {
        float t = v[r];
        if (scales != nullptr) t *= F == Format::FP8 ? scales[o + r] * kFp8HalfScale : scales[o + r];
        if (bias != nullptr) t += static_cast<float>(bias[o + r]);
        y[r] = static_cast<T>(t);
      }
    };
#if defined(CPU_CAPABILITY_AVX2)
    if (float_tile) {
      std::vector<float> tile(a.kp * 2 * kRows);
      float fres[avx2::kFloatTileRows][2 * kRows];
      for (int64_t g = begin; g < end; g += 2) {
        const bool pair = g + 1 < end;
        avx2::fp8_group_to_float(packed + g * group_stride, nbk, tile.data(), 0);
        if (pair)
          avx2::fp8_group_to_float(packed + (g + 1) * group_stride, nbk, tile.data(), 1);
        else
          for (int64_t c = 0; c < a.kp; ++c)
            std::fill_n(tile.data() + c * 2 * kRows + kRows, kRows, 0.f);
        for (int64_t i0 = 0; i0 < rows; i0 += avx2::kFloatTileRows) {
          const int mr = static_cast<int>(std::min<int64_t>(avx2::kFloatTileRows, rows - i0));
          const float* x[avx2::kFloatTileRows];
          for (int i = 0; i < mr; ++i) x[i] = a.xf_row(i0 + i);
          avx2::float_tile_rows(mr, tile.data(), a.kp, x, fres);
          for (int i = 0; i < mr; ++i) {
            emit(g, i0 + i, fres[i]);
            if (pair) emit(g + 1, i0 + i, fres[i] + kRows);
          }
        }
      }
      return;
    }
#endif
    for (int64_t mc = 0; mc < rows; mc += kRowChunk) {
      const int64_t mc_end = std::min(rows, mc + kRowChunk);
      for (int64_t g = begin; g < end; ++g) {
        const uint8_t* group = packed + g * group_stride;
#if defined(LLMKIT_GROUP_PAIRS)
        if constexpr (!kFloatAct && avx2::kPairFormat<F>) {
          // (one row streams the weight at memory speed either way: it keeps the 256-bit tile)
          if (!use_portable && rows > 1 && g + 1 < end) {
            float res2[kMaxTileRows][2 * kRows];
            for (int64_t i0 = mc; i0 < mc_end; i0 += kMaxTileRows) {
              const int mr = static_cast<int>(std::min<int64_t>(kMaxTileRows, mc_end - i0));
              TileRows tr;
              for (int i = 0; i < mr; ++i) {
                tr.q[i] = a.q_row(i0 + i);
                tr.meta[i] = a.meta_row(i0 + i);
                tr.xf[i] = a.xf_row(i0 + i);
              }
              avx2::run_tile_pair<F>(group, group + group_stride, nbk, mr, tr, res2,
                                     i0 == 0 ? prefetch_end : nullptr);
              for (int i = 0; i < mr; ++i) {
                emit(g, i0 + i, res2[i]);
                emit(g + 1, i0 + i, res2[i] + kRows);
              }
            }
            ++g;
            continue;
          }
        }
#endif
        for (int64_t i0 = mc; i0 < mc_end; i0 += kMaxTileRows) {
          const int mr = static_cast<int>(std::min<int64_t>(kMaxTileRows, mc_end - i0));
          TileRows tr;
          for (int i = 0; i < mr; ++i) {
            tr.q[i] = a.q_row(i0 + i);
            tr.meta[i] = a.meta_row(i0 + i);
            tr.xf[i] = a.xf_row(i0 + i);
          }
          run_tile<F, kFloatAct>(group, nbk, mr, tr, res, i0 == 0 ? prefetch_end : nullptr,
                                 use_portable);
          for (int i = 0; i < mr; ++i) emit(g, i0 + i, res[i]);
        }
      }
    }
  });
}

template <typename T>
void dispatch_format(Format f, bool float_activations, const QuantizedActivations& a,
                     const uint8_t* packed, int64_t n_out, const float* scales, const T* bias,
                     T* out, bool use_portable) {
  switch (f) {
    case Format::Q4_0:
      if (float_activations)
        return quant_linear_impl<Format::Q4_0, true>(a, packed, n_out, scales, bias, out, use_portable);
      return quant_linear_impl<Format::Q4_0, false>(a, packed, n_out, scales, bias, out, use_portable);
    case Format::Q4_1:
      if (float_activations)
        return quant_linear_impl<Format::Q4_1, true>(a, packed, n_out, scales, bias, out, use_portable);
      return quant_linear_impl<Format::Q4_1, false>(a, packed, n_out, scales, bias, out, use_portable);
    case Format::Q8_0:
      return quant_linear_impl<Format::Q8_0, false>(a, packed, n_out, scales, bias, out, use_portable);
    case Format::Q4_K:
      return quant_linear_impl<Format::Q4_K, false>(a, packed, n_out, scales, bias, out, use_portable);
    case Format::Q6_K:
      return quant_linear_impl<Format::Q6_K, false>(a, packed, n_out, scales, bias, out, use_portable);
    case Format::INT8:
      return quant_linear_impl<Format::INT8, false>(a, packed, n_out, scales, bias, out, use_portable);
    case Format::FP8:
      return quant_linear_impl<Format::FP8, false>(a, packed, n_out, scales, bias, out, use_portable);
  }
}

// x [rows, k] float32/bfloat16 (contiguous rows); packed from quant_repack(format) of an
// [out_features, k] weight; scales float32 [out_features] for int8/fp8; bias [out_features]
// of x's dtype. Returns [rows, out_features] in x's dtype.
inline at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed,
                               const std::string& format, int64_t out_features,
                               const std::optional<at::Tensor>& scales,
                               const std::optional<at::Tensor>& bias, bool float_activations,
                               bool use_portable) {
  const Format f = parse_format(format);
  const FormatInfo& info = format_info(f);
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1,
              "quant_linear: x must be [rows, in_features] with contiguous rows");
  const int64_t k = x.size(1);
  TORCH_CHECK(info.row_scales || k % info.block_k == 0, "quant_linear: ", info.name,
              " needs in_features a multiple of ", info.block_k, ", got ", k);
  TORCH_CHECK(packed.is_contiguous() && packed.scalar_type() == at::kByte &&
                  packed.numel() == packed_bytes(f, out_features, k),
              "quant_linear: packed must be quant_repack's result for a [", out_features, ", ", k,
              "] ", info.name, " weight (", packed_bytes(f, out_features, k), " bytes), got ",
              packed.numel(), " bytes");
  const float* sp = nullptr;
  if (info.row_scales) {
    TORCH_CHECK(scales.has_value() && scales->defined() && scales->is_contiguous() &&
                    scales->scalar_type() == at::kFloat && scales->numel() == out_features,
                "quant_linear: ", info.name, " needs float32 scales [", out_features, "]");
    sp = scales->const_data_ptr<float>();
  }
  TORCH_CHECK(!float_activations || f == Format::Q4_0 || f == Format::Q4_1,
              "quant_linear: float_activations is implemented for q4_0 and q4_1 only");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == out_features &&
                    bias->scalar_type() == x.scalar_type(),
                "quant_linear: bias must be [out_features] of x's dtype");
  // The caller's thread quantizes; its buffers are kept for its next call (decode steps call
  // ~100 linears of the same few sizes).
  thread_local QuantizedActivations a;
  quantize_activations(x, padded_k(f, k), use_portable, float_activations || f == Format::FP8, a);
  auto out = at::empty({x.size(0), out_features}, x.options());
  if (x.size(0) == 0) return out;
  LLMKIT_DISPATCH_FLOAT(x.scalar_type(), "quant_linear", [&] {
    const scalar_t* bp = has_bias ? bias->const_data_ptr<scalar_t>() : nullptr;
    scalar_t* op = out.data_ptr<scalar_t>();
    const uint8_t* pp = packed.const_data_ptr<uint8_t>();
    // the amx tier's tiles take many rows (the same bits); else this file's kernels
    if (!amx::quant_linear(f, float_activations, a, pp, out_features, sp, bp, op, use_portable))
      dispatch_format(f, float_activations, a, pp, out_features, sp, bp, op, use_portable);
  });
  trim(a);
  return out;
}

}  // namespace llmkit_cpu::quant
