// K-quant GEMV lab (decode matmuls of the Q4_K_M mix): Q4_K, Q6_K, Q5_K and IQ4_NL,
// llama-2-7b's matrices, T = 1 and 2. Each version is checked against version 1 (the engine's
// gemv) and timed with CUDA events over copies of the matrix larger than the L2, as
// dev/cuda/gemv.cu does for Q4_0 / Q8_0. Q5_K and IQ4_NL rows are in the file's layout
// (engine/cuda/raw_blocks.cuh); Q4_K's and Q6_K's engine rows in their split layouts
// (engine/cuda/matmul.h), their v2 rows in the file's (the split copy taken back with
// unsplit_weight).
//
//   dev/cuda/build.sh && build-gpu/dev/gemv_k [--reps N]
//
// Versions:
//   v0  the engine's fp32-activation kernels (gemv_q45k_kernel; Q6_K's gemv_q6k_kernel until
//       its split layout: git history), what gemv runs for the raw types when xq.q is null:
//       eight lanes per 256-weight super-block, two rows per warp; H100: 30% of the copy rate
//       over a 7B Q4_K_M decode
//   v2  the same lanes on int8 activations (quantize_act's per-32 blocks, which the engine's
//       Q4_0 / Q8_0 GEMV already uses): dp4a on the quant nibbles (Q4_K, Q5_K with their fifth
//       bits) or the rebuilt 6-bit values (Q6_K), a quarter of v0's activation bytes; R rows per
//       warp. Their templates (gemv_q45k_q8_kernel, gemv_q6k_q8_kernel: this file since the
//       split layouts took over in the engine) at R = 1, 2, 4. H200: faster than v0 on every matrix at T = 1 and 2
//       (Q4_K R1 1.35x, Q6_K R2 1.3x) -> graduated for Q4_K (R1) and Q6_K (R2); Q5_K not yet run
//   v2 for IQ4_NL (this file: the engine's gemv_iq4nl_kernel lanes, one lane per block, 16-bit
//       loads; the 32 levels as int8, dp4a'd against the block's int8 activations: d d_x Σ l q_x),
//       not yet run on a GPU
//   v3  Q4_K and Q6_K in split layouts (Q4_0-ordered nibbles; Q4_K's sc | mn bytes per
//       sub-block and d, dmin per super-block: 4.625 bits a weight; Q6_K's high crumbs as two
//       words a block, its two int8 scales as one, d per super-block: the file's 6.5625) through
//       the engine's gemv_block_kernel (Q4_1's form; Q6_K with a scale per half block): what the
//       engine runs since the twenty-seventh session; not yet timed on a GPU
//   v1  engine (what gemv runs: v3 for Q4_K and Q6_K, v0 for the others)
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

// The file layout's scale headers (formats/quant.h), for the raw-layout versions below.
/// Sub-block j's (0..7) 6-bit scale and minimum of a Q4_K / Q5_K super-block, from its 12
/// packed scale bytes: byte(i) returns byte i (formats/quant.h has the packing).
template <class Byte>
__device__ __forceinline__ void k4_scale_min(const Byte& byte, int j, int& sc, int& mn) {
  sc = j < 4 ? byte(j) & 63 : (byte(j + 4) & 15) | (byte(j - 4) >> 6) << 4;
  mn = j < 4 ? byte(j + 4) & 63 : (byte(j + 4) >> 4) | (byte(j) >> 6) << 4;
}

/// The fp32 scale a[h] = d·sc and minimum m[h] = dmin·mn of sub-blocks 2p and 2p + 1 (h = 0, 1)
/// of the Q4_K super-block at blk (4-byte aligned: its header read as four words), for
/// w = a·q − m, for v2 below.
__device__ __forceinline__ void q4k_pair_scales(const uint8_t* blk, int p, float (&a)[2], float (&m)[2]) {
  const uint32_t dm = __ldg(reinterpret_cast<const uint32_t*>(blk));
  const uint32_t sw[3] = {__ldg(reinterpret_cast<const uint32_t*>(blk + 4)), __ldg(reinterpret_cast<const uint32_t*>(blk + 8)),
                          __ldg(reinterpret_cast<const uint32_t*>(blk + 12))};
  auto sbyte = [&](int i) { return int((sw[i / 4] >> (8 * (i % 4))) & 255); };
  const float d = fp16_bits_to_float(uint16_t(dm & 0xffff)), dmin = fp16_bits_to_float(uint16_t(dm >> 16));
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    int sc, mn;
    k4_scale_min(sbyte, 2 * p + h, sc, mn);
    a[h] = d * float(sc), m[h] = dmin * float(mn);
  }
}

