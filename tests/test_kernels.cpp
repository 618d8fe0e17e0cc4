// Properties of the CPU kernels beyond parity (which the op harness, tests/test_ops.cpp, checks
// for every op, type and level): agreement across levels and thread counts, decode = batch bit
// for bit, packed = unpacked bit for bit, wide input ranges, the bf16 attention operands.
#include <catch2/catch.hpp>
#include <cmath>
#include <complex>
#include <cstring>
#include <string>
#include <random>
#include <vector>

#include "base/error.h"
#include "engine/cpu/cpu_ops.h"
#include "test_util.h"

using namespace llmq;

namespace {

using test::fresh_seed;
using test::gaussian;
using test::rel_err;

using OwnedWeight = test::RandomWeight;

}  // namespace

// Parity of every op with its fp64 reference, per type and CPU level: the op harness
// (tests/test_ops.cpp). Here: the properties a parity check does not see.

namespace {

// Restores the CPU level active when it was made.
struct LevelGuard {
  CpuLevel saved = cpu_level();
  ~LevelGuard() { set_cpu_level(saved); }
};

// A[t, r] = Σ_k |w[r,k]|·|x[t,k]| in fp64: the scale of any summation's rounding error, free of
// the cancellation that makes a single dot product's relative error meaningless.
std::vector<double> abs_matmul(const float* x, int64_t T, const Weight& w) {
  std::vector<double> a(size_t(T * w.rows));
  std::vector<float> row(size_t(w.cols));
  for (int64_t r = 0; r < w.rows; ++r) {
    dequantize_row(w.type, w.row(r), row.data(), w.cols);
    for (int64_t t = 0; t < T; ++t) {
      double acc = 0;
      for (int64_t k = 0; k < w.cols; ++k) acc += std::fabs(double(row[size_t(k)]) * x[t * w.cols + k]);
      a[size_t(t * w.rows + r)] = acc;
    }
  }
  return a;
}

// ||a - b|| / ||scale||
double scaled_err(const std::vector<float>& a, const std::vector<float>& b, const std::vector<double>& scale) {
  double e = 0, s = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    e += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    s += scale[i] * scale[i];
  }
  return std::sqrt(e / s);
}

std::vector<CpuLevel> supported_levels() {
  std::vector<CpuLevel> v;
  for (CpuLevel l : {CpuLevel::Scalar, CpuLevel::Avx2, CpuLevel::Avx512})
    if (cpu_level_supported(l)) v.push_back(l);
  return v;
}

}  // namespace

// Every instruction-set level the CPU has, forced explicitly, on shapes that are no multiple of
// any SIMD width or tile (rows 1..130, 16-row units split over 3 threads, K tails, odd block
// counts, token counts on both sides of the GEMV/GEMM switch). Each level must (a) meet the
// reference bound, (b) agree with the scalar level: ~1e-6 relative, since both do fp32 sums of
// the same products (the quantized types: exact int32 block dots, only the fp32 rounding of the
// per-block scale products differs), (c) give bit-identical results on 1 and 3 threads, and
// (d) give bit-identical results for a token whether it is alone (decode) or in a batch.
// Relative errors are taken against ||ref|| when there are enough outputs for that to be
// meaningful, and always against the cancellation-free scale Σ|w||x|.
// Every weight type, and a column count rounded up to the type's (super-)block.
const DType kWeightTypes[] = {DType::F32,  DType::F16,  DType::BF16, DType::Q8_0, DType::Q4_0, DType::Q4_1,
                              DType::Q5_0, DType::Q5_1, DType::Q2_K, DType::Q3_K, DType::Q4_K, DType::Q5_K, DType::Q6_K, DType::IQ4_NL};
int64_t whole(DType t, int64_t cols) {
  const int64_t b = dtype_info(t).block;
  return (cols + b - 1) / b * b;
}

