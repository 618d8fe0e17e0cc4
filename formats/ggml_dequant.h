// Dequantization of ggml block types that llmq does not store itself (Q5_0, Q5_1 and the
// K-quants Q4_K, Q5_K, Q6_K), so GGUF files holding them can be converted (to fp32 first).
//
// Block layouts follow ggml's `ggml-common.h` (the block_q5_0, block_q5_1, block_q4_K,
// block_q5_K and block_q6_K structs) and the dequantization formulas of ggml's reference
// `dequantize_row_*` functions; they were checked bit for bit against an independent
// implementation, the `gguf` Python package's `gguf.quants.dequantize` (tests/test_gguf.cpp).
// All fp16 fields are IEEE binary16, little-endian. The code reads blocks byte by byte, so a
// source pointer needs no particular alignment.
#pragma once
#include <cstdint>

namespace llmq {

/// ggml_type ids of the types handled here (GGUF's numbering).
enum GgmlTypeId : uint32_t {
  kGgmlQ5_0 = 6,
  kGgmlQ5_1 = 7,
  kGgmlQ4_K = 12,
  kGgmlQ5_K = 13,
  kGgmlQ6_K = 14,
};

constexpr int kQK_K = 256;  ///< weights per K-quant super-block

/// Q5_0: 32 weights = fp16 d; u8 qh[4] (a little-endian u32 whose bit j is bit 4 of weight
/// j's quant); u8 qs[16] (weight j in the low nibble of qs[j], weight j+16 in the high
/// nibble). w = d * (q - 16), q in 0..31. 22 bytes, 5.5 bits per weight.
struct BlockQ5_0 {
  uint16_t d;
  uint8_t qh[4];
  uint8_t qs[16];
};
/// Q5_1: 32 weights = fp16 d; fp16 m; qh[4] and qs[16] as Q5_0. w = d * q + m. 24 bytes.
struct BlockQ5_1 {
  uint16_t d;
  uint16_t m;
  uint8_t qh[4];
  uint8_t qs[16];
};
/// Q4_K: 256 weights in 8 sub-blocks of 32 = fp16 d; fp16 dmin; u8 scales[12] (8 six-bit
/// scales sc[j] and 8 six-bit mins m[j]: for j < 4, sc = scales[j] & 63, m = scales[j+4] & 63;
/// for j >= 4, sc = (scales[j+4] & 15) | (scales[j-4] >> 6) << 4,
/// m = (scales[j+4] >> 4) | (scales[j] >> 6) << 4); u8 qs[128] (64 weights per 32 bytes:
/// sub-block 2c in the low nibbles of qs[32c .. 32c+31], sub-block 2c+1 in the high nibbles).
/// w = (d * sc) * q - (dmin * m). 144 bytes, 4.5 bits per weight.
struct BlockQ4_K {
  uint16_t d;
  uint16_t dmin;
  uint8_t scales[12];
  uint8_t qs[128];
};
/// Q5_K: as Q4_K plus u8 qh[32] before qs: bit 4 of weight l of sub-block j is bit j of
/// qh[l]. w = (d * sc) * q - (dmin * m), q in 0..31. 176 bytes, 5.5 bits per weight.
struct BlockQ5_K {
  uint16_t d;
  uint16_t dmin;
  uint8_t scales[12];
  uint8_t qh[32];
  uint8_t qs[128];
};
/// Q6_K: 256 weights in 16 sub-blocks of 16 = u8 ql[128] (low 4 bits); u8 qh[64] (high 2
/// bits); int8 scales[16]; fp16 d (last). Weight i: h = i / 128, r = i % 128;
/// low = ql[64h + r % 64] >> (4 * (r / 64)) & 15; high = qh[32h + r % 32] >> (2 * (r / 32)) & 3;
/// q = (low | high << 4) - 32; w = (d * scales[i / 16]) * q. 210 bytes, 6.5625 bits per weight.
struct BlockQ6_K {
  uint8_t ql[128];
  uint8_t qh[64];
  int8_t scales[16];
  uint16_t d;
};
static_assert(sizeof(BlockQ5_0) == 22, "Q5_0 block must be 22 bytes (ggml layout)");
static_assert(sizeof(BlockQ5_1) == 24, "Q5_1 block must be 24 bytes (ggml layout)");
static_assert(sizeof(BlockQ4_K) == 144, "Q4_K block must be 144 bytes (ggml layout)");
static_assert(sizeof(BlockQ5_K) == 176, "Q5_K block must be 176 bytes (ggml layout)");
static_assert(sizeof(BlockQ6_K) == 210, "Q6_K block must be 210 bytes (ggml layout)");

/// True when ggml_dequantize_row can decode `ggml_type`: Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, and
/// llmq's own types (F32, F16, BF16, Q8_0, Q4_0, Q4_1; formats/quant.h).
bool ggml_dequant_supported(uint32_t ggml_type);

/// Decodes n weights of ggml type `ggml_type` from `src` (n / block blocks, any alignment)
/// into dst [n] as fp32. llmq's own types are forwarded to dequantize_row (formats/quant.h).
/// The arithmetic is ggml's, in fp32 and in the same order (for Q4_K: d*sc and dmin*m are
/// rounded to fp32 first), so results are bit-identical to ggml's reference dequantization
/// and to gguf-py's, as long as the compiler does not fuse a*b+c into an FMA (the default
/// build targets x86-64 without FMA; a -march with FMA plus -ffp-contract=fast could change
/// the last bit of Q4_1, Q5_1, Q4_K and Q5_K values; tests/test_gguf.cpp would notice).
/// Throws UsageError for an unsupported type or n not a multiple of the type's block size.
void ggml_dequantize_row(uint32_t ggml_type, const void* src, float* dst, int64_t n);

}  // namespace llmq
