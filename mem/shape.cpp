#include "mem/shape.h"
#include "base/mapped_file.h"

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "base/error.h"
#include "formats/readers/gguf.h"
#include "formats/readers/gguf_model.h"
#include "formats/llmq_file.h"

namespace llmq::mem {

int64_t ModelShape::layer_linear_params() const {
  const int64_t attn = dim * q_dim() + 2 * dim * kv_dim() + q_dim() * dim;
  const int64_t ffn = (mlp == Mlp::SwiGLU ? 3 : 2) * dim * hidden;
  return attn + ffn;
}

int64_t ModelShape::layer_params() const {
  int64_t n = layer_linear_params() + 2 * dim;
  if (gpt) n += (q_dim() + 2 * kv_dim() + dim) + (hidden + dim) + 2 * dim;
  return n;
}

int64_t ModelShape::embed_params() const { return vocab * dim + positions * dim + extra_embed; }

int64_t ModelShape::head_params() const {
  if (head == Head::Classifier) return dim * dim + dim + labels * dim + labels;
  return dim * (gpt ? 2 : 1) + (tied ? 0 : vocab * dim);
}

double ModelShape::logits(double s, double b) const {
  return head == Head::Classifier ? b * double(labels) : s * b * double(vocab);
}

int64_t ModelShape::params() const { return embed_params() + layers * layer_params() + head_params(); }

int64_t ModelShape::largest_layer_params() const {
  return std::max({vocab * dim, dim * hidden, dim * q_dim()});
}

void ModelShape::validate() const {
  if (dim <= 0 || hidden <= 0 || layers <= 0 || heads <= 0 || kv_heads <= 0 || head_dim <= 0 || vocab <= 0)
    throw UsageError("model shape '" + name + "': every dimension must be positive");
  if (heads % kv_heads != 0) throw UsageError("model shape '" + name + "': heads must be a multiple of kv_heads");
}

namespace {

ModelShape llama(const char* name, int64_t dim, int64_t hidden, int64_t layers, int64_t heads, int64_t kv, int64_t vocab,
                 int64_t ctx, bool tied = false, const char* model_type = "llama") {
  ModelShape s;
  s.name = name, s.dim = dim, s.hidden = hidden, s.layers = layers, s.heads = heads, s.kv_heads = kv;
  s.head_dim = dim / heads, s.vocab = vocab, s.context = ctx, s.tied = tied;
  s.model_type = model_type;
  return s;
}

const std::vector<ModelShape>& presets() {
  static const std::vector<ModelShape> p = [] {
    std::vector<ModelShape> v = {
        llama("llama-2-7b", 4096, 11008, 32, 32, 32, 32000, 4096),
        llama("llama-2-13b", 5120, 13824, 40, 40, 40, 32000, 4096),
        llama("llama-2-70b", 8192, 28672, 80, 64, 8, 32000, 4096),
        llama("llama-3-8b", 4096, 14336, 32, 32, 8, 128256, 8192),
        llama("llama-3-70b", 8192, 28672, 80, 64, 8, 128256, 8192),
        llama("llama-3.2-1b", 2048, 8192, 16, 32, 8, 128256, 131072, true),
        llama("llama-3.2-3b", 3072, 8192, 28, 24, 8, 128256, 131072, true),
        llama("mistral-7b", 4096, 14336, 32, 32, 8, 32000, 32768, false, "mistral"),
        llama("tinyllama-1.1b", 2048, 5632, 22, 32, 4, 32000, 2048),
        llama("smollm2-135m", 576, 1536, 30, 9, 3, 49152, 8192, true),
    };
    ModelShape g = llama("gpt-3-175b", 12288, 4 * 12288, 96, 96, 96, 50257, 2048, true);
    g.mlp = Mlp::Gelu, g.gpt = true, g.positions = g.context, g.model_type = "";  // not a transformers model
    v.push_back(g);
    return v;
  }();
  return p;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// BERT (transformers' BertConfig): post-LayerNorm encoder, GELU MLP, biases, learned positions
// and token types; the head from `architectures`: a sequence classifier of num_labels classes
// (len(id2label), default 2), else the masked-LM head (transform dense + LayerNorm, decoder tied
// to the embedding with a bias). BLOOM (BloomConfig): n_layer / n_head, MLP 4·hidden, ALiBi (no
// position table), a LayerNorm after the embedding, tied output.
void apply_family(ModelShape& s, const nlohmann::json& j, const std::string& type) {
  if (type == "gpt_neox" || type == "phi" || type == "falcon" || type == "gpt_bigcode" || type == "gpt2") s.mlp = Mlp::Gelu;
  if (type == "bert") {
    s.mlp = Mlp::Gelu, s.gpt = true, s.positions = s.context;
    s.extra_embed = j.value("type_vocab_size", int64_t(2)) * s.dim + 2 * s.dim;
    bool classifier = false;
    if (j.contains("architectures") && j["architectures"].is_array())
      for (const auto& a : j["architectures"])
        classifier = classifier || (a.is_string() && a.get<std::string>().find("ForSequenceClassification") != std::string::npos);
    if (classifier) {
      s.head = Head::Classifier;
      s.labels = j.contains("id2label") && j["id2label"].is_object() ? int64_t(j["id2label"].size()) : j.value("num_labels", int64_t(2));
      if (s.labels < 1) s.labels = 2;
    } else {
      s.tied = true;
      s.extra_embed += s.dim * s.dim + s.dim + s.vocab;  // MLM transform dense + bias, decoder bias (its LayerNorm: the final norm)
    }
  }
  if (type == "bloom") s.mlp = Mlp::Gelu, s.gpt = true, s.tied = true, s.extra_embed = 2 * s.dim;
}

ModelShape from_hf_config(const std::string& path) {
  std::ifstream in = open_regular_file(path);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
    const std::string type = j.value("model_type", "");
    // The first of the names that holds an integer (BLOOM spells some keys its own way).
    auto get = [&](std::initializer_list<const char*> keys) {
      for (const char* k : keys)
        if (j.contains(k) && j[k].is_number_integer()) return j[k].get<int64_t>();
      throw FileError(path, std::string("missing integer key '") + *keys.begin() + "'");
    };
    auto has = [&](const char* k) { return j.contains(k) && j[k].is_number_integer(); };
    ModelShape s;
    s.name = j.value("_name_or_path", std::filesystem::path(path).parent_path().filename().string());
    s.dim = get({"hidden_size", "n_embed"}), s.layers = get({"num_hidden_layers", "n_layer"});
    s.heads = get({"num_attention_heads", "n_head"});
    s.hidden = type == "bloom" && !has("intermediate_size") ? 4 * s.dim : get({"intermediate_size"});
    s.kv_heads = has("num_key_value_heads") ? get({"num_key_value_heads"}) : s.heads;
    s.head_dim = has("head_dim") ? get({"head_dim"}) : s.dim / s.heads;
    s.vocab = get({"vocab_size"});
    s.context = type == "bloom" && !has("max_position_embeddings") ? j.value("seq_length", int64_t(2048)) : get({"max_position_embeddings"});
    s.tied = j.value("tie_word_embeddings", false);
    s.model_type = type;
    apply_family(s, j, type);
    if (s.name.empty()) s.name = "config.json";
    return s;
  } catch (const nlohmann::json::exception& e) {
    throw FileError(path, std::string("not a valid config.json: ") + e.what());
  }
}

}  // namespace

std::vector<std::string> preset_names() {
  std::vector<std::string> n;
  for (const auto& p : presets()) n.push_back(p.name);
  return n;
}

ModelShape preset(const std::string& name) {
  for (const auto& p : presets())
    if (p.name == name) return p;
  std::string known;
  for (const auto& n : preset_names()) known += (known.empty() ? "" : ", ") + n;
  throw UsageError("unknown model '" + name + "': not a file, and not a preset (" + known + ")");
}

ModelShape shape_from_config(const ModelConfig& c, const std::string& name) {
  ModelShape s;
  s.name = name, s.dim = c.dim, s.hidden = c.hidden_dim, s.layers = c.n_layers, s.heads = c.n_heads;
  s.kv_heads = c.n_kv_heads, s.head_dim = c.head_dim, s.vocab = c.vocab_size, s.context = c.context_length;
  s.tied = c.tied_embeddings, s.model_type = c.arch;
  return s;
}

ModelShape load_shape(const std::string& model) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::exists(model, ec)) return preset(model);
  ModelShape s;
  const std::string name = fs::path(model).filename().string();
  if (fs::is_directory(model, ec)) {
    s = from_hf_config((fs::path(model) / "config.json").string());
  } else if (ends_with(model, ".json")) {
    s = from_hf_config(model);
  } else {
    char magic[8] = {};
    open_regular_file(model).read(magic, sizeof magic);
    if (std::string(magic, 4) == "GGUF") {
      const SourceModel src = read_gguf_model(model);  // config and tensor infos; no weight is read
      s = shape_from_config(src.config, name);
      for (const auto& t : src.tensors) s.counted_params += t.numel();
    } else {
      auto f = LlmqFile::open(model, /*verify=*/false);  // maps; reads the header, metadata, directory
      try {
        s = shape_from_config(ModelConfig::from_metadata(f->meta()), name);
      } catch (const std::exception& e) {
        throw FileError(model, e.what());
      }
      for (const auto& t : f->tensors()) s.counted_params += t.numel();
    }
  }
  s.validate();
  return s;
}

}  // namespace llmq::mem
