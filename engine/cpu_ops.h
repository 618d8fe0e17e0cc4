// CPU kernels of the forward pass. Each has a plain reference (`ref_*`, used by the tests as
// ground truth) where the fast version differs from the obvious loop.
#pragma once
#include <cstdint>
#include <vector>

#include "engine/threadpool.h"
#include "formats/quant.h"
#include "models/llama.h"

namespace llmq {

/// A weight matrix used in place from the mapped file: W [rows, cols], row-major, each row
/// `row_bytes(type, cols)` bytes.
struct Weight {
  DType type = DType::F32;
  const uint8_t* data = nullptr;
  int64_t rows = 0, cols = 0;

  size_t row_stride() const { return row_bytes(type, cols); }
  const uint8_t* row(int64_t r) const { return data + size_t(r) * row_stride(); }
};

/// Activations quantized on the fly for integer dot products against Q8_0/Q4_0/Q4_1 weights:
/// 32 values = fp32 scale d + int8 q, plus s = d * sum(q) (needed by Q4_1's offset term).
struct BlockQ8Act {
  float d;
  float s;
  int8_t qs[QK];
};

/// Reusable buffers for matmul (sized on first use, never shrunk).
struct MatmulScratch {
  std::vector<BlockQ8Act> xq;               // [T, cols/32] quantized activations
  std::vector<std::vector<float>> rowbuf;   // per thread: one dequantized weight row [cols]
};

/// y [T, W.rows] = x [T, W.cols] · Wᵀ, in W's stored type, split over the pool's threads by
/// rows of W (every weight row is read once for all T tokens: batched prefill).
/// F32/F16/BF16 weights use fp32 activations; Q8_0/Q4_0/Q4_1 weights use activations
/// quantized to 8 bits per block of 32 (as llama.cpp does) and integer dot products.
void matmul(ThreadPool& pool, MatmulScratch& s, float* y, const float* x, int64_t T, const Weight& w);

/// Reference for matmul: every weight row dequantized to fp32, fp64 accumulation, fp32 activations.
void ref_matmul(float* y, const float* x, int64_t T, const Weight& w);

/// Quantizes n activations (n a multiple of 32) into n/32 BlockQ8Act (round to nearest).
void quantize_act_q8(const float* x, BlockQ8Act* out, int64_t n);

/// out[n] = x[n] / sqrt(mean(x²) + eps) * w[n]   (RMSNorm, Zhang & Sennrich 2019).
void rmsnorm(float* out, const float* x, const float* w, int64_t n, float eps);

/// Rotary embedding (Su et al. 2021) of n_heads vectors of head_dim at position `pos`, in place:
/// pair i (i < head_dim/2) rotates by pos * theta^(-2i/head_dim). Interleaved pairs are
/// (2i, 2i+1); rotate-half pairs are (i, i + head_dim/2).
void rope(float* v, int64_t n_heads, int64_t head_dim, int64_t pos, double theta, RopeLayout layout);

/// In-place softmax over x[n] (max-subtracted).
void softmax(float* x, int64_t n);

/// SwiGLU (Shazeer 2020): gate[i] = silu(gate[i]) * up[i], silu(g) = g / (1 + e^-g).
void swiglu(float* gate, const float* up, int64_t n);

/// Row `token` of an embedding matrix [vocab, dim] dequantized into out[dim].
void embedding_row(float* out, const Weight& emb, int64_t token);

}  // namespace llmq
