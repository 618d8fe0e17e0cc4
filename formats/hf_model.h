// A Hugging Face Llama-family checkpoint directory opened for conversion to `.llmq`.
#pragma once
#include <string>

#include "formats/llama2c.h"  // SourceModel

namespace llmq {

/// Opens a Hugging Face checkpoint directory: config.json, model.safetensors or shards listed
/// in model.safetensors.index.json, the tokenizer (tokenizer.json or tokenizer.model),
/// tokenizer_config.json (chat template, special tokens) and generation_config.json.
/// F32/F16/BF16 tensors; HF names mapped to ours; RoPE layout rotate_half. Throws FileError.
SourceModel read_hf_model(const std::string& dir);

}  // namespace llmq
