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
const DTypeInfo kQ5_0{"q5_0", QK, sizeof(BlockQ5_0)};
const DTypeInfo kQ5_1{"q5_1", QK, sizeof(BlockQ5_1)};
const DTypeInfo kIQ4_NL{"iq4_nl", QK, sizeof(BlockIQ4_NL)};
const DTypeInfo kQ2_K{"q2_k", QK_K, sizeof(BlockQ2_K)};
const DTypeInfo kQ3_K{"q3_k", QK_K, sizeof(BlockQ3_K)};
const DTypeInfo kQ4_K{"q4_k", QK_K, sizeof(BlockQ4_K)};
const DTypeInfo kQ5_K{"q5_k", QK_K, sizeof(BlockQ5_K)};
const DTypeInfo kQ6_K{"q6_k", QK_K, sizeof(BlockQ6_K)};
constexpr DType kAll[] = {DType::F32,  DType::F16,  DType::BF16, DType::Q8_0, DType::Q4_0, DType::Q4_1,
                          DType::Q5_0, DType::Q5_1, DType::Q2_K, DType::Q3_K, DType::Q4_K, DType::Q5_K, DType::Q6_K,
                          DType::IQ4_NL};

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
    case DType::Q5_0: return kQ5_0;
    case DType::Q5_1: return kQ5_1;
    case DType::IQ4_NL: return kIQ4_NL;
    case DType::Q2_K: return kQ2_K;
    case DType::Q3_K: return kQ3_K;
    case DType::Q4_K: return kQ4_K;
    case DType::Q5_K: return kQ5_K;
    case DType::Q6_K: return kQ6_K;
  }
  throw UsageError("unknown tensor type id " + std::to_string(uint32_t(t)));
}

