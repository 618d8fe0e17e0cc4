// The tokenizer vocabulary as stored in a `.llmq` file (keys `tokenizer.*`, see docs/FORMAT.md).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace llmq {

/// Token kinds; numbering follows SentencePiece's ModelProto.SentencePiece.Type, which GGUF
/// (`tokenizer.ggml.token_type`) uses as well.
enum class TokenType : int32_t {
  Normal = 1,
  Unknown = 2,
  Control = 3,      // BOS, EOS, ...: never produced from user text
  UserDefined = 4,
  Unused = 5,
  Byte = 6,         // byte-fallback piece "<0xNN>"
};

/// A vocabulary. `model == "llama"` is SentencePiece-style BPE: merges are chosen by the
/// score of the merged piece; pieces spell a space as U+2581 ("▁"); unknown characters fall
/// back to their UTF-8 bytes as "<0xNN>" pieces. `model == "gpt2"` is byte-level BPE (GPT-2):
/// pieces are bytes mapped to printable characters, merged by the rank of `merges`.
struct Vocab {
  std::string model = "llama";
  std::vector<std::string> tokens;  // [n_vocab] piece text
  std::vector<float> scores;        // [n_vocab] merge priority (higher merges first)
  std::vector<int32_t> types;       // [n_vocab] TokenType values
  std::vector<std::string> merges;  // byte-level BPE only ("a b" per merge, by rank)
  std::string pre;                  // byte-level BPE: pre-tokenizer name (GGUF tokenizer.ggml.pre)
  int32_t bos_id = -1, eos_id = -1, unk_id = -1, pad_id = -1;
  int32_t eot_id = -1;              // end of turn (chat), when it differs from EOS
  bool add_bos = true;           // prepend BOS when encoding a prompt
  bool add_space_prefix = true;  // SentencePiece's "dummy prefix": text starts with "▁"

  size_t size() const { return tokens.size(); }
};

class Metadata;
/// Writes the vocabulary as the `tokenizer.*` metadata keys (docs/FORMAT.md).
void vocab_to_metadata(const Vocab& v, Metadata& m);
/// Reads them back; throws MetadataError for missing, mistyped or inconsistent keys.
Vocab vocab_from_metadata(const Metadata& m);

}  // namespace llmq
