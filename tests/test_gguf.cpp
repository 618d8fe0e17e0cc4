// GGUF import ([gguf]): formats/readers/gguf_model.cpp, formats/ggml_dequant.cpp, tools/llmq-info.cpp.
//
// What is checked:
//  * ggml_dequantize_row (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, and our Q8_0, Q4_0, Q4_1, F16, BF16)
//    against an independent implementation, the `gguf` Python package (gguf.quants.dequantize),
//    installed with pip into a venv in the scratch folder (skipped with a warning when pip or
//    the network is unavailable): random blocks (finite fp16 scales, subnormals included) must
//    decode to bit-identical floats;
//  * a GGUF written here from stories260K (llama2.c) converts with the real llmq-convert to a
//    `.llmq` whose tensors are byte-identical to the llama2.c route's (test::stories), whose
//    logits match within 1e-5 over 64 greedy steps with the same tokens; a Q8_0 variant's
//    tensors are byte-identical to the GGUF's;
//  * GGUFs holding every supported type (our types raw, Q5_0/Q5_1/K-quants dequantized) convert;
//  * SmolLM2-135M-Instruct (models/, when fetched) repacks losslessly: every tensor
//    byte-identical, dequantized values bit for bit, metadata carried over; llmq-info reads it;
//  * hostile GGUFs (truncations, bad headers, absurd counts and lengths, nesting, unknown
//    types, bad shapes, offsets, alignment, duplicates, wrong architecture, missing or
//    mis-shaped tensors, unsupported types): the real llmq-convert (and llmq-info where the
//    container itself is bad) exits exactly 2, names the file, and leaves no output behind;
//    a seeded sweep of 100 random byte mutations ends only in exit 0 or 2.
// GGUF layout facts (header, kv encoding, tensor infos, alignment) are from ggml's docs/gguf.md.
#include <catch2/catch.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "engine/model.h"
#include "engine/sampler.h"
#include "base/threadpool.h"
#include "base/error.h"
#include "formats/ggml_dequant.h"
#include "formats/readers/convert.h"
#include "formats/readers/gguf.h"
#include "formats/readers/gguf_model.h"
#include "formats/readers/llama2c.h"
#include "formats/llmq_file.h"
#include "formats/quant.h"
#include "formats/readers/tokenizer_files.h"
#include "test_util.h"

using namespace llmq;

namespace {

namespace fs = std::filesystem;
using Bytes = std::vector<uint8_t>;
static_assert(std::endian::native == std::endian::little, "the GGUF writer below writes native little-endian");

// ---------------------------------------------------------------- a small GGUF writer

enum : uint32_t { kU8 = 0, kI8, kU16, kI16, kU32, kI32, kF32, kBool, kStr, kArr, kU64, kI64, kF64 };
// ggml type ids used here
enum : uint32_t { tF32 = 0, tF16 = 1, tQ4_0 = 2, tQ4_1 = 3, tQ5_0 = 6, tQ5_1 = 7, tQ8_0 = 8, tQ8_1 = 9, tQ2_K = 10,
                  tQ3_K = 11, tQ4_K = 12, tIQ4_NL = 20, tQ5_K = 13, tQ6_K = 14, tQ8_K = 15, tF64 = 28, tBF16 = 30 };

void put(Bytes& b, const void* p, size_t n) {
  if (n == 0) return;
  const size_t at = b.size();
  b.resize(at + n);
  std::memcpy(b.data() + at, p, n);
}
template <typename T>
void put_le(Bytes& b, T v) {
  put(b, &v, sizeof v);
}
void put_str(Bytes& b, const std::string& s) {
  put_le<uint64_t>(b, s.size());
  put(b, s.data(), s.size());
}
template <typename T>
Bytes enc(T v) {
  Bytes b;
  put_le(b, v);
  return b;
}
Bytes enc_str(const std::string& s) {
  Bytes b;
  put_str(b, s);
  return b;
}
Bytes enc_arr_str(const std::vector<std::string>& v) {
  Bytes b;
  put_le<uint32_t>(b, kStr);
  put_le<uint64_t>(b, v.size());
  for (const auto& s : v) put_str(b, s);
  return b;
}
template <typename T>
Bytes enc_arr(uint32_t elem, const std::vector<T>& v) {
  Bytes b;
  put_le<uint32_t>(b, elem);
  put_le<uint64_t>(b, v.size());
  for (T x : v) put_le(b, x);
  return b;
}

/// Bytes of a ggml tensor of `type` with ne[0] = cols and `rows` rows.
uint64_t ggml_bytes(uint32_t type, int64_t rows, int64_t cols) {
  const GgmlTypeSize ts = ggml_type_size(type);
  return uint64_t(rows) * uint64_t(cols / ts.block) * ts.bytes;
}

/// Builds a GGUF v3 (or any version) image: header, key/values, tensor infos, aligned data.
/// Fields can be overridden to build broken files on purpose.
struct GgufBuilder {
  struct Kv {
    std::string key;
    uint32_t type;
    Bytes value;
  };
  struct Tensor {
    std::string name;
    std::vector<uint64_t> ne;  ///< innermost first (GGUF order)
    uint32_t type;
    Bytes data;
    std::optional<uint64_t> offset;   ///< written instead of the real offset
    std::optional<uint32_t> n_dims;   ///< written instead of ne.size()
  };
  struct Layout {
    uint64_t kv_begin = 0, kv_end = 0, infos_end = 0, data_start = 0, size = 0;
  };

  std::string magic = "GGUF";
  uint32_t version = 3;
  uint64_t align = 32;  ///< data layout (set general.alignment to match when changing it)
  std::optional<uint64_t> n_kv, n_tensors;
  std::vector<Kv> kvs;
  Bytes raw_kv;  ///< pre-encoded entries written after kvs (raw_kv_count of them)
  uint64_t raw_kv_count = 0;
  std::vector<Tensor> tensors;

  GgufBuilder& set(const std::string& key, uint32_t type, Bytes value) {
    for (Kv& kv : kvs)
      if (kv.key == key) {
        kv.type = type;
        kv.value = std::move(value);
        return *this;
      }
    kvs.push_back({key, type, std::move(value)});
    return *this;
  }
  GgufBuilder& add(const std::string& key, uint32_t type, Bytes value) {  // duplicates allowed
    kvs.push_back({key, type, std::move(value)});
    return *this;
  }
  GgufBuilder& str(const std::string& k, const std::string& v) { return set(k, kStr, enc_str(v)); }
  GgufBuilder& u32(const std::string& k, uint32_t v) { return set(k, kU32, enc(v)); }
  GgufBuilder& f32(const std::string& k, float v) { return set(k, kF32, enc(v)); }
  GgufBuilder& boolean(const std::string& k, bool v) { return set(k, kBool, enc(uint8_t(v))); }
  void erase(const std::string& key) {
    kvs.erase(std::remove_if(kvs.begin(), kvs.end(), [&](const Kv& kv) { return kv.key == key; }), kvs.end());
  }
  /// Adds a tensor of `shape` (outermost first, as llmq writes shapes).
  Tensor& tensor(const std::string& name, const std::vector<int64_t>& shape, uint32_t type, Bytes data) {
    Tensor t{name, {}, type, std::move(data), {}, {}};
    for (auto it = shape.rbegin(); it != shape.rend(); ++it) t.ne.push_back(uint64_t(*it));
    tensors.push_back(std::move(t));
    return tensors.back();
  }
  Tensor& at(const std::string& name) {
    for (Tensor& t : tensors)
      if (t.name == name) return t;
    throw std::runtime_error("no tensor " + name);
  }
  void erase_tensor(const std::string& name) {
    tensors.erase(std::remove_if(tensors.begin(), tensors.end(), [&](const Tensor& t) { return t.name == name; }),
                  tensors.end());
  }

  Bytes build(Layout* lay = nullptr) const {
    Bytes b;
    put(b, magic.data(), magic.size());
    put_le<uint32_t>(b, version);
    put_le<uint64_t>(b, n_tensors ? *n_tensors : tensors.size());
    put_le<uint64_t>(b, n_kv ? *n_kv : kvs.size() + raw_kv_count);
    Layout l;
    l.kv_begin = b.size();
    for (const Kv& kv : kvs) {
      put_str(b, kv.key);
      put_le<uint32_t>(b, kv.type);
      put(b, kv.value.data(), kv.value.size());
    }
    put(b, raw_kv.data(), raw_kv.size());
    l.kv_end = b.size();
    std::vector<uint64_t> offs;
    uint64_t off = 0;
    for (const Tensor& t : tensors) {
      offs.push_back(off);
      off = (off + t.data.size() + align - 1) / align * align;
    }
    for (size_t i = 0; i < tensors.size(); ++i) {
      const Tensor& t = tensors[i];
      put_str(b, t.name);
      put_le<uint32_t>(b, t.n_dims ? *t.n_dims : uint32_t(t.ne.size()));
      for (uint64_t d : t.ne) put_le<uint64_t>(b, d);
      put_le<uint32_t>(b, t.type);
      put_le<uint64_t>(b, t.offset ? *t.offset : offs[i]);
    }
    l.infos_end = b.size();
    b.resize((b.size() + align - 1) / align * align, 0);
    l.data_start = b.size();
    for (size_t i = 0; i < tensors.size(); ++i) {
      b.resize(l.data_start + offs[i], 0);
      put(b, tensors[i].data.data(), tensors[i].data.size());
    }
    l.size = b.size();
    if (lay) *lay = l;
    return b;
  }
};

void write_file(const std::string& path, const Bytes& b) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(b.data()), std::streamsize(b.size()));
  if (!out) throw std::runtime_error("cannot write " + path);
}

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// ---------------------------------------------------------------- tensor data