const std::vector<DType>& all_dtypes() {
  static const std::vector<DType> all(std::begin(kAll), std::end(kAll));
  return all;
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


// Writes the 5th bits qh (bit j = bit 4 of weight j) and the nibbles of 32 quants q[32].
void pack_q5(const int* q, uint8_t* qh, uint8_t* qs) {
  uint32_t h = 0;
  for (int j = 0; j < 16; ++j) {
    qs[j] = uint8_t((q[j] & 15) | (q[j + 16] & 15) << 4);
    h |= uint32_t(q[j] >> 4) << j | uint32_t(q[j + 16] >> 4) << (j + 16);
  }
  std::memcpy(qh, &h, 4);  // little-endian hosts only (as the whole format)
}

// Q5_0 (has_min false) and Q5_1 (true): as quantize_q4_0 / quantize_q4_1 with 5-bit quants.
void quantize_q5(const float* x, uint8_t* out, int64_t nb, bool has_min) {
  const size_t bytes = has_min ? sizeof(BlockQ5_1) : sizeof(BlockQ5_0);
  for (int64_t i = 0; i < nb; ++i, x += QK, out += bytes) {
    int q[QK];
    if (has_min) {
      float lo = x[0], hi = x[0];
      for (int j = 1; j < QK; ++j) lo = std::min(lo, x[j]), hi = std::max(hi, x[j]);
      const float d = (hi - lo) / 31.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
      const uint16_t dh = fp32_to_fp16(d), mh = fp32_to_fp16(lo);
      std::memcpy(out, &dh, 2), std::memcpy(out + 2, &mh, 2);
      for (int j = 0; j < QK; ++j) q[j] = std::min(31, int((x[j] - lo) * id + 0.5f));
    } else {
      float amax = 0.0f, m = 0.0f;
      for (int j = 0; j < QK; ++j)
        if (std::fabs(x[j]) > amax) amax = std::fabs(x[j]), m = x[j];
      const float d = m / -16.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
      const uint16_t dh = fp32_to_fp16(d);
      std::memcpy(out, &dh, 2);
      for (int j = 0; j < QK; ++j) q[j] = std::min(31, int(x[j] * id + 16.5f));
    }
    const size_t off = has_min ? 4 : 2;
    pack_q5(q, out + off, out + off + 4);
  }
}

// Rounds v / scale to the nearest integer in [lo, hi] (0 when scale is 0).
int round_clamp(float v, float scale, int lo, int hi) {
  if (scale == 0.0f) return std::clamp(0, lo, hi);
  return std::clamp(int(std::lround(v / scale)), lo, hi);
}

// The affine fit x ≈ a·q − b of n values (q in [0, qmax], a >= 0, b >= 0) with the least squared
// error among grids that clip the range [min(0, x), max(x)] by up to 30% at either end, each
// refined once by least squares on its integer codes (ordinary linear regression of x on q;
// the offset held at <= 0, K-quants store -b with b >= 0). `weighted` (Q2_K): errors and
// regression weighted by |x|, as llama.cpp's Q2_K quantizer weights them (with 2-bit codes the
// large weights need the fit most: Qwen2.5-0.5B's ffn_down in Q2_K, mean KLD 0.283 -> 0.278,
// llama.cpp's quantizer 0.285). Our own search: the plain range (t = 0) is one candidate, so it
// never does worse than min/max rounding.
void fit_affine(const float* x, int n, int qmax, float* a_out, float* b_out, bool weighted = false) {
  float lo = 0.0f, hi = x[0];
  for (int l = 0; l < n; ++l) lo = std::min(lo, x[l]), hi = std::max(hi, x[l]);
  float best_a = (hi - lo) / float(qmax), best_b = -lo;
  if (hi <= lo) {
    *a_out = 0.0f, *b_out = -lo;
    return;
  }
  auto weight = [&](int l) { return weighted ? std::fabs(double(x[l])) : 1.0; };
  auto error = [&](float a, float b) {
    double e = 0;
    for (int l = 0; l < n; ++l) {
      const int q = a > 0 ? std::clamp(int(std::lround((x[l] + b) / a)), 0, qmax) : 0;
      const double d = double(a) * q - b - x[l];
      e += weight(l) * d * d;
    }
    return e;
  };
  double best = error(best_a, best_b);
  for (int t_lo = 0; t_lo <= 6; ++t_lo)
    for (int t_hi = 0; t_hi <= 6; ++t_hi) {
      const float range = hi - lo, l0 = std::min(0.0f, lo + 0.05f * float(t_lo) * range), h0 = hi - 0.05f * float(t_hi) * range;
      if (h0 <= l0) continue;
      float a = (h0 - l0) / float(qmax), b = -l0;
      for (int pass = 0; pass < 2; ++pass) {
        const double e = error(a, b);
        if (e < best) best = e, best_a = a, best_b = b;
        // (Weighted) least squares of x on the codes q: a = cov(q, x) / var(q), offset = mean(x) -
        // a·mean(q).
        double sw = 0, sq = 0, sx = 0, sqq = 0, sqx = 0;
        for (int l = 0; l < n; ++l) {
          const double q = std::clamp(int(std::lround((x[l] + b) / a)), 0, qmax), w = weight(l);
          sw += w, sq += w * q, sx += w * x[l], sqq += w * q * q, sqx += w * q * x[l];
        }
        if (sw <= 0) break;
        const double var = sqq - sq * sq / sw;
        if (var <= 0) break;
        double na = (sqx - sq * sx / sw) / var, off = (sx - na * sq) / sw;
        if (off > 0) off = 0, na = sqx / sqq;  // the offset must be <= 0
        if (!(na > 0)) break;
        a = float(na), b = float(-off);
      }
    }
  *a_out = best_a, *b_out = best_b;
}

// Q4_K (five_bit false) and Q5_K: per sub-block of 32 the affine fit of fit_affine; the scales
// and mins (-offset) as 6-bit multiples of the super-block's d and dmin.
void quantize_k45(const float* x, uint8_t* out, int64_t nsb, bool five_bit) {
  const int qmax = five_bit ? 31 : 15;
  const size_t bytes = five_bit ? sizeof(BlockQ5_K) : sizeof(BlockQ4_K);
  for (int64_t i = 0; i < nsb; ++i, x += QK_K, out += bytes) {
    std::memset(out, 0, bytes);
    float scale[8], mn[8], smax = 0.0f, mmax = 0.0f;
    for (int j = 0; j < 8; ++j) {
      fit_affine(x + 32 * j, 32, qmax, &scale[j], &mn[j]);
      smax = std::max(smax, scale[j]), mmax = std::max(mmax, mn[j]);
    }
    const uint16_t dh = fp32_to_fp16(smax / 63.0f), mh = fp32_to_fp16(mmax / 63.0f);
    std::memcpy(out, &dh, 2), std::memcpy(out + 2, &mh, 2);
    const float d = fp16_to_fp32(dh), dmin = fp16_to_fp32(mh);
    int sc[8], m[8];
    for (int j = 0; j < 8; ++j) sc[j] = round_clamp(scale[j], d, 0, 63), m[j] = round_clamp(mn[j], dmin, 0, 63);
    k_quant_pack_scale_min(sc, m, out + 4);
    uint8_t* qh = out + 16;
    uint8_t* qs = five_bit ? out + 48 : out + 16;
    for (int j = 0; j < 8; ++j) {
      const float a = d * float(sc[j]), b = dmin * float(m[j]);
      for (int l = 0; l < 32; ++l) {
        const int q = round_clamp(x[32 * j + l] + b, a, 0, qmax);
        qs[32 * (j / 2) + l] |= uint8_t((q & 15) << (4 * (j % 2)));
        if (five_bit) qh[l] |= uint8_t((q >> 4) << j);
      }
    }
  }
}

// The scale of least error among the candidates start(k), k = k0..k1, each tried as it is and
// once more refined by least squares on the codes v it gives (s = Σvx / Σv²); err(s, &Σvx, &Σv²)
// returns the error of s. `first` when every error is infinite.
template <class Start, class Err>
float best_refined_scale(int k0, int k1, Start start, Err err, float first) {
  float best_s = first;
  double best = HUGE_VAL;
  for (int k = k0; k <= k1; ++k) {
    float s = start(k);
    for (int pass = 0; pass < 2; ++pass) {
      double svx, svv;
      const double e = err(s, &svx, &svv);
      if (e < best) best = e, best_s = s;
      if (svv <= 0) break;
      s = float(svx / svv);
      if (s == 0.0f) break;
    }
  }
  return best_s;
}

// The scale s of x ≈ s·q, q in [-qn, qn - 1], for n values with the least squared error among
// candidates that map the value of largest magnitude m to -qn (Q4_0's rule), or to a code up to
// 8 steps of `step` nearer zero (so the others get finer steps; Q6_K: qn = 32, step 0.5; Q3_K: 4,
// 0.125), each refined once by least squares on its codes (s = Σqx / Σq²). `weighted`: every
// squared error (and the refit) weighted by x², so the large weights, which matter most, are
// fitted best (the weighting llama.cpp's Q3_K quantizer uses; Q3_K's PPL on Qwen2.5-0.5B went
// from +2.7% to −1.2% against llama.cpp's quantizer, bench/RESULTS.md). Our own search; the
// first candidate is the plain rule.
float fit_symmetric(const float* x, int n, int qn, float step, bool weighted) {
  float amax = 0.0f, m = 0.0f;
  for (int l = 0; l < n; ++l)
    if (std::fabs(x[l]) > amax) amax = std::fabs(x[l]), m = x[l];
  if (amax == 0.0f) return 0.0f;
  auto codes_error = [&](float s, double* sqx, double* sqq) {
    double e = 0;
    *sqx = *sqq = 0;
    for (int l = 0; l < n; ++l) {
      const int q = std::clamp(int(std::lround(x[l] / s)), -qn, qn - 1);
      const double d = double(s) * q - x[l], w = weighted ? double(x[l]) * x[l] : 1.0;
      e += w * d * d, *sqx += w * double(q) * x[l], *sqq += w * double(q) * q;
    }
    return e;
  };
  return best_refined_scale(0, 8, [&](int k) { return m / -(float(qn) - float(k) * step); }, codes_error, m / -float(qn));
}

// fit_symmetric's scale of each of the 16 sub-blocks of 16 weights of the super-block x [256]
// into scale [16]; returns the one of largest magnitude, with its sign.
float fit_sub_scales(const float* x, int qn, float step, bool weighted, float* scale) {
  float big = 0.0f;
  for (int j = 0; j < 16; ++j) {
    scale[j] = fit_symmetric(x + 16 * j, 16, qn, step, weighted);
    if (std::fabs(scale[j]) > std::fabs(big)) big = scale[j];
  }
  return big;
}

// Q6_K: per sub-block of 16 the scale of fit_symmetric; the 16 scales as 8-bit multiples of
// d = max|scale| / 127.
void quantize_q6_k(const float* x, uint8_t* out, int64_t nsb) {
  for (int64_t i = 0; i < nsb; ++i, x += QK_K, out += sizeof(BlockQ6_K)) {
    std::memset(out, 0, sizeof(BlockQ6_K));
    float scale[16];
    const float smax = std::fabs(fit_sub_scales(x, 32, 0.5f, false, scale));
    const uint16_t dh = fp32_to_fp16(smax / 127.0f);
    std::memcpy(out + 208, &dh, 2);
    const float d = fp16_to_fp32(dh);
    auto* scales = reinterpret_cast<int8_t*>(out + 192);
    for (int j = 0; j < 16; ++j) scales[j] = int8_t(round_clamp(scale[j], d, -127, 127));
    for (int w = 0; w < QK_K; ++w) {
      const int q = round_clamp(x[w], d * float(scales[w / 16]), -32, 31) + 32;
      const int h = w / 128, r = w % 128;
      out[64 * h + r % 64] |= uint8_t((q & 15) << (4 * (r / 64)));
      out[128 + 32 * h + r % 32] |= uint8_t((q >> 4) << (2 * (r / 32)));
    }
  }
}

// Sets weight w's (0..255) 2-bit quant q in a Q2_K/Q3_K super-block's qs[64] (k_crumb's layout).
void put_k_crumb(uint8_t* qs, int w, int q) { qs[32 * (w / 128) + w % 32] |= uint8_t((q & 3) << (2 * (w / 32 % 4))); }

// Q3_K: per sub-block of 16 the scale of fit_symmetric (codes -4..3, weighted); the 16 scales as 6-bit
// multiples s − 32 (−32..31) of d, the largest scale mapped to −32 (its sign carried by d).
void quantize_q3_k(const float* x, uint8_t* out, int64_t nsb) {
  for (int64_t i = 0; i < nsb; ++i, x += QK_K, out += sizeof(BlockQ3_K)) {
    std::memset(out, 0, sizeof(BlockQ3_K));
    float scale[16];
    const uint16_t dh = fp32_to_fp16(fit_sub_scales(x, 4, 0.125f, true, scale) / -32.0f);
    std::memcpy(out + 108, &dh, 2);
    const float d = fp16_to_fp32(dh);
    int sc[16];
    for (int j = 0; j < 16; ++j) sc[j] = round_clamp(scale[j], d, -32, 31);
    uint8_t* s = out + 96;
    for (int k = 0; k < 16; ++k) {
      const int v = sc[k] + 32;
      s[k % 8] |= uint8_t((v & 15) << (4 * (k / 8)));
      s[8 + k % 4] |= uint8_t((v >> 4) << (2 * (k / 4)));
    }
    for (int w = 0; w < QK_K; ++w) {
      const int q = round_clamp(x[w], d * float(sc[w / 16]), -4, 3) + 4;
      put_k_crumb(out + 32, w, q);
      out[w % 32] |= uint8_t((q >> 2) << (w / 32));  // hmask
    }
  }
}

// The index of IQ4_NL's level nearest v (levels ascending; ties to the lower).
int iq4_nl_index(float v) {
  int best = 0;
  for (int i = 1; i < 16; ++i)
    if (std::fabs(v - float(kIQ4NLValues[i])) < std::fabs(v - float(kIQ4NLValues[best]))) best = i;
  return best;
}

// IQ4_NL: per block of 32, the scale d of least squared error among d0 · (1 + k/32), k = −8..8,
// where d0 maps the value of largest magnitude m to −127 (its sign carried by d), each weight at
// its nearest level; then d refined once by least squares on those levels (d = Σ v x / Σ v²).
void quantize_iq4_nl(const float* x, BlockIQ4_NL* out, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += QK) {
    float m = 0.0f;
    for (int i = 0; i < QK; ++i)
      if (std::fabs(x[i]) > std::fabs(m)) m = x[i];
    auto error = [&](float d, double* svx, double* svv) {
      double e = 0;
      *svx = *svv = 0;
      for (int i = 0; i < QK; ++i) {
        const double v = kIQ4NLValues[iq4_nl_index(x[i] / d)], r = double(d) * v - x[i];
        e += r * r, *svx += v * x[i], *svv += v * v;
      }
      return e;
    };
    const float best_d = m == 0.0f ? 0.0f
                                   : best_refined_scale(-8, 8, [&](int k) { return m / -127.0f * (1.0f + float(k) / 32.0f); }, error,
                                                        m / -127.0f);
    out[b].d = fp32_to_fp16(best_d);
    const float d = fp16_to_fp32(out[b].d);
    for (int j = 0; j < 16; ++j) {
      const int lo = d == 0.0f ? 8 : iq4_nl_index(x[j] / d), hi = d == 0.0f ? 8 : iq4_nl_index(x[j + 16] / d);
      out[b].qs[j] = uint8_t(lo | hi << 4);
    }
  }
}

