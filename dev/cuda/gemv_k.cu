// K-quant GEMV lab (decode matmuls of the Q4_K_M mix): Q4_K and Q6_K rows in the file's layout
// (engine/cuda/raw_blocks.cuh), llama-2-7b's matrices, T = 1 and 2. Each version is checked
// against version 1 (the engine's gemv) and timed with CUDA events over copies of the matrix
// larger than the L2, as dev/cuda/gemv.cu does for Q4_0 / Q8_0.
//
//   dev/cuda/build.sh && build-gpu/dev/gemv_k [--reps N]
//
// Versions:
//   v0  the engine's fp32-activation kernels (gemv_q45k_kernel / gemv_q6k_kernel, what gemv runs
//       when xq.q is null): eight lanes per 256-weight super-block, two rows per warp; H100: 30%
//       of the copy rate over a 7B Q4_K_M decode
//   v2  the same lanes on int8 activations (quantize_act's per-32 blocks, which the engine's
//       Q4_0 / Q8_0 GEMV already uses): dp4a on the quant nibbles (Q4_K, Q5_K with their fifth
//       bits) or the rebuilt 6-bit values (Q6_K), a quarter of v0's activation bytes; R rows per
//       warp. The engine's templates (engine/cuda/gemv.cuh: gemv_q45k_q8_kernel,
//       gemv_q6k_q8_kernel) at R = 1, 2, 4. H200: faster than v0 on every matrix at T = 1 and 2
//       (Q4_K R1 1.35x, Q6_K R2 1.3x) -> graduated for Q4_K (R1) and Q6_K (R2); Q5_K not yet run
//   v2 for IQ4_NL (this file: the engine's gemv_iq4nl_kernel lanes, one lane per block, 16-bit
//       loads; the 32 levels as int8, dp4a'd against the block's int8 activations: d d_x Σ l q_x),
//       not yet run on a GPU
//   v1  engine (what gemv runs: v2 for Q4_K and Q6_K, v0 for the others)
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "engine/cuda/common.cuh"
#include "engine/cuda/cuda.h"
#include "engine/cuda/gemv.cuh"
#include "engine/cuda/matmul.h"
#include "engine/cuda/raw_blocks.cuh"
#include "dev/cuda/lab.h"
#include "formats/quant.h"

using namespace llmq;
using namespace llmq::cuda;

#define CK(x) check((x), #x)

namespace {

// v2, IQ4_NL: lane = block (b = lane, lane + 32, ...), R rows per warp.
template <int R>
__global__ void __launch_bounds__(128) iq4nl_v2(const uint8_t* __restrict__ wq, size_t rb, const int8_t* __restrict__ xq,
                                                const float* __restrict__ xd, float* __restrict__ y, int rows, int cols, int T) {
  constexpr int kBlockBytes = raw_block_bytes(DType::IQ4_NL);
  const int row0 = warp_row0<R>(rows);
  if (row0 < 0) return;
  const int nb = cols / 32;
  float acc[R][kGemvMaxTokens] = {};
  for (int b = int(threadIdx.x); b < nb; b += 32) {
    uint4 lo[R], hi[R];  // weights 0..15 and 16..31 as int8
    float d[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = wq + size_t(min(row0 + r, rows - 1)) * rb + size_t(b) * kBlockBytes;
      d[r] = fp16_bits_to_float(__ldg(reinterpret_cast<const uint16_t*>(blk)));
      uint32_t qw[4], l[4], u[4];
      ld_words2<4>(blk + kIQ4NLQs, qw);
#pragma unroll
      for (int c = 0; c < 4; ++c) l[c] = iq4_nl_level_bytes(qw[c]), u[c] = iq4_nl_level_bytes(qw[c] >> 4);
      lo[r] = make_uint4(l[0], l[1], l[2], l[3]), hi[r] = make_uint4(u[0], u[1], u[2], u[3]);
    }
#pragma unroll
    for (int t = 0; t < kGemvMaxTokens; ++t)
      if (t < T) {
        const int4* xr = reinterpret_cast<const int4*>(xq + size_t(t) * cols + size_t(b) * 32);
        const int4 x0 = __ldg(xr), x1 = __ldg(xr + 1);
        const float dx = __ldg(xd + t * nb + b);
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r][t] += d[r] * dx * float(dp4a4(hi[r], x1, dp4a4(lo[r], x0, 0)));
      }
  }
#pragma unroll
  for (int r = 0; r < R; ++r)
    if (row0 + r < rows) store_rows(acc[r], y, rows, row0 + r, T);
}

struct Shape {
  int rows, cols;
  const char* what;
};

struct Case {
  std::string name;
  bool int8;  // compared with v1 at the int8 activations' tolerance
  std::function<void(const DeviceWeight&, const DeviceActQ8&, const float*, float*, int)> run;
};