/// A random finite fp16 value of either sign with magnitude up to `max`, spanning many
/// binades (fp16 subnormals included), and sometimes exactly zero.
uint16_t random_half(std::mt19937& rng, float max) {
  std::uniform_int_distribution<int> e(-24, 0), pick(0, 31);
  std::uniform_real_distribution<float> m(0.5f, 1.0f);
  if (pick(rng) == 0) return 0;
  const float v = std::ldexp(m(rng), e(rng)) * max * (pick(rng) & 1 ? -1.0f : 1.0f);
  return fp32_to_fp16(v);
}

/// Positions of the fp16 fields in one block of a quantized ggml type.
std::vector<size_t> half_fields(uint32_t type) {
  switch (type) {
    case tQ4_0: case tQ5_0: case tQ8_0: return {0};
    case tQ4_1: case tQ5_1: case tQ4_K: case tQ5_K: return {0, 2};
    case tQ6_K: return {208};
    case tQ3_K: return {108};
    case tQ2_K: return {80, 82};
    case tIQ4_NL: return {0};
    default: return {};
  }
}

/// `n` weights of `type` as raw random blocks: random quant bits, finite random fp16 scales
/// (F16/BF16: random finite values).
Bytes random_blocks(uint32_t type, int64_t n, std::mt19937& rng, float max_scale = 0.05f) {
  const GgmlTypeSize ts = ggml_type_size(type);
  Bytes b(uint64_t(n / ts.block) * ts.bytes);
  for (auto& x : b) x = uint8_t(rng());
  auto store = [&](size_t at, uint16_t h) { std::memcpy(&b[at], &h, 2); };
  if (type == tF16) {
    for (size_t i = 0; i < b.size(); i += 2) store(i, random_half(rng, 4.0f));
  } else if (type == tBF16) {
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (size_t i = 0; i < b.size(); i += 2) store(i, fp32_to_bf16(nd(rng)));
  } else if (type == tF32) {
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (size_t i = 0; i < b.size(); i += 4) {
      const float f = nd(rng);
      std::memcpy(&b[i], &f, 4);
    }
  } else {
    for (size_t blk = 0; blk < b.size(); blk += ts.bytes)
      for (size_t f : half_fields(type)) store(blk + f, random_half(rng, max_scale));
  }
  return b;
}

/// Encodes fp32 rows `x` [rows, cols] as `type` (our types through quantize_row).
Bytes encode_rows(DType type, const std::vector<float>& x, int64_t cols) {
  const size_t rb = row_bytes(type, cols);
  const int64_t rows = int64_t(x.size()) / cols;
  Bytes out(rb * size_t(rows));
  for (int64_t r = 0; r < rows; ++r) quantize_row(type, x.data() + r * cols, out.data() + size_t(r) * rb, cols);
  return out;
}

/// Data for a tensor of `type` and shape [rows, cols]: our types quantize random weights,
/// others are random blocks (unsupported types: random bytes of the right size).
Bytes tensor_data(uint32_t type, int64_t rows, int64_t cols, std::mt19937& rng) {
  if (dtype_known(type)) {
    std::normal_distribution<float> nd(0.0f, 0.5f);
    std::vector<float> x(size_t(rows * cols));
    for (float& v : x) v = nd(rng);
    return encode_rows(DType(type), x, cols);
  }
  if (dtype_known(type) || !half_fields(type).empty()) return random_blocks(type, rows * cols, rng);  // finite scales
  Bytes b(ggml_bytes(type, rows, cols));
  for (auto& x : b) x = uint8_t(rng());
  return b;
}

// ---------------------------------------------------------------- models

/// A small Llama model as GGUF: hyper-parameters, an 8-token SentencePiece-style vocabulary,
/// and every tensor of the table in the type `types` gives it (default F32; norms F32).
struct TinySpec {
  int64_t dim = 32, hidden = 64, layers = 1, heads = 2, kv_heads = 1, context = 64;
  bool tied = false;
  std::map<std::string, uint32_t> types;  ///< tensor kind ("attn_q", "token_embd", ...) -> ggml type
  uint32_t file_type = 7;                 ///< general.file_type (u32); ~0u: no key
};

GgufBuilder tiny_model(const TinySpec& s, uint32_t seed = 1) {
  std::mt19937 rng(seed);
  GgufBuilder g;
  const std::vector<std::string> tokens{"<unk>", "<s>", "</s>", "\xe2\x96\x81" "a", "\xe2\x96\x81" "b", "a", "b", "c"};
  g.str("general.architecture", "llama").str("general.name", "tiny");
  g.u32("llama.context_length", uint32_t(s.context)).u32("llama.embedding_length", uint32_t(s.dim));
  g.u32("llama.feed_forward_length", uint32_t(s.hidden)).u32("llama.block_count", uint32_t(s.layers));
  g.u32("llama.attention.head_count", uint32_t(s.heads)).u32("llama.attention.head_count_kv", uint32_t(s.kv_heads));
  g.f32("llama.attention.layer_norm_rms_epsilon", 1e-5f).f32("llama.rope.freq_base", 10000.0f);
  if (s.file_type != ~0u) g.u32("general.file_type", s.file_type);
  g.str("tokenizer.ggml.model", "llama");
  g.set("tokenizer.ggml.tokens", kArr, enc_arr_str(tokens));
  g.set("tokenizer.ggml.scores", kArr, enc_arr<float>(kF32, {0, 0, 0, -1, -2, -3, -4, -5}));
  g.set("tokenizer.ggml.token_type", kArr, enc_arr<int32_t>(kI32, {2, 3, 3, 1, 1, 1, 1, 1}));
  g.u32("tokenizer.ggml.bos_token_id", 1).u32("tokenizer.ggml.eos_token_id", 2).u32("tokenizer.ggml.unknown_token_id", 0);
  const int64_t V = int64_t(tokens.size()), hd = s.dim / s.heads, qd = s.heads * hd, kvd = s.kv_heads * hd;
  auto type_of = [&](const std::string& kind) {
    auto it = s.types.find(kind);
    return it == s.types.end() ? tF32 : it->second;
  };
  auto mat = [&](const std::string& name, const std::string& kind, int64_t rows, int64_t cols) {
    const uint32_t t = type_of(kind);
    g.tensor(name, {rows, cols}, t, tensor_data(t, rows, cols, rng));
  };
  auto norm = [&](const std::string& name) { g.tensor(name, {s.dim}, tF32, tensor_data(tF32, 1, s.dim, rng)); };
  mat("token_embd.weight", "token_embd", V, s.dim);
  for (int64_t i = 0; i < s.layers; ++i) {
    norm(layer_tensor(i, "attn_norm"));
    mat(layer_tensor(i, "attn_q"), "attn_q", qd, s.dim);
    mat(layer_tensor(i, "attn_k"), "attn_k", kvd, s.dim);
    mat(layer_tensor(i, "attn_v"), "attn_v", kvd, s.dim);
    mat(layer_tensor(i, "attn_output"), "attn_output", s.dim, qd);
    norm(layer_tensor(i, "ffn_norm"));
    mat(layer_tensor(i, "ffn_gate"), "ffn_gate", s.hidden, s.dim);
    mat(layer_tensor(i, "ffn_up"), "ffn_up", s.hidden, s.dim);
    mat(layer_tensor(i, "ffn_down"), "ffn_down", s.dim, s.hidden);
  }
  norm("output_norm.weight");
  if (!s.tied) mat("output.weight", "output", V, s.dim);
  return g;
}

/// The default mixed-type tiny model: every type llmq reads from a GGUF with 32-weight blocks.
TinySpec mixed_spec() {
  TinySpec s;
  s.types = {{"token_embd", tQ8_0}, {"attn_q", tQ8_0}, {"attn_k", tQ4_0}, {"attn_v", tQ4_1}, {"attn_output", tF16},
             {"ffn_gate", tBF16},   {"ffn_up", tQ5_0}, {"ffn_down", tQ5_1}, {"output", tF32}};
  return s;
}

/// stories260K (llama2.c) written as a GGUF: llama keys, tokenizer.ggml.* from tok512.bin,
/// tensors F32, or (q8) Q8_0 where the row length allows and F16 elsewhere, quantized with
/// our quantize_row (so they match test::stories("q8_0")).
GgufBuilder stories_gguf_builder(bool q8) {
  const SourceModel src = read_llama2c(test::shared("models/stories260K/stories260K.bin"));
  const Vocab voc = read_llama2c_tokenizer(test::shared("models/stories260K/tok512.bin"), int32_t(src.config.vocab_size));
  const ModelConfig& c = src.config;
  GgufBuilder g;
  g.str("general.architecture", "llama").str("general.name", "stories260K");
  g.u32("llama.context_length", uint32_t(c.context_length)).u32("llama.embedding_length", uint32_t(c.dim));
  g.u32("llama.feed_forward_length", uint32_t(c.hidden_dim)).u32("llama.block_count", uint32_t(c.n_layers));
  g.u32("llama.attention.head_count", uint32_t(c.n_heads)).u32("llama.attention.head_count_kv", uint32_t(c.n_kv_heads));
  g.u32("llama.rope.dimension_count", uint32_t(c.head_dim));
  g.f32("llama.attention.layer_norm_rms_epsilon", float(c.norm_eps)).f32("llama.rope.freq_base", float(c.rope_theta));
  g.u32("general.file_type", q8 ? 7 : 0);
  g.str("tokenizer.ggml.model", "llama");
  g.set("tokenizer.ggml.tokens", kArr, enc_arr_str(voc.tokens));
  g.set("tokenizer.ggml.scores", kArr, enc_arr<float>(kF32, voc.scores));
  g.set("tokenizer.ggml.token_type", kArr, enc_arr<int32_t>(kI32, voc.types));
  g.u32("tokenizer.ggml.bos_token_id", uint32_t(voc.bos_id)).u32("tokenizer.ggml.eos_token_id", uint32_t(voc.eos_id));
  g.u32("tokenizer.ggml.unknown_token_id", uint32_t(voc.unk_id));
  g.boolean("tokenizer.ggml.add_bos_token", voc.add_bos).boolean("tokenizer.ggml.add_space_prefix", voc.add_space_prefix);
  for (const TensorSpec& spec : tensor_table(c)) {
    const SourceTensor* st = nullptr;
    for (const SourceTensor& t : src.tensors)
      if (t.name == spec.name) st = &t;
    REQUIRE(st != nullptr);
    std::vector<float> x(size_t(st->numel()));
    st->read(x.data());
    const int64_t cols = spec.shape.back();
    DType type = DType::F32;
    if (q8 && spec.shape.size() == 2) type = row_fits(DType::Q8_0, cols) ? DType::Q8_0 : DType::F16;
    g.tensor(spec.name, spec.shape, uint32_t(type), encode_rows(type, x, cols));
  }
  return g;
}
Bytes stories_gguf(bool q8) { return stories_gguf_builder(q8).build(); }

