// Tokenizer tests on the real files in ../shared: llama2.c's tok512.bin (stories260K) and the
// Llama-2 SentencePiece model, checked against llama.cpp's test vectors and the sentencepiece
// library itself.
#include <catch2/catch.hpp>
#include <sentencepiece_processor.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "text/tokenizer.h"
#include "base/error.h"
#include "formats/readers/tokenizer_files.h"
#include "test_util.h"
#include "vocab_vectors.h"

using llmq::FileError;
using llmq::Tokenizer;
using llmq::UsageError;
using llmq::test::escaped;
using llmq::test::ids_str;
using llmq::test::load_vectors;
using llmq::test::read_bytes;
using llmq::test::shared;
using llmq::test::VocabCase;

namespace {

void write_bytes(const std::string& path, const std::string& data) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(data.data(), static_cast<std::streamsize>(data.size()));
  if (!out) throw std::runtime_error("cannot write " + path);
}

const std::string kTok512 = "models/stories260K/tok512.bin";
const std::string kLlama2 = "tokenizers/llama2/tokenizer.model";
const std::string kSpmVectors = "tokenizers/llamacpp-vocab/ggml-vocab-llama-spm.gguf";

const Tokenizer& tok512() {
  static const Tokenizer t(llmq::read_llama2c_tokenizer(shared(kTok512), 512));
  return t;
}

const Tokenizer& llama2() {
  static const Tokenizer t(llmq::read_sentencepiece_model(shared(kLlama2)));
  return t;
}

std::vector<int32_t> spm_encode(const sentencepiece::SentencePieceProcessor& sp, const std::string& text) {
  std::vector<int> ids;
  const auto st = sp.Encode(text, &ids);
  REQUIRE(st.ok());
  return std::vector<int32_t>(ids.begin(), ids.end());
}

}  // namespace

TEST_CASE("llama2.c tokenizer.bin is read into SentencePiece form", "[tokenizer]") {
  const llmq::Vocab v = llmq::read_llama2c_tokenizer(shared(kTok512), 512);
  REQUIRE(v.size() == 512);
  REQUIRE(v.scores.size() == 512);
  REQUIRE(v.types.size() == 512);
  CHECK(v.model == "llama");
  CHECK(v.bos_id == 1);
  CHECK(v.eos_id == 2);
  CHECK(v.unk_id == 0);
  CHECK(v.add_bos);
  CHECK(v.add_space_prefix);
  CHECK(v.tokens[0] == "<unk>");
  CHECK(v.tokens[1] == "<s>");
  CHECK(v.tokens[2] == "</s>");
  CHECK(v.types[0] == int32_t(llmq::TokenType::Unknown));
  CHECK(v.types[1] == int32_t(llmq::TokenType::Control));
  CHECK(v.types[2] == int32_t(llmq::TokenType::Control));
  for (int b = 0; b < 256; ++b) {
    INFO("byte " << b);
    CHECK(v.tokens[3 + b] == fmt::format("<0x{:02X}>", b));
    CHECK(v.types[3 + b] == int32_t(llmq::TokenType::Byte));
  }
  CHECK(v.tokens[410] == "\xE2\x96\x81");           // was " " in the file
  CHECK(v.tokens[259] == "\xE2\x96\x81t");          // was " t"
  CHECK(v.types[259] == int32_t(llmq::TokenType::Normal));
  for (const std::string& t : v.tokens) CHECK(t.find(' ') == std::string::npos);

  // Reading to the end of the file gives the same vocabulary.
  const llmq::Vocab all = llmq::read_llama2c_tokenizer(shared(kTok512));
  CHECK(all.tokens == v.tokens);
  CHECK(all.scores == v.scores);
}

