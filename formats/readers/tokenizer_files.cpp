// Tokenizer file readers: llama2.c `tokenizer.bin` and SentencePiece `tokenizer.model`.
#include "formats/readers/tokenizer_files.h"
#include "base/mapped_file.h"

#include <sentencepiece_processor.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string_view>
#include <system_error>

#include <fmt/format.h>

#include "base/error.h"

namespace llmq {
namespace {

constexpr std::string_view kSpaceMark = "\xE2\x96\x81";  // U+2581, SentencePiece's space
constexpr int64_t kMaxPieceBytes = int64_t(1) << 20;      // 1 MiB: no real piece comes near
constexpr uint64_t kMaxTokenizerFile = uint64_t(1) << 30; // 1 GiB: refuse anything larger

// Reads a whole (bounded-size) file into memory.
std::string read_whole_file(const std::string& path) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (ec || !std::filesystem::exists(status)) throw FileError(path, "cannot open: file not found");
  if (!std::filesystem::is_regular_file(status)) throw FileError(path, "not a regular file");
  const uint64_t size = std::filesystem::file_size(path, ec);
  if (ec) throw FileError(path, "cannot determine the file size: " + ec.message());
  if (size > kMaxTokenizerFile)
    throw FileError(path, fmt::format("file is {} bytes, too large for a tokenizer (limit {})", size,
                                      kMaxTokenizerFile));
  std::ifstream in = open_regular_file(path);
  std::string data(static_cast<size_t>(size), '\0');
  if (size > 0 && !in.read(data.data(), static_cast<std::streamsize>(size)))
    throw FileError(path, "read error");
  // The file may have changed size between stat and read; make sure nothing is left.
  if (in.peek() != std::char_traits<char>::eof()) throw FileError(path, "file grew while reading");
  return data;
}

// True for a piece spelled exactly "<0xNN>" with two upper-case hex digits (SentencePiece's
// byte-fallback pieces).
bool is_byte_piece(std::string_view p) {
  auto hex = [](char c) { return (c >= '0' && c <= '9') || (c >= 'A' && c <= 'F'); };
  return p.size() == 6 && p.substr(0, 3) == "<0x" && hex(p[3]) && hex(p[4]) && p[5] == '>';
}

// A bounds-checked little-endian cursor over an in-memory file.
class Cursor {
 public:
  Cursor(const std::string& path, std::string_view data) : path_(path), data_(data) {}
  size_t pos() const { return pos_; }
  size_t left() const { return data_.size() - pos_; }
  bool at_end() const { return pos_ == data_.size(); }

  int32_t i32(const char* what) {
    uint32_t u = u32(what);
    int32_t v;
    std::memcpy(&v, &u, 4);
    return v;
  }
  float f32(const char* what) {
    uint32_t u = u32(what);
    float v;
    std::memcpy(&v, &u, 4);
    return v;
  }
  std::string_view bytes(size_t n, const char* what) {
    need(n, what);
    std::string_view s = data_.substr(pos_, n);
    pos_ += n;
    return s;
  }

 private:
  void need(size_t n, const char* what) const {
    if (n > left())
      throw FileError(path_, fmt::format("truncated: {} needs {} bytes at offset {}, only {} left",
                                         what, n, pos_, left()));
  }
  uint32_t u32(const char* what) {
    need(4, what);
    const auto* b = reinterpret_cast<const unsigned char*>(data_.data() + pos_);
    pos_ += 4;
    return uint32_t(b[0]) | (uint32_t(b[1]) << 8) | (uint32_t(b[2]) << 16) | (uint32_t(b[3]) << 24);
  }

  const std::string& path_;
  std::string_view data_;
  size_t pos_ = 0;
};

// Replaces every plain space by U+2581.
std::string spaces_to_mark(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    if (c == ' ')
      out += kSpaceMark;
    else
      out += c;
  }
  return out;
}

// ---- Minimal protobuf wire-format reader (for the parts of ModelProto the library's public
// header does not expose: piece types USER_DEFINED, the trainer's model_type, the normalizer's
// add_dummy_prefix). Field numbers follow sentencepiece_model.proto.

struct WireField {
  uint32_t number = 0;
  uint32_t wire_type = 0;
  uint64_t varint = 0;         // wire types 0 (varint), 1 (fixed64), 5 (fixed32)
  std::string_view bytes;      // wire type 2 (length-delimited)
};

class WireReader {
 public:
  WireReader(const std::string& path, std::string_view data) : path_(path), data_(data) {}
  bool at_end() const { return pos_ >= data_.size(); }

  WireField next() {
    WireField f;
    const uint64_t key = varint();
    f.number = static_cast<uint32_t>(key >> 3);
    f.wire_type = static_cast<uint32_t>(key & 7);
    switch (f.wire_type) {
      case 0: f.varint = varint(); break;
      case 1: f.varint = fixed(8); break;
      case 5: f.varint = fixed(4); break;
      case 2: {
        const uint64_t n = varint();
        if (n > data_.size() - pos_) bad("length-delimited field runs past the end");
        f.bytes = data_.substr(pos_, static_cast<size_t>(n));
        pos_ += static_cast<size_t>(n);
        break;
      }
      default: bad(fmt::format("unsupported protobuf wire type {}", f.wire_type));
    }
    return f;
  }

