// Micro-benchmark of the attention kernels on SmolLM2's shapes (head_dim 64, 3 query heads per
// KV head, blocks of 16 positions with K transposed), per CPU level, timed in thread CPU time
// (robust to load): ns and multiply-adds per ns for attn_scores and attn_accumulate over one
// block for the 3 heads, with the block hot in L1 and cold (a fresh block each call).
//
//   dev/cpu/build.sh && build-simd/dev/bench_attn
#include <time.h>

#include <cstdio>
#include <random>
#include <vector>

#include "engine/cpu/cpu_ops.h"

using namespace llmq;

namespace {
double cpu_now() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}
}  // namespace

int main() {
  const int64_t hd = 64, G = 3, bt = 16;  // SmolLM2: 3 query heads per KV head
  const int64_t nblocks = 24576;          // 24576 blocks × 8 KiB (K^T and V of one head) = 192 MiB: cold when cycled
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  // Per block: K^T [hd, bt] then V [bt, hd] of one KV head, as engine/kv_cache.h lays them out.
  std::vector<float> kv(static_cast<size_t>(nblocks * 2 * bt * hd)), q(static_cast<size_t>(G * hd)),
      s(static_cast<size_t>(G * bt)), out(static_cast<size_t>(G * hd));
  for (auto& v : kv) v = nd(rng);
  for (auto& v : q) v = nd(rng);
  for (CpuLevel level : {CpuLevel::Scalar, CpuLevel::Avx2, CpuLevel::Avx512}) {
    if (!cpu_level_supported(level)) continue;
    set_cpu_level(level);
    for (bool hot : {true, false}) {
      const int64_t calls = hot ? 1000000 : 100000;
      double best_s = 1e30, best_a = 1e30;
      for (int rep = 0; rep < 3; ++rep) {
        double t0 = cpu_now();
        for (int64_t i = 0; i < calls; ++i)
          attn_scores(s.data(), bt, q.data(), G, kv.data() + (hot ? 0 : (i % nblocks) * 2 * bt * hd), bt, bt, hd, 0.125f);
        best_s = std::min(best_s, (cpu_now() - t0) / double(calls));
        t0 = cpu_now();
        for (int64_t i = 0; i < calls; ++i)
          attn_accumulate(out.data(), s.data(), bt, G, kv.data() + (hot ? 0 : (i % nblocks) * 2 * bt * hd) + bt * hd, bt, hd, hd);
        best_a = std::min(best_a, (cpu_now() - t0) / double(calls));
      }
      std::printf("%-6s %-4s  scores %6.1f ns/block (%5.1f MAC/ns)   accumulate %6.1f ns/block (%5.1f MAC/ns)\n",
                  cpu_level_name(level), hot ? "hot" : "cold", best_s * 1e9, double(G * bt * hd) / (best_s * 1e9),
                  best_a * 1e9, double(G * bt * hd) / (best_a * 1e9));
    }
  }
}