// Q2_K: per sub-block of 16 the affine fit of fit_affine (codes 0..3, weighted); the scales and mins
// (−offset) as 4-bit multiples of the super-block's d and dmin.
void quantize_q2_k(const float* x, uint8_t* out, int64_t nsb) {
  for (int64_t i = 0; i < nsb; ++i, x += QK_K, out += sizeof(BlockQ2_K)) {
    std::memset(out, 0, sizeof(BlockQ2_K));
    float scale[16], mn[16], smax = 0.0f, mmax = 0.0f;
    for (int j = 0; j < 16; ++j) {
      fit_affine(x + 16 * j, 16, 3, &scale[j], &mn[j], /*weighted=*/true);
      smax = std::max(smax, scale[j]), mmax = std::max(mmax, mn[j]);
    }
    const uint16_t dh = fp32_to_fp16(smax / 15.0f), mh = fp32_to_fp16(mmax / 15.0f);
    std::memcpy(out + 80, &dh, 2), std::memcpy(out + 82, &mh, 2);
    const float d = fp16_to_fp32(dh), dmin = fp16_to_fp32(mh);
    int sc[16], m[16];
    for (int j = 0; j < 16; ++j) {
      sc[j] = round_clamp(scale[j], d, 0, 15), m[j] = round_clamp(mn[j], dmin, 0, 15);
      out[j] = uint8_t(sc[j] | m[j] << 4);
    }
    for (int w = 0; w < QK_K; ++w) {
      const int k = w / 16;
      put_k_crumb(out + 16, w, round_clamp(x[w] + dmin * float(m[k]), d * float(sc[k]), 0, 3));
    }
  }
}

