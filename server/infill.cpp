#include "server/infill.h"

namespace llmq {

std::optional<InfillTokens> find_infill_tokens(const Vocab& v) {
  auto id_of = [&](const char* piece) {
    for (size_t i = 0; i < v.tokens.size(); ++i)
      if (v.tokens[i] == piece) return int32_t(i);
    return int32_t(-1);
  };
  static const char* const kSets[][3] = {
      {"<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"},          // Qwen2.5-Coder, CodeGemma-style
      {"<fim_prefix>", "<fim_suffix>", "<fim_middle>"},                // StarCoder, SantaCoder
      {"\u2581<PRE>", "\u2581<SUF>", "\u2581<MID>"},                   // CodeLlama
      {"<\uff5cfim\u2581begin\uff5c>", "<\uff5cfim\u2581hole\uff5c>", "<\uff5cfim\u2581end\uff5c>"},  // DeepSeek-Coder
  };
  for (const auto& set : kSets) {
    InfillTokens t{id_of(set[0]), id_of(set[1]), id_of(set[2]), {}};
    if (t.prefix < 0 || t.suffix < 0 || t.middle < 0) continue;
    for (const char* stop : {"<|endoftext|>", "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "\u2581<EOT>", "<EOT>"})
      if (const int32_t id = id_of(stop); id >= 0) t.stops.push_back(id);
    return t;
  }
  return std::nullopt;
}

std::vector<int32_t> infill_prompt(const Tokenizer& tok, const InfillTokens& t, const std::string& prompt, const std::string& suffix) {
  std::vector<int32_t> ids;
  if (tok.vocab().add_bos && tok.bos() >= 0) ids.push_back(tok.bos());
  ids.push_back(t.prefix);
  for (int32_t id : tok.encode(prompt, false)) ids.push_back(id);
  ids.push_back(t.suffix);
  for (int32_t id : tok.encode(suffix, false)) ids.push_back(id);
  ids.push_back(t.middle);
  return ids;
}

}  // namespace llmq