TEST_CASE("matmul at every CPU level matches the scalar path on awkward shapes", "[kernels]") {
  LevelGuard guard;
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  ThreadPool pool1(1), pool3(3);
  const int64_t rows_list[] = {1, 15, 17, 37, 130};
  const int64_t float_cols[] = {1, 15, 33, 172, 300};
  const int64_t block_cols[] = {32, 64, 96, 160, 320};
  const int64_t Ts[] = {1, 2, 3, 7, 8, 17, 33, 64};  // both sides of every GEMV/GEMM switch, tile tails
  for (DType t : kWeightTypes) {
    const bool block = dtype_info(t).block > 1;
    for (size_t si = 0; si < 5; ++si) {
      const int64_t rows = rows_list[si], cols = block ? whole(t, block_cols[si]) : float_cols[si];
      OwnedWeight w(t, rows, cols, rng);
      for (int64_t T : Ts) {
        const auto x = gaussian(size_t(T * cols), rng);
        std::vector<float> ref(size_t(T * rows)), scalar(ref.size(), NAN);
        ref_matmul(ref.data(), x.data(), T, w.w);
        const auto scale = abs_matmul(x.data(), T, w.w);
        const double bound = block ? 2e-2 : 1e-5;
        for (CpuLevel level : supported_levels()) {
          set_cpu_level(level);
          std::vector<float> y1(ref.size(), NAN), y3(ref.size(), NAN);
          MatmulScratch sc1, sc3;
          matmul(pool1, sc1, y1.data(), x.data(), T, w.w);
          matmul(pool3, sc3, y3.data(), x.data(), T, w.w);
          INFO(cpu_level_name(level) << " " << dtype_name(t) << " rows " << rows << " cols " << cols << " T " << T);
          for (float v : y1) REQUIRE(std::isfinite(v));  // every output written
          const double err = rel_err(y1.data(), ref.data(), ref.size());
          INFO("rel err vs fp64 reference " << err);
          if (ref.size() >= 16) CHECK(err < bound);
          CHECK(scaled_err(y1, ref, scale) < bound);
          CHECK(y1 == y3);  // independent of the thread count, bit for bit
          // Batched prefill equals decoding token by token, bit for bit (GEMM vs GEMV paths):
          // otherwise re-quantized activations amplify last-bit differences downstream.
          std::vector<float> one(static_cast<size_t>(rows));
          bool same = true;
          for (int64_t t = 0; t < T; ++t) {
            matmul(pool3, sc3, one.data(), x.data() + t * cols, 1, w.w);
            same = same && std::memcmp(one.data(), y1.data() + t * rows, size_t(rows) * sizeof(float)) == 0;
          }
          CHECK(same);
          if (level == CpuLevel::Scalar) {
            scalar = y1;
          } else {
            const double es = scaled_err(y1, scalar, scale);
            INFO("error vs scalar level, relative to sum |w||x|: " << es);
            CHECK(es < 1e-6);
          }
        }
      }
    }
  }
}

