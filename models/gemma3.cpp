// Gemma 3 (Gemma Team 2025, "Gemma 3 technical report", section 2): RMSNorm before and after
// each sub-block (sandwich norms), QK-norm, GeGLU with the tanh gelu, embeddings × √dim, tied
// output; five sliding-window layers (window 512 for the small models) per global layer, the
// local layers with RoPE base 10,000 and the global ones with 1,000,000 (and linear scaling on
// the larger models). transformers: modeling_gemma3.py; llama.cpp fixes the same pattern (6) and
// local base when the GGUF does not say. Gemma's RMSNorm multiplies by (1 + w): llama.cpp's
// converter stores 1 + w, so the file's norm weights are used as they are (models from
// Hugging Face directories need the same +1 at import).
#include "models/architecture.h"

namespace llmq {

const Architecture kGemma3 = {
    "gemma3",
    "Gemma 3 (sandwich norms, QK-norm, GeGLU, sliding-window layers, sqrt(dim) embedding)",
    [](const Metadata& m, ModelConfig& c) {
      c.norms = NormPlacement::PrePost;
      c.act = Activation::GeGLU;
      c.qk_norm = true;
      c.embed_scale = true;
      if (!m.has("gemma3.attention.sliding_window_pattern")) c.swa_period = 6;
      if (!m.has("gemma3.rope.freq_base_swa")) c.rope_theta_local = 10000.0;
    },
};

}  // namespace llmq
