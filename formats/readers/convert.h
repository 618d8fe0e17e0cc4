// Conversion of an opened source checkpoint (llama2.c, later GGUF and safetensors) to `.llmq`.
#pragma once
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "formats/readers/llama2c.h"
#include "formats/vocab.h"

namespace llmq {

/// llama.cpp's K-quant mixes by name ("q4_k_m", "q5_k_m"; facts from llama.cpp's
/// llama-quant.cpp, llama_tensor_get_type): every 2-D weight in `base` (Q4_K or Q5_K) except
/// output.weight (token_embd.weight when the embeddings are tied) in Q6_K, and attn_v and
/// ffn_down in Q6_K in the layers use_more_bits picks, counting those tensors in the source
/// file's order as llama.cpp's quantizer does (its converters have written layers both as
/// 0, 1, 2, … and as 0, 1, 10, 11, …, 2, …: SourceTensor::file_order), else in layer order.
struct QuantMix {
  DType base = DType::Q4_K;
  std::string name;  ///< "q4_k_m", recorded as general.file_type
};
/// The mix of that name, or nullopt when `name` is not a mix.
std::optional<QuantMix> quant_mix_from_name(const std::string& name);
/// llama.cpp's use_more_bits: layer i of n gets more bits when i < n/8, i >= 7n/8, or
/// (i − n/8) mod 3 == 2 (a third of the middle layers).
bool use_more_bits(int layer, int n_layers);
/// The type that stands in for a K-quant when a row does not hold whole 256-weight
/// super-blocks (llama.cpp's fallbacks): Q2_K and Q3_K → Q4_0, Q4_K → Q5_0, Q5_K → Q5_1, Q6_K → Q8_0; any other type
/// is returned unchanged.
DType k_quant_fallback(DType t);

struct ConvertOptions {
  /// Type of 2-D weights; 1-D tensors always stay F32. Unset: every tensor keeps the type it
  /// has in the source when that is one of ours (a byte copy: lossless); see choose_type.
  std::optional<DType> type;
  /// A K-quant mix instead of one type (type then unset).
  std::optional<QuantMix> mix;
  bool tied_output = false;              ///< for the mix: no output.weight (convert_to_llmq sets it)
  std::vector<std::string> more_bits;    ///< for the mix: the attn_v/ffn_down to store as Q6_K (ditto)
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
/// opts.type or the mix's choice, else (no type asked for) the source's own type when it has
/// one of ours (raw), else F16. A K-quant whose super-blocks do not fit the row takes
/// k_quant_fallback's type; F16 when the row length still is not a multiple of the chosen
/// type's block (sets *fell_back).
DType choose_type(const SourceTensor& t, const ConvertOptions& opts, bool* fell_back);

/// Writes `out` (atomically; see LlmqWriter) from `src` and `vocab`. Holds one tensor in
/// memory at a time. A tensor whose chosen type equals its raw source type is copied byte for
/// byte (lossless repack); others are dequantized to fp32 and quantized. Throws FileError (I/O, source faults) or UsageError (NaN/Inf weights,
/// vocabulary size mismatch).
ConvertReport convert_to_llmq(const SourceModel& src, const Vocab& vocab, const std::string& out, const ConvertOptions& opts);

/// XXH64 of a whole file, streamed (hex string). Throws FileError.
std::string file_xxh64(const std::string& path);

}  // namespace llmq
