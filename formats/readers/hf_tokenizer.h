// Tokenizers of Hugging Face checkpoint directories: `tokenizer.json` (the HF `tokenizers`
// library's serialization) or a SentencePiece `tokenizer.model`, completed by
// `tokenizer_config.json` (transformers: chat template, special tokens, add_bos_token) and
// `generation_config.json` (transformers: bos/eos ids used when generating).
#pragma once
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>

#include "formats/vocab.h"

namespace llmq {

/// Reads and parses a JSON file of at most `max_bytes` bytes. Throws FileError(path, ...) when
/// the file is missing, not a regular file, larger than the cap, or not valid JSON (the
/// parser's message, with its byte position, is included).
nlohmann::json read_json_file(const std::string& path, uint64_t max_bytes = uint64_t(64) << 20);

/// The GGUF-style pre-tokenizer name (`tokenizer.pre`) of a tokenizer.json `pre_tokenizer`
/// value, recognised by structure and regex:
///   ByteLevel with use_regex (GPT-2's built-in regex), alone               -> "gpt2"
///   Sequence [Digits(individual_digits), ByteLevel(use_regex)]             -> "smollm"
///   Split on Llama-3's regex ("...\p{N}{1,3}...") then ByteLevel           -> "llama-bpe"
///   Split on Qwen2's regex (Llama-3's with single digits "\p{N}")          -> "qwen2"
///   anything else                                                          -> "default"
std::string hf_pre_tokenizer_name(const nlohmann::json& pre_tokenizer);

/// True when a tokenizer.json value uses byte-level BPE: a BPE model with a ByteLevel
/// pre-tokenizer (alone or in a Sequence) or, failing that, a ByteLevel decoder.
bool hf_tokenizer_is_byte_level(const nlohmann::json& tokenizer);

/// Reads a byte-level BPE `tokenizer.json` (HF tokenizers) into a Vocab with model "gpt2":
/// `model.vocab` (piece -> id; pieces are kept as written, i.e. GPT-2's printable byte
/// characters), `model.merges` ("a b" strings, or [a, b] pairs as tokenizers >= 0.20 writes
/// them), `model.unk_token`; `added_tokens` ({id, content, special}) with special -> Control,
/// else UserDefined (an added token may repeat a vocab entry with the same id and text).
/// The id range is 0..max id; ids no entry names are filled with "[PAD<id>]" Unused pieces.
/// Scores are 0. `pre` from hf_pre_tokenizer_name. add_bos is true when the post-processor is
/// a TemplateProcessing whose "single" template starts with a special token;
/// add_space_prefix is ByteLevel's add_prefix_space. bos/eos ids are left -1 (the caller
/// takes them from the config files).
/// Throws FileError for a file that is not JSON, a model that is not byte-level BPE, ids that
/// are negative, repeated or above 2^24, merges that are not two pieces, or an added token
/// whose id the vocabulary gives to another piece.
Vocab read_hf_tokenizer_json(const std::string& path);

/// A checkpoint directory's tokenizer and chat template.
struct HfTokenizer {
  bool found = false;         ///< false when the directory has neither tokenizer file
  Vocab vocab;
  std::string chat_template;  ///< empty when none was found
  std::string source;         ///< the file the vocabulary came from
};

/// Reads the tokenizer of a Hugging Face checkpoint directory:
///  * the vocabulary from `tokenizer.json` when it is byte-level BPE, else from
///    `tokenizer.model` (SentencePiece, via read_sentencepiece_model); a tokenizer.json of
///    another kind with no tokenizer.model is a FileError; neither file: found = false;
///  * `tokenizer_config.json` (optional): `chat_template` (a string, or a list of
///    {name, template} from which "default" is taken), `bos_token` / `eos_token` /
///    `unk_token` / `pad_token` (strings or {"content": ...} objects, looked up in the
///    vocabulary), `add_bos_token`; a `chat_template.jinja` file beside it is used when the
///    config holds no template;
///  * `generation_config.json` (optional): `bos_token_id`, `eos_token_id` (an int or a list:
///    the first is EOS); these win over tokenizer_config.json, which wins over `config_json`'s
///    own bos/eos_token_id, which win over the tokenizer file's;
///  * eot_id: the first of the EOS candidates (generation_config's list, the eos_token) that
///    is an end-of-turn piece (`<|im_end|>`, `<|eot_id|>`, `<|end|>`, `<end_of_turn>`,
///    `<|end_of_turn|>`).
/// A vocabulary shorter than `vocab_size` (HF pads embedding matrices) is padded with
/// "[PAD<id>]" Unused pieces; a longer one, or an id from the config files outside the
/// vocabulary, is a FileError naming the file.
HfTokenizer read_hf_tokenizer(const std::string& dir, const nlohmann::json& config_json, int64_t vocab_size);

}  // namespace llmq