// ---------------------------------------------------------------- running the tools

struct Outcome {
  int code;
  std::string err;
};

/// Runs a built tool under `timeout 20` with a 4 GiB address-space cap (not under
/// AddressSanitizer, whose shadow memory needs more); stdout discarded.
Outcome run_tool(const std::string& tool, const std::string& args, const std::string& errfile) {
#ifdef __SANITIZE_ADDRESS__
  const std::string cap = "";
#else
  const std::string cap = "ulimit -v 4194304; ";
#endif
  const std::string cmd = "(" + cap + "exec timeout -k 2 20 " + test::bin(tool) + " " + args + ") >/dev/null 2>'" +
                          errfile + "'";
  Outcome o{test::run(cmd), ""};
  o.err = slurp(errfile);
  return o;
}

Outcome convert(const std::string& in, const std::string& out, const std::string& errfile) {
  return run_tool("llmq-convert", "'" + in + "' -o '" + out + "' --no-progress", errfile);
}

bool dir_empty(const std::string& dir) { return fs::is_empty(dir); }

/// Bit-exact equality of float arrays; returns the number of differing elements.
size_t bit_mismatches(const float* a, const float* b, size_t n) {
  size_t bad = 0;
  for (size_t i = 0; i < n; ++i) bad += std::memcmp(&a[i], &b[i], 4) != 0;
  return bad;
}

/// Greedy decode from BOS (one token per forward pass), recording each step's logits.
std::vector<int32_t> greedy(const Model& m, int64_t n, std::vector<std::vector<float>>* logits) {
  ThreadPool pool(2);
  Session s(m, pool, n);
  std::vector<int32_t> ids{m.vocab.bos_id};
  while (int64_t(ids.size()) < n) {
    const float* l = s.forward(&ids.back(), 1);
    logits->emplace_back(l, l + m.config.vocab_size);
    ids.push_back(Sampler::argmax(l, m.config.vocab_size));
  }
  return ids;
}

/// Path of the SmolLM2 GGUF fetched by scripts/fetch_models.sh (models/ of this repository).
std::string smollm2_path() {
  return (fs::path(__FILE__).parent_path().parent_path() / "models" / "smollm2-135m-instruct-q4_1.gguf").string();
}

}  // namespace

// ================================================================ dequantization vs gguf-py

TEST_CASE("ggml dequantization is bit-identical to gguf-py's for Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL (and our types)",
          "[gguf][dequant]") {
  const std::string dir = test::scratch("gguf-py");
  const std::string venv = dir + "/venv";
  const std::string log = dir + "/pip.log";
  const int rc = test::run("timeout 60 python3 -m venv '" + venv + "' >'" + log + "' 2>&1 && timeout 120 '" + venv +
                           "/bin/pip' install --quiet --disable-pip-version-check --timeout 20 --retries 1 gguf numpy >>'" +
                           log + "' 2>&1");
  if (rc != 0) {
    WARN("SKIPPED: could not install the gguf Python package (pip or network unavailable):\n" + slurp(log));
    return;
  }
  const std::vector<uint32_t> types{tQ5_0, tQ5_1, tQ2_K, tQ3_K, tIQ4_NL, tQ4_K, tQ5_K, tQ6_K, tQ8_0, tQ4_0, tQ4_1, tF16, tBF16};
  std::mt19937 rng(20240521);
  std::map<uint32_t, Bytes> inputs;
  std::string ids;
  for (uint32_t t : types) {
    const int64_t n = 256 * 96;  // 96 K-quant super-blocks, 768 32-weight blocks
    inputs[t] = random_blocks(t, n, rng, 2.0f);
    write_file(dir + "/in_" + std::to_string(t) + ".bin", inputs[t]);
    ids.push_back(' ');
    ids.append(std::to_string(t));
  }
  write_file(dir + "/deq.py", [] {
    const std::string py =
        "import sys\n"
        "import numpy as np\n"
        "from gguf.quants import dequantize\n"
        "from gguf.constants import GGMLQuantizationType\n"
        "d = sys.argv[1]\n"
        "for t in map(int, sys.argv[2:]):\n"
        "    raw = np.fromfile(f'{d}/in_{t}.bin', dtype=np.uint8).reshape(1, -1)\n"
        "    out = np.asarray(dequantize(raw, GGMLQuantizationType(t)), dtype=np.float32)\n"
        "    out.tofile(f'{d}/out_{t}.bin')\n";
    return Bytes(py.begin(), py.end());
  }());
  REQUIRE(test::run("'" + venv + "/bin/python' '" + dir + "/deq.py' '" + dir + "'" + ids + " 2>'" + dir + "/py.err'") == 0);
  for (uint32_t t : types) {
    INFO("type " << ggml_type_size(t).name);
    const Bytes& in = inputs[t];
    const int64_t n = 256 * 96;
    std::vector<float> ours(static_cast<size_t>(n)), theirs(static_cast<size_t>(n));
    // Decode in rows of 1024 from a misaligned copy too, to exercise the any-alignment promise.
    Bytes shifted(in.size() + 1);
    std::memcpy(shifted.data() + 1, in.data(), in.size());
    const uint64_t rb = ggml_bytes(t, 1, 1024);
    for (int64_t r = 0; r < n / 1024; ++r)
      ggml_dequantize_row(t, shifted.data() + 1 + uint64_t(r) * rb, ours.data() + r * 1024, 1024);
    const std::string py_out = slurp(dir + "/out_" + std::to_string(t) + ".bin");
    REQUIRE(py_out.size() == size_t(n) * 4);
    std::memcpy(theirs.data(), py_out.data(), py_out.size());
    CHECK(bit_mismatches(ours.data(), theirs.data(), size_t(n)) == 0);
    size_t nonzero = 0;
    for (float v : ours) nonzero += v != 0.0f;
    CHECK(nonzero > size_t(n) / 2);  // the random blocks really exercise the decoder
  }
}

TEST_CASE("ggml_dequantize_row rejects unsupported types and partial blocks", "[gguf][dequant]") {
  std::vector<uint8_t> buf(4096);
  std::vector<float> out(1024);
  CHECK_THROWS_AS(ggml_dequantize_row(tQ8_K, buf.data(), out.data(), 256), UsageError);
  CHECK_THROWS_AS(ggml_dequantize_row(tQ4_K, buf.data(), out.data(), 128), UsageError);
  CHECK_THROWS_AS(ggml_dequantize_row(tQ5_0, buf.data(), out.data(), 33), UsageError);
  CHECK(dtype_known(tQ6_K));
  CHECK(dtype_known(tBF16));
  CHECK_FALSE(dtype_known(tQ8_1));
  CHECK_FALSE(dtype_known(tF64));
}

// ================================================================ stories260K through GGUF

TEST_CASE("stories260K as GGUF (F32) converts to the same model as the llama2.c route", "[gguf]") {
  const std::string dir = test::scratch("gguf-stories");
  const std::string gguf = dir + "/stories260K-f32.gguf", out = dir + "/from-gguf.llmq";
  write_file(gguf, stories_gguf(false));
  const Outcome o = convert(gguf, out, dir + "/err");
  INFO(o.err);
  REQUIRE(o.code == 0);

  const auto a = LlmqFile::open(out);
  const auto b = LlmqFile::open(test::stories("f32"));
  CHECK(a->meta().get_string("general.source.format") == "GGUF v3 (F32)");
  CHECK(a->meta().get_string("general.source.file") == "stories260K-f32.gguf");  // the name, not the scratch path
  // Same hyper-parameters and vocabulary as the llama2.c route.
  const ModelConfig ca = ModelConfig::from_metadata(a->meta()), cb = ModelConfig::from_metadata(b->meta());
  CHECK(ca.dim == cb.dim);
  CHECK(ca.hidden_dim == cb.hidden_dim);
  CHECK(ca.n_layers == cb.n_layers);
  CHECK(ca.n_heads == cb.n_heads);
  CHECK(ca.n_kv_heads == cb.n_kv_heads);
  CHECK(ca.head_dim == cb.head_dim);
  CHECK(ca.vocab_size == cb.vocab_size);
  CHECK(ca.context_length == cb.context_length);
  CHECK(ca.tied_embeddings == cb.tied_embeddings);
  CHECK(ca.rope_layout == cb.rope_layout);
  CHECK(float(ca.norm_eps) == float(cb.norm_eps));
  CHECK(ca.rope_theta == cb.rope_theta);
  const Vocab va = vocab_from_metadata(a->meta()), vb = vocab_from_metadata(b->meta());
  CHECK(va.tokens == vb.tokens);
  CHECK(va.scores == vb.scores);
  CHECK(va.types == vb.types);
  CHECK(va.bos_id == vb.bos_id);
  CHECK(va.eos_id == vb.eos_id);
  CHECK(va.unk_id == vb.unk_id);
  CHECK(va.add_bos == vb.add_bos);
  CHECK(va.add_space_prefix == vb.add_space_prefix);
  // Every tensor byte-identical.
  REQUIRE(a->tensors().size() == b->tensors().size());
  for (const TensorInfo& t : a->tensors()) {
    const TensorInfo* u = b->find(t.name);
    REQUIRE(u != nullptr);
    CHECK(t.type == u->type);
    CHECK(t.shape == u->shape);
    REQUIRE(t.nbytes == u->nbytes);
    CHECK(std::memcmp(a->data(t), b->data(*u), t.nbytes) == 0);
  }

  // Same logits (within 1e-5) and the same 64 greedy tokens.
  auto ma = Model::load(out), mb = Model::load(test::stories("f32"));
  std::vector<std::vector<float>> la, lb;
  const auto ta = greedy(*ma, 64, &la), tb = greedy(*mb, 64, &lb);
  CHECK(ta == tb);
  REQUIRE(la.size() == lb.size());
  double worst = 0;
  for (size_t s = 0; s < la.size(); ++s)
    for (size_t j = 0; j < la[s].size(); ++j) worst = std::max(worst, double(std::fabs(la[s][j] - lb[s][j])));
  CHECK(worst <= 1e-5);
}

