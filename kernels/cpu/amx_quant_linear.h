// The amx tier's quantized linear for many rows (batched decoding, prefill chunks): AMX-INT8
// tiles multiply sixteen activation rows by sixteen outputs (two x8 weight groups) per
// instruction, 32 inputs (one block) at a time.
//
// Bits: every block's integer sum is exact in int32 however it is computed, so a tile's
// TDPBSUD (int8 activations x u4 weights) or TDPBSSD (x s8 weights) gives the same block sums
// as the VNNI tiers' vpdpbusd; the block's float32 scaling then runs per output lane in
// quant_linear.h's order (t = d_x * sum, acc = fma(d_w, t, acc), then a minimum's
// fma(m, d_x * sum q_x, acc)), one block after another. So every row gets the VNNI tiers' (and
// the portable code's) bits, whatever the batch. A block is one tile product (K = 32, not 64):
// two blocks summed in a tile would merge before their scales.
//
// Formats: q4_0, q4_1, q4_k, q8_0 and int8. q6_k (two 16-input scales per block), fp8 and the
// float-activation kernels keep quant_linear.h's VNNI path in this tier.
//
// Linux hands out the tile registers' state only on request: the process asks once
// (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)); each thread loads the tile
// configuration before its tiles and releases them after (other libraries, oneDNN, configure
// the same registers their own way).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_activation.h"
#include "quant_blocks.h"
#include "thread_pool.h"
#include "tuning.h"

#if defined(LLMKIT_AMX)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#endif

namespace llmkit_cpu::quant::amx {

// Rows from which the tile kernel runs (a tile is sixteen rows; fewer pad it with zero rows).
// Both paths give the same bits, so this moves speed only.
constexpr int64_t kMinRows = 16;

#if defined(LLMKIT_AMX)

constexpr int64_t kTileRows = 16;     // activation rows of a tile (C and A tiles' rows)
constexpr int64_t kTileOut = 16;      // outputs of a tile: two x8 groups
constexpr int64_t kBBytes = 512;      // one block of 16 outputs in VNNI order: 8 rows x 64 bytes
constexpr int64_t kABytes = 512;      // one block of 16 activation rows: 16 rows x 32 bytes
constexpr int64_t kRowChunk = 256;    // activation rows that pass over a decoded pair together

// Tile registers: C0, C1 int32 [16][16] (two blocks in flight), A0, A1 int8 [16][32] (the
// activations' block), B0, B1 [8][64] (the weights' block, four inputs per output per row).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline void load_tile_config() {
  TileConfig c;
  for (int t = 0; t < 2; ++t) {
    c.rows[t] = kTileRows;      c.colsb[t] = kTileOut * 4;   // C
    c.rows[2 + t] = kTileRows;  c.colsb[2 + t] = kBlock;     // A
    c.rows[4 + t] = kBlock / 4; c.colsb[4 + t] = kTileOut * 4; // B
  }
  // not _tile_loadconfig: GCC's names only the first 8 bytes as read, so the stores of the
  // rest may be dropped (an unconfigured tile then faults)
  asm volatile("ldtilecfg %0" ::"m"(c));
}

// 0 when the kernel granted this process the tile data state, else the errno of its refusal.
inline int tile_permission_error() {
  static const int error = [] {
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0 ? 0 : errno;
  }();
  return error;
}

inline void require_tile_permission() {
  const int error = tile_permission_error();
  TORCH_CHECK(error == 0, "llmkit's amx tier: the Linux kernel refused this process the AMX tile "
              "state (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) failed, errno ", error,
              ": a kernel older than 5.16 or a sandbox); run platform.isa=avx512_bf16");
}

template <Format F>
constexpr bool kSignedWeights = F == Format::Q8_0 || F == Format::INT8;