namespace {

void check_packed_matmul(CpuLevel level) {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  ThreadPool pool1(1), pool3(3);
  struct Shape { int64_t rows, cols; };
  const Shape shapes[] = {{1, 32}, {15, 96}, {16, 64}, {17, 160}, {37, 320}, {130, 576}};
  const int64_t Ts[] = {1, 2, 7, 8, 9, 17};
  for (DType t : kWeightTypes) {
    if (!is_quantized(t)) continue;
    for (Shape sh : shapes) {
      sh.cols = whole(t, sh.cols);
      OwnedWeight w(t, sh.rows, sh.cols, rng);
      Weight pw = w.w;
      std::vector<Weight*> one{&pw};
      const PackedWeights packed = pack_weights(one);
      REQUIRE(pw.packed != nullptr);
      REQUIRE(packed.bytes() == packed_weights_bytes({&w.w}));
      REQUIRE(packed.bytes() % 64 == 0);
      for (int64_t T : Ts) {
        INFO(cpu_level_name(level) << " " << dtype_name(t) << " rows " << sh.rows << " cols " << sh.cols << " T " << T);
        const auto x = gaussian(size_t(T * sh.cols), rng);
        std::vector<float> plain(size_t(T * sh.rows), NAN), p1(plain.size(), NAN), p3(plain.size(), NAN);
        MatmulScratch sc0, sc1, sc3;
        matmul(pool3, sc0, plain.data(), x.data(), T, w.w);
        matmul(pool1, sc1, p1.data(), x.data(), T, pw);
        matmul(pool3, sc3, p3.data(), x.data(), T, pw);
        for (float v : p1) REQUIRE(std::isfinite(v));
        CHECK(std::memcmp(p1.data(), plain.data(), plain.size() * sizeof(float)) == 0);
        CHECK(std::memcmp(p3.data(), plain.data(), plain.size() * sizeof(float)) == 0);
        // A slice of rows (TP): packed when it starts on a panel, else read from the file layout.
        for (int64_t r0 : {int64_t(0), int64_t(16), int64_t(3)}) {
          if (r0 >= sh.rows) continue;
          const int64_t n = sh.rows - r0;
          const Weight slice = weight_rows(pw, r0, n);
          CHECK((slice.packed != nullptr) == (r0 % 16 == 0));
          std::vector<float> ys(size_t(T * n), NAN);
          matmul(pool3, sc3, ys.data(), x.data(), T, slice);
          bool same = true;
          for (int64_t tk = 0; tk < T; ++tk)
            same = same && std::memcmp(ys.data() + tk * n, plain.data() + tk * sh.rows + r0, size_t(n) * sizeof(float)) == 0;
          INFO("slice from row " << r0);
          CHECK(same);
        }
      }
    }
  }
}

}  // namespace

// Weights packed at load (pack_weights: AVX-512 panels of 16 rows, AVX2 panels of 8, nibbles
// kept packed) are the file's bytes rearranged; matmul on them must equal matmul on the file
// layout bit for bit (same exact integer block sums, same fp32 sequence), for decode and
// batched prefill, any thread count, partial panels and odd block counts, and for row slices
// (tensor parallelism).
TEST_CASE("packed weights give bit-identical matmul results", "[kernels]") {
  LevelGuard guard;
  for (CpuLevel level : {CpuLevel::Avx2, CpuLevel::Avx512}) {
    if (!cpu_level_supported(level)) {
      WARN("SKIPPED: this CPU has no " << cpu_level_name(level));
      continue;
    }
    set_cpu_level(level);
    check_packed_matmul(level);
  }
}

TEST_CASE("matmul_many equals one matmul per weight, bit for bit, at every CPU level", "[kernels]") {
  LevelGuard guard;
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  ThreadPool pool3(3);
  for (CpuLevel level : {CpuLevel::Scalar, CpuLevel::Avx2, CpuLevel::Avx512}) {
    if (!cpu_level_supported(level)) continue;
    set_cpu_level(level);
    for (DType t : kWeightTypes) {
      // Q, K, V-like shapes (rows not multiples of 16), then a mixed-type group (per-weight path).
      const int64_t K = whole(t, 96);
      OwnedWeight a(t, 70, K, rng), b(t, 24, K, rng), c(t, 17, K, rng);
      OwnedWeight d(t == DType::Q8_0 ? DType::Q4_0 : DType::Q8_0, 33, K, rng);
      Weight pa = a.w, pb = b.w, pc = c.w;
      std::vector<Weight*> ws{&pa, &pb, &pc};
      const PackedWeights packed = pack_weights(ws);
      for (int64_t T : {1, 5, 9}) {
        INFO(cpu_level_name(level) << " " << dtype_name(t) << " T " << T);
        const auto x = gaussian(size_t(T * K), rng);
        std::vector<float> ya(size_t(T * 70), NAN), yb(size_t(T * 24), NAN), yc(size_t(T * 17), NAN), yd(size_t(T * 33), NAN);
        auto ra = ya, rb = yb, rc = yc, rd = yd;
        MatmulScratch s1, s2;
        matmul(pool3, s1, ra.data(), x.data(), T, pa);
        matmul(pool3, s1, rb.data(), x.data(), T, pb);
        matmul(pool3, s1, rc.data(), x.data(), T, pc);
        matmul(pool3, s1, rd.data(), x.data(), T, d.w);
        matmul_many(pool3, s2, x.data(), T, {{ya.data(), &pa}, {yb.data(), &pb}, {yc.data(), &pc}});
        CHECK(std::memcmp(ya.data(), ra.data(), ya.size() * sizeof(float)) == 0);
        CHECK(std::memcmp(yb.data(), rb.data(), yb.size() * sizeof(float)) == 0);
        CHECK(std::memcmp(yc.data(), rc.data(), yc.size() * sizeof(float)) == 0);
        std::fill(ya.begin(), ya.end(), NAN);
        matmul_many(pool3, s2, x.data(), T, {{ya.data(), &pa}, {yd.data(), &d.w}});
        CHECK(std::memcmp(ya.data(), ra.data(), ya.size() * sizeof(float)) == 0);
        CHECK(std::memcmp(yd.data(), rd.data(), yd.size() * sizeof(float)) == 0);
      }
    }
  }
}

