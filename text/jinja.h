// A Jinja2 subset interpreter for chat templates (the tokenizer.chat_template strings of
// Hugging Face and GGUF models), rendering byte for byte as Hugging Face transformers does:
// jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
// extensions=[loopcontrols]) with transformers' globals raise_exception(msg) and
// strftime_now(fmt) and its tojson filter, json.dumps(x, ensure_ascii=False, indent=indent,
// separators=separators, sort_keys=False) (transformers/utils/chat_template_utils.py,
// _compile_jinja_template). The rules follow jinja2 3.1 (lexer.py, parser.py, runtime.py,
// filters.py, tests.py, sandbox.py) and Python 3's str/int/float/list/dict semantics.
//
// Supported: {{ }}, {% %}, {# #}, whitespace control (-, +), trim_blocks, lstrip_blocks, raw;
// if/elif/else, for (tuple unpacking, `if` filter, else, loop.*, break, continue), set (names,
// tuples, namespace attributes, set blocks), macro (defaults, varargs, kwargs, caller), call
// blocks, filter blocks, with, print, transformers' {% generation %} (renders its body);
// every jinja2 expression form but `%` string formatting; the filters abs attr capitalize
// center count d default dictsort e escape first float forceescape indent int items join last
// length list lower map max min reject rejectattr replace reverse round safe select
// selectattr sort string sum title tojson trim unique upper wordcount; all of jinja2's tests;
// the str, dict and list methods templates use (split, strip, startswith, replace, get, items,
// ...); the globals range, dict, namespace, raise_exception, strftime_now. Values follow
// Python: int/float arithmetic and comparisons, float repr (1.0, 1e-05), str() and repr() of
// lists and dicts, code-point indexing and slicing of strings, Python's whitespace and case
// mappings. tests/test_jinja.cpp checks all this against jinja2 (fixtures in tests/jinja/).
//
// Not supported: a UsageError at parse or render time, never a different output, for
// extends/include/import/block (a chat template is one string), recursive for loops,
// loop.changed, cycler/joiner/lipsum, the filters batch filesizeformat format groupby pprint
// random slice striptags truncate urlencode urlize wordwrap xmlattr, str.format and `%`
// formatting, \N{...} escapes, non-ASCII identifiers, integers beyond int64 (Python's are
// unbounded) and dict keys other than strings.
// Known differences from jinja2: filters it evaluates lazily (map, select, items, ...) run at
// once here, so `x|map` without arguments throws instead of printing a generator object, and
// `|length` works on their results; range() gives a list (prints as [0, 1] rather than
// range(0, 2)); functions and macros print as <function name>; a slice with constant operands
// and a bad bound ([1, 2][0:'a']) throws, where jinja2's constant folding renders ''; the
// multi-character upper cases of Greek (SpecialCasing.txt) are not applied (ß, the Latin
// ligatures and final sigma are).
#pragma once
#include <cstddef>
#include <cstdint>
#include <ctime>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace llmq::jinja {

/// A template value: jinja2's Undefined, Python's None, bool, int (int64 here), float,
/// str (UTF-8 bytes), list (or tuple), dict (string keys, insertion order), and the
/// interpreter's own namespaces, functions and loop objects. Copies are cheap: strings,
/// lists and dicts are shared and never changed once built (only namespaces are mutable, as
/// in jinja2's immutable sandbox).
class Value {
 public:
  enum class Kind : uint8_t { Undefined, None, Bool, Int, Float, String, Array, Object, Namespace, Function, Loop };

  Value() = default;  ///< Undefined
  Value(std::nullptr_t) : kind_(Kind::None) {}
  Value(bool b) : kind_(Kind::Bool) { u_.b = b; }
  template <class T>
    requires(std::is_integral_v<T> && !std::is_same_v<T, bool>)
  Value(T i) : kind_(Kind::Int) {
    u_.i = static_cast<int64_t>(i);
  }
  Value(double d) : kind_(Kind::Float) { u_.f = d; }
  Value(std::string s);
  Value(std::string_view s) : Value(std::string(s)) {}
  Value(const char* s) : Value(std::string(s)) {}

  /// A list of `items`. Throws UsageError if it would nest deeper than 256 levels.
  static Value array(std::vector<Value> items = {});
  /// An empty dict; fill it with set().
  static Value object();
  /// The JSON value as a template value: null -> None, numbers -> int or float (unsigned
  /// integers above INT64_MAX -> float), objects keep their key order. Throws UsageError if
  /// nested deeper than 256 levels.
  static Value from_json(const nlohmann::json& j);
  /// The same, keeping the key order of the JSON text (what Python's json.loads keeps, and so
  /// what tojson writes in transformers): use this for messages and tools.
  static Value from_json(const nlohmann::ordered_json& j);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::Undefined; }
  /// Sets `key` of a dict (replacing its value, keeping its position, if present); copies the
  /// dict first if it is shared. Throws UsageError if this is not a dict.
  void set(std::string key, Value v);
  /// Appends to a list (copied first if shared). Throws UsageError if this is not a list.
  void push_back(Value v);
  /// The value as Python's str() prints it (what {{ value }} writes): '' for Undefined, None,
  /// True, 1, 1.0, 1e-05, ['a', 1], {'k': 'v'}.
  std::string str() const;

  /// Implementation detail: the shared payload of strings, lists, dicts and the rest
  /// (defined in jinja.cpp).
  struct Heap;

 private:
  friend struct Access;
  Kind kind_ = Kind::Undefined;
  union {
    bool b;
    int64_t i;
    double f;
  } u_{};
  std::shared_ptr<Heap> heap_;
};

/// Render settings and limits. A render that would exceed a limit throws UsageError.
struct RenderOptions {
  /// The time strftime_now(fmt) formats (its fields are normalised with timegm, so only
  /// year, month, day, hour, minute and second matter); unset: the current local time.
  std::optional<std::tm> now;
  size_t max_output_bytes = size_t(64) << 20;  ///< size of the rendered text
  /// Bytes of strings and list elements created while rendering (concatenations, joins,
  /// repetitions, list building), the output included: bounds the memory of a render.
  size_t max_alloc_bytes = size_t(256) << 20;
  int64_t max_loop_iterations = 1'000'000;  ///< for-loop iterations, all loops together
  /// Elementary steps (loop iterations, elements compared, serialised, filtered, ...).
  int64_t max_steps = 50'000'000;
};

/// A parsed template: parse once, render many times (render is const and thread-safe).
class Template {
 public:
  /// Parses `source`. Throws UsageError on a syntax error ("jinja: line N: ..."), on a tag,
  /// filter or test jinja2 does not know, on nesting deeper than 256 levels (parentheses,
  /// blocks) and on the unsupported statements listed at the top of this file.
  explicit Template(std::string_view source);
  ~Template();
  Template(Template&&) noexcept;
  Template& operator=(Template&&) noexcept;

  /// Renders with the variables of `context`, a dict (e.g. messages, tools, documents,
  /// add_generation_prompt, bos_token, eos_token, as transformers passes them). Throws
  /// UsageError when the template fails at render time, with the line: jinja2's TypeError,
  /// UndefinedError and the like, a limit of `options` exceeded, or an unsupported feature;
  /// raise_exception(msg) throws UsageError whose what() is exactly msg.
  std::string render(const Value& context, const RenderOptions& options = {}) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Renders `source` once (Template(source).render(context, options)).
std::string render(std::string_view source, const Value& context, const RenderOptions& options = {});

}  // namespace llmq::jinja