// The eight rows' 4-byte lanes of one block (Q4: 4 x [8][4] nibble bytes; Q8: 8 x [8][4]).
template <Format F>
inline const uint8_t* block_quants(const uint8_t* block, int sub) {
  if constexpr (F == Format::Q4_0) return &reinterpret_cast<const Q4_0x8*>(block)->qs[0][0][0];
  if constexpr (F == Format::Q4_1) return &reinterpret_cast<const Q4_1x8*>(block)->qs[0][0][0];
  if constexpr (F == Format::Q4_K) return &reinterpret_cast<const Q4_Kx8*>(block)->qs[sub][0][0][0];
  if constexpr (F == Format::Q8_0)
    return reinterpret_cast<const uint8_t*>(&reinterpret_cast<const Q8_0x8*>(block)->qs[0][0][0]);
  if constexpr (F == Format::INT8)
    return reinterpret_cast<const uint8_t*>(&reinterpret_cast<const I8x8*>(block)->qs[0][0][0]);
  return nullptr;
}

inline __m512i concat(const uint8_t* lo, const uint8_t* hi) {
  return _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo))),
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi)), 1);
}
inline __m512 half16(const uint16_t* lo, const uint16_t* hi) {
  return _mm512_cvtph_ps(_mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(hi)), 1));
}
inline __m512 u8x16_to_float(const uint8_t* lo, const uint8_t* hi) {
  const __m128i v = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(lo)),
                                       _mm_loadl_epi64(reinterpret_cast<const __m128i*>(hi)));
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v));
}

// One weight pair (groups g0, g1: 16 outputs) decoded for the tiles: per 32-input block its
// B tile (row j: inputs 4j..4j+3 of each output), its scales dw and its minimum's factor mw
// (q4_1: m; q4_k: -dmin * m_s), 16 lanes each, in the VNNI code's float32 values.
template <Format F>
void decode_pair(const uint8_t* g0, const uint8_t* g1, int64_t nbk, uint8_t* b, float* dw,
                 float* mw) {
  constexpr int64_t bytes = sizeof(packed_block_t<F>);
  constexpr int subs = F == Format::Q4_K ? 8 : 1;
  for (int64_t blk = 0; blk < nbk; ++blk) {
    const uint8_t* p0 = g0 + blk * bytes;
    const uint8_t* p1 = g1 + blk * bytes;
    for (int s = 0; s < subs; ++s) {
      const int64_t n = blk * subs + s;
      uint8_t* dst = b + n * kBBytes;
      const uint8_t* q0 = block_quants<F>(p0, s);
      const uint8_t* q1 = block_quants<F>(p1, s);
      if constexpr (kSignedWeights<F>) {
        for (int j = 0; j < 8; ++j)
          _mm512_storeu_si512(dst + 64 * j, concat(q0 + 32 * j, q1 + 32 * j));
      } else {
        // byte i of a row: input i (low nibble), input 16 + i (high): quad j's bytes give B
        // rows j and 4 + j
        const __m512i mask = _mm512_set1_epi8(0x0F);
        for (int j = 0; j < 4; ++j) {
          const __m512i raw = concat(q0 + 32 * j, q1 + 32 * j);
          _mm512_storeu_si512(dst + 64 * j, _mm512_and_si512(raw, mask));
          _mm512_storeu_si512(dst + 64 * (4 + j), _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask));
        }
      }
      if constexpr (F == Format::Q4_0 || F == Format::Q8_0) {
        const auto* b0 = reinterpret_cast<const packed_block_t<F>*>(p0);
        const auto* b1 = reinterpret_cast<const packed_block_t<F>*>(p1);
        _mm512_storeu_ps(dw + n * kTileOut, half16(b0->d, b1->d));
      } else if constexpr (F == Format::Q4_1) {
        const auto* b0 = reinterpret_cast<const Q4_1x8*>(p0);
        const auto* b1 = reinterpret_cast<const Q4_1x8*>(p1);
        _mm512_storeu_ps(dw + n * kTileOut, half16(b0->d, b1->d));
        _mm512_storeu_ps(mw + n * kTileOut, half16(b0->m, b1->m));
      } else if constexpr (F == Format::Q4_K) {
        const auto* b0 = reinterpret_cast<const Q4_Kx8*>(p0);
        const auto* b1 = reinterpret_cast<const Q4_Kx8*>(p1);
        _mm512_storeu_ps(dw + n * kTileOut, _mm512_mul_ps(half16(b0->d, b1->d),
                                                          u8x16_to_float(b0->sc[s], b1->sc[s])));
        const __m512 mn = _mm512_mul_ps(half16(b0->dmin, b1->dmin),
                                        u8x16_to_float(b0->m[s], b1->m[s]));
        _mm512_storeu_ps(mw + n * kTileOut, _mm512_xor_ps(mn, _mm512_set1_ps(-0.f)));
      }
    }
  }
}

