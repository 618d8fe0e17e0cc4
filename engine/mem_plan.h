// The CPU engine's allocation plan: every byte the engine allocates for a model (KV cache,
// workspace, matmul scratch), computed before anything is allocated. The engine allocates from
// this plan (KVCache, Workspace, Session, the server's Scheduler) and `llmq-mem infer` reports
// it, so the report and the allocation cannot drift apart. docs/MEMORY.md explains each line.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "engine/cpu/cpu_ops.h"
#include "engine/cuda_plan.h"
#include "formats/llmq_file.h"
#include "models/config.h"

namespace llmq {

/// Positions per KV-cache block (engine/kv_cache.h), the granularity of every KV allocation.
constexpr int64_t kKvBlockTokens = 16;
/// Attention runs over a token's positions in parts of this many (a multiple of the KV block),
/// merged by their softmax maxima and sums (engine/model.cpp); fixed, so that a token's result
/// does not depend on the batch or the thread count.
constexpr int64_t kAttnPartTokens = 128;

/// One buffer of a plan: what it holds, its shape and its size.
struct PlannedBuffer {
  std::string name;   ///< e.g. "kv.k"
  std::string shape;  ///< e.g. "[256, 5, 16, 32] f32"
  uint64_t bytes = 0;
};

/// The KV cache: n_blocks blocks of block_tokens positions; K and V each
/// [n_layers, n_kv_heads, n_blocks, block_tokens · head_dim] of elem_bytes (engine/kv_cache.h).
/// bytes = 2 · n_blocks · block_tokens · n_layers · kv_dim · elem_bytes
/// (= 2 · layers · kv_heads · head_dim · bytes · tokens rounded up to whole blocks; the
/// PagedAttention layout of Kwon et al., SOSP 2023).
struct KVPlan {
  int64_t n_blocks = 0, block_tokens = kKvBlockTokens, n_layers = 0, kv_dim = 0;
  int elem_bytes = 4;  ///< 4: the CPU engine stores f32
  uint64_t bytes() const {
    return 2 * uint64_t(n_blocks) * uint64_t(block_tokens) * uint64_t(n_layers) * uint64_t(kv_dim) * uint64_t(elem_bytes);
  }
  int64_t tokens() const { return n_blocks * block_tokens; }
};

/// KV cache for `tokens` positions over all sequences, rounded up to whole blocks.
/// Throws UsageError for tokens <= 0.
KVPlan plan_kv(const ModelConfig& c, int64_t tokens, int elem_bytes = 4, int64_t block_tokens = kKvBlockTokens);

/// One matrix the forward pass multiplies by, and the most tokens it is applied to at once.
struct MatmulUse {
  DType type = DType::F32;
  int64_t cols = 0;
  int64_t max_tokens = 0;
};

/// The matmuls of a Llama forward pass with weights typed as in `tensors` (a `.llmq` tensor
/// directory): every layer matrix with up to `capacity` tokens, the output matrix (the
/// embedding when tied) with up to `logits_rows` tokens. Throws UsageError if a
/// table tensor is missing.
std::vector<MatmulUse> llama_matmuls(const ModelConfig& c, const std::vector<TensorInfo>& tensors, int64_t capacity,
                                     int64_t logits_rows);

/// Scratch buffers of forward_batch (engine/model.h, class Workspace), in elements. A Workspace
/// built from a plan allocates exactly these at construction and never grows while calls stay
/// within the plan: at most `capacity` tokens, positions < `max_ctx`, at most `logits_rows`
/// logits rows, a pool of `threads` threads.
struct WorkspacePlan {
  int64_t capacity = 1;     ///< tokens per forward_batch call (n_batch)
  int64_t max_ctx = 0;      ///< longest sequence in positions (attention score rows)
  int64_t logits_rows = 0;  ///< logits rows returned per call
  int threads = 0;          ///< ThreadPool::size()
  // Elements (floats unless noted): [capacity, ...] activations
  size_t x = 0, xb = 0, q = 0, k = 0, v = 0, att_out = 0, h1 = 0, h2 = 0;
  size_t rope = 0;    ///< RoPE angles [capacity, head_dim]
  size_t pos = 0;     ///< int64 positions [capacity], and as many batch indexes of flagged tokens
  size_t att = 0;       ///< per thread: scores [G, part] + bf16 q and weights [G, head_dim + part] / 2
                        ///< + the parts of one item [max_parts, G, head_dim + 2]
  size_t att_part = 0;  ///< decode: the parts of every item when parts run on separate threads
                        ///< [2 · threads, max_parts, G, head_dim + 2]
  size_t logits = 0;  ///< [logits_rows, vocab]
  MatmulScratchPlan matmul;

