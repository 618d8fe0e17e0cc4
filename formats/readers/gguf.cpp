#include "formats/readers/gguf.h"

#include <algorithm>
#include <cstring>

#include "base/error.h"
#include "formats/llmq_file.h"  // MetadataError

namespace llmq {

const char* gguf_type_name(GgufType t) {
  static const char* names[] = {"u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool", "string", "array", "u64", "i64", "f64"};
  const auto i = uint32_t(t);
  return i < 13 ? names[i] : "unknown";
}

namespace {
uint64_t min_size(GgufType t);
}  // namespace

GgufValue GgufValue::element(uint64_t k) const {
  if (type != GgufType::ARRAY || k >= count) throw MetadataError("GGUF: array element " + std::to_string(k) + " out of range");
  if (elem == GgufType::ARRAY) return arr[size_t(k)];
  GgufValue e;
  e.type = elem;
  if (elem == GgufType::STRING) {
    e.s = strs[size_t(k)];
    return e;
  }
  const uint64_t size = min_size(elem);
  uint64_t bits = 0;
  std::memcpy(&bits, raw.data() + k * size, size_t(size));
  switch (elem) {
    case GgufType::I8: e.i = int8_t(bits); break;
    case GgufType::I16: e.i = int16_t(bits); break;
    case GgufType::I32: e.i = int32_t(bits); break;
    case GgufType::I64: e.i = int64_t(bits); break;
    case GgufType::F32: {
      float x;
      const auto b32 = uint32_t(bits);
      std::memcpy(&x, &b32, 4);
      e.f = x;
      break;
    }
    case GgufType::F64: std::memcpy(&e.f, &bits, 8); break;
    default: e.u = bits; break;  // unsigned integers, bool
  }
  return e;
}

bool GgufValue::is_int() const {
  switch (type) {
    case GgufType::U8: case GgufType::I8: case GgufType::U16: case GgufType::I16: case GgufType::U32:
    case GgufType::I32: case GgufType::U64: case GgufType::I64: case GgufType::BOOL: return true;
    default: return false;
  }
}

int64_t GgufValue::as_int(const std::string& key) const {
  switch (type) {
    case GgufType::U8: case GgufType::U16: case GgufType::U32: case GgufType::U64: case GgufType::BOOL:
      if (u > uint64_t(INT64_MAX)) throw MetadataError("GGUF key '" + key + "': value too large");
      return int64_t(u);
    case GgufType::I8: case GgufType::I16: case GgufType::I32: case GgufType::I64: return i;
    default: throw MetadataError("GGUF key '" + key + "' is a " + gguf_type_name(type) + ", not an integer");
  }
}

double GgufValue::as_float(const std::string& key) const {
  if (type == GgufType::F32 || type == GgufType::F64) return f;
  if (is_int()) return double(as_int(key));
  throw MetadataError("GGUF key '" + key + "' is a " + gguf_type_name(type) + ", not a number");
}

const std::string& GgufValue::as_string(const std::string& key) const {
  if (type != GgufType::STRING) throw MetadataError("GGUF key '" + key + "' is a " + gguf_type_name(type) + ", not a string");
  return s;
}

GgmlTypeSize ggml_type_size(uint32_t type) {
  switch (type) {
    case 0: return {1, 4, "F32"};
    case 1: return {1, 2, "F16"};
    case 2: return {32, 18, "Q4_0"};
    case 3: return {32, 20, "Q4_1"};
    case 6: return {32, 22, "Q5_0"};
    case 7: return {32, 24, "Q5_1"};
    case 8: return {32, 34, "Q8_0"};
    case 9: return {32, 36, "Q8_1"};
    case 10: return {256, 84, "Q2_K"};
    case 11: return {256, 110, "Q3_K"};
    case 12: return {256, 144, "Q4_K"};
    case 13: return {256, 176, "Q5_K"};
    case 14: return {256, 210, "Q6_K"};
    case 15: return {256, 292, "Q8_K"};
    case 20: return {32, 18, "IQ4_NL"};
    case 24: return {1, 1, "I8"};
    case 25: return {1, 2, "I16"};
    case 26: return {1, 4, "I32"};
    case 27: return {1, 8, "I64"};
    case 28: return {1, 8, "F64"};
    case 30: return {1, 2, "BF16"};
    default: return {0, 0, nullptr};
  }
}

namespace {

// Bounds-checked little-endian cursor over the mapped file.
struct Cursor {
  const uint8_t* p;
  const uint8_t* end;
  const std::string& path;

