// Structured outputs: OpenAI's `response_format` (json_object, json_schema) and llama.cpp
// server's `grammar` (GBNF), enforced by constrained decoding. Each request gets a
// TokenConstraint (engine/sampler.h) whose bitmask removes, at every step, the tokens that
// cannot continue a valid output; the scheduler applies it before sampling.
//
// The grammar engine is xgrammar (Dong et al. 2024, "XGrammar: flexible and efficient structured
// generation"; its C++ core from the PyPI sdist, built by scripts/fetch_xgrammar.sh): it compiles a
// JSON schema or an EBNF grammar against the vocabulary once (cached by text) and answers each
// step's mask from precomputed per-state token sets.
#pragma once
#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>
#include <string>

#include "engine/sampler.h"

namespace llmq {

class Tokenizer;

/// What shape the output must have.
struct OutputFormat {
  enum class Kind { Text, JsonObject, JsonSchema, Grammar };
  Kind kind = Kind::Text;
  std::string spec;     ///< JsonSchema: the schema as JSON text; Grammar: the GBNF text (root rule `root`)
  bool strict = false;  ///< JsonSchema: OpenAI's `strict` (no properties beyond the schema's)
  /// JsonSchema: literal text before and after the JSON (a forced tool call's tags); may be empty
  std::string prefix, suffix;
};

/// Compiles OutputFormats into per-request constraints for one model's vocabulary. Thread-safe.
class StructuredOutputs {
 public:
  /// The vocabulary as xgrammar sees it: each token's bytes (Tokenizer::decode_piece after a
  /// non-initial token), control tokens as special; `stop_ids` end a complete output. Cheap: the
  /// grammar engine's view of the vocabulary is built at the first constraint (not at start-up).
  /// `tok` must outlive this object. `cache_bytes` bounds the cache of compiled grammars (least
  /// recently used ones are dropped), as xgrammar counts it: its payload (grammar tables and
  /// token masks), which is most but not all of what the cache keeps resident
  /// (bench/grammar_cache_memory.py measures the server's RSS against it).
  StructuredOutputs(const Tokenizer& tok, const std::vector<int32_t>& stop_ids, size_t cache_bytes = size_t(64) << 20);
  ~StructuredOutputs();
  /// True when this build has the grammar engine.
  static bool available();
  /// A fresh constraint for `f` (nullptr for Kind::Text). Throws UsageError naming what is wrong
  /// with a schema or grammar (the server answers 400), or when !available().
  std::shared_ptr<TokenConstraint> constraint(const OutputFormat& f);

 private:
  struct Impl;
  const Tokenizer& tok_;
  std::vector<int32_t> stop_ids_;
  size_t cache_bytes_;
  std::mutex mu_;               // one compilation at a time (each uses the compiler's threads)
  std::unique_ptr<Impl> impl_;  // made by the first constraint()
};

}  // namespace llmq