/// The four 16-weight scales d · sc of a Q6_K super-block that lane positions l0 .. l0 + 7 of
/// half h meet in its four 32-weight quarters (scales 8h + l0/16 + {0, 2, 4, 6}).
__device__ __forceinline__ void q6k_lane_scales(const uint8_t* blk, int h, int l0, float (&sc)[4]) {
  const float d = fp16_bits_to_float(__ldg(reinterpret_cast<const uint16_t*>(blk + 208)));
  const auto* scales = reinterpret_cast<const int8_t*>(blk + 192 + 8 * h + l0 / 16);
#pragma unroll
  for (int g = 0; g < 4; ++g) sc[g] = d * float(__ldg(scales + 2 * g));
}

// Lane k of a group of eight: quant bytes qs[16k, 16k + 16) = positions l0 .. l0 + 15 (l0 =
// 16 (k % 2)) of sub-blocks 2p (low nibbles) and 2p + 1 (high), p = k / 2; Q5_K's qh[l0, l0 + 16)
// holds their fifth bits, bit 2p and 2p + 1.
template <int R, bool kQ5>
__global__ void __launch_bounds__(32 * kGemvWarps) gemv_q45k_q8_kernel(const uint8_t* __restrict__ wq, size_t rb, const int8_t* __restrict__ xq,
                                                                   const float* __restrict__ xd, const float* __restrict__ xs,
                                                                   float* __restrict__ y, int64_t ldy, int64_t rows, int64_t cols, int T) {
  pdl_begin();
  const int nrows = int(rows), ncols = int(cols), row0 = warp_row0<R>(nrows);
  if (row0 < 0) return;
  const int k = int(threadIdx.x % 8), p = k / 2, l0 = 16 * (k % 2);
  const int nb = ncols / 32;
  float acc[R][kGemvMaxTokens] = {};
  for (int sb = int(threadIdx.x) / 8; sb < ncols / 256; sb += 4) {
    uint4 lo[R], hi[R];  // positions l0 .. l0 + 15 of sub-blocks 2p (low nibbles) and 2p + 1 (high), as bytes
    float a[R][2], m[R][2];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = wq + size_t(min(row0 + r, nrows - 1)) * rb + size_t(sb) * raw_block_bytes(kQ5 ? DType::Q5_K : DType::Q4_K);
      const uint4 q = __ldg(reinterpret_cast<const uint4*>(blk + (kQ5 ? 48 : 16) + 16 * k));
      const uint4 h = kQ5 ? __ldg(reinterpret_cast<const uint4*>(blk + 16 + l0)) : make_uint4(0, 0, 0, 0);
      auto low = [&](uint32_t qw, uint32_t hw) { return (qw & 0x0f0f0f0fu) | ((hw >> (2 * p)) & 0x01010101u) << 4; };
      auto high = [&](uint32_t qw, uint32_t hw) { return ((qw >> 4) & 0x0f0f0f0fu) | ((hw >> (2 * p + 1)) & 0x01010101u) << 4; };
      lo[r] = make_uint4(low(q.x, h.x), low(q.y, h.y), low(q.z, h.z), low(q.w, h.w));
      hi[r] = make_uint4(high(q.x, h.x), high(q.y, h.y), high(q.z, h.z), high(q.w, h.w));
      q4k_pair_scales(blk, p, a[r], m[r]);  // the same header in Q4_K and Q5_K
    }
#pragma unroll
    for (int t = 0; t < kGemvMaxTokens; ++t)
      if (t < T) {
        const int8_t* xr = xq + t * ncols + sb * 256 + 64 * p + l0;
        const int4 x0 = __ldg(reinterpret_cast<const int4*>(xr)), x1 = __ldg(reinterpret_cast<const int4*>(xr + 32));
        const int b = t * nb + sb * 8 + 2 * p;
        const float d0 = __ldg(xd + b), d1 = __ldg(xd + b + 1);
        const float s0 = l0 == 0 ? __ldg(xs + b) : 0.0f, s1 = l0 == 0 ? __ldg(xs + b + 1) : 0.0f;
#pragma unroll
        for (int r = 0; r < R; ++r)
          acc[r][t] += (a[r][0] * d0 * float(dp4a4(lo[r], x0, 0)) - m[r][0] * s0) + (a[r][1] * d1 * float(dp4a4(hi[r], x1, 0)) - m[r][1] * s1);
      }
  }
