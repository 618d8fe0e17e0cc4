// Causal attention on the GPU over one sequence's fp16 KV cache, decode and prefill alike.
//
// A CUDA block takes one query token, one KV head and one part of the positions, with one warp
// per query head of the KV head's group (GQA: the group's warps share each K/V tile read).
// Tiles of 32 positions go through shared memory; lane j scores position j of a tile against
// the warp's query, and the softmax is kept online (running max m, sum l, output o; Milakov &
// Gimelshein 2018, FlashAttention, Dao et al. 2022): no [T, T] score matrix in memory.
// Positions are cut into n_splits parts of part_len (flash-decoding, Dao et al. 2023): each
// part writes (o, m, l) and attention_merge combines them,
//   out = Σ_c e^(m_c - M) o_c / Σ_c e^(m_c - M) l_c,  M = max_c m_c.
// Decode uses many parts (enough blocks for the GPU at batch 1) with a fixed count, so a CUDA
// graph can replay it at any position: parts past the token's position write l = 0 and leave.
// CPU reference: the attention of engine/model.cpp (forward_shard).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace llmq::cuda {

struct DeviceActQ8;  // engine/cuda/matmul.h

/// Largest head_dim the kernel takes (each lane holds head_dim / 32 outputs in registers).
constexpr int64_t kMaxHeadDim = 256;

/// Where a paged KV cache keeps each token's positions (PagedAttention, Kwon et al. 2023; the
/// block tables of engine/kv_cache.h): position p of token t is cache row
///   tables[seq[t] · table_stride + p / block_tokens] · block_tokens + p % block_tokens.
/// seq: [T] device int32 (the token's row of `tables`); tables: [sequences, table_stride]
/// device int32. Default (tables null): one sequence, position p at row p.
struct KvPages {
  const int32_t* seq = nullptr;
  const int32_t* tables = nullptr;
  int64_t table_stride = 0, block_tokens = 0;
};

/// A Q8_0 KV cache (ops.h store_kv_q8): kq, vq [rows, n_kv · hd] int8 and kd, vd
/// [rows, n_kv · hd / 32] fp16 scales; when set, attention reads these instead of kc, vc
/// (dequantized into the same shared-memory tiles).
struct KvQ8 {
  const int8_t* kq = nullptr;
  const uint16_t* kd = nullptr;
  const int8_t* vq = nullptr;
  const uint16_t* vd = nullptr;
};

/// Which KV head each query head reads when a tensor-parallel rank holds a slice of the heads
/// that does not fall on GQA-group boundaries (engine/tp.h: a KV head whose group straddles
/// two ranks is held by both): local query head h reads local KV head (h + head_offset) / group.
/// group = 0: the usual n_heads / n_kv (n_heads a multiple of n_kv), offset 0.
struct GqaSlice {
  int64_t group = 0;        ///< query heads per KV head in the whole model
  int64_t head_offset = 0;  ///< the rank's first query head minus its first KV head x group, in [0, group)
};

/// Raises the shared-memory limits of the attention kernels a model of these heads uses (once
/// per process and device), so the launches in a captured CUDA graph make no such call.
/// CudaSession calls it at construction.
void attention_prepare(int64_t n_heads, int64_t n_kv, int64_t hd);

/// Attention for T tokens of one sequence, or of several over a paged cache (`pages`). q: [T, ldq], head h at column h · hd, already
/// rotated; kc, vc: the layer's cache [rows, n_kv · hd] fp16 (rows as `pages` says); pos: [T]
/// device int32, token t attends to its sequence's positions 0 .. pos[t], or under a sliding
/// window (window > 0: Mistral, Gemma 3's local layers, Phi-3) to max(0, pos[t] + 1 - window) ..
/// pos[t] (the CPU's ModelConfig::window_start; the cache keeps every position); out: [T, ldo],
/// head h at column h · hd.
/// n_splits == 1: out written directly (part_len must cover every position). n_splits > 1:
/// parts of part_len positions (a multiple of 32) written to `partial`
/// [T, n_heads, n_splits, hd + 2] (o unnormalized, then m, l), then merged into out.
/// scale: the score factor, 1/sqrt(hd). gqa: the heads of a rank's uneven slice (see GqaSlice).
/// q_out: when n_splits > 1, hd is a multiple of 32 and ldo = n_heads · hd, the merge also writes
/// out quantized into *q_out (quantize_act's layout, for the product that reads out:
/// MatmulContext::fusable) and attention() returns true; otherwise false and q_out untouched.
/// Throws UsageError for hd > kMaxHeadDim, odd hd, n_heads not a multiple of n_kv (without
/// gqa) or query heads that do not map onto the n_kv KV heads (with it), tables without a
/// positive block size, a Q8_0 cache whose head_dim is not a multiple of 32, or a negative window.
bool attention(const float* q, int64_t ldq, const uint16_t* kc, const uint16_t* vc, const int32_t* pos, int64_t T,
               int64_t n_heads, int64_t n_kv, int64_t hd, float scale, int64_t n_splits, int64_t part_len, float* partial,
               float* out, int64_t ldo, cudaStream_t s, const KvPages& pages = {}, const KvQ8& q8 = {}, const GqaSlice& gqa = {},
               const DeviceActQ8* q_out = nullptr, int64_t window = 0);

/// Which kernel takes the flash-decoding parts of a decode step (n_splits > 1) over an fp16
/// cache: 1, attention_kernel; 3, attention_decode_v3_kernel (head_dim 64, 128 or 256, GQA
/// groups up to 8; other shapes stay on 1): the step's positions spread over every part, a
/// part's positions split over 4 warps, each warp's K and V loads issued a round of 8 positions
/// at a time, a GQA group's heads scored on rows read once; 0 (the default): 3 where the shape
/// allows it, else 1, the faster on an H200 for MHA and GQA alike (dev/README.md #19). Version 2
/// lost to 3 and was removed (#15). The environment's LLMQ_CUDA_DECODE_ATTN=1 or 3 forces one at
/// start-up; dev/cuda/attn.cu times both. Throws UsageError for other values.
void set_decode_attention_version(int version);

/// Version 3's block target for a decode step: its parts per (token, KV head) are about
/// blocks / (T · n_kv), at least 1 and at most the caller's n_splits (0, the default: 528, four
/// blocks per SM of an H100/H200; 2048 before the sixth GPU session, dev/README.md #22). With
/// fewer parts each block walks more rounds of K and V and fewer blocks pay the prologue, the
/// warps' combine and the merge.
/// LLMQ_CUDA_V3_BLOCKS=N at start-up sets it for benchmarks. Throws UsageError outside 0 .. 2^20.
void set_decode_v3_blocks(int64_t blocks);

}  // namespace llmq::cuda
