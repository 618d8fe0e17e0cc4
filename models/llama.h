// The Llama architecture: hyper-parameters, metadata keys and tensor table.
//
// Llama (Touvron et al. 2023): pre-norm decoder; RMSNorm (Zhang & Sennrich 2019); rotary
// position embedding (Su et al. 2021); grouped-query attention (Ainslie et al. 2023);
// SwiGLU feed-forward (Shazeer 2020). Tensor names follow the GGUF scheme (docs/FORMAT.md).
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

/// Hyper-parameters of a Llama-family model.
struct LlamaConfig {
  int64_t dim = 0;             ///< embedding width (d_model)
  int64_t hidden_dim = 0;      ///< FFN width
  int64_t n_layers = 0;
  int64_t n_heads = 0;         ///< query heads
  int64_t n_kv_heads = 0;      ///< key/value heads (GQA: n_heads % n_kv_heads == 0)
  int64_t head_dim = 0;        ///< usually dim / n_heads
  int64_t vocab_size = 0;
  int64_t context_length = 0;  ///< trained context
  double norm_eps = 1e-5;      ///< RMSNorm epsilon
  double rope_theta = 10000.0;
  RopeLayout rope_layout = RopeLayout::Interleaved;
  bool tied_embeddings = false;  ///< the output matrix is the token embedding
  bool attn_qkv_bias = false;    ///< q, k, v projections add a bias (Qwen2; Llama `attention_bias`)
  bool attn_out_bias = false;    ///< the attention output projection adds a bias (Llama `attention_bias`)

  int64_t q_dim() const { return n_heads * head_dim; }
  int64_t kv_dim() const { return n_kv_heads * head_dim; }
  /// Throws UsageError describing the first inconsistent or absurd value.
  void validate() const;
  /// Writes `general.architecture = llama` and the `llama.*` keys.
  void to_metadata(Metadata& m) const;
  /// Reads them back; throws MetadataError (missing/mistyped) or UsageError (inconsistent).
  static LlamaConfig from_metadata(const Metadata& m);
};

/// One tensor the architecture expects: its name and shape (outermost first).
struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
};

/// The full tensor table of a Llama model, in file order.
/// token_embd.weight [vocab, dim]; per layer i, blk.i.:
///   attn_norm.weight [dim]; attn_q.weight [q_dim, dim]; attn_k.weight [kv_dim, dim];
///   attn_v.weight [kv_dim, dim]; attn_output.weight [dim, q_dim]; ffn_norm.weight [dim];
///   ffn_gate.weight [hidden, dim]; ffn_up.weight [hidden, dim]; ffn_down.weight [dim, hidden];
/// output_norm.weight [dim]; output.weight [vocab, dim] (absent when tied).
/// With attn_qkv_bias, each layer also has attn_q.bias [q_dim], attn_k.bias [kv_dim] and
/// attn_v.bias [kv_dim]; with attn_out_bias, attn_output.bias [dim] (after its weight).
std::vector<TensorSpec> llama_tensor_table(const LlamaConfig& c);

/// "blk.<layer>.<what>.weight"
std::string llama_layer_tensor(int64_t layer, const char* what);
/// "blk.<layer>.<what>.bias"
std::string llama_layer_bias(int64_t layer, const char* what);

}  // namespace llmq
