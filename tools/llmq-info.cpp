// llmq-info: what is inside a model file, a GGUF (v2/v3) or a `.llmq`, told apart by magic.
//
//   llmq-info model.gguf            format and version, every metadata key (type and value;
//                                   arrays: element type, length and the first elements; long
//                                   strings cut with "…"), the tensor table and the totals
//   llmq-info model.llmq --json     the same as one JSON document
//
// A file that is not valid (the readers' full validation: formats/readers/gguf.h, formats/llmq_file.h)
// exits with code 2 and one line naming the file and the fault.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <variant>
#include <vector>

#include "base/error.h"
#include "base/mapped_file.h"
#include "formats/readers/gguf.h"
#include "formats/llmq_file.h"
#include "cli/cli_common.h"

using namespace llmq;
using json = nlohmann::json;

namespace {

constexpr size_t kMaxString = 120;  // bytes of a string value shown before "…"
constexpr size_t kMaxElems = 8;     // array elements shown

/// Cuts `s` to at most `max` bytes at a UTF-8 character boundary; *cut says whether it did.
std::string truncate_utf8(const std::string& s, size_t max, bool* cut) {
  *cut = s.size() > max;
  if (!*cut) return s;
  size_t n = max;
  while (n > 0 && (uint8_t(s[n]) & 0xC0) == 0x80) --n;  // do not split a multi-byte character
  return s.substr(0, n);
}

/// A string value for the report: truncated, with "…" appended when cut.
std::string shown_string(const std::string& s) {
  bool cut = false;
  std::string t = truncate_utf8(s, kMaxString, &cut);
  return cut ? t + "\u2026" : t;
}

/// Text-mode quoting: control characters and bytes that are not UTF-8 are escaped.
std::string quote(const std::string& s) {
  std::string out = "\"";
  for (size_t i = 0; i < s.size();) {
    const auto c = uint8_t(s[i]);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += char(c);
      ++i;
    } else if (c == '\n') {
      out += "\\n", ++i;
    } else if (c == '\t') {
      out += "\\t", ++i;
    } else if (c < 0x20 || c == 0x7f) {
      out += fmt::format("\\x{:02x}", c), ++i;
    } else if (c < 0x80) {
      out += char(c), ++i;
    } else {  // a well-formed UTF-8 sequence passes, anything else is escaped byte by byte
      const int len = (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
      bool ok = len > 0 && i + size_t(len) <= s.size();
      for (int k = 1; ok && k < len; ++k) ok = (uint8_t(s[i + size_t(k)]) & 0xC0) == 0x80;
      if (ok) {
        out.append(s, i, size_t(len));
        i += size_t(len);
      } else {
        out += fmt::format("\\x{:02x}", c), ++i;
      }
    }
  }
  return out + "\"";
}

std::string gguf_type_label(const GgufValue& v) {
  if (v.type != GgufType::ARRAY) return gguf_type_name(v.type);
  return std::string("array[") + gguf_type_name(v.elem) + "]";
}

/// One GGUF value as JSON: scalars as themselves, strings truncated, arrays summarized
/// ({"length": n, "first": [...]} recursively).
json gguf_value_json(const GgufValue& v) {
  switch (v.type) {
    case GgufType::U8: case GgufType::U16: case GgufType::U32: case GgufType::U64: return v.u;
    case GgufType::I8: case GgufType::I16: case GgufType::I32: case GgufType::I64: return v.i;
    case GgufType::BOOL: return v.u != 0;
    case GgufType::F32: return float(v.f);
    case GgufType::F64: return v.f;
    case GgufType::STRING: return shown_string(v.s);
    case GgufType::ARRAY: {
      json first = json::array();
      for (uint64_t k = 0; k < v.count && k < kMaxElems; ++k) first.push_back(gguf_value_json(v.element(k)));
      return json{{"type", gguf_type_label(v)}, {"length", v.count}, {"first", first}};
    }
  }
  return nullptr;
}

/// The report of one file, built as JSON (printed as is, or rendered as text).
json describe_gguf(const std::string& path) {
  const auto g = GgufFile::open(path);
  json r;
  r["file"] = path;
  r["format"] = "GGUF";
  r["version"] = g->version();
  r["alignment"] = g->alignment();
  r["file_bytes"] = g->mapping()->size();
  json meta = json::array();
  for (const auto& [key, v] : g->kv()) {
    json e{{"key", key}, {"type", gguf_type_label(v)}};
    if (v.type == GgufType::ARRAY) {
      e["length"] = v.count;
      e["first"] = gguf_value_json(v)["first"];
    } else {
      e["value"] = gguf_value_json(v);
      if (v.type == GgufType::STRING) e["bytes"] = v.s.size();
    }
    meta.push_back(std::move(e));
  }
  r["metadata"] = std::move(meta);
  json tensors = json::array();
  for (const GgufTensor& t : g->tensors()) {
    const GgmlTypeSize ts = ggml_type_size(t.type);
    tensors.push_back({{"name", t.name}, {"type", ts.name}, {"shape", t.shape}, {"bytes", t.nbytes}, {"offset", t.offset}});
  }
  r["tensors"] = std::move(tensors);
  return r;
}

json describe_llmq(const std::string& path, bool verify) {
  const auto f = LlmqFile::open(path, verify);
  json r;
  r["file"] = path;
  r["format"] = "LLMQ";
  r["version"] = kLlmqVersion;
  r["alignment"] = kLlmqAlign;
  r["file_bytes"] = f->file_size();
  r["checksums_verified"] = verify;
  json meta = json::array();
  for (const auto& [key, v] : f->meta().values) {
    json e{{"key", key}};
    std::visit(
        [&](const auto& x) {
          using T = std::decay_t<decltype(x)>;
          auto summarize = [&](const auto& vec, const char* type) {
            e["type"] = type;
            e["length"] = vec.size();
            json first = json::array();
            for (size_t k = 0; k < vec.size() && k < kMaxElems; ++k) {
              if constexpr (std::is_same_v<std::decay_t<decltype(vec)>, std::vector<std::string>>)
                first.push_back(shown_string(vec[k]));
              else
                first.push_back(vec[k]);
            }
            e["first"] = first;
          };
          if constexpr (std::is_same_v<T, bool>) e["type"] = "bool", e["value"] = x;
          else if constexpr (std::is_same_v<T, int64_t>) e["type"] = "int", e["value"] = x;
          else if constexpr (std::is_same_v<T, double>) e["type"] = "float", e["value"] = x;
          else if constexpr (std::is_same_v<T, std::string>) e["type"] = "string", e["value"] = shown_string(x), e["bytes"] = x.size();
          else if constexpr (std::is_same_v<T, std::vector<int32_t>>) summarize(x, "array[i32]");
          else if constexpr (std::is_same_v<T, std::vector<float>>) summarize(x, "array[f32]");
          else summarize(x, "array[string]");
        },
        v);
    meta.push_back(std::move(e));
  }
  r["metadata"] = std::move(meta);
  json tensors = json::array();
  for (const TensorInfo& t : f->tensors())
    tensors.push_back({{"name", t.name}, {"type", dtype_info(t.type).name}, {"shape", t.shape}, {"bytes", t.nbytes},
                       {"offset", t.offset}});
  r["tensors"] = std::move(tensors);
  return r;
}

/// Adds "totals": tensor count, bytes, weights and bits per weight.
void add_totals(json& r) {
  uint64_t bytes = 0, weights = 0;
  for (const json& t : r["tensors"]) {
    bytes += t["bytes"].get<uint64_t>();
    uint64_t n = 1;
    for (const json& d : t["shape"]) n *= d.get<uint64_t>();
    weights += n;
  }
  r["totals"] = {{"tensors", r["tensors"].size()},
                 {"bytes", bytes},
                 {"weights", weights},
                 {"bits_per_weight", weights ? 8.0 * double(bytes) / double(weights) : 0.0}};
}

/// Plain names stay as they are; anything else is quoted and escaped.
std::string name_text(const std::string& s) {
  for (char c : s)
    if (c <= 0x20 || c >= 0x7f || c == '"' || c == '\\') return quote(s);
  return s.empty() ? quote(s) : s;
}

/// A scalar or summarized value as text; f32 values are printed as the shortest float text.
std::string value_text(const json& v, bool f32 = false) {
  if (v.is_string()) return quote(v.get<std::string>());
  if (v.is_object()) {  // nested array
    std::string s = fmt::format("{} ({}): [", v["type"].get<std::string>(), v["length"].get<uint64_t>());
    bool firstel = true;
    const bool elem_f32 = v["type"].get<std::string>() == "array[f32]";
    for (const json& x : v["first"]) s += (firstel ? "" : ", ") + value_text(x, elem_f32), firstel = false;
    return s + (v["length"].get<uint64_t>() > v["first"].size() ? ", ...]" : "]");
  }
  if (v.is_number_float()) return f32 ? fmt::format("{}", v.get<float>()) : fmt::format("{}", v.get<double>());
  return v.dump();
}

void print_text(const json& r) {
  std::printf("%s: %s v%u, alignment %llu, %s (%llu bytes)\n", r["file"].get<std::string>().c_str(),
              r["format"].get<std::string>().c_str(), r["version"].get<unsigned>(),
              (unsigned long long)r["alignment"].get<uint64_t>(), cli::human_bytes(r["file_bytes"].get<uint64_t>()).c_str(),
              (unsigned long long)r["file_bytes"].get<uint64_t>());
  std::printf("\nmetadata (%zu keys):\n", r["metadata"].size());
  for (const json& e : r["metadata"]) {
    const std::string type = e["type"].get<std::string>();
    std::string val;
    if (e.contains("length")) {
      val = fmt::format("length {}: [", e["length"].get<uint64_t>());
      bool firstel = true;
      for (const json& x : e["first"]) val += (firstel ? "" : ", ") + value_text(x, type == "array[f32]"), firstel = false;
      val += e["length"].get<uint64_t>() > e["first"].size() ? ", ...]" : "]";
    } else {
      val = value_text(e["value"], type == "f32");
    }
    std::printf("  %-40s %-14s %s\n", name_text(e["key"].get<std::string>()).c_str(), type.c_str(), val.c_str());
  }
  std::printf("\ntensors (%zu):\n", r["tensors"].size());
  std::printf("  %-32s %-5s %-20s %12s %12s\n", "name", "type", "shape", "bytes", "offset");
  for (const json& t : r["tensors"]) {
    std::string shape = "[";
    for (size_t k = 0; k < t["shape"].size(); ++k) shape += (k ? ", " : "") + std::to_string(t["shape"][k].get<int64_t>());
    shape += "]";
    std::printf("  %-32s %-5s %-20s %12llu %12llu\n", name_text(t["name"].get<std::string>()).c_str(),
                t["type"].get<std::string>().c_str(), shape.c_str(), (unsigned long long)t["bytes"].get<uint64_t>(),
                (unsigned long long)t["offset"].get<uint64_t>());
  }
  const json& tot = r["totals"];
  std::printf("\ntotal: %llu tensors, %llu bytes (%s), %llu weights, %.4f bits per weight\n",
              (unsigned long long)tot["tensors"].get<uint64_t>(), (unsigned long long)tot["bytes"].get<uint64_t>(),
              cli::human_bytes(tot["bytes"].get<uint64_t>()).c_str(), (unsigned long long)tot["weights"].get<uint64_t>(),
              tot["bits_per_weight"].get<double>());
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"llmq-info: show the metadata and tensors of a .gguf or .llmq file"};
  std::string path;
  bool as_json = false, no_verify = false;
  app.add_option("file", path, "a GGUF (v2/v3) or .llmq file (told apart by its magic)")->required();
  app.add_flag("--json", as_json, "print one JSON document instead of text");
  app.add_flag("--no-verify", no_verify, ".llmq: skip the tensor-data checksums (header and index are always checked)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {  // --help exits 0, usage errors 1 (docs/ARCHITECTURE.md)
    return app.exit(e) == 0 ? cli::kOk : cli::kUsage;
  }

  return cli::run_guarded("llmq-info", [&] {
    std::ifstream in = open_regular_file(path);
    char magic[8] = {};
    in.read(magic, 8);
    const auto got = size_t(in.gcount());
    json r;
    if (got >= 4 && std::memcmp(magic, "GGUF", 4) == 0) r = describe_gguf(path);
    else if (got == 8 && std::memcmp(magic, kLlmqMagic, 8) == 0) r = describe_llmq(path, !no_verify);
    else throw FileError(path, "neither a GGUF nor a .llmq file (unknown magic)");
    add_totals(r);
    if (as_json) std::printf("%s\n", r.dump(2, ' ', false, json::error_handler_t::replace).c_str());
    else print_text(r);
    return 0;
  });
}
