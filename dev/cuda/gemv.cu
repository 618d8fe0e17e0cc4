// GEMV lab (decode matmuls): numbered kernel versions for Q4_0 and Q8_0 weights in the engine's
// split layout (engine/cuda/matmul.h), checked against version 1 (the engine's own gemv) and
// timed with CUDA events over enough copies of each matrix that every call reads its weights
// from DRAM (the copies together are several times the L2). Prints a table: GB/s of weight bytes
// per version and shape, and the device-to-device copy rate measured in the same run.
//
//   dev/cuda/build.sh && build-gpu/dev/gemv [--tokens T] [--reps N]
//
// Versions (each is a template over rows per warp R, warps per block W, tokens T):
//   v1  engine: one warp per row, 4 warps per block, lanes stride over the row's blocks
//   v2  R rows per warp sharing each activation load (registers), W warps per block
//   v3  v2 with the K dimension split over the block's W warps (partial sums through shared
//       memory): more blocks in flight for matrices with few rows
//   v4  v2 with streaming weight loads (ld.global.nc.L1::no_allocate: weights bypass L1)
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "engine/cuda/common.cuh"
#include "engine/cuda/cuda.h"
#include "engine/cuda/gemv.cuh"
#include "engine/cuda/matmul.h"
#include "dev/cuda/lab.h"

using namespace llmq;
using namespace llmq::cuda;

#define CK(x) check((x), #x)

namespace {

template <bool kStream>
__device__ __forceinline__ uint4 ldw(const uint4* p) {
  if constexpr (kStream) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
  } else {
    return __ldg(p);
  }
}

// Q4_0 or Q8_0, R rows per warp: lane handles blocks b = lane, lane + 32 * KS, ... of the K
// slice ks (Q8_0: two 16-byte loads per block, Q4_0: one). KS = 1: one warp per row group
// (v2/v4); KS = W: the block's warps split K (v3).
template <bool kQ8, int R, int W, int T, int KS, bool kStream>
__global__ void __launch_bounds__(32 * W) gemv_lab(const uint8_t* __restrict__ wq, const uint16_t* __restrict__ wd,
                                                   const int8_t* __restrict__ xq, const float* __restrict__ xd,
                                                   const float* __restrict__ xs, float* __restrict__ y, int rows, int cols) {
  constexpr int kChunks = kQ8 ? 2 : 1;  // 16-byte loads per block
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int group = KS == 1 ? blockIdx.x * W + warp : blockIdx.x;
  const int ks = KS == 1 ? 0 : warp;
  const int row0 = group * R;
  if (row0 >= rows) return;
  const int nb = cols / 32;
  const uint4* w[R];
  const uint16_t* d[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int row = min(row0 + r, rows - 1);
    w[r] = reinterpret_cast<const uint4*>(wq) + size_t(row) * nb * kChunks;
    d[r] = wd + size_t(row) * nb;
  }
  float acc[R][T] = {};
#pragma unroll 2
  for (int b = ks * 32 + lane; b < nb; b += 32 * KS) {
    uint4 w0[R], w1[R];
    float dw[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      w0[r] = ldw<kStream>(w[r] + kChunks * b), dw[r] = fp16_bits_to_float(__ldg(d[r] + b));
      if constexpr (kQ8) w1[r] = ldw<kStream>(w[r] + 2 * b + 1);
    }
#pragma unroll
    for (int t = 0; t < T; ++t) {
      const int4* xb = reinterpret_cast<const int4*>(xq + size_t(t) * cols + b * 32);
      const int4 x0 = __ldg(xb), x1 = __ldg(xb + 1);
      const float dx = __ldg(xd + t * nb + b);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if constexpr (kQ8) {
          acc[r][t] += dw[r] * dx * float(dp4a4(w1[r], x1, dp4a4(w0[r], x0, 0)));
        } else {
          const uint4 v = w0[r];
          const uint4 lo = make_uint4(v.x & 0x0f0f0f0fu, v.y & 0x0f0f0f0fu, v.z & 0x0f0f0f0fu, v.w & 0x0f0f0f0fu);
          const uint4 hi = make_uint4((v.x >> 4) & 0x0f0f0f0fu, (v.y >> 4) & 0x0f0f0f0fu, (v.z >> 4) & 0x0f0f0f0fu, (v.w >> 4) & 0x0f0f0f0fu);
          acc[r][t] += dw[r] * (dx * float(dp4a4(hi, x1, dp4a4(lo, x0, 0))) - 8.0f * __ldg(xs + t * nb + b));
        }
      }
    }
  }
  gemv_block_store<R, T, KS>(acc, y, rows, row0, rows, lane, warp);  // the engine's store, ldy = rows
}

struct Shape {
  int rows, cols;
  const char* what;
};

struct Case {
  std::string name;
  std::function<void(const DeviceWeight&, const DeviceActQ8&, const float*, float*)> run;
};

