// Architectures: each one declared once, as a name and a recipe function.
//
// The recipe function fixes what the architecture always is (norm placement, activation,
// QK-norm, embedding scale, ...) and reads what its files may vary (the `<arch>.*` keys beyond
// the common sizes, which ModelConfig::from_metadata reads for every architecture). Every backend
// executes the resulting ModelConfig; none of them names an architecture. Adding one: a file
// models/<name>.cpp defining its Architecture, one line in the table of models/architecture.cpp,
// and the kernels it lacks (docs/ARCHITECTURE.md, "How to add an architecture").
#pragma once
#include <string>
#include <vector>

#include "models/config.h"

namespace llmq {

/// One architecture: `general.architecture` = name.
struct Architecture {
  const char* name;  ///< the metadata prefix too: `<name>.block_count`, ... (static storage)
  const char* doc;   ///< one line: the models it covers and its source
  /// Sets the recipe fields of c (c.arch and the common keys are already read from m). Throws
  /// MetadataError for a mistyped key.
  void (*recipe)(const Metadata& m, ModelConfig& c);
  /// How llama.cpp's converter stores this architecture's q and k rows in a GGUF: Meta's
  /// interleaved pairs (it permutes llama's) or the checkpoint's rotate-half order (the others).
  RopeLayout gguf_rope = RopeLayout::RotateHalf;
  /// The files fuse q, k, v into attn_qkv [q_dim + 2 kv_dim, dim] and gate, up into one ffn_up
  /// [2 hidden, dim], gate first (Phi-3); the readers split them into the table's tensors by rows.
  bool fused_projections = false;
};

/// The architecture called `name`, or nullptr.
const Architecture* find_architecture(const std::string& name);
/// The names of every architecture this build runs, comma-separated (for error messages).
std::string architecture_names();
/// Adds an architecture at run time (a test-only variant, tests/test_arch.cpp); replaces one of
/// the same name. Not thread-safe: call before loading models.
void register_architecture(const Architecture& a);

// The built-in declarations (one file each in models/).
extern const Architecture kLlama;   ///< models/llama.cpp
extern const Architecture kQwen2;   ///< models/qwen2.cpp
extern const Architecture kQwen3;   ///< models/qwen3.cpp
extern const Architecture kGemma3;  ///< models/gemma3.cpp
extern const Architecture kMistral;  ///< models/mistral.cpp
extern const Architecture kPhi3;     ///< models/phi3.cpp

}  // namespace llmq
