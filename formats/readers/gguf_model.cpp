#include "formats/readers/gguf_model.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <map>
#include <set>

#include "base/error.h"
#include "formats/ggml_dequant.h"
#include "formats/readers/gguf.h"
#include "formats/llmq_file.h"  // MetadataError
#include "models/architecture.h"

namespace llmq {

namespace {

constexpr const char* kSupportedTypes = "F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL";

std::string type_name(uint32_t t) {
  const GgmlTypeSize ts = ggml_type_size(t);
  return ts.name ? ts.name : "type " + std::to_string(t);
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// llama.cpp's llama_ftype names (general.file_type), for the format line.
const char* file_type_name(int64_t ft) {
  static const std::map<int64_t, const char*> names = {
      {0, "F32"},      {1, "F16"},      {2, "Q4_0"},     {3, "Q4_1"},     {7, "Q8_0"},    {8, "Q5_0"},
      {9, "Q5_1"},     {10, "Q2_K"},    {11, "Q3_K_S"},  {12, "Q3_K_M"},  {13, "Q3_K_L"}, {14, "Q4_K_S"},
      {15, "Q4_K_M"},  {16, "Q5_K_S"},  {17, "Q5_K_M"},  {18, "Q6_K"},    {32, "BF16"},
  };
  auto it = names.find(ft);
  return it == names.end() ? nullptr : it->second;
}

// The `<arch>.*` scalar keys of a GGUF as llmq metadata (the .llmq file uses GGUF's key
// names), so ModelConfig::from_metadata reads them and applies the architecture's recipe.
Metadata arch_metadata(const GgufFile& g, const std::string& arch) {
  Metadata m;
  m.set("general.architecture", arch);
  const std::string prefix = arch + ".";
  for (const auto& [key, v] : g.kv()) {
    if (key.compare(0, prefix.size(), prefix) != 0) continue;
    if (v.type == GgufType::BOOL) m.set(key, v.u != 0);
    else if (v.is_int()) m.set(key, v.as_int(key));
    else if (v.type == GgufType::F32 || v.type == GgufType::F64) m.set(key, v.as_float(key));
    else if (v.type == GgufType::STRING) m.set(key, v.s);
  }
  return m;
}

// A 1-D F32/F16 tensor of at most 4096 values (RoPE factor lists) as floats. Throws FileError.
std::vector<float> factor_list(const GgufTensor& t, const std::string& path) {
  if (t.shape.size() != 1 || t.shape[0] < 1 || t.shape[0] > 4096 || (t.type != uint32_t(DType::F32) && t.type != uint32_t(DType::F16)))
    throw FileError(path, "tensor '" + t.name + "' must be a list of at most 4096 F32 or F16 values");
  std::vector<float> v(size_t(t.shape[0]));
  ggml_dequantize_row(t.type, t.data, v.data(), t.shape[0]);
  return v;
}

// The hyper-parameters and recipe of a GGUF's architecture (llama.cpp's LLM_KV names, which
// are llmq's), but the vocabulary size and the tensor-dependent flags, which read_gguf_model
// fills. Throws FileError.
ModelConfig gguf_config(const GgufFile& g, const std::string& path) {
  const GgufValue* arch_v = g.find("general.architecture");
  if (!arch_v) throw FileError(path, "GGUF model has no general.architecture key");
  const std::string& arch = arch_v->as_string("general.architecture");
  const Architecture* a = find_architecture(arch);
  if (!a) throw FileError(path, "GGUF architecture '" + arch + "' is not supported (llmq converts: " + architecture_names() + ")");
  Metadata m = arch_metadata(g, arch);
  const std::string p = arch + ".";
  if (!m.has(p + "vocab_size")) m.set(p + "vocab_size", int64_t(1));  // from the tokenizer, below
  m.set(p + "rope.layout", std::string(rope_layout_name(a->gguf_rope)));
  if (m.get_string(p + "rope.scaling.type", "none") == "none") m.values.erase(p + "rope.scaling.type");
  if (m.has(p + "rope.scaling.type") && m.get_float(p + "rope.scaling.factor", 1.0) == 1.0) m.values.erase(p + "rope.scaling.type");
  // LongRoPE (Phi-3 128k): llama.cpp stores the factor lists as tensors; llmq as metadata.
  const GgufTensor* longf = g.find_tensor("rope_factors_long.weight");
  const GgufTensor* shortf = g.find_tensor("rope_factors_short.weight");
  // Llama 3.1 scaling as llama.cpp's converter stores it: per-frequency divisors.
  if (const GgufTensor* ff = g.find_tensor("rope_freqs.weight")) m.set(p + "rope.freq_factors", factor_list(*ff, path));
  if (longf && shortf) {
    m.set(p + "rope.scaling.type", std::string("longrope"));
    m.set(p + "rope.scaling.long_factor", factor_list(*longf, path));
    m.set(p + "rope.scaling.short_factor", factor_list(*shortf, path));
  }
  // As llama.cpp: head_dim = key_length (default dim / heads); the value length and
  // rope.dimension_count (n_rot) must equal it (no partial rotary embedding).
  ModelConfig c;
  try {
    c = ModelConfig::from_metadata(m);
  } catch (const std::exception& e) {
    throw FileError(path, std::string("GGUF ") + arch + " hyper-parameters: " + e.what());
  }
  if (m.has(p + "attention.value_length") && m.get_int(p + "attention.value_length") != c.head_dim)
    throw FileError(path, p + "attention.value_length differs from the key length (not supported)");
  if (m.has(p + "rope.dimension_count") && m.get_int(p + "rope.dimension_count") != c.head_dim)
    throw FileError(path, "partial RoPE (" + p + "rope.dimension_count " + std::to_string(m.get_int(p + "rope.dimension_count")) +
                              " != head_dim " + std::to_string(c.head_dim) + ") is not supported");
  if (m.get_int(p + "expert_count", 0) > 0) throw FileError(path, "mixture-of-experts models are not supported");
  return c;
}

// Where the table's tensor `spec` lives in the file: a tensor of its own name, or rows
// [row0, row0 + spec rows) of a fused one (Architecture::fused_projections: attn_qkv, and ffn_up
// holding gate then up) of src_rows rows in all.
struct GgufPiece {
  std::string src;
  int64_t row0 = 0, src_rows = -1;  // src_rows < 0: the whole tensor
};

GgufPiece gguf_piece(const ModelConfig& c, const TensorSpec& spec) {
  const Architecture* a = find_architecture(c.arch);
  if (!a || !a->fused_projections || spec.name.rfind("blk.", 0) != 0) return {spec.name};
  const size_t dot = spec.name.find('.', 4);
  const std::string blk = spec.name.substr(0, dot + 1), what = spec.name.substr(dot + 1);
  const int64_t qkv = c.q_dim() + 2 * c.kv_dim();
  if (what == "attn_q.weight") return {blk + "attn_qkv.weight", 0, qkv};
  if (what == "attn_k.weight") return {blk + "attn_qkv.weight", c.q_dim(), qkv};
  if (what == "attn_v.weight") return {blk + "attn_qkv.weight", c.q_dim() + c.kv_dim(), qkv};
  if (what == "ffn_gate.weight") return {blk + "ffn_up.weight", 0, 2 * c.hidden_dim};
  if (what == "ffn_up.weight") return {blk + "ffn_up.weight", c.hidden_dim, 2 * c.hidden_dim};
  return {spec.name};
}

// Tensors beyond the table: RoPE factor tensors (read into the config by gguf_config) pass,
// anything else is refused.
void check_extra_tensors(const GgufFile& g, const ModelConfig& c, const std::vector<TensorSpec>& table, const std::string& path) {
  std::set<std::string> expected;
  for (const TensorSpec& s : table) expected.insert(gguf_piece(c, s).src);
  for (const GgufTensor& t : g.tensors()) {
    if (expected.count(t.name)) continue;
    if (c.rope_scaling == RopeScaling::LongRope && (t.name == "rope_factors_long.weight" || t.name == "rope_factors_short.weight"))
      continue;  // read into the config (gguf_config)
    if (t.name == "rope_freqs.weight") continue;  // read into the config (gguf_config)
    throw FileError(path, "unexpected tensor '" + t.name + "' (not part of the " + c.arch + " architecture)");
  }
}

// The table's tensor `spec` from the file: its raw bytes when llmq has its type, and readers
// that dequantize rows to fp32 and release the pages afterwards.
SourceTensor gguf_source_tensor(const std::shared_ptr<GgufFile>& g, const ModelConfig& c, const TensorSpec& spec, const std::string& path) {
  const GgufPiece piece = gguf_piece(c, spec);
  const GgufTensor* t = g->find_tensor(piece.src);
  if (!t) throw FileError(path, "missing tensor '" + piece.src + "'");
  std::vector<int64_t> want = spec.shape;
  if (piece.src_rows >= 0) want[0] = piece.src_rows;
  if (t->shape != want)
    throw FileError(path, "tensor '" + piece.src + "' has shape " + shape_str(t->shape) + ", expected " + shape_str(want));
  if (!dtype_known(t->type))
    throw FileError(path, "tensor '" + piece.src + "' has type " + type_name(t->type) + ", which llmq cannot convert (supported: " +
                              kSupportedTypes + ")");
  SourceTensor st;
  st.name = spec.name;
  st.shape = spec.shape;
  st.file_order = t - g->tensors().data();
  const uint32_t type = t->type;
  const int64_t cols = spec.shape.back();
  const int64_t rows = st.numel() / cols;
  const GgmlTypeSize ts = ggml_type_size(type);
  const uint64_t rb = uint64_t(cols / ts.block) * ts.bytes;
  const uint8_t* data = t->data + uint64_t(piece.row0) * rb;  // whole rows: exact for every block type
  std::shared_ptr<GgufFile> keep = g;
  st.raw_type = DType(t->type);
  st.raw = data;
  st.read = [keep, type, data, rows, cols, rb](float* out) {
    for (int64_t r = 0; r < rows; ++r) ggml_dequantize_row(type, data + uint64_t(r) * rb, out + r * cols, cols);
  };
  // Done with the tensor: drop its whole pages from the resident set (the mapping is read-only
  // and private, so they are simply read again if ever touched).
  const uint64_t nbytes = uint64_t(rows) * rb;
  st.release = [keep, data, nbytes] { keep->mapping()->release(data, nbytes); };
  return st;
}

// "GGUF v3 (Q4_1)": the file type named by general.file_type, else the type of most weights.
std::string gguf_format(const GgufFile& g, const std::map<uint32_t, int64_t>& weights_by_type) {
  std::string ftype;
  if (const GgufValue* ft = g.find("general.file_type"); ft && ft->is_int() && ft->u <= uint64_t(INT64_MAX))
    if (const char* n = file_type_name(ft->as_int("general.file_type"))) ftype = n;
  if (ftype.empty() && !weights_by_type.empty()) {
    auto best = weights_by_type.begin();
    for (auto it = weights_by_type.begin(); it != weights_by_type.end(); ++it)
      if (it->second > best->second) best = it;
    ftype = type_name(best->first);
  }
  return "GGUF v" + std::to_string(g.version()) + (ftype.empty() ? "" : " (" + ftype + ")");
}

}  // namespace

SourceModel read_gguf_model(const std::string& path) {
  std::shared_ptr<GgufFile> g = GgufFile::open(path);
  SourceModel sm;
  try {
    ModelConfig& c = sm.config;
    c = gguf_config(*g, path);
    // The tokenizer (its token count is the vocabulary size).
    sm.vocab = vocab_from_gguf(*g);
    sm.has_vocab = true;
    const std::string vs_key = c.arch + ".vocab_size";
    const GgufValue* vs = g->find(vs_key);
    c.vocab_size = vs ? vs->as_int(vs_key) : int64_t(sm.vocab.size());
    if (c.vocab_size != int64_t(sm.vocab.size()))
      throw FileError(path, vs_key + " " + std::to_string(c.vocab_size) + " differs from the " + std::to_string(sm.vocab.size()) +
                                " tokens of tokenizer.ggml.tokens");
    if (const GgufValue* ct = g->find("tokenizer.chat_template")) sm.chat_template = ct->as_string("tokenizer.chat_template");
    c.tied_embeddings = g->find_tensor("output.weight") == nullptr;
    // Attention biases (a llama GGUF of a checkpoint with attention_bias): then every layer must
    // have them (the table asks for them).
    c.attn_qkv_bias = g->find_tensor("blk.0.attn_q.bias") || g->find_tensor("blk.0.attn_k.bias") || g->find_tensor("blk.0.attn_v.bias");
    c.attn_out_bias = g->find_tensor("blk.0.attn_output.bias") != nullptr;
    try {
      c.validate();
    } catch (const UsageError& e) {
      throw FileError(path, "GGUF " + c.arch + " hyper-parameters: " + std::string(e.what()));
    }
    // The tensors: exactly the llama table, plus known-harmless extras.
    const std::vector<TensorSpec> table = tensor_table(c);
    check_extra_tensors(*g, c, table, path);
    std::map<uint32_t, int64_t> weights_by_type;  // 2-D tensors only, for the format line
    for (const TensorSpec& spec : table) {
      sm.tensors.push_back(gguf_source_tensor(g, c, spec, path));
      if (spec.shape.size() >= 2) weights_by_type[uint32_t(sm.tensors.back().raw_type)] += sm.tensors.back().numel();
    }
    sm.format = gguf_format(*g, weights_by_type);
  } catch (const MetadataError& e) {
    throw FileError(path, e.what());
  } catch (const UsageError& e) {
    throw FileError(path, e.what());
  }
  sm.keepalive = g;
  return sm;
}

}  // namespace llmq
