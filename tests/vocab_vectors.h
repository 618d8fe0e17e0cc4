// llama.cpp's tokenizer test vectors (shared/tokenizers/llamacpp-vocab/X.gguf.inp and .out) and
// small printing helpers, shared by the tokenizer tests.
#pragma once
#include <catch2/catch.hpp>

#include <cstdint>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>

namespace llmq::test {

/// The whole file as bytes; throws std::runtime_error if it cannot be read.
inline std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

/// Printable form of a test input (escapes control bytes, keeps UTF-8 as is).
inline std::string escaped(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '\n')
      out += "\\n";
    else if (c == '\t')
      out += "\\t";
    else if (c == '"')
      out += "\\\"";
    else if (c < 0x20)
      out += fmt::format("\\x{:02x}", c);
    else
      out += static_cast<char>(c);
  }
  return out + "\"";
}

inline std::string ids_str(const std::vector<int32_t>& ids) { return fmt::format("[{}]", fmt::join(ids, ", ")); }

/// One test vector: an input text and the ids llama.cpp expects (no BOS, no special parsing).
struct VocabCase {
  std::string text;
  std::vector<int32_t> ids;
};

/// Splits a `.inp` file: each input is followed by a line "__ggml_vocab_test__" (the '\n' just
/// before that line belongs to the separator), as llama.cpp's test-tokenizer-0 reads it.
inline std::vector<std::string> split_inp(const std::string& data) {
  static const std::string sep = "__ggml_vocab_test__";
  std::vector<std::string> inputs;
  size_t start = 0;  // start of the current input
  size_t line = 0;   // start of the current line
  while (line < data.size()) {
    size_t eol = data.find('\n', line);
    const size_t line_end = eol == std::string::npos ? data.size() : eol;
    if (data.compare(line, line_end - line, sep) == 0) {
      std::string text = data.substr(start, line - start);
      if (!text.empty() && text.back() == '\n') text.pop_back();  // exactly one
      inputs.push_back(std::move(text));
      start = eol == std::string::npos ? data.size() : eol + 1;
    }
    if (eol == std::string::npos) break;
    line = eol + 1;
  }
  // Text after the last separator must be empty (the file ends with a separator line).
  REQUIRE(start == data.size());
  return inputs;
}

/// Reads `stem`.inp and `stem`.out (one line of space-separated ids per input).
inline std::vector<VocabCase> load_vectors(const std::string& stem) {
  const std::vector<std::string> inputs = split_inp(read_bytes(stem + ".inp"));
  std::vector<std::vector<int32_t>> outputs;
  std::istringstream out(read_bytes(stem + ".out"));
  for (std::string line; std::getline(out, line);) {
    std::vector<int32_t> ids;
    std::istringstream ls(line);
    for (long long id; ls >> id;) ids.push_back(static_cast<int32_t>(id));
    REQUIRE(ls.eof());  // nothing but integers on the line
    outputs.push_back(std::move(ids));
  }
  INFO(stem);
  REQUIRE(inputs.size() == outputs.size());
  std::vector<VocabCase> cases;
  for (size_t i = 0; i < inputs.size(); ++i) cases.push_back({inputs[i], outputs[i]});
  return cases;
}

}  // namespace llmq::test
