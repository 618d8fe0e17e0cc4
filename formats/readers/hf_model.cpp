#include "formats/readers/hf_model.h"
#include "base/mapped_file.h"

#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "base/error.h"
#include "formats/readers/hf_tokenizer.h"
#include "formats/quant.h"
#include "formats/readers/safetensors.h"

namespace llmq {

namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

std::string dims_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// --- config.json ---------------------------------------------------------------------------

int64_t config_int(const std::string& path, const json& c, const char* key, std::optional<int64_t> fallback) {
  auto it = c.find(key);
  if (it == c.end() || it->is_null()) {
    if (fallback) return *fallback;
    throw FileError(path, std::string("missing key \"") + key + "\"");
  }
  if (!it->is_number_integer() || (it->is_number_unsigned() && it->get<uint64_t>() > (uint64_t(1) << 40)) ||
      it->get<int64_t>() <= 0 || it->get<int64_t>() > (int64_t(1) << 40))
    throw FileError(path, std::string("\"") + key + "\" is " + it->dump() + ", not a positive integer in range");
  return it->get<int64_t>();
}

double config_float(const std::string& path, const json& c, const char* key, std::optional<double> fallback) {
  auto it = c.find(key);
  if (it == c.end() || it->is_null()) {
    if (fallback) return *fallback;
    throw FileError(path, std::string("missing key \"") + key + "\"");
  }
  if (!it->is_number() || !std::isfinite(it->get<double>()) || it->get<double>() <= 0)
    throw FileError(path, std::string("\"") + key + "\" is " + it->dump() + ", not a positive number");
  return it->get<double>();
}

bool config_bool(const std::string& path, const json& c, const char* key, bool fallback) {
  auto it = c.find(key);
  if (it == c.end() || it->is_null()) return fallback;
  if (!it->is_boolean()) throw FileError(path, std::string("\"") + key + "\" is " + it->dump() + ", not true or false");
  return it->get<bool>();
}

// The model family: config.json's model_type, else its first architecture. The families read
// and the llmq architecture each becomes (models/architecture.h).
struct Family {
  const char* model_type;    // config.json's model_type
  const char* hf_class;      // its architectures[0]
  const char* arch;          // llmq's
};
constexpr Family kFamilies[] = {
    {"llama", "LlamaForCausalLM", "llama"},   {"mistral", "MistralForCausalLM", "mistral"},
    {"qwen2", "Qwen2ForCausalLM", "qwen2"},   {"qwen3", "Qwen3ForCausalLM", "qwen3"},
    {"gemma3_text", "Gemma3ForCausalLM", "gemma3"}, {"phi3", "Phi3ForCausalLM", "phi3"},
};

std::string model_family(const std::string& path, const json& c) {
  auto mt = c.find("model_type");
  std::string names;
  for (const Family& f : kFamilies) names += (names.empty() ? "" : ", ") + std::string(f.model_type);
  if (mt != c.end() && !mt->is_null()) {
    if (!mt->is_string()) throw FileError(path, "\"model_type\" is not a string");
    for (const Family& f : kFamilies)
      if (*mt == f.model_type) return f.model_type;
    throw FileError(path, "model_type '" + mt->get<std::string>() + "' is not supported (" + names + " are read)");
  }
  auto ar = c.find("architectures");
  if (ar == c.end() || !ar->is_array() || ar->empty() || !(*ar)[0].is_string())
    throw FileError(path, "neither \"model_type\" nor \"architectures\" says what model this is");
  for (const Family& f : kFamilies)
    if ((*ar)[0] == f.hf_class) return f.model_type;
  throw FileError(path, "architecture '" + (*ar)[0].get<std::string>() + "' is not supported (" + names + " are read)");
}

const char* family_arch(const std::string& family) {
  for (const Family& f : kFamilies)
    if (family == f.model_type) return f.arch;
  return "llama";
}

// A list of positive numbers (LongRoPE's factors) of length n.
std::vector<float> config_factors(const std::string& path, const json& j, const char* key, int64_t n) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_array() || int64_t(it->size()) != n)
    throw FileError(path, std::string("rope scaling \"") + key + "\" must be a list of head_dim/2 = " + std::to_string(n) + " numbers");
  std::vector<float> v;
  for (const json& x : *it) {
    if (!x.is_number() || !std::isfinite(x.get<double>()) || x.get<double>() <= 0)
      throw FileError(path, std::string("rope scaling \"") + key + "\" holds " + x.dump() + ", not a positive number");
    v.push_back(x.get<float>());
  }
  return v;
}

