#include "formats/readers/hf_tokenizer.h"
#include "base/mapped_file.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include "base/error.h"
#include "formats/readers/tokenizer_files.h"

namespace llmq {

namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

constexpr int64_t kMaxVocab = int64_t(1) << 24;  // 16M ids: far above any real vocabulary

// Llama-3's and Qwen2's pre-tokenizer regexes, as their tokenizer.json files spell them
// (after JSON unescaping). They differ only in how digits are grouped.
constexpr const char* kLlama3Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kQwen2Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// End-of-turn pieces of common chat formats (ChatML, Llama-3, Phi-3, Gemma).
constexpr const char* kEndOfTurn[] = {"<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|end_of_turn|>"};

std::string type_of(const json& j) {
  if (!j.is_object()) return "";
  auto it = j.find("type");
  return it != j.end() && it->is_string() ? it->get<std::string>() : "";
}

bool flag(const json& j, const char* key, bool fallback) {
  auto it = j.find(key);
  return it != j.end() && it->is_boolean() ? it->get<bool>() : fallback;
}

// The members of a Sequence (or the value itself, as a list of one).
std::vector<json> members(const json& j, const char* list_key) {
  if (type_of(j) == "Sequence") {
    auto it = j.find(list_key);
    if (it != j.end() && it->is_array()) return std::vector<json>(it->begin(), it->end());
    return {};
  }
  if (j.is_object()) return {j};
  return {};
}

// The ByteLevel pre-tokenizer of `pre` (itself or a Sequence member); null when none.
json find_bytelevel(const json& pre) {
  for (const json& m : members(pre, "pretokenizers"))
    if (type_of(m) == "ByteLevel") return m;
  return json();
}

std::string split_regex(const json& m) {
  if (type_of(m) != "Split") return "";
  auto p = m.find("pattern");
  if (p == m.end() || !p->is_object()) return "";
  auto r = p->find("Regex");
  return r != p->end() && r->is_string() ? r->get<std::string>() : "";
}

// A special token in tokenizer_config.json: "text" or {"content": "text", ...}; "" if absent.
std::string special_text(const std::string& path, const json& cfg, const char* key) {
  auto it = cfg.find(key);
  if (it == cfg.end() || it->is_null()) return "";
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object()) {
    auto c = it->find("content");
    if (c != it->end() && c->is_string()) return c->get<std::string>();
  }
  throw FileError(path, std::string(key) + " is neither a string nor an object with \"content\"");
}

// An id, or a list of ids, from a config file; empty when absent or null.
std::vector<int64_t> id_list(const std::string& path, const json& cfg, const char* key) {
  auto it = cfg.find(key);
  if (it == cfg.end() || it->is_null()) return {};
  std::vector<int64_t> out;
  auto one = [&](const json& v) {
    if (!v.is_number_integer()) throw FileError(path, std::string(key) + " is not an integer or a list of integers");
    out.push_back(v.get<int64_t>());
  };
  if (it->is_array())
    for (const json& v : *it) one(v);
  else
    one(*it);
  return out;
}

