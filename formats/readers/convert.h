// Conversion of an opened source checkpoint (llama2.c, later GGUF and safetensors) to `.llmq`.
#pragma once
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "formats/readers/llama2c.h"
#include "formats/vocab.h"

namespace llmq {

/// llama.cpp's K-quant mixes by name (facts from llama.cpp's llama-quant.cpp,
/// llama_tensor_get_type, for a dense model; its Falcon, mixture-of-experts and 70B-Llama
/// special cases are not followed): every 2-D weight in `base` except output.weight
/// (token_embd.weight when the embeddings are tied) in Q6_K, and these, where attn_v and
/// ffn_down are counted in the source file's order as llama.cpp's quantizer does (its
/// converters have written layers both as 0, 1, 2, … and as 0, 1, 10, 11, …, 2, …:
/// SourceTensor::file_order), i of n:
///  - "q4_k_m" (base Q4_K), "q5_k_m" (Q5_K): attn_v and ffn_down in Q6_K where use_more_bits(i, n);
///  - "q3_k_m" (Q3_K): attn_v Q5_K for i < 2, else Q4_K; ffn_down Q5_K for i < n/16, else Q4_K;
///    attn_output Q4_K;
///  - "q2_k" (Q2_K): attn_v Q4_K when 4 or more query heads share a KV head, else Q3_K;
///    ffn_down and attn_output Q3_K.
struct QuantMix {
  DType base = DType::Q4_K;
  std::string name;  ///< "q4_k_m", recorded as general.file_type
};
/// The mix of that name, or nullopt when `name` is not a mix.
std::optional<QuantMix> quant_mix_from_name(const std::string& name);
/// The mix's types for the attn_v, ffn_down and attn_output tensors among `ts` (those it does
/// not keep in its base type), for a model whose query heads per KV head are `gqa`.
std::map<std::string, DType> mix_tensor_types(const QuantMix& mix, const std::vector<SourceTensor>& ts, int64_t gqa);
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
  std::map<std::string, DType> mix_types;  ///< for the mix: mix_tensor_types (ditto)
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
