#include "engine/sampler.h"

#include <algorithm>
#include <cmath>

#include "util/error.h"

namespace kvserve {

void SamplerOptions::validate() const {
  if (!(temperature >= 0.0f) || !std::isfinite(temperature)) fail("--temperature must be >= 0 (got {})", temperature);
  if (top_k < 0) fail("--top-k must be >= 0 (got {})", top_k);
  if (!(top_p > 0.0f && top_p <= 1.0f)) fail("--top-p must be in (0, 1] (got {})", top_p);
}

int32_t argmax(const float* x, int32_t n) {
  int32_t best = 0;
  for (int32_t i = 1; i < n; ++i)
    if (x[i] > x[best]) best = i;
  return best;
}

Sampler::Sampler(const SamplerOptions& options) : options_(options), rng_(options.seed) {
  options_.validate();
}

int32_t Sampler::sample(const float* logits, int32_t vocab) {
  if (options_.temperature == 0.0f) return argmax(logits, vocab);

  candidates_.resize(size_t(vocab));
  for (int32_t i = 0; i < vocab; ++i) candidates_[size_t(i)] = {logits[i] / options_.temperature, i};
  auto by_prob = [](const auto& a, const auto& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); };
  size_t keep = candidates_.size();
  if (options_.top_k > 0 && size_t(options_.top_k) < keep) {
    keep = size_t(options_.top_k);
    std::partial_sort(candidates_.begin(), candidates_.begin() + long(keep), candidates_.end(), by_prob);
  } else {
    std::sort(candidates_.begin(), candidates_.end(), by_prob);
  }
  candidates_.resize(keep);

  // Softmax over the kept candidates (sorted, so the first is the max).
  const float max_logit = candidates_.front().first;
  double total = 0;
  for (auto& c : candidates_) total += (c.first = std::exp(c.first - max_logit));
  for (auto& c : candidates_) c.first = float(c.first / total);

  if (options_.top_p < 1.0f) {
    double mass = 0;
    size_t cut = 0;
    while (cut < candidates_.size()) {
      mass += candidates_[cut++].first;
      if (mass >= options_.top_p) break;
    }
    candidates_.resize(cut);
    total = mass;
  } else {
    total = 1.0;
  }

  std::uniform_real_distribution<double> uniform(0.0, total);
  double r = uniform(rng_), acc = 0;
  for (const auto& c : candidates_) {
    acc += c.first;
    if (r < acc) return c.second;
  }
  return candidates_.back().second;
}

}  // namespace kvserve
