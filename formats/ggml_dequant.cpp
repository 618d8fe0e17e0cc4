#include "formats/ggml_dequant.h"

#include <cstring>
#include <string>
#include <vector>

#include "base/error.h"
#include "formats/quant.h"

namespace llmq {

namespace {

constexpr uint32_t kIQ4_NL = 20;
constexpr size_t kIQ4NLBytes = 18;
constexpr int8_t kIq4nlValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// One IQ4_NL block (18 bytes) as one Q8_0 block.
void widen_iq4_nl_block(const uint8_t* in, BlockQ8_0& o) {
  std::memcpy(&o.d, in, 2);
  for (int j = 0; j < 16; ++j) {
    o.qs[j] = kIq4nlValues[in[2 + j] & 15];
    o.qs[j + 16] = kIq4nlValues[in[2 + j] >> 4];
  }
}

}  // namespace

bool ggml_widened_type(uint32_t t, DType* out) {
  if (t != kIQ4_NL) return false;
  *out = DType::Q8_0;
  return true;
}

void ggml_widen_row(uint32_t t, const void* src, uint8_t* dst, int64_t n) {
  DType wide;
  if (!ggml_widened_type(t, &wide)) throw UsageError("ggml_widen_row: ggml type " + std::to_string(t) + " is not widened");
  const int block = dtype_info(wide).block;
  if (n % block != 0) throw UsageError("ggml_widen_row: " + std::to_string(n) + " weights is not a whole number of blocks");
  const auto* in = static_cast<const uint8_t*>(src);
  for (int64_t b = 0; b < n / block; ++b) {
    BlockQ8_0 o;
    widen_iq4_nl_block(in + b * kIQ4NLBytes, o);
    std::memcpy(dst + b * sizeof o, &o, sizeof o);
  }
}

void ggml_dequantize_row(uint32_t t, const void* src, float* dst, int64_t n) {
  if (DType wide; ggml_widened_type(t, &wide)) {  // through the wider type: the same values
    if (n % dtype_info(wide).block != 0) throw UsageError("ggml_dequantize_row: " + std::to_string(n) + " weights is not a whole number of blocks");
    std::vector<uint32_t> tmp((row_bytes(wide, n) + 3) / 4);
    ggml_widen_row(t, src, reinterpret_cast<uint8_t*>(tmp.data()), n);
    return dequantize_row(wide, tmp.data(), dst, n);
  }
  if (!dtype_known(t)) throw UsageError("ggml_dequantize_row: ggml type " + std::to_string(t) + " is not supported");
  if (reinterpret_cast<uintptr_t>(src) % alignof(uint32_t) == 0) return dequantize_row(DType(t), src, dst, n);
  // The float paths of dequantize_row read through typed pointers: give them an aligned copy.
  const size_t bytes = row_bytes(DType(t), n);
  std::vector<uint32_t> tmp((bytes + 3) / 4);
  std::memcpy(tmp.data(), src, bytes);
  dequantize_row(DType(t), tmp.data(), dst, n);
}

}  // namespace llmq
