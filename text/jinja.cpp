// The Jinja2 subset interpreter (jinja.h): values, the lexer and parser (jinja2's lexer.py and
// parser.py, rule for rule), and a tree-walking renderer with jinja2's runtime semantics.
#include "text/jinja.h"

#include <algorithm>
#include <initializer_list>
#include <charconv>
#include <cmath>
#include <cstring>
#include <functional>
#include <unordered_map>

#include "base/error.h"
#include "text/unicode.h"

namespace llmq::jinja {

namespace {

constexpr int kMaxValueDepth = 256;   // nesting of lists and dicts
constexpr int kMaxNesting = 256;      // parentheses, brackets, blocks in the source
constexpr int kMaxExprHeight = 512;   // height of an expression tree (a+b+c+... chains)
constexpr int kMaxEvalDepth = 1000;   // nested evaluations at render time (macro recursion)
constexpr int kMaxClosures = 100000;  // macros and call blocks defined in one render
constexpr int64_t kMaxRange = 100000; // jinja2.sandbox.MAX_RANGE

/// A render-time error; Template::render turns it into a UsageError naming the line.
struct Fail {
  std::string msg;
};
/// raise_exception(msg): a UsageError with exactly msg.
struct Raised {
  std::string msg;
};

[[noreturn]] void fail(std::string msg) { throw Fail{std::move(msg)}; }

struct SvHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

/// A dict: string keys in insertion order, with a hash index once it grows.
struct Object {
  std::vector<std::pair<std::string, Value>> entries;
  std::unordered_map<std::string, size_t, SvHash, std::equal_to<>> index;

  const Value* find(std::string_view key) const {
    if (!index.empty()) {
      auto it = index.find(key);
      return it == index.end() ? nullptr : &entries[it->second].second;
    }
    for (const auto& e : entries)
      if (e.first == key) return &e.second;
    return nullptr;
  }
  void set(std::string key, Value v) {
    if (Value* old = const_cast<Value*>(find(key))) {
      *old = std::move(v);
      return;
    }
    entries.emplace_back(std::move(key), std::move(v));
    if (!index.empty()) {
      index.emplace(entries.back().first, entries.size() - 1);
    } else if (entries.size() > 8) {
      for (size_t i = 0; i < entries.size(); i++) index.emplace(entries[i].first, i);
    }
  }
};

}  // namespace

struct Value::Heap {
  virtual ~Heap() = default;
};

namespace {

struct StrHeap final : Value::Heap {
  std::string s;
};
struct ArrHeap final : Value::Heap {
  std::vector<Value> items;
  bool tuple = false;
  int depth = 1;
};
struct ObjHeap final : Value::Heap {
  Object obj;
  int depth = 1;
};
struct NsHeap final : Value::Heap {
  Object attrs;
};
struct Ctx;
struct Args;
/// A callable: a builtin function, a bound method, a macro, a call block's caller, loop.cycle.
struct FnHeap : Value::Heap {
  std::string name;
  virtual Value call(Ctx& ctx, Args& args) const = 0;
};
/// The `loop` variable of one iteration.
struct LoopHeap final : Value::Heap {
  std::shared_ptr<const std::vector<Value>> items;
  int64_t index0 = 0;
  Value cycle_fn;
};

}  // namespace

/// Reads and builds the private parts of Value.
struct Access {
  static const Value::Heap* heap(const Value& v) { return v.heap_.get(); }
  static int64_t i(const Value& v) { return v.u_.i; }
  static double f(const Value& v) { return v.u_.f; }
  static bool b(const Value& v) { return v.u_.b; }
  static Value make(Value::Kind k, std::shared_ptr<Value::Heap> h) {
    Value v;
    v.kind_ = k;
    v.heap_ = std::move(h);
    return v;
  }
  static std::shared_ptr<Value::Heap> shared(const Value& v) { return v.heap_; }
  static std::shared_ptr<Value::Heap>& mut_heap(Value& v) { return v.heap_; }
};

namespace {

using Kind = Value::Kind;

const std::string& S(const Value& v) { return static_cast<const StrHeap*>(Access::heap(v))->s; }
const ArrHeap& A(const Value& v) { return *static_cast<const ArrHeap*>(Access::heap(v)); }
const std::vector<Value>& items(const Value& v) { return A(v).items; }
const Object& O(const Value& v) { return static_cast<const ObjHeap*>(Access::heap(v))->obj; }
NsHeap& NS(const Value& v) { return *const_cast<NsHeap*>(static_cast<const NsHeap*>(Access::heap(v))); }
const FnHeap& FN(const Value& v) { return *static_cast<const FnHeap*>(Access::heap(v)); }
const LoopHeap& LOOP(const Value& v) { return *static_cast<const LoopHeap*>(Access::heap(v)); }
int64_t I(const Value& v) { return v.kind() == Kind::Bool ? int64_t(Access::b(v)) : Access::i(v); }
double F(const Value& v) { return v.kind() == Kind::Float ? Access::f(v) : double(I(v)); }

int depth_of(const Value& v) {
  if (v.kind() == Kind::Array) return A(v).depth;
  if (v.kind() == Kind::Object) return static_cast<const ObjHeap*>(Access::heap(v))->depth;
  return v.kind() >= Kind::Namespace ? 1 : 0;
}

Value make_str(std::string s) {
  auto h = std::make_shared<StrHeap>();
  h->s = std::move(s);
  return Access::make(Kind::String, std::move(h));
}

Value make_array(std::vector<Value> v, bool tuple = false) {
  auto h = std::make_shared<ArrHeap>();
  int d = 0;
  for (const auto& x : v) d = std::max(d, depth_of(x));
  if (d + 1 > kMaxValueDepth) fail("lists and dicts nest deeper than 256 levels");
  h->depth = d + 1;
  h->items = std::move(v);
  h->tuple = tuple;
  return Access::make(Kind::Array, std::move(h));
}

Value make_object(Object o) {
  auto h = std::make_shared<ObjHeap>();
  int d = 0;
  for (const auto& e : o.entries) d = std::max(d, depth_of(e.second));
  if (d + 1 > kMaxValueDepth) fail("lists and dicts nest deeper than 256 levels");
  h->depth = d + 1;
  h->obj = std::move(o);
  return Access::make(Kind::Object, std::move(h));
}

Value tuple2(Value a, Value b) {
  std::vector<Value> v;
  v.push_back(std::move(a));
  v.push_back(std::move(b));
  return make_array(std::move(v), true);
}

/// Runs a public entry point, turning internal failures into UsageError.
template <class F>
auto guarded(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const Fail& e) {
    throw UsageError("jinja: " + e.msg);
  }
}

template <class Json>
Value from_json_at(const Json& j, int depth) {
  if (depth > kMaxValueDepth) fail("JSON value nests deeper than 256 levels");
  switch (j.type()) {
    case Json::value_t::null: return Value(nullptr);
    case Json::value_t::boolean: return Value(j.template get<bool>());
    case Json::value_t::number_integer: return Value(j.template get<int64_t>());
    case Json::value_t::number_unsigned: {
      const uint64_t u = j.template get<uint64_t>();
      return u > uint64_t(INT64_MAX) ? Value(double(u)) : Value(int64_t(u));
    }
    case Json::value_t::number_float: return Value(j.template get<double>());
    case Json::value_t::string: return make_str(j.template get<std::string>());
    case Json::value_t::array: {
      std::vector<Value> v;
      v.reserve(j.size());
      for (const auto& x : j) v.push_back(from_json_at(x, depth + 1));
      return make_array(std::move(v));
    }
    case Json::value_t::object: {
      Object o;
      for (auto it = j.begin(); it != j.end(); ++it) o.set(it.key(), from_json_at(it.value(), depth + 1));
      return make_object(std::move(o));
    }
    default: fail("unsupported JSON value (binary)");
  }
}

}  // namespace

Value::Value(std::string s) : Value(make_str(std::move(s))) {}

Value Value::array(std::vector<Value> items) { return guarded([&] { return make_array(std::move(items)); }); }

Value Value::object() { return make_object({}); }

Value Value::from_json(const nlohmann::json& j) { return guarded([&] { return from_json_at(j, 1); }); }

Value Value::from_json(const nlohmann::ordered_json& j) { return guarded([&] { return from_json_at(j, 1); }); }

void Value::set(std::string key, Value v) {
  if (kind_ != Kind::Object) throw UsageError("jinja: Value::set on a value that is not a dict");
  guarded([&] {
    if (depth_of(v) + 1 > kMaxValueDepth) fail("lists and dicts nest deeper than 256 levels");
    if (heap_.use_count() > 1) heap_ = std::make_shared<ObjHeap>(*static_cast<const ObjHeap*>(heap_.get()));
    auto* h = static_cast<ObjHeap*>(heap_.get());
    h->depth = std::max(h->depth, depth_of(v) + 1);
    h->obj.set(std::move(key), std::move(v));
  });
}

void Value::push_back(Value v) {
  if (kind_ != Kind::Array) throw UsageError("jinja: Value::push_back on a value that is not a list");
  guarded([&] {
    if (depth_of(v) + 1 > kMaxValueDepth) fail("lists and dicts nest deeper than 256 levels");
    if (heap_.use_count() > 1) heap_ = std::make_shared<ArrHeap>(*static_cast<const ArrHeap*>(heap_.get()));
    auto* h = static_cast<ArrHeap*>(heap_.get());
    h->depth = std::max(h->depth, depth_of(v) + 1);
    h->items.push_back(std::move(v));
  });
}

// ---------------------------------------------------------------------------------------------
// Text: code points, Python's whitespace and case mappings.

namespace {

/// Python's str.isspace(): the White_Space property plus U+001C..U+001F.
bool py_space(char32_t c) { return (c >= 0x1c && c <= 0x1f) || unicode::is_whitespace(c); }

char32_t decode_at(std::string_view s, size_t pos, size_t* len) {
  char32_t cp;
  *len = unicode::decode_utf8(s, pos, &cp);
  return cp;
}

void append_cp(std::string& out, char32_t cp) {
  if (cp >= unicode::kInvalidByte) {
    out.push_back(char(cp - unicode::kInvalidByte));
  } else {
    unicode::append_utf8(out, cp);
  }
}

std::vector<char32_t> to_cps(std::string_view s) {
  std::vector<char32_t> v;
  v.reserve(s.size());
  for (size_t p = 0, n; p < s.size(); p += n) v.push_back(decode_at(s, p, &n));
  return v;
}

std::string from_cps(const char32_t* b, const char32_t* e) {
  std::string out;
  for (; b != e; ++b) append_cp(out, *b);
  return out;
}

bool is_ascii(std::string_view s) {
  for (unsigned char c : s)
    if (c >= 0x80) return false;
  return true;
}

/// Byte offsets of a string's code points (offsets[i], and offsets[n] == size).
struct CpIndex {
  std::string_view s;
  bool ascii;
  std::vector<size_t> off;
  explicit CpIndex(std::string_view text) : s(text), ascii(is_ascii(text)) {
    if (ascii) return;
    for (size_t p = 0, n; p < s.size(); p += n) {
      off.push_back(p);
      decode_at(s, p, &n);
    }
    off.push_back(s.size());
  }
  size_t size() const { return ascii ? s.size() : off.size() - 1; }
  size_t at(size_t i) const { return ascii ? i : off[i]; }
  std::string_view sub(size_t i, size_t j) const { return s.substr(at(i), at(j) - at(i)); }
};

size_t cp_count(std::string_view s) { return CpIndex(s).size(); }

/// Python's simple upper-case mapping: the inverse of unicode::to_lower (the first code point
/// that lower-cases to c, titlecase letters excepted), plus the lower-case letters whose upper
/// case does not lower back to them (many-to-one mappings of UnicodeData.txt).
char32_t to_upper(char32_t c) {
  static const std::unordered_map<char32_t, char32_t> table = [] {
    std::unordered_map<char32_t, char32_t> t;
    for (char32_t u = 0; u < 0x20000; u++) {
      if (unicode::category(u) == unicode::Category::Lt) continue;
      const char32_t l = unicode::to_lower(u);
      if (l != u) t.emplace(l, u);
    }
    static const std::pair<char32_t, char32_t> extra[] = {
        {0xB5, 0x39C},   {0x131, 0x49},   {0x17F, 0x53},   {0x1C5, 0x1C4},  {0x1C8, 0x1C7},  {0x1CB, 0x1CA},
        {0x1F2, 0x1F1},  {0x345, 0x399},  {0x3C2, 0x3A3},  {0x3D0, 0x392},  {0x3D1, 0x398},  {0x3D5, 0x3A6},
        {0x3D6, 0x3A0},  {0x3F0, 0x39A},  {0x3F1, 0x3A1},  {0x3F5, 0x395},  {0x1C80, 0x412}, {0x1C81, 0x414},
        {0x1C82, 0x41E}, {0x1C83, 0x421}, {0x1C84, 0x422}, {0x1C85, 0x422}, {0x1C86, 0x42A}, {0x1C87, 0x462},
        {0x1C88, 0xA64A}, {0x1E9B, 0x1E60}, {0x1FBE, 0x399}};
    for (auto [l, u] : extra) t[l] = u;
    return t;
  }();
  if (c < 0x80) return (c >= 'a' && c <= 'z') ? c - 32 : c;
  auto it = table.find(c);
  return it == table.end() ? c : it->second;
}

char32_t to_lower(char32_t c) {
  if (c < 0x80) return (c >= 'A' && c <= 'Z') ? c + 32 : c;
  return c >= unicode::kInvalidByte ? c : unicode::to_lower(c);
}

uint32_t cp_flags(char32_t c) { return c >= unicode::kInvalidByte ? 0u : unicode::flags(c); }

/// Python's "cased" (Lu, Ll, Lt, or a letter-like symbol with a case mapping).
bool is_cased(char32_t c) {
  using unicode::Category;
  const uint32_t cased = unicode::flag(Category::Lu) | unicode::flag(Category::Ll) | unicode::flag(Category::Lt);
  return (cp_flags(c) & cased) || to_upper(c) != c || to_lower(c) != c;
}

/// Python's case-ignorable characters (approximately: marks, format characters, modifiers and
/// the apostrophe, period, colon and middle dot).
bool is_case_ignorable(char32_t c) {
  using unicode::Category;
  const uint32_t m = unicode::flag(Category::Mn) | unicode::flag(Category::Me) | unicode::flag(Category::Cf) |
                     unicode::flag(Category::Lm) | unicode::flag(Category::Sk);
  return (cp_flags(c) & m) || c == '\'' || c == '.' || c == ':' || c == 0xB7 || c == 0x2019;
}

/// The multi-character upper and title cases of SpecialCasing.txt for Latin letters.
const char* special_upper(char32_t c, bool title) {
  switch (c) {
    case 0xDF: return title ? "Ss" : "SS";
    case 0x149: return "\xCA\xBCN";
    case 0x1F0: return "J\xCC\x8C";
    case 0xFB00: return title ? "Ff" : "FF";
    case 0xFB01: return title ? "Fi" : "FI";
    case 0xFB02: return title ? "Fl" : "FL";
    case 0xFB03: return title ? "Ffi" : "FFI";
    case 0xFB04: return title ? "Ffl" : "FFL";
    case 0xFB05:
    case 0xFB06: return title ? "St" : "ST";
    default: return nullptr;
  }
}

void append_upper(std::string& out, char32_t c) {
  if (const char* s = special_upper(c, false)) {
    out += s;
  } else {
    append_cp(out, to_upper(c));
  }
}

/// Title case of one character (str.title, str.capitalize): the upper case except for the
/// digraphs DŽ, LJ, NJ, DZ (to their title forms), ß, the ligatures and Georgian Mkhedruli.
void append_title(std::string& out, char32_t c) {
  if (const char* s = special_upper(c, true)) return void(out += s);
  if (c >= 0x1C4 && c <= 0x1CC) return append_cp(out, 0x1C5 + (c - 0x1C4) / 3 * 3);
  if (c >= 0x1F1 && c <= 0x1F3) return append_cp(out, 0x1F2);
  if ((c >= 0x10D0 && c <= 0x10FA) || (c >= 0x10FD && c <= 0x10FF)) return append_cp(out, c);
  append_cp(out, to_upper(c));
}

/// Lower case of cps[i] in context: İ -> i + U+0307, and Python's final sigma (Σ -> ς after a
/// cased letter and not before one, case-ignorable characters skipped).
void append_lower(std::string& out, const std::vector<char32_t>& cps, size_t i) {
  const char32_t c = cps[i];
  if (c == 0x130) return void(out += "i\xCC\x87");
  if (c == 0x3A3) {
    size_t j = i;
    while (j > 0 && is_case_ignorable(cps[j - 1])) j--;
    const bool after_cased = j > 0 && is_cased(cps[j - 1]);
    size_t k = i + 1;
    while (k < cps.size() && is_case_ignorable(cps[k])) k++;
    const bool before_cased = k < cps.size() && is_cased(cps[k]);
    if (after_cased && !before_cased) return append_cp(out, 0x3C2);
  }
  append_cp(out, to_lower(c));
}

std::string str_upper(std::string_view s) {
  std::string out;
  for (char32_t c : to_cps(s)) append_upper(out, c);
  return out;
}

std::string str_lower(std::string_view s) {
  const auto cps = to_cps(s);
  std::string out;
  for (size_t i = 0; i < cps.size(); i++) append_lower(out, cps, i);
  return out;
}

/// str.capitalize(): the first character title-cased, the rest lower-cased.
std::string str_capitalize(std::string_view s) {
  const auto cps = to_cps(s);
  std::string out;
  for (size_t i = 0; i < cps.size(); i++) i == 0 ? append_title(out, cps[i]) : append_lower(out, cps, i);
  return out;
}

/// str.title(): a cased character after an uncased one is title-cased, other ones lowered.
std::string str_title(std::string_view s) {
  const auto cps = to_cps(s);
  std::string out;
  bool prev_cased = false;
  for (size_t i = 0; i < cps.size(); i++) {
    prev_cased ? append_lower(out, cps, i) : append_title(out, cps[i]);
    prev_cased = is_cased(cps[i]);
  }
  return out;
}

/// str.strip/lstrip/rstrip: `chars` null for whitespace, else the characters to remove.
std::string str_strip(std::string_view s, const std::string* chars, bool left, bool right) {
  const auto cps = to_cps(s);
  const auto set = chars ? to_cps(*chars) : std::vector<char32_t>{};
  auto strip = [&](char32_t c) { return chars ? std::find(set.begin(), set.end(), c) != set.end() : py_space(c); };
  size_t b = 0, e = cps.size();
  if (left)
    while (b < e && strip(cps[b])) b++;
  if (right)
    while (e > b && strip(cps[e - 1])) e--;
  return from_cps(cps.data() + b, cps.data() + e);
}

// ---------------------------------------------------------------------------------------------
// Numbers as Python prints them.

std::string fmt_float(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);
  std::string sci(buf, r.ptr);  // [-]d[.ddd]e[+-]XX
  std::string sign;
  if (sci[0] == '-') sign = "-", sci.erase(0, 1);
  const size_t e = sci.find('e');
  std::string digits = sci.substr(0, e);
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  const int exp = std::stoi(sci.substr(e + 1));
  const int decpt = exp + 1;  // digits d1 d2 ... with the point after `decpt` of them
  const int nd = int(digits.size());
  if (decpt > -4 && decpt <= 16) {  // CPython float_repr_style 'short', mode 'r'
    if (decpt <= 0) return sign + "0." + std::string(size_t(-decpt), '0') + digits;
    if (decpt >= nd) return sign + digits + std::string(size_t(decpt - nd), '0') + ".0";
    return sign + digits.substr(0, size_t(decpt)) + "." + digits.substr(size_t(decpt));
  }
  std::string m = digits.substr(0, 1);
  if (nd > 1) m += "." + digits.substr(1);
  const int x = decpt - 1;
  std::string xs = std::to_string(std::abs(x));
  if (xs.size() < 2) xs = "0" + xs;
  return sign + m + (x < 0 ? "e-" : "e+") + xs;
}

// ---------------------------------------------------------------------------------------------
// str(), repr() and json.dumps, with a cap on the bytes written and on the nesting.

struct Writer {
  std::string out;
  size_t cap;
  void put(std::string_view s) {
    if (out.size() + s.size() > cap) fail("string too long (over the render's size limits)");
    out += s;
  }
};

const char* type_name(const Value& v) {
  switch (v.kind()) {
    case Kind::Undefined: return "Undefined";
    case Kind::None: return "NoneType";
    case Kind::Bool: return "bool";
    case Kind::Int: return "int";
    case Kind::Float: return "float";
    case Kind::String: return "str";
    case Kind::Array: return A(v).tuple ? "tuple" : "list";
    case Kind::Object: return "dict";
    case Kind::Namespace: return "Namespace";
    case Kind::Function: return "function";
    case Kind::Loop: return "LoopContext";
  }
  return "?";
}

