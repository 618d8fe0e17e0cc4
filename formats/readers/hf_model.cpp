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

// The model family: config.json's model_type, else its first architecture.
std::string model_family(const std::string& path, const json& c) {
  auto mt = c.find("model_type");
  std::string family;
  if (mt != c.end() && !mt->is_null()) {
    if (!mt->is_string()) throw FileError(path, "\"model_type\" is not a string");
    family = mt->get<std::string>();
  } else {
    auto ar = c.find("architectures");
    if (ar == c.end() || !ar->is_array() || ar->empty() || !(*ar)[0].is_string())
      throw FileError(path, "neither \"model_type\" nor \"architectures\" says what model this is");
    const std::string a = (*ar)[0].get<std::string>();
    family = a == "LlamaForCausalLM" ? "llama" : a == "MistralForCausalLM" ? "mistral" : a == "Qwen2ForCausalLM" ? "qwen2" : a;
  }
  if (family != "llama" && family != "mistral" && family != "qwen2")
    throw FileError(path, "model_type '" + family + "' is not supported (llama, mistral and qwen2 are read)");
  return family;
}

ModelConfig read_config(const std::string& path, const json& c, const std::string& family) {
  ModelConfig cfg;
  cfg.dim = config_int(path, c, "hidden_size", std::nullopt);
  cfg.hidden_dim = config_int(path, c, "intermediate_size", std::nullopt);
  cfg.n_layers = config_int(path, c, "num_hidden_layers", std::nullopt);
  cfg.n_heads = config_int(path, c, "num_attention_heads", std::nullopt);
  cfg.n_kv_heads = config_int(path, c, "num_key_value_heads", cfg.n_heads);
  cfg.head_dim = config_int(path, c, "head_dim", cfg.dim / cfg.n_heads);
  cfg.vocab_size = config_int(path, c, "vocab_size", std::nullopt);
  cfg.context_length = config_int(path, c, "max_position_embeddings", std::nullopt);
  cfg.norm_eps = config_float(path, c, "rms_norm_eps", std::nullopt);
  cfg.rope_theta = config_float(path, c, "rope_theta", 10000.0);
  cfg.tied_embeddings = config_bool(path, c, "tie_word_embeddings", false);
  cfg.rope_layout = RopeLayout::RotateHalf;

  if (c.contains("rope_scaling") && !c["rope_scaling"].is_null())
    throw FileError(path, "rope_scaling " + c["rope_scaling"].dump() + " is not supported yet");
  if (c.contains("hidden_act") && c["hidden_act"] != "silu")
    throw FileError(path, "hidden_act " + c["hidden_act"].dump() + " is not supported (only silu)");
  if (config_bool(path, c, "mlp_bias", false)) throw FileError(path, "mlp_bias is not supported");
  if (family == "qwen2" && config_bool(path, c, "use_sliding_window", false))
    throw FileError(path, "use_sliding_window is not supported");
  if (family == "mistral") {  // Mistral 7B v0.1: every layer attends over a window (v0.2 on: null)
    auto sw = c.find("sliding_window");
    if (sw != c.end() && !sw->is_null()) cfg.sliding_window = config_int(path, c, "sliding_window", std::nullopt);
  }
  try {
    cfg.validate();
  } catch (const UsageError& e) {
    throw FileError(path, e.what());
  }
  return cfg;
}

// --- tensor names ----------------------------------------------------------------------------

