// The shape of a decoder-only transformer for memory estimates: dimensions and parameter
// counts, from a named preset, a `.llmq` or GGUF file (metadata and tensor directory only: no
// weight is read) or a Hugging Face config.json.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "models/config.h"

namespace llmq::mem {

/// Feed-forward block type.
enum class Mlp {
  SwiGLU,  ///< Llama: gate, up [hidden, dim] and down [dim, hidden], no biases
  Gelu,    ///< GPT: fc [hidden, dim] and proj [dim, hidden], with biases
};

/// What the last block feeds.
enum class Head {
  LM,          ///< a final norm and the vocabulary logits at every position (decoders; BERT's MLM head)
  Classifier,  ///< BERT's sequence classifier: pooler [dim, dim] on the first token, then [labels, dim]; no per-token logits
};

/// Dimensions of a transformer (decoder-only, or a BERT-style encoder).
struct ModelShape {
  std::string name;
  std::string model_type;   ///< transformers' model_type (config.json; a GGUF's architecture; presets: llama, mistral), "" unknown
  int64_t dim = 0, hidden = 0, layers = 0, heads = 0, kv_heads = 0, head_dim = 0, vocab = 0, context = 0;
  bool tied = false;        ///< output matrix = token embedding
  Mlp mlp = Mlp::SwiGLU;
  bool gpt = false;         ///< GPT-style: biases on every linear, LayerNorm with bias (GPT-2/3, BERT, BLOOM)
  int64_t positions = 0;    ///< rows of learned position embeddings (GPT-2/3, BERT: context; RoPE, ALiBi: 0)
  int64_t extra_embed = 0;  ///< other embedding parameters: BERT's token types and embedding LayerNorm, BLOOM's embedding LayerNorm
  Head head = Head::LM;
  int64_t labels = 0;       ///< Head::Classifier: classes (transformers' num_labels, default 2)
  int64_t counted_params = 0;  ///< from a file's tensor directory (0: not counted)

  int64_t q_dim() const { return heads * head_dim; }
  int64_t kv_dim() const { return kv_heads * head_dim; }
  /// Parameters of one block: attention dim·q + 2·dim·kv + q·dim, MLP 3·dim·hidden (SwiGLU)
  /// or 2·dim·hidden (GELU), norms 2·dim; GPT adds biases q + 2kv + dim + hidden + dim and
  /// LayerNorm biases 2·dim.
  int64_t layer_params() const;
  /// Parameters of the block's matrices only (what LoRA/QLoRA/autocast treat as Linear).
  int64_t layer_linear_params() const;
  /// Token embedding vocab·dim + learned positions positions·dim + extra_embed.
  int64_t embed_params() const;
  /// LM: final norm dim (+dim bias for GPT) + output vocab·dim unless tied. Classifier: pooler
  /// dim·dim + dim, classifier labels·dim + labels (BERT has no final norm: its LayerNorms
  /// follow each sub-layer).
  int64_t head_params() const;
  /// Logit values of one micro-batch of b sequences of s tokens: LM s·b·vocab, classifier b·labels.
  double logits(double s, double b) const;
  /// embed + layers·layer + head: the formula, which equals a file's counted_params.
  int64_t params() const;
  /// DeepSpeed's "largest layer": the largest single module's parameters, here
  /// max(vocab·dim, the largest block matrix).
  int64_t largest_layer_params() const;
  /// Throws UsageError for non-positive or inconsistent dimensions.
  void validate() const;
};

/// The named presets: llama-2-7b, llama-2-13b, llama-2-70b, llama-3-8b, llama-3-70b,
/// llama-3.2-1b, mistral-7b, tinyllama-1.1b, smollm2-135m, gpt-3-175b (shapes from the models'
/// published configurations; GPT-3 from Brown et al. 2020, Table 2.1).
std::vector<std::string> preset_names();
/// Throws UsageError naming the known presets when `name` is not one.
ModelShape preset(const std::string& name);

/// A Llama config as a shape.
ModelShape shape_from_config(const ModelConfig& c, const std::string& name);

/// A model given as a preset name, a `.llmq` file, a GGUF file, a Hugging Face config.json or a
/// directory holding one. Files are read for their metadata and tensor directory only (the
/// parameter count is the directory's Σ numel). Throws FileError (bad file) or UsageError.
ModelShape load_shape(const std::string& model);

}  // namespace llmq::mem