TEST_CASE("quantize_act_q8, dot_f32 and axpy_f32 agree across CPU levels", "[kernels]") {
  LevelGuard guard;
  std::mt19937_64 rng(fresh_seed());
  const int64_t n = 32 * 37;
  auto x = gaussian(size_t(n), rng);
  for (int i = 0; i < 32; ++i) x[size_t(64 + i)] = 0.0f;  // an all-zero block: d = 0
  // A block of exact ties (d = 1): rounded to even, as nearbyint does: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2.
  for (int i = 0; i < 32; ++i) x[size_t(96 + i)] = i == 0 ? 127.0f : float(i % 8) * (i % 2 ? -1.0f : 1.0f) + 0.5f;
  set_cpu_level(CpuLevel::Scalar);
  std::vector<BlockQ8Act> want(size_t(n / 32));
  quantize_act_q8(x.data(), want.data(), n);
  // One scale per 256 values (llama.cpp's Q8_K rule, for K-quant weights): 4 groups of the first 1024.
  const int64_t n256 = 1024;
  std::vector<BlockQ8Act> want256(size_t(n256 / 32));
  quantize_act_q8(x.data(), want256.data(), n256, 256);
  for (int64_t g = 0; g < n256 / 256; ++g) {
    float amax = 0.0f;
    for (int64_t i = 0; i < 256; ++i) amax = std::max(amax, std::fabs(x[size_t(g * 256 + i)]));
    int qmax = 0;
    for (int64_t b = g * 8; b < g * 8 + 8; ++b) {
      CHECK(want256[size_t(b)].d == want256[size_t(g * 8)].d);
      int32_t sum = 0;
      for (int i = 0; i < 32; ++i) {
        const float v = x[size_t(b * 32 + i)], q = float(want256[size_t(b)].qs[i]);
        CHECK(std::fabs(v - want256[size_t(b)].d * q) <= 0.5001f * want256[size_t(b)].d);
        qmax = std::max(qmax, std::abs(int(want256[size_t(b)].qs[i])));
        sum += want256[size_t(b)].qs[i];
      }
      CHECK(want256[size_t(b)].s == want256[size_t(b)].d * float(sum));
    }
    CHECK(qmax == 127);
    CHECK(want256[size_t(g * 8)].d == 1.0f / (127.0f / amax));
  }
  CHECK_THROWS_AS(quantize_act_q8(x.data(), want256.data(), n256, 64), UsageError);
  for (CpuLevel level : supported_levels()) {
    set_cpu_level(level);
    INFO(cpu_level_name(level));
    std::vector<BlockQ8Act> got(want.size());
    quantize_act_q8(x.data(), got.data(), n);
    CHECK(std::memcmp(got.data(), want.data(), got.size() * sizeof(BlockQ8Act)) == 0);
    std::vector<BlockQ8Act> got256(want256.size());
    quantize_act_q8(x.data(), got256.data(), n256, 256);
    CHECK(std::memcmp(got256.data(), want256.data(), got256.size() * sizeof(BlockQ8Act)) == 0);
    for (int64_t len : {1, 7, 16, 31, 64, 100}) {
      const auto a = gaussian(size_t(len), rng), b = gaussian(size_t(len), rng);
      double ref = 0;
      for (int64_t i = 0; i < len; ++i) ref += double(a[size_t(i)]) * b[size_t(i)];
      double mag = 0;
      for (int64_t i = 0; i < len; ++i) mag += std::fabs(double(a[size_t(i)]) * b[size_t(i)]);
      CHECK(std::fabs(dot_f32(a.data(), b.data(), len) - ref) <= 1e-6 * mag);
      std::vector<float> y = b;
      axpy_f32(y.data(), 0.75f, a.data(), len);
      for (int64_t i = 0; i < len; ++i)
        CHECK(std::fabs(y[size_t(i)] - (double(b[size_t(i)]) + 0.75 * a[size_t(i)])) <= 1e-6 * (1 + std::fabs(y[size_t(i)])));
    }
  }
  CHECK_THROWS(cpu_level_from_name("sse9"));
  CHECK(std::string(cpu_kernels_name()) == cpu_level_name(cpu_level()));
}

