// SentencePiece-style BPE and byte-level BPE tokenizers (see tokenizer.h for the algorithms
// and their sources).
#include "text/tokenizer.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>

#include <fmt/format.h>

#include "base/error.h"

namespace llmq {
namespace {

constexpr std::string_view kSpaceMark = "\xE2\x96\x81";  // U+2581 "▁"

bool is_type(int32_t t, TokenType want) { return t == static_cast<int32_t>(want); }

// Value of a "<0xNN>" piece, or -1 if the piece is not spelled that way.
int hex_byte_value(std::string_view p) {
  auto nib = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  if (p.size() != 6 || p.substr(0, 3) != "<0x" || p[5] != '>') return -1;
  const int hi = nib(p[3]), lo = nib(p[4]);
  if (hi < 0 || lo < 0) return -1;
  return hi * 16 + lo;
}

// Length of the UTF-8 character at the start of `s` (s non-empty): 1..4 for a well-formed
// sequence, 1 for a malformed byte (stray continuation byte, invalid lead byte, truncated or
// broken sequence), so that every byte of the input belongs to exactly one character.
size_t utf8_char_len(std::string_view s) {
  const auto c = static_cast<unsigned char>(s[0]);
  size_t len;
  if (c < 0x80)
    return 1;
  else if (c >= 0xC2 && c <= 0xDF)
    len = 2;
  else if (c >= 0xE0 && c <= 0xEF)
    len = 3;
  else if (c >= 0xF0 && c <= 0xF4)
    len = 4;
  else
    return 1;
  if (len > s.size()) return 1;
  for (size_t i = 1; i < len; ++i)
    if ((static_cast<unsigned char>(s[i]) & 0xC0) != 0x80) return 1;
  return len;
}

// A UTF-8 character (1..4 bytes) packed into an integer; distinct characters give distinct
// values (multi-byte characters have no zero byte, single bytes are < 0x100).
uint32_t pack_char(std::string_view c) {
  uint32_t v = 0;
  for (size_t i = 0; i < c.size(); ++i) v |= uint32_t(static_cast<unsigned char>(c[i])) << (8 * i);
  return v;
}

uint64_t char_pair_key(std::string_view a, std::string_view b) {
  return (uint64_t(pack_char(a)) << 32) | pack_char(b);
}

// One symbol of the BPE working sequence: a span of the prepared text, in a doubly linked list.
struct Symbol {
  uint32_t off = 0;
  uint32_t len = 0;    // 0 once merged into its left neighbour
  int32_t prev = -1;
  int32_t next = -1;
  bool frozen = false; // a user-defined piece: never merged
};

// A candidate merge of symbols `left` and `left.next`, valid while the pair still spans `len`
// bytes.
struct Candidate {
  float score;
  int32_t left;
  int32_t right;
  uint32_t len;
};

// Max-heap order: higher score first; equal scores, the leftmost pair first.
struct CandidateLess {
  bool operator()(const Candidate& a, const Candidate& b) const {
    if (a.score != b.score) return a.score < b.score;
    return a.left > b.left;
  }
};


// ---------------------------------------------------------------------------------------------
// Byte-level BPE pre-tokenizers: the `tokenizer.ggml.pre` names llama.cpp knows
// (src/llama-vocab.cpp, llama_vocab::impl::load) and the regexes each applies, in order
// (llm_tokenizer_bpe). Where llama.cpp rewrote a Hugging Face pattern for std::regex, the
// original tokenizer.json pattern is used instead, since unicode::Regex runs it directly:
// (?i:'s|...) rather than '[sS]|..., and tekken/gpt-4o's letter classes by sub-category.

// GPT-2 (openai/gpt-2 encoder.py).
#define LLMQ_RE_GPT2 R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)"
// Llama 3 (its tokenizer.json); Qwen2's is the same with \p{N} instead of \p{N}{1,3}.
#define LLMQ_RE_LLAMA3(N) \
  R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|)" N R"(| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"
// BLOOM / Poro: anything up to a separator.
#define LLMQ_RE_BLOOM R"( ?[^(\s|.,!?\u2026\u3002\uFF0C\u3001\u0964\u06D4\u060C)]+)"
// Tekken / GPT-4o letters: upper-case run then lower-case run, or the reverse.
#define LLMQ_RE_UPPER R"([\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}])"
#define LLMQ_RE_LOWER R"([\p{Ll}\p{Lm}\p{Lo}\p{M}])"
#define LLMQ_RE_CONTRACTION R"((?i:'s|'t|'re|'ve|'m|'ll|'d))"
// CJK ranges of the DeepSeek patterns.
#define LLMQ_RE_CJK R"([\u4E00-\u9FA5\u0800-\u4E00\uAC00-\uD7FF]+)"

struct PreTokenizer {
  std::vector<const char*> names;
  std::vector<const char*> regexes;
  bool ignore_merges = false;
};

const std::vector<PreTokenizer>& pre_tokenizers() {
  static const std::vector<PreTokenizer> table = {
      {{"default"},
       {R"([\p{P}\$\+<=>\^~\|]+)", LLMQ_RE_GPT2, R"(\p{N}+)", R"([0-9][0-9][0-9])"}},
      {{"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"},
       {LLMQ_RE_LLAMA3(R"(\p{N}{1,3})")},
       true},
      {{"dbrx", "smaug-bpe", "chatglm-bpe", "glm4"}, {LLMQ_RE_LLAMA3(R"(\p{N}{1,3})")}},
      {{"deepseek-llm"},
       {R"([\r\n])",
        // DeepSeek-LLM's letter class (cased letters, as its tokenizer.json spells them).
        R"(\s?[A-Za-z\u00B5\u00C0-\u00D6\u00D8-\u00F6\u00F8-\u01BA\u01BC-\u01BF\u01C4-\u0293)"
        R"(\u0295-\u02AF\u0370-\u0373\u0376\u0377\u037B-\u037D\u037F\u0386\u0388-\u038A\u038C)"
        R"(\u038E-\u03A1\u03A3-\u03F5\u03F7-\u0481\u048A-\u052F\u0531-\u0556\u10A0-\u10C5)"
        R"(\u13A0-\u13F5\u13F8-\u13FD\u1C90-\u1CBA\u1CBD-\u1CBF\u1D00-\u1D2B\u1D6B-\u1D77)"
        R"(\u1D79-\u1D9A\u1E00-\u1F15\u1F18-\u1F1D\u1F20-\u1F45\u1F48-\u1F4D\u1F50-\u1F57\u1F59)"
        R"(\u1F5B\u1F5D\u1F5F-\u1F7D\u1F80-\u1FB4\u1FB6-\u1FBC\u1FBE\u1FC2-\u1FC4\u1FC6-\u1FCC)"
        R"(\u1FD0-\u1FD3\u1FD6-\u1FDB\u1FE0-\u1FEC\u1FF2-\u1FF4\u1FF6-\u1FFC\u2102\u2107)"
        R"(\u210A-\u2113\u2115\u2119-\u211D\u2124\u2126\u2128\u212A-\u212D\u212F-\u2134\u2139)"
        R"(\u213C-\u213F\u2145-\u2149\u214E\u2183\u2184\u2C00-\u2C7B\u2C7E-\u2CE4\u2CEB-\u2CEE)"
        R"(\u2CF2\u2CF3\uA640-\uA66D\uA680-\uA69B\uA722-\uA76F\uA771-\uA787\uA78B-\uA78E)"
        R"(\uAB70-\uABBF\uFB00-\uFB06\uFB13-\uFB17\uFF21-\uFF3A\uFF41-\uFF5A\U00010400-\U0001044F)"
        R"(\U000104B0-\U000104D3\U000104D8-\U000104FB\U00010C80-\U00010CB2\U00010CC0-\U00010CF2)"
        R"(\U000118A0-\U000118DF\U0001E900-\U0001E943]+)",
        R"(\s?[!-/:-~\uFF01-\uFF0F\uFF1A-\uFF5E\u2018-\u201F\u3000-\u3002]+)",
        R"(\s+$)",
        LLMQ_RE_CJK,
        R"(\p{N}+)"}},
      {{"deepseek-coder"},
       {R"([\r\n])", R"(\s?\p{L}+)", R"(\s?\p{P}+)", LLMQ_RE_CJK, R"(\p{N})"}},
      {{"deepseek-v3", "hunyuan-dense"},
       {R"(\p{N}{1,3})",
        R"([\u4E00-\u9FA5\u3040-\u309F\u30A0-\u30FF]+)",
        R"([!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+)"
        R"(| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"}},
      {{"falcon"}, {R"([\p{P}\$\+<=>\^~\|`]+)", LLMQ_RE_GPT2, R"([0-9][0-9][0-9])"}},
      {{"starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"},
       {R"(\p{N})", LLMQ_RE_GPT2}},
      {{"gpt-2", "gpt2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v1-en", "jina-v2-es", "jina-v2-de",
        "jina-v2-code", "roberta-bpe", "a.x-4.0", "mellum", "exaone4", "mpt", "olmo", "jais", "trillion",
        "granite-docling"},
       {LLMQ_RE_GPT2}},
      {{"qwen2", "deepseek-r1-qwen", "kormo", "megrez", "stablelm2", "hunyuan", "grok-2"},
       {LLMQ_RE_LLAMA3(R"(\p{N})")}},
      {{"seed-coder"},
       {R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+)"
        R"(|\s+(?!\S)|\s+)"}},
      {{"bailingmoe", "bailingmoe2", "llada-moe"},
       // llama.cpp's form: the possessive quantifiers of the original made greedy.
       {R"('(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*)"
        R"(|\s*[\r\n]|\s+(?!\S)|\s+)"}},
      {{"poro-chat", "bloom", "gpt3-finnish"}, {LLMQ_RE_BLOOM}},
      {{"viking"}, {LLMQ_RE_BLOOM, R"(\p{N})"}},
      {{"tekken"},
       {R"([^\r\n\p{L}\p{N}]?)" LLMQ_RE_UPPER "*" LLMQ_RE_LOWER "+" R"(|[^\r\n\p{L}\p{N}]?)" LLMQ_RE_UPPER
        "+" LLMQ_RE_LOWER "*" R"(|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)"},
       true},
      {{"gpt-4o", "llama4", "minimax-m2"},
       {R"([^\r\n\p{L}\p{N}]?)" LLMQ_RE_UPPER "*" LLMQ_RE_LOWER "+" LLMQ_RE_CONTRACTION
        "?" R"(|[^\r\n\p{L}\p{N}]?)" LLMQ_RE_UPPER "+" LLMQ_RE_LOWER "*" LLMQ_RE_CONTRACTION
        "?" R"(|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)"}},
      {{"chameleon"},
       {R"(<sentinel:[0-9]+>)", R"((IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z)", R"(([\t\n]|    |  ))", R"(\p{N})",
        R"([\p{P}!-/:-@\[-`{-~])", LLMQ_RE_GPT2}},
  };
  return table;
}

const PreTokenizer* find_pre_tokenizer(std::string_view name) {
  if (name.empty()) name = "default";
  for (const PreTokenizer& p : pre_tokenizers())
    for (const char* n : p.names)
      if (name == n) return &p;
  return nullptr;
}

// A candidate byte-level merge of symbols `left` and `left.next`, valid while the pair still
// spans `len` bytes.
struct BpeCandidate {
  int32_t rank;
  int32_t left;
  int32_t right;
  int32_t result;
  uint32_t len;
};

// Heap order: the lowest rank on top; equal ranks, the leftmost pair (llama.cpp's
// llm_bigram_bpe::comparator).
struct BpeCandidateAfter {
  bool operator()(const BpeCandidate& a, const BpeCandidate& b) const {
    if (a.rank != b.rank) return a.rank > b.rank;
    return a.left > b.left;
  }
};

}  // namespace