template <int R, int W, int T, int KS, bool kStream>
Case make_case(DType type, const char* name) {
  return {name, [type](const DeviceWeight& w, const DeviceActQ8& xq, const float*, float* y) {
            const int groups = (int(w.rows) + R - 1) / R;
            const unsigned grid = KS == 1 ? unsigned((groups + W - 1) / W) : unsigned(groups);
            if (type == DType::Q4_0)
              gemv_lab<false, R, W, T, KS, kStream><<<grid, 32 * W>>>(w.q, w.d, xq.q, xq.d, xq.s, y, int(w.rows), int(w.cols));
            else
              gemv_lab<true, R, W, T, KS, kStream><<<grid, 32 * W>>>(w.q, w.d, xq.q, xq.d, xq.s, y, int(w.rows), int(w.cols));
          }};
}

template <int T>
std::vector<Case> cases(DType type) {
  std::vector<Case> c;
  c.push_back({"v1 engine", [](const DeviceWeight& w, const DeviceActQ8& xq, const float* x, float* y) { gemv(w, x, xq, y, T, 0, nullptr); }});
  c.push_back(make_case<1, 4, T, 1, false>(type, "v2 R1 W4"));
  c.push_back(make_case<2, 4, T, 1, false>(type, "v2 R2 W4"));
  c.push_back(make_case<4, 4, T, 1, false>(type, "v2 R4 W4"));
  c.push_back(make_case<2, 8, T, 1, false>(type, "v2 R2 W8"));
  c.push_back(make_case<1, 4, T, 4, false>(type, "v3 R1 KS4"));
  c.push_back(make_case<2, 4, T, 4, false>(type, "v3 R2 KS4"));
  c.push_back(make_case<4, 4, T, 4, false>(type, "v3 R4 KS4"));
  // After the sixth GPU session: inside the decode graph Q4_0's products ran at 0.81 of the copy
  // rate and Q8_0's at 0.95 (bench/RESULTS.md); a Q4_0 lane's iteration moves half Q8_0's bytes,
  // so these give each lane more rows (R8) or each row more warps (KS8: 8 warps, 256 threads).
  c.push_back(make_case<8, 4, T, 4, false>(type, "v3 R8 KS4"));
  c.push_back(make_case<4, 8, T, 8, false>(type, "v3 R4 KS8"));
  c.push_back(make_case<2, 4, T, 1, true>(type, "v4 R2 W4 nc"));
  c.push_back(make_case<2, 4, T, 4, true>(type, "v4 R2 KS4 nc"));
  return c;
}

template <int T>
void run_type(DType type, const std::vector<Shape>& shapes, int reps, double copy_gbs) {
  std::vector<Case> cs = cases<T>(type);
  for (const Shape& sh : shapes) {
    const uint64_t bytes = split_weight_bytes(type, sh.rows, sh.cols);
    const lab::WeightCopies wc(type, sh.rows, sh.cols);
    const std::vector<DeviceWeight>& ws = wc.w;
    const int copies = int(wc.size());
    lab::Activations act(T, sh.cols);
    const DeviceBuffer& x = act.x;
    const DeviceActQ8 xq = act.xq;
    quantize_act(x.as<float>(), xq, T, sh.cols, nullptr);
    DeviceBuffer y(size_t(T) * sh.rows * 4);
    std::vector<float> ref(size_t(T) * sh.rows), got(ref.size());
    for (size_t ci = 0; ci < cs.size(); ++ci) {
      CK(cudaMemset(y.get(), 0xff, y.bytes()));  // NaN: every element must be written
      cs[ci].run(ws[0], xq, x.as<float>(), y.as<float>());
      CK(cudaGetLastError());
      CK(cudaDeviceSynchronize());
      y.download(ci == 0 ? ref.data() : got.data(), ref.size() * 4);
      const double err = ci == 0 ? 0.0 : lab::max_rel_err(got, ref);
      int i = 0;
      const double ms = best_time_ms(reps, [&] {
        for (int k = 0; k < copies; ++k) cs[ci].run(ws[(i++) % copies], xq, x.as<float>(), y.as<float>());
      }) / copies;
      const double gbs = double(bytes) / (ms * 1e-3) / 1e9;
      std::printf("%-5s T=%d %-10s %5dx%-5d  %-14s %8.2f us  %7.0f GB/s  %5.1f%% of copy  err %.1e%s\n", dtype_name(type), T, sh.what, sh.rows,
                  sh.cols, cs[ci].name.c_str(), ms * 1e3, gbs, 100.0 * gbs / copy_gbs, err, err > 1e-4 ? "  MISMATCH" : "");
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const int reps = lab::start(argc, argv, 20);
    const double copy = measure_copy_bandwidth() / 1e9;
    std::printf("copy %.0f GB/s (read + write)\n", copy);
    // llama-2-7b's matrices (qkv stacked, gate/up stacked), llama.cpp test-backend-ops' 4096x14336.
    const std::vector<Shape> shapes = {{12288, 4096, "qkv"},       {4096, 4096, "wo"},        {22016, 4096, "gate_up"},
                                       {4096, 11008, "down"},      {4096, 14336, "tbo"},      {32000, 4096, "output"}};
    for (DType t : {DType::Q4_0, DType::Q8_0}) {
      run_type<1>(t, shapes, reps, copy);
      run_type<2>(t, {shapes[2]}, reps, copy);
      run_type<8>(t, {shapes[2]}, reps, copy);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gemv lab: %s\n", e.what());
    return 1;
  }
  return 0;
}
