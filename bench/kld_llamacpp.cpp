// KL divergence of llmq's next-token distributions from llama.cpp's on the same GGUF and the
// same tokens: llama.cpp (the peer, linked as a library: libllama from the llama-cpp-python
// sdist, built by bench/kld_llamacpp.sh) is the reference P, llmq (the .llmq converted from
// that GGUF) is Q. Chunks of --ctx tokens as llama-perplexity cuts them (a BOS first where the
// vocabulary takes one), the second half of each chunk scored; per position
// KL(P‖Q) = Σ_v p_v (log p_v − log q_v) in fp64 over the whole vocabulary. Prints one JSON
// object: mean and max KLD, the 99th percentile, how often the argmax agrees, and both
// perplexities over the scored positions.
//
//   kld_llamacpp GGUF LLMQ TEXT [CTX=512] [CHUNKS=20] [THREADS=2]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "base/threadpool.h"
#include "engine/model.h"
#include "llama.h"

namespace {

// log-softmax of row [V] in fp64.
std::vector<double> log_softmax(const float* row, int64_t V) {
  double mx = row[0];
  for (int64_t v = 1; v < V; ++v) mx = std::max(mx, double(row[v]));
  double z = 0;
  for (int64_t v = 0; v < V; ++v) z += std::exp(double(row[v]) - mx);
  const double lz = mx + std::log(z);
  std::vector<double> out(static_cast<size_t>(V));
  for (int64_t v = 0; v < V; ++v) out[size_t(v)] = double(row[v]) - lz;
  return out;
}

int64_t argmax(const float* row, int64_t V) { return std::max_element(row, row + V) - row; }

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s GGUF LLMQ TEXT [CTX=512] [CHUNKS=20] [THREADS=2]\n", argv[0]);
    return 2;
  }
  const int64_t n_ctx = argc > 4 ? std::atoll(argv[4]) : 512, max_chunks = argc > 5 ? std::atoll(argv[5]) : 20;
  const int threads = argc > 6 ? std::atoi(argv[6]) : 2;
  std::ifstream f(argv[3]);
  std::stringstream ss;
  ss << f.rdbuf();

  auto model = llmq::Model::load(argv[2]);
  llmq::ThreadPool pool(threads);
  llmq::Session session(*model, pool, n_ctx, n_ctx, n_ctx);
  const std::vector<int32_t> tokens = model->tokenizer->encode(ss.str(), model->vocab.add_bos);
  const int64_t V = model->config.vocab_size;

  llama_backend_init();
  llama_model_params mp = llama_model_default_params();
  if (const char* r = std::getenv("LLMQ_PEER_REPACK"); r && std::string(r) == "0") mp.use_extra_bufts = false;  // no repacked kernels
  llama_model* peer = llama_model_load_from_file(argv[1], mp);
  if (!peer) return std::fprintf(stderr, "llama.cpp could not load %s\n", argv[1]), 2;
  llama_context_params cp = llama_context_default_params();
  cp.n_ctx = uint32_t(n_ctx), cp.n_batch = uint32_t(n_ctx), cp.n_ubatch = uint32_t(n_ctx);
  cp.n_threads = cp.n_threads_batch = threads;
  if (const char* kv = std::getenv("LLMQ_PEER_KV"); kv && std::string(kv) == "f32") {  // llama.cpp at its most exact
    cp.type_k = cp.type_v = GGML_TYPE_F32;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
  }
  llama_context* ctx = llama_init_from_model(peer, cp);
  if (llama_vocab_n_tokens(llama_model_get_vocab(peer)) != V) return std::fprintf(stderr, "vocabulary sizes differ\n"), 2;

  // Tokenization check: llama.cpp's tokens for the same text (both with the model's BOS rule).
  std::vector<llama_token> theirs(tokens.size() + 16);
  const int nt = llama_tokenize(llama_model_get_vocab(peer), ss.str().c_str(), int32_t(ss.str().size()), theirs.data(),
                                int32_t(theirs.size()), model->vocab.add_bos, false);
  int64_t same_prefix = 0;
  while (same_prefix < std::min<int64_t>(nt, int64_t(tokens.size())) && theirs[size_t(same_prefix)] == tokens[size_t(same_prefix)]) ++same_prefix;

  const int64_t n_chunks = std::min<int64_t>(int64_t(tokens.size()) / n_ctx, max_chunks), first = n_ctx / 2;
  std::vector<double> klds;
  int64_t agree = 0;
  double nll_p = 0, nll_q = 0;
  std::vector<int32_t> chunk(static_cast<size_t>(n_ctx));
  llama_batch batch = llama_batch_init(int32_t(n_ctx), 0, 1);
  for (int64_t c = 0; c < n_chunks; ++c) {
    std::copy(tokens.begin() + c * n_ctx, tokens.begin() + (c + 1) * n_ctx, chunk.begin());
    if (model->vocab.add_bos && model->vocab.bos_id >= 0) chunk[0] = model->vocab.bos_id;
    session.reset();
    const float* q_logits = session.forward(chunk.data(), n_ctx, true);  // [n_ctx, V]
    llama_memory_clear(llama_get_memory(ctx), true);
    batch.n_tokens = int32_t(n_ctx);
    for (int64_t i = 0; i < n_ctx; ++i) {
      batch.token[i] = chunk[size_t(i)], batch.pos[i] = int32_t(i), batch.n_seq_id[i] = 1, batch.seq_id[i][0] = 0;
      batch.logits[i] = 1;
    }
    if (llama_decode(ctx, batch) != 0) return std::fprintf(stderr, "llama_decode failed\n"), 2;
    for (int64_t j = first; j < n_ctx - 1; ++j) {
      const float* p_row = llama_get_logits_ith(ctx, int32_t(j));
      const float* q_row = q_logits + j * V;
      const auto lp = log_softmax(p_row, V), lq = log_softmax(q_row, V);
      double kl = 0;
      for (int64_t v = 0; v < V; ++v) kl += std::exp(lp[size_t(v)]) * (lp[size_t(v)] - lq[size_t(v)]);
      klds.push_back(kl);
      agree += argmax(p_row, V) == argmax(q_row, V);
      nll_p -= lp[size_t(chunk[size_t(j + 1)])], nll_q -= lq[size_t(chunk[size_t(j + 1)])];
    }
    std::fprintf(stderr, "[%lld] mean KLD so far %.6f\n", (long long)c + 1, [&] {
      double s = 0;
      for (double k : klds) s += k;
      return s / double(klds.size());
    }());
  }
  llama_batch_free(batch);
  const size_t n = klds.size();
  double mean = 0;
  for (double k : klds) mean += k;
  mean /= double(n);
  std::vector<double> sorted = klds;
  std::sort(sorted.begin(), sorted.end());
  std::printf(
      "{\"positions\": %zu, \"chunks\": %lld, \"ctx\": %lld, \"tokens_same_as_llamacpp\": %lld, \"tokens\": %zu, "
      "\"mean_kld\": %.6f, \"p99_kld\": %.6f, \"max_kld\": %.6f, \"top1_agreement\": %.4f, \"ppl_llamacpp\": %.4f, "
      "\"ppl_llmq\": %.4f}\n",
      n, (long long)n_chunks, (long long)n_ctx, (long long)same_prefix, tokens.size(), mean, sorted[n * 99 / 100], sorted.back(),
      double(agree) / double(n), std::exp(nll_p / double(n)), std::exp(nll_q / double(n)));
  llama_free(ctx);
  llama_model_free(peer);
  return 0;
}