#pragma unroll
  for (int r = 0; r < R; ++r)
    if (row0 + r < nrows) store_rows(acc[r], y, ldy, row0 + r, T);
}

// Lane k: half h = k / 4 of the super-block, positions l0 .. l0 + 7 (l0 = 8 (k % 4)) of its four
// 32-weight quarters (xs unused: the -32 offset takes Σ q_x from the activations themselves).
template <int R>
__global__ void __launch_bounds__(32 * kGemvWarps) gemv_q6k_q8_kernel(const uint8_t* __restrict__ wq, size_t rb, const int8_t* __restrict__ xq,
                                                                  const float* __restrict__ xd, const float* __restrict__,
                                                                  float* __restrict__ y, int64_t ldy, int64_t rows, int64_t cols, int T) {
  pdl_begin();
  const int nrows = int(rows), ncols = int(cols), row0 = warp_row0<R>(nrows);
  if (row0 < 0) return;
  const int k = int(threadIdx.x % 8), h = k / 4, l0 = 8 * (k % 4);
  const int nb = ncols / 32;
  float acc[R][kGemvMaxTokens] = {};
  for (int sb = int(threadIdx.x) / 8; sb < ncols / 256; sb += 4) {
    uint32_t v[R][4][2];  // quarter g's eight 6-bit values at positions l0 .. l0 + 7, two words
    float sc[R][4];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = wq + size_t(min(row0 + r, nrows - 1)) * rb + size_t(sb) * raw_block_bytes(DType::Q6_K);
      uint32_t la[2], lb[2], hb[2];
      ld_words2<2>(blk + 64 * h + l0, la), ld_words2<2>(blk + 64 * h + 32 + l0, lb), ld_words2<2>(blk + 128 + 32 * h + l0, hb);
#pragma unroll
      for (int g = 0; g < 4; ++g)
#pragma unroll
        for (int c = 0; c < 2; ++c)
          v[r][g][c] = (((g % 2 == 0 ? la[c] : lb[c]) >> (4 * (g / 2))) & 0x0f0f0f0fu) | ((hb[c] >> (2 * g)) & 0x03030303u) << 4;
      q6k_lane_scales(blk, h, l0, sc[r]);
    }
#pragma unroll
    for (int t = 0; t < kGemvMaxTokens; ++t)
      if (t < T) {
#pragma unroll
        for (int g = 0; g < 4; ++g) {
          const int2 x = __ldg(reinterpret_cast<const int2*>(xq + t * ncols + sb * 256 + 128 * h + 32 * g + l0));
          const float dx = __ldg(xd + t * nb + sb * 8 + 4 * h + g);
          const int sx = __dp4a(0x01010101, x.x, __dp4a(0x01010101, x.y, 0));
#pragma unroll
          for (int r = 0; r < R; ++r)
            acc[r][t] += sc[r][g] * dx * float(__dp4a(int(v[r][g][0]), x.x, __dp4a(int(v[r][g][1]), x.y, 0)) - 32 * sx);
        }
      }
  }