// The token table of a tokenizer.json: model.vocab's entries (Normal) and added_tokens (Control
// when special, else UserDefined) by id; ids no entry names become "[PADi]" (Unused). Throws
// FileError for an id out of range or given to two texts.
struct TokenTable {
  std::vector<std::string> tokens;
  std::vector<int32_t> types;
  std::vector<bool> have;
};
TokenTable token_table(const std::string& path, const json& j, const json& vocab) {
  TokenTable t;
  // Ids are dense in real vocabularies (0 .. entries-1, added tokens just past them): an id far
  // beyond the entries the file has would make us allocate for it (issue 22 item 9: one entry
  // with id 16M cost 2 GB and 30 s). Allowed: below twice the entries plus 64K, and below 16M.
  const size_t added = j.contains("added_tokens") && j["added_tokens"].is_array() ? j["added_tokens"].size() : 0;
  const int64_t max_id = std::min<int64_t>(kMaxVocab, 2 * int64_t(vocab.size() + added) + 65536);
  auto place = [&](int64_t id, const std::string& text, TokenType type, bool may_repeat) {
    if (id < 0 || id >= max_id)
      throw FileError(path, "token '" + text + "' has id " + std::to_string(id) + ", outside 0.." + std::to_string(max_id - 1) +
                                " (the file lists " + std::to_string(vocab.size() + added) + " tokens)");
    if (size_t(id) >= t.tokens.size()) {
      t.tokens.resize(size_t(id) + 1);
      t.types.resize(size_t(id) + 1, int32_t(TokenType::Unused));
      t.have.resize(size_t(id) + 1, false);
    }
    if (t.have[size_t(id)] && (!may_repeat || t.tokens[size_t(id)] != text))
      throw FileError(path, "id " + std::to_string(id) + " is given to both '" + t.tokens[size_t(id)] + "' and '" + text + "'");
    t.tokens[size_t(id)] = text;
    t.types[size_t(id)] = int32_t(type);
    t.have[size_t(id)] = true;
  };
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    if (!it.value().is_number_integer()) throw FileError(path, "vocab entry '" + it.key() + "' has no integer id");
    place(it.value().get<int64_t>(), it.key(), TokenType::Normal, false);
  }
  auto ai = j.find("added_tokens");
  if (ai != j.end() && !ai->is_null()) {
    if (!ai->is_array()) throw FileError(path, "added_tokens is not a list");
    for (const json& a : *ai) {
      if (!a.is_object() || !a.contains("id") || !a["id"].is_number_integer() || !a.contains("content") || !a["content"].is_string())
        throw FileError(path, "an added_tokens entry lacks an integer id or a string content");
      const bool special = flag(a, "special", false);
      place(a["id"].get<int64_t>(), a["content"].get<std::string>(), special ? TokenType::Control : TokenType::UserDefined, true);
    }
  }
  for (size_t i = 0; i < t.tokens.size(); ++i)
    if (!t.have[i]) t.tokens[i] = "[PAD" + std::to_string(i) + "]";
  return t;
}

// model.merges as "a b" strings (the file has "a b" or ["a", "b"]). Throws FileError for others.
std::vector<std::string> read_merges(const std::string& path, const json& model) {
  std::vector<std::string> merges;
  auto mg = model.find("merges");
  if (mg == model.end() || mg->is_null()) return merges;
  if (!mg->is_array()) throw FileError(path, "model.merges is not a list");
  merges.reserve(mg->size());
  for (const json& m : *mg) {
    std::string a, b;
    if (m.is_string()) {
      const std::string s = m.get<std::string>();
      const size_t sp = s.find(' ');
      if (sp == std::string::npos) throw FileError(path, "merge '" + s + "' is not two pieces separated by a space");
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      a = m[0].get<std::string>();
      b = m[1].get<std::string>();
    } else {
      throw FileError(path, "merge " + m.dump() + " is neither \"a b\" nor [\"a\", \"b\"]");
    }
    if (a.empty() || b.empty()) throw FileError(path, "merge " + m.dump() + " has an empty piece");
    merges.push_back(a + " " + b);
  }
  return merges;
}

// BOS added by the post-processor: TemplateProcessing (possibly inside a Sequence) whose
// "single" template starts with {"SpecialToken": {"id": "<bos text>", ...}} sets v.add_bos and,
// when the text is a token, v.bos_id.
void post_processor_bos(const json& j, const std::unordered_map<std::string, int32_t>& ids, Vocab& v) {
  v.add_bos = false;
  if (!j.contains("post_processor")) return;
  for (const json& p : members(j["post_processor"], "processors")) {
    if (type_of(p) != "TemplateProcessing") continue;
    auto si = p.find("single");
    if (si == p.end() || !si->is_array() || si->empty()) continue;
    const json& first = (*si)[0];
    if (!first.is_object() || !first.contains("SpecialToken")) continue;
    v.add_bos = true;
    const json& st = first["SpecialToken"];
    if (st.is_object() && st.contains("id") && st["id"].is_string()) {
      auto f = ids.find(st["id"].get<std::string>());
      if (f != ids.end()) v.bos_id = f->second;
    }
  }
}

