// Instruction throughput on one core, from asm loops with 12 independent accumulators (no
// memory, nothing the compiler can fold): the ceilings the CPU kernels are measured against
// (dev/README.md #21). x86-64 with AVX-512 VNNI and BF16; run it pinned to a quiet core:
//   build-simd/dev/bench_peak
#include <chrono>
#include <cstdio>

namespace {

template <class F>
double seconds(F f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

#define LLMQ_X12(op)                                                                                                       \
  op " %%zmm30, %%zmm31, %%zmm0\n" op " %%zmm30, %%zmm31, %%zmm1\n" op " %%zmm30, %%zmm31, %%zmm2\n" op                   \
     " %%zmm30, %%zmm31, %%zmm3\n" op " %%zmm30, %%zmm31, %%zmm4\n" op " %%zmm30, %%zmm31, %%zmm5\n" op                   \
     " %%zmm30, %%zmm31, %%zmm6\n" op " %%zmm30, %%zmm31, %%zmm7\n" op " %%zmm30, %%zmm31, %%zmm8\n" op                   \
     " %%zmm30, %%zmm31, %%zmm9\n" op " %%zmm30, %%zmm31, %%zmm10\n" op " %%zmm30, %%zmm31, %%zmm11\n"
#define LLMQ_CLOBBER "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11"

}  // namespace

int main() {
  const long n = 100000000;
  double s = seconds([&] {
    for (long i = 0; i < n; ++i) asm volatile(LLMQ_X12("vpdpbusd") ::: LLMQ_CLOBBER);
  });
  std::printf("vpdpbusd zmm      %.3g /s  %6.1f GOP/s (64 u8 x s8 multiply-adds each)\n", n * 12 / s, n * 12 * 128 / s / 1e9);
  s = seconds([&] {
    for (long i = 0; i < n; ++i) asm volatile(LLMQ_X12("vfmadd231ps") ::: LLMQ_CLOBBER);
  });
  std::printf("vfmadd231ps zmm   %.3g /s  %6.1f GFLOP/s\n", n * 12 / s, n * 12 * 32 / s / 1e9);
  s = seconds([&] {
    for (long i = 0; i < n; ++i) asm volatile(LLMQ_X12("vdpbf16ps") ::: LLMQ_CLOBBER);
  });
  std::printf("vdpbf16ps zmm     %.3g /s  %6.1f GFLOP/s\n", n * 12 / s, n * 12 * 64 / s / 1e9);
  // The packed GEMM tile's mix (engine/cpu/cpu_x86.cpp packed_tile): per block and token 8
  // vpdpbusd, then one vcvtdq2ps, one vmulps and one vfmadd231ps.
  s = seconds([&] {
    for (long i = 0; i < n; ++i)
      asm volatile(
          "vpdpbusd %%zmm30, %%zmm31, %%zmm0\n vpdpbusd %%zmm30, %%zmm31, %%zmm1\n vpdpbusd %%zmm30, %%zmm31, %%zmm2\n"
          "vpdpbusd %%zmm30, %%zmm31, %%zmm3\n vpdpbusd %%zmm30, %%zmm31, %%zmm4\n vpdpbusd %%zmm30, %%zmm31, %%zmm5\n"
          "vpdpbusd %%zmm30, %%zmm31, %%zmm6\n vpdpbusd %%zmm30, %%zmm31, %%zmm7\n"
          "vcvtdq2ps %%zmm27, %%zmm8\n vmulps %%zmm29, %%zmm28, %%zmm9\n vfmadd231ps %%zmm29, %%zmm28, %%zmm10\n" ::
              : LLMQ_CLOBBER);
  });
  std::printf("tile mix          %.3g vpdpbusd/s (8 vpdpbusd + cvt + mul + fma per round)\n", n * 8 / s);
  return 0;
}