 private:
  [[noreturn]] void bad(const std::string& what) const {
    throw FileError(path_, "malformed SentencePiece model (" + what + ")");
  }
  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (pos_ >= data_.size()) bad("truncated varint");
      const auto b = static_cast<unsigned char>(data_[pos_++]);
      v |= uint64_t(b & 0x7F) << shift;
      if (!(b & 0x80)) return v;
    }
    bad("varint longer than 10 bytes");
  }
  uint64_t fixed(size_t n) {
    if (n > data_.size() - pos_) bad("truncated fixed-width field");
    uint64_t v = 0;
    for (size_t i = 0; i < n; ++i) v |= uint64_t(static_cast<unsigned char>(data_[pos_ + i])) << (8 * i);
    pos_ += n;
    return v;
  }

  const std::string& path_;
  std::string_view data_;
  size_t pos_ = 0;
};

struct ProtoSummary {
  int32_t model_type = 1;             // TrainerSpec.model_type, default UNIGRAM (1); BPE is 2
  bool add_dummy_prefix = true;       // NormalizerSpec.add_dummy_prefix (default true)
  std::vector<int32_t> piece_types;   // SentencePiece.type per piece, default NORMAL (1)
};

ProtoSummary summarize_model_proto(const std::string& path, std::string_view proto) {
  ProtoSummary s;
  WireReader top(path, proto);
  while (!top.at_end()) {
    const WireField f = top.next();
    if (f.number == 1 && f.wire_type == 2) {  // repeated SentencePiece pieces
      int32_t type = 1;
      WireReader piece(path, f.bytes);
      while (!piece.at_end()) {
        const WireField pf = piece.next();
        if (pf.number == 3 && pf.wire_type == 0) type = static_cast<int32_t>(pf.varint);
      }
      s.piece_types.push_back(type);
    } else if (f.number == 2 && f.wire_type == 2) {  // TrainerSpec
      WireReader trainer(path, f.bytes);
      while (!trainer.at_end()) {
        const WireField tf = trainer.next();
        if (tf.number == 3 && tf.wire_type == 0) s.model_type = static_cast<int32_t>(tf.varint);
      }
    } else if (f.number == 3 && f.wire_type == 2) {  // NormalizerSpec
      WireReader norm(path, f.bytes);
      while (!norm.at_end()) {
        const WireField nf = norm.next();
        if (nf.number == 3 && nf.wire_type == 0) s.add_dummy_prefix = nf.varint != 0;
      }
    }
  }
  return s;
}

// One llama2.c token record at the cursor (f32 score, i32 length, the bytes) appended to v:
// the piece with spaces as U+2581, its score; the length checked against the header's max_len.
void read_llama2c_token(Cursor& cur, const std::string& path, int32_t max_len, Vocab& v) {
  const size_t id = v.tokens.size();
  const size_t at = cur.pos();
  const float score = cur.f32("token score");
  const int32_t len = cur.i32("token length");
  if (len < 0)
    throw FileError(path, fmt::format("token {} (offset {}) has a negative length {}", id, at, len));
  if (len > kMaxPieceBytes)
    throw FileError(path, fmt::format("token {} (offset {}) has an absurd length {} (over 1 MiB)",
                                      id, at, len));
  if (static_cast<size_t>(len) > cur.left())
    throw FileError(path, fmt::format("truncated: token {} (offset {}) has length {}, but only {} "
                                      "bytes are left", id, at, len, cur.left()));
  if (len > max_len)
    throw FileError(path, fmt::format("token {} (offset {}) has length {}, above the header's "
                                      "max_token_length {}", id, at, len, max_len));
  if (std::isnan(score)) throw FileError(path, fmt::format("token {} has a NaN score", id));
  const std::string_view raw = cur.bytes(static_cast<size_t>(len), "token bytes");
  v.tokens.push_back(spaces_to_mark(raw));
  v.scores.push_back(score);
}

// v.types for a llama2.c vocabulary: id 0 unknown, 1 and 2 control, "<0xNN>" pieces byte, the rest normal.
void set_llama2c_types(Vocab& v) {
  v.types.resize(v.tokens.size());
  for (size_t i = 0; i < v.tokens.size(); ++i) {
    TokenType t = TokenType::Normal;
    if (i == 0)
      t = TokenType::Unknown;
    else if (i == 1 || i == 2)
      t = TokenType::Control;
    else if (is_byte_piece(v.tokens[i]))
      t = TokenType::Byte;
    v.types[i] = static_cast<int32_t>(t);
  }
}

