// llmq-tokenize: text -> token ids (or back) with the tokenizer of any model or tokenizer file.
//
//   llmq-tokenize model.gguf "Hello, world!"          [9906,11,1917,0]
//   llmq-tokenize model.llmq --bos "Once upon"        with BOS
//   llmq-tokenize model.gguf --special "<|im_start|>user"   special-token text -> its id
//   llmq-tokenize tokenizer.model -f text.txt --pieces
//                                                     ids, then the pieces as spelled in the
//                                                     vocabulary, one JSON array per line
//   llmq-tokenize model.gguf --decode 9906 11 1917    ids -> text ("[9906, 11]" works too)
//   llmq-tokenize model.gguf --pre qwen2 "text"       another pre-tokenizer (byte-level only)
//
// FILE is told apart by its magic: "GGUF" (a model or a vocabulary-only GGUF), "LLMQFILE"
// (.llmq), otherwise by extension: ".model" is a SentencePiece protobuf, anything else a
// llama2.c tokenizer.bin. A bad file (unreadable, malformed, or a vocabulary the tokenizer
// rejects) exits with code 2; usage errors with 1.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "text/tokenizer.h"
#include "base/mapped_file.h"
#include "base/error.h"
#include "formats/readers/gguf.h"
#include "formats/llmq_file.h"
#include "formats/readers/tokenizer_files.h"
#include "formats/vocab.h"
#include "cli/cli_common.h"

using namespace llmq;
using json = nlohmann::json;

namespace {

std::string read_file(const std::string& path) {
  std::ifstream in = open_regular_file(path);
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) throw FileError(path, "read error");
  return ss.str();
}

bool ends_with(const std::string& s, const char* suffix) {
  const size_t n = std::strlen(suffix);
  return s.size() >= n && s.compare(s.size() - n, n, suffix) == 0;
}

// The vocabulary of `path`, whatever kind of file it is.
Vocab load_vocab(const std::string& path) {
  char magic[8] = {};
  {
    std::ifstream in = open_regular_file(path);
    in.read(magic, sizeof magic);
  }
  if (std::memcmp(magic, "GGUF", 4) == 0) return vocab_from_gguf(*GgufFile::open(path));
  if (std::memcmp(magic, "LLMQFILE", 8) == 0 || ends_with(path, ".llmq")) {
    const auto f = LlmqFile::open(path, /*verify=*/false);  // only the metadata is needed
    return vocab_from_metadata(f->meta());
  }
  if (ends_with(path, ".model")) return read_sentencepiece_model(path);
  return read_llama2c_tokenizer(path);
}

// Ids from arguments such as "1", "2,", "[3," or "[1, 2, 3]".
std::vector<int32_t> parse_ids(const std::vector<std::string>& args) {
  std::vector<int32_t> ids;
  for (const std::string& a : args) {
    std::string s = a;
    for (char& c : s)
      if (c == '[' || c == ']' || c == ',') c = ' ';
    std::istringstream in(s);
    std::string tok;
    while (in >> tok) {
      size_t used = 0;
      long long v = -1;
      try {
        v = std::stoll(tok, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used != tok.size() || v < 0 || v > INT32_MAX) throw UsageError("not a token id: '" + tok + "'");
      ids.push_back(static_cast<int32_t>(v));
    }
  }
  return ids;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"llmq-tokenize: token ids of a text (or the text of ids) with a model's tokenizer"};
  std::string path, text_file, pre;
  std::vector<std::string> args;
  bool bos = false, special = false, pieces = false, decode = false;
  app.add_option("FILE", path, "model or tokenizer: .gguf, .llmq, tokenizer.model, tokenizer.bin")->required();
  app.add_option("TEXT", args, "the text (several arguments are joined by spaces); with --decode, the ids");
  app.add_option("-f,--file", text_file, "read the text from this file");
  app.add_flag("--bos", bos, "add the BOS token");
  app.add_flag("--special", special, "parse special-token text (<|im_start|>, <s>, ...) into their ids; "
                                     "with --decode, print special tokens");
  app.add_flag("--pieces", pieces, "also print the pieces, as the vocabulary spells them");
  app.add_flag("--decode", decode, "the arguments are token ids: print their text");
  app.add_option("--pre", pre, "byte-level vocabularies: use this pre-tokenizer instead of the file's (tokenizer.ggml.pre)");
  LLMQ_CLI_PARSE(app, argc, argv);

  return cli::run_guarded("llmq-tokenize", [&] {
    Vocab vocab = load_vocab(path);
    if (!pre.empty()) {
      if (vocab.model != "gpt2") throw UsageError("--pre applies to byte-level (gpt2) vocabularies only");
      vocab.pre = pre;
    }
    std::unique_ptr<Tokenizer> tok;
    try {
      tok = std::make_unique<Tokenizer>(std::move(vocab));
    } catch (const UsageError& e) {
      throw FileError(path, e.what());  // a vocabulary we cannot use is a bad file
    }

    if (decode) {
      if (!text_file.empty()) throw UsageError("--decode takes ids as arguments, not -f");
      const std::string text = tok->decode(parse_ids(args), special);
      std::fwrite(text.data(), 1, text.size(), stdout);
      std::fputc('\n', stdout);
      return int(cli::kOk);
    }

    std::string text;
    if (!text_file.empty()) {
      if (!args.empty()) throw UsageError("give the text either as arguments or with -f, not both");
      text = read_file(text_file);
    } else {
      for (size_t i = 0; i < args.size(); ++i) text += (i ? " " : "") + args[i];
    }
    const std::vector<int32_t> ids = tok->encode(text, bos, special);
    std::printf("%s\n", json(ids).dump().c_str());
    if (pieces) {
      json p = json::array();
      for (int32_t id : ids) p.push_back(tok->vocab().tokens[static_cast<size_t>(id)]);
      std::printf("%s\n", p.dump(-1, ' ', false, json::error_handler_t::replace).c_str());
    }
    return int(cli::kOk);
  });
}