// One RoPE parameter set (transformers 5's rope_parameters entry, or the older rope_scaling
// object with rope_theta beside it) applied to cfg: the base and the scaling of the global layers.
void read_rope_params(const std::string& path, const json& p, const json& top, ModelConfig& cfg) {
  if (p.contains("rope_theta")) cfg.rope_theta = config_float(path, p, "rope_theta", std::nullopt);
  std::string type = "default";
  for (const char* k : {"rope_type", "type"})
    if (p.contains(k) && p[k].is_string()) type = p[k].get<std::string>();
  if (p.contains("partial_rotary_factor") && p["partial_rotary_factor"] != 1.0)
    throw FileError(path, "partial_rotary_factor " + p["partial_rotary_factor"].dump() + " is not supported (only 1)");
  if (type == "default") return;
  if (type == "linear") {
    cfg.rope_scaling = RopeScaling::Linear;
    cfg.rope_factor = config_float(path, p, "factor", std::nullopt);
  } else if (type == "llama3") {
    cfg.rope_scaling = RopeScaling::Llama3;
    cfg.rope_factor = config_float(path, p, "factor", std::nullopt);
    cfg.rope_low_freq = config_float(path, p, "low_freq_factor", std::nullopt);
    cfg.rope_high_freq = config_float(path, p, "high_freq_factor", std::nullopt);
    cfg.rope_orig_ctx = config_int(path, p, "original_max_position_embeddings", std::nullopt);
  } else if (type == "longrope" || type == "su") {
    cfg.rope_scaling = RopeScaling::LongRope;
    cfg.rope_orig_ctx = config_int(path, top, "original_max_position_embeddings",
                                   config_int(path, p, "original_max_position_embeddings", cfg.context_length));
    cfg.rope_short_factors = config_factors(path, p, "short_factor", cfg.head_dim / 2);
    cfg.rope_long_factors = config_factors(path, p, "long_factor", cfg.head_dim / 2);
    cfg.rope_attn_factor = p.contains("attention_factor") && !p["attention_factor"].is_null()
                               ? config_float(path, p, "attention_factor", std::nullopt)
                               : 0.0;
  } else {
    throw FileError(path, "RoPE scaling type '" + type + "' is not supported (linear, llama3, longrope)");
  }
}

// RoPE: transformers 5's rope_parameters (Gemma 3: one set per layer type), else rope_theta,
// rope_scaling and Gemma's rope_local_base_freq.
void read_rope(const std::string& path, const json& c, const std::string& family, ModelConfig& cfg) {
  const bool gemma = family == "gemma3_text";
  auto rp = c.find("rope_parameters");
  if (rp != c.end() && rp->is_object()) {
    if (gemma) {
      if (rp->contains("full_attention")) read_rope_params(path, (*rp)["full_attention"], c, cfg);
      if (rp->contains("sliding_attention")) {
        ModelConfig local;
        read_rope_params(path, (*rp)["sliding_attention"], c, local);
        if (local.rope_scaling != RopeScaling::None) throw FileError(path, "RoPE scaling on sliding-window layers is not supported");
        cfg.rope_theta_local = local.rope_theta;
      }
    } else {
      read_rope_params(path, *rp, c, cfg);
    }
    return;
  }
  cfg.rope_theta = config_float(path, c, "rope_theta", gemma ? 1e6 : 10000.0);
  if (gemma) cfg.rope_theta_local = config_float(path, c, "rope_local_base_freq", 10000.0);
  auto rs = c.find("rope_scaling");
  if (rs != c.end() && !rs->is_null()) {
    if (!rs->is_object()) throw FileError(path, "\"rope_scaling\" is not an object");
    json p = *rs;
    p.erase("rope_theta");  // the top-level rope_theta is the base
    read_rope_params(path, p, c, cfg);
  }
}