Vocab vocab_from_tokenizer_json(const std::string& path, const json& j) {
  if (!j.is_object()) throw FileError(path, "tokenizer.json is not a JSON object");
  auto mi = j.find("model");
  if (mi == j.end() || !mi->is_object()) throw FileError(path, "tokenizer.json has no \"model\" object");
  const json& model = *mi;
  const std::string mtype = type_of(model);
  if (!mtype.empty() && mtype != "BPE") throw FileError(path, "tokenizer model type '" + mtype + "' is not supported (only BPE)");
  if (!hf_tokenizer_is_byte_level(j)) throw FileError(path, "tokenizer.json is not a byte-level BPE tokenizer");
  auto vi = model.find("vocab");
  if (vi == model.end() || !vi->is_object() || vi->empty()) throw FileError(path, "tokenizer.json model.vocab is missing, empty or not an object");
  TokenTable t = token_table(path, j, *vi);
  Vocab v;
  v.model = "gpt2";
  v.tokens = std::move(t.tokens);
  v.types = std::move(t.types);
  v.scores.assign(v.tokens.size(), 0.0f);
  v.merges = read_merges(path, model);
  std::unordered_map<std::string, int32_t> ids;
  for (size_t i = 0; i < v.tokens.size(); ++i) ids.emplace(v.tokens[i], int32_t(i));
  auto ui = model.find("unk_token");
  if (ui != model.end() && ui->is_string()) {
    auto f = ids.find(ui->get<std::string>());
    if (f != ids.end()) v.unk_id = f->second;
  }
  const json pre = j.contains("pre_tokenizer") ? j["pre_tokenizer"] : json();
  v.pre = hf_pre_tokenizer_name(pre);
  v.add_space_prefix = flag(find_bytelevel(pre), "add_prefix_space", false);
  post_processor_bos(j, ids, v);
  return v;
}

}  // namespace

json read_json_file(const std::string& path, uint64_t max_bytes) {
  std::error_code ec;
  const auto st = fs::status(path, ec);
  if (ec || !fs::exists(st)) throw FileError(path, "cannot open: file not found");
  if (!fs::is_regular_file(st)) throw FileError(path, "not a regular file");
  const uint64_t size = fs::file_size(path, ec);
  if (ec) throw FileError(path, "cannot determine the file size: " + ec.message());
  if (size > max_bytes)
    throw FileError(path, "file is " + std::to_string(size) + " bytes, above the limit of " + std::to_string(max_bytes));
  std::ifstream in = open_regular_file(path);
  std::string text(size_t(size), '\0');
  if (size > 0 && !in.read(text.data(), std::streamsize(size))) throw FileError(path, "read error");
  // Nesting is bounded before parsing (issue 22 item 9): a file of a billion '[' took 2.3 GB as a
  // document. Real configuration and tokenizer files nest a few levels.
  constexpr int kMaxDepth = 128;
  int depth = 0;
  bool in_string = false, escaped = false;
  for (const char ch : text) {
    if (in_string) {
      if (escaped) escaped = false;
      else if (ch == '\\') escaped = true;
      else if (ch == '"') in_string = false;
    } else if (ch == '"') {
      in_string = true;
    } else if (ch == '[' || ch == '{') {
      if (++depth > kMaxDepth) throw FileError(path, "JSON nested deeper than " + std::to_string(kMaxDepth) + " levels");
    } else if (ch == ']' || ch == '}') {
      --depth;
    }
  }
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    throw FileError(path, std::string("not valid JSON: ") + e.what());
  }
}

std::string hf_pre_tokenizer_name(const json& pre) {
  const std::vector<json> list = members(pre, "pretokenizers");
  if (list.empty()) return "default";
  auto bytelevel_regex = [](const json& m) { return type_of(m) == "ByteLevel" && flag(m, "use_regex", true); };
  if (list.size() == 1 && bytelevel_regex(list[0])) return "gpt2";
  if (list.size() == 2 && type_of(list[0]) == "Digits" && flag(list[0], "individual_digits", false) &&
      bytelevel_regex(list[1]))
    return "smollm";
  if (list.size() == 2 && type_of(list[1]) == "ByteLevel" && !flag(list[1], "use_regex", true)) {
    const std::string re = split_regex(list[0]);
    if (re == kLlama3Regex) return "llama-bpe";
    if (re == kQwen2Regex) return "qwen2";
  }
  return "default";
}

