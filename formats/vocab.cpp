#include "formats/vocab.h"

#include "formats/llmq_file.h"

namespace llmq {

void vocab_to_metadata(const Vocab& v, Metadata& m) {
  m.set("tokenizer.model", v.model);
  m.set("tokenizer.tokens", v.tokens);
  m.set("tokenizer.scores", v.scores);
  m.set("tokenizer.token_type", v.types);
  if (!v.merges.empty()) m.set("tokenizer.merges", v.merges);
  m.set("tokenizer.bos_token_id", int64_t(v.bos_id));
  m.set("tokenizer.eos_token_id", int64_t(v.eos_id));
  m.set("tokenizer.unknown_token_id", int64_t(v.unk_id));
  m.set("tokenizer.padding_token_id", int64_t(v.pad_id));
  if (!v.pre.empty()) m.set("tokenizer.pre", v.pre);
  if (v.eot_id >= 0) m.set("tokenizer.eot_token_id", int64_t(v.eot_id));
  m.set("tokenizer.add_bos_token", v.add_bos);
  m.set("tokenizer.add_space_prefix", v.add_space_prefix);
}

Vocab vocab_from_metadata(const Metadata& m) {
  Vocab v;
  v.model = m.get_string("tokenizer.model");
  v.tokens = m.get_string_array("tokenizer.tokens");
  const size_t n = v.tokens.size();
  v.scores = m.has("tokenizer.scores") ? m.get_f32_array("tokenizer.scores") : std::vector<float>(n, 0.0f);
  v.types = m.has("tokenizer.token_type") ? m.get_i32_array("tokenizer.token_type")
                                          : std::vector<int32_t>(n, int32_t(TokenType::Normal));
  if (m.has("tokenizer.merges")) v.merges = m.get_string_array("tokenizer.merges");
  if (v.scores.size() != n || v.types.size() != n)
    throw MetadataError("tokenizer.scores/token_type lengths differ from tokenizer.tokens");
  auto id = [&](const char* key) {
    const int64_t x = m.get_int(key, -1);
    if (x < -1 || x >= int64_t(n)) throw MetadataError(std::string(key) + " out of range");
    return int32_t(x);
  };
  v.bos_id = id("tokenizer.bos_token_id");
  v.eos_id = id("tokenizer.eos_token_id");
  v.unk_id = id("tokenizer.unknown_token_id");
  v.pad_id = id("tokenizer.padding_token_id");
  v.eot_id = id("tokenizer.eot_token_id");
  v.pre = m.get_string("tokenizer.pre", "");
  v.add_bos = m.get_bool("tokenizer.add_bos_token", true);
  v.add_space_prefix = m.get_bool("tokenizer.add_space_prefix", true);
  return v;
}

}  // namespace llmq
