// Unicode tables access, UTF-8, GPT-2's byte mapping and the code point regex matcher (see
// unicode.h for the sources and the supported syntax).
#include "text/unicode.h"

#include <algorithm>
#include <array>
#include <limits>

#include <fmt/format.h>

#include "base/error.h"

namespace llmq::unicode {
namespace {

struct AsciiFlags {
  std::array<uint32_t, 128> f{};
  AsciiFlags() {
    for (char32_t c = 0; c < 128; ++c) f[c] = flag(category(c)) | (is_whitespace(c) ? kWhiteSpace : 0);
  }
};
const AsciiFlags& ascii_flags() {
  static const AsciiFlags t;
  return t;
}

struct ByteMap {
  std::array<char32_t, 256> to_cp{};
  std::array<int16_t, 0x144> to_byte{};  // every mapped code point is below U+0144
  ByteMap() {
    to_byte.fill(-1);
    char32_t extra = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      to_cp[b] = printable ? char32_t(b) : extra++;
      to_byte[to_cp[b]] = int16_t(b);
    }
  }
};
const ByteMap& byte_map() {
  static const ByteMap m;
  return m;
}

}  // namespace

const char* version() { return detail::kUnicodeVersion; }

Category category(char32_t cp) {
  if (cp >= 0x110000) return Category::Cn;
  const uint32_t* first = detail::kCategoryRanges;
  const uint32_t* last = first + detail::kCategoryRangeCount;
  // The last range starting at or before cp.
  const uint32_t* it = std::upper_bound(first, last, (uint32_t(cp) << 5) | 31u);
  return static_cast<Category>(*(it - 1) & 31u);
}

bool is_whitespace(char32_t cp) {
  const uint32_t* first = detail::kWhiteSpace;
  const uint32_t* last = first + detail::kWhiteSpaceCount;
  return std::binary_search(first, last, uint32_t(cp));
}

uint32_t flags(char32_t cp) {
  if (cp < 128) return ascii_flags().f[cp];
  return flag(category(cp)) | (is_whitespace(cp) ? kWhiteSpace : 0);
}

char32_t to_lower(char32_t cp) {
  if (cp < 128) return (cp >= 'A' && cp <= 'Z') ? cp + 32 : cp;
  const detail::LowerRun* first = detail::kLowerRuns;
  const detail::LowerRun* last = first + detail::kLowerRunCount;
  const auto* it = std::upper_bound(first, last, uint32_t(cp),
                                    [](uint32_t v, const detail::LowerRun& r) { return v < r.first; });
  if (it == first) return cp;
  const detail::LowerRun& r = *(it - 1);
  if (cp > r.last || (cp - r.first) % r.stride != 0) return cp;
  return char32_t(int64_t(cp) + r.delta);
}

size_t decode_utf8(std::string_view s, size_t pos, char32_t* cp) {
  const auto b = [&](size_t i) { return static_cast<unsigned char>(s[pos + i]); };
  const unsigned c = b(0);
  *cp = kInvalidByte + c;
  if (c < 0x80) {
    *cp = c;
    return 1;
  }
  size_t len;
  unsigned lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  char32_t v;
  if (c >= 0xC2 && c <= 0xDF) {
    len = 2;
    v = c & 0x1F;
  } else if (c >= 0xE0 && c <= 0xEF) {
    len = 3;
    v = c & 0x0F;
    if (c == 0xE0) lo = 0xA0;  // no overlong forms
    if (c == 0xED) hi = 0x9F;  // no surrogates
  } else if (c >= 0xF0 && c <= 0xF4) {
    len = 4;
    v = c & 0x07;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;  // nothing above U+10FFFF
  } else {
    return 1;
  }
  if (pos + len > s.size()) return 1;
  if (b(1) < lo || b(1) > hi) return 1;
  for (size_t i = 1; i < len; ++i) {
    if ((b(i) & 0xC0) != 0x80) return 1;
    v = (v << 6) | (b(i) & 0x3F);
  }
  *cp = v;
  return len;
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xC0 | (cp >> 6));
    out += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += char(0xE0 | (cp >> 12));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  } else {
    out += char(0xF0 | (cp >> 18));
    out += char(0x80 | ((cp >> 12) & 0x3F));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  }
}

char32_t byte_to_unicode(uint8_t b) { return byte_map().to_cp[b]; }

int unicode_to_byte(char32_t cp) { return cp < 0x144 ? byte_map().to_byte[cp] : -1; }