// Little-endian fp16 at p (any alignment) as fp32.
inline float half_at(const uint8_t* p) { return fp16_to_fp32(uint16_t(p[0] | (p[1] << 8))); }

// Nibbles of a 32-weight block (weight j low nibble of qs[j], j+16 the high one) plus the
// 5th bits of Q5_0/Q5_1 (qh, or null).
void unpack_q4_q5(const uint8_t* qs, const uint8_t* qh, uint8_t* q) {
  uint32_t h = 0;
  if (qh) h = uint32_t(qh[0]) | uint32_t(qh[1]) << 8 | uint32_t(qh[2]) << 16 | uint32_t(qh[3]) << 24;
  for (int j = 0; j < 16; ++j) {
    q[j] = uint8_t((qs[j] & 15) | ((h >> j) & 1) << 4);
    q[j + 16] = uint8_t((qs[j] >> 4) | ((h >> (j + 16)) & 1) << 4);
  }
}

// Q8_0 block b of `row`: q = w + 128 (int8 stored, sign bit flipped), one scale for all 32.
inline void decode_q8_0(const uint8_t* row, int64_t b, QuantBlock& o) {
  const uint8_t* blk = row + size_t(b) * sizeof(BlockQ8_0);
  o.a[0] = o.a[1] = half_at(blk), o.offset = 128;
  for (int i = 0; i < QK; ++i) o.q[i] = uint8_t(blk[2 + i] ^ 0x80);
}

