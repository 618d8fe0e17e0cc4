// Text <-> token ids: SentencePiece-style BPE (Llama, Llama-2, llama2.c; Vocab model "llama")
// and byte-level BPE (GPT-2 style: GPT-2, Llama-3, Qwen2, SmolLM, DeepSeek, Falcon, ...; Vocab
// model "gpt2").
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "text/unicode.h"
#include "formats/vocab.h"

namespace llmq {

/// A tokenizer over a `Vocab`.
///
/// `model == "llama"`: SentencePiece BPE (Kudo & Richardson, 2018, "SentencePiece: A simple
/// and language independent subword tokenizer and detokenizer for Neural Text Processing"),
/// with byte fallback. The reference behaviour is llama.cpp's SPM tokenizer (it reproduces
/// llama.cpp's test vectors for the Llama-2 vocabulary and the sentencepiece library's own
/// output).
///
/// `model == "gpt2"`: byte-level BPE (Radford et al., 2019, "Language Models are Unsupervised
/// Multitask Learners", openai/gpt-2 encoder.py; Sennrich et al., 2016 for BPE). The text is
/// split into words by the pre-tokenizer regexes that `vocab.pre` names (llama.cpp's table of
/// `tokenizer.ggml.pre` names, see known_pre_tokenizers()), each word's bytes are mapped to
/// GPT-2's printable characters (unicode::byte_to_unicode), and within each word the adjacent
/// pair with the lowest merge rank (its index in `vocab.merges`) is merged until none is left.
/// The reference is llama.cpp's BPE tokenizer and its test vectors.
///
/// Thread safety: all member functions are const and may be called concurrently.
class Tokenizer {
 public:
  /// Builds the lookup tables. Throws UsageError if `v.model` is neither "llama" nor "gpt2",
  /// the vocabulary is empty, its tokens/scores/types arrays differ in length, a type is not a
  /// TokenType, a score is NaN, a Byte token is not spelled "<0xNN>", bos/eos/unk/pad/eot ids
  /// are out of range, or ("gpt2") the vocabulary has no merges or `v.pre` names no known
  /// pre-tokenizer (the message lists the known names; an empty `pre` means "default", as in
  /// llama.cpp). Merges whose two parts or whose result are not pieces of the vocabulary can
  /// never apply and are ignored.
  explicit Tokenizer(Vocab v);

  /// Encodes UTF-8 text to token ids.
  ///
  /// Special tokens: with `parse_special`, the text of every Control, UserDefined or Unknown
  /// piece (e.g. "<|im_start|>", "<s>") found in the text is emitted as that single id
  /// (scanning left to right, the longest piece matching at a position wins), and the plain
  /// text between them is encoded as below. Without it, such text is ordinary text, except
  /// that UserDefined pieces are always split out of the raw text first (as llama.cpp and
  /// Hugging Face tokenizers do: Gemma's runs of spaces "  ", "   ", … are such pieces, spelled
  /// with real spaces, so they must be found before spaces become "▁").
  ///
  /// "llama" (SentencePiece BPE as llama.cpp's SPM tokenizer applies it): if the text is
  /// non-empty and the vocabulary has add_space_prefix, "▁" is prepended (to the text at the
  /// start and after each piece split out above, as llama.cpp does); every ' '
  /// becomes "▁" (U+2581). The text is split into UTF-8 characters (a malformed byte is a
  /// character of its own; a user-defined piece matching at a position is taken whole and
  /// never merged). Then, repeatedly, the adjacent pair whose concatenation is a Normal or
  /// UserDefined piece with the highest score is merged (ties: leftmost pair), until no pair
  /// is a piece. Each final symbol becomes its piece id; a symbol that is not a piece is
  /// emitted as one Byte piece "<0xNN>" per UTF-8 byte (a missing byte piece gives unk_id; a
  /// vocabulary with no byte pieces at all gives one unk_id per such symbol).
  ///
  /// "gpt2" (byte-level BPE as llama.cpp's BPE tokenizer applies it): the text is split into
  /// words by the pre-tokenizer's regexes, applied one after the other, each splitting every
  /// fragment into its matches and the stretches between them (llama.cpp's
  /// unicode_regex_split). Each word's bytes become one symbol each (the piece spelled by the
  /// byte's GPT-2 character); then the adjacent pair with the lowest merge rank is merged
  /// (ties: leftmost) until no pair has a merge. Pre-tokenizers that ignore merges (llama3,
  /// tekken) emit a word that is a piece as it is. A byte whose character is not a piece is
  /// dropped (as llama.cpp and Hugging Face do; some vocabularies lack a few control bytes).
  /// Malformed UTF-8 is kept: each bad byte is a character of category Cn, so
  /// decode(encode(text)) == text for any bytes when the vocabulary has all 256 byte pieces
  /// as Normal pieces (see decode()).
  ///
  /// Both take O(n log n) time in the text length ("gpt2": the regex matching of the built-in
  /// patterns is linear in practice; runs of one class are measured once). `add_bos`: prepend
  /// the BOS id (ignored if the vocabulary has none). Empty text gives [BOS] or []. Throws
  /// UsageError only if ("llama") an unknown character must be emitted and the vocabulary has
  /// neither byte pieces nor an unknown piece.
  std::vector<int32_t> encode(std::string_view text, bool add_bos, bool parse_special = false) const;

