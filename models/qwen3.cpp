// Qwen3 dense models (Qwen team 2025, "Qwen3 technical report", section 2): the Qwen2 block
// without the q/k/v biases and with QK-norm (an RMSNorm over each head of q and of k, before
// RoPE); RoPE base 1e6, rotate-half pairs, head_dim 128 (key_length, not dim / heads).
// transformers: modeling_qwen3.py. Checked here against the fp64 reference of
// tests/test_arch.cpp on random weights; no real Qwen3 file is at hand yet.
#include "models/architecture.h"

namespace llmq {

const Architecture kQwen3 = {
    "qwen3",
    "Qwen3 dense (QK-norm, no biases)",
    [](const Metadata&, ModelConfig& c) {
      c.norms = NormPlacement::Pre;
      c.act = Activation::SwiGLU;
      c.qk_norm = true;
      c.embed_scale = false;
    },
};

}  // namespace llmq
