// Quantization types: reference quantize/dequantize round trips on fresh random data, with the
// stated relative RMS error bound of each type; exact round trips on the grid; zeros; NaN/Inf.
#include <catch2/catch.hpp>
#include <cmath>
#include <random>
#include <vector>

#include "base/error.h"
#include "formats/quant.h"

using namespace llmq;

namespace {

std::vector<float> gaussian(size_t n, uint64_t seed, float sigma = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, sigma);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

double rel_rms(const std::vector<float>& a, const std::vector<float>& ref) {
  double e = 0, r = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    e += (double(a[i]) - ref[i]) * (double(a[i]) - ref[i]);
    r += double(ref[i]) * ref[i];
  }
  return std::sqrt(e / r);
}

std::vector<float> round_trip(DType t, const std::vector<float>& x) {
  std::vector<uint8_t> buf(row_bytes(t, int64_t(x.size())));
  quantize_row(t, x.data(), buf.data(), int64_t(x.size()));
  std::vector<float> y(x.size());
  dequantize_row(t, buf.data(), y.data(), int64_t(x.size()));
  return y;
}

}  // namespace

TEST_CASE("block sizes match GGUF", "[quant]") {
  CHECK(row_bytes(DType::Q8_0, 64) == 68);
  CHECK(row_bytes(DType::Q4_0, 64) == 36);
  CHECK(row_bytes(DType::Q4_1, 64) == 40);
  CHECK(row_bytes(DType::F16, 3) == 6);
  CHECK(row_bytes(DType::F32, 3) == 12);
  CHECK_THROWS_AS(row_bytes(DType::Q4_0, 33), UsageError);
  CHECK(dtype_from_name("Q8_0") == DType::Q8_0);
  CHECK(row_bytes(DType::Q3_K, 256) == 110);
  CHECK(dtype_from_name("q3_k") == DType::Q3_K);
  CHECK(row_bytes(DType::Q2_K, 512) == 168);
  CHECK(dtype_from_name("iq4_nl") == DType::IQ4_NL);
  CHECK_THROWS_AS(dtype_from_name("iq4_xs"), UsageError);
}

// Relative RMS round-trip error bounds on N(0,1) data (stated per type, with ~1.5x headroom
// over the expected value: step/sqrt(12) with step = 2^-11 (f16), 2^-8 (bf16), amax/127 (q8_0),
// amax/8 (q4_0), (max-min)/15 (q4_1), amax/16 (q5_0), (max-min)/31 (q5_1); the K-quants
// measured for llmq's own search (formats/quant.h: iq4_nl 0.074, q2_k 0.281 (|x|-weighted), q3_k 0.154 (x²-weighted), q4_k 0.072, q5_k 0.037, q6_k 0.017, about
// Q4_1's and Q5_1's on N(0,1) data, whose sub-block ranges vary little), with the same headroom).
TEST_CASE("round-trip error on fresh random data is within each type's bound", "[quant]") {
  const std::pair<DType, double> bounds[] = {
      {DType::F32, 0.0}, {DType::F16, 5e-4}, {DType::BF16, 4e-3}, {DType::Q8_0, 8e-3}, {DType::Q4_0, 0.13}, {DType::Q4_1, 0.13},
      {DType::Q5_0, 0.065}, {DType::Q5_1, 0.065}, {DType::IQ4_NL, 0.11}, {DType::Q2_K, 0.4}, {DType::Q3_K, 0.22}, {DType::Q4_K, 0.12}, {DType::Q5_K, 0.06}, {DType::Q6_K, 0.03},
  };
  std::random_device rd;
  const uint64_t seed = (uint64_t(rd()) << 32) | rd();
  INFO("seed " << seed);
  for (auto [t, bound] : bounds) {
    const auto x = gaussian(32 * 1024, seed);
    const double err = rel_rms(round_trip(t, x), x);
    INFO(dtype_name(t) << " rel rms " << err);
    CHECK(err <= bound);
    if (t != DType::F32) CHECK(err > 0);
  }
}