  /// The text of token `id` when it follows `prev_id` (for streaming output). Normal pieces:
  /// "llama": "▁" becomes ' '; "gpt2": each character is mapped back to its byte
  /// (unicode::unicode_to_byte; a character outside the map is kept as is). Byte pieces give
  /// their raw byte (possibly part of a UTF-8 sequence: the caller buffers). UserDefined pieces
  /// give their text ("llama": with "▁" as ' '). Control and Unknown pieces give "" unless
  /// `show_special`, then their text; Unused pieces give "". "llama": when `prev_id` is BOS or
  /// negative (start of text) and the vocabulary has add_space_prefix, one leading space is
  /// removed (the dummy prefix SentencePiece added when encoding). Throws UsageError if `id` is
  /// out of range (`prev_id` is only compared, never looked up).
  std::string decode_piece(int32_t prev_id, int32_t id, bool show_special = false) const;

  /// Concatenation of decode_piece over `ids` (the first token's prev_id is -1), so that
  /// decode(encode(text, add_bos)) == text for valid UTF-8 text ("llama": when the text holds no
  /// user-defined piece, after which the rest gets SentencePiece's dummy space prefix again, as
  /// in llama.cpp; "gpt2": for any bytes, given
  /// all 256 byte pieces as Normal pieces; where the piece of a byte's character is UserDefined,
  /// as a few single-character added tokens of DeepSeek's vocabularies are, that byte decodes as
  /// the piece's text, as llama.cpp and Hugging Face decode added tokens). Throws UsageError on
  /// an out-of-range id.
  std::string decode(const std::vector<int32_t>& ids, bool show_special = false) const;

  /// Id of the piece spelled exactly `piece` (the vocabulary's own spelling, e.g. "▁the",
  /// "<0x0A>", "<s>", or byte-level "Ġthe"), of any type; -1 if the vocabulary has no such
  /// piece.
  int32_t token_id(std::string_view piece) const;

  /// The vocabulary this tokenizer was built from.
  const Vocab& vocab() const { return vocab_; }
  /// BOS id (-1 if none).
  int32_t bos() const { return vocab_.bos_id; }
  /// EOS id (-1 if none).
  int32_t eos() const { return vocab_.eos_id; }
  /// Number of pieces in the vocabulary.
  size_t n_vocab() const { return vocab_.tokens.size(); }
  /// Whether this is a byte-level BPE ("gpt2") tokenizer.
  bool byte_level() const { return byte_level_; }

