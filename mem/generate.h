// `llmq-mem generate`: GPU memory of text generation with a PyTorch framework (Hugging Face
// transformers, LitGPT, torchtune) in bf16 or with bitsandbytes int8/4-bit weights: what
// torch.cuda.max_memory_allocated() reports, beside llmq's own plan (`llmq-mem infer`).
#pragma once
#include <cstdint>
#include <string>

#include "mem/report.h"
#include "mem/shape.h"

namespace llmq::mem {

/// A generation run.
struct GenerateOptions {
  std::string framework = "transformers";  ///< transformers | litgpt | torchtune
  std::string weights = "bf16";            ///< bf16 | fp16 | int8 (LLM.int8) | nf4 | nf4-dq | fp4 (bitsandbytes 4-bit)
  int64_t batch = 1;
  int64_t prompt = 16;      ///< prompt tokens (one prefill pass)
  int64_t kv_len = 0;       ///< KV-cache positions per sequence (0: prompt + new_tokens)
  int64_t new_tokens = 64;
  bool flash = true;        ///< false: eager attention keeps [b, heads, prompt, prompt] scores during the prefill
  int compute_bytes = 2;    ///< bitsandbytes 4-bit compute dtype (4: float32, transformers' old default)
  std::string gpu;          ///< GPU model (--gpu): PyTorch's cuBLAS workspace is 32 MiB on sm_90, 8 MiB elsewhere
  /// transformers' release, "MAJOR.MINOR[.PATCH]": from 4.45 (some model types) and 5.0 (all),
  /// generate() computes the prefill's logits for the last prompt position only.
  std::string transformers_version = "5.0";
};

/// Whether transformers `version` ("MAJOR.MINOR[.PATCH]") computes only the last prompt position's
/// logits in generate()'s prefill for `model_type` (transformers' model_type): generate() passes
/// num_logits_to_keep = 1 (later logits_to_keep) from 4.45 to the models whose forward takes it.
/// Throws UsageError for a malformed version.
bool last_position_logits(const std::string& version, const std::string& model_type);

/// The report: weights (Linear layers in the weight format, the rest in 16 bits; the output
/// layer quantized or not as the framework does), the KV cache, and the prefill's largest
/// transient (logits, attention scores, a dequantized matrix). Throws UsageError for unknown
/// names or sizes < 1.
MemReport estimate_generate(const ModelShape& m, const GenerateOptions& o);

}  // namespace llmq::mem
