// The tokenizer fuzz targets' shared driver (fuzz/tokenizer_spm.cpp, fuzz/tokenizer_bpe.cpp).
//
// Input layout: byte 0 holds flags, the rest is the payload.
//   bits 0-1  which tokenizer (index modulo the number loaded)
//   bit 2     add_bos
//   bit 3     parse_special
//   bit 4     show_special (decoding)
//   bit 5     decode mode: the payload is little-endian int32 token ids (any value, out of
//             range included), decoded with decode() and decode_piece(); otherwise it is text
//             to encode.
// Checked: encode gives ids in range; decode accepts every id encode gives; an out-of-range id
// is a UsageError; and the documented round trips hold: "llama" decode(encode(text)) == text
// for valid UTF-8 without U+2581 and without the text of a user-defined piece (such a piece is
// split out of the raw text and the rest after it gets SentencePiece's dummy space prefix, as
// in llama.cpp), "gpt2" for any bytes when the vocabulary has all 256 byte pieces as Normal pieces (both
// without parse_special).
#pragma once
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "text/tokenizer.h"
#include "text/unicode.h"
#include "base/error.h"
#include "fuzz/fuzz_common.h"

namespace llmq::fuzz {

/// A tokenizer under test and whether its documented round trip applies to any input.
struct TokenizerCase {
  std::string name;
  Tokenizer tok;
  bool all_byte_pieces = false;  ///< "gpt2": every byte's GPT-2 character is a piece
};

/// Whether a byte-level vocabulary has the one-character piece of every byte as a Normal
/// piece (a byte whose piece is UserDefined decodes as the piece's text, see Tokenizer::decode).
inline bool has_all_byte_pieces(const Tokenizer& t) {
  for (int b = 0; b < 256; ++b) {
    std::string piece;
    unicode::append_utf8(piece, unicode::byte_to_unicode(uint8_t(b)));
    const int32_t id = t.token_id(piece);
    if (id < 0 || t.vocab().types[size_t(id)] != int32_t(TokenType::Normal)) return false;
  }
  return true;
}

/// `s` as hex bytes, for messages.
inline std::string hex(std::string_view s) {
  std::string out;
  char buf[4];
  for (unsigned char c : s) std::snprintf(buf, sizeof buf, "%02x ", c), out += buf;
  return out;
}

/// Runs one fuzz input against `cases` (see the layout above).
inline void run_tokenizer_input(const std::vector<TokenizerCase>& cases, const uint8_t* data, size_t size) {
  if (size == 0 || cases.empty()) return;
  const uint8_t flags = data[0];
  const TokenizerCase& c = cases[(flags & 3u) % cases.size()];
  const Tokenizer& tok = c.tok;
  const bool add_bos = flags & 4u, parse_special = flags & 8u, show_special = flags & 16u;
  const std::string_view payload(reinterpret_cast<const char*>(data + 1), size - 1);
  const auto n_vocab = int64_t(tok.n_vocab());

  if (flags & 32u) {
    std::vector<int32_t> ids(payload.size() / 4);
    if (!ids.empty()) std::memcpy(ids.data(), payload.data(), ids.size() * 4);
    bool in_range = true;
    for (int32_t id : ids) in_range = in_range && id >= 0 && id < n_vocab;
    try {
      tok.decode(ids, show_special);
      if (!in_range) fail(c.name + ": decode accepted an out-of-range id");
    } catch (const UsageError&) {
      if (in_range) fail(c.name + ": decode refused ids in range");
    }
    int32_t prev = -1;
    for (int32_t id : ids) {
      try {
        tok.decode_piece(prev, id, show_special);
      } catch (const UsageError&) {
        if (id >= 0 && id < n_vocab) fail(c.name + ": decode_piece refused an id in range");
      }
      prev = id;
    }
    return;
  }

  std::vector<int32_t> ids;
  try {
    ids = tok.encode(payload, add_bos, parse_special);
  } catch (const UsageError&) {
    return;  // documented: "llama" vocabulary with neither byte pieces nor an unknown piece
  }
  for (int32_t id : ids)
    if (id < 0 || id >= n_vocab) fail(c.name + ": encode gave id " + std::to_string(id) + " out of range");
  const std::string text = tok.decode(ids, show_special);
  if (parse_special || show_special) return;
  // "llama": a literal U+2581 in the text decodes as a space (as in SentencePiece), so such
  // texts are left out of the round trip.
  bool user_defined = false;
  for (int32_t id : ids)
    user_defined = user_defined || (size_t(id) < tok.vocab().types.size() && tok.vocab().types[size_t(id)] == int32_t(TokenType::UserDefined));
  const bool round_trip = tok.byte_level() ? c.all_byte_pieces
                                           : valid_utf8(payload) && payload.find("\xE2\x96\x81") == std::string_view::npos && !user_defined;
  if (round_trip && text != payload) {
    std::string why = c.name;  // (appended piece by piece: GCC 12's -Wrestrict misfires on a + chain here)
    why += ": decode(encode(text)) != text\n  text:   ";
    why += hex(payload);
    why += "\n  ids:   ";
    for (int32_t id : ids) {
      why += ' ';
      why += std::to_string(id);
      why += "(type ";
      why += std::to_string(tok.vocab().types[size_t(id)]);
      why += ')';
    }
    fail(why + "\n  decode: " + hex(text));
  }
}

/// The cases `build()` returns, built once (the first call); a failure to load them (missing
/// files in ../shared) prints which and exits 1: a setup error, not a finding.
template <class F>
const std::vector<TokenizerCase>& load_cases_once(const char* target, F build) {
  static const std::vector<TokenizerCase> cases = [&] {
    try {
      return build();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s: cannot load the vocabularies (set LLMQ_SHARED_DIR): %s\n", target, e.what());
      std::exit(1);
    }
  }();
  return cases;
}

}  // namespace llmq::fuzz

/// The libFuzzer entry points of a tokenizer target whose cases come from `cases_fn()`:
/// LLVMFuzzerInitialize loads the vocabularies before the first input (seconds under ASan, which
/// must not count against libFuzzer's per-input -timeout); every input goes through
/// run_tokenizer_input.
#define LLMQ_TOKENIZER_FUZZ_TARGET(cases_fn)                                   \
  extern "C" int LLVMFuzzerInitialize(int*, char***) {                         \
    cases_fn();                                                                \
    return 0;                                                                  \
  }                                                                            \
  extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {   \
    llmq::fuzz::run_tokenizer_input(cases_fn(), data, size);                   \
    return 0;                                                                  \
  }