// Which layers of a Gemma 3 slide: layer_types, else sliding_window_pattern (default 6: five
// local layers, then a global one). llmq's recipe takes a period, so layer_types must be one.
int64_t gemma_swa_period(const std::string& path, const json& c, int64_t n_layers) {
  auto lt = c.find("layer_types");
  if (lt == c.end() || lt->is_null()) return config_int(path, c, "sliding_window_pattern", 6);
  if (!lt->is_array() || int64_t(lt->size()) != n_layers)
    throw FileError(path, "\"layer_types\" must list num_hidden_layers layer types");
  int64_t period = 0;
  for (int64_t l = 0; l < n_layers; ++l)
    if ((*lt)[size_t(l)] == "full_attention") {
      period = l + 1;
      break;
    }
  if (period == 0) period = n_layers + 1;  // no global layer at all: a period longer than the model
  for (int64_t l = 0; l < n_layers; ++l) {
    const bool global = (l + 1) % period == 0;
    if ((*lt)[size_t(l)] != (global ? "full_attention" : "sliding_attention"))
      throw FileError(path, "\"layer_types\" is not a repeating pattern of sliding layers then one full layer");
  }
  return std::min(period, n_layers);
}

// A key that must be absent or null (features llmq does not implement).
void refuse_key(const std::string& path, const json& c, const char* key) {
  if (c.contains(key) && !c[key].is_null() && c[key] != false)
    throw FileError(path, std::string("\"") + key + "\" " + c[key].dump() + " is not supported");
}

ModelConfig read_config(const std::string& path, const json& c, const std::string& family) {
  ModelConfig cfg;
  const bool gemma = family == "gemma3_text";
  cfg.arch = family_arch(family);
  cfg.dim = config_int(path, c, "hidden_size", std::nullopt);
  cfg.hidden_dim = config_int(path, c, "intermediate_size", std::nullopt);
  cfg.n_layers = config_int(path, c, "num_hidden_layers", std::nullopt);
  cfg.n_heads = config_int(path, c, "num_attention_heads", std::nullopt);
  cfg.n_kv_heads = config_int(path, c, "num_key_value_heads", cfg.n_heads);
  cfg.head_dim = config_int(path, c, "head_dim", cfg.dim / cfg.n_heads);
  cfg.vocab_size = config_int(path, c, "vocab_size", std::nullopt);
  cfg.context_length = config_int(path, c, "max_position_embeddings", std::nullopt);
  cfg.norm_eps = config_float(path, c, "rms_norm_eps", std::nullopt);
  cfg.tied_embeddings = config_bool(path, c, "tie_word_embeddings", gemma);
  cfg.rope_layout = RopeLayout::RotateHalf;
  read_rope(path, c, family, cfg);

  const char* act_key = gemma ? "hidden_activation" : "hidden_act";
  const char* act = gemma ? "gelu_pytorch_tanh" : "silu";
  if (c.contains(act_key) && c[act_key] != act)
    throw FileError(path, std::string(act_key) + " " + c[act_key].dump() + " is not supported (only " + act + ")");
  if (config_bool(path, c, "mlp_bias", false)) throw FileError(path, "mlp_bias is not supported");
  if (family == "qwen2" || family == "qwen3")
    if (config_bool(path, c, "use_sliding_window", false)) throw FileError(path, "use_sliding_window is not supported");
  // Mistral 7B v0.1 and Phi-3: every layer attends over a window (Mistral v0.2 on: null).
  if ((family == "mistral" || family == "phi3" || gemma) && c.contains("sliding_window") && !c["sliding_window"].is_null())
    cfg.sliding_window = config_int(path, c, "sliding_window", std::nullopt);
  if (gemma) {
    cfg.swa_period = gemma_swa_period(path, c, cfg.n_layers);
    cfg.attn_scale = 1.0 / std::sqrt(config_float(path, c, "query_pre_attn_scalar", double(cfg.head_dim)));
    cfg.logit_softcap = c.contains("final_logit_softcapping") && !c["final_logit_softcapping"].is_null()
                            ? config_float(path, c, "final_logit_softcapping", std::nullopt)
                            : 0.0;
    refuse_key(path, c, "attn_logit_softcapping");
    refuse_key(path, c, "use_bidirectional_attention");
  }
  // The architecture's recipe (norm placement, activation, QK-norm, ...), as a .llmq loads it.
  try {
    Metadata m;
    cfg.to_metadata(m);
    const int64_t period = cfg.swa_period;
    cfg = ModelConfig::from_metadata(m);
    cfg.swa_period = period;
  } catch (const std::exception& e) {
    throw FileError(path, e.what());
  }
  return cfg;
}

