// A decoder-only model's hyper-parameters and its block recipe: what every backend executes.
//
// One struct, ModelConfig, holds both the sizes (dim, heads, layers, ...) and the block's
// recipe (norm placement, activation, RoPE style and scaling, attention biases, QK-norm,
// sliding-window layers, embedding scale, logit soft-capping, tied embeddings). An
// architecture (models/architecture.h, one file per architecture: models/llama.cpp, ...) is the
// function that fills the recipe from a file's metadata; the CPU forward (engine/model.cpp
// ShardPass) and the GPU's (engine/cuda/session.cpp CudaSession) read only this struct.
//
// Metadata keys follow GGUF's scheme, prefixed by the architecture's name: `<arch>.block_count`,
// `<arch>.attention.head_count`, ... (GGUF spec, "Standardized key-value pairs"); tensor names
// follow GGUF's too (docs/FORMAT.md).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "formats/llmq_file.h"

namespace llmq {

/// Which dimensions RoPE rotates together.
enum class RopeLayout {
  Interleaved,  ///< pairs (2i, 2i+1): Meta's and llama2.c's checkpoints, GGUF llama
  RotateHalf,   ///< pairs (i, i + head_dim/2): Hugging Face checkpoints (GPT-NeoX style)
};
const char* rope_layout_name(RopeLayout l);          ///< "interleaved" | "rotate_half"
RopeLayout rope_layout_from_name(const std::string&);  ///< throws MetadataError

/// How RoPE's frequencies are stretched for contexts longer than the trained one.
enum class RopeScaling {
  None,
  Linear,  ///< every frequency ÷ factor (position interpolation, Chen et al. 2023)
  Llama3,  ///< Llama 3.1's: low frequencies ÷ factor, high ones kept, a smooth ramp between
           ///< (Meta's reference `apply_scaling`; transformers `_compute_llama3_parameters`)
  LongRope,  ///< Phi-3's LongRoPE (Ding et al. 2024): frequency i ÷ factor[i], a short and a long
             ///< factor list (the long one when the run's context exceeds the original), and q·k
             ///< scaled by attn_factor² (transformers `_compute_longrope_parameters`)
};
const char* rope_scaling_name(RopeScaling s);            ///< "none" | "linear" | "llama3" | "longrope"
RopeScaling rope_scaling_from_name(const std::string&);  ///< throws MetadataError

/// Where each sub-block (attention, FFN) of a layer applies RMSNorm.
enum class NormPlacement {
  Pre,      ///< x += f(norm(x)): Llama, Qwen, Mistral, Phi-3
  PrePost,  ///< x += norm_post(f(norm_pre(x))): Gemma 2 and 3 ("sandwich" norms)
};
const char* norm_placement_name(NormPlacement p);             ///< "pre" | "pre_post"
NormPlacement norm_placement_from_name(const std::string& s);  ///< throws MetadataError

/// The gated feed-forward's activation: h = act(x·W_gateᵀ) ⊙ (x·W_upᵀ) (Shazeer 2020).
enum class Activation {
  SwiGLU,  ///< act = silu(g) = g / (1 + e^-g)
  GeGLU,   ///< act = gelu(g), tanh approximation: 0.5 g (1 + tanh(√(2/π)(g + 0.044715 g³)))
};
const char* activation_name(Activation a);             ///< "swiglu" | "geglu"
Activation activation_from_name(const std::string& s);  ///< throws MetadataError

/// How /v1/embeddings pools a sequence's final-norm hidden states into one vector. Stored as
/// GGUF's `<arch>.pooling_type` (llama.cpp's llama_pooling_type: 1 mean, 2 cls, 3 last).
enum class Pooling {
  Last,   ///< the last token's state: what a causal model's last position has seen of the whole
          ///< input (vLLM's default for decoder-only models; the default here when a file says nothing)
  Mean,   ///< the mean over the tokens (sentence-transformers' mean pooling)
  First,  ///< the first token's state (BERT's [CLS]; GGUF pooling_type 2)
};
const char* pooling_name(Pooling p);             ///< "last" | "mean" | "cls"
Pooling pooling_from_name(const std::string& s);  ///< throws MetadataError

/// Hyper-parameters and block recipe of a decoder-only transformer.
struct ModelConfig {
  std::string arch = "llama";  ///< the architecture (general.architecture; models/architecture.h)
  // ---- sizes
  int64_t dim = 0;             ///< embedding width (d_model)
  int64_t hidden_dim = 0;      ///< FFN width
  int64_t n_layers = 0;
  int64_t n_heads = 0;         ///< query heads
  int64_t n_kv_heads = 0;      ///< key/value heads (GQA: n_heads % n_kv_heads == 0)
  int64_t head_dim = 0;        ///< usually dim / n_heads
  int64_t vocab_size = 0;
  int64_t context_length = 0;  ///< trained context
  double norm_eps = 1e-5;      ///< RMSNorm epsilon
  // ---- RoPE (Su et al. 2021)
  double rope_theta = 10000.0;      ///< frequency base of the global layers
  double rope_theta_local = 0.0;    ///< base of the sliding-window layers; 0: rope_theta
  RopeLayout rope_layout = RopeLayout::Interleaved;
  RopeScaling rope_scaling = RopeScaling::None;  ///< applies to the global layers
  double rope_factor = 1.0;         ///< scaling factor (Linear, Llama3)
  double rope_low_freq = 1.0;       ///< Llama3: low_freq_factor
  double rope_high_freq = 4.0;      ///< Llama3: high_freq_factor
  int64_t rope_orig_ctx = 8192;     ///< Llama3, LongRope: original_max_position_embeddings
  std::vector<float> rope_short_factors;  ///< LongRope: [head_dim/2] divisors of the frequencies
  std::vector<float> rope_long_factors;   ///< LongRope: [head_dim/2], used when rope_use_long
  double rope_attn_factor = 0.0;    ///< LongRope: cos and sin × this; 0: √(1 + ln s / ln orig_ctx), s = context / orig_ctx
  bool rope_use_long = false;       ///< LongRope: the long factors (set by use_context, not stored)
  std::vector<float> rope_freq_factors;  ///< [head_dim/2] or empty: the global layers' frequency i ÷ factor[i]
                                         ///< (llama.cpp's `rope_freqs` tensor: how its converter stores Llama 3.1 scaling)
  // ---- the block's recipe
  NormPlacement norms = NormPlacement::Pre;
  Activation act = Activation::SwiGLU;
  bool qk_norm = false;          ///< RMSNorm over each head of q and k (weights [head_dim]) before RoPE: Qwen3, Gemma 3
  bool attn_qkv_bias = false;    ///< q, k, v projections add a bias (Qwen2; Llama `attention_bias`)
  bool attn_out_bias = false;    ///< the attention output projection adds a bias (Llama `attention_bias`)
  double attn_scale = 0.0;       ///< softmax scale of q·k; 0: 1/√head_dim (Gemma: query_pre_attn_scalar^-½)
  int64_t sliding_window = 0;    ///< tokens a sliding-window layer sees (itself included); 0: none
  int64_t swa_period = 0;        ///< with a window: layer l is global iff (l+1) % swa_period == 0; 0: every layer slides
  bool embed_scale = false;      ///< the embedding rows are multiplied by √dim (Gemma)
  double logit_softcap = 0.0;    ///< logits = c·tanh(logits / c) (Gemma 2); 0: none
  bool tied_embeddings = false;  ///< the output matrix is the token embedding
  Pooling pooling = Pooling::Last;  ///< embeddings: how a sequence's hidden states are pooled

