// GGUF blocks (and int8 / fp8 rows) -> llmkit's packed x8 layouts (quant_blocks.h), and back
// to float32 values (to test the repack, to gather embedding rows, and for references). The
// repack moves bits only; the dequantized values are those of gguf-py's dequantize, bit for bit
// (every format's value is one float32 rounding of its exact value, the same rounding both).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <cstdint>
#include <algorithm>
#include <cstring>
#include <optional>

#include "quant_blocks.h"
#include "thread_pool.h"

namespace llmkit_cpu::quant {

namespace detail {

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// Q4_K's twelve scale bytes -> eight 6-bit scales and eight 6-bit minimums.
inline void q4k_scales(const uint8_t* s, uint8_t* sc, uint8_t* m) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    m[j] = s[j + 4] & 63;
  }
  for (int j = 4; j < 8; ++j) {
    sc[j] = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    m[j] = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// 32 four-bit values (one per input of a block) into Q4_0 order: byte i = e[i] | e[16+i] << 4,
// written as the packed layout's four 4-byte lanes of row ``r``.
inline void put_nibbles(const uint8_t* e, uint8_t (*qs)[kRows][4], int64_t r) {
  for (int i = 0; i < 16; ++i)
    qs[i / 4][r][i % 4] = static_cast<uint8_t>((e[i] & 0x0F) | ((e[16 + i] & 0x0F) << 4));
}

// The 4-bit value of input i (0..31) of row r of a Q4_0-ordered packed block.
inline uint8_t get_nibble(const uint8_t (*qs)[kRows][4], int64_t r, int i) {
  const int byte = i % 16;
  return (qs[byte / 4][r][byte % 4] >> (4 * (i / 16))) & 0x0F;
}

// One GGUF row block (or int8/fp8 run of 32 inputs) into lane r of a packed group-block.
inline void pack_block(Format f, const uint8_t* src, int64_t valid, uint8_t* dst, int64_t r) {
  switch (f) {
    case Format::Q4_0: {
      auto* b = reinterpret_cast<Q4_0x8*>(dst);
      b->d[r] = load_u16(src);
      for (int i = 0; i < 16; ++i) b->qs[i / 4][r][i % 4] = src[2 + i];
      break;
    }
    case Format::Q4_1: {
      auto* b = reinterpret_cast<Q4_1x8*>(dst);
      b->d[r] = load_u16(src);
      b->m[r] = load_u16(src + 2);
      for (int i = 0; i < 16; ++i) b->qs[i / 4][r][i % 4] = src[4 + i];
      break;
    }
    case Format::Q8_0: {
      auto* b = reinterpret_cast<Q8_0x8*>(dst);
      b->d[r] = load_u16(src);
      for (int i = 0; i < 32; ++i) b->qs[i / 4][r][i % 4] = static_cast<int8_t>(src[2 + i]);
      break;
    }
    case Format::Q4_K: {
      auto* b = reinterpret_cast<Q4_Kx8*>(dst);
      b->d[r] = load_u16(src);
      b->dmin[r] = load_u16(src + 2);
      uint8_t sc[8], m[8];
      q4k_scales(src + 4, sc, m);
      const uint8_t* qs = src + 16;
      for (int s = 0; s < 8; ++s) {
        b->sc[s][r] = sc[s];
        b->m[s][r] = m[s];
        // GGUF: sub-block s = nibble s % 2 of the 32 bytes of chunk s / 2.
        uint8_t e[32];
        for (int i = 0; i < 32; ++i) e[i] = (qs[32 * (s / 2) + i] >> (4 * (s % 2))) & 0x0F;
        put_nibbles(e, b->qs[s], r);
      }
      break;
    }
    case Format::Q6_K: {
      auto* b = reinterpret_cast<Q6_Kx8*>(dst);
      const uint8_t* ql = src;
      const uint8_t* qh = src + 128;
      const int8_t* scales = reinterpret_cast<const int8_t*>(src + 192);
      b->d[r] = load_u16(src + 208);
      for (int blk = 0; blk < 8; ++blk) {
        b->sc[blk][r][0] = scales[2 * blk];
        b->sc[blk][r][1] = scales[2 * blk + 1];
        uint8_t lo[32];
        for (int i = 0; i < 32; ++i) {
          const int e = 32 * blk + i, half = e / 128, in = e % 128;
          const uint8_t low = (ql[64 * half + in % 64] >> (4 * (in / 64))) & 0x0F;
          const uint8_t high = (qh[32 * half + in % 32] >> (2 * (in / 32))) & 0x03;
          lo[i] = low;
          const int h = i / 16, u = (i % 16) / 4, t = i % 4;
          if (u == 0) b->qh[blk][h][r][t] = 0;
          b->qh[blk][h][r][t] |= static_cast<uint8_t>(high << (2 * u));
        }
        put_nibbles(lo, b->ql[blk], r);
      }
      break;
    }
    case Format::INT8: {
      auto* b = reinterpret_cast<I8x8*>(dst);
      for (int i = 0; i < 32; ++i)
        b->qs[i / 4][r][i % 4] = i < valid ? static_cast<int8_t>(src[i]) : int8_t(0);
      break;
    }
    case Format::FP8: {
      auto* b = reinterpret_cast<F8x8*>(dst);
      for (int i = 0; i < 32; ++i) b->qs[i][r] = i < valid ? src[i] : uint8_t(0);
      break;
    }
  }
}

// The value of input i (< the format's block_k) of lane r of a packed group-block, as gguf-py
// computes it; ``scale`` is the row's float scale (int8, fp8).
inline __attribute__((always_inline)) float block_value(Format f, const uint8_t* blk, int64_t r, int i, float scale) {
  switch (f) {
    case Format::Q4_0: {
      auto* b = reinterpret_cast<const Q4_0x8*>(blk);
      return half_to_float(b->d[r]) * static_cast<float>(get_nibble(b->qs, r, i) - 8);
    }
    case Format::Q4_1: {
      auto* b = reinterpret_cast<const Q4_1x8*>(blk);
      return half_to_float(b->d[r]) * static_cast<float>(get_nibble(b->qs, r, i)) +
             half_to_float(b->m[r]);
    }
    case Format::Q8_0: {
      auto* b = reinterpret_cast<const Q8_0x8*>(blk);
      return static_cast<float>(b->qs[i / 4][r][i % 4]) * half_to_float(b->d[r]);
    }
    case Format::Q4_K: {
      auto* b = reinterpret_cast<const Q4_Kx8*>(blk);
      const int s = i / 32;
      const float d = half_to_float(b->d[r]) * static_cast<float>(b->sc[s][r]);
      const float dm = half_to_float(b->dmin[r]) * static_cast<float>(b->m[s][r]);
      return d * static_cast<float>(get_nibble(b->qs[s], r, i % 32)) - dm;
    }
    case Format::Q6_K: {
      auto* b = reinterpret_cast<const Q6_Kx8*>(blk);
      const int blk32 = i / 32, e = i % 32, h = e / 16, u = (e % 16) / 4, t = e % 4;
      const int q = get_nibble(b->ql[blk32], r, e) | (((b->qh[blk32][h][r][t] >> (2 * u)) & 3) << 4);
      const float d = half_to_float(b->d[r]) * static_cast<float>(b->sc[blk32][r][h]);
      return d * static_cast<float>(q - 32);
    }
    case Format::INT8: {
      auto* b = reinterpret_cast<const I8x8*>(blk);
      return scale * static_cast<float>(b->qs[i / 4][r][i % 4]);
    }
    case Format::FP8: {
      auto* b = reinterpret_cast<const F8x8*>(blk);
      return (scale * kFp8HalfScale) * half_to_float(e4m3_to_half_bits_scaled(b->qs[i][r]));
    }
  }
  return 0.f;
}

// All block_k values of lane r of a packed group-block, into out (the format switch once per
// block rather than per value: an embedding lookup decodes whole rows).
inline void block_values(Format f, const uint8_t* blk, int64_t r, float scale, int64_t block_k,
                         float* out) {
  switch (f) {
    case Format::Q4_0:
      for (int i = 0; i < 32; ++i) out[i] = block_value(Format::Q4_0, blk, r, i, scale);
      break;
    case Format::Q4_1:
      for (int i = 0; i < 32; ++i) out[i] = block_value(Format::Q4_1, blk, r, i, scale);
      break;
    case Format::Q8_0:
      for (int i = 0; i < 32; ++i) out[i] = block_value(Format::Q8_0, blk, r, i, scale);
      break;
    case Format::Q4_K:
      for (int i = 0; i < 256; ++i) out[i] = block_value(Format::Q4_K, blk, r, i, scale);
      break;
    case Format::Q6_K:
      for (int i = 0; i < 256; ++i) out[i] = block_value(Format::Q6_K, blk, r, i, scale);
      break;
    case Format::INT8:
      for (int i = 0; i < 32; ++i) out[i] = block_value(Format::INT8, blk, r, i, scale);
      break;
    case Format::FP8:
      for (int i = 0; i < 32; ++i) out[i] = block_value(Format::FP8, blk, r, i, scale);
      break;
  }
  (void)block_k;
}

}  // namespace detail

// raw: uint8 [n, row_bytes] -- GGUF blocks of each row (q4_0 ... q6_k), or one byte per weight
// (int8 as its two's complement, fp8 e4m3 bits), k inputs per row. Returns the packed uint8
// weight (packed_bytes(format, n, k)); rows past n and inputs past k are zeros.
inline at::Tensor quant_repack(const at::Tensor& raw, const std::string& format, int64_t k) {
  const Format f = parse_format(format);
  const FormatInfo& info = format_info(f);
  TORCH_CHECK(raw.dim() == 2 && raw.is_contiguous() &&
                  (raw.scalar_type() == at::kByte || raw.scalar_type() == at::kChar),
              "quant_repack: raw must be a contiguous uint8 [rows, row_bytes] tensor");
  const int64_t n = raw.size(0);
  if (info.gguf_bytes > 0) {
    TORCH_CHECK(k > 0 && k % info.block_k == 0, "quant_repack: ", info.name, " rows must be "
                "whole blocks of ", info.block_k, " inputs, got ", k);
    TORCH_CHECK(raw.size(1) == k / info.block_k * info.gguf_bytes, "quant_repack: ", info.name,
                " rows of ", k, " inputs take ", k / info.block_k * info.gguf_bytes,
                " bytes, got ", raw.size(1));
  } else {
    TORCH_CHECK(k > 0 && raw.size(1) == k, "quant_repack: ", info.name, " rows must be ", k,
                " bytes (one per weight), got ", raw.size(1));
  }
  const int64_t nbk = padded_k(f, k) / info.block_k;
  const int64_t groups = div_up(n, kRows);
  auto packed = at::zeros({packed_bytes(f, n, k)}, raw.options().dtype(at::kByte));
  const uint8_t* src = reinterpret_cast<const uint8_t*>(raw.const_data_ptr());
  uint8_t* dst = packed.data_ptr<uint8_t>();
  const int64_t row_bytes = raw.size(1);
  const int64_t src_block = info.gguf_bytes > 0 ? info.gguf_bytes : info.block_k;
  llmkit_cpu::parallel_for(0, groups, 16, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t r = 0; r < kRows && g * kRows + r < n; ++r) {
        const uint8_t* row = src + (g * kRows + r) * row_bytes;
        for (int64_t b = 0; b < nbk; ++b)
          detail::pack_block(f, row + b * src_block, std::min(src_block, row_bytes - b * src_block),
                             dst + (g * nbk + b) * info.group_bytes, r);
      }
  });
  return packed;
}

