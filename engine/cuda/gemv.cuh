// Decode GEMV pieces shared by engine/cuda/matmul.cu and the kernel lab (dev/cuda/gemv_k.cu):
// the warp layout, the row stores, and the K-quant kernels on int8 activations, which the lab
// times at other rows per warp than the engine launches.
//
// Q4_K / Q5_K and Q6_K against int8 activations (quantize_act: per 32 values q_x, d_x and
// s_x = d_x Σ q_x), the lanes of matmul.cu's gemv_q45k_kernel and gemv_q6k_kernel with the
// products by dp4a: a quarter of the activation bytes and no float conversion per weight. On an
// H200 (bench/RESULTS.md, third GPU session) this took llama-2-7b's Q4_K matrices at T = 1 from
// 23-26% to 31-34% of the copy rate (one row per warp best) and Q6_K's from 28-42% to 34-55%
// (two rows). The sums (formats/quant.h has the layouts):
//   Q4_K / Q5_K sub-block:  a d_x Σ q q_x - m s_x   (s_x added by the lanes holding positions 0 .. 15)
//   Q6_K 16 weights:        d sc d_x (Σ q q_x - 32 Σ q_x),  q = 0 .. 63
// Both index in 32 bits (rows, cols and T·cols below 2^31): Q4_K 56 registers, Q6_K 96.
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

}  // namespace llmq::cuda