Tokenizer::Tokenizer(Vocab v) : vocab_(std::move(v)) {
  check_vocab();
  byte_level_ = vocab_.model == "gpt2";
  index_pieces();
  if (byte_level_)
    init_bpe();
  else
    init_spm();
}

void Tokenizer::check_vocab() const {
  if (vocab_.model != "llama" && vocab_.model != "gpt2")
    throw UsageError(fmt::format("tokenizer model '{}' is not supported (supported: \"llama\", SentencePiece "
                                 "BPE; \"gpt2\", byte-level BPE)",
                                 vocab_.model));
  const size_t n = vocab_.tokens.size();
  if (n == 0) throw UsageError("tokenizer: the vocabulary is empty");
  if (n > static_cast<size_t>(INT32_MAX)) throw UsageError("tokenizer: vocabulary too large");
  if (vocab_.scores.size() != n || vocab_.types.size() != n)
    throw UsageError(fmt::format("tokenizer: vocabulary arrays differ in length ({} tokens, {} "
                                 "scores, {} types)",
                                 n, vocab_.scores.size(), vocab_.types.size()));
  auto check_id = [n](int32_t id, const char* what) {
    if (id < -1 || id >= static_cast<int64_t>(n))
      throw UsageError(fmt::format("tokenizer: {} id {} is out of range (vocabulary of {})", what, id, n));
  };
  check_id(vocab_.bos_id, "BOS");
  check_id(vocab_.eos_id, "EOS");
  check_id(vocab_.unk_id, "unknown-token");
  check_id(vocab_.pad_id, "padding");
  check_id(vocab_.eot_id, "end-of-turn");
}