#pragma unroll
  for (int r = 0; r < R; ++r)
    if (row0 + r < nrows) store_rows(acc[r], y, ldy, row0 + r, T);
}

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
  bool file_layout = false;  // reads a split type in the file's layout (run_type's FileCopies)
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
          },
          !is_raw_type(type)};
}

std::vector<Case> cases(DType type) {
  std::vector<Case> cs = {
      {"v1 engine", false, [](const DeviceWeight& w, const DeviceActQ8& xq, const float* x, float* y, int T) { gemv(w, x, xq, y, T, 0, nullptr); }}};
  if (is_raw_type(type))  // the split types have no fp32-activation kernel
    cs.push_back({"v0 fp32 act", true, [](const DeviceWeight& w, const DeviceActQ8&, const float* x, float* y, int T) { gemv(w, x, DeviceActQ8{}, y, T, 0, nullptr); }});
  for (Case c : {v2_case<1>(type, "v2 R1"), v2_case<2>(type, "v2 R2"), v2_case<4>(type, "v2 R4")}) cs.push_back(c);
  return cs;
}

// A split type's file layout in copies like wc's: the first split copy taken back with unsplit_weight,
// then copied device to device (the addresses, not the values, defeat the L2).
struct FileCopies {
  DeviceBuffer buf;
  std::vector<DeviceWeight> w;
  FileCopies() = default;
  FileCopies(const lab::WeightCopies& wc, DType t, int64_t rows, int64_t cols) {
    std::vector<uint8_t> split(split_weight_bytes(t, rows, cols)), file(size_t(rows) * row_bytes(t, cols));
    CK(cudaMemcpy(split.data(), wc.w[0].q, split.size(), cudaMemcpyDeviceToHost));
    unsplit_weight(t, split.data(), rows, cols, file.data());
    buf = DeviceBuffer(file.size() * wc.size());
    for (size_t i = 0; i < wc.size(); ++i) {
      uint8_t* at = buf.as<uint8_t>() + file.size() * i;
      CK(cudaMemcpy(at, file.data(), file.size(), cudaMemcpyHostToDevice));
      DeviceWeight v;
      v.type = t, v.rows = rows, v.cols = cols, v.q = at;
      w.push_back(v);
    }
  }
};

void run_type(DType type, const std::vector<Shape>& shapes, int T, int reps, double copy_gbs) {
  const std::vector<Case> cs = cases(type);
  for (const Shape& sh : shapes) {
    const lab::WeightCopies wc(type, sh.rows, sh.cols);  // fill_random: the device's layout, sane fp16 scales
    const FileCopies fc = is_raw_type(type) ? FileCopies{} : FileCopies(wc, type, sh.rows, sh.cols);
    const double bytes = double(row_bytes(type, sh.cols)) * sh.rows;  // the file's bytes (Q4_K's split layout reads 148/144 of them)
    const lab::Activations act(T, sh.cols);
    const DeviceBuffer& x = act.x;
    const DeviceActQ8 xq = act.xq;
    quantize_act(x.as<float>(), xq, T, sh.cols, nullptr);
    DeviceBuffer y(size_t(T) * sh.rows * 4);
    std::vector<float> ref(size_t(T) * sh.rows), got(ref.size());
    for (size_t ci = 0; ci < cs.size(); ++ci) {
      CK(cudaMemset(y.get(), 0xff, y.bytes()));  // NaN: every element must be written
      const std::vector<DeviceWeight>& ws = cs[ci].file_layout ? fc.w : wc.w;
      cs[ci].run(ws[0], xq, x.as<float>(), y.as<float>(), T);
      CK(cudaGetLastError());
      CK(cudaDeviceSynchronize());
      y.download(ci == 0 ? ref.data() : got.data(), ref.size() * 4);
      const double err = ci == 0 ? 0.0 : lab::max_rel_err(got, ref), tol = cs[ci].int8 ? 2e-2 : 1e-4;
      size_t i = 0;
      const double ms = best_time_ms(reps, [&] {
        for (size_t c = 0; c < ws.size(); ++c) cs[ci].run(ws[(i++) % ws.size()], xq, x.as<float>(), y.as<float>(), T);
      }) / double(ws.size());
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
