// Llama (Touvron et al. 2023, "LLaMA"; Llama 2 and 3): pre-norm decoder; RMSNorm (Zhang &
// Sennrich 2019); rotary position embedding (Su et al. 2021), Llama 3.1's frequency scaling when
// the file says so; grouped-query attention (Ainslie et al. 2023); SwiGLU feed-forward (Shazeer
// 2020); optional attention biases (transformers' `attention_bias`). Also SmolLM2 and TinyLlama,
// which are Llamas. Everything Llama is ModelConfig's default recipe.
#include "models/architecture.h"

namespace llmq {

const Architecture kLlama = {
    "llama",
    "Llama 1/2/3, SmolLM2, TinyLlama (pre-norm, SwiGLU, RoPE, GQA)",
    [](const Metadata&, ModelConfig& c) {
      c.norms = NormPlacement::Pre;
      c.act = Activation::SwiGLU;
      c.qk_norm = false;
      c.embed_scale = false;
    },
    RopeLayout::Interleaved,
};

}  // namespace llmq