template <int R>
Case v2_case(DType type, const char* name) {
  return {name, true, [type](const DeviceWeight& w, const DeviceActQ8& xq, const float*, float* y, int T) {
            const dim3 block(32, kGemvWarps);
            const unsigned grid = unsigned((w.rows + kGemvWarps * R - 1) / (kGemvWarps * R));
            const size_t rb = row_bytes(type, w.cols);
            const int rows = int(w.rows), cols = int(w.cols);
            switch (type) {
              case DType::Q4_K: gemv_q45k_q8_kernel<R, false><<<grid, block>>>(w.q, rb, xq.q, xq.d, xq.s, y, rows, rows, cols, T); break;
              case DType::Q5_K: gemv_q45k_q8_kernel<R, true><<<grid, block>>>(w.q, rb, xq.q, xq.d, xq.s, y, rows, rows, cols, T); break;
              case DType::Q6_K: gemv_q6k_q8_kernel<R><<<grid, block>>>(w.q, rb, xq.q, xq.d, xq.s, y, rows, rows, cols, T); break;
              default: iq4nl_v2<R><<<grid, block>>>(w.q, rb, xq.q, xq.d, y, rows, cols, T); break;
            }
          }};
}

std::vector<Case> cases(DType type) {
  return {{"v1 engine", false, [](const DeviceWeight& w, const DeviceActQ8& xq, const float* x, float* y, int T) { gemv(w, x, xq, y, T, 0, nullptr); }},
          {"v0 fp32 act", true, [](const DeviceWeight& w, const DeviceActQ8&, const float* x, float* y, int T) { gemv(w, x, DeviceActQ8{}, y, T, 0, nullptr); }},
          v2_case<1>(type, "v2 R1"), v2_case<2>(type, "v2 R2"), v2_case<4>(type, "v2 R4")};
}

void run_type(DType type, const std::vector<Shape>& shapes, int T, int reps, double copy_gbs) {
  const std::vector<Case> cs = cases(type);
  for (const Shape& sh : shapes) {
    const lab::WeightCopies wc(type, sh.rows, sh.cols);  // fill_random: the file's blocks, sane fp16 scales
    const double bytes = double(row_bytes(type, sh.cols)) * sh.rows;
    const lab::Activations act(T, sh.cols);
    const DeviceBuffer& x = act.x;
    const DeviceActQ8 xq = act.xq;
    quantize_act(x.as<float>(), xq, T, sh.cols, nullptr);
    DeviceBuffer y(size_t(T) * sh.rows * 4);
    std::vector<float> ref(size_t(T) * sh.rows), got(ref.size());
    for (size_t ci = 0; ci < cs.size(); ++ci) {
      CK(cudaMemset(y.get(), 0xff, y.bytes()));  // NaN: every element must be written
      cs[ci].run(wc.w[0], xq, x.as<float>(), y.as<float>(), T);
      CK(cudaGetLastError());
      CK(cudaDeviceSynchronize());
      y.download(ci == 0 ? ref.data() : got.data(), ref.size() * 4);
      const double err = ci == 0 ? 0.0 : lab::max_rel_err(got, ref), tol = cs[ci].int8 ? 2e-2 : 1e-4;
      size_t i = 0;
      const double ms = best_time_ms(reps, [&] {
        for (size_t c = 0; c < wc.w.size(); ++c) cs[ci].run(wc.w[(i++) % wc.w.size()], xq, x.as<float>(), y.as<float>(), T);
      }) / double(wc.w.size());
      const double gbs = bytes / (ms * 1e-3) / 1e9;
      std::printf("%-5s T=%d %-8s %5dx%-5d  %-10s %8.2f us  %7.0f GB/s  %5.1f%% of copy  err %.1e%s\n", dtype_name(type), T, sh.what,
                  sh.rows, sh.cols, cs[ci].name.c_str(), ms * 1e3, gbs, 100.0 * gbs / copy_gbs, err, err > tol ? "  MISMATCH" : "");
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const int reps = lab::start(argc, argv, 20);
    const double copy = measure_copy_bandwidth() / 1e9;
    std::printf("copy %.0f GB/s (read + write)\n", copy);
    // llama-2-7b's matrices as a Q4_K_M file has them: Q4_K qkv (stacked), wo, gate_up (stacked),
    // down; Q6_K down (the use_more_bits layers), v and the output.
    const std::vector<Shape> q4k = {{12288, 4096, "qkv"}, {4096, 4096, "wo"}, {22016, 4096, "gate_up"}, {4096, 11008, "down"}};
    const std::vector<Shape> q6k = {{4096, 11008, "down"}, {4096, 4096, "v"}, {32000, 4096, "output"}};
    // The other raw types on the same 7B matrices (a Q5_K_M file's Q5_K; IQ4_NL as llama.cpp's
    // mixes put it where widths are not multiples of 256).
    const std::vector<Shape> other = {{12288, 4096, "qkv"}, {4096, 11008, "down"}};
    for (int T : {1, 2}) {
      run_type(DType::Q4_K, q4k, T, reps, copy);
      run_type(DType::Q6_K, q6k, T, reps, copy);
      for (DType t : {DType::Q5_K, DType::IQ4_NL}) run_type(t, other, T, reps, copy);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gemv_k lab: %s\n", e.what());
    return 1;
  }
  return 0;
}
