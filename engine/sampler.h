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
  int32_t repeat_last_n = 64;  ///< how many recent tokens the penalties look at (-1: all)
  float presence_penalty = 0;  ///< OpenAI: logit -= presence * [count > 0]
  float frequency_penalty = 0; ///< OpenAI: logit -= frequency * count
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
  /// log softmax of logits [n] at `id`, and the `top` most likely ids with their log
  /// probabilities (descending), from the raw logits (no penalties or temperature).
  static float logprob(const float* logits, int64_t n, int32_t id, int top, std::vector<std::pair<int32_t, float>>* best);

 private:
  double uniform();  // [0, 1)
  SamplerParams p_;
  uint64_t state_;
  struct Cand { int32_t id; float logit; float p; };
  std::vector<Cand> cand_;
};

}  // namespace llmq