TEST_CASE("tok512: encode, decode and byte fallback", "[tokenizer]") {
  const Tokenizer& t = tok512();
  CHECK(t.n_vocab() == 512);
  CHECK(t.bos() == 1);
  CHECK(t.eos() == 2);
  CHECK(t.token_id("\xE2\x96\x81") == 410);
  CHECK(t.token_id("<s>") == 1);
  CHECK(t.token_id("no such piece") == -1);

  CHECK(t.encode("Zoo", true) == std::vector<int32_t>{1, 410, 469, 347});
  CHECK(t.encode("Zoo", false) == std::vector<int32_t>{410, 469, 347});
  CHECK(t.encode("", true) == std::vector<int32_t>{1});
  CHECK(t.encode("", false).empty());

  const std::vector<std::string> texts = {
      "Once upon a time, there was a little girl named Lily.",
      "She loved to play outside in the park.",
      " Leading space and  two  spaces ",
      "Tom said, \"Look!\" and ran away.\nThe end.",
      "Numbers 12345 and symbols #%&*@ ~",
      "\n\nnewlines\tand tabs\n",
      "x",
      " ",
  };
  for (const std::string& s : texts) {
    INFO(escaped(s));
    const std::vector<int32_t> ids = t.encode(s, true);
    REQUIRE(!ids.empty());
    CHECK(ids[0] == 1);
    CHECK(t.decode(ids) == s);
    CHECK(t.decode(t.encode(s, false)) == s);
    // Streaming decode piece by piece gives the same text.
    std::string streamed;
    for (size_t i = 0; i < ids.size(); ++i) streamed += t.decode_piece(i == 0 ? -1 : ids[i - 1], ids[i]);
    CHECK(streamed == s);
  }

  // The whole TinyStories head round-trips.
  const std::string stories = read_bytes(shared("text/tinystories-valid-head.txt"));
  CHECK(t.decode(t.encode(stories, true)) == stories);

  // Characters outside the vocabulary fall back to their UTF-8 bytes (<0xNN> is id 3 + NN).
  const std::string cjk = "\xE6\x97\xA5\xE6\x9C\xAC";  // 日本
  std::vector<int32_t> expect = {1, 410};
  for (unsigned char c : cjk) expect.push_back(3 + c);
  CHECK(t.encode(cjk, true) == expect);
  CHECK(t.decode(expect) == cjk);
  CHECK(t.decode_piece(3 + 0xE6, 3 + 0x97) == "\x97");

  // Malformed UTF-8 bytes are single characters and come back unchanged.
  const std::string bad = "a\xFF" "b\xE6" "c";
  CHECK(t.decode(t.encode(bad, false)) == bad);

  // Control and unknown pieces decode to nothing; out-of-range ids are usage errors.
  CHECK(t.decode_piece(-1, 1).empty());
  CHECK(t.decode_piece(5, 2).empty());
  CHECK(t.decode_piece(5, 0).empty());
  CHECK(t.decode_piece(1, 410).empty());  // the dummy prefix after BOS
  CHECK(t.decode_piece(469, 410) == " ");
  CHECK_THROWS_AS(t.decode_piece(-1, 512), UsageError);
  CHECK_THROWS_AS(t.decode_piece(-1, -1), UsageError);
  CHECK_THROWS_AS(t.decode({1, 99999}), UsageError);
}

