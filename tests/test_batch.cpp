// Continuous batching: a forward pass over several sequences at different positions gives the
// same logits as running each sequence alone; the paged KV cache hands out and takes back blocks.
#include <catch2/catch.hpp>
#include <algorithm>
#include <cmath>
#include <memory>
#include <random>

#include "engine/cpu/cpu_ops.h"
#include "engine/model.h"
#include "engine/tp.h"
#include "base/error.h"
#include "server/embeddings.h"
#include "server/metrics.h"
#include "server/scheduler.h"
#include "test_util.h"

using namespace llmq;

TEST_CASE("paged KV cache: reserve, truncate, remove", "[batch]") {
  ModelConfig c;
  c.dim = 8, c.hidden_dim = 8, c.n_layers = 2, c.n_heads = 2, c.n_kv_heads = 1, c.head_dim = 4;
  c.vocab_size = 4, c.context_length = 64;
  KVCache kv(c, 5, 4);
  const int32_t a = kv.add_sequence(), b = kv.add_sequence();
  CHECK(kv.reserve(a, 9));  // 3 blocks
  CHECK(kv.free_blocks() == 2);
  CHECK_FALSE(kv.reserve(b, 12));  // needs 3, 2 free: nothing changes
  CHECK(kv.free_blocks() == 2);
  CHECK(kv.capacity(b) == 0);
  kv.set_length(a, 9);
  kv.truncate(a, 4);  // keeps 1 block
  CHECK(kv.free_blocks() == 4);
  CHECK(kv.length(a) == 4);
  CHECK(kv.reserve(b, 12));
  kv.remove_sequence(b);
  CHECK(kv.free_blocks() == 4);
  CHECK(kv.add_sequence() == b);  // ids are reused
  CHECK_THROWS_AS(kv.set_length(a, 5), UsageError);
}

TEST_CASE("a mixed batch of sequences equals each sequence run alone", "[batch][model]") {
  auto m = Model::load(test::stories("q8_0"));
  ThreadPool pool(2);
  std::mt19937 rng(std::random_device{}());
  const int n_seq = 3;
  std::vector<std::vector<int32_t>> prompts(n_seq);
  for (int s = 0; s < n_seq; ++s) {
    prompts[s].push_back(1);
    for (int i = 0; i < 5 + 7 * s; ++i) prompts[s].push_back(int32_t(3 + rng() % 500));
  }
  // Reference: each sequence alone, logits of its last token.
  std::vector<std::vector<float>> want(n_seq);
  for (int s = 0; s < n_seq; ++s) {
    Session one(*m, pool, 64);
    const float* l = one.forward(prompts[s].data(), int64_t(prompts[s].size()));
    want[s].assign(l, l + 512);
  }
  // Batched: sequence 0 is prefilled first, then one batch mixes its decode step with the
  // prefill of sequences 1 and 2 (different positions in one pass).
  KVCache kv(m->config, 16, 16);
  Workspace ws(*m, 64);
  std::vector<int32_t> seq(n_seq);
  for (int s = 0; s < n_seq; ++s) {
    seq[s] = kv.add_sequence();
    REQUIRE(kv.reserve(seq[s], int64_t(prompts[s].size())));
  }
  std::vector<BatchToken> first;
  for (size_t i = 0; i + 1 < prompts[0].size(); ++i) first.push_back({seq[0], prompts[0][i], false});
  CHECK(forward_batch(*m, kv, ws, pool, first.data(), int64_t(first.size())) == nullptr);
  std::vector<BatchToken> mixed{{seq[0], prompts[0].back(), true}};
  for (int s = 1; s < n_seq; ++s)
    for (size_t i = 0; i < prompts[s].size(); ++i) mixed.push_back({seq[s], prompts[s][i], i + 1 == prompts[s].size()});
  const float* got = forward_batch(*m, kv, ws, pool, mixed.data(), int64_t(mixed.size()));
  for (int s = 0; s < n_seq; ++s) {
    CHECK(kv.length(seq[s]) == int64_t(prompts[s].size()));
    double worst = 0;
    for (int v = 0; v < 512; ++v) worst = std::max(worst, std::fabs(double(got[s * 512 + v]) - want[s][size_t(v)]));
    INFO("sequence " << s << " max abs diff " << worst);
    CHECK(worst < 1e-4);
  }
  // Unreserved positions are refused.
  const int32_t extra = kv.add_sequence();
  BatchToken t{extra, 5, true};
  CHECK_THROWS_AS(forward_batch(*m, kv, ws, pool, &t, 1), UsageError);
}