TEST_CASE("stories260K as GGUF (Q8_0) repacks byte for byte and equals the llama2.c Q8_0 route", "[gguf]") {
  const std::string dir = test::scratch("gguf-stories-q8");
  const std::string gguf = dir + "/stories260K-q8_0.gguf", out = dir + "/from-gguf.llmq";
  write_file(gguf, stories_gguf(true));
  const Outcome o = convert(gguf, out, dir + "/err");
  INFO(o.err);
  REQUIRE(o.code == 0);
  const auto g = GgufFile::open(gguf);
  const auto a = LlmqFile::open(out);
  const auto b = LlmqFile::open(test::stories("q8_0"));
  CHECK(a->meta().get_string("general.source.format") == "GGUF v3 (Q8_0)");
  int q8 = 0;
  REQUIRE(a->tensors().size() == g->tensors().size());
  for (const TensorInfo& t : a->tensors()) {
    INFO(t.name);
    const GgufTensor* s = g->find_tensor(t.name);
    REQUIRE(s != nullptr);
    CHECK(uint32_t(t.type) == s->type);
    CHECK(t.shape == s->shape);
    REQUIRE(t.nbytes == s->nbytes);
    CHECK(std::memcmp(a->data(t), s->data, t.nbytes) == 0);
    q8 += t.type == DType::Q8_0;
    const TensorInfo* u = b->find(t.name);  // and the llama2.c route quantized the same way
    REQUIRE(u != nullptr);
    CHECK(u->type == t.type);
    REQUIRE(u->nbytes == t.nbytes);
    CHECK(std::memcmp(a->data(t), b->data(*u), t.nbytes) == 0);
  }
  CHECK(q8 >= 30);
  auto ma = Model::load(out), mb = Model::load(test::stories("q8_0"));
  std::vector<std::vector<float>> la, lb;
  CHECK(greedy(*ma, 64, &la) == greedy(*mb, 64, &lb));
  CHECK(la == lb);
}

// ================================================================ every supported tensor type

TEST_CASE("GGUF tensors of every supported type convert as byte copies", "[gguf]") {
  const std::string dir = test::scratch("gguf-types");
  struct Variant {
    const char* name;
    TinySpec spec;
    const char* format;
  };
  TinySpec kq;
  kq.dim = 256, kq.hidden = 256, kq.heads = 4, kq.kv_heads = 2, kq.file_type = ~0u;
  kq.types = {{"token_embd", tQ6_K}, {"attn_q", tQ4_K}, {"attn_k", tQ5_K}, {"attn_v", tQ3_K}, {"attn_output", tQ5_0},
              {"ffn_gate", tQ5_1},   {"ffn_up", tIQ4_NL}, {"ffn_down", tQ2_K}, {"output", tQ6_K}};
  TinySpec tied = mixed_spec();
  tied.tied = true;
  for (const Variant& v : {Variant{"mixed", mixed_spec(), "GGUF v3 (Q8_0)"}, Variant{"kquants", kq, "GGUF v3 (Q5_0)"},
                           Variant{"tied", tied, "GGUF v3 (Q8_0)"}}) {
    SECTION(v.name) {
      const std::string gguf = dir + "/" + v.name + ".gguf", out = dir + "/" + v.name + ".llmq";
      write_file(gguf, tiny_model(v.spec, 7).build());
      const Outcome o = convert(gguf, out, dir + "/err");
      INFO(o.err);
      REQUIRE(o.code == 0);
      const auto g = GgufFile::open(gguf);
      const auto f = LlmqFile::open(out);
      CHECK(f->meta().get_string("general.source.format") == v.format);
      CHECK(f->meta().get_bool("llama.tied_embeddings", false) == v.spec.tied);
      CHECK((f->find("output.weight") == nullptr) == v.spec.tied);
      REQUIRE(f->tensors().size() == g->tensors().size());
      const SourceModel src = read_gguf_model(gguf);
      for (const SourceTensor& st : src.tensors) {
        INFO(st.name);
        const GgufTensor* s = g->find_tensor(st.name);
        const TensorInfo* t = f->find(st.name);
        REQUIRE(s != nullptr);
        REQUIRE(t != nullptr);
        CHECK(t->shape == s->shape);
        const int64_t cols = s->shape.back(), rows = st.numel() / cols;
        // What the GGUF says, decoded by ggml_dequantize_row, and what read() gives.
        std::vector<float> want(size_t(st.numel())), got(size_t(st.numel()));
        for (int64_t r = 0; r < rows; ++r)
          ggml_dequantize_row(s->type, s->data + uint64_t(r) * (s->nbytes / uint64_t(rows)), want.data() + r * cols, cols);
        st.read(got.data());
        CHECK(bit_mismatches(want.data(), got.data(), want.size()) == 0);
        if (dtype_known(s->type)) {  // ours: byte copy
          REQUIRE(st.raw != nullptr);
          CHECK(uint32_t(st.raw_type) == s->type);
          CHECK(std::memcmp(st.raw, s->data, s->nbytes) == 0);
          CHECK(uint32_t(t->type) == s->type);
          REQUIRE(t->nbytes == s->nbytes);
          CHECK(std::memcmp(f->data(*t), s->data, s->nbytes) == 0);
        } else {  // dequantized, then stored as F16
          CHECK(st.raw == nullptr);
          CHECK(t->type == DType::F16);
          CHECK(f->data(*t) != nullptr);
          const Bytes want16 = encode_rows(DType::F16, want, cols);
          REQUIRE(t->nbytes == want16.size());
          CHECK(std::memcmp(f->data(*t), want16.data(), want16.size()) == 0);
        }
      }
      auto m = Model::load(out);  // it loads and runs
      std::vector<std::vector<float>> l;
      CHECK(greedy(*m, 4, &l).size() == 4);
    }
  }
}

// ================================================================ llmq-run -m model.gguf

TEST_CASE("llmq-run loads a GGUF through one cached lossless conversion", "[gguf][tools]") {
  const std::string dir = test::scratch("gguf-cache");
  const std::string cache = dir + "/cache", gguf = dir + "/tiny.gguf", llmq = dir + "/tiny.llmq";
  write_file(gguf, tiny_model(mixed_spec(), 11).build());
  REQUIRE(convert(gguf, llmq, dir + "/conv.err").code == 0);
  auto run = [&](const std::string& model, const std::string& tag) {
    const test::CachedRun r = test::run_with_cache(cache, model, "hello world", 6, dir + "/" + tag);
    return std::make_tuple(r.code, r.out, r.err);
  };
  const auto [c0, want, e0] = run(llmq, "direct");
  REQUIRE(c0 == 0);
  const auto [c1, first, e1] = run(gguf, "first");
  INFO(e1);
  REQUIRE(c1 == 0);
  CHECK(first == want);  // the same tokens as the converted file
  CHECK(e1.find("converted") != std::string::npos);
  REQUIRE(llmq::test::files_with_extension(cache, ".llmq") == 1);
  const auto [c2, second, e2] = run(gguf, "second");
  CHECK(c2 == 0);
  CHECK(second == want);
  CHECK(e2.find("converted") == std::string::npos);  // loaded from the cache
  // Three processes at once on a new GGUF (MPI ranks): one converts, the others wait for it.
  write_file(gguf, tiny_model(mixed_spec(), 14).build());
  const std::string cmd = "LLMQ_CACHE='" + cache + "' timeout 30 " + test::bin("llmq-run") + " -m '" + gguf + "' -p hi -n 2 -t 1";
  REQUIRE(test::run("(" + cmd + " >/dev/null 2>'" + dir + "/p1.err' & " + cmd + " >/dev/null 2>'" + dir + "/p2.err' & " + cmd +
                    " >/dev/null 2>'" + dir + "/p3.err' & wait)") == 0);
  int conversions = 0;
  for (const char* f : {"/p1.err", "/p2.err", "/p3.err"}) conversions += slurp(dir + f).find("converted") != std::string::npos;
  CHECK(conversions == 1);
  CHECK(llmq::test::files_with_extension(cache, ".llmq") == 2);
  // A changed GGUF is a new cache entry; a broken one exits 2 and leaves nothing behind.
  write_file(gguf, tiny_model(mixed_spec(), 12).build());
  CHECK(std::get<0>(run(gguf, "changed")) == 0);
  CHECK(llmq::test::files_with_extension(cache, ".llmq") == 3);
  const Bytes whole = tiny_model(mixed_spec(), 13).build();
  write_file(gguf, Bytes(whole.begin(), whole.begin() + long(whole.size() / 2)));
  const auto [c3, o3, e3] = run(gguf, "broken");
  CHECK(c3 == 2);
  CHECK(e3.find("tiny.gguf") != std::string::npos);
  CHECK(llmq::test::files_with_extension(cache, ".llmq") == 3);
}

