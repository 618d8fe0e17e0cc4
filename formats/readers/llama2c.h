// Reader for llama2.c checkpoints (github.com/karpathy/llama2.c): the legacy header (run.c)
// and the versioned "ak42" headers v1 (fp32) and v2 (int8, Q8_0-like with a group size),
// as written by llama2.c's export.py.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "formats/vocab.h"
#include "models/config.h"

namespace llmq {

/// A tensor of a source checkpoint, read on demand (so a converter holds one at a time).
struct SourceTensor {
  std::string name;            ///< our name (models/config.h)
  std::vector<int64_t> shape;  ///< outermost first
  /// Writes the tensor as fp32 into out[numel]. May throw FileError.
  std::function<void(float* out)> read;
  /// Lossless path: when the source stores the tensor in one of our types, that type and its
  /// bytes as stored (rows of shape.back(), our block layout); raw == nullptr otherwise.
  DType raw_type = DType::F32;
  const uint8_t* raw = nullptr;
  /// Optional: called by the converter once it is done with the tensor (after the raw copy or
  /// read()); a reader over a mapping drops the tensor's pages from the resident set, so a
  /// lossless conversion does not end with the whole source resident. Empty: nothing to do.
  std::function<void()> release;
  /// Position of the tensor in the source file when the source orders its tensors (GGUF),
  /// else -1 (table order). llama.cpp's K-quant mixes count tensors in file order.
  int64_t file_order = -1;
  int64_t numel() const {
    int64_t n = 1;
    for (auto d : shape) n *= d;
    return n;
  }
};

/// A checkpoint opened for conversion: hyper-parameters and its tensors in table order.
struct SourceModel {
  ModelConfig config;
  std::string format;  ///< e.g. "llama2.c legacy", "llama2.c v1", "llama2.c v2 (int8, group 64)"
  std::vector<SourceTensor> tensors;
  bool has_vocab = false;     ///< the source carries its tokenizer (GGUF); else one is given
  Vocab vocab;
  std::string chat_template;  ///< Jinja text from the source, if any
  std::shared_ptr<const void> keepalive;  ///< the mapping the read functions use
};

/// Opens a llama2.c checkpoint. Legacy layout: 7 int32 (dim, hidden_dim, n_layers, n_heads,
/// n_kv_heads, vocab_size — negative when the classifier is separate — and seq_len), then fp32
/// tensors. Versioned layout: uint32 magic 0x616b3432 ("ak42"), int32 version (1 or 2), the same
/// 7 int32, uint8 shared_classifier, [v2: int32 group_size], zero padding to 256 bytes.
/// RoPE is interleaved (Meta layout), RMSNorm eps 1e-5, theta 10000.
/// Throws FileError for a truncated file, absurd header values or a size that does not match.
SourceModel read_llama2c(const std::string& path);

}  // namespace llmq