void CodepointText::assign(std::string_view text) {
  if (text.size() >= std::numeric_limits<uint32_t>::max())
    throw UsageError(fmt::format("text of {} bytes is too long to pre-tokenize at once", text.size()));
  cps.clear();
  flags.clear();
  offsets.clear();
  cps.reserve(text.size());
  flags.reserve(text.size());
  offsets.reserve(text.size() + 1);
  const auto& af = ascii_flags().f;
  for (size_t pos = 0; pos < text.size();) {
    const auto c = static_cast<unsigned char>(text[pos]);
    char32_t cp;
    size_t len = 1;
    uint32_t fl;
    if (c < 0x80) {
      cp = c;
      fl = af[c];
    } else {
      len = decode_utf8(text, pos, &cp);
      fl = unicode::flags(cp);
    }
    cps.push_back(cp);
    flags.push_back(fl);
    offsets.push_back(uint32_t(pos));
    pos += len;
  }
  offsets.push_back(uint32_t(text.size()));
}

// ---------------------------------------------------------------------------------------------
// Regex: parser

bool Regex::CharClass::contains(char32_t cp, uint32_t fl) const {
  if (cp < 128 && !fold) return (ascii[cp >> 6] >> (cp & 63)) & 1u;
  if (fold) cp = to_lower(cp);
  bool in = (fl & mask) != 0;
  if (!in && !ranges.empty()) {
    auto it = std::upper_bound(ranges.begin(), ranges.end(), cp,
                               [](char32_t v, const std::pair<char32_t, char32_t>& r) { return v < r.first; });
    in = it != ranges.begin() && cp <= (it - 1)->second;
  }
  return in != negated;
}

class Regex::Parser {
 public:
  Parser(Regex& re, std::string_view p) : re_(re), p_(p) {}

  void parse() {
    const int top = new_node(Kind::Group);
    std::vector<int> alts = alternation(false);
    re_.nodes_[size_t(top)].alts = std::move(alts);
    if (i_ != p_.size()) fail("unbalanced ')'");
    re_.start_ = top;
    for (CharClass& c : re_.classes_) finish_class(c);
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw UsageError(fmt::format("regex '{}': {} at byte {}", p_, what, i_));
  }
  bool at_end() const { return i_ >= p_.size(); }
  char peek() const { return p_[i_]; }

  int new_node(Kind k) {
    re_.nodes_.push_back(Node{});
    re_.nodes_.back().kind = k;
    return int(re_.nodes_.size() - 1);
  }
  int new_class_node(CharClass c) {
    re_.classes_.push_back(std::move(c));
    const int n = new_node(Kind::Class);
    re_.nodes_[size_t(n)].cls = int(re_.classes_.size() - 1);
    return n;
  }

  // alternatives up to ')' (when nested) or the end
  std::vector<int> alternation(bool nested) {
    std::vector<int> alts;
    alts.push_back(sequence());
    while (!at_end() && peek() == '|') {
      ++i_;
      alts.push_back(sequence());
    }
    if (nested) {
      if (at_end() || peek() != ')') fail("missing ')'");
      ++i_;
    }
    return alts;
  }

  // a chain of quantified atoms; returns its first node (-1 if empty)
  int sequence() {
    int first = -1, last = -1;
    while (!at_end() && peek() != '|' && peek() != ')') {
      const int n = atom();
      quantifier(n);
      if (first < 0)
        first = n;
      else
        re_.nodes_[size_t(last)].next = n;
      last = n;
    }
    return first;
  }

  int atom() {
    const char c = peek();
    if (c == '(') {
      ++i_;
      Kind kind = Kind::Group;
      const bool outer_fold = fold_;
      if (!at_end() && peek() == '?') {
        ++i_;
        if (at_end()) fail("bad group");
        const char g = p_[i_++];
        if (g == ':') {
        } else if (g == '=') {
          kind = Kind::Ahead;
        } else if (g == '!') {
          kind = Kind::NotAhead;
        } else if (g == 'i' && !at_end() && peek() == ':') {
          ++i_;
          fold_ = true;
        } else {
          fail("unsupported group");
        }
      }
      const int n = new_node(kind);
      std::vector<int> alts = alternation(true);
      re_.nodes_[size_t(n)].alts = std::move(alts);
      fold_ = outer_fold;
      return n;
    }
    if (c == '[') return new_class_node(bracket());
    if (c == '$') {
      ++i_;
      return new_node(Kind::End);
    }
    if (c == '.' || c == '^' || c == '*' || c == '+' || c == '?' || c == '{') fail(fmt::format("unsupported '{}'", c));
    CharClass cls;
    if (c == '\\') {
      escape(cls, false);
    } else {
      const char32_t cp = literal();
      if (fold_) {
        cls.fold = true;
        cls.ranges.push_back({to_lower(cp), to_lower(cp)});
      } else {
        cls.ranges.push_back({cp, cp});
      }
    }
    return new_class_node(std::move(cls));
  }