// ================================================================ SmolLM2-135M-Instruct

TEST_CASE("SmolLM2-135M-Instruct Q4_1 GGUF repacks losslessly with its metadata", "[gguf][smollm2]") {
  const std::string gguf = smollm2_path();
  if (!fs::exists(gguf)) {
    WARN("SKIPPED: " + gguf + " is missing (scripts/fetch_models.sh downloads it)");
    return;
  }
  const std::string dir = test::scratch("gguf-smollm2");
  const std::string out = dir + "/smollm2.llmq";
  const Outcome o = convert(gguf, out, dir + "/err");
  INFO(o.err);
  REQUIRE(o.code == 0);
  const auto g = GgufFile::open(gguf);
  const auto f = LlmqFile::open(out);
  const SourceModel src = read_gguf_model(gguf);
  CHECK(src.format == "GGUF v3 (Q4_1)");

  // Every tensor: same type and shape, byte-identical, and its values bit for bit.
  REQUIRE(f->tensors().size() == 272);
  REQUIRE(src.tensors.size() == 272);
  std::map<DType, int> per_type;
  std::vector<float> a, b;
  for (const SourceTensor& st : src.tensors) {
    INFO(st.name);
    const GgufTensor* s = g->find_tensor(st.name);
    const TensorInfo* t = f->find(st.name);
    REQUIRE(s != nullptr);
    REQUIRE(t != nullptr);
    CHECK(uint32_t(t->type) == s->type);
    CHECK(t->shape == s->shape);
    REQUIRE(t->nbytes == s->nbytes);
    CHECK(std::memcmp(f->data(*t), s->data, s->nbytes) == 0);
    ++per_type[t->type];
    a.resize(size_t(st.numel()));
    b.resize(size_t(st.numel()));
    st.read(a.data());
    const int64_t cols = t->cols(), rows = t->rows();
    const size_t rb = row_bytes(t->type, cols);
    for (int64_t r = 0; r < rows; ++r) dequantize_row(t->type, f->data(*t) + size_t(r) * rb, b.data() + r * cols, cols);
    CHECK(bit_mismatches(a.data(), b.data(), a.size()) == 0);
  }
  CHECK(per_type[DType::Q8_0] == 1);
  CHECK(per_type[DType::Q4_1] == 210);
  CHECK(per_type[DType::F32] == 61);

  // Metadata carried over.
  const ModelConfig c = ModelConfig::from_metadata(f->meta());
  CHECK(c.dim == 576);
  CHECK(c.n_layers == 30);
  CHECK(c.n_heads == 9);
  CHECK(c.n_kv_heads == 3);
  CHECK(c.head_dim == 64);
  CHECK(c.hidden_dim == 1536);
  CHECK(c.vocab_size == 49152);
  CHECK(c.context_length == 8192);
  CHECK(c.rope_theta == 100000.0);
  CHECK(float(c.norm_eps) == 1e-5f);
  CHECK(c.tied_embeddings);
  CHECK(c.rope_layout == RopeLayout::Interleaved);
  const Vocab v = vocab_from_metadata(f->meta());
  const Vocab gv = vocab_from_gguf(*g);
  CHECK(v.model == "gpt2");
  CHECK(v.tokens.size() == 49152);
  CHECK(v.tokens == gv.tokens);
  CHECK(v.types == gv.types);
  CHECK(v.merges.size() == 48900);
  CHECK(v.merges == gv.merges);
  CHECK(v.bos_id == 1);
  CHECK(v.eos_id == 2);
  CHECK(v.bos_id == gv.bos_id);
  CHECK(v.eos_id == gv.eos_id);
  CHECK(v.add_bos == gv.add_bos);
  const std::string tmpl = f->meta().get_string("tokenizer.chat_template", "");
  CHECK(tmpl == g->find("tokenizer.chat_template")->s);
  CHECK(tmpl.find("<|im_start|>") != std::string::npos);

  // llmq-info reads both files; its JSON totals add up.
  for (const std::string& file : {gguf, out}) {
    INFO(file);
    REQUIRE(fs::exists(test::bin("llmq-info")));
    const std::string js = dir + "/info.json";
    REQUIRE(test::run(test::bin("llmq-info") + " --json '" + file + "' >'" + js + "' 2>'" + dir + "/info.err'") == 0);
    const auto j = nlohmann::json::parse(slurp(js));
    CHECK(j["tensors"].size() == 272);
    CHECK(j["totals"]["tensors"] == 272);
    uint64_t bytes = 0;
    for (const auto& t : j["tensors"]) bytes += t["bytes"].get<uint64_t>();
    CHECK(j["totals"]["bytes"].get<uint64_t>() == bytes);
    CHECK(j["totals"]["weights"].get<uint64_t>() == 134515008);
    CHECK(j["totals"]["bits_per_weight"].get<double>() == Approx(8.0 * double(bytes) / 134515008.0));
    CHECK(j["format"] == (file == gguf ? "GGUF" : "LLMQ"));
    bool saw_tokens = false;
    for (const auto& e : j["metadata"])
      if (e["key"] == (file == gguf ? "tokenizer.ggml.tokens" : "tokenizer.tokens")) {
        saw_tokens = true;
        CHECK(e["length"] == 49152);
        CHECK(e["first"][0] == "<|endoftext|>");
      }
    CHECK(saw_tokens);
    REQUIRE(test::run(test::bin("llmq-info") + " '" + file + "' >'" + dir + "/info.txt' 2>&1") == 0);
    const std::string text = slurp(dir + "/info.txt");
    CHECK(text.find("token_embd.weight") != std::string::npos);
    CHECK(text.find("\u2026") != std::string::npos);  // the long chat template is cut
    CHECK(text.find("272 tensors") != std::string::npos);
  }
}

// ================================================================ hostile files

