// A model loaded from a `.llmq` file and the CPU forward pass over a KV cache.
#pragma once
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "engine/comm.h"
#include "engine/cpu/cpu_ops.h"
#include "engine/kv_cache.h"
#include "engine/mem_plan.h"
#include "base/threadpool.h"
#include "text/tokenizer.h"
#include "formats/llmq_file.h"
#include "formats/vocab.h"
#include "models/config.h"

namespace llmq {

/// Weights of one transformer block (pointers into the mapped file).
struct LayerWeights {
  const float* attn_norm;  // [dim]
  Weight wq;               // [q_dim, dim]
  Weight wk;               // [kv_dim, dim]
  Weight wv;               // [kv_dim, dim]
  Weight wo;               // [dim, q_dim]
  const float* bq = nullptr;  // [q_dim] or null (attention biases: Qwen2, Llama attention_bias)
  const float* bk = nullptr;  // [kv_dim] or null
  const float* bv = nullptr;  // [kv_dim] or null
  const float* bo = nullptr;  // [dim] or null
  const float* q_norm = nullptr;          // [head_dim] or null (QK-norm: Qwen3, Gemma 3)
  const float* k_norm = nullptr;          // [head_dim] or null
  const float* post_attn_norm = nullptr;  // [dim] or null (pre_post norms: Gemma)
  const float* ffn_norm;   // [dim]
  Weight w_gate;           // [hidden, dim]
  Weight w_up;             // [hidden, dim]
  Weight w_down;           // [dim, hidden]
  const float* post_ffn_norm = nullptr;   // [dim] or null (pre_post norms)
};

/// The model: config, tokenizer vocabulary and weights, used in place from the mmap.
struct Model {
  std::unique_ptr<LlmqFile> file;
  ModelConfig config;
  Vocab vocab;
  std::unique_ptr<Tokenizer> tokenizer;  // built from vocab at load (validates it)
  std::string chat_template;
  Weight token_embd;        // [vocab, dim]
  std::vector<LayerWeights> layers;
  const float* output_norm = nullptr;  // [dim]
  Weight output;             // [vocab, dim] (the embedding when tied)
  std::vector<double> rope_freqs;  // [config.rope_tables(), head_dim/2] RoPE frequencies (ModelConfig::rope_freq_tables)
  /// The matrices repacked for the CPU kernels at load (pack_weights; empty at the scalar
  /// level or with LLMQ_PACK=0). Their pages in the mapping are released after packing,
  /// so the resident weight bytes stay about the file's.
  PackedWeights packed;
  /// Copies of the file's 1-D tensors (norm weights, biases; tens to hundreds of KiB), which
  /// every token reads: read from the mapping, each would keep its whole page-cache folio (up
  /// to 2 MiB) resident after packing released the matrices around it.
  std::vector<float> vectors;

