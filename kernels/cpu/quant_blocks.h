// The packed weight layouts of llmkit's quantized linears (quant_repack.h writes them,
// quant_linear.h reads them).
//
// Every format is stored in groups of eight output rows ("x8"): a group is the eight rows'
// blocks interleaved, block after block, so one group is one contiguous stream and one AVX2
// register holds the same four inputs of all eight rows (lane r = row r). A product of such a
// register with four broadcast activations gives eight rows' partial dot products at once, with
// no horizontal sums, and every output is one sequential chain of float32 FMAs over its blocks
// (the scalar fallback replays the same chain with std::fma, so both give the same bits).
//
// Within a 32-input block the 4-bit and 6-bit formats keep GGUF Q4_0's nibble order: byte i of
// a row's 16 holds input i (low nibble) and input 16 + i (high nibble), so the four bytes
// 4j..4j+3 hold inputs 4j..4j+3 and 16+4j..16+4j+3: one register of eight rows' four bytes
// unpacks, by a mask and a shift, into the products for two "quads" of inputs. Q4_K and Q6_K
// (whose GGUF order differs) are re-nibbled into it at repack; their 6-bit scales are unpacked
// to bytes. No format is ever widened to floats.
#pragma once

#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <string>

namespace llmkit_cpu::quant {

constexpr int64_t kRows = 8;   // output rows per group
constexpr int64_t kBlock = 32; // inputs per activation block (and per Q4/Q8 weight block)
constexpr int64_t kSuper = 256; // inputs per K-quant super-block

enum class Format { Q4_0, Q4_1, Q8_0, Q4_K, Q6_K, INT8, FP8 };

// A format's layout: how many inputs one packed group-block covers and its bytes, and the
// GGUF block it is repacked from (int8 and fp8 come from row-major bytes, one per weight).
struct FormatInfo {
  Format format;
  const char* name;
  int64_t block_k;         // inputs per packed block (and per GGUF block)
  int64_t group_bytes;     // bytes of one packed block of all eight rows
  int64_t gguf_bytes;      // bytes of one GGUF block of one row (0: not a GGUF block format)
  bool row_scales;         // a float32 scale per output row beside the packed data
};

// ---- per-group block structs (eight rows) -------------------------------------------------
struct Q4_0x8 {              // one 32-input block of eight Q4_0 rows
  uint16_t d[kRows];         // fp16 scales
  uint8_t qs[4][kRows][4];   // qs[j][r] = row r's bytes 4j..4j+3 (Q4_0 nibble order)
};
struct Q4_1x8 {
  uint16_t d[kRows];
  uint16_t m[kRows];         // fp16 minimums
  uint8_t qs[4][kRows][4];
};
struct Q8_0x8 {
  uint16_t d[kRows];
  int8_t qs[8][kRows][4];    // qs[j][r] = row r's inputs 4j..4j+3
};
struct Q4_Kx8 {              // one 256-input super-block of eight Q4_K rows
  uint16_t d[kRows];
  uint16_t dmin[kRows];
  uint8_t sc[8][kRows];      // sc[s][r]: sub-block s's 6-bit scale, one byte
  uint8_t m[8][kRows];       // its 6-bit minimum
  uint8_t qs[8][4][kRows][4]; // per 32-input sub-block, as Q4_0x8::qs
};
struct Q6_Kx8 {              // one 256-input super-block of eight Q6_K rows
  uint16_t d[kRows];
  int8_t sc[8][kRows][2];    // sc[b][r]: the scales of sub-blocks 2b, 2b+1 (16 inputs each)
  uint8_t ql[8][4][kRows][4]; // low four bits, per 32-input block as Q4_0x8::qs
  uint8_t qh[8][2][kRows][4]; // high two bits: qh[b][h][r] byte t, bits 2u..2u+1 = input
                              // 16h + 4u + t of block b
};
struct I8x8 {                // int8 weight-only: 32 inputs of eight rows
  int8_t qs[8][kRows][4];
};
struct F8x8 {                // fp8 e4m3 weights: 32 inputs of eight rows
  uint8_t qs[kBlock][kRows]; // qs[i][r] = row r's input i (eight rows of one input together)
};

static_assert(sizeof(Q4_0x8) == 144 && sizeof(Q4_1x8) == 160 && sizeof(Q8_0x8) == 272);
static_assert(sizeof(Q4_Kx8) == 1184 && sizeof(Q6_Kx8) == 1680);
static_assert(sizeof(I8x8) == 256 && sizeof(F8x8) == 256);

// The packed block struct of each format.
template <Format F> struct PackedBlock;
template <> struct PackedBlock<Format::Q4_0> { using type = Q4_0x8; };
template <> struct PackedBlock<Format::Q4_1> { using type = Q4_1x8; };
template <> struct PackedBlock<Format::Q8_0> { using type = Q8_0x8; };
template <> struct PackedBlock<Format::Q4_K> { using type = Q4_Kx8; };
template <> struct PackedBlock<Format::Q6_K> { using type = Q6_Kx8; };
template <> struct PackedBlock<Format::INT8> { using type = I8x8; };
template <> struct PackedBlock<Format::FP8> { using type = F8x8; };
template <Format F> using packed_block_t = typename PackedBlock<F>::type;

inline const FormatInfo& format_info(Format f) {
  static const FormatInfo infos[] = {
      {Format::Q4_0, "q4_0", kBlock, sizeof(Q4_0x8), 18, false},
      {Format::Q4_1, "q4_1", kBlock, sizeof(Q4_1x8), 20, false},
      {Format::Q8_0, "q8_0", kBlock, sizeof(Q8_0x8), 34, false},
      {Format::Q4_K, "q4_k", kSuper, sizeof(Q4_Kx8), 144, false},
      {Format::Q6_K, "q6_k", kSuper, sizeof(Q6_Kx8), 210, false},
      {Format::INT8, "int8", kBlock, sizeof(I8x8), 0, true},
      {Format::FP8, "fp8", kBlock, sizeof(F8x8), 0, true},
  };
  return infos[static_cast<int>(f)];
}

inline Format parse_format(const std::string& name) {
  for (int i = 0; i <= static_cast<int>(Format::FP8); ++i)
    if (name == format_info(static_cast<Format>(i)).name) return static_cast<Format>(i);
  TORCH_CHECK(false, "quantized linear: unknown weight format '", name,
              "' (q4_0, q4_1, q8_0, q4_k, q6_k, int8, fp8)");
}

inline int64_t div_up(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Inputs a packed row covers: K rounded up to the format's block (int8/fp8 pad with zeros;
// GGUF formats must be whole blocks already).
inline int64_t padded_k(Format f, int64_t k) {
  return div_up(k, format_info(f).block_k) * format_info(f).block_k;
}

// Bytes of the packed weight of an [n, k] matrix.
inline int64_t packed_bytes(Format f, int64_t n, int64_t k) {
  const FormatInfo& info = format_info(f);
  return div_up(n, kRows) * (padded_k(f, k) / info.block_k) * info.group_bytes;
}

inline float half_to_float(uint16_t h) {
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

// fp8 e4m3 -> the fp16 whose value is 2^-8 times it (exactly: the exponent bias differs by 8
// and fp16's subnormals line up with e4m3's), so a scale of 256 restores it. The sign moves
// from bit 14 to bit 15 by adding it to itself.
inline uint16_t e4m3_to_half_bits_scaled(uint8_t b) {
  const uint16_t t = static_cast<uint16_t>(b) << 7;
  return static_cast<uint16_t>(t + (t & 0x4000));
}
constexpr float kFp8HalfScale = 256.f;

}  // namespace llmkit_cpu::quant
