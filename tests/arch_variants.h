// A test-only architecture, declared in this one file as a real one is in models/: a Llama with
// Gemma's sandwich norms (RMSNorm before and after each sub-block), QK-norm, GeGLU and the √dim
// embedding scale, plus Qwen2's q/k/v biases, Llama's output bias, a logit soft-cap and an
// explicit attention scale (those last four are keys any file may carry). No backend names it:
// the CPU (tests/test_arch.cpp) and the CUDA emulator (tests/test_cuda.cpp) run it through the
// recipe alone.
#pragma once
#include "models/architecture.h"
#include "test_util.h"

namespace llmq::test {

/// Registers "llama_sandwich" (idempotent).
inline void register_test_architectures() {
  register_architecture({"llama_sandwich", "test only: Llama + pre/post norms, QK-norm, GeGLU, √dim embedding",
                         [](const Metadata&, ModelConfig& c) {
                           c.norms = NormPlacement::PrePost;
                           c.qk_norm = true;
                           c.act = Activation::GeGLU;
                           c.embed_scale = true;
                         }});
}

/// The sandwich variant's config at test size (vocab 512: stories260K's tokenizer): 3 layers,
/// GQA 4/2 heads of 16, biases, soft-cap 30, attention scale 0.3, rotate-half RoPE.
inline ModelConfig sandwich_config() {
  register_test_architectures();
  ModelConfig c;
  c.arch = "llama_sandwich";
  c.n_heads = 4, c.n_kv_heads = 2, c.head_dim = 16, c.dim = 64, c.hidden_dim = 96, c.n_layers = 3;
  c.vocab_size = 512, c.context_length = 512;
  c.norms = NormPlacement::PrePost, c.qk_norm = true, c.act = Activation::GeGLU, c.embed_scale = true;
  c.attn_qkv_bias = c.attn_out_bias = true;
  c.logit_softcap = 30.0, c.attn_scale = 0.3;
  c.rope_layout = RopeLayout::RotateHalf;
  return c;
}

/// A Llama with sliding-window layers (window 7; every third layer global, as Gemma 3's pattern)
/// with their own RoPE base, and Llama 3.1's frequency scaling on the global layers.
inline ModelConfig sliding_config() {
  ModelConfig c;
  c.n_heads = 4, c.n_kv_heads = 2, c.head_dim = 16, c.dim = 64, c.hidden_dim = 96, c.n_layers = 3;
  c.vocab_size = 512, c.context_length = 1024;
  c.sliding_window = 7, c.swa_period = 3;
  c.rope_theta = 500000.0, c.rope_theta_local = 10000.0;
  c.rope_scaling = RopeScaling::Llama3, c.rope_factor = 8.0, c.rope_low_freq = 1.0, c.rope_high_freq = 4.0, c.rope_orig_ctx = 64;
  return c;
}

}  // namespace llmq::test