// The activations in tile order: per sixteen-row tile and 32-input block, the rows' int8 inputs
// (one A tile, 512 contiguous bytes) and their scales d, the sums sq = d * sum q and sum8 (the
// ActBlock fields the scaling reads), sixteen of each; rows past the last are zeros.
struct TileActivations {
  int64_t tiles = 0, nb = 0;
  std::vector<int8_t> q;     // [tiles][nb][16][32]
  std::vector<float> d, sq;  // [tiles][nb][16]
  std::vector<int32_t> sum8;

  const int8_t* a(int64_t t, int64_t blk) const { return q.data() + (t * nb + blk) * kABytes; }
  int64_t meta(int64_t t, int64_t blk) const { return (t * nb + blk) * kTileRows; }
};

inline void to_tiles(const QuantizedActivations& x, TileActivations& out) {
  const int64_t nb = x.nb, tiles = div_up(x.rows, kTileRows);
  out.tiles = tiles;
  out.nb = nb;
  out.q.assign(tiles * nb * kABytes, 0);
  out.d.assign(tiles * nb * kTileRows, 0.f);
  out.sq.assign(tiles * nb * kTileRows, 0.f);
  out.sum8.assign(tiles * nb * kTileRows, 0);
  llmkit_cpu::parallel_for(0, x.rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t t = row / kTileRows, i = row % kTileRows;
      const int8_t* q = x.q_row(row);
      const ActBlock* m = x.meta_row(row);
      for (int64_t blk = 0; blk < nb; ++blk) {
        std::memcpy(out.q.data() + (t * nb + blk) * kABytes + i * kBlock, q + blk * kBlock, kBlock);
        const int64_t j = out.meta(t, blk) + i;
        out.d[j] = m[blk].d;
        out.sq[j] = m[blk].sq;
        out.sum8[j] = m[blk].sum8;
      }
    }
  });
}

// Gives back a prefill's buffers instead of keeping them for the next call (as trim()).
inline void trim(TileActivations& a) {
  if (a.q.capacity() > (8 << 20)) a = TileActivations();
}

// One block's int32 sums c [16 rows][16 outputs] scaled into the rows' accumulators.
template <Format F>
inline __attribute__((always_inline)) void scale_block(const int32_t (*c)[kTileOut],
                                                       const TileActivations& x, int64_t t,
                                                       int64_t blk, const float* dwb,
                                                       const float* mwb, __m512* acc) {
  [[maybe_unused]] const __m512 dw = _mm512_loadu_ps(dwb + blk * kTileOut);
  [[maybe_unused]] __m512 mw;
  if constexpr (F == Format::Q4_1 || F == Format::Q4_K) mw = _mm512_loadu_ps(mwb + blk * kTileOut);
  const int64_t j = x.meta(t, blk);
  const float* d = x.d.data() + j;
  [[maybe_unused]] const float* sq = x.sq.data() + j;
  [[maybe_unused]] const int32_t* sum8 = x.sum8.data() + j;
  _Pragma("GCC unroll 16") for (int i = 0; i < kTileRows; ++i) {
    __m512i isum = _mm512_load_si512(c[i]);
    if constexpr (F == Format::Q4_0) isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(sum8[i]));
    if constexpr (F == Format::INT8) {
      acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(d[i]), _mm512_cvtepi32_ps(isum), acc[i]);
    } else {
      const __m512 v = _mm512_mul_ps(_mm512_set1_ps(d[i]), _mm512_cvtepi32_ps(isum));
      acc[i] = _mm512_fmadd_ps(dw, v, acc[i]);
      if constexpr (F == Format::Q4_1 || F == Format::Q4_K)
        acc[i] = _mm512_fmadd_ps(mw, _mm512_set1_ps(sq[i]), acc[i]);
    }
  }
}

