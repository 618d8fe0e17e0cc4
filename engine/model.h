// A Llama model loaded from a `.llmq` file and the CPU forward pass over a KV cache.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "engine/cpu_ops.h"
#include "engine/kv_cache.h"
#include "engine/mem_plan.h"
#include "engine/threadpool.h"
#include "engine/tokenizer.h"
#include "formats/llmq_file.h"
#include "formats/vocab.h"
#include "models/llama.h"

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
  const float* ffn_norm;   // [dim]
  Weight w_gate;           // [hidden, dim]
  Weight w_up;             // [hidden, dim]
  Weight w_down;           // [dim, hidden]
};

/// The model: config, tokenizer vocabulary and weights, used in place from the mmap.
struct Model {
  std::unique_ptr<LlmqFile> file;
  LlamaConfig config;
  Vocab vocab;
  std::unique_ptr<Tokenizer> tokenizer;  // built from vocab at load (validates it)
  std::string chat_template;
  Weight token_embd;        // [vocab, dim]
  std::vector<LayerWeights> layers;
  const float* output_norm;  // [dim]
  Weight output;             // [vocab, dim] (the embedding when tied)

  /// Opens and validates `path` (see LlmqFile::open), builds the tokenizer, and binds every
  /// tensor of the Llama table (models/llama.h), checking names, shapes and that 1-D tensors
  /// are F32.
  /// Throws FileError for any fault (the message names the file).
  static std::unique_ptr<Model> load(const std::string& path, bool verify = true);
  /// Bytes of weights in the file (all tensors).
  uint64_t weight_bytes() const;
  /// The type holding most 2-D weights, e.g. "q8_0" (for reports).
  std::string weight_type() const;
};

/// Default KV-cache length when none is asked for and the model's context is longer (as
/// llama.cpp, a long-context model does not reserve its whole context unless asked).
constexpr int64_t kDefaultMaxCtx = 4096;

/// One token of a batched forward pass.
struct BatchToken {
  int32_t seq;    ///< KV-cache sequence id
  int32_t token;  ///< token id
  bool logits;    ///< return logits for this token
};

/// Scratch buffers for forward passes of up to `capacity` tokens.
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
  friend const float* forward_batch(const Model&, KVCache&, Workspace&, ThreadPool&, const BatchToken*, int64_t);
  int64_t cap_;
  std::vector<float> x_, xb_, q_, k_, v_, att_out_, h1_, h2_;  // [capacity, ...]
  std::vector<int64_t> pos_;                 // [capacity] position of each batch token
  std::vector<std::vector<float>> att_;      // per thread: attention scores [context]
  std::vector<float> logits_;                // [n_logits, vocab]
  MatmulScratch scratch_;
};

/// The Llama forward pass over a batch that may mix sequences (continuous batching): every
/// weight matrix is applied once to all tokens; attention runs per token over its own
/// sequence's cached positions. The tokens of a sequence take positions cache.length(seq),
/// +1, ... in batch order, and the cache lengths advance by each sequence's token count.
/// Blocks must be reserved first (KVCache::reserve). Returns logits [n_flagged, vocab] for
/// the tokens with logits = true, in batch order, valid until the next call.
/// Throws UsageError for n > ws.capacity(), a token id out of range, or unreserved positions.
const float* forward_batch(const Model& m, KVCache& cache, Workspace& ws, ThreadPool& pool, const BatchToken* batch,
                           int64_t n);

/// One sequence with its own KV cache: the simple interface for single-stream generation.
class Session {
 public:
  /// ctx: KV-cache length in tokens (<= 0: the model's context length, at most
  /// kDefaultMaxCtx); n_batch: most tokens per forward call (prompts are cut into chunks of
  /// this size); logits_rows: logits rows the workspace reserves (1 for generation; a forward
  /// with all_logits over more tokens grows it). Sizes come from the memory plan
  /// (engine/mem_plan.h: session_sizes, plan_kv, plan_workspace), as `llmq-mem infer` reports.
  Session(const Model& model, ThreadPool& pool, int64_t ctx, int64_t n_batch = 512, int64_t logits_rows = 1);

  /// Runs `tokens` [n] at positions pos() .. pos()+n-1, appending to the KV cache, and returns
  /// logits: [n, vocab] if all_logits, else [vocab] for the last token. The pointer stays valid
  /// until the next call. Throws UsageError if the cache would overflow or a token is out of range.
  const float* forward(const int32_t* tokens, int64_t n, bool all_logits = false);

  const Model& model() const { return m_; }
  int64_t pos() const { return cache_.length(seq_); }
  int64_t ctx() const { return ctx_; }
  /// Forgets the cache (the next forward starts at position 0).
  void reset() { cache_.truncate(seq_, 0); }
  /// Keeps only the first n cached positions (n <= pos()), e.g. to re-use a shared prompt prefix.
  void truncate(int64_t n) { cache_.truncate(seq_, n); }
  /// Bytes held by the KV cache and the scratch buffers.
  uint64_t state_bytes() const { return cache_.bytes() + ws_.bytes(); }
  uint64_t kv_bytes() const { return cache_.bytes(); }
  uint64_t workspace_bytes() const { return ws_.bytes(); }

 private:
  const Model& m_;
  ThreadPool& pool_;
  int64_t ctx_, n_batch_;
  KVCache cache_;
  int32_t seq_;
  Workspace ws_;
  std::vector<BatchToken> batch_;
};

}  // namespace llmq
