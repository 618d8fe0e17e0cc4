#include "models/config.h"

#include <cmath>

#include "base/error.h"
#include "models/architecture.h"

namespace llmq {

namespace {

// A name <-> enum table, for the recipe's enums.
template <class E, size_t N>
E enum_from(const std::pair<E, const char*> (&table)[N], const std::string& s, const char* what) {
  std::string names;
  for (const auto& [e, n] : table) {
    if (s == n) return e;
    names += (names.empty() ? "" : " | ") + std::string(n);
  }
  throw MetadataError(std::string(what) + ": unknown value '" + s + "' (" + names + ")");
}
template <class E, size_t N>
const char* enum_name(const std::pair<E, const char*> (&table)[N], E e) {
  for (const auto& [v, n] : table)
    if (v == e) return n;
  return "?";
}

const std::pair<RopeLayout, const char*> kRopeLayouts[] = {{RopeLayout::Interleaved, "interleaved"}, {RopeLayout::RotateHalf, "rotate_half"}};
const std::pair<RopeScaling, const char*> kRopeScalings[] = {
    {RopeScaling::None, "none"}, {RopeScaling::Linear, "linear"}, {RopeScaling::Llama3, "llama3"}, {RopeScaling::LongRope, "longrope"}};
const std::pair<NormPlacement, const char*> kNorms[] = {{NormPlacement::Pre, "pre"}, {NormPlacement::PrePost, "pre_post"}};
const std::pair<Activation, const char*> kActs[] = {{Activation::SwiGLU, "swiglu"}, {Activation::GeGLU, "geglu"}};
const std::pair<Pooling, const char*> kPoolings[] = {{Pooling::Last, "last"}, {Pooling::Mean, "mean"}, {Pooling::First, "cls"}};

}  // namespace

const char* rope_layout_name(RopeLayout l) { return enum_name(kRopeLayouts, l); }
RopeLayout rope_layout_from_name(const std::string& s) { return enum_from(kRopeLayouts, s, "rope.layout"); }
const char* rope_scaling_name(RopeScaling s) { return enum_name(kRopeScalings, s); }
RopeScaling rope_scaling_from_name(const std::string& s) { return enum_from(kRopeScalings, s, "rope.scaling.type"); }
const char* norm_placement_name(NormPlacement p) { return enum_name(kNorms, p); }
NormPlacement norm_placement_from_name(const std::string& s) { return enum_from(kNorms, s, "norm placement"); }
const char* activation_name(Activation a) { return enum_name(kActs, a); }
Activation activation_from_name(const std::string& s) { return enum_from(kActs, s, "activation"); }
const char* pooling_name(Pooling p) { return enum_name(kPoolings, p); }
Pooling pooling_from_name(const std::string& s) { return enum_from(kPoolings, s, "pooling"); }

bool ModelConfig::is_sliding(int64_t layer) const {
  return sliding_window > 0 && (swa_period <= 0 || (layer + 1) % swa_period != 0);
}

int64_t ModelConfig::window_start(int64_t layer, int64_t pos) const {
  const int64_t w = window(layer);
  return w > 0 ? std::max<int64_t>(0, pos + 1 - w) : 0;
}

int ModelConfig::rope_tables() const {
  // Both kinds of layer exist iff there is a window and a pattern of period 2 .. n_layers
  // (layer period-1 is global, layer 0 sliding); called per layer per pass, so no loop.
  const bool mixed = sliding_window > 0 && swa_period > 1 && swa_period <= n_layers;
  const bool differ = (rope_theta_local > 0 && rope_theta_local != rope_theta) || rope_scaling != RopeScaling::None ||
                      !rope_freq_factors.empty();
  return mixed && differ ? 2 : 1;
}

std::vector<double> ModelConfig::rope_freq_tables() const {
  std::vector<double> all;
  for (int t = 0; t < rope_tables(); ++t) {
    const std::vector<double> f = rope_freqs(rope_table_layer(t));
    all.insert(all.end(), f.begin(), f.end());
  }
  return all;
}

int ModelConfig::rope_table(int64_t layer) const { return rope_tables() == 2 && is_sliding(layer) ? 1 : 0; }

int64_t ModelConfig::rope_table_layer(int table) const {
  for (int64_t l = 0; l < n_layers; ++l)
    if (rope_table(l) == table) return l;
  return 0;
}

// LongRoPE multiplies cos and sin by m, so q and k each by m and q·k by m² (transformers
// `_compute_longrope_parameters`: m = √(1 + ln s / ln orig_ctx), s = context / orig_ctx).
static double longrope_attn_factor(const ModelConfig& c) {
  if (c.rope_attn_factor > 0) return c.rope_attn_factor;
  const double s = double(c.context_length) / double(c.rope_orig_ctx);
  return s <= 1.0 ? 1.0 : std::sqrt(1.0 + std::log(s) / std::log(double(c.rope_orig_ctx)));
}

float ModelConfig::softmax_scale() const {
  double s = attn_scale > 0 ? attn_scale : 1.0 / std::sqrt(double(head_dim));
  if (rope_scaling == RopeScaling::LongRope) s *= longrope_attn_factor(*this) * longrope_attn_factor(*this);
  return float(s);
}

void ModelConfig::use_context(int64_t ctx) {
  rope_use_long = rope_scaling == RopeScaling::LongRope && ctx > rope_orig_ctx;
}

float ModelConfig::embedding_multiplier() const { return embed_scale ? float(std::sqrt(double(dim))) : 1.0f; }

std::vector<double> ModelConfig::rope_freqs(int64_t layer) const {
  // Sliding-window layers of a mixed pattern (Gemma) have their own base and no scaling; a model
  // whose every layer slides (Mistral, Phi-3) scales them all.
  const bool local = is_sliding(layer) && swa_period > 0;
  const double theta = local && rope_theta_local > 0 ? rope_theta_local : rope_theta;
  const int64_t half = head_dim / 2;
  std::vector<double> f(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) f[size_t(i)] = std::pow(theta, -2.0 * double(i) / double(head_dim));
  if (!local && !rope_freq_factors.empty())
    for (int64_t i = 0; i < half; ++i) f[size_t(i)] /= double(rope_freq_factors[size_t(i)]);
  if (local || rope_scaling == RopeScaling::None) return f;
  if (rope_scaling == RopeScaling::Linear) {
    for (double& x : f) x /= rope_factor;
    return f;
  }
  if (rope_scaling == RopeScaling::LongRope) {
    const std::vector<float>& by = rope_use_long ? rope_long_factors : rope_short_factors;
    for (int64_t i = 0; i < half; ++i) f[size_t(i)] /= double(by[size_t(i)]);
    return f;
  }
  // Llama 3.1: wavelengths longer than orig_ctx / low_freq are stretched by the factor, shorter
  // than orig_ctx / high_freq kept, and the ones between interpolated smoothly.
  const double lo_wavelen = double(rope_orig_ctx) / rope_low_freq, hi_wavelen = double(rope_orig_ctx) / rope_high_freq;
  for (double& x : f) {
    const double wavelen = 2.0 * M_PI / x;
    if (wavelen < hi_wavelen) continue;
    if (wavelen > lo_wavelen) {
      x /= rope_factor;
      continue;
    }
    const double smooth = (double(rope_orig_ctx) / wavelen - rope_low_freq) / (rope_high_freq - rope_low_freq);
    x = (1.0 - smooth) * x / rope_factor + smooth * x;
  }
  return f;
}

void ModelConfig::validate() const {
  auto check = [](bool ok, const std::string& what) {
    if (!ok) throw UsageError("model hyper-parameters: " + what);
  };
  constexpr int64_t kBig = int64_t(1) << 24;
  check(dim > 0 && dim <= kBig, "dim " + std::to_string(dim) + " out of range");
  check(hidden_dim > 0 && hidden_dim <= kBig, "hidden_dim " + std::to_string(hidden_dim) + " out of range");
  check(n_layers > 0 && n_layers <= 1024, "n_layers " + std::to_string(n_layers) + " out of range");
  check(n_heads > 0 && n_heads <= 4096, "n_heads " + std::to_string(n_heads) + " out of range");
  check(n_kv_heads > 0 && n_kv_heads <= n_heads && n_heads % n_kv_heads == 0,
        "n_kv_heads " + std::to_string(n_kv_heads) + " must divide n_heads " + std::to_string(n_heads));
  check(head_dim > 0 && head_dim % 2 == 0 && head_dim <= 4096, "head_dim " + std::to_string(head_dim) + " must be even");
  check(vocab_size > 0 && vocab_size <= kBig, "vocab_size " + std::to_string(vocab_size) + " out of range");
  check(context_length > 0 && context_length <= kBig, "context_length " + std::to_string(context_length) + " out of range");
  check(norm_eps > 0 && norm_eps < 1, "norm_eps out of range");
  check(std::isfinite(rope_theta) && rope_theta > 1, "rope_theta (rope.freq_base) must be finite and above 1");
  check(rope_theta_local == 0 || (std::isfinite(rope_theta_local) && rope_theta_local > 1),
        "rope_theta_local (rope.freq_base_swa) must be finite and above 1");
  check(std::isfinite(rope_factor) && rope_factor >= 1 && rope_factor <= 1024, "rope scaling factor out of [1, 1024]");
  check(rope_scaling != RopeScaling::Llama3 ||
            (rope_orig_ctx > 0 && std::isfinite(rope_low_freq) && std::isfinite(rope_high_freq) && rope_low_freq > 0 &&
             rope_high_freq > rope_low_freq),
        "llama3 rope scaling needs 0 < low_freq_factor < high_freq_factor and an original context");
  auto factors_ok = [&](const std::vector<float>& v) {
    if (int64_t(v.size()) != head_dim / 2) return false;
    for (float x : v)
      if (!(std::isfinite(x) && x >= 1e-3f && x <= 1e6f)) return false;
    return true;
  };
  check(rope_freq_factors.empty() || factors_ok(rope_freq_factors), "rope.freq_factors must hold head_dim/2 finite positive values");
  if (rope_scaling == RopeScaling::LongRope) {
    check(factors_ok(rope_short_factors) && factors_ok(rope_long_factors),
          "longrope needs short and long factor lists of head_dim/2 finite positive values");
    check(rope_orig_ctx > 0 && rope_orig_ctx <= kBig, "longrope needs an original context length");
    check(std::isfinite(rope_attn_factor) && rope_attn_factor >= 0 && rope_attn_factor <= 16, "longrope attention factor out of [0, 16]");
  }
  check(std::isfinite(attn_scale) && attn_scale >= 0 && attn_scale <= 16, "attention scale out of [0, 16]");
  check(sliding_window >= 0 && sliding_window <= kBig, "sliding_window out of range");
  check(swa_period >= 0 && swa_period <= n_layers, "sliding_window_pattern out of [0, n_layers]");
  check(std::isfinite(logit_softcap) && logit_softcap >= 0, "final_logit_softcapping must be finite and >= 0");
}

void ModelConfig::to_metadata(Metadata& m) const {
  const std::string p = arch + ".";
  m.set("general.architecture", arch);
  m.set(p + "embedding_length", dim);
  m.set(p + "feed_forward_length", hidden_dim);
  m.set(p + "block_count", n_layers);
  m.set(p + "attention.head_count", n_heads);
  m.set(p + "attention.head_count_kv", n_kv_heads);
  m.set(p + "attention.key_length", head_dim);
  m.set(p + "vocab_size", vocab_size);
  m.set(p + "context_length", context_length);
  m.set(p + "attention.layer_norm_rms_epsilon", norm_eps);
  m.set(p + "rope.freq_base", rope_theta);
  m.set(p + "rope.layout", std::string(rope_layout_name(rope_layout)));
  m.set(p + "tied_embeddings", tied_embeddings);
  // Written only when set, so files of models without them stay as they were.
  if (attn_qkv_bias) m.set(p + "attention.qkv_bias", true);
  if (attn_out_bias) m.set(p + "attention.output_bias", true);
  if (rope_theta_local > 0) m.set(p + "rope.freq_base_swa", rope_theta_local);
  if (rope_scaling != RopeScaling::None) {
    m.set(p + "rope.scaling.type", std::string(rope_scaling_name(rope_scaling)));
    m.set(p + "rope.scaling.factor", rope_factor);
  }
  if (!rope_freq_factors.empty()) m.set(p + "rope.freq_factors", rope_freq_factors);
  if (rope_scaling == RopeScaling::LongRope) {
    m.set(p + "rope.scaling.original_context_length", rope_orig_ctx);
    m.set(p + "rope.scaling.short_factor", rope_short_factors);
    m.set(p + "rope.scaling.long_factor", rope_long_factors);
    if (rope_attn_factor > 0) m.set(p + "rope.scaling.attn_factor", rope_attn_factor);
  }
  if (rope_scaling == RopeScaling::Llama3) {
    m.set(p + "rope.scaling.original_context_length", rope_orig_ctx);
    m.set(p + "rope.scaling.low_freq_factor", rope_low_freq);
    m.set(p + "rope.scaling.high_freq_factor", rope_high_freq);
  }
  if (attn_scale > 0) m.set(p + "attention.scale", attn_scale);
  if (sliding_window > 0) m.set(p + "attention.sliding_window", sliding_window);
  if (swa_period > 0) m.set(p + "attention.sliding_window_pattern", swa_period);
  if (logit_softcap > 0) m.set(p + "final_logit_softcapping", logit_softcap);
  if (pooling != Pooling::Last) m.set(p + "pooling_type", int64_t(pooling == Pooling::Mean ? 1 : 2));
}

ModelConfig ModelConfig::from_metadata(const Metadata& m) {
  ModelConfig c;
  c.arch = m.get_string("general.architecture");
  const Architecture* a = find_architecture(c.arch);
  if (!a) throw MetadataError("unsupported architecture '" + c.arch + "' (this build runs: " + architecture_names() + ")");
  const std::string p = c.arch + ".";
  c.dim = m.get_int(p + "embedding_length");
  c.hidden_dim = m.get_int(p + "feed_forward_length");
  c.n_layers = m.get_int(p + "block_count");
  c.n_heads = m.get_int(p + "attention.head_count");
  c.n_kv_heads = m.get_int(p + "attention.head_count_kv", c.n_heads);
  c.head_dim = m.get_int(p + "attention.key_length", c.n_heads > 0 ? c.dim / c.n_heads : 0);
  c.vocab_size = m.get_int(p + "vocab_size");
  c.context_length = m.get_int(p + "context_length");
  c.norm_eps = m.get_float(p + "attention.layer_norm_rms_epsilon");
  c.rope_theta = m.get_float(p + "rope.freq_base", 10000.0);
  c.rope_theta_local = m.get_float(p + "rope.freq_base_swa", 0.0);
  c.rope_layout = rope_layout_from_name(m.get_string(p + "rope.layout", "interleaved"));
  c.rope_scaling = rope_scaling_from_name(m.get_string(p + "rope.scaling.type", "none"));
  c.rope_factor = m.get_float(p + "rope.scaling.factor", 1.0);
  c.rope_orig_ctx = m.get_int(p + "rope.scaling.original_context_length", c.rope_orig_ctx);
  c.rope_low_freq = m.get_float(p + "rope.scaling.low_freq_factor", c.rope_low_freq);
  c.rope_high_freq = m.get_float(p + "rope.scaling.high_freq_factor", c.rope_high_freq);
  if (c.rope_scaling == RopeScaling::LongRope) {
    c.rope_short_factors = m.get_f32_array(p + "rope.scaling.short_factor");
    c.rope_long_factors = m.get_f32_array(p + "rope.scaling.long_factor");
    c.rope_attn_factor = m.get_float(p + "rope.scaling.attn_factor", 0.0);
  }
  if (m.has(p + "rope.freq_factors")) c.rope_freq_factors = m.get_f32_array(p + "rope.freq_factors");
  c.tied_embeddings = m.get_bool(p + "tied_embeddings", false);
  c.attn_qkv_bias = m.get_bool(p + "attention.qkv_bias", false);
  c.attn_out_bias = m.get_bool(p + "attention.output_bias", false);
  c.attn_scale = m.get_float(p + "attention.scale", 0.0);
  c.sliding_window = m.get_int(p + "attention.sliding_window", 0);
  c.swa_period = m.get_int(p + "attention.sliding_window_pattern", 0);
  c.logit_softcap = m.get_float(p + "final_logit_softcapping", 0.0);
  // GGUF pooling_type: 0 none (per-token), 1 mean, 2 cls, 3 last, 4 rank; per-token and rank
  // outputs are not what /v1/embeddings gives, so they read as the default.
  const int64_t pool = m.get_int(p + "pooling_type", 3);
  c.pooling = pool == 1 ? Pooling::Mean : pool == 2 ? Pooling::First : Pooling::Last;
  a->recipe(m, c);
  c.validate();
  return c;
}

std::string layer_tensor(int64_t layer, const char* what) { return "blk." + std::to_string(layer) + "." + what + ".weight"; }

std::string layer_bias(int64_t layer, const char* what) { return "blk." + std::to_string(layer) + "." + what + ".bias"; }

std::vector<TensorSpec> tensor_table(const ModelConfig& c) {
  std::vector<TensorSpec> t;
  const bool post = c.norms == NormPlacement::PrePost;
  t.push_back({"token_embd.weight", {c.vocab_size, c.dim}});
  for (int64_t i = 0; i < c.n_layers; ++i) {
    t.push_back({layer_tensor(i, "attn_norm"), {c.dim}});
    t.push_back({layer_tensor(i, "attn_q"), {c.q_dim(), c.dim}});
    if (c.attn_qkv_bias) t.push_back({layer_bias(i, "attn_q"), {c.q_dim()}});
    t.push_back({layer_tensor(i, "attn_k"), {c.kv_dim(), c.dim}});
    if (c.attn_qkv_bias) t.push_back({layer_bias(i, "attn_k"), {c.kv_dim()}});
    t.push_back({layer_tensor(i, "attn_v"), {c.kv_dim(), c.dim}});
    if (c.attn_qkv_bias) t.push_back({layer_bias(i, "attn_v"), {c.kv_dim()}});
    if (c.qk_norm) t.push_back({layer_tensor(i, "attn_q_norm"), {c.head_dim}});
    if (c.qk_norm) t.push_back({layer_tensor(i, "attn_k_norm"), {c.head_dim}});
    t.push_back({layer_tensor(i, "attn_output"), {c.dim, c.q_dim()}});
    if (c.attn_out_bias) t.push_back({layer_bias(i, "attn_output"), {c.dim}});
    if (post) t.push_back({layer_tensor(i, "post_attention_norm"), {c.dim}});
    t.push_back({layer_tensor(i, "ffn_norm"), {c.dim}});
    t.push_back({layer_tensor(i, "ffn_gate"), {c.hidden_dim, c.dim}});
    t.push_back({layer_tensor(i, "ffn_up"), {c.hidden_dim, c.dim}});
    t.push_back({layer_tensor(i, "ffn_down"), {c.dim, c.hidden_dim}});
    if (post) t.push_back({layer_tensor(i, "post_ffw_norm"), {c.dim}});
  }
  t.push_back({"output_norm.weight", {c.dim}});
  if (!c.tied_embeddings) t.push_back({"output.weight", {c.vocab_size, c.dim}});
  return t;
}

}  // namespace llmq