  [[noreturn]] void fail(const std::string& what) const { throw FileError(path, "GGUF: " + what); }
  uint64_t left() const { return uint64_t(end - p); }
  void need(uint64_t n, const char* what) const {
    if (n > left()) fail(std::string("truncated while reading ") + what);
  }
  template <typename T>
  T get(const char* what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, p, sizeof v);
    p += sizeof v;
    return v;
  }
  std::string str(const char* what) {
    const uint64_t n = get<uint64_t>(what);
    if (n > left()) fail(std::string(what) + ": string length " + std::to_string(n) + " runs past the end of the file");
    std::string s(reinterpret_cast<const char*>(p), size_t(n));
    p += n;
    return s;
  }
};

// Smallest encoded size of one value of type t (used to bound array counts before reserving).
uint64_t min_size(GgufType t) {
  switch (t) {
    case GgufType::U8: case GgufType::I8: case GgufType::BOOL: return 1;
    case GgufType::U16: case GgufType::I16: return 2;
    case GgufType::U32: case GgufType::I32: case GgufType::F32: return 4;
    case GgufType::STRING: case GgufType::U64: case GgufType::I64: case GgufType::F64: return 8;
    case GgufType::ARRAY: return 12;
  }
  return 1;
}

GgufValue read_value(Cursor& c, GgufType t, const std::string& key, int depth) {
  GgufValue v;
  v.type = t;
  switch (t) {
    case GgufType::U8: v.u = c.get<uint8_t>("a value"); break;
    case GgufType::I8: v.i = c.get<int8_t>("a value"); break;
    case GgufType::U16: v.u = c.get<uint16_t>("a value"); break;
    case GgufType::I16: v.i = c.get<int16_t>("a value"); break;
    case GgufType::U32: v.u = c.get<uint32_t>("a value"); break;
    case GgufType::I32: v.i = c.get<int32_t>("a value"); break;
    case GgufType::U64: v.u = c.get<uint64_t>("a value"); break;
    case GgufType::I64: v.i = c.get<int64_t>("a value"); break;
    case GgufType::F32: v.f = c.get<float>("a value"); break;
    case GgufType::F64: v.f = c.get<double>("a value"); break;
    case GgufType::BOOL: {
      const uint8_t b = c.get<uint8_t>("a value");
      if (b > 1) c.fail("key '" + key + "': bool value " + std::to_string(b));
      v.u = b;
      break;
    }
    case GgufType::STRING: v.s = c.str("a string value"); break;
    case GgufType::ARRAY: {
      if (depth >= kGgufMaxDepth) c.fail("key '" + key + "': arrays nested deeper than " + std::to_string(kGgufMaxDepth));
      const uint32_t et = c.get<uint32_t>("an array type");
      if (et > 12) c.fail("key '" + key + "': unknown array element type " + std::to_string(et));
      v.elem = GgufType(et);
      const uint64_t n = c.get<uint64_t>("an array length");
      if (n > c.left() / min_size(v.elem))
        c.fail("key '" + key + "': array length " + std::to_string(n) + " exceeds the bytes left in the file");
      v.count = n;
      if (v.elem == GgufType::STRING) {
        v.strs.reserve(size_t(n));
        for (uint64_t k = 0; k < n; ++k) v.strs.push_back(c.str("a string value"));
      } else if (v.elem == GgufType::ARRAY) {
        v.arr.reserve(size_t(n));
        for (uint64_t k = 0; k < n; ++k) v.arr.push_back(read_value(c, v.elem, key, depth + 1));
      } else {  // numbers and bools: the file's bytes as they are (min_size is their exact size)
        const uint64_t bytes = n * min_size(v.elem);
        c.need(bytes, "an array");
        v.raw.assign(c.p, c.p + bytes);
        c.p += bytes;
        if (v.elem == GgufType::BOOL)
          for (uint8_t b : v.raw)
            if (b > 1) c.fail("key '" + key + "': bool value " + std::to_string(b));
      }
      break;
    }
    default: c.fail("key '" + key + "': unknown value type " + std::to_string(uint32_t(t)));
  }
  return v;
}

}  // namespace

const GgufValue* GgufFile::find(const std::string& key) const {
  auto it = kv_.find(key);
  return it == kv_.end() ? nullptr : &it->second;
}

