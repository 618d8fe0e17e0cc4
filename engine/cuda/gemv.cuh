// Decode GEMV pieces shared by engine/cuda/matmul.cu and the kernel lab (dev/cuda/gemv_k.cu):
// the warp layout, the row stores, and the Q6_K kernel on int8 activations, which the lab
// times at other rows per warp than the engine launches.
//
// Q6_K against int8 activations (quantize_act: per 32 values q_x, d_x and s_x = d_x Σ q_x), the
// lanes of matmul.cu's gemv_q6k_kernel with the products by dp4a: a quarter of the activation
// bytes and no float conversion per weight. On an H200 (bench/RESULTS.md, third GPU session)
// this took llama-2-7b's Q6_K matrices at T = 1 from 28-42% to 34-55% of the copy rate (two
// rows per warp). The sum (formats/quant.h has the layout), per 16 weights:
//   d sc d_x (Σ q q_x - 32 Σ q_x),  q = 0 .. 63
// It indexes in 32 bits (rows, cols and T·cols below 2^31); 96 registers. (Q4_K's raw-layout
// kernel of the same kind, 31-34% of the copy rate, is now the lab's: its split layout reads
// through matmul.cu's gemv_block_kernel.)
#pragma once
#include "engine/cuda/common.cuh"
#include "engine/cuda/matmul.h"
#include "engine/cuda/raw_blocks.cuh"

namespace llmq::cuda {

inline constexpr int kGemvWarps = 4;  // warps per CUDA block of the GEMV kernels (threadIdx.y)

// The warp's sums acc[t] of one row, reduced, into y[t · ldy + row] for t < T.
__device__ __forceinline__ void store_rows(float (&acc)[kGemvMaxTokens], float* y, int64_t ldy, int64_t row, int T) {
#pragma unroll
  for (int t = 0; t < kGemvMaxTokens; ++t)
    if (t < T) {
      const float v = warp_sum(acc[t]);
      if (threadIdx.x == 0) y[t * ldy + row] = v;
    }
}

// The end of matmul.cu's gemv_block_kernel and of dev/cuda/gemv.cu's versions: each warp's sums
// of R rows x T tokens added over its lanes; KS = 1 writes them, KS > 1 adds the KS warps' sums
// through shared memory in a fixed order.
template <int R, int T, int KS>
__device__ __forceinline__ void gemv_block_store(float (&acc)[R][T], float* __restrict__ y, int64_t ldy, int row0, int rows, int lane,
                                                 int warp) {
  if constexpr (KS == 1) {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int t = 0; t < T; ++t) {
        const float v = warp_sum(acc[r][t]);
        if (lane == 0 && row0 + r < rows) y[t * ldy + row0 + r] = v;
      }
  } else {
    __shared__ float part[KS][R * T];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int t = 0; t < T; ++t) {
        const float v = warp_sum(acc[r][t]);
        if (lane == 0) part[warp][r * T + t] = v;
      }
    __syncthreads();
    if (int(threadIdx.x) < R * T) {
      const int r = int(threadIdx.x) / T, t = int(threadIdx.x) % T;
      float v = 0.0f;
#pragma unroll
      for (int i = 0; i < KS; ++i) v += part[i][threadIdx.x];
      if (row0 + r < rows) y[t * ldy + row0 + r] = v;
    }
  }
}

// The first of the R rows of this warp, or -1 past the last row.
template <int R>
__device__ __forceinline__ int warp_row0(int rows) {
  const int row0 = (int(blockIdx.x) * kGemvWarps + int(threadIdx.y)) * R;
  return row0 < rows ? row0 : -1;
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

}  // namespace llmq::cuda