void Tokenizer::index_pieces() {
  const size_t n = vocab_.tokens.size();
  byte_id_.fill(-1);
  byte_value_.assign(n, -1);
  all_.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const auto id = static_cast<int32_t>(i);
    const std::string& piece = vocab_.tokens[i];
    const int32_t type = vocab_.types[i];
    if (type < static_cast<int32_t>(TokenType::Normal) || type > static_cast<int32_t>(TokenType::Byte))
      throw UsageError(fmt::format("tokenizer: token {} has an invalid type {}", i, type));
    if (std::isnan(vocab_.scores[i])) throw UsageError(fmt::format("tokenizer: token {} has a NaN score", i));
    all_.emplace(piece, id);  // keeps the first id of a duplicated piece
    if (is_type(type, TokenType::Byte)) {
      const int b = hex_byte_value(piece);
      if (b < 0)
        throw UsageError(fmt::format("tokenizer: byte token {} is not spelled <0xNN>: '{}'", i, piece));
      byte_value_[i] = static_cast<int16_t>(b);
      if (byte_id_[static_cast<size_t>(b)] < 0) byte_id_[static_cast<size_t>(b)] = id;
      has_byte_pieces_ = true;
    }
    if (piece.empty()) continue;
    const auto first = static_cast<unsigned char>(piece[0]);
    if (is_type(type, TokenType::UserDefined)) {
      user_defined_[first].push_back(id);
      has_user_defined_ = true;
    }
    if (is_type(type, TokenType::UserDefined) || is_type(type, TokenType::Control) ||
        is_type(type, TokenType::Unknown)) {
      special_[first].push_back(id);
      has_special_ = true;
    }
  }
  auto longest_first = [this](FirstByteIndex& index) {
    for (auto& list : index) {
      std::stable_sort(list.begin(), list.end(), [this](int32_t a, int32_t b) {
        return vocab_.tokens[static_cast<size_t>(a)].size() > vocab_.tokens[static_cast<size_t>(b)].size();
      });
    }
  };
  longest_first(user_defined_);
  longest_first(special_);
}

