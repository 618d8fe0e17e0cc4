// Decode GEMV pieces shared by engine/cuda/matmul.cu and the kernel labs (dev/cuda/gemv.cu,
// gemv_k.cu): the warp layout and the row stores. (The K-quants' raw-layout kernels on int8
// activations, which the engine ran for Q4_K and Q6_K until the split layouts, are the
// gemv_k lab's now.)
#pragma once
#include "engine/cuda/common.cuh"
#include "engine/cuda/matmul.h"

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

}  // namespace llmq::cuda
