// The small per-token kernels of the forward pass on the GPU: RMSNorm (with the residual add
// fused in), RoPE with the KV-cache write fused in, SwiGLU, residual add, bias add, embedding
// lookup. Every one has a CPU reference in engine/cpu/cpu_ops.h; tests/test_cuda.cpp compares them.
// All pointers are device pointers; every call is asynchronous on stream s.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "engine/cuda/matmul.h"
#include "models/config.h"

namespace llmq::cuda {

/// out [T, n] = x · w / sqrt(mean(x²) + eps) per row (Zhang & Sennrich 2019; CPU: rmsnorm).
/// q (optional): out also quantized into q [T, n] as quantize_act does (the same bytes), for
/// the GEMV / MMQ that read it next (MatmulContext::note_quantized); n a multiple of 32, else
/// UsageError.
void rmsnorm(float* out, const float* x, const float* w, int64_t T, int64_t n, float eps, cudaStream_t s, const DeviceActQ8* q = nullptr);
/// x [T, n] += y [T, n], then out = rmsnorm(x): the residual add and the next norm in one pass
/// (q as rmsnorm).
void add_rmsnorm(float* x, const float* y, float* out, const float* w, int64_t T, int64_t n, float eps, cudaStream_t s,
                 const DeviceActQ8* q = nullptr);

/// The attention projections' output qkv [T, ld]: q [n_heads · hd] at column 0, k [n_kv · hd]
/// at n_heads · hd, v [n_kv · hd] after it. Rotates q and k in place by RoPE (Su et al. 2021;
/// angles pos[t] · θ^(-2i/hd) in fp64 rounded to fp32, exactly as the CPU's rope_angles; pairs
/// by `layout`, as rope_rotate) and writes the rotated k and v, as fp16, to the layer's KV
/// cache kc, vc [rows, n_kv · hd] at row rows[t], or at row pos[t] when rows is null (one
/// sequence, contiguous). pos, rows: [T] device int32 (rows: the paged cache's row of each token,
/// block · block_tokens + pos % block_tokens, attention.h KvPages). freqs: [hd/2] device fp64,
/// the layer's ModelConfig::rope_freqs (angle i = double(pos) · freqs[i], as the CPU).
void rope_store_kv(float* qkv, int64_t ld, const int32_t* pos, const int32_t* rows, int64_t T, int64_t n_heads, int64_t n_kv,
                   int64_t hd, const double* freqs, RopeLayout layout, uint16_t* kc, uint16_t* vc, cudaStream_t s);

/// kc, vc null: only the rotation (the cache is written by store_kv_q8).
///
/// A Q8_0 KV cache: the rotated k and v of qkv (as rope_store_kv leaves them) quantized per
/// block of 32 (d = max|x| / 127, q = round(x / d), as Q8_0, formats/quant.h) into kq, vq
/// [rows, n_kv · hd] int8 and kd, vd [rows, n_kv · hd / 32] fp16 scales, at row rows[t] (or
/// pos[t] when rows is null). Throws UsageError when n_kv · hd is not a multiple of 32.
void store_kv_q8(const float* qkv, int64_t ld, const int32_t* pos, const int32_t* rows, int64_t T, int64_t n_heads, int64_t n_kv,
                 int64_t hd, int8_t* kq, uint16_t* kd, int8_t* vq, uint16_t* vd, cudaStream_t s);

/// The gated activation (Shazeer 2020) on h [T, 2H] holding gate in columns [0, H) and up in
/// [H, 2H): out [T, H] = act(gate) ⊙ up, act = silu (SwiGLU) or tanh-approximated gelu (GeGLU),
/// as the CPU's swiglu / geglu. out may not alias h. q (optional): out also quantized as
/// quantize_act (H a multiple of 32, else UsageError).
void gated_act(Activation act, float* out, const float* h, int64_t T, int64_t H, cudaStream_t s, const DeviceActQ8* q = nullptr);
/// QK-norm (Qwen3, Gemma 3): in each row t of qkv [T, ld], the heads [0, n_q) (q, weights wq
/// [hd]) and [n_q, n_q + n_k) (k, weights wk [hd]) each replaced by their RMSNorm (CPU: rmsnorm
/// per head).
void head_rmsnorm(float* qkv, int64_t ld, int64_t T, int64_t n_q, int64_t n_k, int64_t hd, const float* wq, const float* wk, float eps,
                  cudaStream_t s);
/// Logit soft-capping: x [n] = cap · tanh(x / cap) (CPU: softcap).
void softcap(float* x, int64_t n, float cap, cudaStream_t s);
/// x [n] += y [n].
void add(float* x, const float* y, int64_t n, cudaStream_t s);
/// x [T, ld] columns [0, n) += b [n] per row (a linear layer's bias).
void add_bias(float* x, int64_t ld, const float* b, int64_t T, int64_t n, cudaStream_t s);
/// out [rows, n] = x [., n] rows idx[0], idx[1], ... (idx: [rows] device int32), e.g. the
/// tokens of a batch that want logits.
void gather_rows(float* out, const float* x, const int32_t* idx, int64_t rows, int64_t n, cudaStream_t s);
/// x [T, table.cols] = rows tokens[t] of the embedding table (any stored type, dequantized to
/// fp32; CPU: embedding_row), times `scale` (ModelConfig::embedding_multiplier). tokens: [T]
/// device int32, each in [0, table.rows).
void embedding(float* x, const DeviceWeight& table, const int32_t* tokens, int64_t T, cudaStream_t s, float scale = 1.0f);

}  // namespace llmq::cuda