  int64_t q_dim() const { return n_heads * head_dim; }
  int64_t kv_dim() const { return n_kv_heads * head_dim; }
  /// Whether layer l attends over a sliding window (sliding_window > 0 and l not global).
  bool is_sliding(int64_t layer) const;
  /// Positions layer l sees (its own included): sliding_window on a sliding layer, else 0 (all).
  int64_t window(int64_t layer) const { return is_sliding(layer) ? sliding_window : 0; }
  /// The first position a token at `pos` sees in `layer` (0 for a global layer).
  int64_t window_start(int64_t layer, int64_t pos) const;
  /// The softmax scale of q·k: attn_scale, or 1/√head_dim; × the LongRoPE attention factor².
  float softmax_scale() const;
  /// LongRope: picks the long factors iff a run of `ctx` positions per sequence exceeds the
  /// original context (llama.cpp's rule; transformers switches by the sequence's length, which
  /// agrees whenever the sequence fills the context). Other scalings: nothing to do.
  void use_context(int64_t ctx);
  /// The multiplier of the embedding rows: √dim with embed_scale, else 1.
  float embedding_multiplier() const;
  /// RoPE's angular frequencies of `layer` [head_dim / 2]: pair i turns by pos · f[i].
  /// f[i] = θ^(-2i/head_dim) (θ: rope_theta_local on sliding layers), then scaled as
  /// rope_scaling says (global layers only). Computed in fp64; the CPU and the GPU both take
  /// angles as double(pos) · f[i], so they agree bit for bit.
  std::vector<double> rope_freqs(int64_t layer) const;
  /// Distinct RoPE frequency tables among the layers: 2 when sliding-window layers and global
  /// layers both exist and their frequencies differ (own base or scaling), else 1.
  int rope_tables() const;
  /// Every table's frequencies, [rope_tables(), head_dim/2]: what a backend computes once.
  std::vector<double> rope_freq_tables() const;
  /// The table layer l uses (0 or 1), and the first layer using table t.
  int rope_table(int64_t layer) const;
  int64_t rope_table_layer(int table) const;
  /// Throws UsageError describing the first inconsistent or absurd value.
  void validate() const;
  /// Writes `general.architecture` and the `<arch>.*` keys (recipe keys only when they differ
  /// from the defaults, so older files stay as they were).
  void to_metadata(Metadata& m) const;
  /// Reads them back and applies the architecture's recipe (models/architecture.h); throws
  /// MetadataError (missing/mistyped key, unknown architecture) or UsageError (inconsistent).
  static ModelConfig from_metadata(const Metadata& m);
};

/// One tensor the architecture expects: its name and shape (outermost first).
struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
};

/// The full tensor table of a model, in file order, from its config:
/// token_embd.weight [vocab, dim]; per layer i, blk.i.:
///   attn_norm.weight [dim]; attn_q.weight [q_dim, dim] (+ .bias [q_dim] with attn_qkv_bias);
///   attn_k.weight [kv_dim, dim] (+ bias); attn_v.weight [kv_dim, dim] (+ bias);
///   attn_q_norm.weight, attn_k_norm.weight [head_dim] (qk_norm);
///   attn_output.weight [dim, q_dim] (+ .bias [dim] with attn_out_bias);
///   post_attention_norm.weight [dim] (PrePost norms); ffn_norm.weight [dim];
///   ffn_gate.weight [hidden, dim]; ffn_up.weight [hidden, dim]; ffn_down.weight [dim, hidden];
///   post_ffw_norm.weight [dim] (PrePost norms);
/// output_norm.weight [dim]; output.weight [vocab, dim] (absent when tied).
std::vector<TensorSpec> tensor_table(const ModelConfig& c);

/// "blk.<layer>.<what>.weight"
std::string layer_tensor(int64_t layer, const char* what);
/// "blk.<layer>.<what>.bias"
std::string layer_bias(int64_t layer, const char* what);

}  // namespace llmq