bool hf_tokenizer_is_byte_level(const json& j) {
  if (!j.is_object()) return false;
  if (j.contains("pre_tokenizer") && !find_bytelevel(j["pre_tokenizer"]).is_null()) return true;
  if (j.contains("decoder"))
    for (const json& d : members(j["decoder"], "decoders"))
      if (type_of(d) == "ByteLevel") return true;
  return false;
}

Vocab read_hf_tokenizer_json(const std::string& path) {
  const json j = read_json_file(path, uint64_t(1) << 30);
  try {
    return vocab_from_tokenizer_json(path, j);
  } catch (const json::exception& e) {
    throw FileError(path, std::string("unexpected tokenizer.json content: ") + e.what());
  }
}

namespace {

// The vocabulary of dir: tokenizer.json when it is byte-level BPE, else tokenizer.model
// (SentencePiece); none found leaves out.found false. Throws FileError for a tokenizer.json
// that is neither with no tokenizer.model beside it, and for unreadable files.
void read_vocab_files(const std::string& dir, HfTokenizer& out) {
  const std::string tj = dir + "/tokenizer.json", tm = dir + "/tokenizer.model";
  std::error_code ec;
  const bool has_tj = fs::exists(tj, ec), has_tm = fs::exists(tm, ec);
  if (has_tj) {
    const json j = read_json_file(tj, uint64_t(1) << 30);
    if (hf_tokenizer_is_byte_level(j)) {
      try {
        out.vocab = vocab_from_tokenizer_json(tj, j);
      } catch (const json::exception& e) {
        throw FileError(tj, std::string("unexpected tokenizer.json content: ") + e.what());
      }
      out.source = tj;
    } else if (!has_tm) {
      throw FileError(tj, "not a byte-level BPE tokenizer (and there is no tokenizer.model): not supported");
    }
  }
  if (out.source.empty() && has_tm) {
    out.vocab = read_sentencepiece_model(tm);
    out.source = tm;
  }
  out.found = !out.source.empty();
}

// id, checked to lie in v (key and file name the error).
int32_t vocab_id(const Vocab& v, const std::string& file, const char* key, int64_t id) {
  if (id < 0 || id >= int64_t(v.tokens.size()))
    throw FileError(file, std::string(key) + " " + std::to_string(id) + " is outside the vocabulary (" + std::to_string(v.tokens.size()) +
                              " tokens)");
  return int32_t(id);
}

// A config's bos_token_id and eos_token_id (config.json, generation_config.json: a number or a
// list) into v, the first of each; returns every eos id, in order.
std::vector<int32_t> config_ids(Vocab& v, const std::string& file, const json& cfg) {
  for (int64_t id : id_list(file, cfg, "bos_token_id")) {
    v.bos_id = vocab_id(v, file, "bos_token_id", id);
    break;
  }
  std::vector<int32_t> eos;
  for (int64_t id : id_list(file, cfg, "eos_token_id")) eos.push_back(vocab_id(v, file, "eos_token_id", id));
  if (!eos.empty()) v.eos_id = eos[0];
  return eos;
}

// tokenizer_config.json's chat template (a string, or the "default" of a list of {name,
// template}); with a vocabulary, its special tokens (by their text), which go before config.json's,
// and add_bos_token. Throws FileError for content of the wrong kind.
void apply_tokenizer_config(const std::string& tc, HfTokenizer& out, std::vector<int32_t>& eos_candidates) {
  const json cfg = read_json_file(tc);
  if (!cfg.is_object()) throw FileError(tc, "not a JSON object");
  Vocab& v = out.vocab;
  try {
    auto ct = cfg.find("chat_template");
    if (ct != cfg.end() && !ct->is_null()) {
      if (ct->is_string()) {
        out.chat_template = ct->get<std::string>();
      } else if (ct->is_array()) {
        for (const json& t : *ct)
          if (t.is_object() && t.value("name", std::string()) == "default" && t.contains("template") && t["template"].is_string())
            out.chat_template = t["template"].get<std::string>();
      } else {
        throw FileError(tc, "chat_template is neither a string nor a list of {name, template}");
      }
    }
    if (!out.found) return;
    std::unordered_map<std::string, int32_t> ids;
    for (size_t i = 0; i < v.tokens.size(); ++i) ids.emplace(v.tokens[i], int32_t(i));
    auto lookup = [&](const char* key) -> int32_t {
      const std::string text = special_text(tc, cfg, key);
      if (text.empty()) return -1;
      auto f = ids.find(text);
      return f == ids.end() ? -1 : f->second;
    };
    if (int32_t id = lookup("bos_token"); id >= 0) v.bos_id = id;
    if (int32_t id = lookup("eos_token"); id >= 0) {
      v.eos_id = id;
      eos_candidates.insert(eos_candidates.begin(), id);
    }
    if (int32_t id = lookup("unk_token"); id >= 0) v.unk_id = id;
    if (int32_t id = lookup("pad_token"); id >= 0) v.pad_id = id;
    auto ab = cfg.find("add_bos_token");
    if (ab != cfg.end() && !ab->is_null()) {
      if (!ab->is_boolean()) throw FileError(tc, "add_bos_token is not true or false");
      v.add_bos = ab->get<bool>();
    }
  } catch (const json::exception& e) {
    throw FileError(tc, std::string("unexpected content: ") + e.what());
  }
}

// A chat_template.jinja file's text (newer checkpoints keep the template there). Throws
// FileError when it cannot be read or is over 64 MiB.
std::string read_template_file(const std::string& path) {
  std::error_code ec;
  std::ifstream in = open_regular_file(path);
  const uint64_t size = fs::file_size(path, ec);
  if (ec || size > (uint64_t(64) << 20)) throw FileError(path, "cannot read (or larger than 64 MiB)");
  std::string text(size_t(size), '\0');
  if (size > 0 && !in.read(text.data(), std::streamsize(size))) throw FileError(path, "read error");
  return text;
}

// The end-of-turn token: the first candidate (the eos id, then the candidates in the files'
// order of strength) whose text is one of kEndOfTurn; -1 when none is.
int32_t end_of_turn(const Vocab& v, const std::vector<int32_t>& candidates) {
  for (int32_t id : candidates) {
    if (id < 0 || id >= int32_t(v.tokens.size())) continue;
    for (const char* name : kEndOfTurn)
      if (v.tokens[size_t(id)] == name) return id;
  }
  return -1;
}

}  // namespace

