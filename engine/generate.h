// Text generation and perplexity on top of a Session: the loops every tool shares.
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <vector>

#include "engine/model.h"
#include "engine/sampler.h"

namespace llmq {

/// Timings of one generate() call (seconds and token counts).
struct GenerateStats {
  int64_t prompt_tokens = 0, generated_tokens = 0;
  double prefill_s = 0, decode_s = 0;
  double prefill_tps() const { return prefill_s > 0 ? double(prompt_tokens) / prefill_s : 0; }
  double decode_tps() const { return decode_s > 0 ? double(generated_tokens) / decode_s : 0; }
};

/// `history` is the whole token sequence so far; the part not yet in the KV cache
/// (history[s.pos():], the new prompt plus any token sampled but not yet fed) goes through the
/// session as one batched prefill. Then up to `n_predict` tokens are sampled (n_predict < 0:
/// until a stop token or the context is full) and appended to history, calling on_token(id)
/// for each. A token in `stop_ids` (EOS, end of turn) ends generation: it is appended to
/// history (so the next turn continues after it) but not passed to on_token. Also stops when
/// on_token returns false, when *stop becomes true, or when the KV cache is full.
/// Throws UsageError if nothing is pending or the prompt overflows the cache.
GenerateStats generate(SessionBase& s, Sampler& sampler, std::vector<int32_t>& history, int64_t n_predict,
                       const std::vector<int32_t>& stop_ids, const std::function<bool(int32_t)>& on_token,
                       const std::atomic<bool>* stop = nullptr);

/// EOS and end-of-turn ids of a vocabulary (those that exist), for generate()'s stop_ids.
std::vector<int32_t> default_stop_ids(const Vocab& v);

/// Result of perplexity(): PPL = exp(mean NLL) over `scored` tokens, ± its standard error.
struct PerplexityResult {
  double ppl = 0, ppl_err = 0, mean_nll = 0;
  int64_t chunks = 0, scored = 0;
};

/// Perplexity as llama.cpp's `perplexity` tool computes it, so numbers compare: `tokens` is the
/// whole text tokenized with BOS first; it is cut into consecutive chunks of n_ctx tokens (a
/// partial last chunk is dropped); each chunk's first token is replaced by BOS; with
/// first = n_ctx/2, the tokens at positions first+1 .. n_ctx-1 are scored, each from the logits
/// of the position before it. on_chunk(i, ppl_so_far) is called after each chunk.
/// Throws UsageError if there is not one whole chunk.
/// max_chunks > 0 scores only the first max_chunks chunks (llama.cpp's --chunks). kv_type: the
/// KV cache's element type (engine/kv_cache.h).
PerplexityResult perplexity(const Model& m, ThreadPool& pool, const std::vector<int32_t>& tokens, int64_t n_ctx,
                            const std::function<void(int64_t, double)>& on_chunk = {}, int64_t max_chunks = 0,
                            KvType kv_type = KvType::F32);
/// The same on a tensor-parallel runner (engine/tp.h); tp.capacity() must be at least n_ctx
/// (UsageError otherwise).
PerplexityResult perplexity(BatchRunner& tp, const std::vector<int32_t>& tokens, int64_t n_ctx,
                            const std::function<void(int64_t, double)>& on_chunk = {}, int64_t max_chunks = 0,
                            KvType kv_type = KvType::F32);

/// The same on any session (a GPU session, say) whose context and batch hold n_ctx tokens
/// (UsageError otherwise). The session is reset before each chunk.
PerplexityResult perplexity(SessionBase& s, const std::vector<int32_t>& tokens, int64_t n_ctx,
                            const std::function<void(int64_t, double)>& on_chunk = {}, int64_t max_chunks = 0);

}  // namespace llmq
