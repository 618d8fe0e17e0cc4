// GeGLU's fp32 error against fp64, for the old tanh form 0.5·g·(1 + tanh(y)) (the scalar code
// before the thirteenth session) and the sigmoid form g / (1 + e^(−2y)) every level computes now,
// y = √(2/π)(g + 0.044715 g³). The tanh form cancels in 1 + tanh(y) for negative g
// (bench/RESULTS.md, "Greedy text before and after"). x86-64 with AVX-512:
//   build-simd/dev/geglu_error
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "engine/cpu/cpu_x86.h"

namespace {

__attribute__((optimize("fp-contract=off"))) float tanh_form(float g) {
  return 0.5f * g * (1.0f + std::tanh(0.7978845608028654f * (g + 0.044715f * g * g * g)));
}

double exact(double x) { return 0.5 * x * (1 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))); }

// Relative errors where |gelu| >= 1e-6 (below that the relative error says little): median,
// p99, p99.99, max.
void report(const char* name, const std::vector<float>& g, const std::vector<float>& got) {
  std::vector<double> rel;
  for (size_t i = 0; i < g.size(); ++i) {
    const double t = exact(g[i]);
    if (std::fabs(t) >= 1e-6) rel.push_back(std::fabs(got[i] - t) / std::fabs(t));
  }
  std::sort(rel.begin(), rel.end());
  const size_t n = rel.size();
  std::printf("%-22s median %.2e  p99 %.2e  p99.99 %.2e  max %.2e  (%zu values)\n", name, rel[n / 2], rel[n * 99 / 100],
              rel[n * 9999 / 10000], rel.back(), n);
}

}  // namespace

int main() {
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0, 2);
  const int64_t n = int64_t(1) << 22;
  std::vector<float> g(size_t(n)), one(size_t(n), 1.0f), out(size_t(n));
  for (float& x : g) x = normal(rng);
  for (int64_t i = 0; i < n; ++i) out[size_t(i)] = tanh_form(g[size_t(i)]);
  report("tanh form (tanhf)", g, out);
  if (llmq::x86::cpu_has_avx2()) {
    out = g;
    llmq::x86::kernels_avx2()->geglu(out.data(), one.data(), n);
    report("sigmoid form, AVX2", g, out);
  }
  if (llmq::x86::cpu_has_avx512()) {
    out = g;
    llmq::x86::kernels_avx512()->geglu(out.data(), one.data(), n);
    report("sigmoid form, AVX-512", g, out);
  }
}
