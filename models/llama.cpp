#include "models/llama.h"

#include "base/error.h"

namespace llmq {

const char* rope_layout_name(RopeLayout l) {
  return l == RopeLayout::Interleaved ? "interleaved" : "rotate_half";
}

RopeLayout rope_layout_from_name(const std::string& s) {
  if (s == "interleaved") return RopeLayout::Interleaved;
  if (s == "rotate_half") return RopeLayout::RotateHalf;
  throw MetadataError("llama.rope.layout: unknown layout '" + s + "' (interleaved | rotate_half)");
}

void LlamaConfig::validate() const {
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
  check(rope_theta > 0, "rope_theta must be positive");
}

void LlamaConfig::to_metadata(Metadata& m) const {
  m.set("general.architecture", std::string("llama"));
  m.set("llama.embedding_length", dim);
  m.set("llama.feed_forward_length", hidden_dim);
  m.set("llama.block_count", n_layers);
  m.set("llama.attention.head_count", n_heads);
  m.set("llama.attention.head_count_kv", n_kv_heads);
  m.set("llama.attention.key_length", head_dim);
  m.set("llama.vocab_size", vocab_size);
  m.set("llama.context_length", context_length);
  m.set("llama.attention.layer_norm_rms_epsilon", norm_eps);
  m.set("llama.rope.freq_base", rope_theta);
  m.set("llama.rope.layout", std::string(rope_layout_name(rope_layout)));
  m.set("llama.tied_embeddings", tied_embeddings);
  // Written only when set, so files of models without biases stay as they were.
  if (attn_qkv_bias) m.set("llama.attention.qkv_bias", true);
  if (attn_out_bias) m.set("llama.attention.output_bias", true);
}

LlamaConfig LlamaConfig::from_metadata(const Metadata& m) {
  const std::string arch = m.get_string("general.architecture");
  if (arch != "llama") throw MetadataError("unsupported architecture '" + arch + "' (this build runs: llama)");
  LlamaConfig c;
  c.dim = m.get_int("llama.embedding_length");
  c.hidden_dim = m.get_int("llama.feed_forward_length");
  c.n_layers = m.get_int("llama.block_count");
  c.n_heads = m.get_int("llama.attention.head_count");
  c.n_kv_heads = m.get_int("llama.attention.head_count_kv", c.n_heads);
  c.head_dim = m.get_int("llama.attention.key_length", c.n_heads > 0 ? c.dim / c.n_heads : 0);
  c.vocab_size = m.get_int("llama.vocab_size");
  c.context_length = m.get_int("llama.context_length");
  c.norm_eps = m.get_float("llama.attention.layer_norm_rms_epsilon");
  c.rope_theta = m.get_float("llama.rope.freq_base", 10000.0);
  c.rope_layout = rope_layout_from_name(m.get_string("llama.rope.layout", "interleaved"));
  c.tied_embeddings = m.get_bool("llama.tied_embeddings", false);
  c.attn_qkv_bias = m.get_bool("llama.attention.qkv_bias", false);
  c.attn_out_bias = m.get_bool("llama.attention.output_bias", false);
  c.validate();
  return c;
}

std::string llama_layer_tensor(int64_t layer, const char* what) {
  return "blk." + std::to_string(layer) + "." + what + ".weight";
}

std::string llama_layer_bias(int64_t layer, const char* what) {
  return "blk." + std::to_string(layer) + "." + what + ".bias";
}

std::vector<TensorSpec> llama_tensor_table(const LlamaConfig& c) {
  std::vector<TensorSpec> t;
  t.push_back({"token_embd.weight", {c.vocab_size, c.dim}});
  for (int64_t i = 0; i < c.n_layers; ++i) {
    t.push_back({llama_layer_tensor(i, "attn_norm"), {c.dim}});
    t.push_back({llama_layer_tensor(i, "attn_q"), {c.q_dim(), c.dim}});
    if (c.attn_qkv_bias) t.push_back({llama_layer_bias(i, "attn_q"), {c.q_dim()}});
    t.push_back({llama_layer_tensor(i, "attn_k"), {c.kv_dim(), c.dim}});
    if (c.attn_qkv_bias) t.push_back({llama_layer_bias(i, "attn_k"), {c.kv_dim()}});
    t.push_back({llama_layer_tensor(i, "attn_v"), {c.kv_dim(), c.dim}});
    if (c.attn_qkv_bias) t.push_back({llama_layer_bias(i, "attn_v"), {c.kv_dim()}});
    t.push_back({llama_layer_tensor(i, "attn_output"), {c.dim, c.q_dim()}});
    if (c.attn_out_bias) t.push_back({llama_layer_bias(i, "attn_output"), {c.dim}});
    t.push_back({llama_layer_tensor(i, "ffn_norm"), {c.dim}});
    t.push_back({llama_layer_tensor(i, "ffn_gate"), {c.hidden_dim, c.dim}});
    t.push_back({llama_layer_tensor(i, "ffn_up"), {c.hidden_dim, c.dim}});
    t.push_back({llama_layer_tensor(i, "ffn_down"), {c.dim, c.hidden_dim}});
  }
  t.push_back({"output_norm.weight", {c.dim}});
  if (!c.tied_embeddings) t.push_back({"output.weight", {c.vocab_size, c.dim}});
  return t;
}

}  // namespace llmq
