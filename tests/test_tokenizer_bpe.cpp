// Byte-level BPE, special tokens and the Unicode pre-tokenizer: llama.cpp's test vectors for
// every vocabulary in ../shared/tokenizers/llamacpp-vocab, SmolLM2's tokenizer (when its GGUF
// has been fetched into models/), the regex matcher against std::regex, and llmq-tokenize.
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <iostream>
#include <map>
#include <random>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "text/tokenizer.h"
#include "text/unicode.h"
#include "base/error.h"
#include "formats/readers/gguf.h"
#include "test_util.h"
#include "vocab_vectors.h"

namespace fs = std::filesystem;
using llmq::Tokenizer;
using llmq::UsageError;
using llmq::test::escaped;
using llmq::test::ids_str;
using llmq::test::read_bytes;
using llmq::test::shared;
namespace uc = llmq::unicode;

namespace {

const std::string kVocabDir = "tokenizers/llamacpp-vocab";

// models/ of this repository (ignored by git; scripts/fetch_models.sh fills it).
std::string repo_model(const std::string& name) {
  return (fs::path(__FILE__).parent_path().parent_path() / "models" / name).string();
}
const std::string kSmolLM2 = "smollm2-135m-instruct-q4_1.gguf";

Tokenizer gguf_tokenizer(const std::string& path) { return Tokenizer(llmq::vocab_from_gguf(*llmq::GgufFile::open(path))); }

const Tokenizer& gpt2() {
  static const Tokenizer t = gguf_tokenizer(shared(kVocabDir + "/ggml-vocab-gpt-2.gguf"));
  return t;
}

std::string slurp_stdout(const std::string& cmd, int* status) {
  const std::string dir = llmq::test::scratch("llmq-tokenize-cli");
  const std::string out = dir + "/out.txt";
  *status = llmq::test::run(cmd + " > " + out + " 2> " + dir + "/err.txt");
  return read_bytes(out);
}

// A small byte-level vocabulary: the 256 byte characters, then the merges' results.
llmq::Vocab tiny_bpe_vocab(const std::vector<std::string>& merges, const std::string& pre) {
  llmq::Vocab v;
  v.model = "gpt2";
  v.pre = pre;
  v.add_bos = false;
  v.add_space_prefix = false;
  for (int b = 0; b < 256; ++b) {
    std::string s;
    uc::append_utf8(s, uc::byte_to_unicode(uint8_t(b)));
    v.tokens.push_back(s);
  }
  for (const std::string& m : merges) {
    v.merges.push_back(m);
    std::string joined = m;
    joined.erase(joined.find(' '), 1);
    v.tokens.push_back(joined);
  }
  v.tokens.push_back("<|end|>");
  v.tokens.push_back("<tag>");
  v.scores.assign(v.tokens.size(), 0.0f);
  v.types.assign(v.tokens.size(), int32_t(llmq::TokenType::Normal));
  v.types[v.tokens.size() - 2] = int32_t(llmq::TokenType::Control);
  v.types[v.tokens.size() - 1] = int32_t(llmq::TokenType::UserDefined);
  v.eos_id = int32_t(v.tokens.size() - 2);
  return v;
}

// The split llama.cpp does with std::regex (unicode_regex_split_stl): matches and the gaps
// between them, as strings.
std::vector<std::string> std_split(const std::string& text, const std::string& pattern) {
  const std::regex re(pattern, std::regex::ECMAScript);
  std::vector<std::string> out;
  size_t last = 0;
  for (auto it = std::sregex_iterator(text.begin(), text.end(), re); it != std::sregex_iterator(); ++it) {
    const size_t pos = size_t(it->position()), len = size_t(it->length());
    if (len == 0) continue;
    if (pos > last) out.push_back(text.substr(last, pos - last));
    out.push_back(text.substr(pos, len));
    last = pos + len;
  }
  if (last < text.size()) out.push_back(text.substr(last));
  return out;
}

std::vector<std::string> our_split(const std::string& text, const std::string& pattern) {
  const uc::Regex re(pattern);
  uc::CodepointText t;
  t.assign(text);
  const std::vector<uint32_t> ends = re.split(t, {uint32_t(t.size())});
  std::vector<std::string> out;
  uint32_t begin = 0;
  for (uint32_t e : ends) {
    if (e > begin) out.push_back(text.substr(t.offsets[begin], t.offsets[e] - t.offsets[begin]));
    begin = e;
  }
  return out;
}

}  // namespace

