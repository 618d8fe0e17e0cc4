// The whole model on real weights: stories260K converted by the real llmq-convert, checked
// against the golden outputs of an independent fp64 implementation (../shared/reference).
#include <catch2/catch.hpp>
#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <tuple>

#include "engine/generate.h"
#include "engine/model.h"
#include "engine/sampler.h"
#include "text/tokenizer.h"
#include "formats/readers/llama2c.h"
#include "test_util.h"

using namespace llmq;
using llmq::test::shared;
using llmq::test::stories;

namespace {

const nlohmann::json& golden() {
  static const nlohmann::json j = [] {
    std::ifstream in(shared("reference/stories260K_golden.json"));
    return nlohmann::json::parse(in);
  }();
  return j;
}

std::vector<int32_t> golden_ids() { return golden()["greedy_token_ids"].get<std::vector<int32_t>>(); }

// Greedy decode from BOS, one token per forward pass, `n` tokens in all (BOS included).
std::vector<int32_t> greedy(const Model& m, int64_t n) {
  ThreadPool pool(2);
  Session s(m, pool, n);
  std::vector<int32_t> ids{m.vocab.bos_id};
  while (int64_t(ids.size()) < n) {
    const float* logits = s.forward(&ids.back(), 1);
    ids.push_back(Sampler::argmax(logits, m.config.vocab_size));
  }
  return ids;
}

std::string read_file(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

TEST_CASE("F32: greedy decoding from BOS reproduces the 256 golden token ids", "[model][golden]") {
  auto m = Model::load(stories("f32"));
  const auto want = golden_ids();
  REQUIRE(want.size() == 256);
  const auto got = greedy(*m, 256);
  CHECK(got == want);
  const Tokenizer& tok = *m->tokenizer;
  CHECK(tok.decode(got) == golden()["greedy_text"].get<std::string>());
}

TEST_CASE("F32: logits of positions 0-15 match the golden rows within 1e-4", "[model][golden]") {
  auto m = Model::load(stories("f32"));
  const auto ids = golden_ids();
  const auto rows = golden()["logits_first16"];
  REQUIRE(rows.size() == 16);
  ThreadPool pool(2);
  SECTION("token by token (decode)") {
    Session s(*m, pool, 64);
    for (int p = 0; p < 16; ++p) {
      const float* logits = s.forward(&ids[size_t(p)], 1);
      double worst = 0;
      for (int v = 0; v < 512; ++v) worst = std::max(worst, std::fabs(double(logits[v]) - rows[size_t(p)][size_t(v)].get<double>()));
      INFO("position " << p << " max abs diff " << worst);
      CHECK(worst < 1e-4);
    }
  }
  SECTION("as one batch (prefill)") {
    Session s(*m, pool, 64);
    const float* logits = s.forward(ids.data(), 16, /*all_logits=*/true);
    double worst = 0;
    for (int p = 0; p < 16; ++p)
      for (int v = 0; v < 512; ++v)
        worst = std::max(worst, std::fabs(double(logits[p * 512 + v]) - rows[size_t(p)][size_t(v)].get<double>()));
    INFO("max abs diff " << worst);
    CHECK(worst < 1e-4);
  }
}

// Bit for bit, at every CPU level: every kernel computes a token's outputs with the same
// instructions whatever the batch (matmul tiles, attention parts fixed by position, vector tails),
// so a request's text does not depend on what else the server batches with it.
TEST_CASE("batched prefill equals token-by-token decoding for every type", "[model]") {
  const CpuLevel saved = cpu_level();
  for (CpuLevel level : {CpuLevel::Scalar, CpuLevel::Avx2, CpuLevel::Avx512})
  for (const char* type : {"f32", "f16", "bf16", "q8_0", "q4_0", "q4_1"}) {
    if (!cpu_level_supported(level)) continue;
    set_cpu_level(level);  // before loading: the AVX-512 level packs the weights at load
    auto m = Model::load(stories(type));
    const auto ids = golden_ids();
    ThreadPool pool(2);
    Session a(*m, pool, 128, 40), b(*m, pool, 128, 40);
    const float* batch = a.forward(ids.data(), 40, true);  // [40, 512]
    std::vector<float> all(batch, batch + 40 * 512);
    double worst = 0;
    for (int p = 0; p < 40; ++p) {
      const float* one = b.forward(&ids[size_t(p)], 1);
      for (int v = 0; v < 512; ++v) worst = std::max(worst, std::fabs(double(one[v]) - all[size_t(p * 512 + v)]));
    }
    INFO(cpu_level_name(level) << " " << type << " max abs diff " << worst);
    CHECK(worst == 0.0);
  }
  set_cpu_level(saved);
}

// Past kAttnPartTokens positions attention merges parts; in decode with fewer (token, KV head)
// items than 2 · threads each part runs as an item of its own (4 KV heads < 2 · 3 threads). The
// merged result must still equal the batched one bit for bit.
TEST_CASE("decoding past the attention part length equals batched prefill, parts split over threads", "[model]") {
  auto m = Model::load(stories("q8_0"));
  const auto ids = golden_ids();
  REQUIRE(ids.size() >= 200);
  REQUIRE(m->config.n_kv_heads < 2 * 3);
  ThreadPool pool(3);
  Session a(*m, pool, 256, 200), b(*m, pool, 256, 200);
  const float* batch = a.forward(ids.data(), 200, true);  // [200, 512]
  std::vector<float> all(batch, batch + 200 * 512);
  double worst = 0;
  for (int p = 0; p < 200; ++p) {
    const float* one = b.forward(&ids[size_t(p)], 1);
    for (int v = 0; v < 512; ++v) worst = std::max(worst, std::fabs(double(one[v]) - all[size_t(p * 512 + v)]));
  }
  INFO("max abs diff " << worst);
  CHECK(worst == 0.0);
}

// The bf16 KV cache (--kv-type bf16): the same bit-for-bit contract between decode and batched
// prefill at every level (past the attention part length too), logits close to the f32 cache's,
// and perplexity within 0.5% of it.
TEST_CASE("bf16 KV cache: decode equals batched prefill at every level - logits and perplexity near the f32 cache", "[model]") {
  const CpuLevel saved = cpu_level();
  const auto ids = golden_ids();
  REQUIRE(ids.size() >= 200);
  for (CpuLevel level : {CpuLevel::Scalar, CpuLevel::Avx2, CpuLevel::Avx512})
    for (const char* type : {"f32", "q8_0"}) {
      if (!cpu_level_supported(level)) continue;
      set_cpu_level(level);
      auto m = Model::load(stories(type));
      ThreadPool pool(3);
      Session a(*m, pool, 256, 200, 200, KvType::BF16), b(*m, pool, 256, 200, 1, KvType::BF16), f(*m, pool, 256, 200, 200);
      CHECK(a.kv_bytes() * 2 == f.kv_bytes());
      const float* batch = a.forward(ids.data(), 200, true);  // [200, 512]
      std::vector<float> all(batch, batch + 200 * 512);
      const float* ref = f.forward(ids.data(), 200, true);  // f32 cache
      double worst = 0, err2 = 0, ref2 = 0;  // ||bf16 - f32|| / ||f32|| over all logits
      for (int p = 0; p < 200; ++p) {
        const float* one = b.forward(&ids[size_t(p)], 1);
        for (int v = 0; v < 512; ++v) {
          const double x = all[size_t(p * 512 + v)], r = ref[p * 512 + v];
          worst = std::max(worst, std::fabs(double(one[v]) - x));
          err2 += (x - r) * (x - r), ref2 += r * r;
        }
      }
      const double rel = std::sqrt(err2 / ref2);
      INFO(cpu_level_name(level) << " " << type << " decode vs batched " << worst << ", bf16 vs f32 cache rel. err " << rel);
      CHECK(worst == 0.0);
      // f32 weights: 0.25% here; Q8_0 re-quantizes the activations of every matmul, which turns
      // small differences into whole quantization steps (about 1% here).
      CHECK(rel < (std::string(type) == "f32" ? 5e-3 : 3e-2));
    }
  set_cpu_level(saved);
  auto m = Model::load(stories("f32"));
  const auto tokens = m->tokenizer->encode(read_file(shared("text/tinystories-valid-head.txt")), true);
  ThreadPool pool(2);
  const double f32 = perplexity(*m, pool, tokens, 256, {}, 8).ppl;
  const double bf16 = perplexity(*m, pool, tokens, 256, {}, 8, KvType::BF16).ppl;
  INFO("ppl f32 cache " << f32 << ", bf16 cache " << bf16);
  CHECK(std::fabs(bf16 / f32 - 1) < 5e-3);
}

TEST_CASE("F16 and Q8_0: the first 64 greedy tokens equal the golden ones - Q4_0 reported", "[model][golden]") {
  const auto want = golden_ids();
  for (const char* type : {"f16", "q8_0"}) {
    auto m = Model::load(stories(type));
    const auto got = greedy(*m, 64);
    INFO(type);
    CHECK(got == std::vector<int32_t>(want.begin(), want.begin() + 64));
  }
  for (const char* type : {"bf16", "q4_0", "q4_1"}) {
    auto m = Model::load(stories(type));
    const auto got = greedy(*m, 64);
    int same = 0;
    while (same < 64 && got[size_t(same)] == want[size_t(same)]) ++same;
    WARN(type << ": the first " << same << " of 64 greedy tokens match the golden ones");
    CHECK(same >= 1);
  }
}

TEST_CASE("perplexity (llama.cpp method, ctx 256) on TinyStories: F32 6.423, F16/Q8_0 within 1%", "[model][perplexity]") {
  const std::string text = read_file(shared("text/tinystories-valid-head.txt"));
  ThreadPool pool(2);
  std::map<std::string, double> ppl;
  for (const char* type : {"f32", "f16", "q8_0"}) {
    auto m = Model::load(stories(type));
    const Tokenizer& tok = *m->tokenizer;
    const auto tokens = tok.encode(text, true);
    const PerplexityResult r = perplexity(*m, pool, tokens, 256);
    CHECK(r.chunks == 39);
    CHECK(r.scored == 4953);
    ppl[type] = r.ppl;
  }
  INFO("f32 " << ppl["f32"] << " f16 " << ppl["f16"] << " q8_0 " << ppl["q8_0"]);
  CHECK(std::fabs(ppl["f32"] / 6.4229 - 1) < 1e-3);
  CHECK(std::fabs(ppl["f16"] / ppl["f32"] - 1) < 1e-2);
  CHECK(std::fabs(ppl["q8_0"] / ppl["f32"] - 1) < 1e-2);
}

TEST_CASE("sampling with a seed is reproducible - different seeds differ", "[model][sampler]") {
  auto m = Model::load(stories("q8_0"));
  ThreadPool pool(2);
  auto run = [&](uint64_t seed) {
    SamplerParams p;
    p.temperature = 1.0f;
    p.seed = seed;
    Sampler sampler(p);
    Session s(*m, pool, 200);
    std::vector<int32_t> hist{m->vocab.bos_id};
    generate(s, sampler, hist, 100, {}, [](int32_t) { return true; });
    return hist;
  };
  const auto a = run(42), b = run(42), c = run(43);
  CHECK(a == b);
  CHECK(a != c);
  CHECK(a.size() == 101);
}

// What a GPU session relies on when it copies back only the top_k candidates: sample_top over
// the k largest logits (sorted, ties by id) draws the same tokens as sample over all of them.
TEST_CASE("sample_top on the top-k candidates draws what sample draws on all logits", "[sampler]") {
  std::mt19937_64 rng(test::fresh_seed());
  std::normal_distribution<float> nd(0.0f, 3.0f);
  struct P { float temp, top_p, min_p; int32_t top_k; };
  for (const P& p : {P{0.8f, 0.95f, 0.05f, 40}, P{1.5f, 1.0f, 0.0f, 5}, P{0.3f, 0.5f, 0.0f, 1}, P{1.0f, 0.9f, 0.1f, 600}}) {
    SamplerParams sp;
    sp.temperature = p.temp, sp.top_p = p.top_p, sp.min_p = p.min_p, sp.top_k = p.top_k, sp.seed = rng();
    Sampler all(sp), top(sp);
    REQUIRE(top.top_k_suffices());
    const int64_t n = 512;
    for (int draw = 0; draw < 200; ++draw) {
      std::vector<float> logits(static_cast<size_t>(n));
      for (auto& l : logits) l = std::round(nd(rng) * 4) / 4;  // coarse values: many ties
      std::vector<int32_t> ids(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) ids[size_t(i)] = int32_t(i);
      std::sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) { return logits[size_t(a)] > logits[size_t(b)] || (logits[size_t(a)] == logits[size_t(b)] && a < b); });
      const int64_t k = std::min<int64_t>(p.top_k, n);
      std::vector<float> vals(static_cast<size_t>(k));
      for (int64_t i = 0; i < k; ++i) vals[size_t(i)] = logits[size_t(ids[size_t(i)])];
      INFO("temp " << p.temp << " top_k " << p.top_k << " draw " << draw);
      REQUIRE(top.sample_top(ids.data(), vals.data(), k) == all.sample(logits.data(), n, {}));
    }
  }
  SamplerParams greedy;
  greedy.temperature = 0;
  CHECK(Sampler(greedy).greedy());
  greedy.repeat_penalty = 1.1f;
  CHECK(!Sampler(greedy).greedy());
  CHECK(!Sampler(greedy).top_k_suffices());
}

