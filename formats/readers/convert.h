// Conversion of an opened source checkpoint (llama2.c, later GGUF and safetensors) to `.llmq`.
#pragma once
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "formats/readers/llama2c.h"
#include "formats/vocab.h"

namespace llmq {

struct ConvertOptions {
  /// Type of 2-D weights; 1-D tensors always stay F32. Unset: every tensor keeps the type it
  /// has in the source when that is one of ours (a byte copy: lossless); see choose_type.
  std::optional<DType> type;
  /// Per-tensor overrides, "glob pattern" -> type (fnmatch syntax, e.g. "token_embd.weight",
  /// "blk.*.ffn_down.weight"); the first matching pattern wins.
  std::vector<std::pair<std::string, DType>> overrides;
  bool overwrite = false;
  bool progress = false;       ///< draw a progress bar on stderr
  std::string source_path;     ///< recorded in the provenance metadata (hashed with XXH64)
  std::string chat_template;   ///< stored as tokenizer.chat_template when non-empty
};

/// What happened to one tensor.
struct ConvertedTensor {
  std::string name;
  DType type;
  bool fell_back;       ///< requested type did not fit the row length; stored as F16
  double rel_rms_error; ///< ||w - dequant(quant(w))|| / ||w||
  uint64_t bytes;
  int64_t numel;
};

struct ConvertReport {
  std::vector<ConvertedTensor> tensors;
  uint64_t file_bytes = 0;
  uint64_t weight_bytes = 0;
  int64_t weights = 0;
};

/// The type a tensor gets: F32 for 1-D tensors; else the first matching override, else
/// opts.type, else (no type asked for) the source's own type when it has one of ours (raw),
/// else F16; and F16 when the row length is not a multiple of the chosen type's block
/// (sets *fell_back).
DType choose_type(const SourceTensor& t, const ConvertOptions& opts, bool* fell_back);

/// Writes `out` (atomically; see LlmqWriter) from `src` and `vocab`. Holds one tensor in
/// memory at a time. A tensor whose chosen type equals its raw source type is copied byte for
/// byte (lossless repack); others are dequantized to fp32 and quantized. Throws FileError (I/O, source faults) or UsageError (NaN/Inf weights,
/// vocabulary size mismatch).
ConvertReport convert_to_llmq(const SourceModel& src, const Vocab& vocab, const std::string& out, const ConvertOptions& opts);

/// XXH64 of a whole file, streamed (hex string). Throws FileError.
std::string file_xxh64(const std::string& path);

}  // namespace llmq
