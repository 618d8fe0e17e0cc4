// CPU kernels against their references on fresh random inputs, every weight type, awkward
// shapes; relative error ||out - ref|| / ||ref|| with a stated bound per type.
#include <catch2/catch.hpp>
#include <cmath>
#include <complex>
#include <random>
#include <vector>

#include "engine/cpu_ops.h"

using namespace llmq;

namespace {

uint64_t fresh_seed() {
  std::random_device rd;
  return (uint64_t(rd()) << 32) | rd();
}

std::vector<float> gaussian(size_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

double rel_err(const float* a, const float* ref, size_t n) {
  double e = 0, r = 0;
  for (size_t i = 0; i < n; ++i) {
    e += (double(a[i]) - ref[i]) * (double(a[i]) - ref[i]);
    r += double(ref[i]) * ref[i];
  }
  return std::sqrt(e / r);
}

// A random weight matrix [rows, cols] stored in type t.
struct OwnedWeight {
  std::vector<uint8_t> bytes;
  Weight w;
  OwnedWeight(DType t, int64_t rows, int64_t cols, std::mt19937_64& rng) {
    const size_t rb = row_bytes(t, cols);
    bytes.resize(rb * size_t(rows));
    for (int64_t r = 0; r < rows; ++r) {
      auto x = gaussian(size_t(cols), rng);
      quantize_row(t, x.data(), bytes.data() + size_t(r) * rb, cols);
    }
    w = Weight{t, bytes.data(), rows, cols};
  }
};

}  // namespace

// Bounds: fp32-activation types differ from the fp64 reference only by fp32 summation
// (1e-5); the block-quantized types also quantize the activations to 8 bits per block of 32,
// which adds about 0.5% relative error (bound 2e-2).
TEST_CASE("matmul matches the reference for every type and awkward shapes", "[kernels]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  struct Shape { int64_t rows, cols, T; };
  const Shape float_shapes[] = {{1, 1, 1}, {37, 172, 1}, {130, 33, 5}, {64, 64, 17}, {5, 300, 3}};
  const Shape block_shapes[] = {{1, 32, 40}, {37, 64, 1}, {130, 96, 5}, {3, 320, 17}, {129, 160, 2}};
  ThreadPool pool1(1), pool3(3);
  for (DType t : {DType::F32, DType::F16, DType::BF16, DType::Q8_0, DType::Q4_0, DType::Q4_1}) {
    const bool block = dtype_info(t).block > 1;
    const double bound = block ? 2e-2 : 1e-5;
    for (const Shape& s : block ? block_shapes : float_shapes) {
      OwnedWeight w(t, s.rows, s.cols, rng);
      const auto x = gaussian(size_t(s.T * s.cols), rng);
      std::vector<float> ref(size_t(s.T * s.rows)), y1(ref.size(), NAN), y3(ref.size(), NAN);
      ref_matmul(ref.data(), x.data(), s.T, w.w);
      MatmulScratch sc1, sc3;
      matmul(pool1, sc1, y1.data(), x.data(), s.T, w.w);
      matmul(pool3, sc3, y3.data(), x.data(), s.T, w.w);
      INFO(dtype_name(t) << " rows " << s.rows << " cols " << s.cols << " T " << s.T);
      for (float v : y1) REQUIRE(std::isfinite(v));  // every output written
      const double err = rel_err(y1.data(), ref.data(), ref.size());
      INFO("rel err " << err);
      CHECK(err < bound);
      CHECK(y1 == y3);  // independent of the thread count, bit for bit
    }
  }
}

TEST_CASE("rmsnorm, softmax and swiglu match fp64 formulas", "[kernels]") {
  std::mt19937_64 rng(fresh_seed());
  const int64_t n = 203;
  auto x = gaussian(n, rng), w = gaussian(n, rng), up = gaussian(n, rng);
  std::vector<float> out(n);
  rmsnorm(out.data(), x.data(), w.data(), n, 1e-5f);
  double ss = 0;
  for (float v : x) ss += double(v) * v;
  const double scale = 1.0 / std::sqrt(ss / n + 1e-5);
  std::vector<float> ref(n);
  for (int64_t i = 0; i < n; ++i) ref[i] = float(x[i] * scale * w[i]);
  CHECK(rel_err(out.data(), ref.data(), n) < 1e-6);

  std::vector<float> sm = x;
  softmax(sm.data(), n);
  double z = 0;
  for (float v : x) z += std::exp(double(v));
  for (int64_t i = 0; i < n; ++i) ref[i] = float(std::exp(double(x[i])) / z);
  CHECK(rel_err(sm.data(), ref.data(), n) < 1e-6);

  std::vector<float> g = x;
  swiglu(g.data(), up.data(), n);
  for (int64_t i = 0; i < n; ++i) ref[i] = float(double(x[i]) / (1 + std::exp(-double(x[i]))) * up[i]);
  CHECK(rel_err(g.data(), ref.data(), n) < 1e-6);
}

// RoPE as a complex rotation (Su et al. 2021, eq. 34): pair j of each head is multiplied by
// e^{i·pos·θ^(-2j/d)}; the layouts differ only in which two dimensions form pair j.
TEST_CASE("rope matches the complex-rotation formula in both layouts", "[kernels]") {
  std::mt19937_64 rng(fresh_seed());
  const int64_t heads = 3, hd = 16;
  for (RopeLayout layout : {RopeLayout::Interleaved, RopeLayout::RotateHalf}) {
    for (int64_t pos : {0, 1, 17, 511, 4000}) {
      auto v = gaussian(size_t(heads * hd), rng);
      std::vector<float> ref(v.size());
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t j = 0; j < hd / 2; ++j) {
          const int64_t a = layout == RopeLayout::Interleaved ? 2 * j : j;
          const int64_t b = layout == RopeLayout::Interleaved ? 2 * j + 1 : j + hd / 2;
          const std::complex<double> z(v[h * hd + a], v[h * hd + b]);
          const std::complex<double> r = z * std::polar(1.0, double(pos) * std::pow(10000.0, -2.0 * double(j) / double(hd)));
          ref[h * hd + a] = float(r.real());
          ref[h * hd + b] = float(r.imag());
        }
      rope(v.data(), heads, hd, pos, 10000.0, layout);
      INFO("layout " << rope_layout_name(layout) << " pos " << pos);
      CHECK(rel_err(v.data(), ref.data(), v.size()) < 1e-6);
    }
  }
}

TEST_CASE("thread pool covers every index exactly once", "[kernels]") {
  ThreadPool pool(4);
  for (int64_t n : {1, 3, 4, 5, 1000}) {
    std::vector<int> hits(size_t(n), 0);
    pool.parallel_for(n, [&](int64_t a, int64_t b, int) {
      for (int64_t i = a; i < b; ++i) ++hits[size_t(i)];
    });
    for (int h : hits) CHECK(h == 1);
  }
  CHECK_THROWS_AS(pool.parallel_for(8, [](int64_t, int64_t, int) { throw std::runtime_error("boom"); }), std::runtime_error);
}