/// Python's repr() of a str: single quotes unless it holds ' and no ", escapes for the
/// non-printable characters (str.isprintable).
void repr_string(Writer& w, std::string_view s) {
  const bool dq = s.find('\'') != std::string_view::npos && s.find('"') == std::string_view::npos;
  const char q = dq ? '"' : '\'';
  std::string out(1, q);
  for (size_t p = 0, n; p < s.size(); p += n) {
    const char32_t c = decode_at(s, p, &n);
    if (c == char32_t(q) || c == '\\') {
      out += '\\', out += char(c);
    } else if (c == '\n' || c == '\r' || c == '\t') {
      out += c == '\n' ? "\\n" : c == '\r' ? "\\r" : "\\t";
    } else if (c >= unicode::kInvalidByte) {
      out += s.substr(p, n);
    } else if (c < 0x20 || c == 0x7f || (c >= 0x80 && ((unicode::flags(c) & (unicode::kOther | unicode::kSeparator)) && c != ' '))) {
      char buf[16];
      if (c < 0x100) {
        snprintf(buf, sizeof buf, "\\x%02x", unsigned(c));
      } else if (c < 0x10000) {
        snprintf(buf, sizeof buf, "\\u%04x", unsigned(c));
      } else {
        snprintf(buf, sizeof buf, "\\U%08x", unsigned(c));
      }
      out += buf;
    } else {
      out += s.substr(p, n);
    }
  }
  out += q;
  w.put(out);
}

void write_value(Writer& w, const Value& v, bool repr, int depth);

void write_items(Writer& w, const Value& v, int depth) {
  const auto& a = A(v);
  w.put(a.tuple ? "(" : "[");
  for (size_t i = 0; i < a.items.size(); i++) {
    if (i) w.put(", ");
    write_value(w, a.items[i], true, depth + 1);
  }
  w.put(a.tuple ? (a.items.size() == 1 ? ",)" : ")") : "]");
}

void write_dict(Writer& w, const Object& o, int depth) {
  w.put("{");
  for (size_t i = 0; i < o.entries.size(); i++) {
    if (i) w.put(", ");
    repr_string(w, o.entries[i].first);
    w.put(": ");
    write_value(w, o.entries[i].second, true, depth + 1);
  }
  w.put("}");
}

void write_value(Writer& w, const Value& v, bool repr, int depth) {
  if (depth > kMaxValueDepth + 8) fail("value nests too deeply to print");
  switch (v.kind()) {
    case Kind::Undefined: return w.put(repr ? "Undefined" : "");
    case Kind::None: return w.put("None");
    case Kind::Bool: return w.put(Access::b(v) ? "True" : "False");
    case Kind::Int: return w.put(std::to_string(Access::i(v)));
    case Kind::Float: return w.put(fmt_float(Access::f(v)));
    case Kind::String: return repr ? repr_string(w, S(v)) : w.put(S(v));
    case Kind::Array: return write_items(w, v, depth);
    case Kind::Object: return write_dict(w, O(v), depth);
    case Kind::Namespace:
      w.put("<Namespace ");
      write_dict(w, NS(v).attrs, depth);
      return w.put(">");
    case Kind::Function: return w.put("<function " + FN(v).name + ">");
    case Kind::Loop: {
      const auto& l = LOOP(v);
      return w.put("<LoopContext " + std::to_string(l.index0 + 1) + "/" + std::to_string(l.items->size()) + ">");
    }
  }
}

std::string to_str(const Value& v, size_t cap) {
  if (v.kind() == Kind::String) return S(v);
  Writer w{{}, cap};
  write_value(w, v, false, 0);
  return std::move(w.out);
}

std::string repr(const Value& v, size_t cap = SIZE_MAX) {
  Writer w{{}, cap};
  write_value(w, v, true, 0);
  return std::move(w.out);
}

/// json.dumps options (transformers' tojson: ensure_ascii=False, sort_keys=False).
struct JsonStyle {
  bool ensure_ascii = false;
  bool sort_keys = false;
  std::optional<std::string> indent;  // none: one line
  std::string item_sep = ", ", key_sep = ": ";
};

void json_string(Writer& w, std::string_view s, bool ascii) {
  std::string out = "\"";
  char buf[16];
  for (size_t p = 0, n; p < s.size(); p += n) {
    const char32_t c = decode_at(s, p, &n);
    switch (c) {
      case '"': out += "\\\""; continue;
      case '\\': out += "\\\\"; continue;
      case '\n': out += "\\n"; continue;
      case '\r': out += "\\r"; continue;
      case '\t': out += "\\t"; continue;
      case '\b': out += "\\b"; continue;
      case '\f': out += "\\f"; continue;
      default: break;
    }
    if (c < 0x20 || (ascii && c >= 0x7f && c < unicode::kInvalidByte)) {
      if (c >= 0x10000) {
        const unsigned v = unsigned(c) - 0x10000;
        snprintf(buf, sizeof buf, "\\u%04x\\u%04x", 0xD800 + (v >> 10), 0xDC00 + (v & 0x3FF));
      } else {
        snprintf(buf, sizeof buf, "\\u%04x", unsigned(c));
      }
      out += buf;
    } else {
      out += s.substr(p, n);
    }
  }
  out += '"';
  w.put(out);
}

void json_value(Writer& w, const Value& v, const JsonStyle& st, int level);

void json_newline(Writer& w, const JsonStyle& st, int level) {
  if (!st.indent) return;
  std::string s = "\n";
  for (int i = 0; i < level; i++) s += *st.indent;
  w.put(s);
}

void json_array(Writer& w, const std::vector<Value>& a, const JsonStyle& st, int level) {
  if (a.empty()) return w.put("[]");
  w.put("[");
  for (size_t i = 0; i < a.size(); i++) {
    if (i) w.put(st.item_sep);
    json_newline(w, st, level + 1);
    json_value(w, a[i], st, level + 1);
  }
  json_newline(w, st, level);
  w.put("]");
}

void json_object(Writer& w, const Object& o, const JsonStyle& st, int level) {
  if (o.entries.empty()) return w.put("{}");
  std::vector<const std::pair<std::string, Value>*> es;
  for (const auto& e : o.entries) es.push_back(&e);
  if (st.sort_keys) std::stable_sort(es.begin(), es.end(), [](auto* a, auto* b) { return a->first < b->first; });
  w.put("{");
  for (size_t i = 0; i < es.size(); i++) {
    if (i) w.put(st.item_sep);
    json_newline(w, st, level + 1);
    json_string(w, es[i]->first, st.ensure_ascii);
    w.put(st.key_sep);
    json_value(w, es[i]->second, st, level + 1);
  }
  json_newline(w, st, level);
  w.put("}");
}

void json_value(Writer& w, const Value& v, const JsonStyle& st, int level) {
  if (level > kMaxValueDepth + 8) fail("value nests too deeply for tojson");
  switch (v.kind()) {
    case Kind::None: return w.put("null");
    case Kind::Bool: return w.put(Access::b(v) ? "true" : "false");
    case Kind::Int: return w.put(std::to_string(Access::i(v)));
    case Kind::Float: {
      const double d = Access::f(v);
      if (std::isnan(d)) return w.put("NaN");
      if (std::isinf(d)) return w.put(d < 0 ? "-Infinity" : "Infinity");
      return w.put(fmt_float(d));
    }
    case Kind::String: return json_string(w, S(v), st.ensure_ascii);
    case Kind::Array: return json_array(w, items(v), st, level);
    case Kind::Object: return json_object(w, O(v), st, level);
    default: fail(std::string("Object of type ") + type_name(v) + " is not JSON serializable");
  }
}

}  // namespace

std::string Value::str() const {
  return guarded([&] { return to_str(*this, SIZE_MAX); });
}

// ---------------------------------------------------------------------------------------------
// Lexer: jinja2's lexer.py with trim_blocks and lstrip_blocks on.