// The server's scheduler with a bf16 KV cache (llmq-server --kv-type bf16): three greedy
// requests batched together produce the tokens a Session with the same cache type produces
// for each alone (decode and batched prefill agree bit for bit, so the batch cannot change them).
TEST_CASE("scheduler with a bf16 KV cache: batched greedy requests equal each one alone", "[batch][model]") {
  auto m = Model::load(test::stories("q8_0"));
  ThreadPool pool(2);
  std::vector<std::vector<int32_t>> prompts = {{1, 400, 20}, {1, 17, 300, 41, 99}, {1, 250}};
  std::vector<std::vector<int32_t>> want;
  for (const auto& p : prompts) {
    Session s(*m, pool, 128, 64, 1, KvType::BF16);
    std::vector<int32_t> out;
    const float* logits = s.forward(p.data(), int64_t(p.size()));
    for (int i = 0; i < 12; ++i) {
      const int32_t t = int32_t(std::max_element(logits, logits + 512) - logits);
      out.push_back(t);
      logits = s.forward(&t, 1);
    }
    want.push_back(out);
  }
  SchedulerOptions so;
  so.parallel = 3, so.ctx = 128, so.n_batch = 32, so.kv_type = KvType::BF16;
  Scheduler sched(*m, pool, so);
  std::vector<std::shared_ptr<GenRequest>> reqs;
  for (const auto& p : prompts) {
    GenParams g;
    g.prompt = p;
    g.max_tokens = 12;
    g.sampling.temperature = 0;  // greedy
    reqs.push_back(std::make_shared<GenRequest>(g));
    REQUIRE(sched.submit(reqs.back()) == Scheduler::Submit::Ok);
  }
  for (size_t r = 0; r < reqs.size(); ++r) {
    std::vector<int32_t> got;
    std::vector<GenEvent> ev;
    while (reqs[r]->wait(&ev, 10000)) {
      for (const GenEvent& e : ev)
        for (const TokenInfo& t : e.tokens) got.push_back(t.id);
      ev.clear();
    }
    for (const GenEvent& e : ev)
      for (const TokenInfo& t : e.tokens) got.push_back(t.id);
    INFO("request " << r << ": " << got.size() << " tokens, finish " << reqs[r]->finish_reason);
    REQUIRE(!got.empty());
    CHECK(got == std::vector<int32_t>(want[r].begin(), want[r].begin() + int64_t(got.size())));
    CHECK((got.size() == 12 || reqs[r]->finish_reason == "stop"));
  }
}

// Issue 22 item 4: /metrics label values come from fixed sets. A thousand refused requests to
// distinct hostile paths (quotes, newlines, label syntax) leave one "other" series, and the
// exposition has no line that a path wrote.
TEST_CASE("metrics: request labels are the server's routes or \"other\", never a client's path", "[server]") {
  Metrics m;
  for (int i = 0; i < 1000; ++i) m.count_request("/x" + std::to_string(i) + "\"} 1\nevil_metric{a=\"", 401);
  m.count_request("/v1/completions", 200);
  m.count_request("/v1/completions", 1234);
  CHECK(m.requests.size() == 3);
  SchedulerStats st;
  st.kv_blocks_total = 1;
  const std::string out = m.render(st);
  CHECK(out.find("evil") == std::string::npos);
  CHECK(out.find("llmq_requests_total{endpoint=\"other\",status=\"401\"} 1000") != std::string::npos);
  CHECK(out.find("llmq_requests_total{endpoint=\"/v1/completions\",status=\"200\"} 1") != std::string::npos);
  CHECK(out.find("llmq_requests_total{endpoint=\"/v1/completions\",status=\"other\"} 1") != std::string::npos);
}