TEST_CASE("BPE merge order, ties and user-defined pieces on a small vocabulary", "[tokenizer]") {
  using TT = llmq::TokenType;
  llmq::Vocab v;
  v.add_space_prefix = false;
  v.unk_id = 0;
  v.bos_id = 1;
  v.eos_id = 2;
  auto add = [&](const std::string& piece, float score, TT type) {
    v.tokens.push_back(piece);
    v.scores.push_back(score);
    v.types.push_back(int32_t(type));
    return int32_t(v.tokens.size() - 1);
  };
  add("<unk>", 0, TT::Unknown);
  add("<s>", 0, TT::Control);
  add("</s>", 0, TT::Control);
  const int32_t a = add("a", -1, TT::Normal);
  const int32_t b = add("b", -1, TT::Normal);
  const int32_t c = add("c", -1, TT::Normal);
  const int32_t aa = add("aa", -2, TT::Normal);
  const int32_t ab = add("ab", -3, TT::Normal);
  const int32_t bc = add("bc", -1.5f, TT::Normal);
  const int32_t abc = add("abc", -4, TT::Normal);
  const int32_t tag = add("<ab>", 0, TT::UserDefined);
  add("ca", 5, TT::Control);  // a control piece is never a merge result
  const Tokenizer t(v);

  CHECK(t.encode("aaa", false) == std::vector<int32_t>{aa, a});      // tie: leftmost pair first
  CHECK(t.encode("aaaa", false) == std::vector<int32_t>{aa, aa});
  CHECK(t.encode("aab", false) == std::vector<int32_t>{aa, b});      // "aa" outscores "ab"
  CHECK(t.encode("abc", false) == std::vector<int32_t>{abc});        // via a + bc ("bc" first)
  CHECK(t.encode("abcb", false) == std::vector<int32_t>{abc, b});
  CHECK(t.encode("ab", false) == std::vector<int32_t>{ab});
  CHECK(t.encode("ca", false) == std::vector<int32_t>{c, a});
  CHECK(t.encode("a<ab>b", false) == std::vector<int32_t>{a, tag, b});  // taken whole, never merged
  // No byte pieces: an unknown character is one <unk>; spaces need "▁", absent here.
  CHECK(t.encode("axb", false) == std::vector<int32_t>{a, 0, b});
  CHECK(t.encode("a\xE6\x97\xA5", false) == std::vector<int32_t>{a, 0});
  CHECK(t.decode({a, bc, tag}) == "abc<ab>");
}

TEST_CASE("Tokenizer rejects unsupported or inconsistent vocabularies", "[tokenizer]") {
  llmq::Vocab v = llmq::read_llama2c_tokenizer(shared(kTok512), 512);
  {
    llmq::Vocab g = v;
    g.model = "bert";
    CHECK_THROWS_AS(Tokenizer(std::move(g)), UsageError);
  }
  {
    llmq::Vocab g = v;
    g.model = "gpt2";  // byte-level BPE needs merges
    CHECK_THROWS_AS(Tokenizer(std::move(g)), UsageError);
  }
  {
    llmq::Vocab g = v;
    g.scores.pop_back();
    CHECK_THROWS_AS(Tokenizer(std::move(g)), UsageError);
  }
  {
    llmq::Vocab g = v;
    g.bos_id = 512;
    CHECK_THROWS_AS(Tokenizer(std::move(g)), UsageError);
  }
  CHECK_THROWS_AS(Tokenizer(llmq::Vocab{}), UsageError);
  // A copy of a tokenizer works on its own.
  Tokenizer a(v);
  Tokenizer b = a;
  CHECK(b.encode("Zoo", true) == std::vector<int32_t>{1, 410, 469, 347});
}