  /// Opens and validates `path` (see LlmqFile::open) and builds what the host holds besides the
  /// weights: config (for `ctx` as load's), vocabulary, tokenizer and chat template; binds no
  /// tensor (every Weight empty). load's first step; llmq-mem builds it to measure those tables.
  /// Throws FileError for any fault (the message names the file).
  static std::unique_ptr<Model> open(const std::string& path, bool verify = true, int64_t ctx = 0);
  /// Model::open, then binds every
  /// tensor of the Llama table (models/config.h), checking names, shapes and that 1-D tensors
  /// are F32.
  /// Throws FileError for any fault (the message names the file).
  /// pack = false leaves the matrices unpacked (a model whose weights go to a GPU);
  /// gpu_layers > 0 leaves the last gpu_layers layers and the output unpacked (partial offload:
  /// a GPU runs them, the CPU the layers before); tp > 1 leaves the attention output and FFN
  /// down unpacked (tensor parallelism: each rank packs its own column slice of them, so the
  /// model's panels would go unused). model_packed_bytes (engine/mem_plan.h) predicts the bytes.
  /// ctx: KV positions per sequence the runs will use (<= 0: the model's, at most
  /// kDefaultMaxCtx); LongRoPE picks its factors by it (ModelConfig::use_context).
  static std::unique_ptr<Model> load(const std::string& path, bool verify = true, bool pack = true, int64_t gpu_layers = 0,
                                     int tp = 1, int64_t ctx = 0);
  /// Bytes of weights in the file (all tensors).
  uint64_t weight_bytes() const;
  /// The type holding most 2-D weights, e.g. "q8_0" (for reports).
  std::string weight_type() const;
};

/// The part of the model one tensor-parallel rank computes (Megatron-LM, Shoeybi et al. 2019,
/// section 3): contiguous ranges of query heads, KV heads, FFN columns and vocabulary rows.
/// With one rank every range is the whole dimension.
struct ShardRanges {
  int rank = 0, n_ranks = 1;
  int64_t head0 = 0, n_heads = 0;        ///< query heads [head0, head0 + n_heads)
  int64_t kv_head0 = 0, n_kv_heads = 0;  ///< KV heads held: those the query heads read (GQA)
  int64_t ffn0 = 0, ffn_dim = 0;         ///< FFN hidden units [ffn0, ffn0 + ffn_dim)
  int64_t vocab0 = 0, n_vocab = 0;       ///< output (logit) rows this rank computes
  int64_t embd0 = 0, n_embd = 0;         ///< embedding rows held (vocab-parallel embedding)

  /// The whole model on one rank.
  static ShardRanges whole(const ModelConfig& c);
};

/// One rank's weights: a view of the model with every matrix cut to the rank's ranges.
/// Column-parallel matrices (Q, K, V, gate, up, output, embedding rows) are row ranges of the
/// row-major [out, in] tensor: a pointer into the mapped file and a row count, nothing copied.
/// Row-parallel matrices (attention output, FFN down) are column ranges, strided in memory:
/// they are copied at load into buffers this rank owns (`owned`). Norm vectors are replicated.
struct ModelShard {
  ShardRanges ranges;
  Weight token_embd;                 // [n_embd, dim], rows embd0 ...
  std::vector<LayerWeights> layers;  // per layer: wq [n_heads*hd, dim], wk/wv [n_kv_heads*hd, dim],
                                     // wo [dim, n_heads*hd] (owned), w_gate/w_up [ffn_dim, dim],
                                     // w_down [dim, ffn_dim] (owned); biases bq [n_heads*hd],
                                     // bk/bv [n_kv_heads*hd] sliced like their rows, bo [dim] whole
  const float* output_norm = nullptr;  // [dim]
  Weight output;                       // [n_vocab, dim], rows vocab0 ...
  std::vector<int64_t> vocab_bounds;   // [n_ranks + 1]: rank r computes logits [b[r], b[r+1])
  std::vector<std::unique_ptr<uint8_t[]>> owned;  // the row-parallel copies
  uint64_t owned_bytes = 0;                       // bytes allocated in `owned`
  PackedWeights packed;  // matrices packed for this rank only (column copies, unaligned row ranges)