TEST_CASE("prefix cache: whole blocks of a seen prefix are shared, counted, kept and evicted LRU", "[batch]") {
  ModelConfig c;
  c.dim = 8, c.hidden_dim = 8, c.n_layers = 1, c.n_heads = 2, c.n_kv_heads = 1, c.head_dim = 4;
  c.vocab_size = 100, c.context_length = 64;
  KVCache kv(c, 6, 4);
  kv.enable_prefix_cache();
  const std::vector<int32_t> p = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};  // 2 whole blocks + 2 tokens
  const int32_t a = kv.add_sequence();
  CHECK(kv.attach_prefix(a, p.data(), 10) == 0);  // nothing cached yet
  REQUIRE(kv.reserve(a, 10));
  kv.set_length(a, 10);
  kv.register_prefix(a, p.data(), 10);
  CHECK(kv.prefix_blocks() == 2);  // the partial third block is not registered
  // A second sequence with the same prompt shares both blocks; one with a different second
  // block shares only the first; one token short of two blocks leaves the last block to compute.
  const int32_t b = kv.add_sequence();
  CHECK(kv.attach_prefix(b, p.data(), 10) == 8);
  CHECK(kv.blocks(b) == std::vector<int32_t>(kv.blocks(a).begin(), kv.blocks(a).begin() + 2));
  std::vector<int32_t> q = p;
  q[5] = 99;
  const int32_t d = kv.add_sequence();
  CHECK(kv.attach_prefix(d, q.data(), 10) == 4);
  const int32_t e = kv.add_sequence();
  CHECK(kv.attach_prefix(e, p.data(), 8) == 4);  // 8 tokens: the last one must be computed
  kv.remove_sequence(b), kv.remove_sequence(d), kv.remove_sequence(e);
  CHECK(kv.free_blocks() == 3);  // a holds 3 of 6
  // When a goes, its registered blocks stay cached (evictable, counted free) and are found again.
  kv.remove_sequence(a);
  CHECK(kv.free_blocks() == 6);
  CHECK(kv.evictable_blocks() == 2);
  const int32_t f = kv.add_sequence();
  CHECK(kv.attach_prefix(f, p.data(), 10) == 8);
  CHECK(kv.evictable_blocks() == 0);
  kv.remove_sequence(f);
  // Needing every block evicts the cached ones; the prefix is gone afterwards, never wrong.
  const int32_t g = kv.add_sequence();
  REQUIRE(kv.reserve(g, 24));
  CHECK(kv.prefix_blocks() == 0);
  kv.remove_sequence(g);
  const int32_t h = kv.add_sequence();
  CHECK(kv.attach_prefix(h, p.data(), 10) == 0);
  // A sequence removed before anything was registered (a request cancelled while queued for
  // its first pass) just frees its blocks.
  KVCache fresh(c, 6, 4);
  fresh.enable_prefix_cache();
  const int32_t y = fresh.add_sequence();
  REQUIRE(fresh.reserve(y, 10));
  fresh.remove_sequence(y);
  CHECK(fresh.free_blocks() == 6);
  CHECK(fresh.evictable_blocks() == 0);
  // Off (the default): nothing is attached.
  KVCache plain(c, 6, 4);
  const int32_t x = plain.add_sequence();
  REQUIRE(plain.reserve(x, 10));
  plain.set_length(x, 10);
  plain.register_prefix(x, p.data(), 10);
  CHECK(plain.attach_prefix(plain.add_sequence(), p.data(), 10) == 0);
}

