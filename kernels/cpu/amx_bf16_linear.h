// The amx tier's bf16 linear, for every row count: AMX-BF16 tiles multiply sixteen activation
// rows by sixteen outputs, 32 inputs at a time (TDPBF16PS: bf16 products, float32 sums).
//
// Bits: output (row, o) is one C tile element, accumulated over the 32-input blocks in order,
// from row's inputs and o's weights alone; the other rows of the tile (or its zero padding)
// and the thread split never enter it. So a row gets the same bits at any batch size, from one
// decode row to a prefill chunk, unlike oneDNN's bf16 GEMM (its blocking follows the row count).
// The result is rounded once to bf16 after the bias, as the other linears do. The bits differ
// from the C++ linear's (torch's GEMV order) and from oneDNN's: a per-tier choice.
//
// Speed: the weight is repacked once into tile order ([outputs/16][inputs/32][16 pairs][16
// outputs][2]), so each thread streams its outputs' weights as one contiguous run, which the
// hardware prefetchers follow; one tile operation does 16 x 16 x 32 products, so at a few rows
// the step is bound by reading the weight, as the C++ linear at one row is.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cstdint>

#include "amx_quant_linear.h"
#include "thread_pool.h"
#include "tuning.h"
#include "vec.h"

namespace llmkit_cpu::amx_bf16 {

constexpr int64_t kTile = 16;        // rows of a C / A tile; outputs of a B tile
constexpr int64_t kBlockK = 32;      // inputs of one tile product
constexpr int64_t kTileElems = 512;  // one B tile: 16 input pairs x 16 outputs x 2
constexpr int64_t kRowChunk = 256;   // activation rows that pass over a weight pair together

// weight [out, in] bf16 -> the tile order above, inputs and outputs padded with zeros.
inline at::Tensor pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "bf16_tile_pack: weight must be [out, in] bfloat16");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1);
  const int64_t nb = (n + kTile - 1) / kTile, kb = (k + kBlockK - 1) / kBlockK;
  auto out = at::zeros({nb * kb * kTileElems}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.const_data_ptr());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
  llmkit_cpu::parallel_for(0, nb, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t j = 0; j < kTile && b * kTile + j < n; ++j) {
        const uint16_t* row = src + (b * kTile + j) * k;
        for (int64_t i = 0; i < k; ++i) {
          const int64_t blk = i / kBlockK, pair = (i % kBlockK) / 2;
          dst[(b * kb + blk) * kTileElems + pair * 2 * kTile + j * 2 + (i & 1)] = row[i];
        }
      }
  });
  return out;
}

#if defined(LLMKIT_AMX)

// Tiles 0-3: C (float32 [rows][16]); 4-5: A (bf16 [rows][32 inputs]); 6-7: B ([16 pairs][16
// outputs x 2]). Every tile row is 64 bytes; C and A have ``rows`` rows (16, or fewer for a
// call of fewer rows: a C element is computed from its own A row alone, so the rows a tile
// has change no element's bits, and a short call reads its rows in place, unpadded).
inline void load_tile_config(int64_t rows = kTile) {
  quant::amx::TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = t < 6 ? static_cast<uint8_t>(rows) : kTile;
    c.colsb[t] = 64;
  }
  asm volatile("ldtilecfg %0" ::"m"(c));
}

// Rows [0, rows) of a C tile (float32 [16][16]) plus the bias, rounded to bf16 into y.
inline void emit(const float* c, int64_t rows, const bf16* bias, int64_t n, bf16* y,
                 int64_t ldy) {
  const __mmask16 mask = n >= kTile ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
  __m512 b = _mm512_setzero_ps();
  if (bias != nullptr)
    b = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, static_cast<const void*>(bias))), 16));
  for (int64_t i = 0; i < rows; ++i) {
    __m512 v = _mm512_load_ps(c + i * kTile);
    if (bias != nullptr) v = _mm512_add_ps(v, b);
    _mm256_mask_storeu_epi16(static_cast<void*>(y + i * ldy), mask, (__m256i)_mm512_cvtneps_pbh(v));
  }
}

