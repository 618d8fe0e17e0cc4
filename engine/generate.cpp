#include "engine/generate.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "engine/tp.h"
#include "base/error.h"

namespace llmq {

namespace {
double now_s() {
  using clock = std::chrono::steady_clock;
  return std::chrono::duration<double>(clock::now().time_since_epoch()).count();
}
}  // namespace

std::vector<int32_t> default_stop_ids(const Vocab& v) {
  std::vector<int32_t> ids;
  if (v.eos_id >= 0) ids.push_back(v.eos_id);
  if (v.eot_id >= 0 && v.eot_id != v.eos_id) ids.push_back(v.eot_id);
  return ids;
}

GenerateStats generate(SessionBase& s, Sampler& sampler, std::vector<int32_t>& history, int64_t n_predict,
                       const std::vector<int32_t>& stop_ids, const std::function<bool(int32_t)>& on_token,
                       const std::atomic<bool>* stop) {
  GenerateStats st;
  const int64_t pending = int64_t(history.size()) - s.pos();
  if (pending <= 0) throw UsageError("generate: no new tokens to feed");
  if (n_predict == 0) {  // the prompt into the cache, nothing drawn
    double t0 = now_s();
    s.forward(history.data() + s.pos(), pending);
    st.prefill_s = now_s() - t0;
    st.prompt_tokens = pending;
    return st;
  }
  // forward_sample: the session draws each token (a GPU copies back only what the draw needs).
  double t0 = now_s();
  int32_t id = s.forward_sample(history.data() + s.pos(), pending, sampler, history);
  st.prefill_s = now_s() - t0;
  st.prompt_tokens = pending;

  t0 = now_s();
  for (int64_t i = 0; n_predict < 0 || i < n_predict; ++i) {
    if (stop && stop->load()) break;
    history.push_back(id);
    if (std::find(stop_ids.begin(), stop_ids.end(), id) != stop_ids.end()) break;
    ++st.generated_tokens;
    if (!on_token(id)) break;
    if (s.pos() >= s.ctx()) break;  // KV cache full
    if (n_predict >= 0 && i + 1 >= n_predict) break;
    const int32_t prev = id;
    id = s.forward_sample(&prev, 1, sampler, history);
  }
  st.decode_s = now_s() - t0;
  return st;
}

namespace {

void check_perplexity_args(const std::vector<int32_t>& tokens, int64_t n_ctx) {
  if (n_ctx < 4) throw UsageError("perplexity: --ctx must be at least 4");
  if (int64_t(tokens.size()) < n_ctx)
    throw UsageError("perplexity: the text has " + std::to_string(tokens.size()) + " tokens, fewer than one chunk of " +
                     std::to_string(n_ctx));
}

// The scoring loop over a session whose context and batch hold n_ctx tokens.
PerplexityResult perplexity_on(SessionBase& s, const std::vector<int32_t>& tokens, int64_t n_ctx,
                               const std::function<void(int64_t, double)>& on_chunk, int64_t max_chunks) {
  const Model& m = s.model();
  int64_t n_chunks = int64_t(tokens.size()) / n_ctx;
  if (max_chunks > 0) n_chunks = std::min(n_chunks, max_chunks);
  const int64_t V = m.config.vocab_size, first = n_ctx / 2;
  double sum = 0, sum2 = 0;
  int64_t count = 0;
  std::vector<int32_t> chunk(static_cast<size_t>(n_ctx));
  for (int64_t c = 0; c < n_chunks; ++c) {
    std::copy(tokens.begin() + c * n_ctx, tokens.begin() + (c + 1) * n_ctx, chunk.begin());
    if (m.vocab.add_bos && m.vocab.bos_id >= 0) chunk[0] = m.vocab.bos_id;  // as llama.cpp: only for models that take a BOS
    s.reset();
    const float* logits = s.forward(chunk.data(), n_ctx, /*all_logits=*/true);  // [n_ctx, V]
    for (int64_t j = first; j < n_ctx - 1; ++j) {
      const float* row = logits + j * V;
      float mx = row[0];
      for (int64_t v = 1; v < V; ++v) mx = std::max(mx, row[v]);
      double z = 0;
      for (int64_t v = 0; v < V; ++v) z += std::exp(double(row[v]) - double(mx));
      const double nll = -(double(row[chunk[size_t(j + 1)]]) - double(mx) - std::log(z));
      sum += nll;
      sum2 += nll * nll;
      ++count;
    }
    if (on_chunk) on_chunk(c, std::exp(sum / double(count)));
  }
  PerplexityResult r;
  r.chunks = n_chunks;
  r.scored = count;
  r.mean_nll = sum / double(count);
  r.ppl = std::exp(r.mean_nll);
  const double var = count > 1 ? (sum2 / double(count) - r.mean_nll * r.mean_nll) / double(count - 1) : 0;
  r.ppl_err = r.ppl * std::sqrt(std::max(0.0, var));
  return r;
}

}  // namespace

PerplexityResult perplexity(const Model& m, ThreadPool& pool, const std::vector<int32_t>& tokens, int64_t n_ctx,
                            const std::function<void(int64_t, double)>& on_chunk, int64_t max_chunks, KvType kv_type) {
  check_perplexity_args(tokens, n_ctx);
  Session s(m, pool, n_ctx, n_ctx, n_ctx, kv_type);  // every position's logits
  return perplexity_on(s, tokens, n_ctx, on_chunk, max_chunks);
}

PerplexityResult perplexity(BatchRunner& tp, const std::vector<int32_t>& tokens, int64_t n_ctx,
                            const std::function<void(int64_t, double)>& on_chunk, int64_t max_chunks, KvType kv_type) {
  check_perplexity_args(tokens, n_ctx);
  if (tp.capacity() < n_ctx)
    throw UsageError("perplexity: the forward capacity " + std::to_string(tp.capacity()) + " is below --ctx " + std::to_string(n_ctx));
  Session s(tp, n_ctx, kv_type);
  return perplexity_on(s, tokens, n_ctx, on_chunk, max_chunks);
}

PerplexityResult perplexity(SessionBase& s, const std::vector<int32_t>& tokens, int64_t n_ctx,
                            const std::function<void(int64_t, double)>& on_chunk, int64_t max_chunks) {
  check_perplexity_args(tokens, n_ctx);
  if (s.ctx() < n_ctx || s.n_batch() < n_ctx)
    throw UsageError("perplexity: the session holds " + std::to_string(std::min(s.ctx(), s.n_batch())) + " tokens, below --ctx " +
                     std::to_string(n_ctx));
  return perplexity_on(s, tokens, n_ctx, on_chunk, max_chunks);
}

}  // namespace llmq