void Tokenizer::init_spm() {
  const size_t n = vocab_.tokens.size();
  mergeable_.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const std::string& piece = vocab_.tokens[i];
    const int32_t type = vocab_.types[i];
    if ((is_type(type, TokenType::Normal) || is_type(type, TokenType::UserDefined)) && !piece.empty()) {
      mergeable_.emplace(piece, static_cast<int32_t>(i));
      // Split exactly as encode() splits text, so the pairs seen here are the pairs a merged
      // symbol can span there.
      const std::string_view p(piece);
      size_t prev_pos = 0, prev_len = 0;
      for (size_t pos = 0; pos < p.size();) {
        const size_t len = utf8_char_len(p.substr(pos));
        if (pos > 0) inner_pairs_.insert(char_pair_key(p.substr(prev_pos, prev_len), p.substr(pos, len)));
        prev_pos = pos;
        prev_len = len;
        pos += len;
      }
    }
  }
}

void Tokenizer::init_bpe() {
  if (vocab_.merges.empty()) throw UsageError("tokenizer: the byte-level BPE vocabulary has no merges");
  const PreTokenizer* pre = find_pre_tokenizer(vocab_.pre);
  if (!pre) {
    throw UsageError(fmt::format("tokenizer: unknown pre-tokenizer '{}' (tokenizer.ggml.pre); known: {}", vocab_.pre,
                                 fmt::join(known_pre_tokenizers(), ", ")));
  }
  for (const char* re : pre->regexes) pre_regex_.emplace_back(re);
  ignore_merges_ = pre->ignore_merges;
  init_bpe_merges();
  init_bpe_bytes();
}