  /// Total bytes: 4 · (x + xb + q + k + v + att_out + h1 + h2 + rope + threads·att + att_part + logits)
  /// + 2 · 8 · pos + matmul.bytes().
  uint64_t bytes() const;
  /// The buffers one by one (the report's detail lines).
  std::vector<PlannedBuffer> buffers() const;
};

/// The workspace for a model: activations sized by `capacity`, attention scores by `max_ctx`
/// and the GQA group, logits by `logits_rows`, matmul scratch from `matmuls` at the active CPU
/// level (cpu_level(): the plan is for this machine's kernels) and `threads`.
WorkspacePlan plan_workspace(const ModelConfig& c, const std::vector<MatmulUse>& matmuls, int64_t capacity, int64_t max_ctx,
                             int64_t logits_rows, int threads);

/// Everything the CPU engine holds for a loaded model and its runtime state.
struct InferencePlan {
  uint64_t weight_bytes = 0;  ///< Σ tensor bytes of the file's tensor directory (scales included)
  uint64_t file_bytes = 0;    ///< the whole mapped file: weights + header, metadata, directory, padding
  /// The matmul weights repacked at load for the active CPU kernels (Model::packed,
  /// pack_weights); 0 when the level does not repack. Their pages of the mapping are released
  /// after packing, so resident memory is about total() - packed_from_file.
  uint64_t packed_bytes = 0;
  uint64_t packed_from_file = 0;  ///< the file bytes of the matrices that were packed
  /// File bytes of the matrices the runs read from the mapping every token (those not packed:
  /// all of them when the CPU level does not repack), resident once read. The embedding is not
  /// among them unless it is a tied output left unpacked: its rows are dropped after reading.
  uint64_t mapped_matrix_bytes = 0;
  uint64_t vector_bytes = 0;    ///< the 1-D tensors (norms, biases) Model::load copies out of the mapping, f32
  uint64_t largest_tensor = 0;  ///< the checksum pass (LlmqFile::open) holds one tensor's pages at a time
  KVPlan kv;
  WorkspacePlan ws;
  int64_t ctx = 0, parallel = 1, n_batch = 0, kv_tokens = 0;
  /// file_bytes + packed_bytes + kv.bytes() + ws.bytes(): mapped file, packed weights, KV cache
  /// and workspace, the engine's own buffers (the tokenizer's tables and the C++ runtime are not
  /// counted).
  uint64_t total() const { return file_bytes + packed_bytes + kv.bytes() + ws.bytes(); }
  /// What of total() becomes resident while the engine runs: packed_bytes + mapped_matrix_bytes
  /// + vector_bytes + kv.bytes() + ws.bytes() (the rest of the mapping is released after the
  /// load and not read again). The host tables and the runtime are llmq-mem's to add
  /// (mem/infer.h, resident_peak).
  uint64_t resident() const { return packed_bytes + mapped_matrix_bytes + vector_bytes + kv.bytes() + ws.bytes(); }
};

/// Sizes a Session (engine/model.h) would use: ctx (<= 0: the model's context, at most
/// kDefaultMaxCtx), n_batch clamped to [1, ctx], logits_rows (1 for generation; n_batch when
/// every position's logits are needed, as perplexity does).
struct SessionSizes {
  int64_t ctx, n_batch, logits_rows;
};
SessionSizes session_sizes(const ModelConfig& c, int64_t ctx, int64_t n_batch, int64_t logits_rows = 1);

/// The KV-cache size llmq-server uses: kv_tokens when > 0, else max(ctx, parallel · min(ctx,
/// 2048)); never less than ctx.
int64_t server_kv_tokens(int64_t ctx, int64_t parallel, int64_t kv_tokens);

/// Bytes Model::load(..., gpu_layers, tp) packs for the active CPU kernels (Model::packed) from a
/// tensor directory: every layer matrix of the layers the CPU runs (all but the last gpu_layers)
/// except, with tp > 1, the attention output and FFN down (each rank packs its own column slice
/// of those: shard_packed_bytes), and the output (the embedding when tied) unless gpu_layers > 0.
/// *from_file: the file bytes of those matrices (their pages are released after packing).
uint64_t model_packed_bytes(const std::vector<TensorInfo>& tensors, int64_t n_layers, int64_t gpu_layers = 0, int tp = 1,
                            uint64_t* from_file = nullptr);

/// The plan of llmq-run (parallel = 1: a Session of `ctx` tokens) or llmq-server (parallel > 1,
/// or server = true: a Scheduler with `parallel` sequences of up to `ctx` tokens, a KV cache of
/// server_kv_tokens(ctx, parallel, kv_tokens) tokens and a workspace of max(n_batch, parallel)
/// tokens). `file` is only read for its metadata and tensor directory.
InferencePlan plan_inference(const LlmqFile& file, const ModelConfig& c, int64_t ctx, int64_t n_batch, int threads,
                             int64_t parallel = 1, bool server = false, int64_t kv_tokens = 0);

/// Device memory of the CUDA backend for one model and one sequence, or, for llmq-server, many
/// sequences over a paged KV cache (engine/cuda/session.h: CudaModel and CudaSession allocate
/// exactly these sizes; tests/test_cuda.cpp checks it).
struct CudaPlan {
  int64_t ctx = 0, n_batch = 0, logits_rows = 0;
  int64_t parallel = 0;      ///< 0: one sequence; else the most sequences of a paged cache
  int64_t first_layer = 0;   ///< partial offload: the GPU holds layers first_layer .. n_layers-1 (the CPU the rest)
  int64_t kv_rows = 0;       ///< KV-cache positions per layer: ctx, or paged kv_blocks x block_tokens
  int64_t kv_blocks = 0, block_tokens = 0;  ///< paged: the cache's blocks (KVCache::tables_only)
  int64_t table_stride = 0;  ///< paged: block-table entries per sequence, ceil(ctx / block_tokens)
  int64_t decode_parts = 1, decode_part_len = 0;  ///< decode attention: parts of part_len positions
  uint64_t weights = 0;      ///< every tensor, Q/K/V and gate/up stacked when of one type, each 256-byte aligned
  bool kv_q8 = false;        ///< the KV cache in Q8_0 (int8 and an fp16 scale per 32) instead of fp16
  uint64_t kv = 0;           ///< per layer from first_layer, K then V: fp16 [kv_rows, kv_dim], or Q8_0 int8 [kv_rows, kv_dim] + fp16 [kv_rows, kv_dim / 32]
  uint64_t tokens = 0;       ///< token ids, and again positions: [n_batch] int32 each
  uint64_t top_k = 0;        ///< top-k candidate ids, and again their logits: [kCudaMaxTopK] x 4 B each
  uint64_t io = 0;           ///< 2 tokens + the sampled id (4 B) + 2 top_k
  uint64_t paging = 0;       ///< paged: cache rows and table rows [n_batch] int32 each, block tables [parallel, table_stride] int32, logits rows [logits_rows] int32
  uint64_t x = 0, qkv = 0, att = 0, h = 0, hs = 0;  ///< fp32 [n_batch, dim] (x and xb), [n_batch, q + 2 kv], [n_batch, q], [n_batch, 2 hidden], [n_batch, hidden]
  uint64_t activations = 0;  ///< 2 x + qkv + att + h + hs
  uint64_t logits = 0;       ///< [logits_rows, vocab] fp32
  uint64_t attn_parts = 0;   ///< decode attention parts [max(1, parallel), n_heads, parts, head_dim + 2] fp32 (parts > 1)
  CudaMatmulPlan matmul;
  uint64_t workspace() const { return io + paging + activations + logits + attn_parts + matmul.bytes(); }
  uint64_t total() const { return weights + kv + workspace(); }
};
/// Most rows of a matrix the CUDA backend multiplies by: the output's vocabulary rows, stacked
/// Q/K/V, stacked gate/up, or dim (plan_cuda_matmul's max_rows).
int64_t cuda_matmul_max_rows(const ModelConfig& c);
/// The plan of a CUDA session on the model whose tensor directory is `tensors` (empty: weights
/// left 0): ctx, n_batch, logits_rows as session_sizes (logits_rows at most n_batch); gpu_layers
/// (partial offload, < 0: all) the last layers on the GPU, whose weights (plus the output, and
/// the embedding only when all layers are there or it is tied) and KV cache it holds. Throws
/// UsageError when a tensor of the Llama table is missing, or gpu_layers > n_layers. kv_q8: a
/// Q8_0 KV cache (17/32 of fp16's bytes; head_dim must be a multiple of 32: UsageError).
CudaPlan plan_cuda(const ModelConfig& c, const std::vector<TensorInfo>& tensors, int64_t ctx, int64_t n_batch, int64_t logits_rows = 1,
                   int64_t gpu_layers = -1, bool kv_q8 = false);
/// The plan of llmq-server on a GPU (cuda::CudaBatchRunner): `parallel` sequences of up to ctx
/// tokens over a paged cache of server_kv_tokens(ctx, parallel, kv_tokens) tokens in blocks of
/// kKvBlockTokens, forward passes of max(n_batch, parallel) tokens with logits for up to
/// `parallel` of them (the scheduler's); gpu_layers as plan_cuda (partial offload). Throws
/// UsageError as plan_cuda, or for parallel < 1.
CudaPlan plan_cuda_server(const ModelConfig& c, const std::vector<TensorInfo>& tensors, int64_t ctx, int64_t n_batch,
                          int64_t parallel, int64_t kv_tokens = 0, int64_t gpu_layers = -1, bool kv_q8 = false);

struct ShardRanges;  // engine/model.h

/// A tensor-parallel rank's config: the model's, with n_heads, n_kv_heads and hidden_dim of the
/// rank's slices (the widths its kernels run on).
ModelConfig rank_config(const ModelConfig& c, const ShardRanges& R);

/// The plan of tensor-parallel rank R on the GPU (cuda::CudaRanks: CudaModel of its shard,
/// CudaSession of its widths): weights as CudaModel uploads the shard (its rows of Q/K/V,
/// gate/up and the output, its columns of the attention output and FFN down, the embedding and
/// norms whole), buffers as plan_cuda (parallel 0) or plan_cuda_server (parallel > 0) on
/// rank_config. Throws UsageError as plan_cuda.
CudaPlan plan_cuda_rank(const ModelConfig& c, const std::vector<TensorInfo>& tensors, const ShardRanges& R, int64_t ctx, int64_t n_batch,
                        int64_t logits_rows = 1, int64_t parallel = 0, int64_t kv_tokens = 0, bool kv_q8 = false);

/// Bytes a tensor holds on one of `tp` tensor-parallel ranks under the Megatron-LM split
/// (Shoeybi et al. 2019): column-parallel attn_q/attn_k/attn_v/ffn_gate/ffn_up and the
/// vocab-parallel token_embd/output split their rows (output features) by tp; row-parallel
/// attn_output/ffn_down split their columns (input features); 1-D norms are replicated.
/// Rows are rounded up when they do not divide; a column split must keep whole blocks.
/// Throws UsageError when a split column count is not a multiple of the block size.
uint64_t tensor_bytes_per_rank(const TensorInfo& t, int tp);

}  // namespace llmq
