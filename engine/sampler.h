// Token sampling from logits: greedy, temperature, top-k, top-p, min-p, repetition penalty.
#pragma once
#include <cstdint>
#include <utility>
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
  /// OpenAI's logit_bias: (token id, bias) pairs added to those logits after the penalties
  /// (-100 effectively bans a token, +100 forces it); ids must be in the vocabulary.
  std::vector<std::pair<int32_t, float>> logit_bias = {};
};

/// A rule on which tokens may come next (constrained decoding: a JSON schema, a grammar), kept
/// per sequence by whoever samples it. Implemented outside the engine (server/structured.h).
class TokenConstraint {
 public:
  virtual ~TokenConstraint() = default;
  /// Writes the tokens allowed next as a bitmask, mask [(n_vocab + 31) / 32] (bit i % 32 of
  /// word i / 32: token i); returns false when every token is allowed (mask left unspecified).
  virtual bool fill_mask(uint32_t* mask) = 0;
  /// Advances past the sampled token; false when the rule does not allow it.
  virtual bool accept(int32_t id) = 0;
};

/// Draws one token per call. Deterministic: the random stream depends only on the seed.
class Sampler {
 public:
  explicit Sampler(const SamplerParams& p);
  /// Picks a token from logits [n_vocab]; `history` is the sequence so far (for the penalty).
  /// Order of filters (as llama.cpp): penalty, logit bias, top-k, top-p, min-p, temperature, draw.
  /// allowed: a TokenConstraint's bitmask [(n_vocab + 31) / 32], or nullptr; the tokens it
  /// leaves out are never drawn (their logits count as -inf, applied after the logit bias).
  int32_t sample(const float* logits, int64_t n_vocab, const std::vector<int32_t>& history,
                 const uint32_t* allowed = nullptr);
  /// True when sample() is the plain argmax (temperature <= 0, no penalties).
  bool greedy() const;
  /// True when the draw depends only on the top_k largest logits: temperature > 0, top_k > 0,
  /// no penalties. A GPU then copies back those k candidates (sample_top), not all logits.
  bool top_k_suffices() const;
  /// True when the masked draw may be done by rejection: draw from all logits, and only if a
  /// constraint rules that token out, draw again under its mask. The result has the masked
  /// distribution exactly when nothing truncates it (greedy, or no top-k/top-p/min-p):
  /// p(x)·[x∈A] + (1 − p(A))·p(x)/p(A) = p(x)/p(A) for the allowed set A (and greedy's argmax, when
  /// allowed, is the masked argmax). llama.cpp's sampler tries the unconstrained token first too.
  bool mask_by_rejection() const;
  /// The top_k setting (the candidates sample_top expects).
  int32_t top_k() const { return p_.top_k; }
  /// sample() from the k = min(top_k, n_vocab) largest logits only: ids [k] and logits [k]
  /// sorted by logit, descending, ties by lower id (as sample's own order). Draws the same token
  /// as sample() on the whole vector, when top_k_suffices(). Throws UsageError for k < 1.
  int32_t sample_top(const int32_t* ids, const float* logits, int64_t k);
  /// Index of the largest logit (ties: the lowest index).
  static int32_t argmax(const float* logits, int64_t n);
  /// log softmax of logits [n] at `id`, and the `top` most likely ids with their log
  /// probabilities (descending), from the raw logits (no penalties or temperature).
  static float logprob(const float* logits, int64_t n, int32_t id, int top, std::vector<std::pair<int32_t, float>>* best);

 private:
  double uniform();  // [0, 1)
  void penalize(const std::vector<int32_t>& history);  // repeat, presence and frequency penalties on cand_
  void bias_and_mask(const uint32_t* allowed);         // logit_bias, then -inf for the tokens `allowed` rules out
  int32_t draw_all();     // temperature and the draw over every candidate (no truncation, no sort: O(n))
  int32_t draw_sorted();  // top-p, min-p, temperature and the draw over cand_ (sorted, descending)
  SamplerParams p_;
  uint64_t state_;
  struct Cand { int32_t id; float logit; float p; };
  std::vector<Cand> cand_;
};

}  // namespace llmq