void Tokenizer::init_bpe_merges() {
  // Merges "left right" by rank; llama.cpp splits at the first space after the first byte.
  merges_.reserve(vocab_.merges.size());
  std::string joined;
  for (size_t r = 0; r < vocab_.merges.size(); ++r) {
    const std::string& m = vocab_.merges[r];
    const size_t sp = m.find(' ', 1);
    if (sp == std::string::npos) continue;
    const std::string_view left = std::string_view(m).substr(0, sp);
    const std::string_view right = std::string_view(m).substr(sp + 1);
    joined.assign(left);
    joined += right;
    const int32_t l = token_id(left), rr = token_id(right), res = token_id(joined);
    if (l < 0 || rr < 0 || res < 0) continue;  // can never apply
    const uint64_t key = (uint64_t(uint32_t(l)) << 32) | uint32_t(rr);
    merges_.emplace(key, Merge{static_cast<int32_t>(std::min<size_t>(r, INT32_MAX)), res});  // first rank wins
  }
}

void Tokenizer::init_bpe_bytes() {
  std::string ch;
  for (int b = 0; b < 256; ++b) {
    ch.clear();
    unicode::append_utf8(ch, unicode::byte_to_unicode(static_cast<uint8_t>(b)));
    bpe_byte_piece_[static_cast<size_t>(b)] = token_id(ch);
    // Printable ASCII, tab, newline and CR must have their pieces, or ordinary text could not be
    // encoded (a vocabulary without byte pieces is refused here, at load or conversion, not at
    // run time). Real vocabularies lack some control bytes and bytes that valid UTF-8 never
    // holds (C0, C1, F5-FF): encode() drops such a byte, as llama.cpp and Hugging Face do.
    const bool needed = (b >= 0x20 && b <= 0x7E) || b == '\t' || b == '\n' || b == '\r';
    if (needed && bpe_byte_piece_[static_cast<size_t>(b)] < 0)
      throw UsageError(fmt::format("tokenizer: the byte-level BPE vocabulary has no piece for byte 0x{:02X} ('{}')", b, ch));
  }

  // Decoded bytes of every Normal piece.
  bpe_text_.resize(vocab_.tokens.size());
  for (size_t i = 0; i < vocab_.tokens.size(); ++i) {
    if (!is_type(vocab_.types[i], TokenType::Normal)) continue;
    const std::string& piece = vocab_.tokens[i];
    std::string& out = bpe_text_[i];
    for (size_t pos = 0; pos < piece.size();) {
      char32_t cp;
      const size_t len = unicode::decode_utf8(piece, pos, &cp);
      const int byte = unicode::unicode_to_byte(cp);
      if (byte >= 0)
        out += static_cast<char>(byte);
      else
        out.append(piece, pos, len);  // not a byte-level character: kept as it is
      pos += len;
    }
  }
}

std::vector<std::string> Tokenizer::known_pre_tokenizers() {
  std::vector<std::string> names;
  for (const PreTokenizer& p : pre_tokenizers())
    for (const char* n : p.names) names.emplace_back(n);
  std::sort(names.begin(), names.end());
  return names;
}

std::pair<int32_t, size_t> Tokenizer::match_piece(const FirstByteIndex& index, std::string_view text,
                                                  size_t pos) const {
  for (int32_t id : index[static_cast<unsigned char>(text[pos])]) {
    const std::string& p = vocab_.tokens[static_cast<size_t>(id)];
    if (text.compare(pos, p.size(), p) == 0) return {id, p.size()};  // longest first
  }
  return {-1, 0};
}