// --- tensor names ----------------------------------------------------------------------------

// A checkpoint's per-layer tensor names (after "model.layers.<i>.") -> ours. Phi-3's fused
// projections map to attn_qkv and ffn_gate_up, which read_hf_model splits by rows.
const std::map<std::string, std::string>& layer_names(const std::string& family) {
  static const std::map<std::string, std::string> llama = {
      {"input_layernorm.weight", "attn_norm.weight"},
      {"self_attn.q_proj.weight", "attn_q.weight"},
      {"self_attn.k_proj.weight", "attn_k.weight"},
      {"self_attn.v_proj.weight", "attn_v.weight"},
      {"self_attn.o_proj.weight", "attn_output.weight"},
      {"self_attn.q_proj.bias", "attn_q.bias"},
      {"self_attn.k_proj.bias", "attn_k.bias"},
      {"self_attn.v_proj.bias", "attn_v.bias"},
      {"self_attn.o_proj.bias", "attn_output.bias"},
      {"post_attention_layernorm.weight", "ffn_norm.weight"},
      {"mlp.gate_proj.weight", "ffn_gate.weight"},
      {"mlp.up_proj.weight", "ffn_up.weight"},
      {"mlp.down_proj.weight", "ffn_down.weight"},
      {"self_attn.rotary_emb.inv_freq", ""},
  };
  auto with = [](std::map<std::string, std::string> m, const std::map<std::string, std::string>& changes) {
    for (const auto& [k, v] : changes) m[k] = v;
    return m;
  };
  static const auto qwen3 = with(llama, {{"self_attn.q_norm.weight", "attn_q_norm.weight"}, {"self_attn.k_norm.weight", "attn_k_norm.weight"}});
  static const auto gemma = with(qwen3, {{"post_attention_layernorm.weight", "post_attention_norm.weight"},
                                         {"pre_feedforward_layernorm.weight", "ffn_norm.weight"},
                                         {"post_feedforward_layernorm.weight", "post_ffw_norm.weight"}});
  static const auto phi3 = with(llama, {{"self_attn.qkv_proj.weight", "attn_qkv.weight"}, {"mlp.gate_up_proj.weight", "ffn_gate_up.weight"}});
  return family == "qwen3" ? qwen3 : family == "gemma3_text" ? gemma : family == "phi3" ? phi3 : llama;
}