TEST_CASE("values already on the grid round-trip exactly", "[quant]") {
  std::mt19937 rng(std::random_device{}());
  const int nb = 64;
  SECTION("f16 and bf16") {
    std::vector<float> x(nb * 32);
    for (auto& v : x) v = fp16_to_fp32(uint16_t(rng() % 0x7bff));  // finite fp16 values, subnormals included
    CHECK(round_trip(DType::F16, x) == x);
    for (auto& v : x) v = bf16_to_fp32(uint16_t(rng() % 0x7f7f));
    CHECK(round_trip(DType::BF16, x) == x);
  }
  SECTION("q8_0: x = d*q with fp16 d and |q| <= 127 (127 present)") {
    std::vector<float> x(nb * 32);
    for (int b = 0; b < nb; ++b) {
      const float d = fp16_to_fp32(fp32_to_fp16(0.001f * float(1 + rng() % 1000)));
      for (int j = 0; j < 32; ++j) x[b * 32 + j] = d * float(int(rng() % 255) - 127);
      x[b * 32 + rng() % 32] = d * ((rng() & 1) ? 127.0f : -127.0f);
    }
    CHECK(round_trip(DType::Q8_0, x) == x);
  }
  SECTION("q4_0: x = d*(q-8), q in 0..15, -8d present") {
    std::vector<float> x(nb * 32);
    for (int b = 0; b < nb; ++b) {
      const float d = float(1 + rng() % 200) / 256.0f;  // exact in fp16
      for (int j = 0; j < 32; ++j) x[b * 32 + j] = d * float(int(rng() % 16) - 8);
      x[b * 32 + rng() % 32] = -8.0f * d;
    }
    CHECK(round_trip(DType::Q4_0, x) == x);
  }
  SECTION("q4_1: x = d*q + m, q in 0..15, both ends present") {
    std::vector<float> x(nb * 32);
    for (int b = 0; b < nb; ++b) {
      const float d = float(1 + rng() % 200) / 256.0f, m = float(int(rng() % 400) - 200) / 256.0f;
      for (int j = 0; j < 32; ++j) x[b * 32 + j] = d * float(rng() % 16) + m;
      x[b * 32 + 0] = m;
      x[b * 32 + 31] = d * 15.0f + m;
    }
    CHECK(round_trip(DType::Q4_1, x) == x);
  }
}

TEST_CASE("all-zero blocks stay zero", "[quant]") {
  for (DType t : {DType::F16, DType::BF16, DType::Q8_0, DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q5_1, DType::Q2_K,
                  DType::Q3_K, DType::Q4_K, DType::Q5_K, DType::Q6_K, DType::IQ4_NL}) {
    std::vector<float> x(512, 0.0f);
    const auto y = round_trip(t, x);
    for (float v : y) CHECK(v == 0.0f);
  }
}

const float bad_nan = std::nanf("");

TEST_CASE("NaN and Inf are rejected with a clear error", "[quant]") {
  for (DType t : {DType::F32, DType::F16, DType::BF16, DType::Q8_0, DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q5_1,
                  DType::Q2_K, DType::Q3_K, DType::Q4_K, DType::Q5_K, DType::Q6_K, DType::IQ4_NL}) {
    for (float bad : {std::nanf(""), INFINITY, -INFINITY}) {
      auto x = gaussian(256, 7);
      x[37] = bad;
      std::vector<uint8_t> buf(row_bytes(t, 256));
      INFO(dtype_name(t));
      CHECK_THROWS_WITH(quantize_row(t, x.data(), buf.data(), 256), Catch::Contains("not finite"));
    }
    // A stored row whose scale (or value) is NaN is found without dequantizing (lossless repacks).
    const auto x = gaussian(512, 9);
    std::vector<uint8_t> row(row_bytes(t, 512));
    quantize_row(t, x.data(), row.data(), 512);
    CHECK(first_nonfinite(t, row.data(), 512) == -1);
    const size_t second = row.size() / 2;  // the second half: block 8 (or weight 256 of the float types)
    const size_t at = !is_quantized(t) ? second : t == DType::Q6_K ? second + 208 : t == DType::Q3_K ? second + 108 : t == DType::Q2_K ? second + 80 : second;  // where d lives
    if (t == DType::F32) std::memcpy(row.data() + at, &bad_nan, 4);
    else if (t == DType::BF16) row[at] = 0xc0, row[at + 1] = 0x7f;  // bf16 NaN
    else row[at] = 0x00, row[at + 1] = 0x7e;                         // fp16 NaN
    INFO(dtype_name(t));
    CHECK(first_nonfinite(t, row.data(), 512) == 256);
  }
  std::vector<float> big(32, 1e6f);  // overflows fp16
  std::vector<uint8_t> buf(64);
  CHECK_THROWS_AS(quantize_row(DType::F16, big.data(), buf.data(), 32), UsageError);
}

TEST_CASE("fp16 conversion matches IEEE binary16", "[quant]") {
  CHECK(fp32_to_fp16(1.0f) == 0x3c00);
  CHECK(fp32_to_fp16(-2.0f) == 0xc000);
  CHECK(fp32_to_fp16(65504.0f) == 0x7bff);
  CHECK(fp32_to_fp16(1e6f) == 0x7c00);
  CHECK(fp32_to_fp16(5.9604645e-8f) == 0x0001);  // smallest subnormal
  CHECK(fp32_to_fp16(1.0f + 1.0f / 2048) == 0x3c00);       // tie -> even
  CHECK(fp32_to_fp16(1.0f + 3.0f / 2048) == 0x3c02);       // tie -> even (up)
  for (uint32_t h = 0; h < 0x7c00; ++h) REQUIRE(fp32_to_fp16(fp16_to_fp32(uint16_t(h))) == h);
  CHECK(std::isnan(fp16_to_fp32(fp32_to_fp16(std::nanf("")))));
  CHECK(fp32_to_bf16(1.0f) == 0x3f80);
  CHECK(bf16_to_fp32(0x3f80) == 1.0f);
}