  /// Bytes of weights this rank holds: every matrix slice (rows x row bytes) and norm vector
  /// it points at, each counted once (a tied output inside the embedding slice is not counted
  /// again). Includes owned_bytes.
  uint64_t weight_bytes() const;
};

/// Default KV-cache length when none is asked for and the model's context is longer (as
/// llama.cpp, a long-context model does not reserve its whole context unless asked).
constexpr int64_t kDefaultMaxCtx = 4096;

/// One token of a batched forward pass.
struct BatchToken {
  int32_t seq;    ///< KV-cache sequence id
  int32_t token;  ///< token id
  bool logits;    ///< return logits for this token (or its hidden state: Output::Hidden)
};

/// What a forward pass returns for its flagged tokens.
enum class Output {
  Logits,  ///< [n_flagged, vocab]: the output projection of the final norm (soft-capped)
  Hidden,  ///< [n_flagged, dim]: the final norm's output, RMSNorm(x) ⊙ output_norm, the state
           ///< the output projection reads (what /v1/embeddings pools)
};

/// Positions of a batch's tokens, worked out once per forward pass (by every rank's driver,
/// before the ranks run) from the cache lengths.
struct BatchPlan {
  std::vector<int64_t> pos;                            // [T] position of each batch token
  std::vector<std::pair<int32_t, int64_t>> ends;       // per sequence: cache length afterwards
  std::vector<int64_t> out;                            // [n_logits] batch index of each flagged token
  int64_t n_logits = 0;                                // tokens flagged for logits
  int64_t max_pos = 0;                                 // 1 + the largest position
};

/// Fills `plan` for the batch [T]; throws UsageError for T <= 0 or T > capacity, a token id out of
/// range, or positions the cache has not reserved. Changes nothing in the cache.
void plan_batch(const Model& m, const KVCache& cache, const BatchToken* batch, int64_t T, int64_t capacity,
                BatchPlan& plan);
/// The same for a model known only by its shapes (token ids checked against c.vocab_size).
void plan_batch(const ModelConfig& c, const KVCache& cache, const BatchToken* batch, int64_t T, int64_t capacity, BatchPlan& plan);

namespace detail {
class ShardPass;
}  // namespace detail

/// Scratch buffers for forward passes of up to `capacity` tokens (one rank's widths under
/// tensor parallelism: engine/tp.cpp plans them from the rank's slices).
class Workspace {
 public:
  /// Activation buffers for `capacity` tokens; the logits, attention-score and matmul buffers
  /// grow on demand.
  Workspace(const Model& m, int64_t capacity);
  /// Every buffer allocated once, to the sizes of `plan` (engine/mem_plan.h); forward passes
  /// within the plan never allocate, so bytes() == plan.bytes().
  Workspace(const Model& m, const WorkspacePlan& plan);
  int64_t capacity() const { return cap_; }
  /// Bytes held now (capacities of every buffer, matmul scratch included).
  uint64_t bytes() const;

