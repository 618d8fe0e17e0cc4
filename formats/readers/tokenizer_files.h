// Readers for tokenizer files that come beside a model: llama2.c's `tokenizer.bin` and
// SentencePiece's `tokenizer.model`. Both give a `llmq::Vocab` in SentencePiece form (spaces as
// U+2581 "▁", byte-fallback pieces "<0xNN>"), ready for `llmq::Tokenizer`.
#pragma once
#include <cstdint>
#include <string>

#include "formats/vocab.h"

namespace llmq {

/// Reads a llama2.c `tokenizer.bin` (as written by llama2.c's `tokenizer.py` export).
///
/// Layout (little-endian): int32 `max_token_length`, then for each token: float32 score,
/// int32 byte length, that many bytes of piece text. The token count is not stored: with
/// `expected_vocab < 0` tokens are read until the end of the file; with `expected_vocab >= 0`
/// the file must hold exactly that many tokens (no more, no fewer).
///
/// The exporter wrote SentencePiece's U+2581 as a plain space and the BOS/EOS pieces as
/// "\n<s>\n" / "\n</s>\n"; both are undone here, so the returned pieces are SentencePiece's
/// ("▁the", "<s>", "</s>"). Types: id 0 Unknown, ids 1 and 2 Control, pieces spelled exactly
/// `<0xNN>` (two upper-case hex digits) Byte, the rest Normal. bos_id=1, eos_id=2, unk_id=0,
/// pad_id=-1, model "llama", add_bos and add_space_prefix true.
///
/// Throws FileError (naming the file) when the file cannot be read, is truncated, holds a
/// negative or absurd length (over 1 MiB, past the end of the file, or over max_token_length),
/// a NaN score, fewer than 3 tokens, or a token count other than `expected_vocab`.
Vocab read_llama2c_tokenizer(const std::string& path, int32_t expected_vocab = -1);

/// Reads a SentencePiece model (`tokenizer.model`, a serialized ModelProto) through the
/// sentencepiece library. Piece text, scores and types are copied (types from the library's
/// IsControl/IsUnknown/IsByte/IsUnused, user-defined pieces from the ModelProto itself);
/// bos/eos/unk/pad ids from the model; add_space_prefix from its normalizer's
/// add_dummy_prefix. Only BPE models (the kind Llama-2 uses) are accepted.
///
/// The model's normalizer is not carried over: llmq's Tokenizer only maps ' ' to "▁" and adds
/// the dummy prefix, which matches SentencePiece exactly for models with the "identity"
/// normalizer and remove_extra_whitespaces=false (Llama, Llama-2, llama2.c's models).
///
/// Throws FileError when the library cannot load the file, the model is not BPE, or the
/// model is empty.
Vocab read_sentencepiece_model(const std::string& path);

}  // namespace llmq