HfTokenizer read_hf_tokenizer(const std::string& dir, const json& config_json, int64_t vocab_size) {
  HfTokenizer out;
  read_vocab_files(dir, out);
  Vocab& v = out.vocab;
  if (out.found) {
    if (int64_t(v.tokens.size()) > vocab_size)
      throw FileError(out.source, "the tokenizer has " + std::to_string(v.tokens.size()) + " tokens, more than config.json's vocab_size " +
                                      std::to_string(vocab_size));
    while (int64_t(v.tokens.size()) < vocab_size) {  // HF pads embedding matrices past the tokenizer
      v.tokens.push_back("[PAD" + std::to_string(v.tokens.size()) + "]");
      v.scores.push_back(0.0f);
      v.types.push_back(int32_t(TokenType::Unused));
    }
  }
  // The special ids, weakest first: config.json, tokenizer_config.json, generation_config.json.
  std::vector<int32_t> eos_candidates;
  if (out.found) eos_candidates = config_ids(v, dir + "/config.json", config_json);
  std::error_code ec;
  if (const std::string tc = dir + "/tokenizer_config.json"; fs::exists(tc, ec)) apply_tokenizer_config(tc, out, eos_candidates);
  if (const std::string jinja = dir + "/chat_template.jinja"; out.chat_template.empty() && fs::is_regular_file(jinja, ec))
    out.chat_template = read_template_file(jinja);
  if (const std::string gc = dir + "/generation_config.json"; out.found && fs::exists(gc, ec)) {
    const json cfg = read_json_file(gc);
    if (!cfg.is_object()) throw FileError(gc, "not a JSON object");
    const std::vector<int32_t> g = config_ids(v, gc, cfg);
    eos_candidates.insert(eos_candidates.begin(), g.begin(), g.end());
  }
  if (out.found) {
    eos_candidates.insert(eos_candidates.begin(), v.eos_id);
    if (const int32_t eot = end_of_turn(v, eos_candidates); eot >= 0) v.eot_id = eot;
  }
  return out;
}

}  // namespace llmq
