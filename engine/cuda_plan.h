// Sizes of the CUDA backend's buffers that its kernels' host code needs too (engine/cuda/
// compiles as C++17 under nvcc: this header stays free of the C++20 engine headers). The rest
// of the CUDA plan is engine/mem_plan.h's CudaPlan.
#pragma once
#include <cstdint>

#include "formats/quant.h"

namespace llmq {

/// Bytes of one row of `cols` weights of type t as the CUDA backend stores it (engine/cuda/
/// matmul.h DeviceWeight, the split layout): the file's row bytes, except Q4_K's 148 per 256
/// weights (its packed 6-bit scales and minimums unpacked to a byte each: 4.625 bits a weight,
/// against 4.5 in the file), Q5_K's 180 (176) the same way, and Q6_K's 212 (the file's 210, its
/// fp16 d padded to a 4-byte word). llmq-mem's CUDA plan counts weights with it.
inline uint64_t cuda_row_bytes(DType t, int64_t cols) {
  const int64_t sb = cols / 256;
  switch (t) {
    case DType::Q4_K: return uint64_t(sb) * 148;
    case DType::Q5_K: return uint64_t(sb) * 180;
    case DType::Q6_K: return uint64_t(sb) * 212;
    default: return uint64_t(row_bytes(t, cols));
  }
}

/// The CUDA backend's matmul scratch (engine/cuda/matmul.h, MatmulContext) for up to
/// cap_tokens tokens and matrices of at most max_cols columns and max_rows rows (0: any): int8
/// activations for the GEMV, and for prefill (cap_tokens > 8) fp16 activations, one dequantized
/// weight tile of at most 128 MiB (tile_rows x cols fp16, tile_rows no more than max_rows rounded
/// up to 128), the cuBLAS workspace (32 MiB, NVIDIA's advice for Hopper) and MMQ's split-K
/// partial sums (mmq_split: 16 MiB, or [min(cap, kCudaMmqMaxTokens), max_rows] fp32 x 8 splits if
/// less).
struct CudaMatmulPlan {
  int64_t cols = 0;       ///< max_cols rounded up to a multiple of 32
  int64_t tile_rows = 0;  ///< weight rows dequantized per cuBLAS call
  uint64_t act_q = 0, act_d = 0, act_s = 0;            ///< [cap, cols] int8; [cap, cols/32] fp32 x2
  uint64_t act_h = 0, tile = 0, cublas_workspace = 0;  ///< prefill only: [cap, cols] fp16; the tile; cuBLAS's
  uint64_t mmq_split = 0;                              ///< batches of 9 .. kCudaMmqMaxTokens: MMQ's split-K partial sums
  uint64_t bytes() const { return act_q + act_d + act_s + act_h + tile + cublas_workspace + mmq_split; }
};
CudaMatmulPlan plan_cuda_matmul(int64_t cap_tokens, int64_t max_cols, int64_t max_rows = 0);

/// Most tokens the CUDA GEMV kernels take per call; more go through MMQ (block-quantized weights,
/// up to kCudaMmqMaxTokens) or cuBLAS.
constexpr int kCudaGemvMaxTokens = 8;
/// Most tokens per call on MMQ (engine/cuda/mmq.cu); more (prefill) dequantize and use cuBLAS,
/// faster there on an H200 (bench/RESULTS.md, the MMQ lab).
constexpr int kCudaMmqMaxTokens = 64;

/// Positions per part of the CUDA backend's decode attention (flash-decoding; a multiple of 32).
constexpr int64_t kCudaDecodePartTokens = 64;

/// Top-k candidates a CUDA session keeps room for (engine/cuda/sampling.h kMaxTopK).
constexpr int64_t kCudaMaxTopK = 256;
}  // namespace llmq