TEST_CASE("Bad tokenizer files throw FileError", "[tokenizer]") {
  using Catch::Matchers::Contains;
  const std::string dir = llmq::test::scratch("llmq-tok-test");
  const std::string good = read_bytes(shared(kTok512));
  REQUIRE(good.size() == 6227);
  auto path = [&](const std::string& name) { return dir + "/" + name; };

  // Truncated copies: every cut fails with the expected count; cuts inside a token, or before
  // the first token, fail even when reading to the end of the file.
  for (size_t cut : {size_t(0), size_t(2), size_t(4), size_t(7), size_t(11), size_t(101),
                     good.size() / 2, good.size() - 1}) {
    INFO("cut at " << cut);
    const std::string p = path(fmt::format("cut{}.bin", cut));
    write_bytes(p, good.substr(0, cut));
    CHECK_THROWS_AS(llmq::read_llama2c_tokenizer(p, 512), FileError);
    if (cut != good.size() / 2) CHECK_THROWS_AS(llmq::read_llama2c_tokenizer(p), FileError);
  }
  CHECK_THROWS_WITH(llmq::read_llama2c_tokenizer(path("cut101.bin"), 512), Contains("cut101.bin"));

  auto with_i32 = [&](size_t offset, int32_t value) {
    std::string d = good;
    std::memcpy(d.data() + offset, &value, 4);
    return d;
  };
  // The first token's length field is at offset 8 (after max_token_length and its score).
  write_bytes(path("negative.bin"), with_i32(8, -5));
  CHECK_THROWS_WITH(llmq::read_llama2c_tokenizer(path("negative.bin"), 512), Contains("negative"));
  CHECK_THROWS_AS(llmq::read_llama2c_tokenizer(path("negative.bin")), FileError);
  write_bytes(path("huge.bin"), with_i32(8, 0x7FFFFFF0));
  CHECK_THROWS_WITH(llmq::read_llama2c_tokenizer(path("huge.bin"), 512), Contains("absurd"));
  CHECK_THROWS_AS(llmq::read_llama2c_tokenizer(path("huge.bin")), FileError);
  write_bytes(path("past_end.bin"), with_i32(8, 100000));
  CHECK_THROWS_AS(llmq::read_llama2c_tokenizer(path("past_end.bin"), 512), FileError);
  write_bytes(path("over_max.bin"), with_i32(8, 40));  // in the file, but over max_token_length 7
  CHECK_THROWS_AS(llmq::read_llama2c_tokenizer(path("over_max.bin"), 512), FileError);
  write_bytes(path("bad_header.bin"), with_i32(0, -1));
  CHECK_THROWS_AS(llmq::read_llama2c_tokenizer(path("bad_header.bin"), 512), FileError);
  write_bytes(path("header_only.bin"), good.substr(0, 4));
  CHECK_THROWS_WITH(llmq::read_llama2c_tokenizer(path("header_only.bin")), Contains("no tokens"));

  // Wrong counts.
  CHECK_THROWS_AS(llmq::read_llama2c_tokenizer(shared(kTok512), 511), FileError);
  CHECK_THROWS_AS(llmq::read_llama2c_tokenizer(shared(kTok512), 513), FileError);
  CHECK_THROWS_AS(llmq::read_llama2c_tokenizer(shared(kTok512), 0), FileError);
  CHECK_THROWS_AS(llmq::read_llama2c_tokenizer(shared(kTok512), 2000000000), FileError);
  write_bytes(path("trailing.bin"), good + "abc");
  CHECK_THROWS_AS(llmq::read_llama2c_tokenizer(path("trailing.bin")), FileError);

  // Missing files and non-SentencePiece files.
  CHECK_THROWS_AS(llmq::read_llama2c_tokenizer(path("does-not-exist.bin")), FileError);
  CHECK_THROWS_AS(llmq::read_llama2c_tokenizer(dir), FileError);
  CHECK_THROWS_AS(llmq::read_sentencepiece_model(path("does-not-exist.model")), FileError);
  CHECK_THROWS_AS(llmq::read_sentencepiece_model(shared(kTok512)), FileError);
  write_bytes(path("garbage.model"), std::string("\x0a\xff\xff\xff\xff\x0f", 6));
  CHECK_THROWS_AS(llmq::read_sentencepiece_model(path("garbage.model")), FileError);
}

TEST_CASE("Llama-2 tokenizer.model is read through sentencepiece", "[tokenizer]") {
  const Tokenizer& t = llama2();
  const llmq::Vocab& v = t.vocab();
  REQUIRE(t.n_vocab() == 32000);
  CHECK(v.bos_id == 1);
  CHECK(v.eos_id == 2);
  CHECK(v.unk_id == 0);
  CHECK(v.pad_id == -1);
  CHECK(v.add_space_prefix);
  CHECK(v.tokens[1] == "<s>");
  CHECK(v.types[1] == int32_t(llmq::TokenType::Control));
  CHECK(v.types[0] == int32_t(llmq::TokenType::Unknown));
  CHECK(v.tokens[13] == "<0x0A>");
  CHECK(v.types[13] == int32_t(llmq::TokenType::Byte));
  CHECK(v.tokens[29871] == "\xE2\x96\x81");
  CHECK(v.tokens[15043] == "\xE2\x96\x81Hello");
  CHECK(t.token_id("\xE2\x96\x81Hello") == 15043);
  CHECK(t.encode("Hello world", true) == std::vector<int32_t>{1, 15043, 3186});
  CHECK(t.decode({1, 15043, 3186}) == "Hello world");
}

