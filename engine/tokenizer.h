// Text <-> token ids for SentencePiece-style BPE vocabularies (Llama, Llama-2, llama2.c).
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "formats/vocab.h"

namespace llmq {

/// A tokenizer over a `Vocab` with `model == "llama"`: SentencePiece BPE (Kudo & Richardson,
/// 2018, "SentencePiece: A simple and language independent subword tokenizer and detokenizer
/// for Neural Text Processing"), with byte fallback. The reference behaviour is llama.cpp's
/// SPM tokenizer (it reproduces llama.cpp's test vectors for the Llama-2 vocabulary and the
/// sentencepiece library's own output). Byte-level BPE (`model == "gpt2"`) is not supported yet.
///
/// Thread safety: all member functions are const and may be called concurrently.
class Tokenizer {
 public:
  /// Builds the lookup tables. Throws UsageError if `v.model` is not "llama", the vocabulary is
  /// empty, its tokens/scores/types arrays differ in length, a score is NaN, or bos/eos/unk ids
  /// are out of range.
  explicit Tokenizer(Vocab v);

  /// Encodes UTF-8 text to token ids.
  ///
  /// Algorithm (SentencePiece BPE as llama.cpp's SPM tokenizer applies it): if the text is
  /// non-empty and the vocabulary has add_space_prefix, "▁" is prepended; every ' ' becomes
  /// "▁" (U+2581). The text is split into UTF-8 characters (a malformed byte is a character of
  /// its own; a user-defined piece matching at a position is taken whole and never merged).
  /// Then, repeatedly, the adjacent pair whose concatenation is a Normal or UserDefined piece
  /// with the highest score is merged (ties: leftmost pair), until no pair is a piece. Each
  /// final symbol becomes its piece id; a symbol that is not a piece is emitted as one Byte
  /// piece "<0xNN>" per UTF-8 byte (a missing byte piece gives unk_id; a vocabulary with no
  /// byte pieces at all gives one unk_id per such symbol). O(n log n) in the text length.
  ///
  /// `add_bos`: prepend the BOS id (ignored if the vocabulary has none). Empty text gives
  /// [BOS] or []. Throws UsageError only if an unknown character must be emitted and the
  /// vocabulary has neither byte pieces nor an unknown piece.
  std::vector<int32_t> encode(std::string_view text, bool add_bos) const;

  /// The text of token `id` when it follows `prev_id` (for streaming output): "▁" becomes
  /// ' ', a Byte piece gives its raw byte (possibly part of a UTF-8 sequence: the caller
  /// buffers), Control/Unknown/Unused pieces give "". When `prev_id` is BOS or negative (start
  /// of text) and the vocabulary has add_space_prefix, one leading space is removed (the
  /// dummy prefix SentencePiece added when encoding). Throws UsageError if `id` is out of
  /// range (`prev_id` is only compared, never looked up).
  std::string decode_piece(int32_t prev_id, int32_t id) const;

  /// Concatenation of decode_piece over `ids` (the first token's prev_id is -1), so that
  /// decode(encode(text, add_bos)) == text for valid UTF-8 text. Throws UsageError on an
  /// out-of-range id.
  std::string decode(const std::vector<int32_t>& ids) const;

  /// Id of the piece spelled exactly `piece` (SentencePiece form, e.g. "▁the", "<0x0A>",
  /// "<s>"), of any type; -1 if the vocabulary has no such piece.
  int32_t token_id(std::string_view piece) const;

  /// The vocabulary this tokenizer was built from.
  const Vocab& vocab() const { return vocab_; }
  /// BOS id (-1 if none).
  int32_t bos() const { return vocab_.bos_id; }
  /// EOS id (-1 if none).
  int32_t eos() const { return vocab_.eos_id; }
  /// Number of pieces in the vocabulary.
  size_t n_vocab() const { return vocab_.tokens.size(); }

 private:
  struct StringHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  using PieceMap = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

  // Longest user-defined piece starting at text[pos], or 0 if none.
  size_t match_user_defined(std::string_view text, size_t pos) const;

  Vocab vocab_;
  PieceMap all_;       // every piece -> id (first occurrence wins)
  PieceMap mergeable_; // Normal and UserDefined pieces -> id: valid merge results / final symbols
  std::array<int32_t, 256> byte_id_{};  // byte value -> id of "<0xNN>" piece, -1 if none
  std::vector<int16_t> byte_value_;     // id -> byte value for Byte pieces, -1 otherwise
  bool has_byte_pieces_ = false;
  // Ids of user-defined pieces grouped by first byte, longest first (SentencePiece matches them
  // whole). Ids, not views, so that copies and moves of a Tokenizer stay valid.
  std::array<std::vector<int32_t>, 256> user_defined_;
  bool has_user_defined_ = false;
  // Every pair of adjacent characters (packed by char_pair_key) found inside a mergeable piece.
  // Where two neighbouring characters of the text form no such pair, no merge can ever cross
  // between them, so encode() runs the merges of each such segment on its own (same result,
  // small heaps).
  std::unordered_set<uint64_t> inner_pairs_;
};

}  // namespace llmq