TEST_CASE("Unicode tables: categories, white space, lower case, UTF-8, GPT-2 byte map", "[tokenizer]") {
  using C = uc::Category;
  CHECK(std::string(uc::version()).size() >= 5);
  CHECK(uc::category('A') == C::Lu);
  CHECK(uc::category('z') == C::Ll);
  CHECK(uc::category('7') == C::Nd);
  CHECK(uc::category(' ') == C::Zs);
  CHECK(uc::category('\n') == C::Cc);
  CHECK(uc::category('!') == C::Po);
  CHECK(uc::category('$') == C::Sc);
  CHECK(uc::category('+') == C::Sm);
  CHECK(uc::category('_') == C::Pc);
  CHECK(uc::category(0x00BD) == C::No);   // ½
  CHECK(uc::category(0x0436) == C::Ll);   // ж
  CHECK(uc::category(0x0301) == C::Mn);   // combining acute
  CHECK(uc::category(0x4E00) == C::Lo);   // 一
  CHECK(uc::category(0x2167) == C::Nl);   // Ⅷ
  CHECK(uc::category(0x1F680) == C::So);  // 🚀
  CHECK(uc::category(0x3002) == C::Po);   // 。
  CHECK(uc::category(0xE000) == C::Co);
  CHECK(uc::category(0xD800) == C::Cs);
  CHECK(uc::category(0x0378) == C::Cn);   // unassigned
  CHECK(uc::category(0x10FFFF) == C::Cn);
  CHECK(uc::category(uc::kInvalidByte + 0xFF) == C::Cn);
  for (char32_t c : {0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x20, 0x85, 0xA0, 0x1680, 0x2000, 0x200A, 0x2028, 0x2029,
                     0x202F, 0x205F, 0x3000})
    CHECK(uc::is_whitespace(c));
  for (char32_t c : {0x1C, 0x1F, 0x200B, 0x180E, 0x61, 0xFEFF}) CHECK_FALSE(uc::is_whitespace(c));
  CHECK(uc::flags(' ') == (uc::flag(C::Zs) | uc::kWhiteSpace));
  CHECK((uc::flags(0x0436) & uc::kLetter) != 0);
  CHECK(uc::to_lower('Q') == 'q');
  CHECK(uc::to_lower('q') == 'q');
  CHECK(uc::to_lower(0x00C9) == 0x00E9);  // É
  CHECK(uc::to_lower(0x0100) == 0x0101);  // Ā (a stride-2 run)
  CHECK(uc::to_lower(0x0101) == 0x0101);
  CHECK(uc::to_lower(0x0416) == 0x0436);  // Ж
  CHECK(uc::to_lower(0x212A) == 'k');     // Kelvin sign
  CHECK(uc::to_lower(0x10400) == 0x10428);
  CHECK(uc::to_lower(0x4E00) == 0x4E00);

  auto dec = [](const std::string& s, size_t pos, char32_t want, size_t want_len) {
    char32_t cp = 0;
    const size_t len = uc::decode_utf8(s, pos, &cp);
    INFO(escaped(s) << " at " << pos);
    CHECK(len == want_len);
    CHECK(cp == want);
  };
  dec("a", 0, 'a', 1);
  dec("\xC2\xBD", 0, 0xBD, 2);
  dec("\xE6\x97\xA5", 0, 0x65E5, 3);
  dec("\xF0\x9F\x9A\x80", 0, 0x1F680, 4);
  dec("\xC0\x80", 0, uc::kInvalidByte + 0xC0, 1);          // overlong
  dec("\xE0\x80\x80", 0, uc::kInvalidByte + 0xE0, 1);      // overlong
  dec("\xED\xA0\x80", 0, uc::kInvalidByte + 0xED, 1);      // surrogate
  dec("\xF4\x90\x80\x80", 0, uc::kInvalidByte + 0xF4, 1);  // above U+10FFFF
  dec("\xE6\x97", 0, uc::kInvalidByte + 0xE6, 1);          // truncated
  dec("\x97", 0, uc::kInvalidByte + 0x97, 1);              // stray continuation
  std::string all;
  for (char32_t c : {char32_t('x'), char32_t(0xBD), char32_t(0x65E5), char32_t(0x1F680)}) uc::append_utf8(all, c);
  CHECK(all == "x\xC2\xBD\xE6\x97\xA5\xF0\x9F\x9A\x80");

  // GPT-2's byte map: a bijection onto 256 characters, printable bytes unchanged.
  std::set<char32_t> seen;
  for (int b = 0; b < 256; ++b) {
    const char32_t c = uc::byte_to_unicode(uint8_t(b));
    seen.insert(c);
    CHECK(uc::unicode_to_byte(c) == b);
  }
  CHECK(seen.size() == 256);
  CHECK(uc::byte_to_unicode('A') == 'A');
  CHECK(uc::byte_to_unicode(' ') == 0x0120);   // "Ġ"
  CHECK(uc::byte_to_unicode('\n') == 0x010A);  // "Ċ"
  CHECK(uc::byte_to_unicode(0x00) == 0x0100);
  CHECK(uc::byte_to_unicode(0xAD) == 0x0143);
  CHECK(uc::unicode_to_byte(0x0144) == -1);
  CHECK(uc::unicode_to_byte(0x4E00) == -1);
}