TEST_CASE("Llama-2 encodes llama.cpp's llama-spm vectors exactly", "[tokenizer]") {
  const Tokenizer& t = llama2();
  const std::vector<VocabCase> cases = load_vectors(shared(kSpmVectors));
  REQUIRE(cases.size() == 46);
  CHECK(cases[0].text == "ied 4 \xC2\xBD months");
  CHECK(cases[2].text.empty());
  CHECK(cases[2].ids.empty());

  sentencepiece::SentencePieceProcessor sp;
  REQUIRE(sp.Load(shared(kLlama2)).ok());

  size_t passed = 0, library_differs = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const VocabCase& c = cases[i];
    const std::vector<int32_t> got = t.encode(c.text, false);
    const std::vector<int32_t> lib = spm_encode(sp, c.text);
    INFO("case " << i << ": " << escaped(c.text) << "\n  expected " << ids_str(c.ids) << "\n  got      "
                 << ids_str(got) << "\n  sentencepiece " << ids_str(lib));
    CHECK(got == c.ids);
    if (got == c.ids) ++passed;
    if (lib != c.ids) {
      ++library_differs;
      WARN("sentencepiece library differs from llama.cpp's .out on case " << i);
    }
    // Decoding gives the input back (the inputs are valid UTF-8).
    CHECK(t.decode(got) == c.text);
  }
  CHECK(passed == cases.size());
  CHECK(library_differs == 0);
}

TEST_CASE("Llama-2 encoding equals the sentencepiece library on real text", "[tokenizer]") {
  const Tokenizer& t = llama2();
  sentencepiece::SentencePieceProcessor sp;
  REQUIRE(sp.Load(shared(kLlama2)).ok());
  const std::string stories = read_bytes(shared("text/tinystories-valid-head.txt"));
  CHECK(t.encode(stories, true) == [&] {
    std::vector<int32_t> ids = spm_encode(sp, stories);
    ids.insert(ids.begin(), 1);
    return ids;
  }());
  // Line by line over the start of WikiText-2.
  std::istringstream wiki(read_bytes(shared("text/wikitext2-test.txt")));
  int n = 0;
  for (std::string line; n < 400 && std::getline(wiki, line); ++n) {
    INFO("line " << n << ": " << escaped(line));
    CHECK(t.encode(line, false) == spm_encode(sp, line));
  }
}

// Manual check (hidden; run with "[.tokenizer-speed]"): encodes the whole 1.3 MB WikiText-2
// test file, prints the time, and compares with the sentencepiece library. Not timed-asserted.
TEST_CASE("Llama-2 encodes WikiText-2 quickly", "[.tokenizer-speed]") {
  const Tokenizer& t = llama2();
  const std::string text = read_bytes(shared("text/wikitext2-test.txt"));
  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<int32_t> ids = t.encode(text, true);
  const auto t1 = std::chrono::steady_clock::now();
  sentencepiece::SentencePieceProcessor sp;
  REQUIRE(sp.Load(shared(kLlama2)).ok());
  const auto t2 = std::chrono::steady_clock::now();
  std::vector<int32_t> lib = spm_encode(sp, text);
  const auto t3 = std::chrono::steady_clock::now();
  lib.insert(lib.begin(), 1);
  auto secs = [](auto d) { return std::chrono::duration<double>(d).count(); };
  std::cout << fmt::format("wikitext2-test: {} bytes -> {} tokens in {:.3f} s (sentencepiece: {:.3f} s)\n",
                           text.size(), ids.size(), secs(t1 - t0), secs(t3 - t2));
  CHECK(ids == lib);
  CHECK(t.decode(ids) == text);
}