namespace {

[[noreturn]] void syntax_error(int line, const std::string& msg) { fail("line " + std::to_string(line) + ": " + msg); }

enum class Tok : uint8_t { Data, VarBegin, VarEnd, BlockBegin, BlockEnd, Name, String, Int, Float, Op, Eof };

struct Token {
  Tok type;
  std::string text;  // data, name, string value (unescaped), operator
  int line = 1;
  int64_t i = 0;
  double f = 0;
};

bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_name_start(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool is_name_char(char c) { return is_name_start(c) || is_digit(c); }

/// Newlines as jinja2 sees them: \r\n and \r become \n, and one trailing newline is dropped
/// (keep_trailing_newline=False).
std::string normalize_newlines(std::string_view src) {
  std::string s;
  s.reserve(src.size());
  for (size_t i = 0; i < src.size(); i++) {
    if (src[i] == '\r') {
      s += '\n';
      if (i + 1 < src.size() && src[i + 1] == '\n') i++;
    } else {
      s += src[i];
    }
  }
  if (!s.empty() && s.back() == '\n') s.pop_back();
  return s;
}

/// Python's str.rstrip() (Unicode whitespace).
std::string_view rstrip_py(std::string_view s) {
  size_t e = s.size();
  while (e > 0) {
    size_t b = e - 1;
    while (b > 0 && (static_cast<unsigned char>(s[b]) & 0xC0) == 0x80 && e - b < 4) b--;
    size_t n;
    const char32_t c = decode_at(s, b, &n);
    if (b + n != e || !py_space(c)) break;
    e = b;
  }
  return s.substr(0, e);
}

bool all_space(std::string_view s) {
  for (size_t p = 0, n; p < s.size(); p += n)
    if (!py_space(decode_at(s, p, &n))) return false;
  return true;
}

class Lexer {
 public:
  explicit Lexer(std::string_view source) : src_(normalize_newlines(source)) {}
  std::vector<Token> run();

 private:
  std::string src_;
  size_t pos_ = 0;
  int line_ = 1;
  bool line_starting_ = true;
  std::vector<Token> toks_;
  std::vector<char> balance_;

  bool at(size_t p, std::string_view s) const { return src_.compare(p, s.size(), s) == 0; }
  size_t skip_ws(size_t p) const {
    for (size_t n; p < src_.size(); p += n)
      if (!py_space(decode_at(src_, p, &n))) break;
    return p;
  }
  void advance(size_t to) {
    line_ += int(std::count(src_.begin() + std::ptrdiff_t(pos_), src_.begin() + std::ptrdiff_t(to), '\n'));
    pos_ = to;
  }
  void emit(Tok t, std::string text = {}) { toks_.push_back(Token{t, std::move(text), line_}); }
  void data(std::string_view text, char sign, bool lstrip);
  size_t raw_begin_end(size_t p) const;
  void raw();
  void comment();
  void tag(char kind);
  bool tag_end(char kind);
  bool number();
  void string_literal();
  void op();
};

/// Template text before a tag: `{%-` strips all whitespace before it; otherwise (lstrip_blocks,
/// block and comment tags, not `{%+`) spaces and tabs from the start of its line to the tag.
void Lexer::data(std::string_view text, char sign, bool lstrip) {
  if (sign == '-') {
    text = rstrip_py(text);
  } else if (sign != '+' && lstrip) {
    const size_t nl = text.rfind('\n');
    const size_t l_pos = nl == std::string_view::npos ? 0 : nl + 1;
    if ((l_pos > 0 || line_starting_) && l_pos < text.size() && all_space(text.substr(l_pos))) text = text.substr(0, l_pos);
  }
  if (!text.empty()) emit(Tok::Data, std::string(text));
}

/// End of `{% raw %}` (or `{%- raw -%}`) starting at p, or 0 if p starts no raw tag.
size_t Lexer::raw_begin_end(size_t p) const {
  p += 2;
  if (p < src_.size() && (src_[p] == '-' || src_[p] == '+')) p++;
  p = skip_ws(p);
  if (!at(p, "raw")) return 0;
  p = skip_ws(p + 3);
  if (at(p, "-%}")) return skip_ws(p + 3);
  return at(p, "%}") ? p + 2 : 0;
}

void Lexer::raw() {
  for (size_t k = pos_; k + 1 < src_.size(); k++) {
    if (!at(k, "{%")) continue;
    size_t p = k + 2;
    const char sign = p < src_.size() && (src_[p] == '-' || src_[p] == '+') ? src_[p++] : 0;
    p = skip_ws(p);
    if (!at(p, "endraw")) continue;
    p = skip_ws(p + 6);
    size_t end;
    if (at(p, "+%}")) {
      end = p + 3;
    } else if (at(p, "-%}")) {
      end = skip_ws(p + 3);
    } else if (at(p, "%}")) {
      end = p + 2 + (at(p + 2, "\n") ? 1 : 0);
    } else {
      continue;
    }
    const int line = line_;
    data(std::string_view(src_).substr(pos_, k - pos_), sign, true);
    line_ = line;
    advance(end);
    line_starting_ = src_[end - 1] == '\n';
    return;
  }
  syntax_error(line_, "Missing end of raw directive");
}

void Lexer::comment() {
  for (size_t k = pos_; k < src_.size(); k++) {
    size_t end = 0;
    if (at(k, "+#}")) {
      end = k + 3;
    } else if (at(k, "-#}")) {
      end = skip_ws(k + 3);
    } else if (at(k, "#}")) {
      end = k + 2 + (at(k + 2, "\n") ? 1 : 0);
    } else {
      continue;
    }
    advance(end);
    line_starting_ = src_[end - 1] == '\n';
    return;
  }
  syntax_error(line_, "Missing end of comment tag");
}

std::vector<Token> Lexer::run() {
  while (pos_ < src_.size()) {
    size_t i = pos_;
    while (i + 1 < src_.size() && !(src_[i] == '{' && (src_[i + 1] == '{' || src_[i + 1] == '%' || src_[i + 1] == '#'))) i++;
    if (i + 1 >= src_.size()) {
      emit(Tok::Data, src_.substr(pos_));
      advance(src_.size());
      break;
    }
    const char kind = src_[i + 1];
    size_t after = i + 2;
    const char sign = after < src_.size() && (src_[after] == '-' || src_[after] == '+') ? src_[after++] : 0;
    const size_t raw_end = kind == '%' ? raw_begin_end(i) : 0;
    const int line = line_;
    data(std::string_view(src_).substr(pos_, i - pos_), sign, kind != '{');
    line_ = line;
    if (raw_end) {
      advance(raw_end);
      line_starting_ = src_[raw_end - 1] == '\n';
      raw();
      continue;
    }
    advance(after);
    line_starting_ = false;
    if (kind == '#') {
      comment();
    } else {
      tag(kind);
    }
  }
  emit(Tok::Eof);
  return std::move(toks_);
}

bool Lexer::tag_end(char kind) {
  const char* close = kind == '%' ? "%}" : "}}";
  size_t end;
  if (kind == '%' && at(pos_, "+%}")) {
    end = pos_ + 3;
  } else if (pos_ < src_.size() && src_[pos_] == '-' && at(pos_ + 1, close)) {
    end = skip_ws(pos_ + 3);
  } else if (at(pos_, close)) {
    end = pos_ + 2 + (kind == '%' && at(pos_ + 2, "\n") ? 1 : 0);
  } else {
    return false;
  }
  emit(kind == '%' ? Tok::BlockEnd : Tok::VarEnd);
  advance(end);
  line_starting_ = src_[end - 1] == '\n';
  return true;
}

void Lexer::tag(char kind) {
  emit(kind == '%' ? Tok::BlockBegin : Tok::VarBegin);
  while (pos_ < src_.size()) {
    if (balance_.empty() && tag_end(kind)) return;
    const size_t ws = skip_ws(pos_);
    if (ws != pos_) {
      advance(ws);
      continue;
    }
    const char c = src_[pos_];
    if (number()) continue;
    if (is_name_start(c)) {
      size_t e = pos_;
      while (e < src_.size() && is_name_char(src_[e])) e++;
      emit(Tok::Name, src_.substr(pos_, e - pos_));
      pos_ = e;
    } else if (c == '\'' || c == '"') {
      string_literal();
    } else {
      op();
    }
  }
}

/// `(\d+_)*\d+` at p: the end of the match, or npos.
size_t digits_us(const std::string& s, size_t p) {
  if (p >= s.size() || !is_digit(s[p])) return std::string::npos;
  while (p < s.size() && is_digit(s[p])) p++;
  while (p + 1 < s.size() && s[p] == '_' && is_digit(s[p + 1])) {
    p++;
    while (p < s.size() && is_digit(s[p])) p++;
  }
  return p;
}

size_t float_end(const std::string& s, size_t p) {
  const size_t a = digits_us(s, p);
  if (a == std::string::npos) return a;
  auto exponent = [&](size_t q) -> size_t {
    if (q >= s.size() || (s[q] != 'e' && s[q] != 'E')) return std::string::npos;
    q++;
    if (q < s.size() && (s[q] == '+' || s[q] == '-')) q++;
    return digits_us(s, q);
  };
  const size_t frac = a < s.size() && s[a] == '.' ? digits_us(s, a + 1) : std::string::npos;
  if (frac != std::string::npos) {
    if (size_t e = exponent(frac); e != std::string::npos) return e;
  }
  if (size_t e = exponent(a); e != std::string::npos) return e;
  return frac;
}

/// The integer_re alternatives: 0b.., 0o.., 0x.., [1-9](_?\d)*, 0(_?0)*. Returns the end and base.
size_t int_end(const std::string& s, size_t p, int* base) {
  auto run = [&](size_t q, auto ok) -> size_t {  // (_?[ok])+
    size_t e = std::string::npos;
    while (true) {
      size_t r = q < s.size() && s[q] == '_' ? q + 1 : q;
      if (r >= s.size() || !ok(s[r])) return e;
      e = q = r + 1;
    }
  };
  if (s[p] == '0' && p + 1 < s.size()) {
    const char x = char(s[p + 1] | 0x20);
    size_t e = std::string::npos;
    if (x == 'b') e = run(p + 2, [](char c) { return c == '0' || c == '1'; }), *base = 2;
    if (x == 'o') e = run(p + 2, [](char c) { return c >= '0' && c <= '7'; }), *base = 8;
    if (x == 'x') e = run(p + 2, [](char c) { return is_digit(c) || ((c | 0x20) >= 'a' && (c | 0x20) <= 'f'); }), *base = 16;
    if (e != std::string::npos) return e;
  }
  *base = 10;
  if (s[p] >= '1' && s[p] <= '9') {
    const size_t e = run(p + 1, is_digit);
    return e == std::string::npos ? p + 1 : e;
  }
  const size_t e = run(p + 1, [](char c) { return c == '0'; });
  return e == std::string::npos ? p + 1 : e;
}

bool Lexer::number() {
  if (!is_digit(src_[pos_])) return false;
  std::string digits;
  if (pos_ == 0 || src_[pos_ - 1] != '.') {
    const size_t e = float_end(src_, pos_);
    if (e != std::string::npos) {
      for (size_t k = pos_; k < e; k++)
        if (src_[k] != '_') digits += src_[k];
      emit(Tok::Float);
      toks_.back().f = std::strtod(digits.c_str(), nullptr);
      pos_ = e;
      return true;
    }
  }
  int base;
  const size_t e = int_end(src_, pos_, &base);
  for (size_t k = pos_ + (base == 10 ? 0 : 2); k < e; k++)
    if (src_[k] != '_') digits += src_[k];
  int64_t v = 0;
  auto r = std::from_chars(digits.data(), digits.data() + digits.size(), v, base);
  if (r.ec != std::errc()) syntax_error(line_, "integer literal out of range (int64): " + src_.substr(pos_, e - pos_));
  emit(Tok::Int);
  toks_.back().i = v;
  pos_ = e;
  return true;
}

int hex_val(char c) {
  if (is_digit(c)) return c - '0';
  c = char(c | 0x20);
  return c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

/// Python's unicode-escape decoding of a string literal's body.
std::string unescape(std::string_view s, int line) {
  std::string out;
  for (size_t i = 0; i < s.size(); i++) {
    if (s[i] != '\\' || i + 1 >= s.size()) {
      out += s[i];
      continue;
    }
    const char c = s[++i];
    static const std::string_view simple = "\\\\''\"\"a\ab\bf\fn\nr\rt\tv\v";
    if (size_t k = simple.find(c); k != std::string_view::npos && k % 2 == 0) {
      out += simple[k + 1];
    } else if (c == '\n') {
    } else if (c >= '0' && c <= '7') {
      unsigned v = 0;
      for (int n = 0; n < 3 && i < s.size() && s[i] >= '0' && s[i] <= '7'; n++, i++) v = v * 8 + unsigned(s[i] - '0');
      i--;
      append_cp(out, v);
    } else if (c == 'x' || c == 'u' || c == 'U') {
      const int n = c == 'x' ? 2 : c == 'u' ? 4 : 8;
      uint32_t v = 0;
      for (int d = 1; d <= n; d++) {
        const int h = i + size_t(d) < s.size() ? hex_val(s[i + size_t(d)]) : -1;
        if (h < 0) syntax_error(line, std::string("truncated \\") + c + " escape");
        v = v * 16 + uint32_t(h);
      }
      if (v > 0x10FFFF) syntax_error(line, "illegal Unicode character");
      append_cp(out, v);
      i += size_t(n);
    } else if (c == 'N') {
      syntax_error(line, "\\N{...} escapes are not supported");
    } else {
      out += '\\', out += c;
    }
  }
  return out;
}

void Lexer::string_literal() {
  const char q = src_[pos_];
  for (size_t p = pos_ + 1; p < src_.size(); p++) {
    if (src_[p] == '\\') {
      if (++p >= src_.size()) break;
      continue;
    }
    if (src_[p] != q) continue;
    emit(Tok::String, unescape(std::string_view(src_).substr(pos_ + 1, p - pos_ - 1), line_));
    advance(p + 1);
    return;
  }
  syntax_error(line_, std::string("unexpected char '") + q + "'");
}

void Lexer::op() {
  static const char* const two[] = {"//", "**", "==", "!=", ">=", "<="};
  for (const char* t : two) {
    if (at(pos_, t)) {
      emit(Tok::Op, t);
      pos_ += 2;
      return;
    }
  }
  const char c = src_[pos_];
  if (!std::strchr("+-/*%~[](){}><=.:|,;", c) || c == 0) {
    size_t n;
    decode_at(src_, pos_, &n);
    syntax_error(line_, "unexpected char '" + src_.substr(pos_, n) + "'");
  }
  if (c == '(' || c == '[' || c == '{') balance_.push_back(c == '(' ? ')' : c == '[' ? ']' : '}');
  if (c == ')' || c == ']' || c == '}') {
    if (balance_.empty()) syntax_error(line_, std::string("unexpected '") + c + "'");
    const char want = balance_.back();
    balance_.pop_back();
    if (want != c) syntax_error(line_, std::string("unexpected '") + c + "', expected '" + want + "'");
  }
  emit(Tok::Op, std::string(1, c));
  pos_++;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// The syntax tree and the parser: jinja2's parser.py.

namespace {

enum class EK : uint8_t {
  Const, Name, Getattr, Getitem, Slice, Call, Filter, Test, Not, Neg, Pos, Bin, And, Or, Concat, Compare, Cond,
  List, Tuple, Dict, NSRef
};
enum class BinOp : uint8_t { Add, Sub, Mul, Div, FloorDiv, Mod, Pow };
enum class CmpOp : uint8_t { Eq, Ne, Lt, Le, Gt, Ge, In, NotIn };

struct Expr;
using ExprP = std::unique_ptr<Expr>;

/// An expression node. Operands by kind: Getattr a.name; Getitem a[b]; Slice a:b:c (each
/// optional); Call a(list, kwargs, *dyn_args, **dyn_kwargs); Filter a|name(...) (a absent in
/// filter blocks and set blocks); Test a is name(...); Not/Neg/Pos a; Bin/And/Or a op b;
/// Concat list; Compare list[0] cmp[i] list[i+1]; Cond b if a else c; List/Tuple list; Dict
/// list: list2; NSRef name.name2.
struct Expr {
  EK kind;
  int line = 0;
  int height = 1;
  BinOp op = BinOp::Add;
  Value value;
  std::string name, name2;
  ExprP a, b, c;
  std::vector<ExprP> list, list2;
  std::vector<std::pair<std::string, ExprP>> kwargs;
  ExprP dyn_args, dyn_kwargs;
  std::vector<CmpOp> cmp;
};

enum class SK : uint8_t { Data, Output, If, For, Set, SetBlock, Macro, CallBlock, FilterBlock, With, Break, Continue, Body };

struct Stmt;
using StmtP = std::unique_ptr<Stmt>;
using Body = std::vector<StmtP>;

struct Param {
  std::string name;
  ExprP def;
};

/// A statement. Data text; Output exprs; If branches (test, body) then else_body; For
/// target in expr [if test] body else_body; Set target = expr; SetBlock target | expr (a
/// filter) body; Macro text(params) body; CallBlock expr (the call) with params and body;
/// FilterBlock expr body; With exprs (target, value pairs) body; Body body.
struct Stmt {
  SK kind;
  int line = 0;
  std::string text;
  ExprP expr, target, test;
  std::vector<ExprP> exprs;
  std::vector<std::pair<ExprP, Body>> branches;
  Body body, else_body;
  std::vector<Param> params;
  bool varargs = false, kwargs = false, caller = false;
};

const char* const kFilters[] = {
    "abs", "attr", "batch", "capitalize", "center", "count", "d", "default", "dictsort", "e", "escape",
    "filesizeformat", "first", "float", "forceescape", "format", "groupby", "indent", "int", "join", "last",
    "length", "list", "lower", "items", "map", "min", "max", "pprint", "random", "reject", "rejectattr", "replace",
    "reverse", "round", "safe", "select", "selectattr", "slice", "sort", "string", "striptags", "sum", "title",
    "trim", "truncate", "unique", "upper", "urlencode", "urlize", "wordcount", "wordwrap", "xmlattr", "tojson"};
const char* const kTests[] = {
    "odd", "even", "divisibleby", "defined", "undefined", "filter", "test", "none", "boolean", "false", "true",
    "integer", "float", "lower", "upper", "string", "mapping", "number", "sequence", "iterable", "callable",
    "sameas", "escaped", "in", "==", "eq", "equalto", "!=", "ne", ">", "gt", "greaterthan", "ge", ">=", "<", "lt",
    "lessthan", "<=", "le"};

template <size_t N>
bool known(const char* const (&names)[N], const std::string& n) {
  for (const char* k : names)
    if (n == k) return true;
  return false;
}

void walk_names(const Expr* e, std::vector<std::string>& out);
void walk_names(const Body& b, std::vector<std::string>& out);

void walk_names(const Expr* e, std::vector<std::string>& out) {
  if (!e) return;
  if (e->kind == EK::Name) out.push_back(e->name);
  for (const Expr* x : {e->a.get(), e->b.get(), e->c.get(), e->dyn_args.get(), e->dyn_kwargs.get()}) walk_names(x, out);
  for (const auto& x : e->list) walk_names(x.get(), out);
  for (const auto& x : e->list2) walk_names(x.get(), out);
  for (const auto& kw : e->kwargs) walk_names(kw.second.get(), out);
}

void walk_names(const Body& b, std::vector<std::string>& out) {
  for (const auto& s : b) {
    for (const Expr* x : {s->expr.get(), s->target.get(), s->test.get()}) walk_names(x, out);
    for (const auto& x : s->exprs) walk_names(x.get(), out);
    for (const auto& br : s->branches) walk_names(br.first.get(), out), walk_names(br.second, out);
    for (const auto& p : s->params) walk_names(p.def.get(), out);
    walk_names(s->body, out);
    walk_names(s->else_body, out);
  }
}

class Parser {
 public:
  explicit Parser(std::vector<Token> toks) : t_(std::move(toks)) {}
  Body parse_template() {
    Body b = subparse({});
    return b;
  }

 private:
  std::vector<Token> t_;
  size_t p_ = 0;
  int depth_ = 0;
  int loop_depth_ = 0;

  struct Guard {
    Parser& p;
    explicit Guard(Parser& parser) : p(parser) {
      if (++p.depth_ > kMaxNesting) p.error("nesting too deep (over 256 levels)");
    }
    ~Guard() { p.depth_--; }
  };

  const Token& cur() const { return t_[p_]; }
  const Token& look() const { return t_[std::min(p_ + 1, t_.size() - 1)]; }
  const Token& next() {
    const Token& t = t_[p_];
    if (p_ + 1 < t_.size()) p_++;
    return t;
  }
  static bool is(const Token& t, Tok type, std::string_view text) { return t.type == type && t.text == text; }
  bool cur_name(std::string_view v) const { return is(cur(), Tok::Name, v); }
  bool cur_op(std::string_view v) const { return is(cur(), Tok::Op, v); }
  bool skip_name(std::string_view v) { return cur_name(v) ? (next(), true) : false; }
  bool skip_op(std::string_view v) { return cur_op(v) ? (next(), true) : false; }
  [[noreturn]] void error(const std::string& msg) const { syntax_error(cur().line, msg); }
  static std::string describe(const Token& t);
  void expect(Tok type, std::string_view text, const char* what);
  void expect_op(std::string_view v) { expect(Tok::Op, v, nullptr); }
  std::string expect_name();

  ExprP mk(EK kind, int line, ExprP a = nullptr, ExprP b = nullptr, ExprP c = nullptr) {
    auto e = std::make_unique<Expr>();
    e->kind = kind, e->line = line;
    e->a = std::move(a), e->b = std::move(b), e->c = std::move(c);
    return e;
  }
  ExprP fix_height(ExprP e);

  Body subparse(const std::vector<std::string_view>& ends);
  Body parse_statements(const std::vector<std::string_view>& ends, bool drop_needle);
  StmtP parse_statement();
  StmtP parse_for();
  StmtP parse_if();
  StmtP parse_set();
  StmtP parse_macro_or_call(bool call);
  StmtP parse_with();
  StmtP parse_body_tag(SK kind, std::string_view end);
  StmtP parse_print();
  void parse_signature(Stmt& s);
  ExprP parse_assign_target(bool with_tuple, const std::vector<std::string_view>& extra, bool with_namespace);

  bool is_tuple_end(const std::vector<std::string_view>& extra) const;
  ExprP parse_tuple(bool simplified, bool with_condexpr, const std::vector<std::string_view>& extra, bool explicit_parens,
                    bool with_namespace = false);
  ExprP parse_expression(bool with_condexpr = true);
  ExprP parse_condexpr();
  ExprP parse_or();
  ExprP parse_and();
  ExprP parse_not();
  ExprP parse_compare();
  ExprP parse_math1();
  ExprP parse_concat();
  ExprP parse_math2();
  ExprP parse_pow();
  ExprP parse_unary(bool with_filter = true);
  ExprP parse_unary_filtered() { return parse_unary(); }
  // One left-associative level: operands from `operand`, joined by the keyword `word` (Or, And:
  // node kind `kind`) or by the operators of `ops` (Bin nodes).
  ExprP parse_logic(const char* word, EK kind, ExprP (Parser::*operand)());
  ExprP parse_binary(std::initializer_list<std::pair<const char*, BinOp>> ops, ExprP (Parser::*operand)());
  ExprP parse_primary(bool with_namespace = false);
  ExprP parse_list();
  ExprP parse_dict();
  ExprP parse_postfix(ExprP node);
  ExprP parse_filter_expr(ExprP node);
  ExprP parse_subscript(ExprP node);
  ExprP parse_subscribed();
  void parse_call_args(Expr& e);
  ExprP parse_filter(ExprP node, bool start_inline);
  ExprP parse_test(ExprP node);
  std::string dotted_name();
};

std::string Parser::describe(const Token& t) {
  switch (t.type) {
    case Tok::Name:
    case Tok::Op: return t.text;
    case Tok::String: return "string";
    case Tok::Int: return "integer";
    case Tok::Float: return "float";
    case Tok::Data: return "template data";
    case Tok::VarBegin: return "begin of print statement";
    case Tok::VarEnd: return "end of print statement";
    case Tok::BlockBegin: return "begin of statement block";
    case Tok::BlockEnd: return "end of statement block";
    case Tok::Eof: return "end of template";
  }
  return "?";
}

void Parser::expect(Tok type, std::string_view text, const char* what) {
  if (cur().type == type && (text.empty() || cur().text == text)) {
    next();
    return;
  }
  const std::string want = what ? what : std::string(text);
  if (cur().type == Tok::Eof) error("unexpected end of template, expected '" + want + "'.");
  error("expected token '" + want + "', got '" + describe(cur()) + "'");
}

std::string Parser::expect_name() {
  if (cur().type != Tok::Name) expect(Tok::Name, "", "name");
  return next().text;
}

ExprP Parser::fix_height(ExprP e) {
  int h = 0;
  for (const Expr* x : {e->a.get(), e->b.get(), e->c.get(), e->dyn_args.get(), e->dyn_kwargs.get()})
    if (x) h = std::max(h, x->height);
  for (const auto& x : e->list) h = std::max(h, x->height);
  for (const auto& x : e->list2) h = std::max(h, x->height);
  for (const auto& kw : e->kwargs) h = std::max(h, kw.second->height);
  e->height = h + 1;
  if (e->height > kMaxExprHeight) syntax_error(e->line, "expression nested too deeply (over 512 levels)");
  return e;
}

Body Parser::subparse(const std::vector<std::string_view>& ends) {
  Body body;
  while (cur().type != Tok::Eof) {
    const Token& t = cur();
    if (t.type == Tok::Data) {
      auto s = std::make_unique<Stmt>();
      s->kind = SK::Data, s->line = t.line, s->text = t.text;
      body.push_back(std::move(s));
      next();
    } else if (t.type == Tok::VarBegin) {
      next();
      auto s = std::make_unique<Stmt>();
      s->kind = SK::Output, s->line = t.line;
      s->exprs.push_back(parse_tuple(false, true, {}, false));
      expect(Tok::VarEnd, "", "end of print statement");
      body.push_back(std::move(s));
    } else if (t.type == Tok::BlockBegin) {
      next();
      for (auto e : ends)
        if (cur_name(e)) return body;
      body.push_back(parse_statement());
      expect(Tok::BlockEnd, "", "end of statement block");
    } else {
      error("unexpected '" + describe(t) + "'");
    }
  }
  return body;
}

Body Parser::parse_statements(const std::vector<std::string_view>& ends, bool drop_needle) {
  skip_op(":");
  expect(Tok::BlockEnd, "", "end of statement block");
  Body b = subparse(ends);
  if (cur().type == Tok::Eof) {
    std::string want;
    for (auto e : ends) want += (want.empty() ? "'" : " or '") + std::string(e) + "'";
    error("Unexpected end of template. Jinja was looking for the following tags: " + want + ".");
  }
  if (drop_needle) next();
  return b;
}

StmtP Parser::parse_statement() {
  Guard g(*this);
  if (cur().type != Tok::Name) error("tag name expected");
  const std::string name = cur().text;
  if (name == "for") return parse_for();
  if (name == "if") return parse_if();
  if (name == "set") return parse_set();
  if (name == "macro") return parse_macro_or_call(false);
  if (name == "call") return parse_macro_or_call(true);
  if (name == "filter") return parse_body_tag(SK::FilterBlock, "endfilter");
  if (name == "with") return parse_with();
  if (name == "print") return parse_print();
  if (name == "generation") return parse_body_tag(SK::Body, "endgeneration");
  if (name == "break" || name == "continue") {
    if (loop_depth_ == 0) error("'" + name + "' outside loop");
    auto s = std::make_unique<Stmt>();
    s->kind = name == "break" ? SK::Break : SK::Continue, s->line = next().line;
    return s;
  }
  for (const char* u : {"block", "extends", "include", "import", "from", "autoescape"})
    if (name == u) error("the '" + name + "' tag is not supported (a chat template is a single template)");
  error("Encountered unknown tag '" + name + "'.");
}

StmtP Parser::parse_for() {
  auto s = std::make_unique<Stmt>();
  s->kind = SK::For, s->line = next().line;
  s->target = parse_assign_target(true, {"in"}, false);
  expect(Tok::Name, "in", nullptr);
  s->expr = parse_tuple(false, false, {"recursive"}, false);
  if (skip_name("if")) s->test = parse_expression();
  if (cur_name("recursive")) error("recursive for loops are not supported");
  loop_depth_++;
  s->body = parse_statements({"endfor", "else"}, false);
  loop_depth_--;
  if (next().text == "else") s->else_body = parse_statements({"endfor"}, true);
  return s;
}

StmtP Parser::parse_if() {
  auto s = std::make_unique<Stmt>();
  s->kind = SK::If, s->line = next().line;
  while (true) {
    ExprP test = parse_tuple(false, false, {}, false);
    Body body = parse_statements({"elif", "else", "endif"}, false);
    s->branches.emplace_back(std::move(test), std::move(body));
    const Token& t = next();
    if (t.text == "elif") continue;
    if (t.text == "else") s->else_body = parse_statements({"endif"}, true);
    return s;
  }
}

StmtP Parser::parse_set() {
  auto s = std::make_unique<Stmt>();
  s->line = next().line;
  s->target = parse_assign_target(true, {}, true);
  if (skip_op("=")) {
    s->kind = SK::Set;
    s->expr = parse_tuple(false, true, {}, false);
    return s;
  }
  s->kind = SK::SetBlock;
  if (cur_op("|")) s->expr = parse_filter(nullptr, false);
  s->body = parse_statements({"endset"}, true);
  return s;
}

void Parser::parse_signature(Stmt& s) {
  expect_op("(");
  bool defaults = false;
  while (!cur_op(")")) {
    if (!s.params.empty()) expect_op(",");
    Param p;
    p.name = expect_name();
    if (skip_op("=")) {
      p.def = parse_expression();
      defaults = true;
    } else if (defaults) {
      error("non-default argument follows default argument");
    }
    s.params.push_back(std::move(p));
  }
  expect_op(")");
}

/// {% macro name(params) %}body{% endmacro %} and {% call(params) macro(args) %}body{% endcall %}.
StmtP Parser::parse_macro_or_call(bool call) {
  auto s = std::make_unique<Stmt>();
  s->kind = call ? SK::CallBlock : SK::Macro, s->line = next().line;
  if (call) {
    if (cur_op("(")) parse_signature(*s);
    s->expr = parse_expression();
    if (s->expr->kind != EK::Call) syntax_error(s->line, "expected call");
  } else {
    s->text = expect_name();
    parse_signature(*s);
  }
  const int saved = loop_depth_;
  loop_depth_ = 0;
  s->body = parse_statements({call ? "endcall" : "endmacro"}, true);
  loop_depth_ = saved;
  std::vector<std::string> names;
  walk_names(s->body, names);
  for (const auto& n : names) {
    s->varargs |= n == "varargs";
    s->kwargs |= n == "kwargs";
    s->caller |= n == "caller";
  }
  return s;
}

StmtP Parser::parse_with() {
  auto s = std::make_unique<Stmt>();
  s->kind = SK::With, s->line = next().line;
  while (cur().type != Tok::BlockEnd) {
    if (!s->exprs.empty()) expect_op(",");
    s->exprs.push_back(parse_assign_target(true, {}, false));
    expect_op("=");
    s->exprs.push_back(parse_expression());
  }
  s->body = parse_statements({"endwith"}, true);
  return s;
}

/// {% filter f %}..{% endfilter %} and {% generation %}..{% endgeneration %}.
StmtP Parser::parse_body_tag(SK kind, std::string_view end) {
  auto s = std::make_unique<Stmt>();
  s->kind = kind, s->line = next().line;
  if (kind == SK::FilterBlock) s->expr = parse_filter(nullptr, true);
  s->body = parse_statements({end}, true);
  return s;
}

StmtP Parser::parse_print() {
  auto s = std::make_unique<Stmt>();
  s->kind = SK::Output, s->line = next().line;
  while (cur().type != Tok::BlockEnd) {
    if (!s->exprs.empty()) expect_op(",");
    s->exprs.push_back(parse_expression());
  }
  return s;
}

bool assignable(const Expr& e) {
  if (e.kind == EK::Name || e.kind == EK::NSRef) return true;
  if (e.kind != EK::Tuple) return false;
  for (const auto& x : e.list)
    if (!assignable(*x)) return false;
  return true;
}

ExprP Parser::parse_assign_target(bool with_tuple, const std::vector<std::string_view>& extra, bool with_namespace) {
  ExprP t = with_tuple ? parse_tuple(true, true, extra, false, with_namespace) : parse_primary(with_namespace);
  if (!assignable(*t)) syntax_error(t->line, "can't assign to this expression");
  return t;
}

bool Parser::is_tuple_end(const std::vector<std::string_view>& extra) const {
  if (cur().type == Tok::VarEnd || cur().type == Tok::BlockEnd || cur_op(")")) return true;
  for (auto e : extra)
    if (cur_name(e)) return true;
  return false;
}

ExprP Parser::parse_tuple(bool simplified, bool with_condexpr, const std::vector<std::string_view>& extra,
                          bool explicit_parens, bool with_namespace) {
  const int line = cur().line;
  std::vector<ExprP> args;
  bool is_tuple = false;
  while (true) {
    if (!args.empty()) expect_op(",");
    if (is_tuple_end(extra)) break;
    args.push_back(simplified ? parse_primary(with_namespace) : parse_expression(with_condexpr));
    if (!cur_op(",")) break;
    is_tuple = true;
  }
  if (!is_tuple) {
    if (!args.empty()) return std::move(args[0]);
    if (!explicit_parens) error("Expected an expression, got '" + describe(cur()) + "'");
  }
  ExprP t = mk(EK::Tuple, line);
  t->list = std::move(args);
  return fix_height(std::move(t));
}

ExprP Parser::parse_expression(bool with_condexpr) {
  Guard g(*this);
  return with_condexpr ? parse_condexpr() : parse_or();
}

ExprP Parser::parse_condexpr() {
  const int line = cur().line;
  ExprP e1 = parse_or();
  while (skip_name("if")) {
    ExprP e2 = parse_or();
    ExprP e3 = skip_name("else") ? parse_condexpr() : nullptr;
    e1 = fix_height(mk(EK::Cond, line, std::move(e2), std::move(e1), std::move(e3)));
  }
  return e1;
}

ExprP Parser::parse_logic(const char* word, EK kind, ExprP (Parser::*operand)()) {
  ExprP left = (this->*operand)();
  while (cur_name(word)) {
    const int line = next().line;
    left = fix_height(mk(kind, line, std::move(left), (this->*operand)()));
  }
  return left;
}

ExprP Parser::parse_or() { return parse_logic("or", EK::Or, &Parser::parse_and); }

ExprP Parser::parse_and() { return parse_logic("and", EK::And, &Parser::parse_not); }

ExprP Parser::parse_not() {
  if (!cur_name("not")) return parse_compare();
  Guard g(*this);
  const int line = next().line;
  return fix_height(mk(EK::Not, line, parse_not()));
}

ExprP Parser::parse_compare() {
  const int line = cur().line;
  ExprP e = parse_math1();
  ExprP cmp = mk(EK::Compare, line);
  static const std::pair<const char*, CmpOp> ops[] = {{"==", CmpOp::Eq}, {"!=", CmpOp::Ne}, {"<", CmpOp::Lt},
                                                      {"<=", CmpOp::Le}, {">", CmpOp::Gt},  {">=", CmpOp::Ge}};
  while (true) {
    bool found = false;
    for (const auto& [text, op] : ops) {
      if (cur_op(text)) {
        next();
        cmp->cmp.push_back(op);
        found = true;
        break;
      }
    }
    if (!found && skip_name("in")) {
      cmp->cmp.push_back(CmpOp::In);
    } else if (!found && cur_name("not") && is(look(), Tok::Name, "in")) {
      next(), next();
      cmp->cmp.push_back(CmpOp::NotIn);
    } else if (!found) {
      break;
    }
    if (cmp->list.empty()) cmp->list.push_back(std::move(e));
    cmp->list.push_back(parse_math1());
  }
  return cmp->list.empty() ? std::move(e) : fix_height(std::move(cmp));
}

ExprP Parser::parse_binary(std::initializer_list<std::pair<const char*, BinOp>> ops, ExprP (Parser::*operand)()) {
  ExprP left = (this->*operand)();
  for (;;) {
    const std::pair<const char*, BinOp>* hit = nullptr;
    for (const auto& o : ops)
      if (cur_op(o.first)) hit = &o;
    if (!hit) return left;
    const int line = next().line;
    ExprP e = mk(EK::Bin, line, std::move(left), (this->*operand)());
    e->op = hit->second;
    left = fix_height(std::move(e));
  }
}

ExprP Parser::parse_math1() { return parse_binary({{"+", BinOp::Add}, {"-", BinOp::Sub}}, &Parser::parse_concat); }

ExprP Parser::parse_concat() {
  const int line = cur().line;
  ExprP first = parse_math2();
  if (!cur_op("~")) return first;
  ExprP e = mk(EK::Concat, line);
  e->list.push_back(std::move(first));
  while (skip_op("~")) e->list.push_back(parse_math2());
  return fix_height(std::move(e));
}

ExprP Parser::parse_math2() {
  return parse_binary({{"*", BinOp::Mul}, {"/", BinOp::Div}, {"//", BinOp::FloorDiv}, {"%", BinOp::Mod}}, &Parser::parse_pow);
}

ExprP Parser::parse_pow() { return parse_binary({{"**", BinOp::Pow}}, &Parser::parse_unary_filtered); }

ExprP Parser::parse_unary(bool with_filter) {
  Guard g(*this);
  const int line = cur().line;
  ExprP node;
  if (skip_op("-")) {
    node = fix_height(mk(EK::Neg, line, parse_unary(false)));
  } else if (skip_op("+")) {
    node = fix_height(mk(EK::Pos, line, parse_unary(false)));
  } else {
    node = parse_primary();
  }
  node = parse_postfix(std::move(node));
  if (with_filter) node = parse_filter_expr(std::move(node));
  return node;
}

ExprP Parser::parse_primary(bool with_namespace) {
  const Token& t = cur();
  ExprP node = mk(EK::Const, t.line);
  if (t.type == Tok::Name) {
    next();
    if (t.text == "true" || t.text == "True" || t.text == "false" || t.text == "False") {
      node->value = Value(t.text == "true" || t.text == "True");
    } else if (t.text == "none" || t.text == "None") {
      node->value = Value(nullptr);
    } else if (with_namespace && cur_op(".")) {
      next();
      node->kind = EK::NSRef, node->name = t.text, node->name2 = expect_name();
    } else {
      node->kind = EK::Name, node->name = t.text;
    }
  } else if (t.type == Tok::String) {
    std::string s;
    while (cur().type == Tok::String) s += next().text;
    node->value = make_str(std::move(s));
  } else if (t.type == Tok::Int || t.type == Tok::Float) {
    node->value = t.type == Tok::Int ? Value(t.i) : Value(t.f);
    next();
  } else if (cur_op("(")) {
    next();
    node = parse_tuple(false, true, {}, true);
    expect_op(")");
  } else if (cur_op("[")) {
    node = parse_list();
  } else if (cur_op("{")) {
    node = parse_dict();
  } else {
    if (t.type == Tok::Eof) error("unexpected end of template");
    error("unexpected '" + describe(t) + "'");
  }
  return node;
}

ExprP Parser::parse_list() {
  ExprP e = mk(EK::List, next().line);
  while (!cur_op("]")) {
    if (!e->list.empty()) expect_op(",");
    if (cur_op("]")) break;
    e->list.push_back(parse_expression());
  }
  expect_op("]");
  return fix_height(std::move(e));
}

ExprP Parser::parse_dict() {
  ExprP e = mk(EK::Dict, next().line);
  while (!cur_op("}")) {
    if (!e->list.empty()) expect_op(",");
    if (cur_op("}")) break;
    e->list.push_back(parse_expression());
    expect_op(":");
    e->list2.push_back(parse_expression());
  }
  expect_op("}");
  return fix_height(std::move(e));
}

ExprP Parser::parse_postfix(ExprP node) {
  while (true) {
    if (cur_op(".") || cur_op("[")) {
      node = parse_subscript(std::move(node));
    } else if (cur_op("(")) {
      ExprP call = mk(EK::Call, cur().line, std::move(node));
      parse_call_args(*call);
      node = fix_height(std::move(call));
    } else {
      return node;
    }
  }
}

ExprP Parser::parse_filter_expr(ExprP node) {
  while (true) {
    if (cur_op("|")) {
      node = parse_filter(std::move(node), false);
    } else if (cur_name("is")) {
      node = parse_test(std::move(node));
    } else if (cur_op("(")) {
      ExprP call = mk(EK::Call, cur().line, std::move(node));
      parse_call_args(*call);
      node = fix_height(std::move(call));
    } else {
      return node;
    }
  }
}

ExprP Parser::parse_subscript(ExprP node) {
  const Token& t = next();
  if (t.text == ".") {
    const Token& attr = cur();
    if (attr.type == Tok::Name) {
      next();
      ExprP e = mk(EK::Getattr, t.line, std::move(node));
      e->name = attr.text;
      return fix_height(std::move(e));
    }
    if (attr.type != Tok::Int) error("expected name or number");
    next();
    ExprP key = mk(EK::Const, attr.line);
    key->value = Value(attr.i);
    return fix_height(mk(EK::Getitem, t.line, std::move(node), std::move(key)));
  }
  std::vector<ExprP> args;
  while (!cur_op("]")) {
    if (!args.empty()) expect_op(",");
    args.push_back(parse_subscribed());
  }
  expect_op("]");
  ExprP key;
  if (args.size() == 1) {
    key = std::move(args[0]);
  } else {
    key = mk(EK::Tuple, t.line);
    key->list = std::move(args);
    key = fix_height(std::move(key));
  }
  return fix_height(mk(EK::Getitem, t.line, std::move(node), std::move(key)));
}

ExprP Parser::parse_subscribed() {
  const int line = cur().line;
  ExprP start, stop, step;
  if (!skip_op(":")) {
    ExprP node = parse_expression();
    if (!cur_op(":")) return node;
    next();
    start = std::move(node);
  }
  if (!cur_op(":") && !cur_op("]") && !cur_op(",")) stop = parse_expression();
  if (skip_op(":")) {
    if (!cur_op("]") && !cur_op(",")) step = parse_expression();
  }
  return fix_height(mk(EK::Slice, line, std::move(start), std::move(stop), std::move(step)));
}

void Parser::parse_call_args(Expr& e) {
  expect_op("(");
  bool require_comma = false;
  auto ensure = [&](bool ok) {
    if (!ok) error("invalid syntax for function call expression");
  };
  while (!cur_op(")")) {
    if (require_comma) {
      expect_op(",");
      if (cur_op(")")) break;
    }
    if (skip_op("*")) {
      ensure(!e.dyn_args && !e.dyn_kwargs);
      e.dyn_args = parse_expression();
    } else if (skip_op("**")) {
      ensure(!e.dyn_kwargs);
      e.dyn_kwargs = parse_expression();
    } else if (cur().type == Tok::Name && is(look(), Tok::Op, "=")) {
      ensure(!e.dyn_kwargs);
      std::string key = next().text;
      next();
      e.kwargs.emplace_back(std::move(key), parse_expression());
    } else {
      ensure(!e.dyn_args && !e.dyn_kwargs && e.kwargs.empty());
      e.list.push_back(parse_expression());
    }
    require_comma = true;
  }
  expect_op(")");
}

std::string Parser::dotted_name() {
  std::string name = expect_name();
  while (skip_op(".")) {
    name += '.';
    name += expect_name();
  }
  return name;
}

ExprP Parser::parse_filter(ExprP node, bool start_inline) {
  while (cur_op("|") || start_inline) {
    if (!start_inline) next();
    const int line = cur().line;
    ExprP f = mk(EK::Filter, line, std::move(node));
    f->name = dotted_name();
    if (!known(kFilters, f->name)) syntax_error(line, "No filter named '" + f->name + "'.");
    if (cur_op("(")) parse_call_args(*f);
    node = fix_height(std::move(f));
    start_inline = false;
  }
  return node;
}

ExprP Parser::parse_test(ExprP node) {
  const int line = next().line;
  const bool negated = skip_name("not");
  ExprP t = mk(EK::Test, line, std::move(node));
  t->name = dotted_name();
  if (!known(kTests, t->name)) syntax_error(line, "No test named '" + t->name + "'.");
  const Token& c = cur();
  if (cur_op("(")) {
    parse_call_args(*t);
  } else if ((c.type == Tok::Name || c.type == Tok::String || c.type == Tok::Int || c.type == Tok::Float ||
              cur_op("[") || cur_op("{")) &&
             !cur_name("else") && !cur_name("or") && !cur_name("and")) {
    if (cur_name("is")) error("You cannot chain multiple tests with is");
    t->list.push_back(parse_postfix(parse_primary()));
  }
  t = fix_height(std::move(t));
  return negated ? fix_height(mk(EK::Not, line, std::move(t))) : std::move(t);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// The renderer's state, and the operators with Python's semantics.

namespace {

struct Scope;
using ScopeP = std::shared_ptr<Scope>;

/// Variables of one frame: the template, a for-loop iteration, a macro call, a with block.
/// Lookups go to the parent, then the context, then the globals.
struct Scope {
  ScopeP parent;
  std::vector<std::pair<std::string, Value>> vars;
  const Value* find(std::string_view n) const {
    for (const auto& v : vars)
      if (v.first == n) return &v.second;
    return nullptr;
  }
  void set(const std::string& n, Value v) {
    for (auto& e : vars) {
      if (e.first == n) {
        e.second = std::move(v);
        return;
      }
    }
    vars.emplace_back(n, std::move(v));
  }
};

ScopeP child_scope(const ScopeP& parent) {
  auto s = std::make_shared<Scope>();
  s->parent = parent;
  return s;
}

struct Ctx {
  const RenderOptions& opt;
  const Object& context;
  std::string* out;
  int depth = 0;
  int line = 0;
  int64_t loops = 0, steps = 0;
  size_t alloc = 0;
  std::vector<ScopeP> closures;                     // scopes that macros capture: cleared at the end
  std::vector<std::shared_ptr<NsHeap>> namespaces;  // cleared at the end (they may hold themselves)

  Ctx(const RenderOptions& o, const Object& vars, std::string* output) : opt(o), context(vars), out(output) {}

  void step(int64_t n = 1) {
    if ((steps += n) > opt.max_steps) fail("the render took too many steps (RenderOptions::max_steps)");
  }
  void charge(size_t bytes) {
    if (bytes > opt.max_alloc_bytes - std::min(alloc, opt.max_alloc_bytes) || (alloc += bytes) > opt.max_alloc_bytes)
      fail("the render built too much text (RenderOptions::max_alloc_bytes)");
  }
  size_t cap() const { return opt.max_alloc_bytes - std::min(alloc, opt.max_alloc_bytes); }
  void write(std::string_view s) {
    if (out->size() + s.size() > opt.max_output_bytes) fail("the output is too long (RenderOptions::max_output_bytes)");
    charge(s.size());
    out->append(s);
  }
};

struct DepthGuard {
  Ctx& c;
  explicit DepthGuard(Ctx& ctx) : c(ctx) {
    if (++c.depth > kMaxEvalDepth) fail("too deeply nested or recursive (over " + std::to_string(kMaxEvalDepth) + " levels)");
  }
  ~DepthGuard() { c.depth--; }
};

Value undefined(std::string hint) {
  auto h = std::make_shared<StrHeap>();
  h->s = std::move(hint);
  return Access::make(Kind::Undefined, std::move(h));
}

std::string undefined_message(const Value& v) {
  return Access::heap(v) ? S(v) : std::string("value is undefined");
}

[[noreturn]] void fail_undefined(const Value& v) { fail(undefined_message(v)); }

/// str(v) within the render's budget.
std::string str_of(Ctx& c, const Value& v) {
  if (v.kind() == Kind::String) return S(v);
  std::string s = to_str(v, c.cap());
  c.charge(s.size());
  return s;
}

Value new_str(Ctx& c, std::string s) {
  c.charge(s.size());
  return make_str(std::move(s));
}

Value new_array(Ctx& c, std::vector<Value> v, bool tuple = false) {
  c.charge(v.size() * sizeof(Value));
  c.step(int64_t(v.size()));
  return make_array(std::move(v), tuple);
}

bool is_num(const Value& v) { return v.kind() == Kind::Bool || v.kind() == Kind::Int || v.kind() == Kind::Float; }
bool is_intlike(const Value& v) { return v.kind() == Kind::Bool || v.kind() == Kind::Int; }

bool truthy(const Value& v) {
  switch (v.kind()) {
    case Kind::Undefined:
    case Kind::None: return false;
    case Kind::Bool: return Access::b(v);
    case Kind::Int: return Access::i(v) != 0;
    case Kind::Float: return Access::f(v) != 0;
    case Kind::String: return !S(v).empty();
    case Kind::Array: return !items(v).empty();
    case Kind::Object: return !O(v).entries.empty();
    default: return true;
  }
}

/// Python's int/float comparison (exact): -1, 0, 1, or 2 when unordered (NaN).
int num_cmp(const Value& a, const Value& b) {
  if (is_intlike(a) && is_intlike(b)) return I(a) < I(b) ? -1 : I(a) > I(b) ? 1 : 0;
  if (a.kind() == Kind::Float && b.kind() == Kind::Float) {
    const double x = Access::f(a), y = Access::f(b);
    return x < y ? -1 : x > y ? 1 : x == y ? 0 : 2;
  }
  const bool flip = a.kind() == Kind::Float;
  const int64_t i = I(flip ? b : a);
  const double d = F(flip ? a : b);
  int r;
  if (std::isnan(d)) return 2;
  if (d >= 9223372036854775808.0) {
    r = -1;
  } else if (d < -9223372036854775808.0) {
    r = 1;
  } else {
    const double t = std::trunc(d);
    const int64_t ti = int64_t(t);
    r = i < ti ? -1 : i > ti ? 1 : (d - t > 0 ? -1 : d - t < 0 ? 1 : 0);
  }
  return flip ? -r : r;
}

bool eq(Ctx& c, const Value& a, const Value& b) {
  c.step();
  if (a.kind() == Kind::Undefined || b.kind() == Kind::Undefined) return a.kind() == b.kind();
  if (is_num(a) && is_num(b)) return num_cmp(a, b) == 0;
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case Kind::None: return true;
    case Kind::String: return S(a) == S(b);
    case Kind::Array: {
      const auto &x = A(a), &y = A(b);
      if (x.tuple != y.tuple || x.items.size() != y.items.size()) return false;
      for (size_t i = 0; i < x.items.size(); i++)
        if (!eq(c, x.items[i], y.items[i])) return false;
      return true;
    }
    case Kind::Object: {
      const auto &x = O(a), &y = O(b);
      if (x.entries.size() != y.entries.size()) return false;
      for (const auto& e : x.entries) {
        const Value* o = y.find(e.first);
        if (!o || !eq(c, e.second, *o)) return false;
      }
      return true;
    }
    default: return Access::heap(a) == Access::heap(b);
  }
}

/// Python's ordering for <, <=, >, >=, sort, min and max: -1, 0, 1, or 2 (unordered, NaN);
/// TypeError for types without an order.
int order(Ctx& c, const Value& a, const Value& b, const char* op = "<") {
  c.step();
  if (a.kind() == Kind::Undefined) fail_undefined(a);
  if (b.kind() == Kind::Undefined) fail_undefined(b);
  if (is_num(a) && is_num(b)) return num_cmp(a, b);
  if (a.kind() == Kind::String && b.kind() == Kind::String) {
    const int r = S(a).compare(S(b));
    return r < 0 ? -1 : r > 0 ? 1 : 0;
  }
  if (a.kind() == Kind::Array && b.kind() == Kind::Array && A(a).tuple == A(b).tuple) {
    const auto &x = items(a), &y = items(b);
    for (size_t i = 0; i < x.size() && i < y.size(); i++)
      if (!eq(c, x[i], y[i])) return order(c, x[i], y[i], op);
    return x.size() < y.size() ? -1 : x.size() > y.size() ? 1 : 0;
  }
  fail(std::string("'") + op + "' not supported between instances of '" + type_name(a) + "' and '" + type_name(b) + "'");
}

bool compare(Ctx& c, CmpOp op, const Value& a, const Value& b);

/// Python's `needle in hay`.
bool contains(Ctx& c, const Value& needle, const Value& hay) {
  switch (hay.kind()) {
    case Kind::Undefined: return false;
    case Kind::String:
      if (needle.kind() != Kind::String)
        fail(std::string("'in <string>' requires string as left operand, not ") + type_name(needle));
      return S(hay).find(S(needle)) != std::string::npos;
    case Kind::Array:
      for (const auto& x : items(hay))
        if (eq(c, needle, x)) return true;
      return false;
    case Kind::Object:
      if (needle.kind() == Kind::Array || needle.kind() == Kind::Object) fail(std::string("unhashable type: '") + type_name(needle) + "'");
      return needle.kind() == Kind::String && O(hay).find(S(needle));
    default: fail(std::string("argument of type '") + type_name(hay) + "' is not iterable");
  }
}

bool compare(Ctx& c, CmpOp op, const Value& a, const Value& b) {
  switch (op) {
    case CmpOp::Eq: return eq(c, a, b);
    case CmpOp::Ne: return !eq(c, a, b);
    case CmpOp::In: return contains(c, a, b);
    case CmpOp::NotIn: return !contains(c, a, b);
    case CmpOp::Lt: return order(c, a, b, "<") == -1;
    case CmpOp::Le: {
      const int r = order(c, a, b, "<=");
      return r == -1 || r == 0;
    }
    case CmpOp::Gt: return order(c, a, b, ">") == 1;
    case CmpOp::Ge: {
      const int r = order(c, a, b, ">=");
      return r == 1 || r == 0;
    }
  }
  return false;
}

// Arithmetic.

const char* op_symbol(BinOp op) {
  static const char* const s[] = {"+", "-", "*", "/", "//", "%", "**"};
  return s[int(op)];
}

[[noreturn]] void fail_operands(BinOp op, const Value& a, const Value& b) {
  fail(std::string("unsupported operand type(s) for ") + op_symbol(op) + ": '" + type_name(a) + "' and '" + type_name(b) + "'");
}

[[noreturn]] void fail_overflow() { fail("integer overflow (integers are 64-bit here; Python's are unbounded)"); }

Value int_pow(int64_t base, int64_t e) {
  if (e < 0) {
    if (base == 0) fail("0.0 cannot be raised to a negative power");
    return Value(std::pow(double(base), double(e)));
  }
  int64_t r = 1;
  while (e > 0) {
    if ((e & 1) && __builtin_mul_overflow(r, base, &r)) fail_overflow();
    e >>= 1;
    if (e > 0 && __builtin_mul_overflow(base, base, &base)) fail_overflow();
  }
  return Value(r);
}

Value int_arith(BinOp op, int64_t a, int64_t b) {
  int64_t r = 0;
  switch (op) {
    case BinOp::Add:
      if (__builtin_add_overflow(a, b, &r)) fail_overflow();
      return Value(r);
    case BinOp::Sub:
      if (__builtin_sub_overflow(a, b, &r)) fail_overflow();
      return Value(r);
    case BinOp::Mul:
      if (__builtin_mul_overflow(a, b, &r)) fail_overflow();
      return Value(r);
    case BinOp::Div:
      if (b == 0) fail("division by zero");
      return Value(double(a) / double(b));
    case BinOp::FloorDiv:
    case BinOp::Mod: {
      if (b == 0) fail("integer division or modulo by zero");
      if (b == -1) {
        if (op == BinOp::Mod) return Value(int64_t(0));
        if (a == INT64_MIN) fail_overflow();
        return Value(-a);
      }
      int64_t q = a / b, m = a % b;
      if (m != 0 && ((m < 0) != (b < 0))) q--, m += b;
      return Value(op == BinOp::Mod ? m : q);
    }
    case BinOp::Pow: return int_pow(a, b);
  }
  return Value();
}

/// CPython's float_divmod (floor division and modulo) and float_pow's errors.
Value float_arith(BinOp op, double a, double b) {
  switch (op) {
    case BinOp::Add: return Value(a + b);
    case BinOp::Sub: return Value(a - b);
    case BinOp::Mul: return Value(a * b);
    case BinOp::Div:
      if (b == 0) fail("float division by zero");
      return Value(a / b);
    case BinOp::FloorDiv:
    case BinOp::Mod: {
      if (b == 0) fail(op == BinOp::Mod ? "float modulo" : "float floor division by zero");
      double mod = std::fmod(a, b), div = (a - mod) / b;
      if (mod != 0) {
        if ((b < 0) != (mod < 0)) mod += b, div -= 1.0;
      } else {
        mod = std::copysign(0.0, b);
      }
      double fl;
      if (div != 0) {
        fl = std::floor(div);
        if (div - fl > 0.5) fl += 1.0;
      } else {
        fl = std::copysign(0.0, a / b);
      }
      return Value(op == BinOp::Mod ? mod : fl);
    }
    case BinOp::Pow: {
      if (a == 0 && b < 0) fail("0.0 cannot be raised to a negative power");
      if (a < 0 && b != std::floor(b) && std::isfinite(b)) fail("a negative number to a fractional power is complex (unsupported)");
      const double r = std::pow(a, b);
      if (std::isinf(r) && std::isfinite(a) && std::isfinite(b)) fail("(34, 'Numerical result out of range')");
      return Value(r);
    }
  }
  return Value();
}

Value repeat(Ctx& c, const Value& seq, int64_t n) {
  n = std::max<int64_t>(n, 0);
  if (seq.kind() == Kind::String) {
    const std::string& s = S(seq);
    if (!s.empty() && uint64_t(n) > c.cap() / s.size()) c.charge(SIZE_MAX);
    std::string r;
    r.reserve(s.size() * size_t(n));
    for (int64_t i = 0; i < n; i++) r += s;
    return new_str(c, std::move(r));
  }
  const auto& v = items(seq);
  if (!v.empty() && uint64_t(n) > c.cap() / (v.size() * sizeof(Value))) c.charge(SIZE_MAX);
  std::vector<Value> r;
  for (int64_t i = 0; i < n; i++) r.insert(r.end(), v.begin(), v.end());
  return new_array(c, std::move(r), A(seq).tuple);
}

Value binop(Ctx& c, BinOp op, const Value& a, const Value& b) {
  if (a.kind() == Kind::Undefined) fail_undefined(a);
  if (b.kind() == Kind::Undefined) fail_undefined(b);
  if (is_num(a) && is_num(b)) {
    if (is_intlike(a) && is_intlike(b)) return int_arith(op, I(a), I(b));
    return float_arith(op, F(a), F(b));
  }
  const Kind ka = a.kind(), kb = b.kind();
  if (op == BinOp::Add && ka == kb && ka == Kind::String) {
    if (S(a).size() + S(b).size() > c.cap()) c.charge(SIZE_MAX);
    return new_str(c, S(a) + S(b));
  }
  if (op == BinOp::Add && ka == Kind::Array && kb == Kind::Array && A(a).tuple == A(b).tuple) {
    std::vector<Value> r = items(a);
    r.insert(r.end(), items(b).begin(), items(b).end());
    return new_array(c, std::move(r), A(a).tuple);
  }
  if (op == BinOp::Add && ka == Kind::String) fail(std::string("can only concatenate str (not \"") + type_name(b) + "\") to str");
  if (op == BinOp::Mul && (ka == Kind::String || ka == Kind::Array) && is_intlike(b)) return repeat(c, a, I(b));
  if (op == BinOp::Mul && (kb == Kind::String || kb == Kind::Array) && is_intlike(a)) return repeat(c, b, I(a));
  if (op == BinOp::Mod && ka == Kind::String) fail("string formatting with % is not supported");
  fail_operands(op, a, b);
}

Value negate(const Value& v, bool minus) {
  if (v.kind() == Kind::Undefined) fail_undefined(v);
  if (v.kind() == Kind::Float) return Value(minus ? -Access::f(v) : Access::f(v));
  if (is_intlike(v)) {
    if (minus && I(v) == INT64_MIN) fail_overflow();
    return Value(minus ? -I(v) : I(v));
  }
  fail(std::string("bad operand type for unary ") + (minus ? "-" : "+") + ": '" + type_name(v) + "'");
}

// Iteration, subscripts, slices.

/// The items `for x in v` visits: a list's items, a string's characters, a dict's keys;
/// nothing for Undefined.
std::vector<Value> iterate(Ctx& c, const Value& v) {
  std::vector<Value> r;
  switch (v.kind()) {
    case Kind::Undefined: return r;
    case Kind::Array: c.step(int64_t(items(v).size())); return items(v);
    case Kind::String: {
      const std::string& s = S(v);
      c.step(int64_t(s.size()));
      c.charge(s.size() * (sizeof(Value) + sizeof(StrHeap)));
      for (size_t p = 0, n; p < s.size(); p += n) {
        decode_at(s, p, &n);
        r.push_back(make_str(s.substr(p, n)));
      }
      return r;
    }
    case Kind::Object:
      c.step(int64_t(O(v).entries.size()));
      for (const auto& e : O(v).entries) r.push_back(make_str(e.first));
      return r;
    default: fail(std::string("'") + type_name(v) + "' object is not iterable");
  }
}

int64_t slice_bound(const Value& v) {
  if (!is_intlike(v)) fail("slice indices must be integers or None or have an __index__ method");
  return std::clamp<int64_t>(I(v), -(int64_t(1) << 62), int64_t(1) << 62);
}

/// v[start:stop:step] with Python's index rules (PySlice_AdjustIndices).
Value slice(Ctx& c, const Value& v, const Value& start, const Value& stop, const Value& step) {
  if (v.kind() == Kind::Undefined) fail_undefined(v);
  // jinja2 compiles a slice to Python's own slicing (not the sandbox's getitem): errors raise
  if (v.kind() == Kind::Object || v.kind() == Kind::Namespace) fail("unhashable type: 'slice'");
  if (v.kind() != Kind::String && v.kind() != Kind::Array) fail(std::string("'") + type_name(v) + "' object is not subscriptable");
  const int64_t st = step.kind() == Kind::None ? 1 : slice_bound(step);
  if (st == 0) fail("slice step cannot be zero");
  const bool is_str = v.kind() == Kind::String;
  const CpIndex cps(is_str ? std::string_view(S(v)) : std::string_view());
  const int64_t n = is_str ? int64_t(cps.size()) : int64_t(items(v).size());
  auto adjust = [&](const Value& b, bool is_start) -> int64_t {
    if (b.kind() == Kind::None) return st < 0 ? (is_start ? n - 1 : -1) : (is_start ? 0 : n);
    int64_t x = slice_bound(b);
    if (x < 0) {
      x += n;
      if (x < 0) x = st < 0 ? -1 : 0;
    } else if (x >= n) {
      x = st < 0 ? n - 1 : n;
    }
    return x;
  };
  const int64_t b = adjust(start, true), e = adjust(stop, false);
  std::vector<int64_t> idx;
  for (int64_t i = b; st > 0 ? i < e : i > e; i += st) idx.push_back(i);
  c.step(int64_t(idx.size()));
  if (is_str) {
    std::string r;
    for (int64_t i : idx) r += cps.sub(size_t(i), size_t(i) + 1);
    return new_str(c, std::move(r));
  }
  std::vector<Value> r;
  for (int64_t i : idx) r.push_back(items(v)[size_t(i)]);
  return new_array(c, std::move(r), A(v).tuple);
}

Value loop_attr(Ctx& c, const Value& loop, const std::string& name);
Value method(const Value& self, const std::string& name);

/// obj.name: Python attributes (methods) first, then the item (jinja2's sandbox getattr).
Value get_attr(Ctx& c, const Value& obj, const std::string& name) {
  switch (obj.kind()) {
    case Kind::Undefined: fail_undefined(obj);
    case Kind::Object: {
      Value m = method(obj, name);
      if (!m.is_undefined()) return m;
      if (const Value* v = O(obj).find(name)) return *v;
      return undefined("'dict object' has no attribute '" + name + "'");
    }
    case Kind::Namespace:
      if (const Value* v = NS(obj).attrs.find(name)) return *v;
      return undefined("'Namespace object' has no attribute '" + name + "'");
    case Kind::Loop: return loop_attr(c, obj, name);
    case Kind::String:
    case Kind::Array: {
      Value m = method(obj, name);
      if (!m.is_undefined()) return m;
      break;
    }
    default: break;
  }
  return undefined(std::string("'") + type_name(obj) + " object' has no attribute '" + name + "'");
}

/// obj[key]: the item first, then (for a string key) the attribute (jinja2's sandbox getitem).
Value get_item(Ctx& c, const Value& obj, const Value& key) {
  if (obj.kind() == Kind::Undefined) fail_undefined(obj);
  if ((obj.kind() == Kind::Array || obj.kind() == Kind::String) && is_intlike(key)) {
    const bool is_str = obj.kind() == Kind::String;
    const CpIndex cps(is_str ? std::string_view(S(obj)) : std::string_view());
    const int64_t n = is_str ? int64_t(cps.size()) : int64_t(items(obj).size());
    int64_t i = I(key);
    if (i < 0) i += n;
    if (i >= 0 && i < n) return is_str ? new_str(c, std::string(cps.sub(size_t(i), size_t(i) + 1))) : items(obj)[size_t(i)];
    return undefined(std::string(type_name(obj)) + " object has no element " + std::to_string(I(key)));
  }
  if (key.kind() == Kind::String) {
    if (obj.kind() == Kind::Object) {
      if (const Value* v = O(obj).find(S(key))) return *v;
      Value m = method(obj, S(key));
      return m.is_undefined() ? undefined("'dict object' has no attribute '" + S(key) + "'") : m;
    }
    return get_attr(c, obj, S(key));
  }
  if (key.kind() == Kind::Array || key.kind() == Kind::Object) {
    if (obj.kind() == Kind::Object) fail(std::string("unhashable type: '") + type_name(key) + "'");
  }
  return undefined(std::string(type_name(obj)) + " object has no element " + repr(key, 200));
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Calls: argument binding, methods of str, dict and list, the globals, macros, loop.

namespace {

struct Args {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;
};

using Bound = std::vector<std::optional<Value>>;

/// Binds `a` to the parameters `names` of `fname` as Python would (positional, then by
/// keyword unless kw_ok is false); the first `required` must be given.
Bound bind(const Args& a, const std::string& fname, std::initializer_list<std::string_view> names, size_t required,
           bool kw_ok = true) {
  Bound r(names.size());
  if (a.pos.size() > names.size())
    fail(fname + "() takes at most " + std::to_string(names.size()) + " argument(s) (" + std::to_string(a.pos.size()) + " given)");
  for (size_t i = 0; i < a.pos.size(); i++) r[i] = a.pos[i];
  if (!kw_ok && !a.kw.empty()) fail(fname + "() takes no keyword arguments");
  for (const auto& [k, v] : a.kw) {
    auto it = std::find(names.begin(), names.end(), k);
    if (it == names.end()) fail(fname + "() got an unexpected keyword argument '" + k + "'");
    auto& slot = r[size_t(it - names.begin())];
    if (slot) fail(fname + "() got multiple values for argument '" + k + "'");
    slot = v;
  }
  for (size_t i = 0; i < required; i++)
    if (!r[i]) fail(fname + "() missing required argument '" + std::string(names.begin()[i]) + "'");
  return r;
}

bool given(const std::optional<Value>& v) { return v && v->kind() != Kind::None; }

int64_t want_int(const Value& v, const std::string& what) {
  if (!is_intlike(v)) fail(what + ": '" + type_name(v) + "' object cannot be interpreted as an integer");
  return I(v);
}

const std::string& want_str(const Value& v, const std::string& what) {
  if (v.kind() != Kind::String) fail(what + " must be str, not " + type_name(v));
  return S(v);
}

struct MethodFn final : FnHeap {
  Value self;
  Value call(Ctx& c, Args& a) const override;
};

struct BuiltinFn final : FnHeap {
  Value (*impl)(Ctx&, Args&) = nullptr;
  Value call(Ctx& c, Args& a) const override { return impl(c, a); }
};

bool listed(std::string_view names, const std::string& n) {
  for (size_t p = 0; p < names.size();) {
    size_t e = names.find(' ', p);
    if (e == std::string_view::npos) e = names.size();
    if (names.substr(p, e - p) == n) return true;
    p = e + 1;
  }
  return false;
}

constexpr std::string_view kStrDone =
    "startswith endswith split rsplit strip lstrip rstrip upper lower title capitalize replace find rfind index rindex "
    "count join isdigit isalpha isalnum isspace islower isupper isnumeric isdecimal splitlines removeprefix removesuffix";
constexpr std::string_view kStrOther =
    "casefold center encode expandtabs format format_map isascii isidentifier isprintable istitle ljust maketrans "
    "partition rjust rpartition swapcase translate zfill";
constexpr std::string_view kDictDone = "get items keys values";
constexpr std::string_view kDictOther = "copy fromkeys";
constexpr std::string_view kDictUnsafe = "clear pop popitem setdefault update";
constexpr std::string_view kListDone = "count index";
constexpr std::string_view kListOther = "copy";
constexpr std::string_view kListUnsafe = "append clear extend insert pop remove reverse sort";

/// The bound method self.name, or Undefined if the type has no such attribute.
Value method(const Value& self, const std::string& name) {
  bool ok = false;
  if (self.kind() == Kind::String) ok = listed(kStrDone, name) || listed(kStrOther, name);
  if (self.kind() == Kind::Object) ok = listed(kDictDone, name) || listed(kDictOther, name) || listed(kDictUnsafe, name);
  if (self.kind() == Kind::Array) ok = listed(kListDone, name) || listed(kListOther, name) || listed(kListUnsafe, name);
  if (!ok) return Value();
  auto m = std::make_shared<MethodFn>();
  m->name = std::string(self.kind() == Kind::String ? "str" : self.kind() == Kind::Object ? "dict" : "list") + "." + name;
  m->self = self;
  return Access::make(Kind::Function, std::move(m));
}

// String algorithms with Python's results.

std::vector<std::string> split_ws(std::string_view s, int64_t maxsplit, bool from_right) {
  auto cps = to_cps(s);
  if (from_right) std::reverse(cps.begin(), cps.end());
  std::vector<std::string> r;
  size_t i = 0;
  const size_t n = cps.size();
  while (true) {
    while (i < n && py_space(cps[i])) i++;
    if (i >= n) break;
    if (maxsplit >= 0 && int64_t(r.size()) == maxsplit) {
      size_t e = n;
      if (!from_right) {
        r.push_back(from_cps(cps.data() + i, cps.data() + e));
      } else {
        std::vector<char32_t> rest(cps.begin() + std::ptrdiff_t(i), cps.end());
        std::reverse(rest.begin(), rest.end());
        r.push_back(from_cps(rest.data(), rest.data() + rest.size()));
      }
      break;
    }
    size_t j = i;
    while (j < n && !py_space(cps[j])) j++;
    std::vector<char32_t> w(cps.begin() + std::ptrdiff_t(i), cps.begin() + std::ptrdiff_t(j));
    if (from_right) std::reverse(w.begin(), w.end());
    r.push_back(from_cps(w.data(), w.data() + w.size()));
    i = j;
  }
  if (from_right) std::reverse(r.begin(), r.end());
  return r;
}

std::vector<std::string> split_sep(std::string_view s, std::string_view sep, int64_t maxsplit, bool from_right) {
  if (sep.empty()) fail("empty separator");
  std::vector<std::string> r;
  if (!from_right) {
    size_t p = 0;
    while (maxsplit < 0 || int64_t(r.size()) < maxsplit) {
      const size_t f = s.find(sep, p);
      if (f == std::string_view::npos) break;
      r.emplace_back(s.substr(p, f - p));
      p = f + sep.size();
    }
    r.emplace_back(s.substr(p));
    return r;
  }
  size_t e = s.size();
  while (maxsplit < 0 || int64_t(r.size()) < maxsplit) {
    if (e < sep.size()) break;
    const size_t f = s.rfind(sep, e - sep.size());
    if (f == std::string_view::npos) break;
    r.emplace_back(s.substr(f + sep.size(), e - f - sep.size()));
    e = f;
  }
  r.emplace_back(s.substr(0, e));
  std::reverse(r.begin(), r.end());
  return r;
}

/// str.replace(old, new, count): an empty `old` inserts `new` around every character.
std::string py_replace(Ctx& c, std::string_view s, std::string_view old, std::string_view rep, int64_t count) {
  std::string out;
  auto add = [&](std::string_view x) {
    if (out.size() + x.size() > c.cap()) c.charge(SIZE_MAX);
    out += x;
  };
  if (old.empty()) {
    const CpIndex cps(s);
    int64_t done = 0;
    for (size_t i = 0; i <= cps.size(); i++) {
      if (count < 0 || done < count) add(rep), done++;
      if (i < cps.size()) add(cps.sub(i, i + 1));
    }
    return out;
  }
  size_t p = 0;
  for (int64_t done = 0; count < 0 || done < count; done++) {
    const size_t f = s.find(old, p);
    if (f == std::string_view::npos) break;
    add(s.substr(p, f - p));
    add(rep);
    p = f + old.size();
    c.step();
  }
  add(s.substr(p));
  return out;
}

/// [b, e) in code points for the optional start/end arguments of find, count, startswith.
std::pair<size_t, size_t> cp_range(const CpIndex& cps, const std::optional<Value>& start, const std::optional<Value>& end) {
  const int64_t n = int64_t(cps.size());
  auto adj = [&](const std::optional<Value>& v, int64_t dflt) {
    if (!given(v)) return dflt;
    int64_t x = slice_bound(*v);
    if (x < 0) x = std::max<int64_t>(x + n, 0);
    return std::min(x, n);
  };
  const int64_t b = adj(start, 0), e = adj(end, n);
  return {size_t(b), size_t(std::max(b, e))};
}

size_t cp_of_byte(const CpIndex& cps, size_t byte) {
  if (cps.ascii) return byte;
  return size_t(std::lower_bound(cps.off.begin(), cps.off.end(), byte) - cps.off.begin());
}

Value str_find(const std::string& self, const Bound& v, bool right) {
  const std::string& sub = want_str(*v[0], "find() argument");
  const CpIndex cps(self);
  auto [b, e] = cp_range(cps, v[1], v[2]);
  if (int64_t(b) > int64_t(cps.size())) return Value(int64_t(-1));
  const std::string_view hay = cps.sub(b, e);
  const size_t f = right ? hay.rfind(sub) : hay.find(sub);
  if (f == std::string_view::npos) return Value(int64_t(-1));
  return Value(int64_t(cp_of_byte(cps, cps.at(b) + f)));
}

Value str_count(const std::string& self, const Bound& v) {
  const std::string& sub = want_str(*v[0], "count() argument");
  const CpIndex cps(self);
  auto [b, e] = cp_range(cps, v[1], v[2]);
  if (sub.empty()) return Value(int64_t(e - b + 1));
  const std::string_view hay = cps.sub(b, e);
  int64_t n = 0;
  for (size_t p = hay.find(sub); p != std::string_view::npos; p = hay.find(sub, p + sub.size())) n++;
  return Value(n);
}

Value str_affix(Ctx& c, const std::string& self, const Bound& v, bool start) {
  const CpIndex cps(self);
  auto [b, e] = cp_range(cps, v[1], v[2]);
  const std::string_view s = int64_t(b) > int64_t(cps.size()) ? std::string_view() : cps.sub(b, e);
  auto test = [&](const Value& p) {
    const std::string& x = want_str(p, std::string(start ? "startswith" : "endswith") + " first arg");
    if (s.size() < x.size()) return false;
    return start ? s.substr(0, x.size()) == x : s.substr(s.size() - x.size()) == x;
  };
  if (v[0]->kind() == Kind::Array && A(*v[0]).tuple) {
    for (const auto& p : items(*v[0]))
      if (test(p)) return Value(true);
    return Value(false);
  }
  if (v[0]->kind() != Kind::String)
    fail(std::string(start ? "startswith" : "endswith") + " first arg must be str or a tuple of str, not " + type_name(*v[0]));
  (void)c;
  return Value(test(*v[0]));
}

Value str_list(Ctx& c, const std::vector<std::string>& parts) {
  std::vector<Value> r;
  for (const auto& p : parts) r.push_back(new_str(c, p));
  return new_array(c, std::move(r));
}

bool cps_all(std::string_view s, const std::function<bool(char32_t)>& f) {
  if (s.empty()) return false;
  for (char32_t c : to_cps(s))
    if (!f(c)) return false;
  return true;
}

Value str_is(const std::string& name, const std::string& s) {
  using unicode::Category;
  auto cat = cp_flags;
  if (name == "isdigit" || name == "isdecimal") return Value(cps_all(s, [&](char32_t c) { return cat(c) & unicode::flag(Category::Nd); }));
  if (name == "isnumeric") return Value(cps_all(s, [&](char32_t c) { return cat(c) & unicode::kNumber; }));
  if (name == "isalpha") return Value(cps_all(s, [&](char32_t c) { return cat(c) & unicode::kLetter; }));
  if (name == "isalnum") return Value(cps_all(s, [&](char32_t c) { return cat(c) & (unicode::kLetter | unicode::kNumber); }));
  if (name == "isspace") return Value(cps_all(s, py_space));
  bool cased = false, lower = true, upper = true;  // Lt breaks both
  for (char32_t c : to_cps(s)) {
    const uint32_t f = cp_flags(c);
    const bool lt = f & unicode::flag(Category::Lt);
    const bool lu = (f & unicode::flag(Category::Lu)) || (!lt && !(f & unicode::flag(Category::Ll)) && to_lower(c) != c);
    const bool ll = (f & unicode::flag(Category::Ll)) || (!lt && !lu && to_upper(c) != c);
    if (lu || ll || lt) cased = true;
    if (lu || lt) lower = false;
    if (ll || lt) upper = false;
  }
  return Value(cased && (name == "islower" ? lower : upper));
}

std::vector<std::string> split_lines(std::string_view s, bool keepends) {
  std::vector<std::string> r;
  const CpIndex cps(s);
  size_t start = 0;
  for (size_t i = 0; i < cps.size(); i++) {
    size_t n;
    const char32_t c = decode_at(s, cps.at(i), &n);
    const bool brk = c == '\n' || c == '\r' || c == 0x0b || c == 0x0c || (c >= 0x1c && c <= 0x1e) || c == 0x85 ||
                     c == 0x2028 || c == 0x2029;
    if (!brk) continue;
    size_t end = i + 1;
    if (c == '\r' && end < cps.size() && s[cps.at(end)] == '\n') end++;
    r.emplace_back(cps.sub(start, keepends ? end : i));
    start = end;
    i = end - 1;
  }
  if (start < cps.size()) r.emplace_back(cps.sub(start, cps.size()));
  return r;
}

Value str_method(Ctx& c, const std::string& s, const std::string& name, const Args& a) {
  const std::string fn = name;
  if (name == "startswith" || name == "endswith") return str_affix(c, s, bind(a, fn, {"prefix", "start", "end"}, 1, false), name == "startswith");
  if (name == "split" || name == "rsplit") {
    auto v = bind(a, fn, {"sep", "maxsplit"}, 0);
    const int64_t maxsplit = v[1] ? want_int(*v[1], fn) : -1;
    const bool right = name == "rsplit";
    return str_list(c, given(v[0]) ? split_sep(s, want_str(*v[0], "sep"), maxsplit, right) : split_ws(s, maxsplit, right));
  }
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    auto v = bind(a, fn, {"chars"}, 0, false);
    const std::string* chars = given(v[0]) ? &want_str(*v[0], fn + " arg") : nullptr;
    return new_str(c, str_strip(s, chars, name != "rstrip", name != "lstrip"));
  }
  if (name == "upper" || name == "lower" || name == "title" || name == "capitalize") {
    bind(a, fn, {}, 0, false);
    return new_str(c, name == "upper" ? str_upper(s) : name == "lower" ? str_lower(s) : name == "title" ? str_title(s) : str_capitalize(s));
  }
  if (name == "replace") {
    auto v = bind(a, fn, {"old", "new", "count"}, 2, false);
    const int64_t count = v[2] ? want_int(*v[2], fn) : -1;
    return new_str(c, py_replace(c, s, want_str(*v[0], "replace() argument 1"), want_str(*v[1], "replace() argument 2"), count));
  }
  if (name == "find" || name == "rfind" || name == "index" || name == "rindex") {
    Value r = str_find(s, bind(a, fn, {"sub", "start", "end"}, 1, false), name[0] == 'r');
    if (I(r) < 0 && name.find("index") != std::string::npos) fail("substring not found");
    return r;
  }
  if (name == "count") return str_count(s, bind(a, fn, {"sub", "start", "end"}, 1, false));
  if (name == "join") {
    auto v = bind(a, fn, {"iterable"}, 1, false);
    std::string out;
    const auto parts = iterate(c, *v[0]);
    for (size_t i = 0; i < parts.size(); i++) {
      if (parts[i].kind() != Kind::String)
        fail("sequence item " + std::to_string(i) + ": expected str instance, " + type_name(parts[i]) + " found");
      if (out.size() + s.size() + S(parts[i]).size() > c.cap()) c.charge(SIZE_MAX);
      if (i) out += s;
      out += S(parts[i]);
    }
    return new_str(c, std::move(out));
  }
  if (name.compare(0, 2, "is") == 0) {
    bind(a, fn, {}, 0, false);
    return str_is(name, s);
  }
  if (name == "splitlines") {
    auto v = bind(a, fn, {"keepends"}, 0);
    return str_list(c, split_lines(s, v[0] && truthy(*v[0])));
  }
  auto v = bind(a, fn, {"affix"}, 1, false);  // removeprefix, removesuffix
  const std::string& x = want_str(*v[0], fn + "() argument");
  const bool pre = name == "removeprefix";
  if (s.size() >= x.size() && (pre ? s.compare(0, x.size(), x) == 0 : s.compare(s.size() - x.size(), x.size(), x) == 0))
    return new_str(c, pre ? s.substr(x.size()) : s.substr(0, s.size() - x.size()));
  return make_str(s);
}

Value dict_method(Ctx& c, const Value& self, const std::string& name, const Args& a) {
  const Object& o = O(self);
  if (name == "get") {
    auto v = bind(a, "get", {"key", "default"}, 1, false);
    if (v[0]->kind() == Kind::Array || v[0]->kind() == Kind::Object) fail(std::string("unhashable type: '") + type_name(*v[0]) + "'");
    const Value* x = v[0]->kind() == Kind::String ? o.find(S(*v[0])) : nullptr;
    return x ? *x : v[1] ? *v[1] : Value(nullptr);
  }
  bind(a, name, {}, 0, false);
  std::vector<Value> r;
  for (const auto& e : o.entries) {
    if (name == "items") r.push_back(tuple2(make_str(e.first), e.second));
    if (name == "keys") r.push_back(make_str(e.first));
    if (name == "values") r.push_back(e.second);
  }
  return new_array(c, std::move(r));
}

Value list_method(Ctx& c, const Value& self, const std::string& name, const Args& a) {
  auto v = bind(a, name, {"value"}, 1, false);
  int64_t n = 0;
  const auto& xs = items(self);
  for (size_t i = 0; i < xs.size(); i++) {
    if (!eq(c, xs[i], *v[0])) continue;
    if (name == "index") return Value(int64_t(i));
    n++;
  }
  if (name == "index") fail(repr(*v[0], 200) + " is not in list");
  return Value(n);
}

Value MethodFn::call(Ctx& c, Args& a) const {
  const std::string m = name.substr(name.find('.') + 1);
  const char* type = self.kind() == Kind::String ? "str" : self.kind() == Kind::Object ? "dict" : "list";
  if (listed(kDictUnsafe, m) && self.kind() == Kind::Object) fail("access to attribute '" + m + "' of 'dict' object is unsafe.");
  if (listed(kListUnsafe, m) && self.kind() == Kind::Array) fail("access to attribute '" + m + "' of 'list' object is unsafe.");
  if (self.kind() == Kind::String && listed(kStrDone, m)) return str_method(c, S(self), m, a);
  if (self.kind() == Kind::Object && listed(kDictDone, m)) return dict_method(c, self, m, a);
  if (self.kind() == Kind::Array && listed(kListDone, m)) return list_method(c, self, m, a);
  fail(std::string(type) + "." + m + "() is not supported");
}

// The globals.

std::string strftime_now(const RenderOptions& o, const std::string& fmt) {
  std::tm t{};
  if (o.now) {
    t = *o.now;
    const time_t tt = timegm(&t);
    gmtime_r(&tt, &t);
  } else {
    const time_t now = time(nullptr);
    localtime_r(&now, &t);
  }
  std::string f;  // Python's datetime.strftime: %f is the microseconds, %z and %Z empty (naive time)
  for (size_t i = 0; i < fmt.size(); i++) {
    if (fmt[i] != '%' || i + 1 >= fmt.size()) {
      f += fmt[i];
    } else if (fmt[++i] == 'f') {
      f += "000000";
    } else if (fmt[i] != 'z' && fmt[i] != 'Z') {
      f += '%', f += fmt[i];
    }
  }
  if (f.empty()) return f;
  std::string buf(256 + f.size() * 64, '\0');
  const size_t n = std::strftime(buf.data(), buf.size(), f.c_str(), &t);
  buf.resize(n);
  return buf;
}

Value g_range(Ctx& c, Args& a) {
  if (!a.kw.empty()) fail("range() takes no keyword arguments");
  if (a.pos.empty() || a.pos.size() > 3) fail("range expected 1 to 3 arguments, got " + std::to_string(a.pos.size()));
  int64_t v[3] = {0, 0, 1};
  for (size_t i = 0; i < a.pos.size(); i++) v[a.pos.size() == 1 ? 1 : i] = want_int(a.pos[i], "range()");
  const int64_t start = v[0], stop = v[1], step = v[2];
  if (step == 0) fail("range() arg 3 must not be zero");
  const uint64_t ustep = step > 0 ? uint64_t(step) : uint64_t(-(step + 1)) + 1;  // |step|, INT64_MIN too
  uint64_t n = 0;
  if (step > 0 && start < stop) n = (uint64_t(stop) - uint64_t(start) - 1) / ustep + 1;
  if (step < 0 && start > stop) n = (uint64_t(start) - uint64_t(stop) - 1) / ustep + 1;
  if (n > uint64_t(kMaxRange)) fail("Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
  std::vector<Value> r;
  for (int64_t i = 0; i < int64_t(n); i++) r.push_back(Value(start + i * step));
  return new_array(c, std::move(r));
}

/// dict(*args, **kwargs): a dict or a list of pairs, then the keywords.
Object dict_args(Ctx& c, const Args& a, const char* fname) {
  Object o;
  if (a.pos.size() > 1) fail(std::string(fname) + " expected at most 1 argument, got " + std::to_string(a.pos.size()));
  if (!a.pos.empty() && a.pos[0].kind() == Kind::Object) {
    o = O(a.pos[0]);
  } else if (!a.pos.empty()) {
    for (const auto& p : iterate(c, a.pos[0])) {
      const auto kv = iterate(c, p);
      if (kv.size() != 2) fail("dictionary update sequence element has length " + std::to_string(kv.size()) + "; 2 is required");
      if (kv[0].kind() != Kind::String) fail("dict keys other than strings are not supported");
      o.set(S(kv[0]), kv[1]);
    }
  }
  for (const auto& [k, v] : a.kw) o.set(k, v);
  return o;
}

Value g_dict(Ctx& c, Args& a) { return make_object(dict_args(c, a, "dict")); }

/// namespace(...), as transformers' TemplateNamespace (no underscore-prefixed attributes).
Value g_namespace(Ctx& c, Args& a) {
  auto ns = std::make_shared<NsHeap>();
  ns->attrs = dict_args(c, a, "namespace");
  for (const auto& e : ns->attrs.entries)
    if (!e.first.empty() && e.first[0] == '_')
      fail("Chat templates cannot store underscore-prefixed attributes on a namespace, but got '" + e.first + "'. Please rename the attribute.");
  c.namespaces.push_back(ns);
  return Access::make(Kind::Namespace, std::move(ns));
}

Value g_raise_exception(Ctx& c, Args& a) {
  auto v = bind(a, "raise_exception", {"message"}, 1);
  throw Raised{str_of(c, *v[0])};
}

Value g_strftime_now(Ctx& c, Args& a) {
  auto v = bind(a, "strftime_now", {"format"}, 1);
  return new_str(c, strftime_now(c.opt, want_str(*v[0], "strftime_now() argument")));
}

Value g_unsupported(Ctx&, Args&) { fail("lipsum, cycler and joiner are not supported"); }

const std::vector<std::pair<std::string, Value>>& globals() {
  static const std::vector<std::pair<std::string, Value>> g = [] {
    std::vector<std::pair<std::string, Value>> r;
    auto add = [&](const char* name, Value (*impl)(Ctx&, Args&)) {
      auto f = std::make_shared<BuiltinFn>();
      f->name = name, f->impl = impl;
      r.emplace_back(name, Access::make(Kind::Function, std::move(f)));
    };
    add("range", g_range), add("dict", g_dict), add("namespace", g_namespace);
    add("raise_exception", g_raise_exception), add("strftime_now", g_strftime_now);
    add("lipsum", g_unsupported), add("cycler", g_unsupported), add("joiner", g_unsupported);
    return r;
  }();
  return g;
}

Value lookup(Ctx& c, const Scope* s, const std::string& name) {
  for (; s; s = s->parent.get())
    if (const Value* v = s->find(name)) return *v;
  if (const Value* v = c.context.find(name)) return *v;
  for (const auto& g : globals())
    if (g.first == name) return g.second;
  return undefined("'" + name + "' is undefined");
}

// Macros, call blocks and the loop object.

std::string run_body(Ctx& c, const Body& body, const ScopeP& scope);
Value eval(const Expr& e, Ctx& c, const ScopeP& s);

struct MacroFn final : FnHeap {
  const Stmt* def = nullptr;  // SK::Macro or SK::CallBlock (then this is `caller`)
  ScopeP closure;
  Value call(Ctx& c, Args& a) const override;
};

Value MacroFn::call(Ctx& c, Args& a) const {
  DepthGuard g(c);
  const auto& ps = def->params;
  auto scope = child_scope(closure);
  std::vector<bool> have(ps.size());
  std::vector<Value> extra;
  for (size_t i = 0; i < a.pos.size(); i++) {
    if (i < ps.size()) {
      scope->set(ps[i].name, a.pos[i]), have[i] = true;
    } else {
      extra.push_back(a.pos[i]);
    }
  }
  if (!extra.empty() && !def->varargs)
    fail("macro '" + name + "' takes not more than " + std::to_string(ps.size()) + " argument(s)");
  Object extra_kw;
  bool has_caller = false;
  for (const auto& [k, v] : a.kw) {
    const std::string& key = k;  // (clang 14 cannot capture a structured binding)
    auto it = std::find_if(ps.begin(), ps.end(), [&](const Param& p) { return p.name == key; });
    if (it != ps.end()) {
      const size_t i = size_t(it - ps.begin());
      if (have[i]) fail("macro '" + name + "' got multiple values for argument '" + k + "'");
      scope->set(k, v), have[i] = true;
    } else if (k == "caller" && def->caller) {
      scope->set(k, v), has_caller = true;
    } else if (def->kwargs) {
      extra_kw.set(k, v);
    } else {
      fail("macro '" + name + "' takes no keyword argument '" + k + "'");
    }
  }
  for (size_t i = 0; i < ps.size(); i++)
    if (!have[i]) scope->set(ps[i].name, ps[i].def ? eval(*ps[i].def, c, scope) : undefined("parameter '" + ps[i].name + "' was not provided"));
  if (def->varargs) scope->set("varargs", make_array(std::move(extra), true));
  if (def->kwargs) scope->set("kwargs", make_object(std::move(extra_kw)));
  if (def->caller && !has_caller) scope->set("caller", undefined("No caller defined"));
  return make_str(run_body(c, def->body, scope));
}

Value make_macro(Ctx& c, const Stmt& def, const ScopeP& scope) {
  if (c.closures.size() >= size_t(kMaxClosures)) fail("too many macros defined in one render");
  if (c.closures.empty() || c.closures.back() != scope) c.closures.push_back(scope);
  auto m = std::make_shared<MacroFn>();
  m->name = def.kind == SK::Macro ? def.text : "caller";
  m->def = &def, m->closure = scope;
  return Access::make(Kind::Function, std::move(m));
}

struct CycleFn final : FnHeap {
  int64_t index0 = 0;
  Value call(Ctx&, Args& a) const override {
    if (!a.kw.empty()) fail("cycle() takes no keyword arguments");
    if (a.pos.empty()) fail("no items for cycling given");
    return a.pos[size_t(index0 % int64_t(a.pos.size()))];
  }
};

Value loop_attr(Ctx&, const Value& loop, const std::string& name) {
  const auto& l = LOOP(loop);
  const int64_t n = int64_t(l.items->size()), i = l.index0;
  if (name == "index") return Value(i + 1);
  if (name == "index0") return Value(i);
  if (name == "revindex") return Value(n - i);
  if (name == "revindex0") return Value(n - i - 1);
  if (name == "first") return Value(i == 0);
  if (name == "last") return Value(i == n - 1);
  if (name == "length") return Value(n);
  if (name == "depth") return Value(int64_t(1));
  if (name == "depth0") return Value(int64_t(0));
  if (name == "previtem") return i > 0 ? (*l.items)[size_t(i - 1)] : undefined("there is no previous item");
  if (name == "nextitem") return i + 1 < n ? (*l.items)[size_t(i + 1)] : undefined("there is no next item");
  if (name == "cycle") {
    auto f = std::make_shared<CycleFn>();
    f->name = "cycle", f->index0 = i;
    return Access::make(Kind::Function, std::move(f));
  }
  if (name == "changed") fail("loop.changed is not supported");
  return undefined("'LoopContext object' has no attribute '" + name + "'");
}

Value call_value(Ctx& c, const Value& f, Args& a) {
  if (f.kind() == Kind::Function) return FN(f).call(c, a);
  if (f.kind() == Kind::Undefined) fail_undefined(f);
  fail(std::string("'") + type_name(f) + "' object is not callable");
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Filters (jinja2's filters.py) and tests (tests.py).

namespace {

Value apply_filter(Ctx& c, const std::string& name, const Value& v, const Args& a);
bool apply_test(Ctx& c, const std::string& name, const Value& v, const Args& a);

/// make_attrgetter: "a.b.0" looked up part by part with getitem (digits as integers).
Value attr_path(Ctx& c, Value item, const Value& attribute, const std::optional<Value>& dflt = std::nullopt) {
  std::vector<Value> parts;
  if (attribute.kind() == Kind::String) {
    for (const auto& p : split_sep(S(attribute), ".", -1, false)) {
      const bool digits = !p.empty() && std::all_of(p.begin(), p.end(), is_digit);
      parts.push_back(digits && p.size() < 18 ? Value(std::stoll(p)) : make_str(p));
    }
  } else {
    parts.push_back(attribute);
  }
  for (const auto& p : parts) {
    item = get_item(c, item, p);
    if (dflt && dflt->kind() != Kind::None && item.is_undefined()) item = *dflt;
  }
  return item;
}

Value lower_if_str(Ctx& c, const Value& v) { return v.kind() == Kind::String ? new_str(c, str_lower(S(v))) : v; }

Value f_abs(Ctx&, const Value& v, const Args& a) {
  bind(a, "abs", {}, 0);
  if (v.kind() == Kind::Float) return Value(std::fabs(Access::f(v)));
  if (!is_intlike(v)) fail(std::string("bad operand type for abs(): '") + type_name(v) + "'");
  if (I(v) == INT64_MIN) fail_overflow();
  return Value(I(v) < 0 ? -I(v) : I(v));
}

Value f_attr(Ctx& c, const Value& v, const Args& a) {
  auto b = bind(a, "attr", {"name"}, 1);
  const std::string& name = want_str(*b[0], "attribute name");
  if (v.kind() == Kind::Undefined) fail_undefined(v);
  if (v.kind() == Kind::Namespace || v.kind() == Kind::Loop) return get_attr(c, v, name);
  Value m = method(v, name);
  return m.is_undefined() ? undefined(std::string("'") + type_name(v) + " object' has no attribute '" + name + "'") : m;
}

Value f_case(Ctx& c, const Value& v, const Args& a, std::string (*f)(std::string_view), const char* name) {
  bind(a, name, {}, 0);
  return new_str(c, f(str_of(c, v)));
}
Value f_capitalize(Ctx& c, const Value& v, const Args& a) { return f_case(c, v, a, str_capitalize, "capitalize"); }
Value f_upper(Ctx& c, const Value& v, const Args& a) { return f_case(c, v, a, str_upper, "upper"); }
Value f_lower(Ctx& c, const Value& v, const Args& a) { return f_case(c, v, a, str_lower, "lower"); }

/// jinja2's title filter: each run of characters other than -, whitespace, (, {, [, < starts
/// upper-case and continues lower-case.
std::string jinja_title(std::string_view s) {
  const auto cps = to_cps(s);
  std::string out;
  auto sep = [](char32_t ch) { return ch == '-' || ch == '(' || ch == '{' || ch == '[' || ch == '<' || py_space(ch); };
  for (size_t i = 0; i < cps.size();) {
    size_t j = i;
    while (j < cps.size() && sep(cps[i]) == sep(cps[j])) j++;
    if (sep(cps[i])) {
      out += from_cps(cps.data() + i, cps.data() + j);
    } else {
      append_upper(out, cps[i]);
      out += str_lower(from_cps(cps.data() + i + 1, cps.data() + j));
    }
    i = j;
  }
  return out;
}
Value f_title(Ctx& c, const Value& v, const Args& a) { return f_case(c, v, a, jinja_title, "title"); }

Value f_center(Ctx& c, const Value& v, const Args& a) {
  auto b = bind(a, "center", {"width"}, 0);
  const std::string s = str_of(c, v);
  const int64_t w = b[0] ? want_int(*b[0], "center()") : 80, n = int64_t(cp_count(s));
  if (w <= n) return new_str(c, s);
  if (uint64_t(w) > c.cap()) c.charge(SIZE_MAX);
  const int64_t pad = w - n, left = pad / 2 + (pad & w & 1);
  return new_str(c, std::string(size_t(left), ' ') + s + std::string(size_t(pad - left), ' '));
}

Value f_length(Ctx&, const Value& v, const Args& a) {
  bind(a, "length", {}, 0);
  switch (v.kind()) {
    case Kind::Undefined: return Value(int64_t(0));
    case Kind::String: return Value(int64_t(cp_count(S(v))));
    case Kind::Array: return Value(int64_t(items(v).size()));
    case Kind::Object: return Value(int64_t(O(v).entries.size()));
    case Kind::Loop: return Value(int64_t(LOOP(v).items->size()));
    default: fail(std::string("object of type '") + type_name(v) + "' has no len()");
  }
}

Value f_default(Ctx& c, const Value& v, const Args& a) {
  auto b = bind(a, "default", {"default_value", "boolean"}, 0);
  if (v.is_undefined() || (b[1] && truthy(*b[1]) && !truthy(v))) return b[0] ? *b[0] : new_str(c, "");
  return v;
}

Value f_dictsort(Ctx& c, const Value& v, const Args& a) {
  auto b = bind(a, "dictsort", {"case_sensitive", "by", "reverse"}, 0);
  if (v.kind() != Kind::Object) fail(std::string("'") + type_name(v) + "' object has no attribute 'items'");
  const bool cs = b[0] && truthy(*b[0]), rev = b[2] && truthy(*b[2]);
  const std::string by = b[1] ? str_of(c, *b[1]) : "key";
  if (by != "key" && by != "value") fail("You can only sort by either \"key\" or \"value\"");
  std::vector<Value> pairs;
  for (const auto& e : O(v).entries) pairs.push_back(tuple2(make_str(e.first), e.second));
  auto key = [&](const Value& p) { return cs ? items(p)[by == "key" ? 0 : 1] : lower_if_str(c, items(p)[by == "key" ? 0 : 1]); };
  std::stable_sort(pairs.begin(), pairs.end(), [&](const Value& x, const Value& y) {
    return rev ? order(c, key(y), key(x)) == -1 : order(c, key(x), key(y)) == -1;
  });
  return new_array(c, std::move(pairs));
}

Value f_escape(Ctx& c, const Value& v, const Args& a) {
  bind(a, "escape", {}, 0);
  std::string out;
  for (char ch : str_of(c, v)) {
    switch (ch) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out += ch;
    }
  }
  return new_str(c, std::move(out));
}

Value f_first_last(Ctx& c, const Value& v, const Args& a, bool last) {
  bind(a, last ? "last" : "first", {}, 0);
  std::vector<Value> xs = v.kind() == Kind::Array ? std::vector<Value>() : iterate(c, v);
  const auto& seq = v.kind() == Kind::Array ? items(v) : xs;
  if (seq.empty()) return undefined(last ? "No last item, sequence was empty." : "No first item, sequence was empty.");
  return last ? seq.back() : seq.front();
}
Value f_first(Ctx& c, const Value& v, const Args& a) { return f_first_last(c, v, a, false); }
Value f_last(Ctx& c, const Value& v, const Args& a) { return f_first_last(c, v, a, true); }

/// Digits with single underscores between them (Python's numeric literal rule).
bool digit_groups(std::string_view s, int base) {
  if (s.empty() || s.front() == '_' || s.back() == '_') return false;
  for (size_t i = 0; i < s.size(); i++) {
    if (s[i] == '_') {
      if (s[i + 1] == '_') return false;
      continue;
    }
    const int d = hex_val(s[i]);
    if (d < 0 || d >= base) return false;
  }
  return true;
}

/// Python's float(str): None if it is not a float literal.
std::optional<double> parse_py_float(std::string_view raw) {
  const std::string s = str_strip(raw, nullptr, true, true);
  std::string t = str_lower(s);
  std::string_view body = t;
  const bool neg = !body.empty() && body[0] == '-';
  if (!body.empty() && (body[0] == '+' || body[0] == '-')) body.remove_prefix(1);
  if (body == "inf" || body == "infinity") return neg ? -INFINITY : INFINITY;
  if (body == "nan") return NAN;
  const size_t e = body.find('e');
  const std::string_view mant = body.substr(0, e), expo = e == std::string_view::npos ? "" : body.substr(e + 1);
  const size_t dot = mant.find('.');
  const std::string_view ip = mant.substr(0, dot), fp = dot == std::string_view::npos ? "" : mant.substr(dot + 1);
  if (ip.empty() && fp.empty()) return std::nullopt;
  if ((!ip.empty() && !digit_groups(ip, 10)) || (!fp.empty() && !digit_groups(fp, 10))) return std::nullopt;
  if (e != std::string_view::npos) {
    std::string_view x = expo;
    if (!x.empty() && (x[0] == '+' || x[0] == '-')) x.remove_prefix(1);
    if (!digit_groups(x, 10)) return std::nullopt;
  }
  std::string clean;
  for (char ch : t)
    if (ch != '_') clean += ch;
  return std::strtod(clean.c_str(), nullptr);
}

/// Python's int(str, base): None if it is not an integer literal in that base.
std::optional<int64_t> parse_py_int(std::string_view raw, int base) {
  const std::string s = str_strip(raw, nullptr, true, true);
  std::string_view b = s;
  const bool neg = !b.empty() && b[0] == '-';
  if (!b.empty() && (b[0] == '+' || b[0] == '-')) b.remove_prefix(1);
  if (b.size() > 1 && b[0] == '0') {
    const char p = char(b[1] | 0x20);
    const int pb = p == 'x' ? 16 : p == 'o' ? 8 : p == 'b' ? 2 : 0;
    if (pb && (base == 0 || base == pb)) base = pb, b.remove_prefix(2), b = !b.empty() && b[0] == '_' ? b.substr(1) : b;
  }
  if (base == 0) {
    base = 10;
    if (b.size() > 1 && b[0] == '0' && b.find_first_not_of("0_") != std::string_view::npos) return std::nullopt;
  }
  if (base < 2 || base > 36 || !digit_groups(b, base)) return std::nullopt;
  std::string digits;
  for (char ch : b)
    if (ch != '_') digits += ch;
  int64_t v = 0;
  auto r = std::from_chars(digits.data(), digits.data() + digits.size(), v, base);
  if (r.ec != std::errc() || r.ptr != digits.data() + digits.size()) fail_overflow();
  return neg ? -v : v;
}

Value f_int(Ctx&, const Value& v, const Args& a) {
  auto b = bind(a, "int", {"default", "base"}, 0);
  const Value dflt = b[0] ? *b[0] : Value(int64_t(0));
  if (v.kind() == Kind::Undefined) fail_undefined(v);
  if (is_intlike(v)) return Value(I(v));
  if (v.kind() == Kind::Float) {
    const double d = Access::f(v);
    if (std::isnan(d)) return dflt;
    if (std::isinf(d)) fail("cannot convert float infinity to integer");
    if (std::fabs(d) >= 9.2e18) fail_overflow();
    return Value(int64_t(d));
  }
  if (v.kind() != Kind::String) return dflt;
  const int base = b[1] ? int(want_int(*b[1], "int() base")) : 10;
  if (auto i = parse_py_int(S(v), base)) return Value(*i);
  const auto d = parse_py_float(S(v));
  if (!d || std::isnan(*d) || std::isinf(*d)) return dflt;
  if (std::fabs(*d) >= 9.2e18) fail_overflow();
  return Value(int64_t(*d));
}

Value f_float(Ctx&, const Value& v, const Args& a) {
  auto b = bind(a, "float", {"default"}, 0);
  const Value dflt = b[0] ? *b[0] : Value(0.0);
  if (v.kind() == Kind::Undefined) fail_undefined(v);
  if (is_num(v)) return Value(F(v));
  if (v.kind() != Kind::String) return dflt;
  const auto d = parse_py_float(S(v));
  return d ? Value(*d) : dflt;
}

Value f_indent(Ctx& c, const Value& v, const Args& a) {
  auto b = bind(a, "indent", {"width", "first", "blank"}, 0);
  if (v.kind() == Kind::Undefined) fail_undefined(v);
  if (v.kind() != Kind::String) fail(std::string("unsupported operand type(s) for +=: '") + type_name(v) + "' and 'str'");
  std::string ind;
  if (b[0] && b[0]->kind() == Kind::String) {
    ind = S(*b[0]);
  } else {
    const int64_t w = b[0] ? want_int(*b[0], "indent()") : 4;
    if (w > 0 && uint64_t(w) > c.cap()) c.charge(SIZE_MAX);
    ind.assign(size_t(std::max<int64_t>(w, 0)), ' ');
  }
  const auto lines = split_lines(S(v) + "\n", false);
  std::string rv;
  for (size_t i = 0; i < lines.size(); i++) {
    if (i) rv += "\n";
    const bool add = i > 0 && (b[2] && truthy(*b[2]) ? true : !lines[i].empty());
    if (rv.size() + ind.size() + lines[i].size() > c.cap()) c.charge(SIZE_MAX);
    if (add) rv += ind;
    rv += lines[i];
  }
  if (b[1] && truthy(*b[1])) rv = ind + rv;
  return new_str(c, std::move(rv));
}

Value f_items(Ctx& c, const Value& v, const Args& a) {
  bind(a, "items", {}, 0);
  if (v.is_undefined()) return new_array(c, {});
  if (v.kind() != Kind::Object) fail("Can only get item pairs from a mapping.");
  return dict_method(c, v, "items", Args{});
}

Value f_join(Ctx& c, const Value& v, const Args& a) {
  auto b = bind(a, "join", {"d", "attribute"}, 0);
  const std::string d = b[0] ? str_of(c, *b[0]) : "";
  std::string out;
  const auto xs = iterate(c, v);
  for (size_t i = 0; i < xs.size(); i++) {
    const Value x = given(b[1]) ? attr_path(c, xs[i], *b[1]) : xs[i];
    const std::string s = to_str(x, c.cap());
    if (out.size() + d.size() + s.size() > c.cap()) c.charge(SIZE_MAX);
    if (i) out += d;
    out += s;
  }
  return new_str(c, std::move(out));
}

Value f_list(Ctx& c, const Value& v, const Args& a) {
  bind(a, "list", {}, 0);
  return v.kind() == Kind::Array && !A(v).tuple ? v : new_array(c, iterate(c, v));
}

Value f_map(Ctx& c, const Value& v, const Args& a) {
  std::vector<Value> r;
  if (!truthy(v)) return new_array(c, std::move(r));
  const auto xs = iterate(c, v);
  if (a.pos.empty() && std::any_of(a.kw.begin(), a.kw.end(), [](const auto& kv) { return kv.first == "attribute"; })) {
    auto b = bind(a, "map", {"attribute", "default"}, 1);
    for (const auto& x : xs) r.push_back(attr_path(c, x, *b[0], b[1]));
    return new_array(c, std::move(r));
  }
  if (a.pos.empty()) fail("map requires a filter argument");
  const std::string name = want_str(a.pos[0], "map() filter name");
  Args rest{std::vector<Value>(a.pos.begin() + 1, a.pos.end()), a.kw};
  for (const auto& x : xs) r.push_back(apply_filter(c, name, x, rest));
  return new_array(c, std::move(r));
}

Value f_min_max(Ctx& c, const Value& v, const Args& a, bool max) {
  auto b = bind(a, max ? "max" : "min", {"case_sensitive", "attribute"}, 0);
  const auto xs = iterate(c, v);
  if (xs.empty()) return undefined("No aggregated item, sequence was empty.");
  const bool cs = b[0] && truthy(*b[0]);
  auto key = [&](const Value& x) {
    const Value k = given(b[1]) ? attr_path(c, x, *b[1]) : x;
    return cs ? k : lower_if_str(c, k);
  };
  size_t best = 0;
  Value bk = key(xs[0]);
  for (size_t i = 1; i < xs.size(); i++) {
    Value k = key(xs[i]);
    if (order(c, k, bk) == (max ? 1 : -1)) best = i, bk = k;
  }
  return xs[best];
}
Value f_min(Ctx& c, const Value& v, const Args& a) { return f_min_max(c, v, a, false); }
Value f_max(Ctx& c, const Value& v, const Args& a) { return f_min_max(c, v, a, true); }

/// select, reject, selectattr, rejectattr.
Value select_or_reject(Ctx& c, const Value& v, const Args& a, bool select, bool attr) {
  std::vector<Value> r;
  if (!truthy(v)) return new_array(c, std::move(r));
  if (attr && a.pos.empty()) fail("Missing parameter for attribute name");
  const size_t off = attr ? 1 : 0;
  const bool has_test = a.pos.size() > off;
  const std::string test = has_test ? want_str(a.pos[off], "test name") : "";
  Args rest{has_test ? std::vector<Value>(a.pos.begin() + std::ptrdiff_t(off + 1), a.pos.end()) : std::vector<Value>{}, a.kw};
  for (const auto& x : iterate(c, v)) {
    const Value t = attr ? attr_path(c, x, a.pos[0]) : x;
    const bool ok = has_test ? apply_test(c, test, t, rest) : truthy(t);
    if (ok == select) r.push_back(x);
  }
  return new_array(c, std::move(r));
}
Value f_select(Ctx& c, const Value& v, const Args& a) { return select_or_reject(c, v, a, true, false); }
Value f_reject(Ctx& c, const Value& v, const Args& a) { return select_or_reject(c, v, a, false, false); }
Value f_selectattr(Ctx& c, const Value& v, const Args& a) { return select_or_reject(c, v, a, true, true); }
Value f_rejectattr(Ctx& c, const Value& v, const Args& a) { return select_or_reject(c, v, a, false, true); }

Value f_replace(Ctx& c, const Value& v, const Args& a) {
  auto b = bind(a, "replace", {"old", "new", "count"}, 2);
  const int64_t count = given(b[2]) ? want_int(*b[2], "replace() count") : -1;
  return new_str(c, py_replace(c, str_of(c, v), str_of(c, *b[0]), str_of(c, *b[1]), count));
}

Value f_reverse(Ctx& c, const Value& v, const Args& a) {
  bind(a, "reverse", {}, 0);
  if (v.kind() == Kind::String) {
    auto cps = to_cps(S(v));
    std::reverse(cps.begin(), cps.end());
    return new_str(c, from_cps(cps.data(), cps.data() + cps.size()));
  }
  if (v.kind() != Kind::Array && v.kind() != Kind::Object && !v.is_undefined()) fail("argument must be iterable");
  auto xs = iterate(c, v);
  std::reverse(xs.begin(), xs.end());
  return new_array(c, std::move(xs));
}

Value f_round(Ctx& c, const Value& v, const Args& a) {
  auto b = bind(a, "round", {"precision", "method"}, 0);
  const int64_t prec = b[0] ? want_int(*b[0], "round() precision") : 0;
  const std::string m = b[1] ? str_of(c, *b[1]) : "common";
  if (m != "common" && m != "ceil" && m != "floor") fail("method must be common, ceil or floor");
  if (!is_num(v)) fail(std::string("type ") + type_name(v) + " doesn't define __round__ method");
  if (m != "common") {
    const Value p = int_pow(10, prec);
    const Value scaled = binop(c, BinOp::Mul, v, p);
    const double r = m == "ceil" ? std::ceil(F(scaled)) : std::floor(F(scaled));
    return binop(c, BinOp::Div, Value(r), p);
  }
  if (is_intlike(v)) {
    if (prec >= 0) return Value(I(v));
    const double q = std::pow(10.0, double(-prec));
    return Value(int64_t(std::nearbyint(double(I(v)) / q) * q));
  }
  const double d = Access::f(v);
  if (!std::isfinite(d)) return v;
  if (prec < 0) {
    const double q = std::pow(10.0, double(-prec));
    return Value(std::nearbyint(d / q) * q);
  }
  if (prec > 330) return v;
  std::vector<char> buf(size_t(prec) + 400);
  snprintf(buf.data(), buf.size(), "%.*f", int(prec), d);  // correctly rounded, half to even
  return Value(std::strtod(buf.data(), nullptr));
}

Value f_safe(Ctx& c, const Value& v, const Args& a) {
  bind(a, "safe", {}, 0);
  return v.kind() == Kind::String ? v : new_str(c, str_of(c, v));
}

Value f_string(Ctx& c, const Value& v, const Args& a) {
  bind(a, "string", {}, 0);
  return v.kind() == Kind::String ? v : new_str(c, str_of(c, v));
}

/// The key of sort and unique: the item or its attributes (comma-separated), lower-cased.
Value sort_key(Ctx& c, const Value& x, const std::optional<Value>& attribute, bool cs, bool multi) {
  if (!given(attribute)) return cs ? x : lower_if_str(c, x);
  if (!multi || attribute->kind() != Kind::String) {
    const Value k = attr_path(c, x, *attribute);
    return cs ? k : lower_if_str(c, k);
  }
  std::vector<Value> ks;
  for (const auto& part : split_sep(S(*attribute), ",", -1, false)) {
    const Value k = attr_path(c, x, make_str(part));
    ks.push_back(cs ? k : lower_if_str(c, k));
  }
  return make_array(std::move(ks));
}

Value f_sort(Ctx& c, const Value& v, const Args& a) {
  auto b = bind(a, "sort", {"reverse", "case_sensitive", "attribute"}, 0);
  const bool rev = b[0] && truthy(*b[0]), cs = b[1] && truthy(*b[1]);
  auto xs = iterate(c, v);
  std::vector<std::pair<Value, Value>> keyed;
  for (auto& x : xs) keyed.emplace_back(sort_key(c, x, b[2], cs, true), x);
  std::stable_sort(keyed.begin(), keyed.end(), [&](const auto& x, const auto& y) {
    return rev ? order(c, y.first, x.first) == -1 : order(c, x.first, y.first) == -1;
  });
  std::vector<Value> r;
  for (auto& k : keyed) r.push_back(std::move(k.second));
  return new_array(c, std::move(r));
}

Value f_sum(Ctx& c, const Value& v, const Args& a) {
  auto b = bind(a, "sum", {"attribute", "start"}, 0);
  Value total = b[1] ? *b[1] : Value(int64_t(0));
  if (total.kind() == Kind::String) fail("sum() can't sum strings [use ''.join(seq) instead]");
  for (const auto& x : iterate(c, v)) total = binop(c, BinOp::Add, total, given(b[0]) ? attr_path(c, x, *b[0]) : x);
  return total;
}

Value f_trim(Ctx& c, const Value& v, const Args& a) {
  auto b = bind(a, "trim", {"chars"}, 0);
  const std::string* chars = given(b[0]) ? &want_str(*b[0], "strip arg") : nullptr;
  return new_str(c, str_strip(str_of(c, v), chars, true, true));
}

/// transformers' tojson: json.dumps(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False), the parameters in that order.
Value f_tojson(Ctx& c, const Value& v, const Args& a) {
  auto b = bind(a, "tojson", {"ensure_ascii", "indent", "separators", "sort_keys"}, 0);
  JsonStyle st;
  st.ensure_ascii = b[0] && truthy(*b[0]);
  st.sort_keys = b[3] && truthy(*b[3]);
  if (given(b[1])) {
    if (b[1]->kind() == Kind::String) {
      st.indent = S(*b[1]);
    } else if (is_intlike(*b[1])) {
      if (I(*b[1]) > 4096) fail("tojson indent too large");
      st.indent = std::string(size_t(std::max<int64_t>(I(*b[1]), 0)), ' ');
    } else {
      fail(std::string("can't multiply sequence by non-int of type '") + type_name(*b[1]) + "'");
    }
    st.item_sep = ",";
  }
  if (given(b[2])) {
    const auto seps = iterate(c, *b[2]);
    if (seps.size() != 2) fail("separators must be a pair of strings");
    st.item_sep = want_str(seps[0], "item separator"), st.key_sep = want_str(seps[1], "key separator");
  }
  Writer w{{}, c.cap()};
  json_value(w, v, st, 0);
  c.step(int64_t(w.out.size() / 16));
  return new_str(c, std::move(w.out));
}

Value f_unique(Ctx& c, const Value& v, const Args& a) {
  auto b = bind(a, "unique", {"case_sensitive", "attribute"}, 0);
  const bool cs = b[0] && truthy(*b[0]);
  std::vector<Value> r, seen;
  for (const auto& x : iterate(c, v)) {
    const Value k = sort_key(c, x, b[1], cs, false);
    if (k.kind() == Kind::Array || k.kind() == Kind::Object) fail(std::string("unhashable type: '") + type_name(k) + "'");
    if (std::any_of(seen.begin(), seen.end(), [&](const Value& s) { return eq(c, s, k); })) continue;
    seen.push_back(k);
    r.push_back(x);
  }
  return new_array(c, std::move(r));
}

Value f_wordcount(Ctx& c, const Value& v, const Args& a) {
  bind(a, "wordcount", {}, 0);
  int64_t n = 0;
  bool in_word = false;
  for (char32_t ch : to_cps(str_of(c, v))) {
    const bool w = ch == '_' || (ch < unicode::kInvalidByte && (unicode::flags(ch) & (unicode::kLetter | unicode::kNumber)));
    if (w && !in_word) n++;
    in_word = w;
  }
  return Value(n);
}

using FilterFn = Value (*)(Ctx&, const Value&, const Args&);

const std::unordered_map<std::string, FilterFn>& filter_table() {
  static const std::unordered_map<std::string, FilterFn> t = {
      {"abs", f_abs},         {"attr", f_attr},       {"capitalize", f_capitalize}, {"center", f_center},
      {"count", f_length},    {"d", f_default},       {"default", f_default},       {"dictsort", f_dictsort},
      {"e", f_escape},        {"escape", f_escape},   {"forceescape", f_escape},    {"first", f_first},
      {"float", f_float},     {"indent", f_indent},   {"int", f_int},               {"join", f_join},
      {"last", f_last},       {"length", f_length},   {"list", f_list},             {"lower", f_lower},
      {"items", f_items},     {"map", f_map},         {"min", f_min},               {"max", f_max},
      {"reject", f_reject},   {"rejectattr", f_rejectattr}, {"replace", f_replace}, {"reverse", f_reverse},
      {"round", f_round},     {"safe", f_safe},       {"select", f_select},         {"selectattr", f_selectattr},
      {"sort", f_sort},       {"string", f_string},   {"sum", f_sum},               {"title", f_title},
      {"trim", f_trim},       {"unique", f_unique},   {"upper", f_upper},           {"wordcount", f_wordcount},
      {"tojson", f_tojson},
  };
  return t;
}

Value apply_filter(Ctx& c, const std::string& name, const Value& v, const Args& a) {
  c.step();
  auto it = filter_table().find(name);
  if (it != filter_table().end()) return it->second(c, v, a);
  if (known(kFilters, name)) fail("the '" + name + "' filter is not supported");
  fail("No filter named '" + name + "' found.");
}

bool test_sameas(const Value& v, const Value& o) {
  if (v.kind() != o.kind()) return false;
  switch (v.kind()) {
    case Kind::None: return true;
    case Kind::Bool: return Access::b(v) == Access::b(o);
    case Kind::Int: return I(v) == I(o) && I(v) >= -5 && I(v) <= 256;
    case Kind::Float:
    case Kind::Undefined: return false;
    default: return Access::heap(v) == Access::heap(o);
  }
}

bool apply_test(Ctx& c, const std::string& name, const Value& v, const Args& a) {
  c.step();
  const Kind k = v.kind();
  static const std::pair<const char*, CmpOp> cmps[] = {
      {"==", CmpOp::Eq}, {"eq", CmpOp::Eq}, {"equalto", CmpOp::Eq}, {"!=", CmpOp::Ne}, {"ne", CmpOp::Ne},
      {">", CmpOp::Gt},  {"gt", CmpOp::Gt}, {"greaterthan", CmpOp::Gt}, {">=", CmpOp::Ge}, {"ge", CmpOp::Ge},
      {"<", CmpOp::Lt},  {"lt", CmpOp::Lt}, {"lessthan", CmpOp::Lt}, {"<=", CmpOp::Le}, {"le", CmpOp::Le}};
  for (const auto& [n, op] : cmps)
    if (name == n) return compare(c, op, v, *bind(a, name, {"other"}, 1)[0]);
  if (name == "divisibleby") return eq(c, binop(c, BinOp::Mod, v, *bind(a, name, {"num"}, 1)[0]), Value(int64_t(0)));
  if (name == "sameas") return test_sameas(v, *bind(a, name, {"other"}, 1)[0]);
  if (name == "in") return contains(c, v, *bind(a, name, {"seq"}, 1)[0]);
  bind(a, name, {}, 0);
  if (name == "filter" || name == "test")  // the value is the name
    return k == Kind::String && (name == "filter" ? known(kFilters, S(v)) : known(kTests, S(v)));
  if (name == "defined") return k != Kind::Undefined;
  if (name == "undefined") return k == Kind::Undefined;
  if (name == "none") return k == Kind::None;
  if (name == "boolean") return k == Kind::Bool;
  if (name == "false") return k == Kind::Bool && !Access::b(v);
  if (name == "true") return k == Kind::Bool && Access::b(v);
  if (name == "integer") return k == Kind::Int;
  if (name == "float") return k == Kind::Float;
  if (name == "number") return is_num(v);
  if (name == "string") return k == Kind::String;
  if (name == "mapping") return k == Kind::Object;
  if (name == "sequence") return k == Kind::String || k == Kind::Array || k == Kind::Object || k == Kind::Undefined || k == Kind::Loop;
  if (name == "iterable") return k == Kind::String || k == Kind::Array || k == Kind::Object || k == Kind::Undefined || k == Kind::Loop || k == Kind::Namespace;
  if (name == "callable") return k == Kind::Function || k == Kind::Undefined || k == Kind::Loop;
  if (name == "escaped") return false;
  if (name == "lower" || name == "upper") return truthy(str_is(name == "lower" ? "islower" : "isupper", str_of(c, v)));
  if (name == "odd" || name == "even") return eq(c, binop(c, BinOp::Mod, v, Value(int64_t(2))), Value(int64_t(name == "odd" ? 1 : 0)));
  fail("No test named '" + name + "' found.");
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Evaluation and execution.

namespace {

enum class Flow { Normal, Break, Continue };

Flow exec_body(const Body& b, Ctx& c, const ScopeP& s);

Args eval_args(const Expr& e, Ctx& c, const ScopeP& s) {
  Args a;
  for (const auto& x : e.list) a.pos.push_back(eval(*x, c, s));
  for (const auto& [k, x] : e.kwargs) a.kw.emplace_back(k, eval(*x, c, s));
  if (e.dyn_args) {
    for (auto& x : iterate(c, eval(*e.dyn_args, c, s))) a.pos.push_back(std::move(x));
  }
  if (e.dyn_kwargs) {
    const Value d = eval(*e.dyn_kwargs, c, s);
    if (d.kind() != Kind::Object) fail(std::string("argument after ** must be a mapping, not ") + type_name(d));
    for (const auto& [k, v] : O(d).entries) a.kw.emplace_back(k, v);
  }
  return a;
}

/// A filter chain of a set block or a filter block, applied to `input` (the innermost filter
/// has no operand).
Value filter_chain(const Expr& f, const Value& input, Ctx& c, const ScopeP& s) {
  const Value in = f.a ? filter_chain(*f.a, input, c, s) : input;
  return apply_filter(c, f.name, in, eval_args(f, c, s));
}

Value eval_subscript(const Expr& e, Ctx& c, const ScopeP& s) {
  const Value obj = eval(*e.a, c, s);
  if (e.b->kind != EK::Slice) return get_item(c, obj, eval(*e.b, c, s));
  const Expr& sl = *e.b;
  auto bound = [&](const ExprP& x) { return x ? eval(*x, c, s) : Value(nullptr); };
  const Value start = bound(sl.a), stop = bound(sl.b), step = bound(sl.c);
  return slice(c, obj, start, stop, step);
}

Value eval_concat(const Expr& e, Ctx& c, const ScopeP& s) {
  std::string r;
  for (const auto& x : e.list) {
    const std::string piece = str_of(c, eval(*x, c, s));
    if (r.size() + piece.size() > c.cap()) c.charge(SIZE_MAX);
    r += piece;
  }
  return new_str(c, std::move(r));
}

Value eval_compare(const Expr& e, Ctx& c, const ScopeP& s) {
  Value left = eval(*e.list[0], c, s);
  for (size_t i = 0; i < e.cmp.size(); i++) {
    Value right = eval(*e.list[i + 1], c, s);
    if (!compare(c, e.cmp[i], left, right)) return Value(false);
    left = std::move(right);
  }
  return Value(true);
}

Value eval_dict(const Expr& e, Ctx& c, const ScopeP& s) {
  Object o;
  for (size_t i = 0; i < e.list.size(); i++) {
    const Value k = eval(*e.list[i], c, s);
    if (k.kind() != Kind::String) fail(std::string("dict keys other than strings are not supported (got ") + type_name(k) + ")");
    o.set(S(k), eval(*e.list2[i], c, s));
  }
  c.charge(o.entries.size() * sizeof(Value) * 2);
  return make_object(std::move(o));
}

Value eval(const Expr& e, Ctx& c, const ScopeP& s) {
  DepthGuard g(c);
  c.line = e.line;
  switch (e.kind) {
    case EK::Const: return e.value;
    case EK::Name: return lookup(c, s.get(), e.name);
    case EK::Getattr: return get_attr(c, eval(*e.a, c, s), e.name);
    case EK::Getitem: return eval_subscript(e, c, s);
    case EK::Slice: fail("a slice is only allowed as a subscript");
    case EK::Call: {
      const Value f = eval(*e.a, c, s);
      Args a = eval_args(e, c, s);
      return call_value(c, f, a);
    }
    case EK::Filter: {
      const Value in = e.a ? eval(*e.a, c, s) : Value();
      return apply_filter(c, e.name, in, eval_args(e, c, s));
    }
    case EK::Test: {
      const Value in = eval(*e.a, c, s);
      return Value(apply_test(c, e.name, in, eval_args(e, c, s)));
    }
    case EK::Not: return Value(!truthy(eval(*e.a, c, s)));
    case EK::Neg: return negate(eval(*e.a, c, s), true);
    case EK::Pos: return negate(eval(*e.a, c, s), false);
    case EK::Bin: {
      const Value l = eval(*e.a, c, s);
      return binop(c, e.op, l, eval(*e.b, c, s));
    }
    case EK::And: {
      Value l = eval(*e.a, c, s);
      return truthy(l) ? eval(*e.b, c, s) : l;
    }
    case EK::Or: {
      Value l = eval(*e.a, c, s);
      return truthy(l) ? l : eval(*e.b, c, s);
    }
    case EK::Concat: return eval_concat(e, c, s);
    case EK::Compare: return eval_compare(e, c, s);
    case EK::Cond:
      if (truthy(eval(*e.a, c, s))) return eval(*e.b, c, s);
      if (e.c) return eval(*e.c, c, s);
      return undefined("the inline if-expression on line " + std::to_string(e.line) +
                       " evaluated to false and no else section was defined.");
    case EK::List:
    case EK::Tuple: {
      std::vector<Value> v;
      for (const auto& x : e.list) v.push_back(eval(*x, c, s));
      return new_array(c, std::move(v), e.kind == EK::Tuple);
    }
    case EK::Dict: return eval_dict(e, c, s);
    case EK::NSRef: fail("a namespace attribute reference is only allowed in {% set %}");
  }
  return Value();
}

void assign(const Expr& t, const Value& v, Ctx& c, const ScopeP& s) {
  if (t.kind == EK::Name) return s->set(t.name, v);
  if (t.kind == EK::NSRef) {
    const Value ns = lookup(c, s.get(), t.name);
    if (ns.kind() != Kind::Namespace) fail("cannot assign attribute on non-namespace object");
    if (!t.name2.empty() && t.name2[0] == '_')
      fail("Chat templates cannot store underscore-prefixed attributes on a namespace, but got '" + t.name2 + "'. Please rename the attribute.");
    return NS(ns).attrs.set(t.name2, v);
  }
  const auto xs = iterate(c, v);
  const size_t n = t.list.size();
  if (xs.size() > n) fail("too many values to unpack (expected " + std::to_string(n) + ")");
  if (xs.size() < n) fail("not enough values to unpack (expected " + std::to_string(n) + ", got " + std::to_string(xs.size()) + ")");
  for (size_t i = 0; i < n; i++) assign(*t.list[i], xs[i], c, s);
}

Flow capture(const Body& b, Ctx& c, const ScopeP& s, std::string& buf) {
  struct Restore {
    Ctx& c;
    std::string* saved;
    ~Restore() { c.out = saved; }
  } restore{c, c.out};
  c.out = &buf;
  return exec_body(b, c, s);
}

std::string run_body(Ctx& c, const Body& body, const ScopeP& scope) {
  std::string buf;
  capture(body, c, scope, buf);
  return buf;
}

/// {% for target in expr [if test] %}: a fresh scope per iteration, with `loop`.
Flow exec_for(const Stmt& st, Ctx& c, const ScopeP& s) {
  std::vector<Value> all = iterate(c, eval(*st.expr, c, s));
  if (st.test) {
    std::vector<Value> kept;
    for (auto& x : all) {
      auto tmp = child_scope(s);
      assign(*st.target, x, c, tmp);
      if (truthy(eval(*st.test, c, tmp))) kept.push_back(std::move(x));
    }
    all = std::move(kept);
  }
  if (all.empty()) return exec_body(st.else_body, c, s);
  const auto seq = std::make_shared<const std::vector<Value>>(std::move(all));
  for (size_t i = 0; i < seq->size(); i++) {
    if (++c.loops > c.opt.max_loop_iterations) fail("too many loop iterations (RenderOptions::max_loop_iterations)");
    c.step();
    auto scope = child_scope(s);
    assign(*st.target, (*seq)[i], c, scope);
    auto l = std::make_shared<LoopHeap>();
    l->items = seq, l->index0 = int64_t(i);
    scope->set("loop", Access::make(Kind::Loop, std::move(l)));
    if (exec_body(st.body, c, scope) == Flow::Break) break;
  }
  return Flow::Normal;
}

Flow exec_block_with_filter(const Stmt& st, Ctx& c, const ScopeP& s) {
  std::string buf;
  const Flow f = capture(st.body, c, s, buf);
  if (f != Flow::Normal) return f;
  Value v = make_str(std::move(buf));
  if (st.expr) v = filter_chain(*st.expr, v, c, s);
  if (st.kind == SK::SetBlock) {
    assign(*st.target, v, c, s);
  } else {
    c.write(str_of(c, v));
  }
  return Flow::Normal;
}

Flow exec(const Stmt& st, Ctx& c, const ScopeP& s) {
  c.line = st.line;
  switch (st.kind) {
    case SK::Data: c.write(st.text); break;
    case SK::Output:
      for (const auto& x : st.exprs) {
        const Value v = eval(*x, c, s);
        c.write(v.kind() == Kind::String ? S(v) : to_str(v, std::min(c.cap(), c.opt.max_output_bytes - c.out->size())));
      }
      break;
    case SK::If:
      for (const auto& [test, body] : st.branches)
        if (truthy(eval(*test, c, s))) return exec_body(body, c, s);
      return exec_body(st.else_body, c, s);
    case SK::For: return exec_for(st, c, s);
    case SK::Set: assign(*st.target, eval(*st.expr, c, s), c, s); break;
    case SK::SetBlock:
    case SK::FilterBlock: return exec_block_with_filter(st, c, s);
    case SK::Macro: s->set(st.text, make_macro(c, st, s)); break;
    case SK::CallBlock: {
      const Expr& call = *st.expr;
      const Value f = eval(*call.a, c, s);
      Args a = eval_args(call, c, s);
      a.kw.emplace_back("caller", make_macro(c, st, s));
      const Value r = call_value(c, f, a);
      c.write(str_of(c, r));
      break;
    }
    case SK::With: {
      auto inner = child_scope(s);
      std::vector<Value> values;
      for (size_t i = 0; i + 1 < st.exprs.size(); i += 2) values.push_back(eval(*st.exprs[i + 1], c, s));
      for (size_t i = 0; i < values.size(); i++) assign(*st.exprs[2 * i], values[i], c, inner);
      return exec_body(st.body, c, inner);
    }
    case SK::Break: return Flow::Break;
    case SK::Continue: return Flow::Continue;
    case SK::Body: return exec_body(st.body, c, s);
  }
  return Flow::Normal;
}

Flow exec_body(const Body& b, Ctx& c, const ScopeP& s) {
  DepthGuard g(c);
  for (const auto& st : b) {
    const Flow f = exec(*st, c, s);
    if (f != Flow::Normal) return f;
  }
  return Flow::Normal;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// The public API.

struct Template::Impl {
  Body body;
};

Template::Template(std::string_view source) : impl_(std::make_unique<Impl>()) {
  guarded([&] {
    Parser p(Lexer(source).run());
    impl_->body = p.parse_template();
  });
}

Template::~Template() = default;
Template::Template(Template&&) noexcept = default;
Template& Template::operator=(Template&&) noexcept = default;

std::string Template::render(const Value& context, const RenderOptions& options) const {
  if (context.kind() != Kind::Object) throw UsageError("jinja: the render context must be a dict");
  std::string out;
  Ctx c{options, O(context), &out};
  auto root = std::make_shared<Scope>();
  struct Cleanup {  // break the cycles macros and namespaces can form
    Ctx& c;
    ~Cleanup() {
      for (auto& s : c.closures) s->vars.clear();
      for (auto& n : c.namespaces) n->attrs = Object{};
    }
  } cleanup{c};
  auto where = [&] { return "jinja: line " + std::to_string(c.line) + ": "; };
  try {
    exec_body(impl_->body, c, root);
  } catch (const Fail& f) {
    throw UsageError(where() + f.msg);
  } catch (const Raised& r) {
    throw UsageError(r.msg);
  } catch (const std::bad_alloc&) {
    throw UsageError(where() + "out of memory");
  } catch (const UsageError&) {
    throw;
  } catch (const std::exception& e) {
    throw UsageError(where() + e.what());
  }
  return out;
}

std::string render(std::string_view source, const Value& context, const RenderOptions& options) {
  return Template(source).render(context, options);
}

}  // namespace llmq::jinja