  char32_t literal() {
    char32_t cp;
    const size_t len = decode_utf8(p_, i_, &cp);
    if (cp >= kInvalidByte) fail("invalid UTF-8");
    i_ += len;
    return cp;
  }

  uint32_t hex(size_t digits) {
    if (i_ + digits > p_.size()) fail("short hex escape");
    uint32_t v = 0;
    for (size_t k = 0; k < digits; ++k) {
      const char h = p_[i_++];
      int d;
      if (h >= '0' && h <= '9')
        d = h - '0';
      else if (h >= 'a' && h <= 'f')
        d = h - 'a' + 10;
      else if (h >= 'A' && h <= 'F')
        d = h - 'A' + 10;
      else
        fail("bad hex digit");
      v = v * 16 + uint32_t(d);
    }
    if (v >= 0x110000) fail("code point out of range");
    return v;
  }

  uint32_t category_mask() {
    if (at_end() || peek() != '{') fail("expected '{' after \\p");
    const size_t close = p_.find('}', i_);
    if (close == std::string_view::npos) fail("missing '}'");
    const std::string_view name = p_.substr(i_ + 1, close - i_ - 1);
    i_ = close + 1;
    static constexpr const char* kNames[kCategoryCount] = {
        "Lu", "Ll", "Lt", "Lm", "Lo", "Mn", "Mc", "Me", "Nd", "Nl", "No", "Pc", "Pd", "Ps", "Pe",
        "Pi", "Pf", "Po", "Sm", "Sc", "Sk", "So", "Zs", "Zl", "Zp", "Cc", "Cf", "Cs", "Co", "Cn"};
    if (name.size() == 1) {
      uint32_t m = 0;
      for (int k = 0; k < kCategoryCount; ++k)
        if (kNames[k][0] == name[0]) m |= 1u << k;
      if (m) return m;
    } else {
      for (int k = 0; k < kCategoryCount; ++k)
        if (name == kNames[k]) return 1u << k;
    }
    fail(fmt::format("unknown category '{}'", name));
  }

  // After '\\': fills `cls` (adds to it inside a bracket). Negated escapes are refused inside
  // brackets.
  void escape(CharClass& cls, bool in_bracket) {
    ++i_;  // the backslash
    if (at_end()) fail("trailing backslash");
    const char e = p_[i_++];
    auto add = [&](char32_t a, char32_t b) { cls.ranges.push_back({a, b}); };
    auto negated = [&]() {
      if (in_bracket) fail("negated escape inside a class");
      cls.negated = true;
    };
    switch (e) {
      case 's': cls.mask |= kWhiteSpace; return;
      case 'S': negated(); cls.mask |= kWhiteSpace; return;
      case 'd': add('0', '9'); return;
      case 'D': negated(); add('0', '9'); return;
      case 'p': cls.mask |= category_mask(); return;
      case 'P': negated(); cls.mask |= category_mask(); return;
      case 'r': add('\r', '\r'); return;
      case 'n': add('\n', '\n'); return;
      case 't': add('\t', '\t'); return;
      case 'f': add('\f', '\f'); return;
      case 'v': add('\v', '\v'); return;
      case 'u': { const char32_t v = hex(4); add(v, v); return; }
      case 'U': { const char32_t v = hex(8); add(v, v); return; }
      default:
        if ((e >= '!' && e <= '/') || (e >= ':' && e <= '@') || (e >= '[' && e <= '`') || (e >= '{' && e <= '~')) {
          add(char32_t(e), char32_t(e));  // punctuation: the same under (?i:...)
          return;
        }
        --i_;
        fail(fmt::format("unsupported escape '\\{}'", e));
    }
  }

  // One bracket member that can end a range: a literal or a single-character escape.
  bool single_char(char32_t* out) {
    if (peek() != '\\') {
      *out = literal();
      return true;
    }
    const size_t save = i_;
    CharClass tmp;
    escape(tmp, true);
    if (tmp.mask == 0 && tmp.ranges.size() == 1 && tmp.ranges[0].first == tmp.ranges[0].second) {
      *out = tmp.ranges[0].first;
      return true;
    }
    i_ = save;
    return false;
  }