// Attention's two inner loops over one KV-cache block (keys transposed [hd, bt], values
// strided [n, stride]), G heads at once, at every level, against fp64; a head's results do not
// depend on how many heads share the call (decode vs batched prefill).
TEST_CASE("attn_scores and attn_accumulate match fp64 at every CPU level", "[kernels]") {
  LevelGuard guard;
  std::mt19937_64 rng(fresh_seed());
  for (CpuLevel level : supported_levels()) {
    set_cpu_level(level);
    for (int64_t hd : {7, 48, 64, 80, 128}) {
      for (int64_t n : {1, 5, 16, 17, 33}) {
        for (int64_t G : {1, 3, 5}) {
          const int64_t bt = n + 3;           // block longer than the positions used
          const int64_t stride = hd * 3 + 5;  // V rows hold other heads too
          const int64_t ss = n + 2, as = n + 1;
          const auto q = gaussian(size_t(G * hd), rng), kT = gaussian(size_t(hd * bt), rng);
          const auto v = gaussian(size_t(n * stride), rng), a = gaussian(size_t(G * as), rng);
          const auto out0 = gaussian(size_t(G * hd), rng);
          std::vector<float> s(size_t(G * ss), 7.0f), out = out0;
          attn_scores(s.data(), ss, q.data(), G, kT.data(), n, bt, hd, 0.125f);
          attn_accumulate(out.data(), a.data(), as, G, v.data(), n, stride, hd);
          INFO(cpu_level_name(level) << " hd " << hd << " n " << n << " G " << G);
          for (int64_t g = 0; g < G; ++g) {
            std::vector<float> ref_s(static_cast<size_t>(n)), ref_out(static_cast<size_t>(hd)), s_g(static_cast<size_t>(n));
            double worst_s = 0;  // |s - ref| relative to scale·Σ|q||k| (single dots can cancel)
            for (int64_t p = 0; p < n; ++p) {
              double acc = 0, mag = 0;
              for (int64_t j = 0; j < hd; ++j) {
                const double t = double(q[size_t(g * hd + j)]) * kT[size_t(j * bt + p)];
                acc += t, mag += std::fabs(t);
              }
              ref_s[size_t(p)] = float(0.125 * acc);
              s_g[size_t(p)] = s[size_t(g * ss + p)];
              worst_s = std::max(worst_s, std::fabs(s_g[size_t(p)] - 0.125 * acc) / (0.125 * mag));
            }
            CHECK(s[size_t(g * ss + n)] == 7.0f);  // nothing written past n
            for (int64_t j = 0; j < hd; ++j) {
              double acc = out0[size_t(g * hd + j)];
              for (int64_t p = 0; p < n; ++p) acc += double(a[size_t(g * as + p)]) * v[size_t(p * stride + j)];
              ref_out[size_t(j)] = float(acc);
            }
            CHECK(worst_s < 1e-6);
            if (n >= 16) CHECK(rel_err(s_g.data(), ref_s.data(), s_g.size()) < 1e-5);
            CHECK(rel_err(out.data() + g * hd, ref_out.data(), ref_out.size()) < 1e-5);
            // The same head alone gives the same bits.
            std::vector<float> s1(static_cast<size_t>(n)), o1(out0.begin() + g * hd, out0.begin() + (g + 1) * hd);
            attn_scores(s1.data(), n, q.data() + g * hd, 1, kT.data(), n, bt, hd, 0.125f);
            attn_accumulate(o1.data(), a.data() + g * as, as, 1, v.data(), n, stride, hd);
            CHECK(std::memcmp(s1.data(), s_g.data(), size_t(n) * sizeof(float)) == 0);
            CHECK(std::memcmp(o1.data(), out.data() + g * hd, size_t(hd) * sizeof(float)) == 0);
          }
        }
      }
    }
  }
}

