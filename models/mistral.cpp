// Mistral 7B (Jiang et al. 2023, "Mistral 7B", section 2): the Llama block with grouped-query
// attention and sliding-window attention on every layer (window 4096 in v0.1; v0.2 and later
// set no window, which makes them plain Llamas). transformers: modeling_mistral.py. llama.cpp's
// converter writes Mistral checkpoints as arch `llama` with Meta's interleaved q/k rows; a file
// that says `mistral` is read the same way.
#include "models/architecture.h"

namespace llmq {

const Architecture kMistral = {
    "mistral",
    "Mistral 7B and its fine-tunes (Llama block, sliding-window attention on every layer)",
    [](const Metadata&, ModelConfig& c) {
      c.norms = NormPlacement::Pre;
      c.act = Activation::SwiGLU;
      c.qk_norm = false;
      c.embed_scale = false;
      c.swa_period = 0;  // every layer slides when the file sets a window
    },
    RopeLayout::Interleaved,
};

}  // namespace llmq