// Where an HF tensor goes: our name, or "" for a tensor that is ignored (rotary buffers).
// nullopt for a tensor that has no place in the family's model.
std::optional<std::string> our_name(const std::string& hf, int64_t n_layers, const std::string& family) {
  if (hf == "model.embed_tokens.weight") return "token_embd.weight";
  if (hf == "model.norm.weight") return "output_norm.weight";
  if (hf == "lm_head.weight") return "output.weight";
  const std::string prefix = "model.layers.";
  if (hf.compare(0, prefix.size(), prefix) != 0) return std::nullopt;
  size_t p = prefix.size();
  int64_t layer = 0;
  const size_t digits_at = p;
  while (p < hf.size() && hf[p] >= '0' && hf[p] <= '9' && p - digits_at < 6) layer = layer * 10 + (hf[p++] - '0');
  if (p == digits_at || p >= hf.size() || hf[p] != '.' || layer >= n_layers ||
      (hf[digits_at] == '0' && p - digits_at > 1))
    return std::nullopt;
  const auto& per_layer = layer_names(family);
  auto it = per_layer.find(hf.substr(p + 1));
  if (it == per_layer.end()) return std::nullopt;
  if (it->second.empty()) return std::string();
  return "blk." + std::to_string(layer) + "." + it->second;
}

// The checkpoint's name for one of ours (the inverse of our_name), for messages.
std::string hf_name_of(const std::string& ours, const std::string& family) {
  static const std::map<std::string, std::string> global = {{"token_embd.weight", "model.embed_tokens.weight"},
                                                             {"output_norm.weight", "model.norm.weight"},
                                                             {"output.weight", "lm_head.weight"}};
  if (auto it = global.find(ours); it != global.end()) return it->second;
  const size_t dot = ours.find('.', 4);
  if (ours.rfind("blk.", 0) == 0 && dot != std::string::npos) {
    std::string what = ours.substr(dot + 1);
    if (family == "phi3" && (what == "attn_q.weight" || what == "attn_k.weight" || what == "attn_v.weight")) what = "attn_qkv.weight";
    if (family == "phi3" && (what == "ffn_gate.weight" || what == "ffn_up.weight")) what = "ffn_gate_up.weight";
    for (const auto& [hf, o] : layer_names(family))
      if (o == what) return "model.layers." + ours.substr(4, dot - 4) + "." + hf;
  }
  return ours;
}

// One tensor found in the checkpoint.
struct Found {
  std::string hf_name;
  const SafetensorsTensor* t = nullptr;
  std::shared_ptr<SafetensorsFile> file;
};

// Opens the weights: model.safetensors, else the index and its shards. Returns HF name ->
// tensor; *weights_path is the file to name when a tensor is missing.
std::map<std::string, Found> open_weights(const std::string& dir, std::string* weights_path, int* n_files) {
  std::map<std::string, Found> out;
  std::error_code ec;
  const std::string single = dir + "/model.safetensors", index = dir + "/model.safetensors.index.json";
  if (fs::exists(single, ec)) {
    *weights_path = single;
    *n_files = 1;
    auto f = SafetensorsFile::open(single);
    for (const auto& t : f->tensors()) out[t.name] = Found{t.name, &t, f};
    return out;
  }
  if (!fs::exists(index, ec)) {
    const bool pt = fs::exists(dir + "/pytorch_model.bin", ec) || fs::exists(dir + "/pytorch_model.bin.index.json", ec);
    throw FileError(dir, std::string("no model.safetensors or model.safetensors.index.json") +
                             (pt ? " (PyTorch .bin checkpoints are not read: convert them to safetensors)" : ""));
  }
  *weights_path = index;
  const json j = read_json_file(index);
  if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object() || j["weight_map"].empty())
    throw FileError(index, "no \"weight_map\" object naming the shards");
  std::map<std::string, std::shared_ptr<SafetensorsFile>> shards;
  for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
    if (!it.value().is_string()) throw FileError(index, "weight_map entry '" + it.key() + "' is not a file name");
    const std::string file = it.value().get<std::string>();
    if (file.empty() || file == "." || file == ".." || file.find('/') != std::string::npos ||
        file.find('\\') != std::string::npos || file.find('\0') != std::string::npos)
      throw FileError(index, "weight_map names '" + file + "', which is not a plain file name in the directory");
    auto& shard = shards[file];
    if (!shard) {
      const std::string path = dir + "/" + file;
      if (!fs::exists(path, ec))
        throw FileError(index, "shard '" + file + "' (holding '" + it.key() + "') does not exist");
      shard = SafetensorsFile::open(path);
    }
    const SafetensorsTensor* t = shard->find(it.key());
    if (!t) throw FileError(shard->path(), "tensor '" + it.key() + "', which the index places in this file, is not in it");
    out[it.key()] = Found{it.key(), t, shard};
  }
  *n_files = int(shards.size());
  return out;
}