// llama2.c's versioned exports, made here from the real legacy weights: v1 (fp32) must give
// exactly the legacy tensors; v2 (int8 + fp32 scale per group) must dequantize to q * s.
TEST_CASE("llama2.c v1 and v2 checkpoints read the same weights as the legacy file", "[model][llama2c]") {
  const SourceModel legacy = read_llama2c(shared("models/stories260K/stories260K.bin"));
  const ModelConfig& c = legacy.config;
  std::map<std::string, std::vector<float>> w;
  for (const auto& t : legacy.tensors) {
    w[t.name].resize(size_t(t.numel()));
    t.read(w[t.name].data());
  }
  const std::string dir = test::scratch("llama2c-versions");
  auto header = [&](std::ofstream& o, int version, int group) {
    std::vector<char> h(256, 0);
    const uint32_t magic = 0x616b3432;
    const int32_t p[9] = {version, int32_t(c.dim), int32_t(c.hidden_dim), int32_t(c.n_layers), int32_t(c.n_heads),
                          int32_t(c.n_kv_heads), int32_t(c.vocab_size), int32_t(c.context_length), 0};
    std::memcpy(h.data(), &magic, 4);
    std::memcpy(h.data() + 4, p, 32);
    h[36] = 1;  // shared classifier
    std::memcpy(h.data() + 37, &group, 4);
    o.write(h.data(), 256);
  };
  auto layer_names = [&](const char* what) {
    std::vector<std::string> v;
    for (int64_t i = 0; i < c.n_layers; ++i) v.push_back(layer_tensor(i, what));
    return v;
  };
  std::vector<std::string> norms = layer_names("attn_norm"), ffn_norms = layer_names("ffn_norm");
  norms.insert(norms.end(), ffn_norms.begin(), ffn_norms.end());
  norms.push_back("output_norm.weight");
  std::vector<std::string> mats{"token_embd.weight"};
  for (const char* what : {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_down", "ffn_up"})
    for (const auto& n : layer_names(what)) mats.push_back(n);

  const std::string v1 = dir + "/v1.bin", v2 = dir + "/v2.bin";
  {
    std::ofstream o(v1, std::ios::binary);
    header(o, 1, 0);
    for (const auto& n : norms) o.write(reinterpret_cast<const char*>(w[n].data()), std::streamsize(w[n].size() * 4));
    for (const auto& n : mats) o.write(reinterpret_cast<const char*>(w[n].data()), std::streamsize(w[n].size() * 4));
  }
  const int group = 32;
  std::map<std::string, std::vector<float>> deq;
  {
    std::ofstream o(v2, std::ios::binary);
    header(o, 2, group);
    for (const auto& n : norms) o.write(reinterpret_cast<const char*>(w[n].data()), std::streamsize(w[n].size() * 4));
    for (const auto& n : mats) {
      const auto& x = w[n];
      std::vector<int8_t> q(x.size());
      std::vector<float> s(x.size() / group);
      auto& d = deq[n];
      d.resize(x.size());
      for (size_t g = 0; g < s.size(); ++g) {
        float amax = 0;
        for (int j = 0; j < group; ++j) amax = std::max(amax, std::fabs(x[g * group + j]));
        s[g] = amax / 127.0f;
        for (int j = 0; j < group; ++j) {
          q[g * group + j] = int8_t(std::lround(s[g] ? x[g * group + j] / s[g] : 0));
          d[g * group + j] = float(q[g * group + j]) * s[g];
        }
      }
      o.write(reinterpret_cast<const char*>(q.data()), std::streamsize(q.size()));
      o.write(reinterpret_cast<const char*>(s.data()), std::streamsize(s.size() * 4));
    }
  }
  for (const auto& [path, version] : {std::pair{v1, 1}, std::pair{v2, 2}}) {
    const SourceModel sm = read_llama2c(path);
    INFO(sm.format);
    CHECK(sm.config.dim == c.dim);
    CHECK(sm.config.tied_embeddings);
    CHECK(sm.tensors.size() == legacy.tensors.size());
    for (const auto& t : sm.tensors) {
      std::vector<float> got(size_t(t.numel()));
      t.read(got.data());
      const bool is_norm = t.shape.size() == 1;
      INFO(t.name);
      CHECK(got == (version == 1 || is_norm ? w.at(t.name) : deq.at(t.name)));
    }
  }
  // And the converter takes them end to end.
  CHECK(test::run(test::bin("llmq-convert") + " " + v1 + " --tokenizer " + shared("models/stories260K/tok512.bin") +
                  " -o " + dir + "/v1.llmq 2>/dev/null") == 0);
  auto m = Model::load(dir + "/v1.llmq");
  const auto want = golden_ids();
  CHECK(greedy(*m, 64) == std::vector<int32_t>(want.begin(), want.begin() + 64));
}

TEST_CASE("llmq-run one-shot streams the golden text", "[model][tools]") {
  const std::string out = test::scratch("run-oneshot") + "/out.txt";
  const std::string cmd =
      test::bin("llmq-run") + " -m " + stories("f32") + " -p 'Once upon a time' -n 40 --temp 0 -t 2 > " + out + " 2>/dev/null";
  REQUIRE(test::run(cmd) == 0);
  const std::string text = read_file(out);
  CHECK(text.rfind("Once upon a time, there was a little girl named Lily.", 0) == 0);
}

// OpenAI's logit_bias: added after the penalties; -100 bans a token, +100 forces it; a biased
// sampler never takes the argmax / top-k shortcuts (a GPU copies back all logits then).
TEST_CASE("logit_bias bans and forces tokens", "[sampler]") {
  const std::vector<float> logits{1.0f, 5.0f, 2.0f, 0.5f};
  SamplerParams p;
  p.temperature = 0.0f;
  CHECK(Sampler(p).sample(logits.data(), 4, {}) == 1);
  p.logit_bias = {{1, -100.0f}};
  Sampler banned(p);
  CHECK_FALSE(banned.greedy());
  CHECK(banned.sample(logits.data(), 4, {}) == 2);
  p.temperature = 1.0f, p.top_k = 2, p.logit_bias = {{3, 100.0f}};
  Sampler forced(p);
  CHECK_FALSE(forced.top_k_suffices());
  for (int i = 0; i < 50; ++i) CHECK(forced.sample(logits.data(), 4, {}) == 3);
}

TEST_CASE("a constraint's mask: tokens outside it are never drawn, whatever the sampling settings", "[sampler]") {
  std::mt19937_64 rng(llmq::test::fresh_seed());
  const int64_t V = 77;  // not a multiple of 32: the last mask word is partial
  std::vector<float> logits = llmq::test::gaussian(size_t(V), rng);
  std::vector<uint32_t> mask(size_t((V + 31) / 32), 0u);
  std::vector<int32_t> allowed_ids;
  for (int64_t i = 0; i < V; ++i)
    if (rng() % 5 == 0) {
      mask[size_t(i / 32)] |= 1u << (i % 32);
      allowed_ids.push_back(int32_t(i));
    }
  mask[2] |= 1u << 12, allowed_ids.push_back(76);  // the last token too
  auto in_mask = [&](int32_t id) { return std::find(allowed_ids.begin(), allowed_ids.end(), id) != allowed_ids.end(); };
  // Greedy: the best allowed logit.
  SamplerParams g;
  g.temperature = 0.0f;
  int32_t best = allowed_ids[0];
  for (int32_t id : allowed_ids)
    if (logits[size_t(id)] > logits[size_t(best)]) best = id;
  CHECK(Sampler(g).sample(logits.data(), V, {}, mask.data()) == best);
  // Every sampling path (no truncation, top-k, top-p, min-p) stays inside the mask, even when
  // the best logits overall are outside it.
  for (const auto& [k, p, mp] : {std::tuple{0, 1.0f, 0.0f}, {5, 1.0f, 0.0f}, {0, 0.9f, 0.0f}, {40, 0.95f, 0.05f}}) {
    SamplerParams s;
    s.temperature = 1.5f, s.top_k = k, s.top_p = p, s.min_p = mp, s.seed = rng();
    Sampler sampler(s);
    for (int i = 0; i < 200; ++i) CHECK(in_mask(sampler.sample(logits.data(), V, {}, mask.data())));
  }
}