// The float32 values of rows ``rows`` (all n when absent) of a packed [n, k] weight: what
// gguf-py's dequantize (or ``q * scale`` for int8/fp8) gives for them.
inline at::Tensor quant_dequantize(const at::Tensor& packed, const std::string& format,
                                   int64_t n, int64_t k, const std::optional<at::Tensor>& scales,
                                   const std::optional<at::Tensor>& rows) {
  const Format f = parse_format(format);
  const FormatInfo& info = format_info(f);
  TORCH_CHECK(packed.is_contiguous() && packed.scalar_type() == at::kByte &&
                  packed.numel() == packed_bytes(f, n, k),
              "quant_dequantize: packed must be the contiguous uint8 result of quant_repack for "
              "a [", n, ", ", k, "] ", info.name, " weight");
  const float* sp = nullptr;
  if (info.row_scales) {
    TORCH_CHECK(scales.has_value() && scales->is_contiguous() &&
                    scales->scalar_type() == at::kFloat && scales->numel() == n,
                "quant_dequantize: ", info.name, " needs float32 scales [", n, "]");
    sp = scales->const_data_ptr<float>();
  }
  at::Tensor ids;
  if (rows.has_value() && rows->defined()) {
    TORCH_CHECK(rows->dim() == 1 && rows->scalar_type() == at::kLong,
                "quant_dequantize: rows must be int64 [m]");
    ids = rows->contiguous();
  }
  const int64_t m = ids.defined() ? ids.numel() : n;
  const int64_t* ip = ids.defined() ? ids.const_data_ptr<int64_t>() : nullptr;
  for (int64_t i = 0; ip != nullptr && i < m; ++i)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < n, "quant_dequantize: row ", ip[i], " out of [0, ", n, ")");
  auto out = at::empty({m, k}, packed.options().dtype(at::kFloat));
  const uint8_t* pp = packed.const_data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t nbk = padded_k(f, k) / info.block_k;
  llmkit_cpu::parallel_for(0, m, 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t row = ip ? ip[i] : i, g = row / kRows, r = row % kRows;
      const float scale = sp ? sp[row] : 0.f;
      float vals[kSuper];
      for (int64_t b = 0; b < nbk; ++b) {
        detail::block_values(f, pp + (g * nbk + b) * info.group_bytes, r, scale, info.block_k, vals);
        const int64_t c0 = b * info.block_k, n_c = std::min(info.block_k, k - c0);
        std::copy(vals, vals + n_c, op + i * k + c0);
      }
    }
  });
  return out;
}

}  // namespace llmkit_cpu::quant
