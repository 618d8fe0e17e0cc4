#include "formats/quant.h"

#include <algorithm>
#include <cctype>
#include <cmath>

#include "base/error.h"

namespace llmq {

namespace {
const DTypeInfo kF32{"f32", 1, 4};
const DTypeInfo kF16{"f16", 1, 2};
const DTypeInfo kBF16{"bf16", 1, 2};
const DTypeInfo kQ8_0{"q8_0", QK, sizeof(BlockQ8_0)};
const DTypeInfo kQ4_0{"q4_0", QK, sizeof(BlockQ4_0)};
const DTypeInfo kQ4_1{"q4_1", QK, sizeof(BlockQ4_1)};
constexpr DType kAll[] = {DType::F32, DType::F16, DType::BF16, DType::Q8_0, DType::Q4_0, DType::Q4_1};

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
}  // namespace

const DTypeInfo& dtype_info(DType t) {
  switch (t) {
    case DType::F32: return kF32;
    case DType::F16: return kF16;
    case DType::BF16: return kBF16;
    case DType::Q8_0: return kQ8_0;
    case DType::Q4_0: return kQ4_0;
    case DType::Q4_1: return kQ4_1;
  }
  throw UsageError("unknown tensor type id " + std::to_string(uint32_t(t)));
}

bool dtype_known(uint32_t id) {
  for (DType t : kAll)
    if (uint32_t(t) == id) return true;
  return false;
}

DType dtype_from_name(std::string_view name) {
  std::string lower(name);
  for (char& c : lower) c = char(std::tolower(static_cast<unsigned char>(c)));
  std::string known;
  for (DType t : kAll) {
    if (lower == dtype_info(t).name) return t;
    known += std::string(known.empty() ? "" : ", ") + dtype_info(t).name;
  }
  throw UsageError("unknown type '" + std::string(name) + "' (known: " + known + ")");
}

bool row_fits(DType t, int64_t n) { return n > 0 && n % dtype_info(t).block == 0; }

size_t row_bytes(DType t, int64_t n) {
  const DTypeInfo& info = dtype_info(t);
  if (n < 0 || n % info.block != 0)
    throw UsageError("row of " + std::to_string(n) + " weights does not fit " + info.name +
                     " blocks of " + std::to_string(info.block));
  return size_t(n / info.block) * info.block_bytes;
}

// IEEE 754 binary16: 1 sign, 5 exponent (bias 15), 10 mantissa bits.
uint16_t fp32_to_fp16(float f) {
  const uint32_t u = bits_of(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t abs = u & 0x7fffffffu;
  if (abs >= 0x7f800000u)  // Inf or NaN (keep NaN quiet and non-zero)
    return uint16_t(sign | 0x7c00u | (abs > 0x7f800000u ? 0x0200u : 0u));
  if (abs >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65520: overflow
  if (abs < 0x38800000u) {  // below the smallest normal fp16 (2^-14): subnormal or zero
    // value = abs_f; fp16 subnormal unit is 2^-24. Round-to-nearest-even via float math.
    const float a = float_of(abs);
    const float scaled = a * 16777216.0f;  // a / 2^-24, exact (power-of-two scaling)
    const uint32_t q = uint32_t(std::nearbyint(scaled));  // default rounding: nearest-even
    return uint16_t(sign | q);
  }
  // Normal: rebias exponent and round the 13 dropped mantissa bits to nearest-even.
  uint32_t mant = abs & 0x7fffffu;
  uint32_t exp = (abs >> 23) - 127 + 15;
  uint32_t h = (exp << 10) | (mant >> 13);
  const uint32_t rest = mant & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h += 1;  // may carry into exponent: fine
  return uint16_t(sign | h);
}

float fp16_to_fp32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24
    const float v = float(mant) * (1.0f / 16777216.0f);
    return float_of(bits_of(v) | sign);
  }
  if (exp == 31) return float_of(sign | 0x7f800000u | (mant << 13));
  return float_of(sign | ((exp - 15 + 127) << 23) | (mant << 13));
}

uint16_t fp32_to_bf16(float f) {
  uint32_t u = bits_of(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x0040u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return uint16_t(u >> 16);
}

namespace {

void check_finite(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(x[i]))
      throw UsageError("cannot quantize: value " + std::to_string(x[i]) + " at index " +
                       std::to_string(i) + " is not finite");
}

void quantize_q8_0(const float* x, BlockQ8_0* b, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += QK) {
    float amax = 0.0f;
    for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    b[i].d = fp32_to_fp16(d);
    for (int j = 0; j < QK; ++j) b[i].qs[j] = int8_t(std::lround(x[j] * id));
  }
}

void quantize_q4_0(const float* x, BlockQ4_0* b, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += QK) {
    float amax = 0.0f, m = 0.0f;  // m: the value of largest magnitude, with its sign
    for (int j = 0; j < QK; ++j)
      if (std::fabs(x[j]) > amax) amax = std::fabs(x[j]), m = x[j];
    const float d = m / -8.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    b[i].d = fp32_to_fp16(d);
    for (int j = 0; j < QK / 2; ++j) {
      const int lo = std::min(15, int(x[j] * id + 8.5f));
      const int hi = std::min(15, int(x[j + QK / 2] * id + 8.5f));
      b[i].qs[j] = uint8_t(lo | (hi << 4));
    }
  }
}