// Where an HF tensor goes: our name, or "" for a tensor that is ignored (rotary buffers).
// nullopt for a tensor that has no place in a Llama model.
std::optional<std::string> our_name(const std::string& hf, int64_t n_layers) {
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
  const std::string rest = hf.substr(p + 1);
  static const std::map<std::string, std::string> per_layer = {
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
  auto it = per_layer.find(rest);
  if (it == per_layer.end()) return std::nullopt;
  if (it->second.empty()) return std::string();
  return "blk." + std::to_string(layer) + "." + it->second;
}

// The checkpoint's name for one of ours (the inverse of our_name), for messages.
std::string hf_name_of(const std::string& ours) {
  static const std::map<std::string, std::string> global = {{"token_embd.weight", "model.embed_tokens.weight"},
                                                             {"output_norm.weight", "model.norm.weight"},
                                                             {"output.weight", "lm_head.weight"}};
  if (auto it = global.find(ours); it != global.end()) return it->second;
  static const std::map<std::string, std::string> per_layer = {
      {"attn_norm.weight", "input_layernorm.weight"},  {"attn_q.weight", "self_attn.q_proj.weight"},
      {"attn_k.weight", "self_attn.k_proj.weight"},    {"attn_v.weight", "self_attn.v_proj.weight"},
      {"attn_output.weight", "self_attn.o_proj.weight"}, {"ffn_norm.weight", "post_attention_layernorm.weight"},
      {"ffn_gate.weight", "mlp.gate_proj.weight"},     {"ffn_up.weight", "mlp.up_proj.weight"},
      {"ffn_down.weight", "mlp.down_proj.weight"},     {"attn_q.bias", "self_attn.q_proj.bias"},
      {"attn_k.bias", "self_attn.k_proj.bias"},        {"attn_v.bias", "self_attn.v_proj.bias"},
      {"attn_output.bias", "self_attn.o_proj.bias"}};
  const size_t dot = ours.find('.', 4);
  if (ours.rfind("blk.", 0) == 0 && dot != std::string::npos)
    if (auto it = per_layer.find(ours.substr(dot + 1)); it != per_layer.end())
      return "model.layers." + ours.substr(4, dot - 4) + "." + it->second;
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

SourceTensor make_tensor(const std::string& name, const Found& f) {
  SourceTensor st;
  st.name = name;
  st.shape = f.t->shape;
  const SafetensorsTensor* t = f.t;
  auto keep = f.file;
  const std::string& dt = t->dtype;
  st.raw_type = dt == "F32" ? DType::F32 : dt == "F16" ? DType::F16 : DType::BF16;  // checked by the caller
  st.raw = t->data;
  st.release = [keep, t] { keep->release(t->data, t->nbytes()); };
  // One tensor, converted from the mapping in chunks whose pages are dropped again as soon as
  // they are converted, so the resident set holds the fp32 output and one chunk of the source.
  st.read = [keep, t](float* out) {
    const int64_t n = t->numel();
    const int64_t esize = t->dtype == "F32" ? 4 : 2;
    const int64_t chunk = (int64_t(4) << 20) / esize;  // 4 MiB of source bytes
    const bool half = t->dtype == "F16";
    for (int64_t i0 = 0; i0 < n; i0 += chunk) {
      const int64_t m = std::min(chunk, n - i0);
      const uint8_t* p = t->data + i0 * esize;
      if (esize == 4) {
        std::memcpy(out + i0, p, size_t(m) * 4);
      } else {
        for (int64_t i = 0; i < m; ++i) {
          uint16_t h;
          std::memcpy(&h, p + 2 * i, 2);
          out[i0 + i] = half ? fp16_to_fp32(h) : bf16_to_fp32(h);
        }
      }
      keep->release(p, uint64_t(m * esize));
    }
  };
  return st;
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
  const ModelConfig& c = sm.config;

  std::string weights_path;
  int n_files = 0;
  const std::map<std::string, Found> hf = open_weights(dir, &weights_path, &n_files);

  // Map every checkpoint tensor to our name; anything unknown is an error.
  std::map<std::string, const Found*> ours;
  for (const auto& [name, f] : hf) {
    const auto to = our_name(name, c.n_layers);
    if (!to)
      throw FileError(f.file->path(), "tensor '" + name + "' has no place in a " + family + " model with " +
                                          std::to_string(c.n_layers) + " layers");
    if (to->empty()) continue;                                     // rotary buffer
    if (*to == "output.weight" && c.tied_embeddings) continue;     // a tied copy of the embedding
    ours[*to] = &f;
  }

  std::set<std::string> dtypes;
  auto take = [&](const std::string& name, const std::vector<int64_t>& shape) {
    auto it = ours.find(name);
    if (it == ours.end()) return false;
    const Found& f = *it->second;
    if (f.t->dtype != "F32" && f.t->dtype != "F16" && f.t->dtype != "BF16")
      throw FileError(f.file->path(), "tensor '" + f.hf_name + "' has dtype " + f.t->dtype +
                                          "; only F32, F16 and BF16 are read");
    if (f.t->shape != shape)
      throw FileError(f.file->path(), "tensor '" + f.hf_name + "' has shape " + dims_text(f.t->shape) + " but " +
                                          config_path + " implies " + dims_text(shape));
    sm.tensors.push_back(make_tensor(name, f));
    dtypes.insert(f.t->dtype);
    ours.erase(it);
    return true;
  };
  // Attention biases (Qwen2: q/k/v; Llama with attention_bias: q/k/v/o) are part of the
  // table when the checkpoint has any of them; the table then asks for every layer's.
  for (const auto& entry : ours) {
    const std::string& name = entry.first;  // (clang 14 cannot capture a structured binding)
    const auto ends = [&](const std::string& suffix) {
      return name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
    };
    if (ends(".attn_q.bias") || ends(".attn_k.bias") || ends(".attn_v.bias")) sm.config.attn_qkv_bias = true;
    if (ends(".attn_output.bias")) sm.config.attn_out_bias = true;
  }
  for (const TensorSpec& spec : tensor_table(c)) {
    if (!take(spec.name, spec.shape))
      throw FileError(weights_path, "tensor '" + hf_name_of(spec.name) + "' (" + spec.name + " " + dims_text(spec.shape) +
                                        ") is missing");
  }
  // Every checkpoint name was mapped (unknown ones are errors above), so nothing is left over.
  if (!ours.empty()) throw FileError(ours.begin()->second->file->path(), "internal: unplaced tensor " + ours.begin()->first);

  std::string dt;
  for (const auto& d : dtypes) dt += (dt.empty() ? "" : "+") + d;
  sm.format = "Hugging Face safetensors (" + family + ", " + dt + ", " + std::to_string(n_files) +
              (n_files == 1 ? " file)" : " shards)");

  const HfTokenizer tok = read_hf_tokenizer(dir, cj, c.vocab_size);
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