  CharClass bracket() {
    if (fold_) fail("classes inside (?i:...) are not supported");
    ++i_;  // '['
    CharClass cls;
    if (!at_end() && peek() == '^') {
      cls.negated = true;
      ++i_;
    }
    bool first = true;
    while (true) {
      if (at_end()) fail("missing ']'");
      if (peek() == ']' && !first) {
        ++i_;
        break;
      }
      first = false;
      char32_t lo;
      if (!single_char(&lo)) {
        escape(cls, true);  // \s, \p{..}, \d
        continue;
      }
      if (i_ + 1 < p_.size() && peek() == '-' && p_[i_ + 1] != ']') {
        ++i_;
        char32_t hi;
        if (!single_char(&hi)) fail("bad range end");
        if (hi < lo) fail("reversed range");
        cls.ranges.push_back({lo, hi});
      } else {
        cls.ranges.push_back({lo, lo});
      }
    }
    return cls;
  }

  void quantifier(int n) {
    if (at_end()) return;
    int mn, mx;
    const char c = peek();
    if (c == '?') {
      mn = 0;
      mx = 1;
      ++i_;
    } else if (c == '*') {
      mn = 0;
      mx = -1;
      ++i_;
    } else if (c == '+') {
      mn = 1;
      mx = -1;
      ++i_;
    } else if (c == '{') {
      ++i_;
      auto number = [&]() {
        if (at_end() || peek() < '0' || peek() > '9') fail("expected a number");
        int v = 0;
        while (!at_end() && peek() >= '0' && peek() <= '9') {
          v = v * 10 + (peek() - '0');
          if (v > 100000) fail("repeat count too large");
          ++i_;
        }
        return v;
      };
      mn = number();
      mx = mn;
      if (!at_end() && peek() == ',') {
        ++i_;
        mx = (!at_end() && peek() == '}') ? -1 : number();
      }
      if (at_end() || peek() != '}') fail("missing '}'");
      ++i_;
      if (mx >= 0 && mx < mn) fail("bad repeat range");
    } else {
      return;
    }
    if (!at_end() && (peek() == '?' || peek() == '+' || peek() == '*' || peek() == '{'))
      fail("lazy, possessive or stacked quantifiers are not supported");
    Node& node = re_.nodes_[size_t(n)];
    if (node.kind == Kind::Ahead || node.kind == Kind::NotAhead || node.kind == Kind::End)
      fail("quantified assertion");
    node.min = mn;
    node.max = mx;
  }

  static void finish_class(CharClass& c) {
    std::sort(c.ranges.begin(), c.ranges.end());
    std::vector<std::pair<char32_t, char32_t>> merged;
    for (const auto& r : c.ranges) {
      if (!merged.empty() && r.first <= merged.back().second + 1)
        merged.back().second = std::max(merged.back().second, r.second);
      else
        merged.push_back(r);
    }
    c.ranges = std::move(merged);
    c.ascii[0] = c.ascii[1] = 0;
    if (!c.fold) {
      const auto& af = ascii_flags().f;
      for (char32_t cp = 0; cp < 128; ++cp) {
        bool in = (af[cp] & c.mask) != 0;
        for (const auto& r : c.ranges) in = in || (cp >= r.first && cp <= r.second);
        if (in != c.negated) c.ascii[cp >> 6] |= uint64_t(1) << (cp & 63);
      }
    }
  }

  Regex& re_;
  std::string_view p_;
  size_t i_ = 0;
  bool fold_ = false;
};

Regex::Regex(std::string_view pattern) : pattern_(pattern) {
  Parser(*this, pattern_).parse();
}

// ---------------------------------------------------------------------------------------------
// Regex: matcher (backtracking with explicit continuations on the C++ stack)

struct Regex::Cont {
  enum Type : uint8_t { Done, Then, Loop, Accept } type;
  int node;          // Then: node to continue at; Loop: the repeated group
  int count;         // Loop: iterations completed, this one included
  size_t start;      // Loop: where this iteration started
  const Cont* next;  // what follows
};

struct Regex::Matcher {
  const Regex& re;
  const char32_t* cps;
  const uint32_t* fl;
  size_t end;
  size_t result = 0;
  // Per Class node: the last run measured, [start, start + length) of matching code points,
  // ending before `end` or at a non-matching one. A later start inside it ends at the same
  // place, which keeps scans over long runs (e.g. \s+$ tried at every space) linear.
  struct RunCache {
    size_t start = SIZE_MAX;
    size_t length = 0;
    size_t end = 0;  // the fragment end it was measured against
  };
  std::vector<RunCache> runs;

  Matcher(const Regex& r, const CodepointText& t, size_t e)
      : re(r), cps(t.cps.data()), fl(t.flags.data()), end(e), runs(r.nodes_.size()) {}


