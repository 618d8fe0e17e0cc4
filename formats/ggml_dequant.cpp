#include "formats/ggml_dequant.h"

#include <cstring>
#include <string>
#include <vector>

#include "base/error.h"
#include "formats/quant.h"

namespace llmq {

namespace {

// Little-endian fp16 at p (any alignment) as fp32.
inline float half_at(const uint8_t* p) { return fp16_to_fp32(uint16_t(p[0] | (p[1] << 8))); }

// Q5_0 / Q5_1: 32 weights per block; has_min selects Q5_1 (fp16 m after d).
void dequant_q5(const uint8_t* b, float* y, int64_t nb, bool has_min) {
  const size_t bytes = has_min ? sizeof(BlockQ5_1) : sizeof(BlockQ5_0);
  for (int64_t i = 0; i < nb; ++i, b += bytes, y += 32) {
    const float d = half_at(b);
    const float m = has_min ? half_at(b + 2) : 0.0f;
    const uint8_t* qhp = b + (has_min ? 4 : 2);
    const uint8_t* qs = qhp + 4;
    const uint32_t qh = uint32_t(qhp[0]) | uint32_t(qhp[1]) << 8 | uint32_t(qhp[2]) << 16 | uint32_t(qhp[3]) << 24;
    for (int j = 0; j < 16; ++j) {
      const int lo = (qs[j] & 0x0f) | int((qh >> j) & 1) << 4;
      const int hi = (qs[j] >> 4) | int((qh >> (j + 16)) & 1) << 4;
      if (has_min) {
        y[j] = d * float(lo) + m;
        y[j + 16] = d * float(hi) + m;
      } else {
        y[j] = d * float(lo - 16);
        y[j + 16] = d * float(hi - 16);
      }
    }
  }
}

// The 6-bit scale and min of sub-block j (0..7) from the 12 packed bytes of Q4_K / Q5_K.
inline void scale_min_k4(int j, const uint8_t* s, int* sc, int* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Q4_K / Q5_K: 256 weights per block; five_bit selects Q5_K (qh[32] before qs).
void dequant_k45(const uint8_t* b, float* y, int64_t nb, bool five_bit) {
  const size_t bytes = five_bit ? sizeof(BlockQ5_K) : sizeof(BlockQ4_K);
  for (int64_t i = 0; i < nb; ++i, b += bytes, y += kQK_K) {
    const float d = half_at(b), dmin = half_at(b + 2);
    const uint8_t* scales = b + 4;
    const uint8_t* qh = b + 16;
    const uint8_t* qs = five_bit ? b + 48 : b + 16;
    for (int j = 0; j < 8; ++j) {  // sub-block j: weights 32j .. 32j+31
      int sc, m;
      scale_min_k4(j, scales, &sc, &m);
      const float d1 = d * float(sc);
      const float m1 = dmin * float(m);
      const uint8_t* q = qs + 32 * (j / 2);
      const int shift = 4 * (j % 2);
      for (int l = 0; l < 32; ++l) {
        int v = (q[l] >> shift) & 0x0f;
        if (five_bit) v |= ((qh[l] >> j) & 1) << 4;
        y[32 * j + l] = d1 * float(v) - m1;
      }
    }
  }
}

void dequant_q6_k(const uint8_t* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, b += sizeof(BlockQ6_K), y += kQK_K) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const auto* scales = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half_at(b + 208);
    for (int w = 0; w < kQK_K; ++w) {
      const int h = w / 128, r = w % 128;
      const int lo = (ql[64 * h + r % 64] >> (4 * (r / 64))) & 0x0f;
      const int hi = (qh[32 * h + r % 32] >> (2 * (r / 32))) & 0x03;
      const float dl = d * float(scales[w / 16]);
      y[w] = dl * float((lo | hi << 4) - 32);
    }
  }
}

bool is_ours(uint32_t t) { return dtype_known(t); }

}  // namespace

bool ggml_dequant_supported(uint32_t t) {
  switch (t) {
    case kGgmlQ5_0: case kGgmlQ5_1: case kGgmlQ4_K: case kGgmlQ5_K: case kGgmlQ6_K: return true;
    default: return is_ours(t);
  }
}

void ggml_dequantize_row(uint32_t t, const void* src, float* dst, int64_t n) {
  if (is_ours(t)) {
    if (reinterpret_cast<uintptr_t>(src) % alignof(uint32_t) == 0) {
      dequantize_row(DType(t), src, dst, n);
    } else {  // dequantize_row reads through block structs: give it an aligned copy
      const size_t bytes = row_bytes(DType(t), n);
      std::vector<uint32_t> tmp((bytes + 3) / 4);
      std::memcpy(tmp.data(), src, bytes);
      dequantize_row(DType(t), tmp.data(), dst, n);
    }
    return;
  }
  int64_t block = 0;
  switch (t) {
    case kGgmlQ5_0: case kGgmlQ5_1: block = 32; break;
    case kGgmlQ4_K: case kGgmlQ5_K: case kGgmlQ6_K: block = kQK_K; break;
    default: throw UsageError("ggml_dequantize_row: ggml type " + std::to_string(t) + " is not supported");
  }
  if (n < 0 || n % block != 0)
    throw UsageError("ggml_dequantize_row: " + std::to_string(n) + " weights is not a multiple of the block (" +
                     std::to_string(block) + ")");
  const auto* b = static_cast<const uint8_t*>(src);
  const int64_t nb = n / block;
  switch (t) {
    case kGgmlQ5_0: dequant_q5(b, dst, nb, false); break;
    case kGgmlQ5_1: dequant_q5(b, dst, nb, true); break;
    case kGgmlQ4_K: dequant_k45(b, dst, nb, false); break;
    case kGgmlQ5_K: dequant_k45(b, dst, nb, true); break;
    case kGgmlQ6_K: dequant_q6_k(b, dst, nb); break;
  }
}

}  // namespace llmq
