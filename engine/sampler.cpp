#include "engine/sampler.h"

#include "base/error.h"

#include <algorithm>
#include <cmath>
#include <unordered_map>

namespace llmq {

namespace {
// Whether the repeat, presence or frequency penalty changes any logit.
bool penalties_apply(const SamplerParams& p) {
  return (p.repeat_penalty != 1.0f || p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f) && p.repeat_last_n != 0;
}
// Whether sample() changes logits before choosing (penalties, logit bias): the argmax and top-k
// shortcuts of greedy() / top_k_suffices() do not apply then.
bool penalizes(const SamplerParams& p) { return penalties_apply(p) || !p.logit_bias.empty(); }
}  // namespace

Sampler::Sampler(const SamplerParams& p) : p_(p), state_(p.seed ^ 0x9e3779b97f4a7c15ull) {}

// splitmix64 (Steele, Lea & Flood 2014): a small generator whose stream is fixed by the seed.
double Sampler::uniform() {
  uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return double(z >> 11) * (1.0 / 9007199254740992.0);
}

int32_t Sampler::argmax(const float* logits, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i)
    if (logits[i] > logits[best]) best = i;
  return int32_t(best);
}

void Sampler::penalize(const std::vector<int32_t>& history) {
  if (!penalties_apply(p_)) return;
  const int64_t n = int64_t(cand_.size());
  const size_t look = p_.repeat_last_n < 0 ? history.size() : std::min(history.size(), size_t(p_.repeat_last_n));
  std::unordered_map<int32_t, int> count;
  for (auto it = history.end() - long(look); it != history.end(); ++it) ++count[*it];
  for (const auto& [id, k] : count) {
    if (id < 0 || id >= n) continue;
    float& l = cand_[size_t(id)].logit;
    if (p_.repeat_penalty != 1.0f) l = l > 0 ? l / p_.repeat_penalty : l * p_.repeat_penalty;
    l -= p_.presence_penalty + p_.frequency_penalty * float(k);
  }
}

void Sampler::bias_and_mask(const uint32_t* allowed) {
  const int64_t n = int64_t(cand_.size());
  for (const auto& [id, bias] : p_.logit_bias)
    if (id >= 0 && id < n) cand_[size_t(id)].logit += bias;
  if (allowed)  // only the ruled-out tokens are touched: the zero bits of each 32-token word
    for (int64_t w = 0; w * 32 < n; ++w)
      for (uint32_t out = ~allowed[w]; out; out &= out - 1) {
        const int64_t i = w * 32 + __builtin_ctz(out);
        if (i < n) cand_[size_t(i)].logit = -INFINITY;
      }
}

int32_t Sampler::draw_all() {
  float mx = cand_[0].logit;
  for (const auto& c : cand_) mx = std::max(mx, c.logit);
  double sum = 0.0;
  for (auto& c : cand_) sum += (c.p = std::exp((c.logit - mx) / p_.temperature));
  const double r = uniform() * sum;
  double cum = 0.0;
  for (const auto& c : cand_) {
    cum += c.p;
    if (r < cum) return c.id;
  }
  return cand_.back().id;
}

int32_t Sampler::sample(const float* logits, int64_t n, const std::vector<int32_t>& history, const uint32_t* allowed) {
  cand_.resize(size_t(n));
  for (int64_t i = 0; i < n; ++i) cand_[size_t(i)] = {int32_t(i), logits[i], 0.0f};
  penalize(history);
  bias_and_mask(allowed);
  if (p_.temperature <= 0.0f) {
    int64_t best = 0;
    for (int64_t i = 1; i < n; ++i)
      if (cand_[size_t(i)].logit > cand_[size_t(best)].logit) best = i;
    return int32_t(best);
  }
  if (p_.top_k <= 0 && p_.top_p >= 1.0f && p_.min_p <= 0.0f) return draw_all();
  // Sort by logit, descending (ties by id, so the order is deterministic).
  auto by_logit = [](const Cand& a, const Cand& b) { return a.logit > b.logit || (a.logit == b.logit && a.id < b.id); };
  size_t keep = cand_.size();
  if (p_.top_k > 0 && size_t(p_.top_k) < keep) {
    keep = size_t(p_.top_k);
    std::partial_sort(cand_.begin(), cand_.begin() + long(keep), cand_.end(), by_logit);
    cand_.resize(keep);
  } else {
    std::sort(cand_.begin(), cand_.end(), by_logit);
  }
  return draw_sorted();
}

bool Sampler::greedy() const { return p_.temperature <= 0.0f && !penalizes(p_); }

bool Sampler::mask_by_rejection() const {
  return p_.temperature <= 0.0f || (p_.top_k <= 0 && p_.top_p >= 1.0f && p_.min_p <= 0.0f);
}

bool Sampler::top_k_suffices() const { return p_.temperature > 0.0f && p_.top_k > 0 && !penalizes(p_); }

int32_t Sampler::sample_top(const int32_t* ids, const float* logits, int64_t k) {
  if (k < 1) throw UsageError("sample_top: no candidates");
  cand_.resize(size_t(k));
  for (int64_t i = 0; i < k; ++i) cand_[size_t(i)] = {ids[i], logits[i], 0.0f};
  return draw_sorted();
}

int32_t Sampler::draw_sorted() {
  auto normalize = [&](float temp) {
    double sum = 0.0;
    const float mx = cand_[0].logit;
    for (auto& c : cand_) sum += (c.p = std::exp((c.logit - mx) / temp));
    for (auto& c : cand_) c.p = float(c.p / sum);
  };
  normalize(1.0f);
  if (p_.top_p < 1.0f) {
    double cum = 0.0;
    size_t k = 0;
    while (k < cand_.size()) {
      cum += cand_[k++].p;
      if (cum >= p_.top_p) break;
    }
    cand_.resize(std::max<size_t>(k, 1));
  }
  if (p_.min_p > 0.0f) {
    const float cut = p_.min_p * cand_[0].p;
    size_t k = 1;
    while (k < cand_.size() && cand_[k].p >= cut) ++k;
    cand_.resize(k);
  }
  normalize(p_.temperature);
  const double r = uniform();
  double cum = 0.0;
  for (const auto& c : cand_) {
    cum += c.p;
    if (r < cum) return c.id;
  }
  return cand_.back().id;
}

float Sampler::logprob(const float* logits, int64_t n, int32_t id, int top, std::vector<std::pair<int32_t, float>>* best) {
  float mx = logits[0];
  for (int64_t i = 1; i < n; ++i) mx = std::max(mx, logits[i]);
  double z = 0;
  for (int64_t i = 0; i < n; ++i) z += std::exp(double(logits[i]) - mx);
  const double lz = double(mx) + std::log(z);
  if (best) {
    best->clear();
    top = int(std::min<int64_t>(top, n));
    if (top > 0) {
      std::vector<int32_t> idx(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) idx[size_t(i)] = int32_t(i);
      std::partial_sort(idx.begin(), idx.begin() + top, idx.end(), [&](int32_t a, int32_t b) {
        return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
      });
      for (int k = 0; k < top; ++k) best->emplace_back(idx[size_t(k)], float(double(logits[idx[size_t(k)]]) - lz));
    }
  }
  return float(double(logits[id]) - lz);
}

}  // namespace llmq
