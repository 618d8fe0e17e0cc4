#include "formats/readers/llama2c.h"

#include <cstring>

#include "base/error.h"
#include "base/mapped_file.h"

namespace llmq {

namespace {

int32_t read_i32(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Lays out tensors sequentially from `offset`, in the order they are added.
struct Layout {
  std::shared_ptr<MappedFile> map;
  std::string path;
  uint64_t offset;
  SourceModel* out;

  // An fp32 tensor [shape] at the current offset.
  void add_f32(const std::string& name, std::vector<int64_t> shape) {
    SourceTensor t;
    t.name = name;
    t.shape = shape;
    const uint64_t off = offset, n = uint64_t(t.numel());
    auto m = map;
    t.read = [m, off, n](float* dst) { std::memcpy(dst, m->data() + off, n * 4); };
    t.raw_type = DType::F32;
    t.raw = map->data() + off;
    offset += n * 4;
    out->tensors.push_back(std::move(t));
  }
  // An int8 tensor with fp32 scales per group (llama2.c v2): q[numel] then s[numel / group].
  void add_q8(const std::string& name, std::vector<int64_t> shape, int64_t group) {
    SourceTensor t;
    t.name = name;
    t.shape = shape;
    const uint64_t off = offset, n = uint64_t(t.numel());
    if (n % uint64_t(group) != 0)
      throw FileError(path, "tensor " + name + " (" + std::to_string(n) + " weights) is not a multiple of group size " +
                                std::to_string(group));
    auto m = map;
    t.read = [m, off, n, group](float* dst) {
      const auto* q = reinterpret_cast<const int8_t*>(m->data() + off);
      const uint8_t* s = m->data() + off + n;
      for (uint64_t i = 0; i < n; ++i) {
        float scale;
        std::memcpy(&scale, s + (i / uint64_t(group)) * 4, 4);
        dst[i] = float(q[i]) * scale;
      }
    };
    offset += n + n / uint64_t(group) * 4;
    out->tensors.push_back(std::move(t));
  }
};

}  // namespace

namespace {

// A llama2.c checkpoint's header: legacy (version 0: 7 int32 params, 28 bytes; a negative vocab
// size means an untied classifier) or "ak42" v1 (fp32) / v2 (int8 per group), 256 bytes.
struct Llama2cHeader {
  int version = 0;
  uint64_t bytes = 28;
  bool shared = false;  // tied classifier
  int32_t group = 0;    // v2's quantization group
  ModelConfig config;
};

Llama2cHeader read_header(const MappedFile& map, const std::string& path) {
  const uint8_t* b = map.data();
  if (map.size() < 28) throw FileError(path, "too short for a llama2.c checkpoint header");
  Llama2cHeader h;
  const uint8_t* params = b;
  uint32_t magic;
  std::memcpy(&magic, b, 4);
  if (magic == 0x616b3432u) {  // "ak42"
    if (map.size() < 256) throw FileError(path, "truncated llama2.c v1/v2 header (256 bytes expected)");
    h.version = read_i32(b + 4);
    if (h.version != 1 && h.version != 2)
      throw FileError(path, "unsupported llama2.c checkpoint version " + std::to_string(h.version) + " (1 and 2 are read)");
    params = b + 8;
    h.shared = b[36] != 0;
    if (b[36] > 1) throw FileError(path, "shared_classifier flag must be 0 or 1");
    if (h.version == 2) {
      h.group = read_i32(b + 37);
      if (h.group <= 0 || h.group > (1 << 20)) throw FileError(path, "absurd group size " + std::to_string(h.group));
    }
    h.bytes = 256;
  }
  ModelConfig& c = h.config;
  c.dim = read_i32(params);
  c.hidden_dim = read_i32(params + 4);
  c.n_layers = read_i32(params + 8);
  c.n_heads = read_i32(params + 12);
  c.n_kv_heads = read_i32(params + 16);
  const int32_t vocab = read_i32(params + 20);
  c.context_length = read_i32(params + 24);
  if (h.version == 0) h.shared = vocab > 0;
  c.vocab_size = vocab < 0 ? -int64_t(vocab) : vocab;
  c.head_dim = c.n_heads > 0 ? c.dim / c.n_heads : 0;
  c.tied_embeddings = h.shared;
  c.rope_layout = RopeLayout::Interleaved;
  c.norm_eps = 1e-5;
  c.rope_theta = 10000.0;
  try {
    c.validate();
    if (c.head_dim * c.n_heads != c.dim) throw UsageError("dim is not a multiple of n_heads");
  } catch (const UsageError& e) {
    throw FileError(path, std::string("not a valid llama2.c checkpoint: ") + e.what());
  }
  return h;
}

// The file size the header implies, in 128-bit arithmetic so absurd (validated but huge) headers
// cannot wrap. Throws FileError past 2^50 bytes.
uint64_t expected_size(const Llama2cHeader& h, const std::string& path) {
  using u128 = unsigned __int128;
  const ModelConfig& c = h.config;
  const u128 L = u128(c.n_layers), D = u128(c.dim), Hd = u128(c.hidden_dim), V = u128(c.vocab_size);
  const u128 QD = u128(c.q_dim()), KVD = u128(c.kv_dim()), S = u128(c.context_length);
  const u128 mats = L * (QD * D + 2 * KVD * D + D * QD + 3 * Hd * D) + V * D * (h.shared ? 1 : 2);
  const u128 norms = L * 2 * D + D;
  u128 expected = h.bytes;
  if (h.version == 2) {
    expected += norms * 4 + mats + mats / u128(h.group) * 4;
  } else {
    expected += (norms + mats) * 4;
    if (h.version == 0) expected += 2 * S * u128(c.head_dim / 2) * 4;  // legacy RoPE tables (unused)
  }
  if (expected > u128(uint64_t(1) << 50)) throw FileError(path, "header describes an absurdly large model");
  return uint64_t(expected);
}

// The tensors in the file's order: legacy puts the embedding first and the RoPE tables before
// the classifier; v1/v2 the norms first, v2's matrices int8 per group.
void lay_out(Layout& lay, const Llama2cHeader& h) {
  const ModelConfig& c = h.config;
  auto per_layer = [&](const char* what, std::vector<int64_t> shape, bool quant) {
    for (int64_t i = 0; i < c.n_layers; ++i) {
      if (quant) lay.add_q8(layer_tensor(i, what), shape, h.group);
      else lay.add_f32(layer_tensor(i, what), shape);
    }
  };
  auto matrix = [&](const char* name, std::vector<int64_t> shape, bool quant) {
    if (quant) lay.add_q8(name, shape, h.group);
    else lay.add_f32(name, shape);
  };
  const std::vector<int64_t> q_shape{c.q_dim(), c.dim}, kv_shape{c.kv_dim(), c.dim}, o_shape{c.dim, c.q_dim()};
  const std::vector<int64_t> up_shape{c.hidden_dim, c.dim}, down_shape{c.dim, c.hidden_dim}, emb{c.vocab_size, c.dim};
  const bool q = h.version == 2;
  if (h.version == 0) {
    lay.add_f32("token_embd.weight", emb);
    per_layer("attn_norm", {c.dim}, false);
  } else {
    per_layer("attn_norm", {c.dim}, false);
    per_layer("ffn_norm", {c.dim}, false);
    lay.add_f32("output_norm.weight", {c.dim});
    matrix("token_embd.weight", emb, q);
  }
  per_layer("attn_q", q_shape, q);
  per_layer("attn_k", kv_shape, q);
  per_layer("attn_v", kv_shape, q);
  per_layer("attn_output", o_shape, q);
  if (h.version == 0) per_layer("ffn_norm", {c.dim}, false);
  per_layer("ffn_gate", up_shape, q);    // w1
  per_layer("ffn_down", down_shape, q);  // w2
  per_layer("ffn_up", up_shape, q);      // w3
  if (h.version == 0) {
    lay.add_f32("output_norm.weight", {c.dim});
    lay.offset += 2 * uint64_t(c.context_length) * uint64_t(c.head_dim / 2) * 4;  // skip freq_cis_real, freq_cis_imag
  }
  if (!h.shared) matrix("output.weight", emb, q);
}

}  // namespace

SourceModel read_llama2c(const std::string& path) {
  auto map = MappedFile::open(path);
  const Llama2cHeader h = read_header(*map, path);
  SourceModel sm;
  sm.config = h.config;
  sm.format = h.version == 0 ? "llama2.c legacy" : h.version == 1 ? "llama2.c v1" : "llama2.c v2 (int8, group " + std::to_string(h.group) + ")";
  const uint64_t expected = expected_size(h, path);
  if (map->size() != expected)
    throw FileError(path, "size " + std::to_string(map->size()) + " bytes does not match its header (" + std::to_string(expected) +
                              " bytes expected for " + sm.format + "): truncated or not a llama2.c checkpoint");
  Layout lay{map, path, h.bytes, &sm};
  lay_out(lay, h);
  if (lay.offset != expected) throw FileError(path, "internal layout error");
  sm.keepalive = map;
  return sm;
}

}  // namespace llmq