TEST_CASE("The code point regex splits as std::regex does (ASCII patterns)", "[tokenizer]") {
  // Patterns in the shape of the pre-tokenizers, with ASCII classes std::regex understands.
  const std::vector<std::string> patterns = {
      R"('s|'t|'re|'ve|'m|'ll|'d| ?[a-zA-Z]+| ?[0-9]+| ?[^\sa-zA-Z0-9]+|\s+(?!\S)|\s+)",
      R"('s|'t|'re|'ve|'m|'ll|'d| ?[a-zA-Z]+| ?[0-9]+| ?[^\sa-zA-Z0-9]+|\s+(?!\S))",
      R"([^\r\na-zA-Z0-9]?[a-zA-Z]+|[0-9]{1,3}| ?[^\sa-zA-Z0-9]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)",
      R"([\r\n])", R"(\s?[a-zA-Z]+)", R"(\s?[!-/:-~]+)", R"(\s+$)", R"([0-9][0-9][0-9])", R"([0-9])",
      R"((ab|a)(c|bcd)(d*))", R"((?:x|xy)+z)", R"(a{2,3})", R"(a{2,}b?)", R"([^a-c]+)", R"(x(?=y)|y(?!x))",
      R"(([\t\n]|    |  ))", R"((a|b|c){1,4}d)", R"([a-c]*[b-d]+|[x-z]+[a-c]*)",
  };
  const std::string alphabet = "abcdxyzAB019 \t\n\r'!.-";
  std::mt19937 rng(12345);
  for (const std::string& p : patterns) {
    for (int trial = 0; trial < 300; ++trial) {
      std::string text;
      const int len = int(rng() % 24);
      for (int i = 0; i < len; ++i) text += alphabet[rng() % alphabet.size()];
      INFO("pattern " << p << "\ntext " << escaped(text));
      REQUIRE(our_split(text, p) == std_split(text, p));
    }
  }
  // Unicode categories, which std::regex lacks.
  CHECK(our_split("Hello wörld 123 ½ 日本!!", R"( ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+)") ==
        std::vector<std::string>{"Hello", " wörld", " 123", " ½", " 日本", "!!"});
  CHECK(our_split("I'M here, You'Ll", R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|\p{L}+)") ==
        std::vector<std::string>{"I", "'M", " ", "here", ", ", "You", "'Ll"});
  CHECK(our_split("ÀÉ x", R"([\u00C0-\u00D6]+|\U00000078)") == std::vector<std::string>{"ÀÉ", " ", "x"});
  // Bad patterns are usage errors.
  for (const char* bad : {"(ab", "ab)", "[ab", "a{3,2}", "\\p{Xx}", "a**", "a+?", "(?<=a)b", ".", "[\\S]", "\\q"})
    CHECK_THROWS_AS(uc::Regex(bad), UsageError);
}

