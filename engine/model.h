// A Llama model loaded from a `.llmq` file and the CPU forward pass over a KV cache.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "engine/cpu_ops.h"
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

/// One sequence's inference state: KV cache plus scratch buffers, sized once.
class Session {
 public:
  /// ctx: KV-cache length in tokens (<= 0: the model's context length, at most
  /// kDefaultMaxCtx); n_batch: most tokens
  /// per forward call (prompts are cut into chunks of this size).
  Session(const Model& model, ThreadPool& pool, int64_t ctx, int64_t n_batch = 512);

  /// Runs `tokens` [n] at positions pos() .. pos()+n-1, appending to the KV cache, and returns
  /// logits: [n, vocab] if all_logits, else [vocab] for the last token. The pointer stays valid
  /// until the next call. Throws UsageError if the cache would overflow or a token is out of range.
  const float* forward(const int32_t* tokens, int64_t n, bool all_logits = false);

  const Model& model() const { return m_; }
  int64_t pos() const { return pos_; }
  int64_t ctx() const { return ctx_; }
  /// Forgets the cache (the next forward starts at position 0).
  void reset() { pos_ = 0; }
  /// Keeps only the first n cached positions (n <= pos()), e.g. to re-use a shared prompt prefix.
  void truncate(int64_t n) { pos_ = std::max<int64_t>(0, std::min(n, pos_)); }
  /// Bytes held by the KV cache and the scratch buffers.
  uint64_t state_bytes() const;

 private:
  const float* forward_chunk(const int32_t* tokens, int64_t n, bool all_logits);

  const Model& m_;
  ThreadPool& pool_;
  int64_t ctx_, n_batch_, pos_ = 0;
  std::vector<float> k_cache_, v_cache_;  // [n_layers, ctx, kv_dim]
  std::vector<float> x_, xb_, q_, k_, v_, att_out_, h1_, h2_;  // [n_batch, ...]
  std::vector<float> att_;      // [threads, ctx] attention scores
  std::vector<float> logits_;   // [n_batch, vocab]
  MatmulScratch scratch_;
};

}  // namespace llmq