namespace {

/// One bad file: its bytes, words its error message must contain, and whether llmq-info (which
/// reads any GGUF container) must reject it too.
struct BadCase {
  std::string name;
  Bytes bytes;
  std::vector<std::string> says;
  bool container = false;
};

/// A key/value entry as raw bytes (for entries the builder cannot express).
Bytes raw_entry(const std::string& key, uint32_t type, const Bytes& value) {
  Bytes b = enc_str(key);
  put_le<uint32_t>(b, type);
  put(b, value.data(), value.size());
  return b;
}

/// An array value nested `levels` deep around one u32.
Bytes nested_array(int levels) {
  Bytes inner;
  put_le<uint32_t>(inner, kU32);
  put_le<uint64_t>(inner, 1);
  put_le<uint32_t>(inner, 7);
  for (int l = 1; l < levels; ++l) {
    Bytes outer;
    put_le<uint32_t>(outer, kArr);
    put_le<uint64_t>(outer, 1);
    put(outer, inner.data(), inner.size());
    inner = std::move(outer);
  }
  return inner;
}

std::vector<BadCase> hostile_cases() {
  std::vector<BadCase> cs;
  const GgufBuilder base = tiny_model(mixed_spec(), 3);
  GgufBuilder::Layout lay;
  const Bytes good = base.build(&lay);
  auto with = [&](const std::string& name, auto edit, std::vector<std::string> says = {}, bool container = false) {
    GgufBuilder g = base;
    edit(g);
    cs.push_back({name, g.build(), std::move(says), container});
  };

  // Truncations at many points through every section.
  std::vector<uint64_t> cuts{0, 1, 3, 4, 6, 8, 12, 16, 20, 23, lay.kv_begin + 3, lay.kv_begin + 9, lay.kv_begin + 13};
  for (int k = 1; k <= 7; ++k) cuts.push_back(lay.kv_begin + (lay.kv_end - lay.kv_begin) * uint64_t(k) / 8);
  for (int k = 0; k <= 4; ++k) cuts.push_back(lay.kv_end + (lay.infos_end - lay.kv_end) * uint64_t(k) / 5);
  for (uint64_t c : {lay.infos_end - 1, lay.infos_end, lay.data_start, lay.data_start + 1,
                     lay.data_start + (lay.size - lay.data_start) / 3, lay.data_start + (lay.size - lay.data_start) / 2,
                     lay.size - 100, lay.size - 1})
    cuts.push_back(c);
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  for (uint64_t c : cuts) cs.push_back({"truncated at " + std::to_string(c), Bytes(good.begin(), good.begin() + long(c)), {}, true});

  // Header.
  with("bad magic", [](GgufBuilder& g) { g.magic = "GGUX"; }, {}, true);
  with("version 1", [](GgufBuilder& g) { g.version = 1; }, {"version 1"}, true);
  with("version 4", [](GgufBuilder& g) { g.version = 4; }, {"version 4"}, true);
  with("absurd kv count", [](GgufBuilder& g) { g.n_kv = uint64_t(1) << 60; }, {"count"}, true);
  with("absurd tensor count", [](GgufBuilder& g) { g.n_tensors = uint64_t(1) << 60; }, {"count"}, true);
  with("kv count one too many", [](GgufBuilder& g) { g.n_kv = g.kvs.size() + 1; }, {}, true);
  with("tensor count one too many", [](GgufBuilder& g) { g.n_tensors = g.tensors.size() + 1; }, {}, true);
  with("tensor count too small", [](GgufBuilder& g) { g.n_tensors = 1; }, {"missing tensor"});

  // Key/value section.
  auto raw = [&](const std::string& name, Bytes entry, std::vector<std::string> says = {}) {
    with(name, [&](GgufBuilder& g) {
      g.raw_kv = entry;
      g.raw_kv_count = 1;
    }, says, true);
  };
  {
    Bytes b;
    put_le<uint64_t>(b, uint64_t(1) << 40);
    raw("key length past the end", b, {"past the end"});
    Bytes c;
    put_le<uint64_t>(c, ~uint64_t(0));
    raw("key length 2^64-1", c);
  }
  {
    Bytes v;
    put_le<uint64_t>(v, uint64_t(1) << 40);
    raw("string value length past the end", raw_entry("general.description", kStr, v), {"past the end"});
  }
  {
    Bytes v;
    put_le<uint32_t>(v, kU32);
    put_le<uint64_t>(v, uint64_t(1) << 40);
    raw("array length past the end", raw_entry("x.array", kArr, v), {"array length"});
    Bytes w;
    put_le<uint32_t>(w, kStr);
    put_le<uint64_t>(w, uint64_t(1) << 61);
    raw("string array count absurd", raw_entry("x.strings", kArr, w), {"array length"});
  }
  raw("arrays nested 9 deep", raw_entry("x.deep", kArr, nested_array(9)), {"nested"});
  raw("unknown value type 13", raw_entry("x.odd", 13, enc<uint32_t>(0)), {"unknown value type"});
  raw("unknown value type 0xffffffff", raw_entry("x.odd", 0xffffffffu, enc<uint32_t>(0)), {"unknown value type"});
  {
    Bytes v;
    put_le<uint32_t>(v, 13);
    put_le<uint64_t>(v, 1);
    raw("unknown array element type", raw_entry("x.arr", kArr, v), {"unknown array element type"});
  }
  raw("bool value 2", raw_entry("x.flag", kBool, enc<uint8_t>(2)), {"bool"});
  raw("empty key", raw_entry("", kU32, enc<uint32_t>(1)), {"empty key"});
  with("duplicate key", [](GgufBuilder& g) { g.add("general.name", kStr, enc_str("again")); }, {"duplicate key"}, true);
  with("general.alignment 0", [](GgufBuilder& g) { g.u32("general.alignment", 0); }, {"alignment"}, true);
  with("general.alignment 3", [](GgufBuilder& g) { g.u32("general.alignment", 3); }, {"alignment"}, true);
  with("general.alignment 2^20", [](GgufBuilder& g) { g.u32("general.alignment", 1u << 20); }, {"alignment"}, true);
  with("general.alignment a string", [](GgufBuilder& g) { g.str("general.alignment", "32"); }, {"alignment"}, true);

  // Tensor infos.
  {  // the first tensor info's name length (the u64 right after the key/values)
    Bytes b = good;
    const uint64_t big = uint64_t(1) << 40;
    std::memcpy(&b[lay.kv_end], &big, 8);
    cs.push_back({"tensor name length past the end", b, {"past the end"}, true});
  }
  with("empty tensor name", [](GgufBuilder& g) { g.at("blk.0.attn_q.weight").name = ""; }, {"empty name"}, true);
  with("unknown ggml type 99", [](GgufBuilder& g) { g.at("blk.0.attn_q.weight").type = 99; }, {"unknown ggml type 99"}, true);
  with("unknown ggml type 16", [](GgufBuilder& g) { g.at("blk.0.attn_k.weight").type = 16; }, {"unknown ggml type"}, true);
  with("n_dims 0", [](GgufBuilder& g) { g.at("blk.0.attn_q.weight").n_dims = 0; }, {"dimensions"}, true);
  with("n_dims 5", [](GgufBuilder& g) { g.at("blk.0.attn_q.weight").n_dims = 5; }, {"dimensions"}, true);
  with("dimension 0", [](GgufBuilder& g) { g.at("blk.0.attn_q.weight").ne[1] = 0; }, {"dimension 0"}, true);
  with("dimension 2^50", [](GgufBuilder& g) { g.at("blk.0.attn_q.weight").ne[1] = uint64_t(1) << 50; }, {"out of range"}, true);
  with("element count absurd", [](GgufBuilder& g) {
    auto& t = g.at("blk.0.attn_q.weight");
    t.ne = {32, uint64_t(1) << 40, uint64_t(1) << 40};
  }, {"absurdly large"}, true);
  with("row length not a multiple of the block", [](GgufBuilder& g) { g.at("blk.0.attn_q.weight").ne[0] = 48; }, {"not a multiple"}, true);
  with("Q4_K row of 32", [](GgufBuilder& g) { g.at("blk.0.attn_q.weight").type = tQ4_K; }, {"Q4_K"}, true);
  with("tensor offset past the end", [](GgufBuilder& g) { g.at("output.weight").offset = uint64_t(1) << 40; }, {"past the end"}, true);
  with("tensor offset near 2^64", [](GgufBuilder& g) { g.at("output.weight").offset = ~uint64_t(31); }, {"past the end"}, true);
  with("unaligned tensor offset", [](GgufBuilder& g) { g.at("blk.0.attn_k.weight").offset = 16; }, {"not aligned"}, true);
  with("overlapping tensors", [](GgufBuilder& g) { g.tensors[3].offset = 0; }, {"overlap"}, true);
  with("duplicate tensor name", [](GgufBuilder& g) { g.at("blk.0.attn_k.weight").name = "blk.0.attn_q.weight"; }, {"duplicate tensor"}, true);

  // A valid container that is not a usable llama model.
  with("missing architecture", [](GgufBuilder& g) { g.erase("general.architecture"); }, {"general.architecture"});
  with("architecture gpt-neox", [](GgufBuilder& g) { g.str("general.architecture", "gpt-neox"); }, {"gpt-neox"});
  with("architecture not a string", [](GgufBuilder& g) { g.u32("general.architecture", 1); }, {"general.architecture"});
  with("missing embedding_length", [](GgufBuilder& g) { g.erase("llama.embedding_length"); }, {"llama.embedding_length"});
  with("embedding_length a string", [](GgufBuilder& g) { g.str("llama.embedding_length", "32"); }, {"llama.embedding_length"});
  with("missing block_count", [](GgufBuilder& g) { g.erase("llama.block_count"); }, {"llama.block_count"});
  with("missing rms epsilon", [](GgufBuilder& g) { g.erase("llama.attention.layer_norm_rms_epsilon"); }, {"epsilon"});
  with("head_count 0", [](GgufBuilder& g) { g.u32("llama.attention.head_count", 0); }, {"n_heads"});
  with("head_count an array", [](GgufBuilder& g) {
    g.set("llama.attention.head_count", kArr, enc_arr<uint32_t>(kU32, {2}));
  }, {"head_count"});
  with("head_count_kv not dividing", [](GgufBuilder& g) { g.u32("llama.attention.head_count_kv", 3); }, {"n_kv_heads"});
  with("odd key_length", [](GgufBuilder& g) { g.u32("llama.attention.key_length", 15); }, {"head_dim"});
  with("value_length differs", [](GgufBuilder& g) { g.u32("llama.attention.value_length", 8); }, {"value_length"});
  with("partial rope", [](GgufBuilder& g) { g.u32("llama.rope.dimension_count", 8); }, {"dimension_count"});
  with("block_count 2^31", [](GgufBuilder& g) { g.u32("llama.block_count", 1u << 31); }, {"n_layers"});
  with("context_length 0", [](GgufBuilder& g) { g.u32("llama.context_length", 0); }, {"context_length"});
  with("negative rms epsilon", [](GgufBuilder& g) { g.f32("llama.attention.layer_norm_rms_epsilon", -1.0f); }, {"norm_eps"});
  with("rope freq_base NaN", [](GgufBuilder& g) { g.f32("llama.rope.freq_base", std::nanf("")); }, {"freq_base"});
  with("rope scaling yarn", [](GgufBuilder& g) {  // linear and llama3 are read; YaRN is not (yet)
    g.str("llama.rope.scaling.type", "yarn").f32("llama.rope.scaling.factor", 4.0f);
  }, {"yarn"});
  with("vocab_size differs from the tokens", [](GgufBuilder& g) { g.u32("llama.vocab_size", 9); }, {"vocab_size"});
  with("missing tokenizer model", [](GgufBuilder& g) { g.erase("tokenizer.ggml.model"); }, {"tokenizer.ggml.model"});
  with("missing tokens", [](GgufBuilder& g) { g.erase("tokenizer.ggml.tokens"); }, {"tokenizer.ggml.tokens"});
  with("scores of the wrong length", [](GgufBuilder& g) {
    g.set("tokenizer.ggml.scores", kArr, enc_arr<float>(kF32, {0, 0, 0}));
  }, {"scores"});
  with("token_type of f32", [](GgufBuilder& g) {
    g.set("tokenizer.ggml.token_type", kArr, enc_arr<float>(kF32, {1, 1, 1, 1, 1, 1, 1, 1}));
  }, {"token_type"});
  with("chat template not a string", [](GgufBuilder& g) { g.u32("tokenizer.chat_template", 5); }, {"chat_template"});
  // Issue 22 item 8: tokenizer metadata the loader would refuse is refused before writing.
  // (Special-token ids out of range are read as absent, as llama.cpp reads them: not an error.)
  with("token type out of range", [](GgufBuilder& g) {
    g.set("tokenizer.ggml.token_type", kArr, enc_arr<int32_t>(kI32, {1, 1, 1, 9, 1, 1, 1, 1}));
  }, {"type"});
  with("token types of the wrong length", [](GgufBuilder& g) {
    g.set("tokenizer.ggml.token_type", kArr, enc_arr<int32_t>(kI32, {1, 1, 1}));
  }, {"token_type"});
  with("missing required tensor", [](GgufBuilder& g) { g.erase_tensor("blk.0.ffn_up.weight"); }, {"blk.0.ffn_up.weight"});
  with("missing token_embd", [](GgufBuilder& g) { g.erase_tensor("token_embd.weight"); }, {"token_embd.weight"});
  with("wrong tensor shape", [](GgufBuilder& g) {
    auto& t = g.at("blk.0.attn_q.weight");
    t.ne = {32, 16};
    t.data.resize(ggml_bytes(t.type, 16, 32));
  }, {"blk.0.attn_q.weight", "shape"});
  with("token_embd rows differ from the vocabulary", [](GgufBuilder& g) {
    auto& t = g.at("token_embd.weight");
    t.ne = {32, 9};
    t.data.resize(ggml_bytes(t.type, 9, 32));
  }, {"token_embd.weight"});
  with("norm stored as 2-D", [](GgufBuilder& g) { g.at("output_norm.weight").ne = {32, 1}; }, {"output_norm.weight"});
  with("unexpected extra tensor", [](GgufBuilder& g) {
    std::mt19937 rng(5);
    g.tensor("blk.0.attn_q_norm.weight", {32}, tF32, tensor_data(tF32, 1, 32, rng));  // QK-norm: not llama
  }, {"blk.0.attn_q_norm.weight"});
  with("attention bias in one layer only", [](GgufBuilder& g) {
    std::mt19937 rng(6);
    g.tensor("blk.0.attn_q.bias", {32}, tF32, tensor_data(tF32, 1, 32, rng));
  }, {"blk.0.attn_k.bias"});
  with("rope_freqs of the wrong length", [](GgufBuilder& g) {
    g.tensor("rope_freqs.weight", {6}, tF32, encode_rows(DType::F32, std::vector<float>(6, 2.0f), 6));
  }, {"rope.freq_factors"});
  with("rope_freqs with a zero", [](GgufBuilder& g) {
    std::vector<float> f(8, 1.0f);
    f[7] = 0.0f;
    g.tensor("rope_freqs.weight", {8}, tF32, encode_rows(DType::F32, f, 8));
  }, {"rope.freq_factors"});
  with("unsupported type Q8_1", [](GgufBuilder& g) {
    auto& t = g.at("blk.0.attn_q.weight");
    t.type = tQ8_1;
    t.data.resize(ggml_bytes(tQ8_1, 32, 32));
  }, {"blk.0.attn_q.weight", "Q8_1", "cannot convert"});
  with("unsupported type F64", [](GgufBuilder& g) {
    auto& t = g.at("blk.0.attn_output.weight");
    t.type = tF64;
    t.data.resize(ggml_bytes(tF64, 32, 32));
  }, {"blk.0.attn_output.weight", "F64", "cannot convert"});
  {  // Q8_K (llama.cpp's activation type, never a weight here) needs 256-wide rows: a 256-wide model
    TinySpec s;
    s.dim = 256, s.hidden = 256, s.heads = 4, s.kv_heads = 2;
    s.types = {{"attn_q", tQ8_K}, {"token_embd", tQ8_0}, {"attn_k", tQ8_0}, {"attn_v", tQ8_0}, {"attn_output", tQ8_0},
               {"ffn_gate", tQ8_0}, {"ffn_up", tQ8_0}, {"ffn_down", tQ8_0}, {"output", tQ8_0}};
    cs.push_back({"unsupported type Q8_K", tiny_model(s, 4).build(), {"blk.0.attn_q.weight", "Q8_K", "cannot convert"}});
    s.types["attn_q"] = tQ4_K;  // a Q4_K tensor whose scale is NaN: the dequantized weights cannot be stored
    GgufBuilder g = tiny_model(s, 4);
    const uint16_t nan16 = 0x7e00;
    std::memcpy(g.at("blk.0.attn_q.weight").data.data(), &nan16, 2);
    cs.push_back({"Q4_K with a NaN scale", g.build(), {"blk.0.attn_q.weight"}});
    s.types["attn_q"] = tQ3_K;  // a Q3_K tensor (kept as it is) whose d is NaN
    GgufBuilder g3 = tiny_model(s, 4);
    std::memcpy(g3.at("blk.0.attn_q.weight").data.data() + 108, &nan16, 2);
    cs.push_back({"Q3_K with a NaN scale", g3.build(), {"blk.0.attn_q.weight", "not finite"}});
  }
  return cs;
}

}  // namespace