TEST_CASE("Every known pre-tokenizer compiles - an unknown one is an error naming the known ones", "[tokenizer]") {
  const std::vector<std::string> names = Tokenizer::known_pre_tokenizers();
  CHECK(names.size() >= 40);
  CHECK(std::is_sorted(names.begin(), names.end()));
  for (const char* want : {"default", "gpt-2", "llama-bpe", "llama3", "deepseek-llm", "deepseek-coder", "falcon", "mpt",
                           "starcoder", "refact", "command-r", "smollm", "qwen2", "stablelm2", "olmo"}) {
    CHECK(std::find(names.begin(), names.end(), want) != names.end());
  }
  for (const std::string& name : names) {
    INFO(name);
    const Tokenizer t(tiny_bpe_vocab({"a b"}, name));
    CHECK(t.decode(t.encode("ab Ab 12345 ..\n\n  x", false)) == "ab Ab 12345 ..\n\n  x");
  }
  CHECK_NOTHROW(Tokenizer(tiny_bpe_vocab({"a b"}, "")));  // no pre: "default", as llama.cpp
  CHECK_THROWS_AS(Tokenizer(tiny_bpe_vocab({}, "gpt-2")), UsageError);  // no merges at all
  try {
    Tokenizer(tiny_bpe_vocab({"a b"}, "no-such-pre"));
    FAIL("no exception");
  } catch (const UsageError& e) {
    const std::string what = e.what();
    CHECK(what.find("no-such-pre") != std::string::npos);
    CHECK(what.find("smollm") != std::string::npos);
    CHECK(what.find("deepseek-coder") != std::string::npos);
  }
}

TEST_CASE("Byte-level BPE: merge ranks, ties, bytes, special tokens", "[tokenizer]") {
  // Ranks: "a b" first, then "ab c", then "b c" (which "a b" pre-empts on "abc").
  const Tokenizer t(tiny_bpe_vocab({"a b", "ab c", "b c", "Ġ a", "a a"}, "gpt-2"));
  const int32_t ab = t.token_id("ab"), abc = t.token_id("abc"), bc = t.token_id("bc"), sp_a = t.token_id("Ġa"),
                aa = t.token_id("aa"), a = t.token_id("a"), b = t.token_id("b"), c = t.token_id("c");
  REQUIRE(std::min({ab, abc, bc, sp_a, aa, a, b, c}) >= 0);
  CHECK(t.byte_level());
  CHECK(t.encode("abc", false) == std::vector<int32_t>{abc});
  CHECK(t.encode("bc", false) == std::vector<int32_t>{bc});
  CHECK(t.encode("aaa", false) == std::vector<int32_t>{aa, a});  // equal ranks: leftmost first
  // Words merge separately; "Ġ a" ranks after "a b", so " abc" keeps its space apart.
  CHECK(t.encode("abc abc", false) == std::vector<int32_t>{abc, t.token_id("Ġ"), abc});
  CHECK(t.encode("bc a", false) == std::vector<int32_t>{bc, sp_a});
  CHECK(t.encode("", true).empty());  // no BOS in this vocabulary
  CHECK(t.encode("\n", false) == std::vector<int32_t>{t.token_id("Ċ")});
  // Any bytes survive, malformed UTF-8 included.
  const std::string bad = "a\xFF" "b\xE6\x97" " \xC0\x80 x";
  CHECK(t.decode(t.encode(bad, false)) == bad);

  // Special tokens: the control piece only with parse_special; the user-defined one always.
  const int32_t end = t.token_id("<|end|>"), tag = t.token_id("<tag>");
  CHECK(t.encode("x<|end|>y", false, true) == std::vector<int32_t>{t.token_id("x"), end, t.token_id("y")});
  const std::vector<int32_t> plain = t.encode("x<|end|>y", false);
  CHECK(std::find(plain.begin(), plain.end(), end) == plain.end());
  CHECK(t.decode(plain) == "x<|end|>y");
  CHECK(t.encode("a<tag>b", false) == std::vector<int32_t>{a, tag, b});
  CHECK(t.decode({end}).empty());
  CHECK(t.decode({end}, true) == "<|end|>");
  CHECK(t.decode({tag}) == "<tag>");
  CHECK_THROWS_AS(t.decode_piece(-1, int32_t(t.n_vocab())), UsageError);

  // Llama-3's pre-tokenizer ignores merges for a word that is a piece; dbrx (same regex) does not.
  llmq::Vocab v = tiny_bpe_vocab({"a b"}, "llama3");
  v.tokens.push_back("abc");
  v.scores.push_back(0);
  v.types.push_back(int32_t(llmq::TokenType::Normal));
  const Tokenizer l3(v);
  v.pre = "dbrx";
  const Tokenizer dbrx(v);
  CHECK(l3.encode("abc", false) == std::vector<int32_t>{l3.token_id("abc")});
  CHECK(dbrx.encode("abc", false) == std::vector<int32_t>{dbrx.token_id("ab"), dbrx.token_id("c")});
  CHECK(l3.encode("abcb", false) == std::vector<int32_t>{l3.token_id("ab"), l3.token_id("c"), l3.token_id("b")});

  // A byte with no piece is dropped (llama.cpp, Hugging Face).
  llmq::Vocab holes = tiny_bpe_vocab({"a b"}, "gpt-2");
  holes.tokens[0x0B] = "<vt>";  // the vertical tab's character is missing
  const Tokenizer h(holes);
  CHECK(h.encode("a\vb", false) == std::vector<int32_t>{h.token_id("a"), h.token_id("b")});

  // Issue 22 item 15: a vocabulary without the pieces ordinary text needs (printable ASCII, tab,
  // newline, CR) is refused when it is loaded or converted, not when a prompt first hits the gap.
  for (int missing : {'x', ' ', '\n'}) {
    llmq::Vocab gap = tiny_bpe_vocab({"a b"}, "gpt-2");
    gap.tokens[size_t(missing)] = "<gone>";
    INFO("byte " << missing);
    CHECK_THROWS_WITH(Tokenizer(gap), Catch::Contains("no piece for byte"));
  }
}