size_t Tokenizer::match_user_defined(std::string_view text, size_t pos) const {
  for (int32_t id : user_defined_[static_cast<unsigned char>(text[pos])]) {
    const std::string& p = vocab_.tokens[static_cast<size_t>(id)];
    if (text.compare(pos, p.size(), p) == 0) return p.size();  // longest first
  }
  return 0;
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_bos, bool parse_special) const {
  std::vector<int32_t> out;
  if (add_bos && vocab_.bos_id >= 0) out.push_back(vocab_.bos_id);
  if (text.empty()) return out;

  // Which pieces are split out of the text before the plain text is encoded.
  const FirstByteIndex* index = nullptr;
  if (parse_special && has_special_)
    index = &special_;
  else if (has_user_defined_)  // always split out of the raw text first (llama.cpp, Hugging Face)
    index = &user_defined_;
  if (!index) {
    if (byte_level_)
      bpe_encode(text, out);
    else
      spm_encode(text, vocab_.add_space_prefix, out);
    return out;
  }

  // llama.cpp's tokenizer_st_partition, scanning left to right with the longest piece first.
  bool prev_special = true;  // SentencePiece: the dummy prefix goes at the start and after specials
  auto plain = [&](std::string_view part) {
    if (part.empty()) return;
    if (byte_level_)
      bpe_encode(part, out);
    else
      spm_encode(part, vocab_.add_space_prefix && prev_special, out);
    prev_special = false;
  };
  size_t start = 0;
  for (size_t pos = 0; pos < text.size();) {
    const auto [id, len] = match_piece(*index, text, pos);
    if (id < 0) {
      ++pos;
      continue;
    }
    plain(text.substr(start, pos - start));
    out.push_back(id);
    prev_special = true;
    pos += len;
    start = pos;
  }
  plain(text.substr(start));
  return out;
}

// Working text and symbols of one spm_encode call.
struct Tokenizer::SpmScratch {
  std::string s;                  // the normalized text
  std::vector<Symbol> sym;        // its characters (user-defined pieces whole), merged in place
  std::vector<int32_t> seg_start; // first symbol of each merge segment, then sym.size()
};

namespace {

// SentencePiece's normalization: the dummy prefix (when asked) and every space as "▁".
// Throws UsageError for text too long for 32-bit symbol offsets.
std::string spm_normalize(std::string_view text, bool space_prefix) {
  const size_t n_spaces = static_cast<size_t>(std::count(text.begin(), text.end(), ' '));
  std::string s;
  s.reserve(text.size() + 2 * n_spaces + kSpaceMark.size());
  if (space_prefix) s += kSpaceMark;
  for (char c : text) {
    if (c == ' ')
      s += kSpaceMark;
    else
      s += c;
  }
  if (s.size() >= static_cast<size_t>(INT32_MAX))
    throw UsageError(fmt::format("tokenizer: text of {} bytes is too long to encode at once", text.size()));
  return s;
}

}  // namespace

void Tokenizer::spm_encode(std::string_view text, bool space_prefix, std::vector<int32_t>& out) const {
  if (text.empty()) return;
  SpmScratch w;
  w.s = spm_normalize(text, space_prefix);  // 1. dummy prefix, spaces as "▁"
  spm_split(w);                             // 2. characters, in segments no merge crosses
  spm_merge(w);                             // 3. best-scoring merges in each segment
  spm_emit(w, out);                         // 4. symbols to ids, with byte fallback
}

// Split into characters (user-defined pieces whole), and cut the list into segments wherever
// no merge can ever join the neighbours (see inner_pairs_).
void Tokenizer::spm_split(SpmScratch& w) const {
  std::vector<Symbol>& sym = w.sym;
  sym.reserve(w.s.size());
  const std::string_view sv(w.s);
  for (size_t pos = 0; pos < sv.size();) {
    Symbol x;
    size_t len = has_user_defined_ ? match_user_defined(sv, pos) : 0;
    x.frozen = len > 0;
    if (len == 0) len = utf8_char_len(sv.substr(pos));
    x.off = static_cast<uint32_t>(pos);
    x.len = static_cast<uint32_t>(len);
    const auto idx = static_cast<int32_t>(sym.size());
    bool cut = sym.empty();
    if (!cut) {
      Symbol& p = sym.back();
      cut = p.frozen || x.frozen ||
            !inner_pairs_.contains(char_pair_key(sv.substr(p.off, p.len), sv.substr(pos, len)));
      if (!cut) {
        x.prev = idx - 1;
        p.next = idx;
      }
    }
    if (cut) w.seg_start.push_back(idx);
    sym.push_back(x);
    pos += len;
  }
  w.seg_start.push_back(static_cast<int32_t>(sym.size()));
}