// Block blk's tile product into C tile TC (from A tile TA and B tile TB), stored to c. A macro:
// GCC's tile intrinsics take the register numbers as literal text. The empty asm first: GCC's
// tile loads do not declare that they read memory, so without it the stores that filled the
// buffers they read may be moved after them.
#define LLMKIT_AMX_BLOCK(TC, TA, TB, blk, c)                          \
  do {                                                                \
    asm volatile("" ::: "memory");                                    \
    _tile_zero(TC);                                                   \
    _tile_loadd(TA, x.a(t, blk), kBlock);                             \
    _tile_loadd(TB, b + (blk) * kBBytes, 64);                         \
    if constexpr (kSignedWeights<F>) _tile_dpbssd(TC, TA, TB);        \
    else _tile_dpbsud(TC, TA, TB);                                    \
    _tile_stored(TC, c, kTileOut * 4);                                \
  } while (0)

// Tile t's sixteen rows times one decoded pair: res[i][o] = row i's sum for output o (before
// int8's row scales and the bias). The tile unit computes block blk + 1 while the vector unit
// scales block blk (two C tiles and two buffers, alternated).
template <Format F>
void tile16(const TileActivations& x, int64_t t, const uint8_t* b, const float* dwb,
            const float* mwb, float (*res)[kTileOut]) {
  const int64_t nb = x.nb;
  __m512 acc[kTileRows];
  _Pragma("GCC unroll 16") for (int i = 0; i < kTileRows; ++i) acc[i] = _mm512_setzero_ps();
  alignas(64) int32_t c0[kTileRows][kTileOut], c1[kTileRows][kTileOut];
  LLMKIT_AMX_BLOCK(0, 2, 4, 0, c0);
  int64_t blk = 0;
  for (; blk + 2 < nb; blk += 2) {
    LLMKIT_AMX_BLOCK(1, 3, 5, blk + 1, c1);
    scale_block<F>(c0, x, t, blk, dwb, mwb, acc);
    LLMKIT_AMX_BLOCK(0, 2, 4, blk + 2, c0);
    scale_block<F>(c1, x, t, blk + 1, dwb, mwb, acc);
  }
  if (blk + 1 < nb) {
    LLMKIT_AMX_BLOCK(1, 3, 5, blk + 1, c1);
    scale_block<F>(c0, x, t, blk, dwb, mwb, acc);
    scale_block<F>(c1, x, t, blk + 1, dwb, mwb, acc);
  } else {
    scale_block<F>(c0, x, t, blk, dwb, mwb, acc);
  }
  _Pragma("GCC unroll 16") for (int i = 0; i < kTileRows; ++i) _mm512_storeu_ps(res[i], acc[i]);
}
#undef LLMKIT_AMX_BLOCK