  /// The `tokenizer.ggml.pre` names a "gpt2" vocabulary may use, sorted ("" is taken as
  /// "default").
  static std::vector<std::string> known_pre_tokenizers();

 private:
  struct StringHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  using PieceMap = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;
  // Piece ids grouped by the first byte of their text, longest first.
  using FirstByteIndex = std::array<std::vector<int32_t>, 256>;
  struct Merge {
    int32_t rank;
    int32_t result;
  };

  void check_vocab() const;  // UsageError for an unsupported model, inconsistent arrays or ids out of range
  void index_pieces();       // all_, byte pieces, user-defined and special pieces' first-byte indexes
  void init_spm();
  void init_bpe();
  void init_bpe_merges();    // merges_: "left right" by rank
  void init_bpe_bytes();     // bpe_byte_piece_ and bpe_text_ (the bytes each Normal piece stands for)
  // Longest piece of `index` whose text starts at text[pos], as {id, length}; {-1, 0} if none.
  std::pair<int32_t, size_t> match_piece(const FirstByteIndex& index, std::string_view text, size_t pos) const;
  // Longest user-defined piece starting at text[pos], or 0 if none.
  size_t match_user_defined(std::string_view text, size_t pos) const;
  // Appends the SentencePiece encoding of `text` (no special-token parsing).
  void spm_encode(std::string_view text, bool space_prefix, std::vector<int32_t>& out) const;
  // spm_encode's steps on its working text and symbols: characters into merge segments, the
  // merges of each segment, the surviving symbols to ids (byte fallback).
  struct SpmScratch;
  void spm_split(SpmScratch& w) const;
  void spm_merge(SpmScratch& w) const;
  void spm_emit(const SpmScratch& w, std::vector<int32_t>& out) const;
  // Appends the byte-level BPE encoding of `text` (no special-token parsing).
  void bpe_encode(std::string_view text, std::vector<int32_t>& out) const;
  // Appends the ids of one pre-tokenized word (bytes of the original text).
  struct BpeScratch;
  void bpe_word(std::string_view word, BpeScratch& s, std::vector<int32_t>& out) const;

  Vocab vocab_;
  bool byte_level_ = false;
  PieceMap all_;       // every piece -> id (first occurrence wins)
  // SentencePiece: Normal and UserDefined pieces -> id: valid merge results / final symbols.
  PieceMap mergeable_;
  std::array<int32_t, 256> byte_id_{};  // byte value -> id of "<0xNN>" piece, -1 if none
  std::vector<int16_t> byte_value_;     // id -> byte value for Byte pieces, -1 otherwise
  bool has_byte_pieces_ = false;
  // User-defined pieces (SentencePiece takes them whole, never merged; byte-level BPE splits
  // them out before pre-tokenizing). Ids, not views, so that copies of a Tokenizer stay valid.
  FirstByteIndex user_defined_;
  bool has_user_defined_ = false;
  // Control, UserDefined and Unknown pieces: what parse_special recognizes.
  FirstByteIndex special_;
  bool has_special_ = false;
  // SentencePiece: every pair of adjacent characters (packed by char_pair_key) found inside a
  // mergeable piece. Where two neighbouring characters of the text form no such pair, no merge
  // can ever cross between them, so encode() runs the merges of each such segment on its own
  // (same result, small heaps).
  std::unordered_set<uint64_t> inner_pairs_;

  // Byte-level BPE.
  std::vector<unicode::Regex> pre_regex_;          // applied in order
  bool ignore_merges_ = false;                     // a word that is a piece is emitted whole
  std::unordered_map<uint64_t, Merge> merges_;     // (left id << 32 | right id) -> merge
  std::array<int32_t, 256> bpe_byte_piece_{};      // byte -> id of its one-character piece, -1
  std::vector<std::string> bpe_text_;              // id -> decoded bytes of Normal pieces
};

}  // namespace llmq