 private:
  friend const float* forward_batch(const Model&, KVCache&, Workspace&, ThreadPool&, const BatchToken*, int64_t, Output);
  friend const float* forward_shard(const Model&, const ModelShard*, KVCache&, Workspace&, ThreadPool&, Communicator*,
                                    const BatchToken*, int64_t, const BatchPlan&, int64_t, Output);
  friend class detail::ShardPass;  // forward_shard's steps (engine/model.cpp)
  int64_t cap_;
  std::vector<float> x_, xb_, q_, k_, v_, att_out_, h1_, h2_;  // [capacity, ...] (local widths)
  BatchPlan plan_;                           // forward_batch's plan (reused)
  std::vector<std::vector<float>> att_;      // per thread: attention scores [G, context]
  std::vector<float> att_part_;              // split decode attention: per part [G, head_dim + 2]
  std::vector<float> rope_;                  // [capacity, head_dim] RoPE cos, sin per token
  std::vector<float> logits_;                // [n_logits, n_vocab] this rank's logits
  std::vector<float> gathered_;              // root: [n_logits, vocab] all ranks' logits
  MatmulScratch scratch_;
};

/// The Llama forward pass over a batch that may mix sequences (continuous batching): every
/// weight matrix is applied once to all tokens; attention runs per token over its own
/// sequence's cached positions. The tokens of a sequence take positions cache.length(seq),
/// +1, ... in batch order, and the cache lengths advance by each sequence's token count.
/// Blocks must be reserved first (KVCache::reserve). Returns logits [n_flagged, vocab] for
/// the tokens with logits = true, in batch order, valid until the next call (out = Hidden:
/// their final-norm states [n_flagged, dim] instead).
/// Throws UsageError for n > ws.capacity(), a token id out of range, or unreserved positions.
const float* forward_batch(const Model& m, KVCache& cache, Workspace& ws, ThreadPool& pool, const BatchToken* batch,
                           int64_t n, Output out = Output::Logits);

/// One rank's part of the forward pass (tensor parallelism, Megatron-LM section 3), run by every
/// rank of a group at once with the same batch and plan (see plan_batch):
///   attention: Q/K/V column-parallel (this rank's heads; its KV heads go to KV-cache pool
///   `shard->ranges.rank`), attention over its heads, output projection row-parallel, then
///   comm->all_reduce_sum of the [T, dim] partial output; FFN: gate/up column-parallel, down
///   row-parallel, all_reduce_sum. Norms and the residual stream are replicated. A
///   vocab-parallel embedding (n_embd < vocab) is summed with one more all-reduce; the output
///   projection computes this rank's vocabulary rows and rank 0 gathers them.
/// shard == nullptr (and comm == nullptr) is the whole model on one rank: forward_batch.
/// Does not advance the cache lengths (the caller sets plan.ends once all ranks are done).
/// Returns logits [plan.n_logits, vocab] on rank 0 (nullptr when none are flagged), nullptr on
/// the other ranks. layer_end >= 0 (partial offload, one rank): runs layers 0 .. layer_end-1
/// only and returns the residual stream x [T, dim] after them (all T tokens), which a GPU's
/// layers take on from (cuda::CudaOffloadSession); the cache needs only those layers.
/// out = Hidden: returns the final-norm states [plan.n_logits, dim] of the flagged tokens on
/// every rank (the residual stream is replicated), with no output projection.
const float* forward_shard(const Model& m, const ModelShard* shard, KVCache& cache, Workspace& ws, ThreadPool& pool,
                           Communicator* comm, const BatchToken* batch, int64_t T, const BatchPlan& plan, int64_t layer_end = -1,
                           Output out = Output::Logits);

/// The one chunked-prefill loop of every session: fn(i, len, last) for the consecutive chunks
/// [i, i + len) of n tokens, each at most n_batch long (last: the chunk that ends at n).
template <class Fn>
void for_each_chunk(int64_t n, int64_t n_batch, const Fn& fn) {
  for (int64_t i = 0; i < n; i += n_batch) {
    const int64_t len = std::min(n_batch, n - i);
    fn(i, len, i + len == n);
  }
}

class TensorParallel;  // engine/tp.h
class Sampler;         // engine/sampler.h

/// What runs batched forward passes over a paged KV cache for the continuous-batching scheduler
/// (server/scheduler.h), whatever the device: the CPU ranks (TensorParallel, engine/tp.h) or a
/// GPU (cuda::CudaBatchRunner, engine/cuda/session.h).
class BatchRunner {
 public:
  virtual ~BatchRunner() = default;
  virtual const Model& model() const = 0;
  /// Most tokens per forward call.
  virtual int64_t capacity() const = 0;
  /// The KV cache the forward passes run over: n_blocks blocks of block_tokens positions.
  /// `type` is the CPU's element type (a GPU keeps fp16 and ignores it). Call once.
  virtual KVCache make_cache(int64_t n_blocks, int64_t block_tokens, KvType type) = 0;
  /// The forward pass over a batch that may mix sequences, with forward_batch's contract and
  /// errors: returns logits [n_flagged, vocab] for the flagged tokens in batch order (host
  /// memory, valid until the next call) or nullptr, and advances the cache lengths.
  virtual const float* forward(KVCache& cache, const BatchToken* batch, int64_t n) = 0;
  /// Whether forward_hidden works here (the CPU in this process; not a GPU or a process group).
  virtual bool has_hidden() const { return false; }
  /// forward() returning the flagged tokens' final-norm states [n_flagged, dim] (Output::Hidden)
  /// instead of logits. Throws UsageError where !has_hidden().
  virtual const float* forward_hidden(KVCache& cache, const BatchToken* batch, int64_t n);
  /// Bytes of the KV cache's storage (device bytes on a GPU).
  virtual uint64_t kv_bytes(const KVCache& cache) const { return cache.bytes(); }
  /// Bytes of the scratch buffers (all ranks; device bytes on a GPU).
  virtual uint64_t workspace_bytes() const = 0;
};

/// One sequence's forward pass over its own KV cache, whatever runs it: Session (the CPU, one
/// rank or tensor-parallel ranks) or cuda::CudaSession (a GPU, engine/cuda/session.h). What
/// generate(), perplexity() and the tools drive.
class SessionBase {
 public:
  virtual ~SessionBase() = default;
  /// Runs `tokens` [n] at positions pos() .. pos()+n-1, appending to the KV cache, and returns
  /// logits: [n, vocab] if all_logits, else [vocab] for the last token (host memory, valid until
  /// the next call). Throws UsageError if the cache would overflow or a token is out of range.
  virtual const float* forward(const int32_t* tokens, int64_t n, bool all_logits = false) = 0;
  virtual const Model& model() const = 0;
  /// Tokens in the KV cache (the next token's position).
  virtual int64_t pos() const = 0;
  /// KV-cache length in tokens.
  virtual int64_t ctx() const = 0;
  /// Most tokens per forward call (longer prompts are cut into chunks of this size).
  virtual int64_t n_batch() const = 0;
  /// Keeps only the first n cached positions (n <= pos()), e.g. to re-use a shared prompt prefix.
  virtual void truncate(int64_t n) = 0;
  /// Forgets the cache (the next forward starts at position 0).
  void reset() { truncate(0); }
  /// Runs tokens as forward() does and draws the next token from the last position's logits
  /// with `sampler` (history: the sequence so far, for its penalties). The CPU samples the
  /// logits; a GPU session copies back only what the draw needs: the token id (greedy), the
  /// top_k candidates (Sampler::top_k_suffices), else all logits. Same token either way.
  virtual int32_t forward_sample(const int32_t* tokens, int64_t n, Sampler& sampler, const std::vector<int32_t>& history);
  /// Bytes of the KV cache and of the scratch buffers (all ranks; device bytes on a GPU).
  virtual uint64_t kv_bytes() const = 0;
  virtual uint64_t workspace_bytes() const = 0;
  uint64_t state_bytes() const { return kv_bytes() + workspace_bytes(); }
};

/// One sequence with its own KV cache on the CPU: the simple interface for single-stream
/// generation.
class Session : public SessionBase {
 public:
  /// ctx: KV-cache length in tokens (<= 0: the model's context length, at most
  /// kDefaultMaxCtx); n_batch: most tokens per forward call (prompts are cut into chunks of
  /// this size); logits_rows: logits rows the workspace reserves (1 for generation; a forward
  /// with all_logits over more tokens grows it). Sizes come from the memory plan
  /// (engine/mem_plan.h: session_sizes, plan_kv, plan_workspace), as `llmq-mem infer` reports.
  /// kv_type: the KV cache's element type (engine/kv_cache.h).
  Session(const Model& model, ThreadPool& pool, int64_t ctx, int64_t n_batch = 512, int64_t logits_rows = 1,
          KvType kv_type = KvType::F32);
  /// The same on a batch runner (engine/tp.h: TensorParallel with any number of ranks, or
  /// ProcessGroupRunner over processes, engine/parallel/tp_process.h), which must
  /// outlive the session and serve one session at a time; prompts are cut into chunks of at
  /// most tp.capacity() tokens; the KV cache holds ctx positions (plan_kv), one pool per rank.
  Session(BatchRunner& tp, int64_t ctx, KvType kv_type = KvType::F32);
  ~Session();

  const float* forward(const int32_t* tokens, int64_t n, bool all_logits = false) override;
  const Model& model() const override { return m_; }
  int64_t pos() const override { return cache_.length(seq_); }
  int64_t ctx() const override { return ctx_; }
  int64_t n_batch() const override { return n_batch_; }
  void truncate(int64_t n) override { cache_.truncate(seq_, n); }
  uint64_t kv_bytes() const override { return cache_.bytes(); }
  uint64_t workspace_bytes() const override;
  /// The KV cache (one pool per tensor-parallel rank).
  const KVCache& cache() const { return cache_; }

 private:
  const Model& m_;
  int64_t ctx_, n_batch_;
  std::unique_ptr<TensorParallel> own_;  // the one-rank runner of the (model, pool) constructor
  BatchRunner& tp_;
  KVCache cache_;
  int32_t seq_;
  std::vector<BatchToken> batch_;
};

}  // namespace llmq