TEST_CASE("hostile GGUF files: llmq-convert and llmq-info exit 2, name the file, leave nothing", "[gguf][badfiles]") {
  REQUIRE(fs::exists(test::bin("llmq-info")));
  const std::string dir = test::scratch("gguf-hostile");
  const std::string outdir = dir + "/out";
  fs::create_directories(outdir);
  const std::string out = outdir + "/out.llmq", err = dir + "/err";

  // The base file and a few valid variants convert (so the failures below are for their reason).
  {
    write_file(dir + "/good.gguf", tiny_model(mixed_spec(), 3).build());
    Outcome o = convert(dir + "/good.gguf", out, err);
    INFO(o.err);
    REQUIRE(o.code == 0);
    CHECK(run_tool("llmq-info", "'" + dir + "/good.gguf'", err).code == 0);
    fs::remove(out);
    std::vector<std::pair<std::string, GgufBuilder>> fine;
    GgufBuilder v2 = tiny_model(mixed_spec(), 3);
    v2.version = 2;
    fine.emplace_back("version 2", v2);
    GgufBuilder deep = tiny_model(mixed_spec(), 3);
    deep.set("x.deep", kArr, nested_array(8));
    fine.emplace_back("arrays nested 8 deep", deep);
    GgufBuilder al = tiny_model(mixed_spec(), 3);
    al.align = 64;
    al.u32("general.alignment", 64);
    fine.emplace_back("general.alignment 64", al);
    GgufBuilder rf = tiny_model(mixed_spec(), 3);
    rf.tensor("rope_freqs.weight", {8}, tF32, encode_rows(DType::F32, std::vector<float>(8, 1.0f), 8));
    fine.emplace_back("rope_freqs of ones", rf);
    GgufBuilder none = tiny_model(mixed_spec(), 3);
    none.str("llama.rope.scaling.type", "none");
    fine.emplace_back("rope scaling none", none);
    GgufBuilder linear = tiny_model(mixed_spec(), 3);
    linear.str("llama.rope.scaling.type", "linear").f32("llama.rope.scaling.factor", 4.0f);
    fine.emplace_back("rope scaling linear x4", linear);
    for (auto& [name, g] : fine) {
      INFO(name);
      write_file(dir + "/fine.gguf", g.build());
      o = convert(dir + "/fine.gguf", out, err);
      INFO(o.err);
      CHECK(o.code == 0);
      fs::remove(out);
    }
  }

  const std::vector<BadCase> cases = hostile_cases();
  CHECK(cases.size() >= 100);
  int info_runs = 0;
  for (const BadCase& c : cases) {
    INFO("case: " << c.name);
    const std::string file = dir + "/bad.gguf";
    write_file(file, c.bytes);
    const Outcome o = convert(file, out, err);
    INFO("stderr: " << o.err);
    CHECK(o.code == 2);
    CHECK(o.err.find(file) != std::string::npos);
    CHECK(o.err.find("error") != std::string::npos);
    for (const std::string& w : c.says) CHECK(o.err.find(w) != std::string::npos);
    CHECK(dir_empty(outdir));
    for (const auto& e : fs::directory_iterator(outdir)) fs::remove_all(e.path());
    if (c.container) {
      const Outcome i = run_tool("llmq-info", "'" + file + "'", err);
      INFO("llmq-info stderr: " << i.err);
      CHECK(i.code == 2);
      CHECK(i.err.find(file) != std::string::npos);
      ++info_runs;
    }
  }
  CHECK(info_runs >= 50);
  WARN(cases.size() << " hostile GGUF files rejected by llmq-convert with exit 2; " << info_runs << " also by llmq-info");
}

TEST_CASE("a seeded sweep of 100 random byte mutations of a GGUF ends in exit 0 or 2", "[gguf][badfiles]") {
  const std::string dir = test::scratch("gguf-sweep");
  const std::string outdir = dir + "/out";
  fs::create_directories(outdir);
  const std::string out = outdir + "/out.llmq", err = dir + "/err";
  GgufBuilder::Layout lay;
  const Bytes good = tiny_model(mixed_spec(), 9).build(&lay);
  std::mt19937 rng(424242);
  int ok = 0, bad = 0;
  for (int k = 0; k < 100; ++k) {
    Bytes b = good;
    const int flips = 1 + int(rng() % 3);
    std::string what;
    for (int f = 0; f < flips; ++f) {
      // Mostly the header, key/values and tensor infos, sometimes anywhere.
      const uint64_t limit = rng() % 5 == 0 ? b.size() : lay.data_start;
      const uint64_t at = rng() % limit;
      const uint8_t v = uint8_t(rng());
      what += " [" + std::to_string(at) + "]=" + std::to_string(v);
      b[at] = v;
    }
    INFO("mutation " << k << ":" << what);
    const std::string file = dir + "/m.gguf";
    write_file(file, b);
    const Outcome o = convert(file, out, err);
    INFO("stderr: " << o.err);
    CHECK((o.code == 0 || o.code == 2));
    if (o.code == 2) {
      CHECK(o.err.find(file) != std::string::npos);
      CHECK_FALSE(fs::exists(out));
      ++bad;
    } else {
      ++ok;
    }
    for (const auto& e : fs::directory_iterator(outdir)) fs::remove_all(e.path());
    if (k % 4 == 0) {
      const int ic = run_tool("llmq-info", "'" + file + "'", err).code;
      CHECK((ic == 0 || ic == 2));
    }
  }
  WARN("random mutations: " << ok << " converted, " << bad << " rejected with exit 2");
}