// Q4_0 / Q5_0 (five) block b of `row`: 4- or 5-bit codes, offset 8 or 16, one scale.
inline void decode_q4_q5_0(const uint8_t* row, int64_t b, bool five, QuantBlock& o) {
  const uint8_t* blk = row + size_t(b) * (five ? sizeof(BlockQ5_0) : sizeof(BlockQ4_0));
  o.a[0] = o.a[1] = half_at(blk), o.offset = five ? 16 : 8;
  unpack_q4_q5(blk + (five ? 6 : 2), five ? blk + 2 : nullptr, o.q);
}

// IQ4_NL block b of `row`: q = level + 128 (kIQ4NLValues of each nibble), one scale.
inline void decode_iq4_nl(const uint8_t* row, int64_t b, QuantBlock& o) {
  const uint8_t* blk = row + size_t(b) * sizeof(BlockIQ4_NL);
  o.a[0] = o.a[1] = half_at(blk), o.offset = 128;
  for (int j = 0; j < 16; ++j) {
    o.q[j] = uint8_t(kIQ4NLValues[blk[2 + j] & 15] + 128);
    o.q[j + 16] = uint8_t(kIQ4NLValues[blk[2 + j] >> 4] + 128);
  }
}

// Q4_1 / Q5_1 (five) block b of `row`: 4- or 5-bit codes, scale d and minimum −m (the file stores m).
inline void decode_q4_q5_1(const uint8_t* row, int64_t b, bool five, QuantBlock& o) {
  const uint8_t* blk = row + size_t(b) * (five ? sizeof(BlockQ5_1) : sizeof(BlockQ4_1));
  o.a[0] = o.a[1] = half_at(blk), o.m[0] = o.m[1] = -half_at(blk + 2);
  unpack_q4_q5(blk + (five ? 8 : 4), five ? blk + 4 : nullptr, o.q);
}

