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

namespace llmq {

/// Element type of a stored tensor. Values are GGUF's ggml_type ids.
enum class DType : uint32_t {
  F32 = 0,
  F16 = 1,
  Q4_0 = 2,
  Q4_1 = 3,
  Q8_0 = 8,
  BF16 = 30,
};

constexpr int QK = 32;  ///< weights per quantization block (all block types here)

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
/// Q4_1: 32 weights = fp16 scale d + fp16 minimum m + 16 bytes of 4-bit q: w = d * q + m.
/// Nibble order as Q4_0. 20 bytes, 5 bits per weight.
struct BlockQ4_1 {
  uint16_t d;
  uint16_t m;
  uint8_t qs[QK / 2];
};
static_assert(sizeof(BlockQ8_0) == 34, "Q8_0 block must be 34 bytes (GGUF layout)");
static_assert(sizeof(BlockQ4_0) == 18, "Q4_0 block must be 18 bytes (GGUF layout)");
static_assert(sizeof(BlockQ4_1) == 20, "Q4_1 block must be 20 bytes (GGUF layout)");

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
/// Q4_1 d = (max-min)/15, m = min, q = clamp(trunc((x-min)/d + 0.5), 0, 15).
/// Throws UsageError if x holds NaN or Inf, or n is not a multiple of the block size.
void quantize_row(DType t, const float* x, void* dst, int64_t n);
/// Decodes n weights of type t from `src` into `y` [n].
void dequantize_row(DType t, const void* src, float* y, int64_t n);

}  // namespace llmq
