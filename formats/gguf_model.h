// A Llama-architecture GGUF model opened for conversion to `.llmq`.
#pragma once
#include <string>

#include "formats/llama2c.h"  // SourceModel

namespace llmq {

/// Opens a GGUF model (general.architecture = llama): hyper-parameters from the llama.* keys,
/// its tokenizer and chat template, and its tensors (GGUF names are ours). Tensors stored as
/// F32, F16, BF16, Q8_0, Q4_0 or Q4_1 are offered raw (lossless repack); Q5_0, Q5_1, Q4_K,
/// Q5_K and Q6_K are dequantized to fp32 on read. Throws FileError (bad file, unsupported
/// architecture, or an unsupported tensor type naming the tensor and the type).
SourceModel read_gguf_model(const std::string& path);

}  // namespace llmq