// Requests that share a long prompt prefix: with the prefix cache the later ones start from the
// cached blocks and give the same greedy tokens as without it (and as each run alone).
TEST_CASE("scheduler prefix cache: same greedy output with the cache on and off, cached tokens counted", "[batch][model]") {
  auto m = Model::load(test::stories("q8_0"));
  ThreadPool pool(2);
  std::vector<int32_t> system = {1};
  for (int i = 0; i < 70; ++i) system.push_back(int32_t(20 + (i * 37) % 400));
  std::vector<std::vector<int32_t>> prompts;
  for (int32_t tail : {11, 222, 333, 11}) {
    prompts.push_back(system);
    prompts.back().push_back(tail);
  }
  auto run = [&](bool cache, std::vector<int64_t>* cached) {
    SchedulerOptions so;
    so.parallel = 2, so.ctx = 128, so.n_batch = 32, so.prefix_cache = cache;
    Scheduler sched(*m, pool, so);
    std::vector<std::vector<int32_t>> outs;
    for (const auto& p : prompts) {  // one after the other: each finds the previous ones' blocks
      GenParams g;
      g.prompt = p;
      g.max_tokens = 10;
      g.sampling.temperature = 0;
      auto r = std::make_shared<GenRequest>(g);
      REQUIRE(sched.submit(r) == Scheduler::Submit::Ok);
      std::vector<int32_t> got;
      std::vector<GenEvent> ev;
      while (r->wait(&ev, 10000)) {}
      for (const GenEvent& e : ev)
        for (const TokenInfo& t : e.tokens) got.push_back(t.id);
      outs.push_back(got);
      cached->push_back(r->cached_tokens);
    }
    return outs;
  };
  std::vector<int64_t> with_cache, without;
  const auto on = run(true, &with_cache), off = run(false, &without);
  CHECK(on == off);
  CHECK(on[0] == on[3]);
  CHECK(with_cache[0] == 0);
  for (size_t i = 1; i < prompts.size(); ++i) CHECK(with_cache[i] == 64);  // 4 whole blocks of 16 of the 71 shared tokens
  for (int64_t n : without) CHECK(n == 0);
}

namespace {

// Waits for r and returns its events (GenRequest::wait until the end).
std::vector<GenEvent> all_events(GenRequest& r) {
  std::vector<GenEvent> ev;
  while (r.wait(&ev, 10000)) {}
  return ev;
}

// The final-norm states [n, dim] of `tokens` run alone from position 0 (every token flagged).
std::vector<float> hidden_states(const Model& m, ThreadPool& pool, const std::vector<int32_t>& tokens) {
  KVCache kv(m.config, 8, 16);
  Workspace ws(m, 64);
  const int32_t seq = kv.add_sequence();
  REQUIRE(kv.reserve(seq, int64_t(tokens.size())));
  std::vector<BatchToken> b;
  for (int32_t t : tokens) b.push_back({seq, t, true});
  const float* h = forward_batch(m, kv, ws, pool, b.data(), int64_t(b.size()), Output::Hidden);
  return std::vector<float>(h, h + tokens.size() * size_t(m.config.dim));
}

}  // namespace