TEST_CASE("llama.cpp's tokenizer vectors pass for every supported vocabulary", "[tokenizer]") {
  const fs::path dir = shared(kVocabDir);
  REQUIRE(fs::is_directory(dir));
  std::set<std::string> ggufs, vectors;  // stems "ggml-vocab-X"
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.size() > 5 && name.ends_with(".gguf")) ggufs.insert(name.substr(0, name.size() - 5));
    if (name.ends_with(".gguf.inp")) vectors.insert(name.substr(0, name.size() - 9));
  }
  REQUIRE(vectors.count("ggml-vocab-gpt-2") == 1);
  // The inputs, for round trips on vocabularies that come without vectors.
  const std::vector<llmq::test::VocabCase> common = llmq::test::load_vectors((dir / "ggml-vocab-gpt-2.gguf").string());

  std::map<std::string, std::pair<size_t, size_t>> results;  // stem -> passed, total
  for (const std::string& stem : vectors)
    if (!ggufs.count(stem)) WARN("skipped: " << stem << ".gguf.inp/.out: no " << stem << ".gguf in " << dir.string());

  for (const std::string& stem : ggufs) {
    const std::string path = (dir / (stem + ".gguf")).string();
    llmq::Vocab vocab = llmq::vocab_from_gguf(*llmq::GgufFile::open(path));
    if (vocab.model != "llama" && vocab.model != "gpt2") {
      WARN("skipped: " << stem << ": tokenizer model '" << vocab.model << "' is not supported");
      CHECK_THROWS_AS(Tokenizer(vocab), UsageError);
      continue;
    }
    const std::string model = vocab.model;
    const Tokenizer t(std::move(vocab));
    if (!vectors.count(stem)) {
      WARN("skipped: " << stem << ": no .inp/.out test vectors (loaded; round trips checked)");
      for (const auto& c : common) {
        INFO(stem << ": " << escaped(c.text));
        CHECK(t.decode(t.encode(c.text, false)) == c.text);
      }
      continue;
    }
    const std::vector<llmq::test::VocabCase> cases = llmq::test::load_vectors((dir / stem).string() + ".gguf");
    size_t passed = 0;
    for (size_t i = 0; i < cases.size(); ++i) {
      const auto& c = cases[i];
      const std::vector<int32_t> got = t.encode(c.text, /*add_bos=*/false, /*parse_special=*/false);
      INFO(stem << " case " << i << ": " << escaped(c.text) << "\n  expected " << ids_str(c.ids) << "\n  got      "
                << ids_str(got));
      CHECK(got == c.ids);
      passed += got == c.ids;
      if (model == "gpt2") CHECK(t.decode(got) == c.text);
    }
    results[stem] = {passed, cases.size()};
  }
  std::cout << "llama.cpp tokenizer vectors (encode without BOS, parse_special = false):\n";
  for (const auto& [stem, r] : results) std::cout << fmt::format("  {:<32} passed {}/{}\n", stem, r.first, r.second);
  for (const auto& [stem, r] : results) {
    INFO(stem);
    CHECK(r.first == r.second);
  }
  for (const char* must : {"ggml-vocab-llama-spm", "ggml-vocab-phi-3", "ggml-vocab-gpt-2", "ggml-vocab-falcon",
                           "ggml-vocab-deepseek-coder", "ggml-vocab-deepseek-llm"}) {
    INFO(must);
    CHECK(results.count(must) == 1);
  }
}