void quantize_q4_1(const float* x, BlockQ4_1* b, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += QK) {
    float lo = x[0], hi = x[0];
    for (int j = 1; j < QK; ++j) lo = std::min(lo, x[j]), hi = std::max(hi, x[j]);
    const float d = (hi - lo) / 15.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    b[i].d = fp32_to_fp16(d);
    b[i].m = fp32_to_fp16(lo);
    for (int j = 0; j < QK / 2; ++j) {
      const int q0 = std::min(15, int((x[j] - lo) * id + 0.5f));
      const int q1 = std::min(15, int((x[j + QK / 2] - lo) * id + 0.5f));
      b[i].qs[j] = uint8_t(q0 | (q1 << 4));
    }
  }
}

}  // namespace

void quantize_row(DType t, const float* x, void* dst, int64_t n) {
  row_bytes(t, n);  // validates n
  check_finite(x, n);
  const int64_t nb = n / QK;
  switch (t) {
    case DType::F32: std::memcpy(dst, x, size_t(n) * 4); return;
    case DType::F16: {
      auto* y = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) y[i] = fp32_to_fp16(x[i]);
      for (int64_t i = 0; i < n; ++i)
        if ((y[i] & 0x7c00u) == 0x7c00u)
          throw UsageError("cannot store as f16: value " + std::to_string(x[i]) + " overflows");
      return;
    }
    case DType::BF16: {
      auto* y = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) y[i] = fp32_to_bf16(x[i]);
      return;
    }
    case DType::Q8_0: quantize_q8_0(x, static_cast<BlockQ8_0*>(dst), nb); return;
    case DType::Q4_0: quantize_q4_0(x, static_cast<BlockQ4_0*>(dst), nb); return;
    case DType::Q4_1: quantize_q4_1(x, static_cast<BlockQ4_1*>(dst), nb); return;
  }
}

void dequantize_row(DType t, const void* src, float* y, int64_t n) {
  row_bytes(t, n);
  const int64_t nb = n / QK;
  switch (t) {
    case DType::F32: std::memcpy(y, src, size_t(n) * 4); return;
    case DType::F16: {
      auto* x = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) y[i] = fp16_to_fp32(x[i]);
      return;
    }
    case DType::BF16: {
      auto* x = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) y[i] = bf16_to_fp32(x[i]);
      return;
    }
    case DType::Q8_0: {
      auto* b = static_cast<const BlockQ8_0*>(src);
      for (int64_t i = 0; i < nb; ++i) {
        const float d = fp16_to_fp32(b[i].d);
        for (int j = 0; j < QK; ++j) y[i * QK + j] = d * float(b[i].qs[j]);
      }
      return;
    }
    case DType::Q4_0: {
      auto* b = static_cast<const BlockQ4_0*>(src);
      for (int64_t i = 0; i < nb; ++i) {
        const float d = fp16_to_fp32(b[i].d);
        for (int j = 0; j < QK / 2; ++j) {
          y[i * QK + j] = d * float((b[i].qs[j] & 0x0f) - 8);
          y[i * QK + j + QK / 2] = d * float((b[i].qs[j] >> 4) - 8);
        }
      }
      return;
    }
    case DType::Q4_1: {
      auto* b = static_cast<const BlockQ4_1*>(src);
      for (int64_t i = 0; i < nb; ++i) {
        const float d = fp16_to_fp32(b[i].d), m = fp16_to_fp32(b[i].m);
        for (int j = 0; j < QK / 2; ++j) {
          y[i * QK + j] = d * float(b[i].qs[j] & 0x0f) + m;
          y[i * QK + j + QK / 2] = d * float(b[i].qs[j] >> 4) + m;
        }
      }
      return;
    }
  }
}

}  // namespace llmq
