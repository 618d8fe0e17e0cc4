#include "formats/readers/safetensors.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>
#include <string_view>

#include "base/error.h"

namespace llmq {

namespace {

constexpr uint64_t kMaxHeader = uint64_t(100) << 20;  // the reference implementation's limit
constexpr uint64_t kMaxTensorBytes = uint64_t(1) << 50;

using json = nlohmann::json;

std::string dims_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// Parses the header, refusing duplicate keys at any level (nlohmann keeps the last silently).
json parse_header(const std::string& path, std::string_view text) {
  std::vector<std::set<std::string>> keys;  // one set per open object
  std::string duplicate;
  auto cb = [&](int /*depth*/, json::parse_event_t ev, json& parsed) {
    switch (ev) {
      case json::parse_event_t::object_start: keys.emplace_back(); break;
      case json::parse_event_t::object_end:
        if (!keys.empty()) keys.pop_back();
        break;
      case json::parse_event_t::key:
        if (!keys.empty() && parsed.is_string() && !keys.back().insert(parsed.get<std::string>()).second &&
            duplicate.empty())
          duplicate = parsed.get<std::string>();
        break;
      default: break;
    }
    return true;
  };
  json h;
  try {
    h = json::parse(text.begin(), text.end(), cb);
  } catch (const json::exception& e) {
    throw FileError(path, std::string("safetensors header is not valid JSON: ") + e.what());
  }
  if (!duplicate.empty()) throw FileError(path, "safetensors header repeats the key '" + duplicate + "'");
  if (!h.is_object()) throw FileError(path, "safetensors header is not a JSON object");
  return h;
}

}  // namespace

uint64_t safetensors_dtype_size(const std::string& d) {
  static const std::pair<const char*, uint64_t> table[] = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},   {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"F8_E8M0", 1},
      {"I16", 2},  {"U16", 2}, {"F16", 2},  {"BF16", 2},    {"I32", 4},     {"U32", 4},
      {"F32", 4},  {"F64", 8}, {"I64", 8},  {"U64", 8},
  };
  for (const auto& [name, size] : table)
    if (d == name) return size;
  return 0;
}

const SafetensorsTensor* SafetensorsFile::find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

void SafetensorsFile::release(const uint8_t* p, uint64_t nbytes) const { map_->release(p, nbytes); }