const GgufTensor* GgufFile::find_tensor(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

namespace {

// Tensor k's directory entry at c: name, 1-4 dimensions (GGUF lists the innermost first; shape
// is stored outermost first), ggml type, data offset; nbytes from the type's block size. Throws
// FileError (Cursor::fail) for an empty name, bad dimensions, an unknown type, a row length not
// a whole number of blocks, or an absurd size.
GgufTensor read_tensor_info(Cursor& c, uint64_t k) {
  GgufTensor t;
  t.name = c.str("a tensor name");
  if (t.name.empty()) c.fail("tensor " + std::to_string(k) + " has an empty name");
  const std::string who = "tensor '" + t.name + "'";
  const uint32_t nd = c.get<uint32_t>("a tensor's dimension count");
  if (nd < 1 || nd > 4) c.fail(who + ": " + std::to_string(nd) + " dimensions (1 to 4 allowed)");
  std::vector<int64_t> ne(nd);
  for (uint32_t d = 0; d < nd; ++d) {
    const uint64_t x = c.get<uint64_t>("a tensor dimension");
    if (x < 1 || x > (uint64_t(1) << 40)) c.fail(who + ": dimension " + std::to_string(x) + " out of range");
    ne[d] = int64_t(x);
  }
  t.shape.assign(ne.rbegin(), ne.rend());
  t.type = c.get<uint32_t>("a tensor type");
  const GgmlTypeSize ts = ggml_type_size(t.type);
  if (!ts.block) c.fail(who + ": unknown ggml type " + std::to_string(t.type));
  t.offset = c.get<uint64_t>("a tensor offset");
  if (ne[0] % ts.block != 0)
    c.fail(who + ": row length " + std::to_string(ne[0]) + " is not a multiple of the " + ts.name + " block (" + std::to_string(ts.block) + ")");
  unsigned __int128 bytes = (unsigned __int128)(uint64_t(ne[0]) / uint64_t(ts.block)) * ts.bytes;
  for (uint32_t d = 1; d < nd; ++d) bytes *= uint64_t(ne[d]);
  if (bytes > ((unsigned __int128)1 << 50)) c.fail(who + ": absurdly large");
  t.nbytes = uint64_t(bytes);
  return t;
}

// general.alignment when the file sets it (an integer power of two up to 65536), else 32.
uint64_t read_alignment(Cursor& c, const std::map<std::string, GgufValue>& kv) {
  auto it = kv.find("general.alignment");
  if (it == kv.end()) return 32;
  const GgufValue& a = it->second;
  if (a.type != GgufType::U32 && a.type != GgufType::U64 && a.type != GgufType::I32) c.fail("general.alignment must be an integer");
  const int64_t al = a.as_int("general.alignment");
  if (al <= 0 || al > 65536 || (al & (al - 1)) != 0) c.fail("general.alignment " + std::to_string(al) + " is not a power of two");
  return uint64_t(al);
}

// Points each tensor at its data: the data section starts at the first alignment boundary after
// the header (header_end); every tensor must be aligned, inside the file, and overlap no other.
void place_tensor_data(Cursor& c, std::vector<GgufTensor>& tensors, const uint8_t* base, uint64_t size, uint64_t header_end,
                       uint64_t alignment) {
  const uint64_t data_start = (header_end + alignment - 1) / alignment * alignment;
  if (!tensors.empty() && data_start > size) c.fail("the tensor data section lies past the end of the file");
  const uint64_t data_size = data_start <= size ? size - data_start : 0;
  std::vector<const GgufTensor*> order;
  for (GgufTensor& t : tensors) {
    const std::string who = "tensor '" + t.name + "'";
    if (t.offset % alignment != 0) c.fail(who + ": offset " + std::to_string(t.offset) + " is not aligned");
    if (t.offset > data_size || t.nbytes > data_size - t.offset)
      c.fail(who + ": data [" + std::to_string(t.offset) + ", +" + std::to_string(t.nbytes) + ") lies past the end of the file");
    t.data = base + data_start + t.offset;
    order.push_back(&t);
  }
  std::sort(order.begin(), order.end(), [](auto* a, auto* b) { return a->offset < b->offset; });
  for (size_t i = 1; i < order.size(); ++i)
    if (order[i - 1]->offset + order[i - 1]->nbytes > order[i]->offset)
      c.fail("tensors '" + order[i - 1]->name + "' and '" + order[i]->name + "' overlap");
}

}  // namespace

std::unique_ptr<GgufFile> GgufFile::open(const std::string& path) {
  std::unique_ptr<GgufFile> g(new GgufFile());
  g->map_ = MappedFile::open(path);
  g->path_ = path;
  Cursor c{g->map_->data(), g->map_->data() + g->map_->size(), path};
  if (g->map_->size() < 4 || std::memcmp(g->map_->data(), "GGUF", 4) != 0) throw FileError(path, "not a GGUF file (bad magic)");
  c.p += 4;
  g->version_ = c.get<uint32_t>("the version");
  if (g->version_ != 2 && g->version_ != 3) throw FileError(path, "GGUF version " + std::to_string(g->version_) + " is not supported (2 and 3 are)");
  const uint64_t n_tensors = c.get<uint64_t>("the tensor count");
  const uint64_t n_kv = c.get<uint64_t>("the key/value count");
  if (n_kv > c.left() / 12) c.fail("key/value count " + std::to_string(n_kv) + " exceeds the bytes in the file");
  if (n_tensors > c.left() / 24) c.fail("tensor count " + std::to_string(n_tensors) + " exceeds the bytes in the file");
  for (uint64_t k = 0; k < n_kv; ++k) {
    std::string key = c.str("a key");
    if (key.empty()) c.fail("empty key");
    const uint32_t t = c.get<uint32_t>("a value type");
    if (t > 12) c.fail("key '" + key + "': unknown value type " + std::to_string(t));
    GgufValue v = read_value(c, GgufType(t), key, 0);
    if (!g->kv_.emplace(key, std::move(v)).second) c.fail("duplicate key '" + key + "'");
  }
  g->alignment_ = read_alignment(c, g->kv_);
  for (uint64_t k = 0; k < n_tensors; ++k) {
    GgufTensor t = read_tensor_info(c, k);
    if (g->by_name_.count(t.name)) c.fail("duplicate tensor name '" + t.name + "'");
    g->by_name_[t.name] = g->tensors_.size();
    g->tensors_.push_back(std::move(t));
  }
  place_tensor_data(c, g->tensors_, g->map_->data(), g->map_->size(), uint64_t(c.p - g->map_->data()), g->alignment_);
  return g;
}

Vocab vocab_from_gguf(const GgufFile& g) {
  const std::string& path = g.path();
  try {
    auto need = [&](const char* key) -> const GgufValue& {
      const GgufValue* v = g.find(key);
      if (!v) throw MetadataError(std::string("missing key ") + key);
      return *v;
    };
    auto array_of = [&](const char* key, GgufType elem) -> const GgufValue* {
      const GgufValue* v = g.find(key);
      if (!v) return nullptr;
      if (v->type != GgufType::ARRAY || v->elem != elem)
        throw MetadataError(std::string(key) + " must be an array of " + gguf_type_name(elem));
      return v;
    };
    Vocab voc;
    voc.model = need("tokenizer.ggml.model").as_string("tokenizer.ggml.model");
    if (const GgufValue* pre = g.find("tokenizer.ggml.pre")) voc.pre = pre->as_string("tokenizer.ggml.pre");
    const GgufValue* tokens = array_of("tokenizer.ggml.tokens", GgufType::STRING);
    if (!tokens || tokens->strs.empty()) throw MetadataError("missing or empty tokenizer.ggml.tokens");
    const size_t n = tokens->strs.size();
    voc.tokens = tokens->strs;
    if (const GgufValue* sc = array_of("tokenizer.ggml.scores", GgufType::F32)) {
      if (sc->count != n) throw MetadataError("tokenizer.ggml.scores has a different length than the tokens");
      for (uint64_t k = 0; k < n; ++k) voc.scores.push_back(float(sc->element(k).f));
    } else {
      voc.scores.assign(n, 0.0f);
    }
    if (const GgufValue* ty = array_of("tokenizer.ggml.token_type", GgufType::I32)) {
      if (ty->count != n) throw MetadataError("tokenizer.ggml.token_type has a different length than the tokens");
      for (uint64_t k = 0; k < n; ++k) voc.types.push_back(int32_t(ty->element(k).i));
    } else {
      voc.types.assign(n, int32_t(TokenType::Normal));
    }
    if (const GgufValue* mg = array_of("tokenizer.ggml.merges", GgufType::STRING))
      voc.merges = mg->strs;
    auto id = [&](const char* key) -> int32_t {
      const GgufValue* v = g.find(key);
      if (!v) return -1;
      const int64_t x = v->as_int(key);
      if (x < 0 || uint64_t(x) >= n) return -1;  // llama.cpp treats out-of-range ids as absent
      return int32_t(x);
    };
    voc.bos_id = id("tokenizer.ggml.bos_token_id");
    voc.eos_id = id("tokenizer.ggml.eos_token_id");
    voc.unk_id = id("tokenizer.ggml.unknown_token_id");
    voc.pad_id = id("tokenizer.ggml.padding_token_id");
    voc.eot_id = id("tokenizer.ggml.eot_token_id");
    const bool spm = voc.model == "llama";
    auto flag = [&](const char* key, bool fallback) {
      const GgufValue* v = g.find(key);
      return v ? v->as_int(key) != 0 : fallback;
    };
    voc.add_bos = flag("tokenizer.ggml.add_bos_token", spm);
    voc.add_space_prefix = flag("tokenizer.ggml.add_space_prefix", spm);
    return voc;
  } catch (const MetadataError& e) {
    throw FileError(path, std::string("GGUF tokenizer: ") + e.what());
  }
}

}  // namespace llmq