// In each segment, merge the best-scoring adjacent pair until none is a piece.
void Tokenizer::spm_merge(SpmScratch& w) const {
  std::vector<Symbol>& sym = w.sym;
  const std::string_view sv(w.s);
  std::vector<Candidate> heap;  // max-heap under CandidateLess, reused across segments
  const CandidateLess less;
  auto try_pair = [&](int32_t l, int32_t r) {
    if (l < 0 || r < 0) return;
    const Symbol& a = sym[static_cast<size_t>(l)];
    const Symbol& b = sym[static_cast<size_t>(r)];
    if (a.frozen || b.frozen) return;
    const auto it = mergeable_.find(sv.substr(a.off, size_t(a.len) + b.len));
    if (it == mergeable_.end()) return;
    heap.push_back(Candidate{vocab_.scores[static_cast<size_t>(it->second)], l, r, a.len + b.len});
    std::push_heap(heap.begin(), heap.end(), less);
  };
  for (size_t k = 0; k + 1 < w.seg_start.size(); ++k) {
    const int32_t first = w.seg_start[k], last = w.seg_start[k + 1];
    if (last - first < 2) continue;
    heap.clear();
    for (int32_t i = first + 1; i < last; ++i) try_pair(i - 1, i);
    while (!heap.empty()) {
      std::pop_heap(heap.begin(), heap.end(), less);
      const Candidate c = heap.back();
      heap.pop_back();
      Symbol& a = sym[static_cast<size_t>(c.left)];
      Symbol& b = sym[static_cast<size_t>(c.right)];
      // Stale if either side was merged away or grew since the candidate was pushed.
      if (a.len == 0 || b.len == 0 || a.next != c.right || a.len + b.len != c.len) continue;
      a.len += b.len;
      b.len = 0;
      a.next = b.next;
      if (b.next >= 0) sym[static_cast<size_t>(b.next)].prev = c.left;
      try_pair(a.prev, c.left);
      try_pair(c.left, a.next);
    }
  }
}

// Symbols (those not merged away, in text order) to ids, with byte fallback. Throws UsageError
// for a character the vocabulary cannot express (no byte pieces and no unknown token).
void Tokenizer::spm_emit(const SpmScratch& w, std::vector<int32_t>& out) const {
  const std::string_view sv(w.s);
  for (const Symbol& x : w.sym) {
    if (x.len == 0) continue;
    const std::string_view piece = sv.substr(x.off, x.len);
    const auto it = mergeable_.find(piece);
    if (it != mergeable_.end()) {
      out.push_back(it->second);
      continue;
    }
    if (has_byte_pieces_) {
      for (char ch : piece) {
        const int32_t id = byte_id_[static_cast<unsigned char>(ch)];
        if (id >= 0) {
          out.push_back(id);
        } else if (vocab_.unk_id >= 0) {
          out.push_back(vocab_.unk_id);
        } else {
          throw UsageError(fmt::format("tokenizer: byte 0x{:02X} has no piece and the vocabulary has "
                                       "no unknown token", static_cast<unsigned char>(ch)));
        }
      }
    } else if (vocab_.unk_id >= 0) {
      out.push_back(vocab_.unk_id);
    } else {
      throw UsageError("tokenizer: text holds a character outside the vocabulary, which has neither "
                       "byte-fallback pieces nor an unknown token");
    }
  }
}

// Working memory of one bpe_encode call, reused across its words.
struct Tokenizer::BpeScratch {
  struct Symbol {
    int32_t id;      // piece id (-1: a byte whose character is not a piece)
    uint32_t len;    // bytes; 0 once merged into its left neighbour
    int32_t prev;
    int32_t next;
  };
  unicode::CodepointText text;
  std::vector<Symbol> sym;
  std::vector<BpeCandidate> heap;
  std::string mapped;
};

void Tokenizer::bpe_encode(std::string_view text, std::vector<int32_t>& out) const {
  if (text.empty()) return;
  BpeScratch s;
  s.text.assign(text);
  std::vector<uint32_t> ends{static_cast<uint32_t>(s.text.size())};
  for (const unicode::Regex& re : pre_regex_) ends = re.split(s.text, ends);
  uint32_t begin = 0;
  for (const uint32_t end : ends) {
    const uint32_t b = s.text.offsets[begin], e = s.text.offsets[end];
    bpe_word(text.substr(b, e - b), s, out);
    begin = end;
  }
}