// The vector e^x of softmax and swiglu at every level: lengths around the vector widths, wide
// ranges (softmax terms down to e^-150 underflow, swiglu gates up to ±120 saturate).
// bf16 KV blocks: the reference is fp64 over the bf16-rounded operands (so only the fp32 sums
// differ: bound 1e-5 relative to Σ|terms|), plus the check that rounding the operands costs
// about 2^-8 against the fp32 values.
TEST_CASE("attn_scores_bf16, attn_accumulate_bf16 and to_bf16 match fp64 at every CPU level", "[kernels]") {
  LevelGuard guard;
  std::mt19937_64 rng(fresh_seed());
  auto bf = [](float x) { return bf16_to_fp32(fp32_to_bf16(x)); };
  for (CpuLevel level : supported_levels()) {
    set_cpu_level(level);
    {  // to_bf16 == fp32_to_bf16 on normal values, any length
      const auto x = gaussian(37, rng);
      std::vector<uint16_t> h(37, 0xdead);
      to_bf16(h.data(), x.data(), 37);
      for (size_t i = 0; i < x.size(); ++i) CHECK(h[i] == fp32_to_bf16(x[i]));
    }
    for (int64_t hd : {48, 64, 128}) {
      for (int64_t n : {1, 5, 16}) {
        for (int64_t G : {1, 3, 5}) {
          const int64_t bt = 16, ss = n + 2, as = 18;  // as >= n + 1, even
          const auto q = gaussian(size_t(G * hd), rng), kf = gaussian(size_t(hd * bt), rng);
          const auto vf = gaussian(size_t(bt * hd), rng);
          std::vector<float> a = gaussian(size_t(G * as), rng);
          for (float& x : a) x = std::fabs(x) * 0.1f;  // softmax weights are non-negative
          const auto out0 = gaussian(size_t(G * hd), rng);
          // Paired layouts: K (j, p) at ((j/2)·bt + p)·2 + j%2, V (p, j) at ((p/2)·hd + j)·2 + p%2.
          std::vector<uint16_t> qb(q.size()), kb(size_t(hd * bt)), vb(size_t(bt * hd)), ab(a.size());
          to_bf16(qb.data(), q.data(), int64_t(q.size()));
          for (int64_t j = 0; j < hd; ++j)
            for (int64_t p = 0; p < bt; ++p) {
              kb[size_t(((j / 2) * bt + p) * 2 + j % 2)] = fp32_to_bf16(kf[size_t(j * bt + p)]);
              vb[size_t(((p / 2) * hd + j) * 2 + p % 2)] = fp32_to_bf16(vf[size_t(p * hd + j)]);
            }
          for (int64_t g = 0; g < G; ++g)
            for (int64_t p = 0; p < as; ++p) ab[size_t(g * as + p)] = p < n ? fp32_to_bf16(a[size_t(g * as + p)]) : 0;
          std::vector<float> s(size_t(G * ss), 7.0f), out = out0;
          attn_scores_bf16(s.data(), ss, qb.data(), G, kb.data(), n, bt, hd, 0.125f);
          attn_accumulate_bf16(out.data(), ab.data(), as, G, vb.data(), n, hd);
          INFO(cpu_level_name(level) << " hd " << hd << " n " << n << " G " << G);
          double worst_s = 0, worst_o = 0, round_s = 0;
          for (int64_t g = 0; g < G; ++g) {
            for (int64_t p = 0; p < n; ++p) {
              double acc = 0, mag = 0, exact = 0;
              for (int64_t j = 0; j < hd; ++j) {
                const double t = double(bf(q[size_t(g * hd + j)])) * bf(kf[size_t(j * bt + p)]);
                acc += t, mag += std::fabs(t), exact += double(q[size_t(g * hd + j)]) * kf[size_t(j * bt + p)];
              }
              worst_s = std::max(worst_s, std::fabs(s[size_t(g * ss + p)] - 0.125 * acc) / (0.125 * mag));
              round_s = std::max(round_s, std::fabs(acc - exact) / mag);
            }
            CHECK(s[size_t(g * ss + n)] == 7.0f);  // nothing written past n
            for (int64_t j = 0; j < hd; ++j) {
              double acc = out0[size_t(g * hd + j)], mag = std::fabs(acc);
              for (int64_t p = 0; p < n; ++p) {
                const double t = double(bf(a[size_t(g * as + p)])) * bf(vf[size_t(p * hd + j)]);
                acc += t, mag += std::fabs(t);
              }
              worst_o = std::max(worst_o, std::fabs(out[size_t(g * hd + j)] - acc) / mag);
            }
          }
          CHECK(worst_s < 1e-5);
          CHECK(worst_o < 1e-5);
          CHECK(round_s < 1e-2);  // what bf16 operands cost against fp32 ones (about 2^-8)
        }
      }
    }
  }
}