// x [rows_p, kp] (rows padded to 16, or rows < 16 unpadded; inputs padded to 32), packed
// from pack(); out [rows, n].
inline void linear_tiles(const bf16* x, int64_t rows, int64_t kp, const bf16* w, int64_t n,
                         const bf16* bias, bf16* out) {
  quant::amx::require_tile_permission();
  const int64_t nb = (n + kTile - 1) / kTile, kb = kp / kBlockK;
  const int64_t tiles = (rows + kTile - 1) / kTile, pairs = (nb + 1) / 2;
  const int64_t lda = kp * int64_t(sizeof(bf16));
  const int64_t pair_bytes = 2 * kb * kTileElems * int64_t(sizeof(bf16));
  llmkit_cpu::parallel_for(0, pairs, tuning::grain(pair_bytes), [&](int64_t begin, int64_t end) {
    load_tile_config(std::min(rows, kTile));
    alignas(64) float c[4][kTile * kTile];
    const auto store = [&](int64_t t, int64_t o, const float* c0, const float* c1) {
      const int64_t r0 = t * kTile, mr = std::min(kTile, rows - r0);
      const int64_t n0 = std::min(kTile, n - o);
      emit(c0, mr, bias ? bias + o : nullptr, n0, out + r0 * n + o, n);
      if (o + kTile < n)
        emit(c1, mr, bias ? bias + o + kTile : nullptr, std::min(kTile, n - o - kTile),
             out + r0 * n + o + kTile, n);
    };
    for (int64_t tc = 0; tc < tiles; tc += kRowChunk / kTile) {
      const int64_t tc_end = std::min(tiles, tc + kRowChunk / kTile);
      for (int64_t p = begin; p < end; ++p) {
        // an odd last block's partner: the block itself again (its outputs are not written)
        const bf16* b0 = w + 2 * p * kb * kTileElems;
        const bf16* b1 = 2 * p + 1 < nb ? b0 + kb * kTileElems : b0;
        const int64_t o = 2 * p * kTile;
        int64_t t = tc;
        // The empty asm statements: GCC's tile intrinsics do not say that they read or write
        // memory, so without them the stores that fill c (or x) could move past the tiles.
        for (; t + 2 <= tc_end; t += 2) {
          asm volatile("" ::: "memory");
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          const bf16* a0 = x + t * kTile * kp;
          const bf16* a1 = a0 + kTile * kp;
          for (int64_t k = 0; k < kb; ++k) {
            _tile_loadd(4, a0 + k * kBlockK, lda);
            _tile_loadd(5, a1 + k * kBlockK, lda);
            _tile_loadd(6, b0 + k * kTileElems, 64);
            _tile_loadd(7, b1 + k * kTileElems, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
          _tile_stored(0, c[0], 64);
          _tile_stored(1, c[1], 64);
          _tile_stored(2, c[2], 64);
          _tile_stored(3, c[3], 64);
          asm volatile("" ::: "memory");
          store(t, o, c[0], c[1]);
          store(t + 1, o, c[2], c[3]);
        }
        if (t < tc_end) {
          asm volatile("" ::: "memory");
          _tile_zero(0);
          _tile_zero(1);
          const bf16* a0 = x + t * kTile * kp;
          for (int64_t k = 0; k < kb; ++k) {
            _tile_loadd(4, a0 + k * kBlockK, lda);
            _tile_loadd(6, b0 + k * kTileElems, 64);
            _tile_loadd(7, b1 + k * kTileElems, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
          }
          _tile_stored(0, c[0], 64);
          _tile_stored(1, c[1], 64);
          asm volatile("" ::: "memory");
          store(t, o, c[0], c[1]);
        }
      }
    }
    _tile_release();
  });
}

#endif  // LLMKIT_AMX

// x [rows, in] bf16, packed = pack(weight [out_features, in]), bias [out_features] bf16 or
// undefined. Returns [rows, out_features] bf16. Only the amx tier's build has it.
inline at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                         const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 &&
                  packed.scalar_type() == at::kBFloat16,
              "bf16_tile_linear: x must be [rows, in] bfloat16 and packed from bf16_tile_pack");
  const int64_t rows = x.size(0), k = x.size(1);
  const int64_t kp = (k + kBlockK - 1) / kBlockK * kBlockK;
  const int64_t nb = (out_features + kTile - 1) / kTile;
  TORCH_CHECK(packed.numel() == nb * (kp / kBlockK) * kTileElems,
              "bf16_tile_linear: packed does not hold [", out_features, ", ", k, "]");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == out_features &&
                    bias->scalar_type() == at::kBFloat16,
                "bf16_tile_linear: bias must be [out_features] bfloat16");
  auto out = at::empty({rows, out_features}, x.options());
  if (rows == 0) return out;
#if defined(LLMKIT_AMX)
  // Tiles read whole 32-input blocks, and 16-row ones past the first tile: other shapes go
  // through a zero-padded copy (a single tile of fewer rows reads its rows in place).
  const int64_t rows_p = rows < kTile ? rows : (rows + kTile - 1) / kTile * kTile;
  at::Tensor xs = x.contiguous();
  if (rows_p != rows || kp != k) {
    at::Tensor padded = at::zeros({rows_p, kp}, x.options());
    padded.narrow(0, 0, rows).narrow(1, 0, k).copy_(xs);
    xs = padded;
  }
  linear_tiles(xs.const_data_ptr<bf16>(), rows, kp, packed.const_data_ptr<bf16>(),
               out_features, has_bias ? bias->const_data_ptr<bf16>() : nullptr,
               out.data_ptr<bf16>());
  return out;
#else
  TORCH_CHECK(false, "bf16_tile_linear: only the amx tier's kernels have AMX tiles");
#endif
}

}  // namespace llmkit_cpu::amx_bf16