// A tensor of ours inside a checkpoint tensor: all of it, or rows [row0, row0 + rows) of a fused
// projection (Phi-3's qkv_proj and gate_up_proj).
struct Piece {
  const Found* f = nullptr;
  int64_t row0 = 0, rows = -1;  // rows < 0: the whole tensor
};

// Our tensor `name` of `shape` from piece p. plus_one: the values + 1 (Gemma's RMSNorm weights,
// which the checkpoint stores as w for a norm that multiplies by 1 + w; llmq's files hold 1 + w
// as llama.cpp's do), which leaves no raw copy.
SourceTensor make_tensor(const std::string& name, const std::vector<int64_t>& shape, const Piece& p, bool plus_one) {
  const SafetensorsTensor* t = p.f->t;
  auto keep = p.f->file;
  const int64_t esize = t->dtype == "F32" ? 4 : 2;
  const int64_t row_elems = t->shape.empty() ? 1 : t->numel() / t->shape[0];
  const uint8_t* data = t->data + (p.rows < 0 ? 0 : p.row0 * row_elems * esize);
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  SourceTensor st;
  st.name = name;
  st.shape = shape;
  st.raw_type = t->dtype == "F32" ? DType::F32 : t->dtype == "F16" ? DType::F16 : DType::BF16;  // checked by the caller
  st.raw = plus_one ? nullptr : data;
  st.release = [keep, data, n, esize] { keep->release(data, uint64_t(n * esize)); };
  // Converted from the mapping in chunks whose pages are dropped again as soon as they are
  // converted, so the resident set holds the fp32 output and one chunk of the source.
  const bool half = t->dtype == "F16";
  st.read = [keep, data, n, esize, half, plus_one](float* out) {
    const int64_t chunk = (int64_t(4) << 20) / esize;  // 4 MiB of source bytes
    for (int64_t i0 = 0; i0 < n; i0 += chunk) {
      const int64_t m = std::min(chunk, n - i0);
      const uint8_t* p = data + i0 * esize;
      if (esize == 4) {
        std::memcpy(out + i0, p, size_t(m) * 4);
      } else {
        for (int64_t i = 0; i < m; ++i) {
          uint16_t h;
          std::memcpy(&h, p + 2 * i, 2);
          out[i0 + i] = half ? fp16_to_fp32(h) : bf16_to_fp32(h);
        }
      }
      if (plus_one)
        for (int64_t i = 0; i < m; ++i) out[i0 + i] += 1.0f;
      keep->release(p, uint64_t(m * esize));
    }
  };
  return st;
}

// Phi-3's fused projections as our separate ones: qkv_proj [q + 2 kv, dim] -> attn_q, attn_k,
// attn_v; gate_up_proj [2 hidden, dim] -> ffn_gate (the first half, transformers' Phi3MLP
// `chunk(2)`), ffn_up. Throws FileError when a fused tensor's rows do not add up.
void split_fused(std::map<std::string, Piece>& ours, const ModelConfig& c) {
  auto split = [&](const std::string& fused, const std::vector<std::pair<const char*, int64_t>>& parts) {
    auto it = ours.find(fused);
    if (it == ours.end()) return;
    const Piece whole = it->second;
    int64_t total = 0;
    for (const auto& pr : parts) total += pr.second;
    if (whole.f->t->shape.size() != 2 || whole.f->t->shape[0] != total)
      throw FileError(whole.f->file->path(), "tensor '" + whole.f->hf_name + "' has shape " + dims_text(whole.f->t->shape) +
                                                 ", expected " + std::to_string(total) + " rows");
    const std::string layer = fused.substr(0, fused.find('.', 4) + 1);  // "blk.<i>."
    int64_t row = 0;
    for (const auto& [what, rows] : parts) {
      ours[layer + what + ".weight"] = Piece{whole.f, row, rows};
      row += rows;
    }
    ours.erase(fused);
  };
  for (int64_t l = 0; l < c.n_layers; ++l) {
    const std::string b = "blk." + std::to_string(l) + ".";
    split(b + "attn_qkv.weight", {{"attn_q", c.q_dim()}, {"attn_k", c.kv_dim()}, {"attn_v", c.kv_dim()}});
    split(b + "ffn_gate_up.weight", {{"ffn_gate", c.hidden_dim}, {"ffn_up", c.hidden_dim}});
  }
}

