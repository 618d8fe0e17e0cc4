// Architectures as declarations (models/architecture.h): a test-only variant (tests/arch_variants.h)
// and a sliding-window Llama with Llama 3.1 RoPE scaling, run by the engine's CPU forward and
// checked against an fp64 forward written here from the papers' formulas, independent of the
// engine's kernels (Gemma 2 report, section 2: sandwich norms, GeGLU, soft-capping; Qwen3:
// QK-norm; Mistral 7B, section 2: sliding-window attention; transformers'
// `_compute_llama3_parameters`: the frequency ramp).
#include <catch2/catch.hpp>

#include <cmath>
#include <map>

#include "arch_variants.h"
#include "base/error.h"
#include "base/threadpool.h"
#include "engine/model.h"
#include "engine/tp.h"
#include "test_util.h"

using namespace llmq;

namespace {

using Vec = std::vector<double>;

// The weights of a .llmq file in fp64, by tensor name.
struct RefWeights {
  ModelConfig c;
  std::map<std::string, Vec> w;
  const Vec& operator[](const std::string& name) const { return w.at(name); }
  bool has(const std::string& name) const { return w.count(name) != 0; }
};

RefWeights ref_weights(const std::string& path) {
  auto f = LlmqFile::open(path);
  RefWeights r;
  r.c = ModelConfig::from_metadata(f->meta());
  for (const TensorInfo& t : f->tensors()) {
    const int64_t cols = t.shape.back(), rows = t.numel() / cols;
    std::vector<float> x(size_t(t.numel()));
    for (int64_t i = 0; i < rows; ++i)
      dequantize_row(t.type, f->data(t) + uint64_t(i) * row_bytes(t.type, cols), x.data() + i * cols, cols);
    r.w[t.name] = Vec(x.begin(), x.end());
  }
  return r;
}

Vec rmsnorm(const double* x, const Vec& w, int64_t n, double eps) {
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const double s = 1.0 / std::sqrt(ss / double(n) + eps);
  Vec y(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) y[size_t(i)] = x[i] * s * w[size_t(i)];
  return y;
}

// y [out] = W [out, in] · x (+ b)
Vec linear(const Vec& x, const RefWeights& r, const std::string& name, int64_t out) {
  const Vec& W = r[name + ".weight"];
  const int64_t in = int64_t(x.size());
  Vec y(static_cast<size_t>(out));
  for (int64_t o = 0; o < out; ++o) {
    double s = 0;
    for (int64_t i = 0; i < in; ++i) s += W[size_t(o * in + i)] * x[size_t(i)];
    y[size_t(o)] = s + (r.has(name + ".bias") ? r[name + ".bias"][size_t(o)] : 0.0);
  }
  return y;
}

// RoPE frequencies of a layer, written from transformers' rope initialisation functions.
Vec ref_freqs(const ModelConfig& c, bool sliding) {
  const double theta = sliding && c.rope_theta_local > 0 ? c.rope_theta_local : c.rope_theta;
  Vec f;
  for (int64_t i = 0; i < c.head_dim; i += 2) f.push_back(1.0 / std::pow(theta, double(i) / double(c.head_dim)));
  if (sliding || c.rope_scaling != RopeScaling::Llama3) return f;
  for (double& inv : f) {  // _compute_llama3_parameters
    const double wavelen = 2 * M_PI / inv, low = double(c.rope_orig_ctx) / c.rope_low_freq, high = double(c.rope_orig_ctx) / c.rope_high_freq;
    const double scaled = wavelen > low ? inv / c.rope_factor : inv;
    const double smooth = (double(c.rope_orig_ctx) / wavelen - c.rope_low_freq) / (c.rope_high_freq - c.rope_low_freq);
    const bool medium = !(wavelen < high) && !(wavelen > low);
    inv = medium ? (1 - smooth) * scaled / c.rope_factor + smooth * scaled : scaled;
  }
  return f;
}

void rope(double* v, int64_t hd, double pos, const Vec& f, RopeLayout layout) {
  for (int64_t i = 0; i < hd / 2; ++i) {
    const int64_t a = layout == RopeLayout::Interleaved ? 2 * i : i, b = layout == RopeLayout::Interleaved ? 2 * i + 1 : i + hd / 2;
    const double cs = std::cos(pos * f[size_t(i)]), sn = std::sin(pos * f[size_t(i)]), x0 = v[a], x1 = v[b];
    v[a] = x0 * cs - x1 * sn, v[b] = x0 * sn + x1 * cs;
  }
}

// The reference forward below, one step at a time; x [T][dim] is the residual stream (fp64).
using Rows = std::vector<Vec>;

Rows ref_embed(const RefWeights& r, const std::vector<int32_t>& ids) {
  const int64_t D = r.c.dim;
  const Vec& E = r["token_embd.weight"];  // [vocab, dim]
  Rows x;
  for (int32_t id : ids) {
    x.emplace_back(E.begin() + id * D, E.begin() + (id + 1) * D);
    if (r.c.embed_scale)
      for (double& v : x.back()) v *= std::sqrt(double(D));
  }
  return x;
}

// The n heads of `v` ([n, hd]) QK-normed (if the model has it) and rotated to position pos.
void ref_heads(double* v, int64_t n, const RefWeights& r, const std::string& norm, double pos, const Vec& f) {
  const ModelConfig& c = r.c;
  for (int64_t hh = 0; hh < n; ++hh) {
    double* h = v + hh * c.head_dim;
    if (c.qk_norm) std::copy_n(rmsnorm(h, r[norm], c.head_dim, c.norm_eps).begin(), c.head_dim, h);
    rope(h, c.head_dim, pos, f, c.rope_layout);
  }
}

// Causal (optionally sliding-window) softmax attention of token t over positions first..t:
// att [q_dim] from q [T][q_dim], k, v [T][kv_dim].
Vec ref_attend(const ModelConfig& c, const Rows& q, const Rows& k, const Rows& v, int64_t t, int64_t first) {
  const int64_t hd = c.head_dim, G = c.n_heads / c.n_kv_heads;
  const double scale = c.attn_scale > 0 ? c.attn_scale : 1.0 / std::sqrt(double(hd));
  Vec att(static_cast<size_t>(c.q_dim()), 0.0);
  for (int64_t hh = 0; hh < c.n_heads; ++hh) {
    const int64_t kvh = hh / G;
    Vec s;
    for (int64_t p = first; p <= t; ++p) {
      double d = 0;
      for (int64_t i = 0; i < hd; ++i) d += q[size_t(t)][size_t(hh * hd + i)] * k[size_t(p)][size_t(kvh * hd + i)];
      s.push_back(d * scale);
    }
    const double m = *std::max_element(s.begin(), s.end());
    double sum = 0;
    for (double& e : s) sum += (e = std::exp(e - m));
    for (int64_t p = first; p <= t; ++p)
      for (int64_t i = 0; i < hd; ++i) att[size_t(hh * hd + i)] += s[size_t(p - first)] / sum * v[size_t(p)][size_t(kvh * hd + i)];
  }
  return att;
}

// Layer l's attention block added into x (pre-norm; Gemma's post-norm on the output).
void ref_attention_block(const RefWeights& r, int64_t l, Rows& x) {
  const ModelConfig& c = r.c;
  const int64_t T = int64_t(x.size()), D = c.dim;
  auto name = [&](const char* what) { return "blk." + std::to_string(l) + "." + what; };
  const bool sliding = c.sliding_window > 0 && (c.swa_period == 0 || (l + 1) % c.swa_period != 0);
  const Vec f = ref_freqs(c, sliding);
  Rows q(static_cast<size_t>(T)), k(q), v(q);
  for (int64_t t = 0; t < T; ++t) {
    const Vec h = rmsnorm(x[size_t(t)].data(), r[name("attn_norm.weight")], D, c.norm_eps);
    q[size_t(t)] = linear(h, r, name("attn_q"), c.q_dim());
    k[size_t(t)] = linear(h, r, name("attn_k"), c.kv_dim());
    v[size_t(t)] = linear(h, r, name("attn_v"), c.kv_dim());
    ref_heads(q[size_t(t)].data(), c.n_heads, r, name("attn_q_norm.weight"), double(t), f);
    ref_heads(k[size_t(t)].data(), c.n_kv_heads, r, name("attn_k_norm.weight"), double(t), f);
  }
  for (int64_t t = 0; t < T; ++t) {
    const int64_t first = sliding ? std::max<int64_t>(0, t - c.sliding_window + 1) : 0;
    Vec o = linear(ref_attend(c, q, k, v, t, first), r, name("attn_output"), D);
    if (c.norms == NormPlacement::PrePost) o = rmsnorm(o.data(), r[name("post_attention_norm.weight")], D, c.norm_eps);
    for (int64_t i = 0; i < D; ++i) x[size_t(t)][size_t(i)] += o[size_t(i)];
  }
}

// Layer l's gated feed-forward block (SwiGLU, or GeGLU with the tanh approximation) added into x.
void ref_ffn_block(const RefWeights& r, int64_t l, Rows& x) {
  const ModelConfig& c = r.c;
  auto name = [&](const char* what) { return "blk." + std::to_string(l) + "." + what; };
  for (Vec& xt : x) {
    const Vec h = rmsnorm(xt.data(), r[name("ffn_norm.weight")], c.dim, c.norm_eps);
    Vec g = linear(h, r, name("ffn_gate"), c.hidden_dim);
    const Vec u = linear(h, r, name("ffn_up"), c.hidden_dim);
    for (size_t i = 0; i < g.size(); ++i) {
      const double a = g[i];
      g[i] = (c.act == Activation::GeGLU ? 0.5 * a * (1 + std::tanh(std::sqrt(2 / M_PI) * (a + 0.044715 * a * a * a))) : a / (1 + std::exp(-a))) * u[i];
    }
    Vec d = linear(g, r, name("ffn_down"), c.dim);
    if (c.norms == NormPlacement::PrePost) d = rmsnorm(d.data(), r[name("post_ffw_norm.weight")], c.dim, c.norm_eps);
    for (int64_t i = 0; i < c.dim; ++i) xt[size_t(i)] += d[size_t(i)];
  }
}

// Logits [T, vocab] of every position of `ids` (fp64).
Rows ref_forward(const RefWeights& r, const std::vector<int32_t>& ids) {
  const ModelConfig& c = r.c;
  Rows x = ref_embed(r, ids);
  for (int64_t l = 0; l < c.n_layers; ++l) {
    ref_attention_block(r, l, x);
    ref_ffn_block(r, l, x);
  }
  Rows logits;
  for (const Vec& xt : x) {
    const Vec h = rmsnorm(xt.data(), r["output_norm.weight"], c.dim, c.norm_eps);
    Vec y = linear(h, r, c.tied_embeddings ? "token_embd" : "output", c.vocab_size);
    if (c.logit_softcap > 0)
      for (double& e : y) e = c.logit_softcap * std::tanh(e / c.logit_softcap);
    logits.push_back(y);
  }
  return logits;
}

double row_err(const float* got, const Vec& want) {
  double e = 0, n = 0;
  for (size_t i = 0; i < want.size(); ++i) e += (got[i] - want[i]) * (got[i] - want[i]), n += want[i] * want[i];
  return std::sqrt(e / n);
}

std::vector<int32_t> random_ids(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (auto& t : ids) t = int32_t(rng() % 512);
  return ids;
}

// The engine's logits for ids (a prefill of the first `prefill` tokens with all logits, then
// one token per forward, the decode path) against the reference; returns the worst row error.
double worst_vs_ref(const Model& m, SessionBase& s, const std::vector<int32_t>& ids, int64_t prefill, const std::vector<Vec>& ref) {
  double worst = 0;
  const int64_t V = m.config.vocab_size;
  const float* lg = s.forward(ids.data(), prefill, true);
  for (int64_t t = 0; t < prefill; ++t) worst = std::max(worst, row_err(lg + t * V, ref[size_t(t)]));
  for (size_t t = size_t(prefill); t < ids.size(); ++t) worst = std::max(worst, row_err(s.forward(&ids[t], 1), ref[t]));
  return worst;
}

}  // namespace