namespace {

// The 8-byte little-endian header length, checked against the file: at least 2, at most
// kMaxHeader, within the file. Throws FileError.
uint64_t header_length(const std::string& path, const uint8_t* base, uint64_t size) {
  if (size < 8) throw FileError(path, "too short for a safetensors file (" + std::to_string(size) + " bytes)");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | base[i];
  if (n < 2) throw FileError(path, "safetensors header length " + std::to_string(n) + " is too small");
  if (n > kMaxHeader)
    throw FileError(path, "safetensors header length " + std::to_string(n) + " is absurd (limit " + std::to_string(kMaxHeader) + " bytes)");
  if (n > size - 8)
    throw FileError(path, "safetensors header length " + std::to_string(n) + " runs past the end of the file (" + std::to_string(size) +
                              " bytes)");
  return n;
}

// Tensor `name`'s header entry e: a known dtype, a shape of at most 16 dimensions below 2^50 (and
// below kMaxTensorBytes in all), data_offsets [begin, end] within the data_size bytes of data
// that span exactly the shape's bytes. data stays unset. Throws FileError naming the tensor.
SafetensorsTensor parse_entry(const std::string& path, const std::string& name, const json& e, uint64_t data_size) {
  const std::string where = "tensor '" + name + "': ";
  if (!e.is_object()) throw FileError(path, where + "entry is not a JSON object");
  auto dt = e.find("dtype");
  auto sh = e.find("shape");
  auto off = e.find("data_offsets");
  if (dt == e.end() || sh == e.end() || off == e.end()) throw FileError(path, where + "entry lacks dtype, shape or data_offsets");
  if (!dt->is_string()) throw FileError(path, where + "dtype is not a string");
  SafetensorsTensor t;
  t.name = name;
  t.dtype = dt->get<std::string>();
  const uint64_t esize = safetensors_dtype_size(t.dtype);
  if (esize == 0) throw FileError(path, where + "unknown or unsupported dtype '" + t.dtype + "'");
  if (!sh->is_array() || sh->size() > 16) throw FileError(path, where + "shape is not an array of at most 16 dimensions");
  unsigned __int128 numel = 1;
  for (const json& d : *sh) {
    if (!d.is_number_unsigned() || d.get<uint64_t>() > (uint64_t(1) << 50))
      throw FileError(path, where + "shape holds something other than a dimension in 0..2^50");
    t.shape.push_back(int64_t(d.get<uint64_t>()));
    numel *= d.get<uint64_t>();
    if (numel > kMaxTensorBytes) throw FileError(path, where + "shape " + sh->dump() + " is absurdly large");
  }
  if (!off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() || !(*off)[1].is_number_unsigned())
    throw FileError(path, where + "data_offsets is not a pair of unsigned integers");
  t.begin = (*off)[0].get<uint64_t>();
  t.end = (*off)[1].get<uint64_t>();
  const std::string span = "data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) + "] ";
  if (t.begin > t.end) throw FileError(path, where + span + "end before they begin");
  if (t.end > data_size)
    throw FileError(path, where + span + "run past the end of the file (the data holds " + std::to_string(data_size) + " bytes): truncated?");
  const unsigned __int128 want = numel * esize;
  if (want != t.end - t.begin)
    throw FileError(path, where + "data_offsets span " + std::to_string(t.end - t.begin) + " bytes but shape " + dims_text(t.shape) + " of " +
                              t.dtype + " needs " + std::to_string(uint64_t(want)));
  return t;
}

// Sorts the tensors by their data and checks that no two with bytes overlap. Throws FileError.
void check_no_overlap(const std::string& path, std::vector<SafetensorsTensor>& tensors) {
  std::sort(tensors.begin(), tensors.end(), [](const SafetensorsTensor& a, const SafetensorsTensor& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  const SafetensorsTensor* prev = nullptr;
  for (const SafetensorsTensor& t : tensors) {
    if (t.nbytes() == 0) continue;
    if (prev && t.begin < prev->end)
      throw FileError(path, "tensors '" + prev->name + "' [" + std::to_string(prev->begin) + ", " + std::to_string(prev->end) + ") and '" +
                                t.name + "' [" + std::to_string(t.begin) + ", " + std::to_string(t.end) + ") overlap");
    prev = &t;
  }
}

}  // namespace

std::shared_ptr<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  auto f = std::shared_ptr<SafetensorsFile>(new SafetensorsFile());
  f->map_ = MappedFile::open(path);
  const uint64_t size = f->map_->size();
  const uint8_t* base = f->map_->data();
  const uint64_t n = header_length(path, base, size);
  f->header_size_ = n;
  const std::string_view text(reinterpret_cast<const char*>(base + 8), size_t(n));
  if (text[0] != '{') throw FileError(path, "safetensors header does not start with '{'");
  const json h = parse_header(path, text);
  const uint64_t data_start = 8 + n, data_size = size - data_start;
  for (auto it = h.begin(); it != h.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it.value().is_object()) throw FileError(path, "__metadata__ is not a JSON object");
      for (auto m = it.value().begin(); m != it.value().end(); ++m) {
        if (!m.value().is_string()) throw FileError(path, "__metadata__ entry '" + m.key() + "' is not a string");
        f->metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    SafetensorsTensor t = parse_entry(path, it.key(), it.value(), data_size);
    t.data = base + data_start + t.begin;
    f->tensors_.push_back(std::move(t));
  }
  check_no_overlap(path, f->tensors_);
  for (size_t i = 0; i < f->tensors_.size(); ++i) f->by_name_[f->tensors_[i].name] = i;
  return f;
}

}  // namespace llmq