TEST_CASE("Special tokens in SentencePiece and GPT-2 vocabularies", "[tokenizer]") {
  const Tokenizer& g = gpt2();
  const int32_t eot = g.token_id("<|endoftext|>");
  REQUIRE(eot == 50256);
  CHECK(g.encode("<|endoftext|>", false, true) == std::vector<int32_t>{eot});
  CHECK(g.encode("Hello<|endoftext|> world", false, true) == std::vector<int32_t>{15496, eot, 995});
  const std::vector<int32_t> plain = g.encode("<|endoftext|>", false);
  CHECK(plain.size() > 1);
  CHECK(std::find(plain.begin(), plain.end(), eot) == plain.end());
  CHECK(g.decode(plain) == "<|endoftext|>");
  CHECK(g.decode_piece(-1, eot).empty());
  CHECK(g.decode_piece(-1, eot, true) == "<|endoftext|>");
  CHECK(g.decode_piece(-1, 995) == " world");

  const Tokenizer spm = gguf_tokenizer(shared(kVocabDir + "/ggml-vocab-llama-spm.gguf"));
  CHECK(spm.encode("Hello", false) == std::vector<int32_t>{15043});
  // As llama.cpp: the dummy prefix goes before the text after a special token, too.
  CHECK(spm.encode("<s>Hello</s>", false, true) == std::vector<int32_t>{1, 15043, 2});
  CHECK(spm.encode("Hi<s>Hello", true, true) == std::vector<int32_t>{1, 6324, 1, 15043});
  const std::vector<int32_t> spm_plain = spm.encode("<s>Hello", false);
  CHECK(std::find(spm_plain.begin(), spm_plain.end(), 1) == spm_plain.end());
  CHECK(spm.decode(spm_plain) == "<s>Hello");
  CHECK(spm.decode({1, 15043, 2}).empty() == false);
  CHECK(spm.decode({1, 15043, 2}) == "Hello");
  CHECK(spm.decode({1, 15043, 2}, true) == "<s>Hello</s>");
}

TEST_CASE("SmolLM2's byte-level tokenizer and its ChatML special tokens", "[tokenizer]") {
  const std::string path = repo_model(kSmolLM2);
  if (!fs::exists(path)) {
    WARN("skipped: " << path << " is absent (scripts/fetch_models.sh fetches it)");
    return;
  }
  const Tokenizer t = gguf_tokenizer(path);
  CHECK(t.vocab().model == "gpt2");
  CHECK(t.vocab().pre == "smollm");
  CHECK(t.token_id("<|im_start|>") == 1);
  CHECK(t.token_id("<|im_end|>") == 2);

  const std::vector<int32_t> hello = t.encode("Hello, world!", false);
  std::cout << "SmolLM2 \"Hello, world!\" -> " << ids_str(hello) << "\n";
  CHECK(hello.size() == 4);  // "Hello" "," " world" "!"
  CHECK(t.decode(hello) == "Hello, world!");

  const std::string chat = "<|im_start|>user\nHi<|im_end|>\n";
  const std::vector<int32_t> parsed = t.encode(chat, false, true);
  std::cout << "SmolLM2 ChatML (parse_special) -> " << ids_str(parsed) << "\n";
  REQUIRE(parsed.size() >= 5);
  CHECK(parsed.front() == 1);
  CHECK(std::count(parsed.begin(), parsed.end(), 1) == 1);
  CHECK(std::count(parsed.begin(), parsed.end(), 2) == 1);
  CHECK(t.decode(parsed) == "user\nHi\n");  // control tokens are not printed
  CHECK(t.decode(parsed, true) == chat);
  CHECK(t.decode_piece(-1, 2).empty());
  const std::vector<int32_t> unparsed = t.encode(chat, false);
  CHECK(unparsed.size() > parsed.size());
  CHECK(std::count(unparsed.begin(), unparsed.end(), 1) == 0);
  CHECK(std::count(unparsed.begin(), unparsed.end(), 2) == 0);
  CHECK(t.decode(unparsed) == chat);

  // Digits are split one by one (pre "smollm").
  CHECK(t.encode("2024", false).size() == 4);
}