void Tokenizer::bpe_word(std::string_view word, BpeScratch& s, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    s.mapped.clear();
    for (char c : word) unicode::append_utf8(s.mapped, unicode::byte_to_unicode(static_cast<uint8_t>(c)));
    const int32_t id = token_id(s.mapped);
    if (id >= 0) {
      out.push_back(id);
      return;
    }
  }
  const auto n = static_cast<int32_t>(word.size());
  s.sym.resize(word.size());
  for (int32_t i = 0; i < n; ++i)
    s.sym[size_t(i)] = {bpe_byte_piece_[static_cast<unsigned char>(word[size_t(i)])], 1, i - 1, i + 1 < n ? i + 1 : -1};

  auto& sym = s.sym;
  auto& heap = s.heap;
  heap.clear();
  const BpeCandidateAfter after;
  auto try_pair = [&](int32_t l, int32_t r) {
    if (l < 0 || r < 0) return;
    const auto& a = sym[size_t(l)];
    const auto& b = sym[size_t(r)];
    if (a.id < 0 || b.id < 0) return;
    const auto it = merges_.find((uint64_t(uint32_t(a.id)) << 32) | uint32_t(b.id));
    if (it == merges_.end()) return;
    heap.push_back(BpeCandidate{it->second.rank, l, r, it->second.result, a.len + b.len});
    std::push_heap(heap.begin(), heap.end(), after);
  };
  for (int32_t i = 1; i < n; ++i) try_pair(i - 1, i);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), after);
    const BpeCandidate c = heap.back();
    heap.pop_back();
    auto& a = sym[size_t(c.left)];
    auto& b = sym[size_t(c.right)];
    // Stale if either side was merged away or grew since the candidate was pushed.
    if (a.len == 0 || b.len == 0 || a.next != c.right || a.len + b.len != c.len) continue;
    a.id = c.result;
    a.len += b.len;
    b.len = 0;
    a.next = b.next;
    if (b.next >= 0) sym[size_t(b.next)].prev = c.left;
    try_pair(a.prev, c.left);
    try_pair(c.left, a.next);
  }
  // A byte whose character is not a piece is dropped, as llama.cpp and Hugging Face's BPE do.
  for (int32_t i = 0; i >= 0; i = sym[size_t(i)].next)
    if (sym[size_t(i)].id >= 0) out.push_back(sym[size_t(i)].id);
}

std::string Tokenizer::decode_piece(int32_t prev_id, int32_t id, bool show_special) const {
  if (id < 0 || static_cast<size_t>(id) >= vocab_.tokens.size())
    throw UsageError(fmt::format("tokenizer: token id {} is out of range (vocabulary of {})", id,
                                 vocab_.tokens.size()));
  const auto i = static_cast<size_t>(id);
  const int32_t type = vocab_.types[i];
  if (is_type(type, TokenType::Byte)) return std::string(1, static_cast<char>(byte_value_[i]));
  if (is_type(type, TokenType::Control) || is_type(type, TokenType::Unknown))
    return show_special ? vocab_.tokens[i] : std::string();
  if (is_type(type, TokenType::Unused)) return {};
  if (byte_level_) return is_type(type, TokenType::Normal) ? bpe_text_[i] : vocab_.tokens[i];

  const std::string& piece = vocab_.tokens[i];
  std::string out;
  out.reserve(piece.size());
  for (size_t pos = 0; pos < piece.size();) {
    if (piece.compare(pos, kSpaceMark.size(), kSpaceMark) == 0) {
      out += ' ';
      pos += kSpaceMark.size();
    } else {
      out += piece[pos++];
    }
  }
  const bool at_start = prev_id < 0 || prev_id == vocab_.bos_id;
  if (at_start && vocab_.add_space_prefix && !out.empty() && out[0] == ' ') out.erase(0, 1);
  return out;
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids, bool show_special) const {
  std::string out;
  int32_t prev = -1;
  for (int32_t id : ids) {
    out += decode_piece(prev, id, show_special);
    prev = id;
  }
  return out;
}

int32_t Tokenizer::token_id(std::string_view piece) const {
  const auto it = all_.find(piece);
  return it == all_.end() ? -1 : it->second;
}

}  // namespace llmq
