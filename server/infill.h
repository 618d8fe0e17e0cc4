// Fill-in-the-middle for /v1/completions' `suffix`: the prompt becomes prefix-suffix-middle
// (PSM: <prefix token> prompt <suffix token> suffix <middle token>) for code models trained on
// it, and the model writes the middle (Bavarian et al. 2022, "Efficient training of language
// models to fill in the middle"). The three tokens are found by their names in the vocabulary.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "formats/vocab.h"
#include "text/tokenizer.h"

namespace llmq {

/// A vocabulary's fill-in-the-middle tokens.
struct InfillTokens {
  int32_t prefix = -1, suffix = -1, middle = -1;
  /// Tokens that end a middle besides the end-of-sequence ones: the vocabulary's
  /// <|endoftext|>, <|fim_pad|>, <|file_sep|>, <|repo_name|>, <EOT> where present.
  std::vector<int32_t> stops;
};

/// The FIM tokens of `v` under the names their models use: Qwen2.5-Coder's <|fim_prefix|>,
/// <|fim_suffix|>, <|fim_middle|>; StarCoder's <fim_prefix>, ...; CodeLlama's ▁<PRE>, ▁<SUF>,
/// ▁<MID>; DeepSeek-Coder's <｜fim▁begin｜>, <｜fim▁hole｜>, <｜fim▁end｜>. nullopt when the vocabulary has
/// none of these sets.
std::optional<InfillTokens> find_infill_tokens(const Vocab& v);

/// The PSM prompt: [BOS when the vocabulary adds one] prefix-token prompt suffix-token suffix
/// middle-token.
std::vector<int32_t> infill_prompt(const Tokenizer& tok, const InfillTokens& t, const std::string& prompt, const std::string& suffix);

}  // namespace llmq
