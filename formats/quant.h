// Tensor element types and the quantized block formats, with reference quantize/dequantize.
//
// Block layouts are bit-identical to GGUF's types of the same names (ggml-common.h in the
// ggml project defines them), so importing a GGUF tensor of these types is a byte copy.
// The numeric type ids are GGUF's `ggml_type` ids as well.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

namespace llmq {

/// Element type of a stored tensor. Values are GGUF's ggml_type ids.
enum class DType : uint32_t {
  F32 = 0,
  F16 = 1,
  Q4_0 = 2,
  Q4_1 = 3,
  Q5_0 = 6,
  Q5_1 = 7,
  Q8_0 = 8,
  Q2_K = 10,
  Q3_K = 11,
  Q4_K = 12,
  Q5_K = 13,
  Q6_K = 14,
  IQ4_NL = 20,
  BF16 = 30,
};

constexpr int QK = 32;     ///< weights per block of Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/IQ4_NL (and per activation block)
constexpr int QK_K = 256;  ///< weights per super-block of the K-quants (Q2_K … Q6_K)

/// Q8_0: 32 weights = fp16 scale d + 32 int8 q; w = d * q. 34 bytes, 8.5 bits per weight.
struct BlockQ8_0 {
  uint16_t d;      // fp16 scale
  int8_t qs[QK];   // quants
};
/// Q4_0: 32 weights = fp16 scale d + 16 bytes of 4-bit q (q in 0..15, centred on 8):
/// w = d * (q - 8). Byte j holds weight j in its low nibble and weight j+16 in its high nibble.
/// 18 bytes, 4.5 bits per weight.
struct BlockQ4_0 {
  uint16_t d;
  uint8_t qs[QK / 2];
};
/// IQ4_NL: 32 weights = fp16 scale d + 16 bytes of 4-bit indices q into the non-linear table
/// kIQ4NLValues: w = d * kIQ4NLValues[q]. Nibble order as Q4_0. 18 bytes, 4.5 bits per weight
/// (ggml-common.h block_iq4_nl, kvalues_iq4nl).
struct BlockIQ4_NL {
  uint16_t d;
  uint8_t qs[QK / 2];
};
/// IQ4_NL's 16 levels (ggml-common.h kvalues_iq4nl).
inline constexpr int8_t kIQ4NLValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
/// Levels 8h .. 8h + 7 of kIQ4NLValues (h = 0, 1) as the bytes of one word, lowest level in the
/// lowest byte: the table as two register constants for device code, which cannot index the array.
constexpr uint64_t iq4_nl_levels_word(int h) {
  uint64_t w = 0;
  for (int i = 0; i < 8; ++i) w |= uint64_t(uint8_t(kIQ4NLValues[8 * h + i])) << (8 * i);
  return w;
}
/// Q4_1: 32 weights = fp16 scale d + fp16 minimum m + 16 bytes of 4-bit q: w = d * q + m.
/// Nibble order as Q4_0. 20 bytes, 5 bits per weight.
struct BlockQ4_1 {
  uint16_t d;
  uint16_t m;
  uint8_t qs[QK / 2];
};
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
/// Q2_K: 256 weights in 16 sub-blocks of 16 = u8 scales[16] (sub-block k: scale sc = scales[k] & 15,
/// minimum m = scales[k] >> 4); u8 qs[64] (2-bit quants: weight i, h = i / 128, r = i % 128, at bits
/// 2·(r / 32) of qs[32h + r % 32]); fp16 d; fp16 dmin. w = (d · sc) · q − dmin · m
/// (ggml-quants.c dequantize_row_q2_K). 84 bytes, 2.625 bits per weight.
struct BlockQ2_K {
  uint8_t scales[16];
  uint8_t qs[64];
  uint16_t d;
  uint16_t dmin;
};
/// Q3_K: 256 weights in 16 sub-blocks of 16 = u8 hmask[32] (bit 2 of each quant); u8 qs[64]
/// (bits 0-1); u8 scales[12] (16 six-bit scales); fp16 d (last). Weight i: h = i / 128,
/// r = i % 128, j = r / 32, l = r % 32; q = ((qs[32h + l] >> 2j) & 3) | ((hmask[l] >> (4h + j)) & 1) << 2
/// (0..7); sub-block k = i / 16 has the scale s_k = lo | hi << 4, lo = scales[k] & 15 (k < 8) or
/// scales[k − 8] >> 4 (k >= 8), hi = (scales[8 + k % 4] >> 2·(k / 4)) & 3; w = (d · (s_k − 32)) · (q − 4)
/// (ggml-quants.c dequantize_row_q3_K). 110 bytes, 3.4375 bits per weight.
struct BlockQ3_K {
  uint8_t hmask[32];
  uint8_t qs[64];
  uint8_t scales[12];
  uint16_t d;
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
static_assert(sizeof(BlockQ2_K) == 84, "Q2_K block must be 84 bytes (GGUF layout)");
static_assert(sizeof(BlockQ3_K) == 110, "Q3_K block must be 110 bytes (GGUF layout)");
static_assert(sizeof(BlockQ5_0) == 22, "Q5_0 block must be 22 bytes (GGUF layout)");
static_assert(sizeof(BlockQ5_1) == 24, "Q5_1 block must be 24 bytes (GGUF layout)");
static_assert(sizeof(BlockQ4_K) == 144, "Q4_K block must be 144 bytes (GGUF layout)");
static_assert(sizeof(BlockQ5_K) == 176, "Q5_K block must be 176 bytes (GGUF layout)");
static_assert(sizeof(BlockQ6_K) == 210, "Q6_K block must be 210 bytes (GGUF layout)");
static_assert(sizeof(BlockQ8_0) == 34, "Q8_0 block must be 34 bytes (GGUF layout)");
static_assert(sizeof(BlockQ4_0) == 18, "Q4_0 block must be 18 bytes (GGUF layout)");
static_assert(sizeof(BlockQ4_1) == 20, "Q4_1 block must be 20 bytes (GGUF layout)");
static_assert(sizeof(BlockIQ4_NL) == 18, "IQ4_NL block must be 18 bytes (GGUF layout)");

/// Static facts about a type: weights per block and bytes per block.
struct DTypeInfo {
  const char* name;
  int block;          // weights per block (1 for plain floats)
  size_t block_bytes;  // bytes per block
};

/// Info for a type; throws UsageError for an unknown id.
const DTypeInfo& dtype_info(DType t);
/// True if `id` is one of the DType values above.
bool dtype_known(uint32_t id);
/// Lower-case name ("q8_0", "f16", ...).
inline const char* dtype_name(DType t) { return dtype_info(t).name; }
/// Parses a lower-case or upper-case name; throws UsageError listing the known names.
DType dtype_from_name(std::string_view name);
/// Bytes needed for a row of n weights; throws UsageError if n is not a multiple of the block.
size_t row_bytes(DType t, int64_t n);
/// True when rows of length n can be stored in type t (n a multiple of the block size).
bool row_fits(DType t, int64_t n);
/// True for the block-quantized types (everything but F32, F16, BF16).
bool is_quantized(DType t);
/// Every stored type (the ids dtype_known accepts): F32, F16, BF16, then the block types. Tests
/// loop over it, so a new type is in every type x backend row at once.
const std::vector<DType>& all_dtypes();
/// The (sub-)block decomposition every integer kernel uses: a row of a quantized type is a
/// sequence of 32-weight blocks, block b holding w_i = a_h · (q_i − o) − m_h for i in half h
/// (h = i / 16), q_i ≥ 0. `QuantBlock` is that block decoded (formats/quant.cpp,
/// decode_quant_block): 32 unsigned quants, the offset o, the scale and the subtracted minimum of
/// each half (equal except for Q2_K, Q3_K and Q6_K, whose sub-blocks have 16 weights; Q4_1/Q5_1
/// store −m, the K-quants dmin·m). Scales are the exact fp32 products of the file's fields
/// (fp16 × 6- or 8-bit integer, at most 19 significant bits).
struct QuantBlock {
  uint8_t q[32];
  int offset;    ///< o: 128 for Q8_0 (q = w + 128) and IQ4_NL (q = level + 128), 8 Q4_0, 16 Q5_0, 4 Q3_K, 32 Q6_K, else 0
  float a[2];    ///< scale of weights 0..15 and 16..31
  float m[2];    ///< subtracted minimum of each half (0 for the symmetric types)
};
/// The 6-bit scale and minimum of sub-block j (0..7) of a Q4_K / Q5_K super-block from its
/// 12 packed scale bytes `s` (the layout at BlockQ4_K).
inline void k_quant_scale_min(int j, const uint8_t* s, int* sc, int* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}
/// The inverse of k_quant_scale_min: packs the eight 6-bit scales sc[8] and minimums m[8]
/// (0..63) of a Q4_K / Q5_K super-block into its 12 scale bytes `s`.
inline void k_quant_pack_scale_min(const int* sc, const int* m, uint8_t* s) {
  for (int j = 0; j < 4; ++j) {
    s[j] = uint8_t((sc[j] & 63) | (sc[j + 4] >> 4) << 6);
    s[j + 4] = uint8_t((m[j] & 63) | (m[j + 4] >> 4) << 6);
    s[j + 8] = uint8_t((sc[j + 4] & 15) | (m[j + 4] & 15) << 4);
  }
}
// The helpers below are also compiled for the device (engine/cuda/raw_blocks.cuh).
#if defined(__CUDACC__)
#define LLMQ_HOST_DEVICE __host__ __device__
#else
#define LLMQ_HOST_DEVICE
#endif
/// The 6-bit scale (0..63; the weight's factor is d · (s − 32)) of sub-block k (0..15) of a Q3_K
/// super-block from its 12 packed scale bytes `s` (the layout at BlockQ3_K).
LLMQ_HOST_DEVICE inline int q3_k_scale(const uint8_t* s, int k) {
  return ((k < 8 ? s[k] : s[k - 8] >> 4) & 15) | ((s[8 + k % 4] >> (2 * (k / 4))) & 3) << 4;
}
/// The 2-bit quant (bits 0-1) of weight l (0..31) of 32-weight block j (0..7) of a Q2_K or Q3_K
/// super-block whose qs[64] is `qs` (the layout at BlockQ2_K and BlockQ3_K); Q3_K's bit 2 of
/// that weight is bit j of hmask[l].
LLMQ_HOST_DEVICE inline int k_crumb(const uint8_t* qs, int j, int l) { return (qs[32 * (j / 4) + l] >> (2 * (j % 4))) & 3; }
/// Decodes 32-weight block b (0-based, counting 32-weight blocks along the row) of a row of
/// quantized type t at `row`. Throws nothing; t must be quantized.
void decode_quant_block(DType t, const uint8_t* row, int64_t b, QuantBlock& out);

// --- scalar conversions (IEEE 754 binary16 and bfloat16) ---

/// fp32 -> fp16 with round-to-nearest-even; overflow becomes ±Inf, NaN stays NaN.
uint16_t fp32_to_fp16(float f);
/// fp16 -> fp32 (exact, subnormals included).
float fp16_to_fp32(uint16_t h);
/// fp32 -> bf16 with round-to-nearest-even (the top 16 bits of the fp32 pattern).
uint16_t fp32_to_bf16(float f);
/// bf16 -> fp32 (exact).
inline float bf16_to_fp32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// --- reference quantize / dequantize of one row ---

/// Encodes n floats `x` [n] into type t at `dst` (row_bytes(t, n) bytes).
/// Reference quantizers (as in ggml's reference functions): Q8_0 d = max|x|/127, q = round(x/d);
/// Q4_0 d = m/-8 where m is the x of largest magnitude, q = clamp(trunc(x/d + 8.5), 0, 15);
/// Q4_1 d = (max-min)/15, m = min, q = clamp(trunc((x-min)/d + 0.5), 0, 15); Q5_0 and Q5_1 as
/// Q4_0 and Q4_1 with 16 and 31 for 8 and 15; IQ4_NL the scale of least squared error among
/// candidates around the one that maps the value of largest magnitude to −127, each weight at
/// its nearest level. The K-quants use llmq's own search (not
/// llama.cpp's): per sub-block the grid of least squared error among clipped ranges of
/// [min(0, x), max x] (Q2_K/Q4_K/Q5_K, an affine fit; Q2_K's errors weighted by |x|) or scales that map the value of largest
/// magnitude to -32 (Q6_K; Q3_K -4, its errors weighted by x²) or nearer zero, each refined by
/// least squares on its codes;
/// the sub-block scales and mins rounded to 6 (8) bits against the super-block's largest, then
/// every weight rounded to nearest with the rounded scales.
/// Throws UsageError if x holds NaN or Inf, or n is not a multiple of the block size.
void quantize_row(DType t, const float* x, void* dst, int64_t n);
/// Index of the first weight among n of type t at `src` whose value is not finite (a NaN or
/// infinite element of a float type; a weight of a block whose scale or minimum is not finite),
/// or -1 when all are. Checks a lossless repack, which never dequantizes.
int64_t first_nonfinite(DType t, const void* src, int64_t n);
/// Decodes n weights of type t from `src` into `y` [n].
void dequantize_row(DType t, const void* src, float* y, int64_t n);

}  // namespace llmq
