// Qwen2 and Qwen2.5 (Qwen team 2024, "Qwen2 technical report"): a Llama block with biases on the
// q, k and v projections (none on the output), RoPE with base 1e6 and rotate-half pairs, often
// tied embeddings (the small models). transformers: modeling_qwen2.py. Its sliding window is off
// in every released checkpoint (use_sliding_window: false); a file that sets
// qwen2.attention.sliding_window gets it.
#include "models/architecture.h"

namespace llmq {

const Architecture kQwen2 = {
    "qwen2",
    "Qwen2, Qwen2.5, Qwen2.5-Coder (q/k/v biases)",
    [](const Metadata&, ModelConfig& c) {
      c.norms = NormPlacement::Pre;
      c.act = Activation::SwiGLU;
      c.qk_norm = false;
      c.embed_scale = false;
      c.attn_qkv_bias = true;
    },
};

}  // namespace llmq