  // Number of consecutive code points from `pos` that match node `ni`'s class (unbounded).
  size_t run_length(int ni, size_t pos) {
    RunCache& rc = runs[size_t(ni)];
    if (rc.end == end && rc.start != SIZE_MAX && pos >= rc.start && pos <= rc.start + rc.length)
      return rc.start + rc.length - pos;
    const int cls = re.nodes_[size_t(ni)].cls;
    size_t c = 0;
    while (pos + c < end && re.classes_[size_t(cls)].contains(cps[pos + c], fl[pos + c])) ++c;
    rc = RunCache{pos, c, end};
    return c;
  }

  bool test(int cls, size_t i) const { return i < end && re.classes_[size_t(cls)].contains(cps[i], fl[i]); }

  bool resume(const Cont* k, size_t pos) {
    switch (k->type) {
      case Cont::Done: result = pos; return true;
      case Cont::Accept: return true;
      case Cont::Then: return run(k->node, pos, k->next);
      case Cont::Loop: {
        const Node& g = re.nodes_[size_t(k->node)];
        if (pos == k->start)  // an empty iteration: stop repeating
          return k->count >= g.min && run(g.next, pos, k->next);
        return iterate(k->node, k->count, pos, k->next);
      }
    }
    return false;
  }

  bool iterate(int gi, int count, size_t pos, const Cont* k) {
    const Node& g = re.nodes_[size_t(gi)];
    if (g.max < 0 || count < g.max) {
      for (int alt : g.alts) {
        const Cont c{Cont::Loop, gi, count + 1, pos, k};
        if (run(alt, pos, &c)) return true;
      }
    }
    return count >= g.min && run(g.next, pos, k);
  }

  bool run(int ni, size_t pos, const Cont* k) {
    if (ni < 0) return resume(k, pos);
    const Node& n = re.nodes_[size_t(ni)];
    switch (n.kind) {
      case Kind::Class: {
        size_t c = 0;
        if (n.max < 0) {
          c = run_length(ni, pos);
        } else {
          const size_t most = std::min(end - pos, size_t(n.max));
          while (c < most && test(n.cls, pos + c)) ++c;
        }
        if (c < size_t(n.min)) return false;
        if (n.next >= 0 && re.nodes_[size_t(n.next)].kind == Kind::End)  // X+$: only the whole run
          return pos + c == end && run(n.next, pos + c, k);
        for (size_t j = c;; --j) {  // greedy: longest first
          if (run(n.next, pos + j, k)) return true;
          if (j == size_t(n.min)) return false;
        }
      }
      case Kind::Group: {
        if (n.min == 1 && n.max == 1) {
          const Cont c{Cont::Then, n.next, 0, 0, k};
          for (int alt : n.alts)
            if (run(alt, pos, &c)) return true;
          return false;
        }
        return iterate(ni, 0, pos, k);
      }
      case Kind::Ahead:
      case Kind::NotAhead: {
        bool found = false;
        const Cont acc{Cont::Accept, -1, 0, 0, nullptr};
        for (int alt : n.alts) {
          if (run(alt, pos, &acc)) {
            found = true;
            break;
          }
        }
        if (found != (n.kind == Kind::Ahead)) return false;
        return run(n.next, pos, k);
      }
      case Kind::End:
        return pos == end && run(n.next, pos, k);
    }
    return false;
  }
};

size_t Regex::match_at(const CodepointText& t, size_t pos, size_t end) const {
  Matcher m(*this, t, end);
  const Cont done{Cont::Done, -1, 0, 0, nullptr};
  if (pos > end || !m.run(start_, pos, &done)) return SIZE_MAX;
  return m.result;
}

std::vector<uint32_t> Regex::split(const CodepointText& t, const std::vector<uint32_t>& ends) const {
  std::vector<uint32_t> out;
  out.reserve(ends.size() * 2);
  Matcher m(*this, t, 0);
  const Cont done{Cont::Done, -1, 0, 0, nullptr};
  size_t begin = 0;
  for (const uint32_t e : ends) {
    m.end = e;
    size_t last = begin;  // end of the previous match (or the fragment start)
    for (size_t pos = begin; pos < e; ++pos) {
      if (!m.run(start_, pos, &done) || m.result == pos) continue;  // no match, or an empty one
      if (pos > last) out.push_back(uint32_t(pos));
      out.push_back(uint32_t(m.result));
      last = m.result;
      pos = m.result - 1;
    }
    if (last < e) out.push_back(e);
    begin = e;
  }
  return out;
}

}  // namespace llmq::unicode