// Manual check (hidden; run with "[.tokenizer-speed]"): encodes the whole 1.3 MB WikiText-2
// test file with SmolLM2's vocabulary (or GPT-2's when SmolLM2 is absent) and prints the time.
TEST_CASE("Byte-level BPE encodes WikiText-2 quickly", "[.tokenizer-speed]") {
  const std::string text = read_bytes(shared("text/wikitext2-test.txt"));
  std::vector<std::pair<std::string, std::string>> vocabs = {
      {"gpt-2", shared(kVocabDir + "/ggml-vocab-gpt-2.gguf")},
      {"deepseek-llm", shared(kVocabDir + "/ggml-vocab-deepseek-llm.gguf")}};
  if (fs::exists(repo_model(kSmolLM2))) vocabs.insert(vocabs.begin(), {"SmolLM2", repo_model(kSmolLM2)});
  for (const auto& [name, path] : vocabs) {
    const Tokenizer t = gguf_tokenizer(path);
    const auto t0 = std::chrono::steady_clock::now();
    const std::vector<int32_t> ids = t.encode(text, false);
    const auto t1 = std::chrono::steady_clock::now();
    std::cout << fmt::format("wikitext2-test with {}: {} bytes -> {} tokens in {:.3f} s\n", name, text.size(),
                             ids.size(), std::chrono::duration<double>(t1 - t0).count());
    CHECK(t.decode(ids) == text);
  }
}

TEST_CASE("llmq-tokenize prints ids, pieces and text", "[tokenizer]") {
  const std::string tool = llmq::test::bin("llmq-tokenize");
  REQUIRE(fs::exists(tool));
  const std::string vocab = shared(kVocabDir + "/ggml-vocab-gpt-2.gguf");
  int st = -1;
  CHECK(slurp_stdout(tool + " " + vocab + " 'Hello world'", &st) == "[15496,995]\n");
  CHECK(st == 0);
  CHECK(slurp_stdout(tool + " " + vocab + " --special --pieces 'Hi<|endoftext|>'", &st) ==
        "[17250,50256]\n[\"Hi\",\"<|endoftext|>\"]\n");
  CHECK(st == 0);
  CHECK(slurp_stdout(tool + " " + vocab + " --decode '[15496, 995]'", &st) == "Hello world\n");
  CHECK(st == 0);
  CHECK(slurp_stdout(tool + " " + shared("tokenizers/llama2/tokenizer.model") + " --bos 'Hello world'", &st) ==
        "[1,15043,3186]\n");
  CHECK(st == 0);
  CHECK(slurp_stdout(tool + " " + shared("models/stories260K/tok512.bin") + " Zoo", &st) == "[410,469,347]\n");
  CHECK(st == 0);
  // Bad files exit with 2, bad usage with 1.
  slurp_stdout(tool + " " + shared("text/tinystories-valid-head.txt") + " x", &st);
  CHECK(st == 2);
  slurp_stdout(tool + " " + shared(kVocabDir + "/ggml-vocab-bert-bge.gguf") + " x", &st);
  CHECK(st == 2);
  slurp_stdout(tool + " /no/such/file.gguf x", &st);
  CHECK(st == 2);
  slurp_stdout(tool + " " + vocab + " --decode x", &st);
  CHECK(st == 1);
}
