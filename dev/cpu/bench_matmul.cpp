// Micro-benchmark of llmq::matmul on SmolLM2-135M's shapes, per type and CPU level, plus the
// machine's streaming-read bandwidth with the same thread count.
//
//   dev/cpu/build.sh && build-simd/dev/bench_matmul [-t threads] [-T 1,512] [--types q8_0,...]
//        [--levels scalar,avx2,avx512] [--shapes 576x576,...] [--min-sec 0.3] [--hot 1]
//
// T = 1 (decode) is timed with the weights out of cache: enough copies of the matrix to fill
// 256 MiB are used in turn, so every call streams its weight bytes from DRAM; reported as GB/s
// of weight bytes and % of the measured read bandwidth. T > 1 (prefill) is reported as GFLOP/s
// (2·rows·cols·T per call) with one copy of the weights.
#include <immintrin.h>

#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "engine/cpu/cpu_ops.h"

using namespace llmq;
using clk = std::chrono::steady_clock;

namespace {

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  size_t a = 0;
  while (a <= s.size()) {
    size_t b = s.find(',', a);
    if (b == std::string::npos) b = s.size();
    if (b > a) out.push_back(s.substr(a, b - a));
    a = b + 1;
  }
  return out;
}

double now() { return std::chrono::duration<double>(clk::now().time_since_epoch()).count(); }
// CPU seconds used by the whole process (all threads): robust to other processes' load.
double cpu_now() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

// Streaming read of `bytes` split over the pool: sum of 64-bit words with 4 AVX2 accumulators.
__attribute__((target("avx2"))) uint64_t read_sum(const uint8_t* p, size_t n) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = 0; i + 128 <= n; i += 128) {
    a0 = _mm256_add_epi64(a0, _mm256_load_si256((const __m256i*)(p + i)));
    a1 = _mm256_add_epi64(a1, _mm256_load_si256((const __m256i*)(p + i + 32)));
    a2 = _mm256_add_epi64(a2, _mm256_load_si256((const __m256i*)(p + i + 64)));
    a3 = _mm256_add_epi64(a3, _mm256_load_si256((const __m256i*)(p + i + 96)));
  }
  __m256i s = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
  alignas(32) uint64_t v[4];
  _mm256_store_si256((__m256i*)v, s);
  return v[0] + v[1] + v[2] + v[3];
}

