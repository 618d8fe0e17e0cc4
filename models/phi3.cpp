// Phi-3 (Abdin et al. 2024, "Phi-3 technical report"; Phi-3.5 the same block): the Llama block
// with the q, k and v projections fused into one qkv_proj [q + 2 kv, dim] and the gate and up
// projections into one gate_up_proj [2 hidden, dim] (gate first); sliding-window attention on
// every layer (2047 on the mini models); LongRoPE (Ding et al. 2024) for the 128k models: each
// frequency divided by its own factor, a short list up to the original 4k context and a long
// one beyond, with q·k scaled by the attention factor² (ModelConfig, RopeScaling::LongRope).
// transformers: modeling_phi3.py. The readers split the fused tensors by rows (an exact copy of
// whole rows, lossless for every block type), so the engine runs Phi-3 as separate projections.
#include "models/architecture.h"

namespace llmq {

const Architecture kPhi3 = {
    "phi3",
    "Phi-3, Phi-3.5 mini and medium (fused qkv and gate/up, sliding window, LongRoPE)",
    [](const Metadata&, ModelConfig& c) {
      c.norms = NormPlacement::Pre;
      c.act = Activation::SwiGLU;
      c.qk_norm = false;
      c.embed_scale = false;
      c.swa_period = 0;
    },
    RopeLayout::RotateHalf,
    /*fused_projections=*/true,
};

}  // namespace llmq