// Every checkpoint tensor under our name (rotary buffers and a tied output's copy dropped), fused
// ones split (split_fused). Throws FileError for a name with no place in the model.
std::map<std::string, Piece> our_tensors(const std::map<std::string, Found>& hf, const ModelConfig& c, const std::string& family) {
  std::map<std::string, Piece> ours;
  for (const auto& [name, f] : hf) {
    const auto to = our_name(name, c.n_layers, family);
    if (!to)
      throw FileError(f.file->path(), "tensor '" + name + "' has no place in a " + family + " model with " + std::to_string(c.n_layers) + " layers");
    if (to->empty()) continue;                                  // rotary buffer
    if (*to == "output.weight" && c.tied_embeddings) continue;  // a tied copy of the embedding
    ours[*to] = Piece{&f};
  }
  split_fused(ours, c);
  return ours;
}

// Attention biases (Qwen2: q/k/v; Llama with attention_bias: q/k/v/o) are part of the table when
// the checkpoint has any of them; the table then asks for every layer's.
void mark_biases(const std::map<std::string, Piece>& ours, ModelConfig& c) {
  for (const auto& entry : ours) {
    const std::string& name = entry.first;  // (clang 14 cannot capture a structured binding)
    const auto ends = [&](const std::string& suffix) {
      return name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
    };
    if (ends(".attn_q.bias") || ends(".attn_k.bias") || ends(".attn_v.bias")) c.attn_qkv_bias = true;
    if (ends(".attn_output.bias")) c.attn_out_bias = true;
  }
}

// The source tensors in the table's order, each taken out of ours after checking its dtype
// (F32, F16, BF16) and its shape against the config's (a split piece: its row length); Gemma 3's
// norms get + 1 (plus_one). dtypes collects the checkpoint's types. Throws FileError for a
// missing tensor, a wrong shape or dtype, and anything left unplaced.
std::vector<SourceTensor> place_tensors(std::map<std::string, Piece>& ours, const ModelConfig& c, const std::string& family,
                                        const std::string& config_path, const std::string& weights_path, std::set<std::string>& dtypes) {
  std::vector<SourceTensor> out;
  const bool gemma_norms = family == "gemma3_text";
  for (const TensorSpec& spec : tensor_table(c)) {
    const std::string& name = spec.name;
    const std::vector<int64_t>& shape = spec.shape;
    auto it = ours.find(name);
    if (it == ours.end())
      throw FileError(weights_path, "tensor '" + hf_name_of(name, family) + "' (" + name + " " + dims_text(shape) + ") is missing");
    const Piece& p = it->second;
    const Found& f = *p.f;
    if (f.t->dtype != "F32" && f.t->dtype != "F16" && f.t->dtype != "BF16")
      throw FileError(f.file->path(), "tensor '" + f.hf_name + "' has dtype " + f.t->dtype + "; only F32, F16 and BF16 are read");
    if (p.rows < 0 && f.t->shape != shape)
      throw FileError(f.file->path(), "tensor '" + f.hf_name + "' has shape " + dims_text(f.t->shape) + " but " + config_path + " implies " +
                                          dims_text(shape));
    if (p.rows >= 0 && f.t->shape.back() != shape.back())
      throw FileError(f.file->path(), "tensor '" + f.hf_name + "' has rows of " + std::to_string(f.t->shape.back()) + " but " + config_path +
                                          " implies " + std::to_string(shape.back()));
    const bool norm = name.find("norm.weight") != std::string::npos;
    out.push_back(make_tensor(name, shape, p, gemma_norms && norm));
    dtypes.insert(f.t->dtype);
    ours.erase(it);
  }
  // Every checkpoint name was mapped (unknown ones are errors above), so nothing is left over.
  if (!ours.empty()) throw FileError(ours.begin()->second.f->file->path(), "internal: unplaced tensor " + ours.begin()->first);
  return out;
}

}  // namespace