// Q4_K / Q5_K (five) sub-block b (of 32 weights; 8 per super-block) of `row`: d·sc and dmin·m.
inline void decode_q45_k(const uint8_t* row, int64_t b, bool five, QuantBlock& o) {
  const uint8_t* blk = row + size_t(b / 8) * (five ? sizeof(BlockQ5_K) : sizeof(BlockQ4_K));
  const int j = int(b % 8);
  int sc, m;
  k_quant_scale_min(j, blk + 4, &sc, &m);
  o.a[0] = o.a[1] = half_at(blk) * float(sc), o.m[0] = o.m[1] = half_at(blk + 2) * float(m);
  const uint8_t* qs = blk + (five ? 48 : 16) + 32 * (j / 2);
  for (int l = 0; l < 32; ++l) {
    int v = (qs[l] >> (4 * (j % 2))) & 15;
    if (five) v |= ((blk[16 + l] >> j) & 1) << 4;
    o.q[l] = uint8_t(v);
  }
}

// Q2_K sub-block b (of 32 weights; 8 per super-block) of `row`: 2-bit codes, a scale and a minimum per 16.
inline void decode_q2_k(const uint8_t* row, int64_t b, QuantBlock& o) {  // formats/quant.h has the layout
  const uint8_t* blk = row + size_t(b / 8) * sizeof(BlockQ2_K);
  const int j = int(b % 8);
  const float d = half_at(blk + 80), dmin = half_at(blk + 82);
  for (int half = 0; half < 2; ++half) {
    const uint8_t sc = blk[2 * j + half];
    o.a[half] = d * float(sc & 15), o.m[half] = dmin * float(sc >> 4);
  }
  for (int l = 0; l < 32; ++l) o.q[l] = uint8_t(k_crumb(blk + 16, j, l));
}

// Q3_K sub-block b (of 32 weights; 8 per super-block) of `row`: 3-bit codes, offset 4, a scale per 16.
inline void decode_q3_k(const uint8_t* row, int64_t b, QuantBlock& o) {  // formats/quant.h has the layout
  const uint8_t* blk = row + size_t(b / 8) * sizeof(BlockQ3_K);
  const int j = int(b % 8);
  const float d = half_at(blk + 108);
  for (int half = 0; half < 2; ++half) o.a[half] = d * float(q3_k_scale(blk + 96, 2 * j + half) - 32);
  o.offset = 4;
  for (int l = 0; l < 32; ++l) o.q[l] = uint8_t(k_crumb(blk + 32, j, l) | ((blk[l] >> j) & 1) << 2);
}

