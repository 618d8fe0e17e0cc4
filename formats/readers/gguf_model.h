// A Llama-architecture GGUF model opened for conversion to `.llmq`.
#pragma once
#include <string>

#include "formats/readers/llama2c.h"  // SourceModel

namespace llmq {

/// Opens a GGUF model (general.architecture = llama): hyper-parameters from the llama.* keys,
/// its tokenizer and chat template, and its tensors (GGUF names are ours). Tensors stored as
/// F32, F16, BF16, Q8_0, Q4_0 or Q4_1 are offered raw (lossless repack); Q5_0, Q5_1, Q4_K,
/// Q5_K and Q6_K are dequantized to fp32 on read. Throws FileError (bad file, unsupported
/// architecture, or an unsupported tensor type naming the tensor and the type).
///
/// Keys (llama.cpp's names): llama.embedding_length, feed_forward_length, block_count,
/// attention.head_count, context_length and attention.layer_norm_rms_epsilon are required;
/// attention.head_count_kv defaults to head_count; head_dim = attention.key_length, else
/// embedding_length / head_count (as llama.cpp); rope.dimension_count and
/// attention.value_length, when present, must equal head_dim; rope.freq_base defaults to
/// 10000; a rope.scaling.type other than "none" (with a factor other than 1) and MoE models
/// are rejected; vocab_size defaults to the token count and must equal it. RoPE layout is
/// interleaved (llama.cpp's converter permutes Q/K to Meta's order); embeddings are tied
/// when there is no output.weight. The tokenizer comes from vocab_from_gguf (formats/readers/gguf.h).
///
/// Tensors: exactly those of tensor_table(config) with those shapes. The only extra
/// tensor accepted is rope_freqs.weight [head_dim/2] when all its factors are 1 (it changes
/// nothing); any other extra tensor is an error, as is a missing or mis-shaped one.
///
/// SourceModel::format is "GGUF v<version> (<file type>)", the file type named from
/// general.file_type (llama.cpp's llama_ftype, e.g. "Q4_1", "Q4_K_M") or else the type
/// holding most 2-D weights. The returned tensors read from the file's mapping, which
/// SourceModel::keepalive holds.
SourceModel read_gguf_model(const std::string& path);

}  // namespace llmq