template <Format F, typename T>
void linear(const QuantizedActivations& a, const uint8_t* packed, int64_t n_out,
            const float* scales, const T* bias, T* out) {
  require_tile_permission();
  const FormatInfo& info = format_info(F);
  const int64_t nbk = a.kp / info.block_k, nb = a.nb, rows = a.rows;
  const int64_t group_stride = nbk * info.group_bytes;
  const int64_t groups = div_up(n_out, kRows), pairs = div_up(groups, 2);
  // The caller's thread lays them out; its buffers are kept for its next call. (A reference:
  // the worker threads below must read the caller's, not their own thread_local.)
  thread_local TileActivations buffers;
  TileActivations& x = buffers;
  to_tiles(a, x);
  // an odd last group's partner: zero weights (its outputs are not written)
  std::vector<uint8_t> zeros(pairs * 2 > groups ? group_stride : 0, 0);
  const int64_t chunk_tiles = kRowChunk / kTileRows;
  // threads split the pairs as quant_linear_impl splits groups (tuning.h: speed only)
  llmkit_cpu::parallel_for(0, pairs, tuning::grain(2 * group_stride), [&](int64_t begin, int64_t end) {
    load_tile_config();
    std::vector<uint8_t> b(nb * kBBytes);
    std::vector<float> dw(nb * kTileOut), mw(nb * kTileOut);
    float res[kTileRows][kTileOut];
    for (int64_t tc = 0; tc < x.tiles; tc += chunk_tiles) {
      const int64_t tc_end = std::min(x.tiles, tc + chunk_tiles);
      for (int64_t p = begin; p < end; ++p) {
        const uint8_t* g0 = packed + 2 * p * group_stride;
        const uint8_t* g1 = 2 * p + 1 < groups ? g0 + group_stride : zeros.data();
        decode_pair<F>(g0, g1, nbk, b.data(), dw.data(), mw.data());
        const int64_t o = p * kTileOut, n = std::min(kTileOut, n_out - o);
        for (int64_t t = tc; t < tc_end; ++t) {
          tile16<F>(x, t, b.data(), dw.data(), mw.data(), res);
          const int64_t i0 = t * kTileRows, mr = std::min(kTileRows, rows - i0);
          // as quant_linear_impl's emit: the output's scale, then the bias, then T (the
          // sixteen outputs one vector: the same float operations and rounding lane by lane)
          const __mmask16 m = static_cast<__mmask16>((1u << n) - 1);
          const __m512 sv = scales != nullptr ? _mm512_maskz_loadu_ps(m, scales + o)
                                              : _mm512_setzero_ps();
          const __m512 bv = bias != nullptr ? load16(bias + o, m) : _mm512_setzero_ps();
          for (int64_t i = 0; i < mr; ++i) {
            __m512 v = _mm512_loadu_ps(res[i]);
            if (scales != nullptr) v = _mm512_mul_ps(v, sv);
            if (bias != nullptr) v = _mm512_add_ps(v, bv);
            store16(out + (i0 + i) * n_out + o, v, m);
          }
        }
      }
    }
    _tile_release();
  });
  trim(x);
}

#endif  // LLMKIT_AMX

// Runs the linear on tiles and returns true when this build, the format and the row count
// take them; false: the caller's (VNNI) kernel runs it.
template <typename T>
inline bool quant_linear(Format f, bool float_activations, const QuantizedActivations& a,
                         const uint8_t* packed, int64_t n_out, const float* scales,
                         const T* bias, T* out, bool use_portable) {
#if defined(LLMKIT_AMX)
  if (use_portable || float_activations || a.rows < kMinRows) return false;
  switch (f) {
    case Format::Q4_0: linear<Format::Q4_0>(a, packed, n_out, scales, bias, out); return true;
    case Format::Q4_1: linear<Format::Q4_1>(a, packed, n_out, scales, bias, out); return true;
    case Format::Q4_K: linear<Format::Q4_K>(a, packed, n_out, scales, bias, out); return true;
    case Format::Q8_0: linear<Format::Q8_0>(a, packed, n_out, scales, bias, out); return true;
    case Format::INT8: linear<Format::INT8>(a, packed, n_out, scales, bias, out); return true;
    default: return false;
  }
#else
  (void)f, (void)float_activations, (void)a, (void)packed, (void)n_out, (void)scales, (void)bias,
      (void)out, (void)use_portable;
  return false;
#endif
}

}  // namespace llmkit_cpu::quant::amx