TEST_CASE("GGUF attention biases (attn_{q,k,v,output}.bias) are carried into the .llmq and applied", "[gguf]") {
  // The engine's arithmetic with biases is checked against a NumPy reference in test_hf.cpp;
  // here: a llama GGUF with biases converts with them (bytes unchanged, config flags set),
  // they change the logits, and a file with some layers' biases missing is refused.
  const std::string dir = test::scratch("gguf-bias");
  const ModelConfig c = read_llama2c(test::shared("models/stories260K/stories260K.bin")).config;
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 0.3f);
  auto with_biases = [&](int64_t layers) {
    GgufBuilder g = stories_gguf_builder(false);
    for (int64_t l = 0; l < layers; ++l)
      for (const auto& [what, n] : std::initializer_list<std::pair<const char*, int64_t>>{
               {"attn_q", c.q_dim()}, {"attn_k", c.kv_dim()}, {"attn_v", c.kv_dim()}, {"attn_output", c.dim}}) {
        std::vector<float> b(static_cast<size_t>(n));
        for (float& x : b) x = nd(rng);
        g.tensor(layer_bias(l, what), {n}, tF32, encode_rows(DType::F32, b, n));
      }
    return g;
  };
  const GgufBuilder g = with_biases(c.n_layers);
  const std::string gguf = dir + "/bias.gguf", out = dir + "/bias.llmq";
  write_file(gguf, g.build());
  const Outcome o = convert(gguf, out, dir + "/err");
  INFO(o.err);
  REQUIRE(o.code == 0);
  auto m = Model::load(out);
  CHECK(m->config.attn_qkv_bias);
  CHECK(m->config.attn_out_bias);
  for (const auto& t : g.tensors) {
    if (t.name.find(".bias") == std::string::npos) continue;
    const TensorInfo* u = m->file->find(t.name);
    REQUIRE(u != nullptr);
    CHECK(u->type == DType::F32);
    REQUIRE(u->nbytes == t.data.size());
    CHECK(std::memcmp(m->file->data(*u), t.data.data(), t.data.size()) == 0);
  }
  auto plain = Model::load(test::stories("f32"));
  std::vector<std::vector<float>> lb, lp;
  greedy(*m, 8, &lb);
  greedy(*plain, 8, &lp);
  double diff = 0;
  for (size_t j = 0; j < lb[0].size(); ++j) diff = std::max(diff, double(std::fabs(lb[0][j] - lp[0][j])));
  CHECK(diff > 1e-2);

  write_file(dir + "/partial.gguf", with_biases(2).build());
  const Outcome bad = convert(dir + "/partial.gguf", dir + "/partial.llmq", dir + "/err2");
  CHECK(bad.code == 2);
  CHECK(bad.err.find("blk.2.attn_q.bias") != std::string::npos);
  CHECK_FALSE(fs::exists(dir + "/partial.llmq"));
}

// Issue 22 item 9: metadata arrays cost their bytes, not ~96 bytes per element. A GGUF with a
// 48-million-element u8 array (48 MB) is read by llmq-info and llmq-convert under the tools'
// 4 GiB address-space cap (before: ~4.6 GB of values, out of memory).
TEST_CASE("GGUF: a huge metadata array costs its bytes, not 96 bytes per element", "[gguf]") {
  const std::string dir = test::scratch("gguf_big_array");
  GgufBuilder g = tiny_model(mixed_spec(), 3);
  g.set("general.big_array", kArr, enc_arr<uint8_t>(kU8, std::vector<uint8_t>(size_t(48) << 20, 7)));
  const std::string file = dir + "/big.gguf", out = dir + "/big.llmq", err = dir + "/err.txt";
  write_file(file, g.build());
  const Outcome info = run_tool("llmq-info", "'" + file + "'", err);
  INFO("llmq-info: " << info.err);
  CHECK(info.code == 0);
  const Outcome conv = convert(file, out, err);
  INFO("llmq-convert: " << conv.err);
  CHECK(conv.code == 0);
}

// llama.cpp's Q4_K_M / Q5_K_M choice per tensor (formats/readers/convert.h QuantMix): the output
// in Q6_K, attn_v and ffn_down in Q6_K where use_more_bits picks (counted in file order), the
// rest in the base type; K-quants that do not fit a row take llama.cpp's stand-ins.
TEST_CASE("K-quant mixes choose llama.cpp's type per tensor", "[gguf][convert]") {
  // use_more_bits for 24 layers: the first and last three, and every third in between.
  std::vector<int> picked;
  for (int i = 0; i < 24; ++i)
    if (use_more_bits(i, 24)) picked.push_back(i);
  CHECK(picked == std::vector<int>{0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23});
  CHECK(k_quant_fallback(DType::Q2_K) == DType::Q4_0);
  CHECK(k_quant_fallback(DType::Q3_K) == DType::Q4_0);
  CHECK(k_quant_fallback(DType::Q4_K) == DType::Q5_0);
  CHECK(k_quant_fallback(DType::Q5_K) == DType::Q5_1);
  CHECK(k_quant_fallback(DType::Q6_K) == DType::Q8_0);
  CHECK(k_quant_fallback(DType::Q8_0) == DType::Q8_0);
  CHECK_FALSE(quant_mix_from_name("q4_k").has_value());
  ConvertOptions o;
  o.mix = quant_mix_from_name("q4_k_m");
  REQUIRE(o.mix);
  o.mix_types = {{"blk.0.attn_v.weight", DType::Q6_K}};
  auto type_of = [&](const std::string& name, int64_t cols, bool tied = false) {
    SourceTensor t;
    t.name = name;
    t.shape = {64, cols};
    o.tied_output = tied;
    bool fb = false;
    const DType d = choose_type(t, o, &fb);
    CHECK_FALSE(fb);
    return d;
  };
  CHECK(type_of("blk.0.attn_q.weight", 512) == DType::Q4_K);
  CHECK(type_of("blk.0.attn_q.weight", 896) == DType::Q5_0);  // 896 is no multiple of 256
  CHECK(type_of("blk.0.attn_v.weight", 512) == DType::Q6_K);
  CHECK(type_of("blk.1.attn_v.weight", 512) == DType::Q4_K);
  CHECK(type_of("output.weight", 512) == DType::Q6_K);
  CHECK(type_of("output.weight", 640) == DType::Q8_0);
  CHECK(type_of("token_embd.weight", 512) == DType::Q4_K);
  CHECK(type_of("token_embd.weight", 512, true) == DType::Q6_K);  // tied: the embedding is the output
  o.mix = quant_mix_from_name("Q5_K_M");
  CHECK(type_of("blk.1.ffn_up.weight", 768) == DType::Q5_K);
  CHECK(type_of("blk.1.ffn_up.weight", 800) == DType::Q5_1);
}

// The per-role rules of each mix (QuantMix), over a 32-layer model whose tensors come in layer
// order: Q4_K_M's use_more_bits, Q3_K_M's first layers in Q5_K, Q2_K's GQA switch.
TEST_CASE("K-quant mixes: attn_v, ffn_down and attn_output per layer, as llama.cpp's quantizer", "[gguf][convert]") {
  std::vector<SourceTensor> ts;
  for (int i = 0; i < 32; ++i)
    for (const char* role : {"attn_q", "attn_v", "attn_output", "ffn_down"}) {
      SourceTensor t;
      t.name = "blk." + std::to_string(i) + "." + role + ".weight";
      t.file_order = int64_t(ts.size());
      ts.push_back(t);
    }
  auto type = [](const std::map<std::string, DType>& m, const std::string& name) {
    const auto it = m.find(name);
    return it == m.end() ? std::optional<DType>() : std::optional<DType>(it->second);
  };
  const auto q4 = mix_tensor_types(*quant_mix_from_name("q4_k_m"), ts, 8);
  CHECK(type(q4, "blk.0.attn_v.weight") == DType::Q6_K);
  CHECK(type(q4, "blk.4.attn_v.weight") == std::nullopt);  // the base type
  CHECK(type(q4, "blk.6.ffn_down.weight") == DType::Q6_K);  // (6 − 4) % 3 == 2
  CHECK(type(q4, "blk.6.attn_output.weight") == std::nullopt);
  const auto q3 = mix_tensor_types(*quant_mix_from_name("q3_k_m"), ts, 8);
  CHECK(type(q3, "blk.1.attn_v.weight") == DType::Q5_K);
  CHECK(type(q3, "blk.2.attn_v.weight") == DType::Q4_K);
  CHECK(type(q3, "blk.1.ffn_down.weight") == DType::Q5_K);  // i < 32 / 16
  CHECK(type(q3, "blk.2.ffn_down.weight") == DType::Q4_K);
  CHECK(type(q3, "blk.31.attn_output.weight") == DType::Q4_K);
  CHECK(type(q3, "blk.0.attn_q.weight") == std::nullopt);  // Q3_K
  const auto q2 = mix_tensor_types(*quant_mix_from_name("q2_k"), ts, 8);
  CHECK(type(q2, "blk.9.attn_v.weight") == DType::Q4_K);
  CHECK(type(q2, "blk.9.ffn_down.weight") == DType::Q3_K);
  CHECK(type(q2, "blk.9.attn_output.weight") == DType::Q3_K);
  CHECK(type(mix_tensor_types(*quant_mix_from_name("q2_k"), ts, 1), "blk.9.attn_v.weight") == DType::Q3_K);
}