TEST_CASE("softmax and swiglu at every CPU level match fp64 on wide ranges", "[kernels]") {
  LevelGuard guard;
  std::mt19937_64 rng(fresh_seed());
  for (CpuLevel level : supported_levels()) {
    set_cpu_level(level);
    for (int64_t n : {1, 7, 8, 15, 16, 17, 100, 577}) {
      for (float spread : {1.0f, 10.0f, 40.0f}) {
        auto x = gaussian(size_t(n), rng), up = gaussian(size_t(n), rng);
        for (auto& v : x) v *= spread;
        std::vector<float> sm = x, g = x, ref_sm(x.size()), ref_g(x.size());
        softmax(sm.data(), n);
        swiglu(g.data(), up.data(), n);
        double mx = -1e300, z = 0;
        for (float v : x) mx = std::max(mx, double(v));
        for (float v : x) z += std::exp(double(v) - mx);
        for (size_t i = 0; i < x.size(); ++i) {
          ref_sm[i] = float(std::exp(double(x[i]) - mx) / z);
          ref_g[i] = float(double(x[i]) / (1 + std::exp(-double(x[i]))) * up[i]);
        }
        INFO(cpu_level_name(level) << " n " << n << " spread " << spread);
        // relative, with an absolute floor: silu(g) for g < -88 is below FLT_MIN (0 in fp32)
        auto err = [](const std::vector<float>& a, const std::vector<float>& ref) {
          double e = 0, r = 0;
          for (size_t i = 0; i < a.size(); ++i) e += (double(a[i]) - ref[i]) * (double(a[i]) - ref[i]), r += double(ref[i]) * ref[i];
          return std::sqrt(e) / (std::sqrt(r) + 1e-30);
        };
        CHECK(err(sm, ref_sm) < 1e-6);
        CHECK(err(g, ref_g) < 1e-6);
        double total = 0;
        for (float v : sm) total += v;
        CHECK(std::fabs(total - 1.0) < 1e-5);
      }
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
