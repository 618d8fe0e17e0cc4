#include "formats/ggml_dequant.h"

#include <cstring>
#include <string>
#include <vector>

#include "base/error.h"
#include "formats/quant.h"

namespace llmq {

void ggml_dequantize_row(uint32_t t, const void* src, float* dst, int64_t n) {
  if (!dtype_known(t)) throw UsageError("ggml_dequantize_row: ggml type " + std::to_string(t) + " is not supported");
  if (reinterpret_cast<uintptr_t>(src) % alignof(uint32_t) == 0) return dequantize_row(DType(t), src, dst, n);
  // The float paths of dequantize_row read through typed pointers: give them an aligned copy.
  const size_t bytes = row_bytes(DType(t), n);
  std::vector<uint32_t> tmp((bytes + 3) / 4);
  std::memcpy(tmp.data(), src, bytes);
  dequantize_row(DType(t), tmp.data(), dst, n);
}

}  // namespace llmq