// Q6_K sub-block b (of 32 weights; 8 per super-block) of `row`: 6-bit codes, offset 32, an int8 scale per 16.
inline void decode_q6_k(const uint8_t* row, int64_t b, QuantBlock& o) {
  const uint8_t* blk = row + size_t(b / 8) * sizeof(BlockQ6_K);
  const int j = int(b % 8);
  const float d = half_at(blk + 208);
  const auto* scales = reinterpret_cast<const int8_t*>(blk + 192);
  o.a[0] = d * float(scales[2 * j]), o.a[1] = d * float(scales[2 * j + 1]), o.offset = 32;
  for (int l = 0; l < 32; ++l) {
    const int w = 32 * j + l, h = w / 128, r = w % 128;
    const int lo = (blk[64 * h + r % 64] >> (4 * (r / 64))) & 15;
    const int hi = (blk[128 + 32 * h + r % 32] >> (2 * (r / 32))) & 3;
    o.q[l] = uint8_t(lo | hi << 4);
  }
}

}  // namespace

bool is_quantized(DType t) { return t != DType::F32 && t != DType::F16 && t != DType::BF16; }

void decode_quant_block(DType t, const uint8_t* row, int64_t b, QuantBlock& o) {
  o.m[0] = o.m[1] = 0.0f;
  o.offset = 0;
  switch (t) {
    case DType::Q8_0: decode_q8_0(row, b, o); return;
    case DType::Q4_0: case DType::Q5_0: decode_q4_q5_0(row, b, t == DType::Q5_0, o); return;
    case DType::IQ4_NL: decode_iq4_nl(row, b, o); return;
    case DType::Q4_1: case DType::Q5_1: decode_q4_q5_1(row, b, t == DType::Q5_1, o); return;
    case DType::Q4_K: case DType::Q5_K: decode_q45_k(row, b, t == DType::Q5_K, o); return;
    case DType::Q2_K: decode_q2_k(row, b, o); return;
    case DType::Q3_K: decode_q3_k(row, b, o); return;
    case DType::Q6_K: decode_q6_k(row, b, o); return;
    default: return;
  }
}

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
    case DType::Q5_0: quantize_q5(x, static_cast<uint8_t*>(dst), nb, false); return;
    case DType::Q5_1: quantize_q5(x, static_cast<uint8_t*>(dst), nb, true); return;
    case DType::Q4_K: quantize_k45(x, static_cast<uint8_t*>(dst), n / QK_K, false); return;
    case DType::Q5_K: quantize_k45(x, static_cast<uint8_t*>(dst), n / QK_K, true); return;
    case DType::Q6_K: quantize_q6_k(x, static_cast<uint8_t*>(dst), n / QK_K); return;
    case DType::Q3_K: quantize_q3_k(x, static_cast<uint8_t*>(dst), n / QK_K); return;
    case DType::Q2_K: quantize_q2_k(x, static_cast<uint8_t*>(dst), n / QK_K); return;
    case DType::IQ4_NL: quantize_iq4_nl(x, static_cast<BlockIQ4_NL*>(dst), nb); return;
  }
}

int64_t first_nonfinite(DType t, const void* src, int64_t n) {
  row_bytes(t, n);
  const auto* p = static_cast<const uint8_t*>(src);
  if (!is_quantized(t)) {
    float v;
    for (int64_t i = 0; i < n; ++i) {
      if (t == DType::F32) std::memcpy(&v, p + 4 * i, 4);
      else v = t == DType::F16 ? half_at(p + 2 * i) : bf16_to_fp32(uint16_t(p[2 * i] | p[2 * i + 1] << 8));
      if (!std::isfinite(v)) return i;
    }
    return -1;
  }
  QuantBlock qb;
  for (int64_t b = 0; b < n / QK; ++b) {
    decode_quant_block(t, p, b, qb);
    if (!std::isfinite(qb.a[0]) || !std::isfinite(qb.a[1]) || !std::isfinite(qb.m[0]) || !std::isfinite(qb.m[1])) return b * QK;
  }
  return -1;
}

void dequantize_row(DType t, const void* src, float* y, int64_t n) {
  row_bytes(t, n);
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
    default: {
      QuantBlock qb;
      const auto* row = static_cast<const uint8_t*>(src);
      for (int64_t b = 0; b < n / QK; ++b, y += QK) {
        decode_quant_block(t, row, b, qb);
        for (int i = 0; i < QK; ++i) y[i] = qb.a[i / 16] * float(int(qb.q[i]) - qb.offset) - qb.m[i / 16];
      }
      return;
    }
  }
}

}  // namespace llmq