// Output::Hidden is the state the logits come from: the output projection of the hidden rows
// gives forward's logits; in-process tensor parallelism gives the same rows.
TEST_CASE("forward pass: Output::Hidden is the final norm the output projection reads, alone and under TP", "[batch][model]") {
  auto m = Model::load(test::stories("q8_0"));
  ThreadPool pool(2);
  std::mt19937 rng(std::random_device{}());
  std::vector<int32_t> tokens = {1};
  for (int i = 0; i < 20; ++i) tokens.push_back(int32_t(3 + rng() % 500));
  const int64_t n = int64_t(tokens.size()), D = m->config.dim, V = m->config.vocab_size;
  const std::vector<float> h = hidden_states(*m, pool, tokens);
  Session s(*m, pool, 64, 64, 64);
  const float* logits = s.forward(tokens.data(), n, true);  // [n, V]
  MatmulScratch scratch;
  std::vector<float> proj(size_t(n * V));
  matmul(pool, scratch, proj.data(), h.data(), n, m->output);
  for (int64_t i = 0; i < n * V; ++i) REQUIRE(proj[size_t(i)] == Approx(logits[i]).margin(1e-4));
  // TP on the F32 model (Q8_0's activation codes may flip under TP: test_tp.cpp, kQuantBound).
  auto f32 = Model::load(test::stories("f32"));
  const std::vector<float> h1 = hidden_states(*f32, pool, tokens);
  TensorParallel two(*f32, 2, 2, 64);
  KVCache kv = two.make_cache(8, 16, KvType::F32);
  const int32_t seq = kv.add_sequence();
  REQUIRE(kv.reserve(seq, n));
  std::vector<BatchToken> b;
  for (int32_t t : tokens) b.push_back({seq, t, true});
  const float* ht = two.forward_hidden(kv, b.data(), n);
  for (int64_t i = 0; i < n * D; ++i) REQUIRE(ht[i] == Approx(h1[size_t(i)]).margin(1e-4));  // the ranks sum in another order
}

// Echo with logprobs: each prompt token's logprob is the log-softmax of the position before it,
// computed opt.parallel rows a step beside other sequences; max_tokens 0 scores only.
TEST_CASE("scheduler: prompt logprobs equal each position's log-softmax, and max_tokens 0 scores only", "[batch][model]") {
  auto m = Model::load(test::stories("q8_0"));
  ThreadPool pool(2);
  std::vector<int32_t> prompt = {1};
  for (int i = 0; i < 29; ++i) prompt.push_back(int32_t(20 + (i * 53) % 450));
  const int64_t V = m->config.vocab_size, n = int64_t(prompt.size());
  Session one(*m, pool, 64, 64, 64);
  const float* all = one.forward(prompt.data(), n, true);
  std::vector<float> want(size_t(n), NAN);
  for (int64_t i = 1; i < n; ++i) want[size_t(i)] = Sampler::logprob(all + (i - 1) * V, V, prompt[size_t(i)], 0, nullptr);
  const int32_t next = Sampler::argmax(all + (n - 1) * V, V);

  SchedulerOptions so;
  so.parallel = 3, so.ctx = 128, so.n_batch = 32;  // 3 logits rows a step: the prompt takes many steps
  Scheduler sched(*m, pool, so);
  std::vector<std::shared_ptr<GenRequest>> reqs;
  for (int64_t max_tokens : {int64_t(0), int64_t(3), int64_t(8)}) {
    GenParams g;
    g.prompt = max_tokens == 8 ? std::vector<int32_t>{1, 400, 20} : prompt;  // the third: a plain completion beside them
    g.max_tokens = max_tokens;
    g.sampling.temperature = 0;
    g.top_logprobs = 2;
    g.prompt_logprobs = max_tokens != 8;
    reqs.push_back(std::make_shared<GenRequest>(g));
    REQUIRE(sched.submit(reqs.back()) == Scheduler::Submit::Ok);
  }
  for (int k = 0; k < 2; ++k) {
    const std::vector<GenEvent> ev = all_events(*reqs[size_t(k)]);
    REQUIRE(!ev.empty());
    REQUIRE(ev[0].prompt);
    REQUIRE(int64_t(ev[0].tokens.size()) == n);
    CHECK(std::isnan(ev[0].tokens[0].logprob));
    for (int64_t i = 1; i < n; ++i) {
      const TokenInfo& t = ev[0].tokens[size_t(i)];
      CHECK(t.id == prompt[size_t(i)]);
      CHECK(t.logprob == Approx(want[size_t(i)]).margin(1e-4));
      CHECK(t.top.size() == 2);
    }
    size_t generated = 0;
    for (size_t e = 1; e < ev.size(); ++e) {
      CHECK_FALSE(ev[e].prompt);
      for (const TokenInfo& t : ev[e].tokens) {
        generated += 1;
        if (generated == 1) CHECK(t.id == next);
      }
    }
    CHECK(generated == (k == 0 ? 0u : 3u));
    CHECK(reqs[size_t(k)]->finish_reason == "length");
    CHECK(reqs[size_t(k)]->completion_tokens == int64_t(generated));
  }
  CHECK(all_events(*reqs[2]).size() > 0);
  CHECK(reqs[2]->completion_tokens == 8);
}

