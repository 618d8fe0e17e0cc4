// Token sampling from logits: greedy, temperature, top-k, top-p, min-p, repetition penalty.
#pragma once
#include <cstdint>
#include <vector>

namespace llmq {

/// Sampling settings. The defaults match llama.cpp's command-line defaults.
struct SamplerParams {
  float temperature = 0.8f;    ///< <= 0: greedy (argmax)
  int32_t top_k = 40;          ///< <= 0: off
  float top_p = 0.95f;         ///< >= 1: off (nucleus sampling, Holtzman et al. 2019)
  float min_p = 0.05f;         ///< <= 0: off (keep p >= min_p * p_max)
  float repeat_penalty = 1.0f; ///< 1: off (CTRL, Keskar et al. 2019: logit / p if > 0, else * p)
  int32_t repeat_last_n = 64;  ///< how many recent tokens the penalty looks at
  uint64_t seed = 0;           ///< same seed, same logits -> same tokens
};

/// Draws one token per call. Deterministic: the random stream depends only on the seed.
class Sampler {
 public:
  explicit Sampler(const SamplerParams& p);
  /// Picks a token from logits [n_vocab]; `history` is the sequence so far (for the penalty).
  /// Order of filters (as llama.cpp): penalty, top-k, top-p, min-p, temperature, draw.
  int32_t sample(const float* logits, int64_t n_vocab, const std::vector<int32_t>& history);
  /// Index of the largest logit (ties: the lowest index).
  static int32_t argmax(const float* logits, int64_t n);

 private:
  double uniform();  // [0, 1)
  SamplerParams p_;
  uint64_t state_;
  struct Cand { int32_t id; float logit; float p; };
  std::vector<Cand> cand_;
};

}  // namespace llmq