double read_bandwidth(ThreadPool& pool) {
  const size_t n = size_t(512) << 20;
  uint8_t* buf = static_cast<uint8_t*>(std::aligned_alloc(64, n));
  std::memset(buf, 1, n);
  std::vector<uint64_t> sink(size_t(pool.size()));
  double best = 0;
  for (int rep = 0; rep < 7; ++rep) {
    const double t0 = now();
    pool.parallel_for(pool.size(), [&](int64_t a, int64_t, int th) {
      const size_t chunk = n / size_t(pool.size());
      sink[size_t(th)] += read_sum(buf + size_t(a) * chunk, chunk);
    });
    best = std::max(best, double(n) / (now() - t0) / 1e9);
  }
  std::free(buf);
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 2;
  std::vector<int64_t> Ts = {1, 512};
  std::vector<std::string> types = {"f32", "f16", "bf16", "q8_0", "q4_0", "q4_1"};
  std::vector<std::string> levels = {"scalar", "avx2", "avx512"};
  std::vector<std::string> shapes = {"576x576", "192x576", "1536x576", "576x1536", "49152x576"};
  double min_sec = 0.3;
  bool hot = false;  // T = 1 with one copy of the weights (cache-resident when small enough)
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "-t") threads = std::stoi(v);
    else if (a == "-T") { Ts.clear(); for (auto& s : split(v)) Ts.push_back(std::stoll(s)); }
    else if (a == "--types") types = split(v);
    else if (a == "--levels") levels = split(v);
    else if (a == "--shapes") shapes = split(v);
    else if (a == "--min-sec") min_sec = std::stod(v);
    else if (a == "--hot") hot = v == "1";
  }
  ThreadPool pool(threads);
  const double bw = read_bandwidth(pool);
  std::printf("threads %d  best level %s  streaming read %.1f GB/s\n", threads, cpu_level_name(cpu_best_level()), bw);
  std::printf("%-6s %-7s %-10s %5s %10s %9s %7s %9s %9s\n", "level", "type", "shape", "T", "us/call", "GB/s", "%bw",
              "GFLOP/s", "GF/s(cpu)");
  std::mt19937_64 rng(42);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (const auto& tn : types) {
    const DType type = dtype_from_name(tn);
    for (const auto& sh : shapes) {
      const int64_t rows = std::stoll(sh.substr(0, sh.find('x'))), cols = std::stoll(sh.substr(sh.find('x') + 1));
      const size_t bytes = row_bytes(type, cols) * size_t(rows);
      // One quantized copy, replicated.
      std::vector<uint8_t> one(bytes);
      std::vector<float> tmp(static_cast<size_t>(cols));
      for (int64_t r = 0; r < rows; ++r) {
        for (auto& v : tmp) v = nd(rng) * 0.05f;
        quantize_row(type, tmp.data(), one.data() + size_t(r) * row_bytes(type, cols), cols);
      }
      // Copies 64-byte aligned, as tensors are in a .llmq file.
      const size_t stride = (bytes + 63) / 64 * 64;
      const size_t copies = std::max<size_t>(2, (size_t(256) << 20) / stride);
      uint8_t* many = static_cast<uint8_t*>(std::aligned_alloc(64, stride * copies));
      for (size_t c = 0; c < copies; ++c) std::memcpy(many + c * stride, one.data(), bytes);
      for (int64_t T : Ts) {
        std::vector<float> x(size_t(T * cols)), y(size_t(T * rows));
        for (auto& v : x) v = nd(rng);
        for (const auto& ln : levels) {
          const CpuLevel level = cpu_level_from_name(ln.c_str());
          if (!cpu_level_supported(level)) continue;
          set_cpu_level(level);
          MatmulScratch s;
          const bool cold = T == 1 && !hot;
          // The engine's layout: weights packed at load where the level has a packed layout
          // (AVX-512 Q8_0/Q4_0/Q4_1; LLMQ_PACK=0 measures packing per call). One packed copy per
          // file copy that a cold run cycles through.
          std::vector<Weight> ws(cold ? copies : 1);
          for (size_t i = 0; i < ws.size(); ++i) ws[i] = Weight{type, many + i * stride, rows, cols};
          std::vector<Weight*> wp;
          for (auto& w : ws) wp.push_back(&w);
          const PackedWeights packed = pack_weights(wp);
          size_t c = 0;
          auto call = [&] { matmul(pool, s, y.data(), x.data(), T, ws[cold ? c++ % copies : 0]); };
          call();  // warm-up (scratch sizing)
          // Calls until min_sec has passed; best of 3 such rounds (per-call average).
          double best = 1e30, best_cpu = 1e30;
          for (int round = 0; round < 3; ++round) {
            int n = 0;
            const double t0 = now(), c0 = cpu_now();
            double t1;
            do {
              call();
              ++n;
              t1 = now();
            } while (t1 - t0 < min_sec / 3);
            best = std::min(best, (t1 - t0) / n);
            best_cpu = std::min(best_cpu, (cpu_now() - c0) / n / threads);
          }
          const double gbs = double(bytes) / best / 1e9, gflops = 2.0 * double(rows) * cols * T / best / 1e9;
          std::printf("%-6s %-7s %-10s %5lld %10.1f %9.2f %6.0f%% %9.2f %9.2f\n", ln.c_str(), tn.c_str(), sh.c_str(),
                      (long long)T, best * 1e6, gbs, 100 * gbs / bw, gflops,
                      2.0 * double(rows) * cols * T / best_cpu / 1e9);
          std::fflush(stdout);
        }
      }
      std::free(many);
    }
  }
}