// Piece i's type: the library's unknown / control / byte / unused flags, else the ModelProto's
// USER_DEFINED, else normal.
TokenType sentencepiece_piece_type(const sentencepiece::SentencePieceProcessor& sp, const ProtoSummary& proto, int i) {
  TokenType t = TokenType::Normal;
  if (sp.IsUnknown(i))
    t = TokenType::Unknown;
  else if (sp.IsControl(i))
    t = TokenType::Control;
  else if (sp.IsByte(i))
    t = TokenType::Byte;
  else if (sp.IsUnused(i))
    t = TokenType::Unused;
  else if (proto.piece_types[static_cast<size_t>(i)] == static_cast<int32_t>(TokenType::UserDefined))
    t = TokenType::UserDefined;
  return t;
}

}  // namespace

Vocab read_llama2c_tokenizer(const std::string& path, int32_t expected_vocab) {
  const std::string data = read_whole_file(path);
  Cursor cur(path, data);

  const int32_t max_len = cur.i32("max_token_length");
  if (max_len <= 0 || max_len > kMaxPieceBytes)
    throw FileError(path, fmt::format("max_token_length {} is out of range (1..{})", max_len,
                                      kMaxPieceBytes));

  Vocab v;
  v.model = "llama";
  // Each token takes at least 8 bytes, which bounds any reservation by the real file size.
  const size_t most_tokens = cur.left() / 8;
  if (expected_vocab >= 0) {
    if (static_cast<size_t>(expected_vocab) > most_tokens)
      throw FileError(path, fmt::format("expected {} tokens, but the file ({} bytes) can hold at most {}",
                                        expected_vocab, data.size(), most_tokens));
    v.tokens.reserve(static_cast<size_t>(expected_vocab));
    v.scores.reserve(static_cast<size_t>(expected_vocab));
  }

  while (expected_vocab < 0 ? !cur.at_end() : v.tokens.size() < static_cast<size_t>(expected_vocab))
    read_llama2c_token(cur, path, max_len, v);

  if (expected_vocab >= 0 && !cur.at_end())
    throw FileError(path, fmt::format("{} bytes left after the expected {} tokens: the file holds more "
                                      "tokens than the model's vocabulary", cur.left(), expected_vocab));
  if (v.tokens.empty()) throw FileError(path, "the tokenizer holds no tokens");
  if (v.tokens.size() < 3)
    throw FileError(path, fmt::format("the tokenizer holds only {} tokens; ids 0 (<unk>), 1 (<s>) and "
                                      "2 (</s>) are required", v.tokens.size()));

  // llama2.c's exporter spelled BOS/EOS with surrounding newlines; restore SentencePiece's.
  if (v.tokens[1] == "\n<s>\n") v.tokens[1] = "<s>";
  if (v.tokens[2] == "\n</s>\n") v.tokens[2] = "</s>";

  set_llama2c_types(v);
  v.unk_id = 0;
  v.bos_id = 1;
  v.eos_id = 2;
  v.pad_id = -1;
  v.add_bos = true;
  v.add_space_prefix = true;
  return v;
}

Vocab read_sentencepiece_model(const std::string& path) {
  {
    std::error_code ec;
    if (!std::filesystem::is_regular_file(path, ec))
      throw FileError(path, "cannot open: not found or not a regular file");
  }
  sentencepiece::SentencePieceProcessor sp;
  const auto status = sp.Load(path);
  if (!status.ok()) throw FileError(path, "sentencepiece cannot load the model: " + status.ToString());

  const ProtoSummary proto = summarize_model_proto(path, sp.serialized_model_proto());
  if (proto.model_type != 2)
    throw FileError(path, fmt::format("SentencePiece model type is {} ({}); only BPE SentencePiece "
                                      "models are supported",
                                      proto.model_type,
                                      proto.model_type == 1   ? "unigram"
                                      : proto.model_type == 3 ? "word"
                                      : proto.model_type == 4 ? "char"
                                                              : "unknown"));

  const int n = sp.GetPieceSize();
  if (n <= 0) throw FileError(path, "the SentencePiece model holds no pieces");
  if (proto.piece_types.size() != static_cast<size_t>(n))
    throw FileError(path, fmt::format("ModelProto lists {} pieces, the library reports {}",
                                      proto.piece_types.size(), n));

  Vocab v;
  v.model = "llama";
  v.tokens.reserve(static_cast<size_t>(n));
  v.scores.reserve(static_cast<size_t>(n));
  v.types.reserve(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    const TokenType t = sentencepiece_piece_type(sp, proto, i);
    const float score = sp.GetScore(i);
    if (std::isnan(score)) throw FileError(path, fmt::format("piece {} has a NaN score", i));
    v.tokens.push_back(sp.IdToPiece(i));
    v.scores.push_back(score);
    v.types.push_back(static_cast<int32_t>(t));
  }
  v.bos_id = sp.bos_id();
  v.eos_id = sp.eos_id();
  v.unk_id = sp.unk_id();
  v.pad_id = sp.pad_id();
  v.add_bos = v.bos_id >= 0;
  v.add_space_prefix = proto.add_dummy_prefix;
  return v;
}

}  // namespace llmq