TEST_CASE("architecture registry: unknown names are refused, a registered variant loads", "[arch]") {
  test::register_test_architectures();
  CHECK(find_architecture("llama") != nullptr);
  CHECK(find_architecture("llama_sandwich") != nullptr);
  CHECK(find_architecture("nonesuch") == nullptr);
  Metadata m;
  test::sandwich_config().to_metadata(m);
  const ModelConfig back = ModelConfig::from_metadata(m);
  CHECK(back.norms == NormPlacement::PrePost);  // from the recipe, not from a key
  CHECK(back.qk_norm);
  CHECK(back.act == Activation::GeGLU);
  CHECK(back.logit_softcap == 30.0);
  m.set("general.architecture", std::string("nonesuch"));
  CHECK_THROWS_WITH(ModelConfig::from_metadata(m), Catch::Contains("unsupported architecture 'nonesuch'"));
  Metadata bad;
  ModelConfig c = test::sliding_config();
  c.to_metadata(bad);
  bad.set("llama.rope.freq_base", std::numeric_limits<double>::infinity());
  CHECK_THROWS_AS(ModelConfig::from_metadata(bad), UsageError);  // an infinite RoPE base would give NaNs
}

TEST_CASE("test-only sandwich architecture on the CPU = the fp64 reference within 2e-5 (prefill and decode, TP 1 and 2)", "[arch][model]") {
  const ModelConfig c = test::sandwich_config();
  const std::string path = test::random_model("sandwich_f32", c, DType::F32, 11);
  auto m = Model::load(path);
  const RefWeights r = ref_weights(path);
  const std::vector<int32_t> ids = random_ids(40, 5);
  const std::vector<Vec> ref = ref_forward(r, ids);
  ThreadPool pool(2);
  {
    Session s(*m, pool, 64, 64, 64);
    const double e = worst_vs_ref(*m, s, ids, 24, ref);
    INFO("worst row error " << e);
    CHECK(e < 2e-5);
  }
  auto unpacked = Model::load(path, true, /*pack=*/true, 0, /*tp=*/2);
  TensorParallel tp(*unpacked, 2, 2, 64);
  Session s2(tp, 64);
  const double e2 = worst_vs_ref(*unpacked, s2, ids, 24, ref);
  INFO("TP=2: worst row error " << e2);
  CHECK(e2 < 2e-5);
}