// Embeddings: the scheduler's pooled vectors (mean, last, cls) equal the states of the input run
// alone, pooled and normalised; several inputs at once beside a completion.
TEST_CASE("scheduler: embeddings pool the final-norm states (mean, last, cls) to unit vectors", "[batch][model]") {
  auto m = Model::load(test::stories("q8_0"));
  ThreadPool pool(2);
  const int64_t D = m->config.dim;
  std::vector<std::vector<int32_t>> inputs = {{1, 300, 44, 12}, {1, 7}, {1}};
  for (int i = 0; i < 40; ++i) inputs[0].push_back(int32_t(30 + (i * 29) % 450));  // longer than n_batch: two steps
  std::vector<std::vector<float>> states;  // before the scheduler starts: its loop owns the pool then
  for (const auto& in : inputs) states.push_back(hidden_states(*m, pool, in));
  SchedulerOptions so;
  so.parallel = 4, so.ctx = 128, so.n_batch = 32;
  Scheduler sched(*m, pool, so);
  REQUIRE(sched.has_hidden());
  for (Pooling pooling : {Pooling::Mean, Pooling::Last, Pooling::First}) {
    std::vector<std::shared_ptr<GenRequest>> reqs;
    GenParams busy;  // a completion in the same steps
    busy.prompt = {1, 99, 98};
    busy.max_tokens = 6;
    auto other = std::make_shared<GenRequest>(busy);
    REQUIRE(sched.submit(other) == Scheduler::Submit::Ok);
    for (const auto& in : inputs) {
      GenParams g;
      g.prompt = in;
      g.max_tokens = 0;
      g.embed = pooling;
      reqs.push_back(std::make_shared<GenRequest>(g));
      REQUIRE(sched.submit(reqs.back()) == Scheduler::Submit::Ok);
    }
    for (size_t k = 0; k < inputs.size(); ++k) {
      all_events(*reqs[k]);
      const std::vector<float>& h = states[k];
      const int64_t n = int64_t(inputs[k].size());
      std::vector<double> want(size_t(D), 0.0);
      for (int64_t i = 0; i < n; ++i)
        if (pooling == Pooling::Mean || (pooling == Pooling::Last ? i == n - 1 : i == 0))
          for (int64_t d = 0; d < D; ++d) want[size_t(d)] += h[size_t(i * D + d)];
      double norm = 0;
      for (double v : want) norm += v * v;
      INFO("pooling " << pooling_name(pooling) << ", input " << k);
      REQUIRE(int64_t(reqs[k]->embedding.size()) == D);
      double got_norm = 0;
      for (int64_t d = 0; d < D; ++d) {
        CHECK(reqs[k]->embedding[size_t(d)] == Approx(want[size_t(d)] / std::sqrt(norm)).margin(1e-5));
        got_norm += double(reqs[k]->embedding[size_t(d)]) * reqs[k]->embedding[size_t(d)];
      }
      CHECK(got_norm == Approx(1.0).epsilon(1e-5));
      CHECK(reqs[k]->completion_tokens == 0);
    }
    all_events(*other);
    CHECK(other->completion_tokens > 0);
  }
}

TEST_CASE("embeddings: base64 is the little-endian float32 bytes (OpenAI's encoding_format)", "[server]") {
  CHECK(base64_floats({}).empty());
  CHECK(base64_floats({1.0f}) == "AACAPw==");
  CHECK(base64_floats({1.0f, -2.0f}) == "AACAPwAAAMA=");
  CHECK(base64_floats({1.0f, -2.0f, 0.5f}) == "AACAPwAAAMAAAAA/");
}
