// Continuous batching: a forward pass over several sequences at different positions gives the
// same logits as running each sequence alone; the paged KV cache hands out and takes back blocks.
#include <catch2/catch.hpp>
#include <cmath>
#include <random>

#include "engine/model.h"
#include "formats/error.h"
#include "test_util.h"

using namespace llmq;

TEST_CASE("paged KV cache: reserve, truncate, remove", "[batch]") {
  LlamaConfig c;
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