TEST_CASE("sliding-window layers with their own RoPE base and Llama 3.1 scaling = the fp64 reference within 2e-5", "[arch][model]") {
  // 300 prompt tokens: windows of 7 over attention parts of 128 positions (whole parts skipped,
  // a part cut inside), then decode steps (the split-parts path).
  const ModelConfig c = test::sliding_config();
  const std::string path = test::random_model("sliding_f32", c, DType::F32, 12);
  auto m = Model::load(path);
  CHECK(m->config.rope_tables() == 2);
  const std::vector<int32_t> ids = random_ids(310, 6);
  const std::vector<Vec> ref = ref_forward(ref_weights(path), ids);
  ThreadPool pool(2);
  for (KvType kv : {KvType::F32, KvType::BF16}) {
    Session s(*m, pool, 512, 512, 512, kv);
    const double e = worst_vs_ref(*m, s, ids, 300, ref);
    INFO("KV " << (kv == KvType::F32 ? "f32" : "bf16") << ": worst row error " << e);
    CHECK(e < (kv == KvType::F32 ? 2e-5 : 2e-2));
  }
}

TEST_CASE("qwen3 (QK-norm, no biases, head_dim beside dim / heads) = the fp64 reference within 2e-5", "[arch][model]") {
  ModelConfig c;
  c.arch = "qwen3";
  c.n_heads = 4, c.n_kv_heads = 2, c.head_dim = 32, c.dim = 64, c.hidden_dim = 96, c.n_layers = 2;  // q_dim 128 != dim
  c.vocab_size = 512, c.context_length = 256, c.rope_theta = 1000000.0, c.norm_eps = 1e-6;
  c.qk_norm = true, c.rope_layout = RopeLayout::RotateHalf, c.tied_embeddings = true;
  const std::string path = test::random_model("qwen3_f32", c, DType::F32, 13);
  auto m = Model::load(path);
  CHECK(m->config.qk_norm);
  CHECK_FALSE(m->config.attn_qkv_bias);
  const std::vector<int32_t> ids = random_ids(24, 7);
  const std::vector<Vec> ref = ref_forward(ref_weights(path), ids);
  ThreadPool pool(2);
  Session s(*m, pool, 64, 64, 64);
  const double e = worst_vs_ref(*m, s, ids, 16, ref);
  INFO("worst row error " << e);
  CHECK(e < 2e-5);
}