SourceModel read_hf_model(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) throw FileError(dir, "not a directory");
  const std::string config_path = dir + "/config.json";
  const json cj = read_json_file(config_path);
  if (!cj.is_object()) throw FileError(config_path, "not a JSON object");
  SourceModel sm;
  std::string family;
  try {
    family = model_family(config_path, cj);
    sm.config = read_config(config_path, cj, family);
  } catch (const json::exception& e) {
    throw FileError(config_path, std::string("unexpected content: ") + e.what());
  }
  std::string weights_path;
  int n_files = 0;
  const std::map<std::string, Found> hf = open_weights(dir, &weights_path, &n_files);
  std::map<std::string, Piece> ours = our_tensors(hf, sm.config, family);
  mark_biases(ours, sm.config);
  std::set<std::string> dtypes;
  sm.tensors = place_tensors(ours, sm.config, family, config_path, weights_path, dtypes);
  std::string dt;
  for (const auto& d : dtypes) dt += (dt.empty() ? "" : "+") + d;
  sm.format = "Hugging Face safetensors (" + family + ", " + dt + ", " + std::to_string(n_files) + (n_files == 1 ? " file)" : " shards)");

  const HfTokenizer tok = read_hf_tokenizer(dir, cj, sm.config.vocab_size);
  sm.has_vocab = tok.found;
  sm.vocab = tok.vocab;
  sm.chat_template = tok.chat_template;
  auto files = std::make_shared<std::set<std::shared_ptr<SafetensorsFile>>>();
  for (const auto& [name, f] : hf) files->insert(f.file);
  sm.keepalive = files;
  return sm;
}

}  // namespace llmq

namespace llmq {

std::string hf_checkpoint_xxh64(const std::string& dir) {
  std::error_code ec;
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    if (!e.is_regular_file(ec)) continue;
    const std::string n = e.path().filename().string();
    for (const char* ext : {".json", ".safetensors", ".model", ".jinja"}) {
      const std::string x = ext;
      if (n.size() > x.size() && n.compare(n.size() - x.size(), x.size(), x) == 0) {
        names.push_back(n);
        break;
      }
    }
  }
  if (ec) throw FileError(dir, "cannot list the directory: " + ec.message());
  std::sort(names.begin(), names.end());
  std::unique_ptr<XXH64_state_t, decltype(&XXH64_freeState)> st(XXH64_createState(), &XXH64_freeState);
  XXH64_reset(st.get(), 0);
  std::vector<char> buf(1 << 20);
  for (const std::string& n : names) {
    const std::string path = dir + "/" + n;
    std::ifstream in = open_regular_file(path);
    const uint64_t size = fs::file_size(path, ec);
    if (ec) throw FileError(path, "cannot determine the file size: " + ec.message());
    uint8_t le[8];
    for (int i = 0; i < 8; ++i) le[i] = uint8_t(size >> (8 * i));
    XXH64_update(st.get(), n.data(), n.size() + 1);  // the name and its terminating zero
    XXH64_update(st.get(), le, 8);
    while (in) {
      in.read(buf.data(), std::streamsize(buf.size()));
      if (in.gcount() > 0) XXH64_update(st.get(), buf.data(), size_t(in.gcount()));
    }
    if (in.bad()) throw FileError(path, "read error while hashing");
  }
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(XXH64_digest(st.get())));
  return hex;
}

}  // namespace llmq
