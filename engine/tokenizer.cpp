// SentencePiece-style BPE tokenizer (see tokenizer.h for the algorithm and its sources).
#include "engine/tokenizer.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>

#include <fmt/format.h>

#include "formats/error.h"

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

}  // namespace

Tokenizer::Tokenizer(Vocab v) : vocab_(std::move(v)) {
  if (vocab_.model != "llama")
    throw UsageError(fmt::format("tokenizer model '{}' is not supported (only SentencePiece BPE, "
                                 "model \"llama\")",
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

  byte_id_.fill(-1);
  byte_value_.assign(n, -1);
  all_.reserve(n);
  mergeable_.reserve(n);
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
    if ((is_type(type, TokenType::Normal) || is_type(type, TokenType::UserDefined)) && !piece.empty()) {
      mergeable_.emplace(piece, id);
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
    if (is_type(type, TokenType::UserDefined) && !piece.empty()) {
      user_defined_[static_cast<unsigned char>(piece[0])].push_back(id);
      has_user_defined_ = true;
    }
  }
  for (auto& list : user_defined_) {
    std::stable_sort(list.begin(), list.end(), [this](int32_t a, int32_t b) {
      return vocab_.tokens[static_cast<size_t>(a)].size() > vocab_.tokens[static_cast<size_t>(b)].size();
    });
  }
}

size_t Tokenizer::match_user_defined(std::string_view text, size_t pos) const {
  for (int32_t id : user_defined_[static_cast<unsigned char>(text[pos])]) {
    const std::string& p = vocab_.tokens[static_cast<size_t>(id)];
    if (text.compare(pos, p.size(), p) == 0) return p.size();  // longest first
  }
  return 0;
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_bos) const {
  std::vector<int32_t> out;
  if (add_bos && vocab_.bos_id >= 0) out.push_back(vocab_.bos_id);
  if (text.empty()) return out;

  // 1. Normalize: dummy prefix, spaces as "▁".
  const size_t n_spaces = static_cast<size_t>(std::count(text.begin(), text.end(), ' '));
  std::string s;
  s.reserve(text.size() + 2 * n_spaces + kSpaceMark.size());
  if (vocab_.add_space_prefix) s += kSpaceMark;
  for (char c : text) {
    if (c == ' ')
      s += kSpaceMark;
    else
      s += c;
  }
  if (s.size() >= static_cast<size_t>(INT32_MAX))
    throw UsageError(fmt::format("tokenizer: text of {} bytes is too long to encode at once", text.size()));

  // 2. Split into characters (user-defined pieces whole), and cut the list into segments
  //    wherever no merge can ever join the neighbours (see inner_pairs_).
  std::vector<Symbol> sym;
  sym.reserve(s.size());
  std::vector<int32_t> seg_start;  // first symbol of each segment
  const std::string_view sv(s);
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
    if (cut) seg_start.push_back(idx);
    sym.push_back(x);
    pos += len;
  }
  seg_start.push_back(static_cast<int32_t>(sym.size()));

  // 3. In each segment, merge the best-scoring adjacent pair until none is a piece.
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
  for (size_t k = 0; k + 1 < seg_start.size(); ++k) {
    const int32_t first = seg_start[k], last = seg_start[k + 1];
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

  // 4. Symbols (those not merged away, in text order) to ids, with byte fallback.
  for (size_t i = 0; i < sym.size(); ++i) {
    if (sym[i].len == 0) continue;
    const Symbol& x = sym[i];
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
  return out;
}

std::string Tokenizer::decode_piece(int32_t prev_id, int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= vocab_.tokens.size())
    throw UsageError(fmt::format("tokenizer: token id {} is out of range (vocabulary of {})", id,
                                 vocab_.tokens.size()));
  const auto i = static_cast<size_t>(id);
  const int32_t type = vocab_.types[i];
  if (is_type(type, TokenType::Byte)) return std::string(1, static_cast<char>(byte_value_[i]));
  if (is_type(type, TokenType::Control) || is_type(type, TokenType::Unknown) ||
      is_type(type, TokenType::Unused))
    return {};

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

std::string Tokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string out;
  int32_t prev = -1;
  for (int32_t id : ids) {
    out += decode_piece(prev, id);
    prev = id;
  }
  return out;
}

int32_t Tokenizer::token_id(std::string_view piece) const {
  const auto it = all_.find(piece);
  return it == all_.end() ? -1 : it->second;
}

}  // namespace llmq
