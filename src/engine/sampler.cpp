#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "util/error.h"

namespace kvserve {

void SamplerOptions::validate() const {
  if (!(temperature >= 0.0f) || !std::isfinite(temperature)) fail("--temperature must be >= 0 (got {})", temperature);
  if (top_k < 0) fail("--top-k must be >= 0 (got {})", top_k);
  if (!(top_p > 0.0f && top_p <= 1.0f)) fail("--top-p must be in (0, 1] (got {})", top_p);
  if (!(min_p >= 0.0f && min_p <= 1.0f)) fail("--min-p must be in [0, 1] (got {})", min_p);
  if (!std::isfinite(presence_penalty) || !std::isfinite(frequency_penalty))
    fail("the presence and frequency penalties must be finite (got {}, {})", presence_penalty, frequency_penalty);
  if (!(repetition_penalty > 0.0f) || !std::isfinite(repetition_penalty))
    fail("--repetition-penalty must be > 0 (got {})", repetition_penalty);
  for (const auto& [token, bias] : logit_bias)
    if (token < 0 || !std::isfinite(bias)) fail("logit bias {} for token {} is invalid", bias, token);
  for (int32_t token : allowed_tokens)
    if (token < 0) fail("allowed token id {} is invalid", token);
  for (const std::vector<int32_t>& word : bad_words) {
    if (word.empty()) fail("a bad word has no tokens");
    for (int32_t token : word)
      if (token < 0) fail("bad word token id {} is invalid", token);
  }
}

bool SamplerOptions::adjusts_logits() const {
  return presence_penalty != 0.0f || frequency_penalty != 0.0f || repetition_penalty != 1.0f || !logit_bias.empty() ||
         !allowed_tokens.empty() || !bad_words.empty();
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

const float* Sampler::adjust(const float* logits, int32_t vocab, const SamplingContext& context) {
  if (!options_.adjusts_logits() && context.banned.empty()) return logits;
  adjusted_.assign(logits, logits + vocab);
  auto valid = [vocab](int32_t t) { return t >= 0 && t < vocab; };
  if (options_.repetition_penalty != 1.0f) {
    seen_.assign(size_t(vocab), 0);
    for (std::span<const int32_t> part : {context.prompt, context.generated})
      for (int32_t t : part)
        if (valid(t) && !seen_[size_t(t)]) {
          seen_[size_t(t)] = 1;
          float& l = adjusted_[size_t(t)];
          l = l > 0 ? l / options_.repetition_penalty : l * options_.repetition_penalty;
        }
  }
  if (options_.presence_penalty != 0.0f || options_.frequency_penalty != 0.0f) {
    counts_.assign(size_t(vocab), 0);
    for (int32_t t : context.generated)
      if (valid(t)) ++counts_[size_t(t)];
    for (int32_t t : context.generated)
      if (valid(t) && counts_[size_t(t)] > 0) {
        adjusted_[size_t(t)] -= options_.frequency_penalty * float(counts_[size_t(t)]) + options_.presence_penalty;
        counts_[size_t(t)] = 0;  // once per distinct token
      }
  }
  for (const auto& [t, bias] : options_.logit_bias)
    if (valid(t)) adjusted_[size_t(t)] += bias;
  // A tiny repetition penalty divides a logit past the float range: keep
  // every adjusted logit finite (banned tokens below are the only -inf).
  constexpr float kLimit = 1e30f;
  for (float& l : adjusted_) l = std::clamp(l, -kLimit, kLimit);
  constexpr float kBanned = -std::numeric_limits<float>::infinity();
  for (int32_t t : context.banned)
    if (valid(t)) adjusted_[size_t(t)] = kBanned;
  if (!options_.allowed_tokens.empty()) {
    if (allowed_.size() != size_t(vocab)) {
      allowed_.assign(size_t(vocab), 0);
      for (int32_t t : options_.allowed_tokens)
        if (valid(t)) allowed_[size_t(t)] = 1;
    }
    for (int32_t t = 0; t < vocab; ++t)
      if (!allowed_[size_t(t)]) adjusted_[size_t(t)] = kBanned;
  }
  // A bad word's last token may not complete it: its other tokens end the
  // generated text (vLLM looks at generated tokens only, not the prompt).
  for (const std::vector<int32_t>& word : options_.bad_words) {
    const size_t rest = word.size() - 1;
    if (rest > context.generated.size() || !valid(word.back())) continue;
    if (std::equal(word.begin(), word.end() - 1, context.generated.end() - long(rest)))
      adjusted_[size_t(word.back())] = kBanned;
  }
  return adjusted_.data();
}

int32_t Sampler::sample(const float* raw_logits, int32_t vocab, const SamplingContext& context) {
  const float* logits = adjust(raw_logits, vocab, context);
  const int32_t best = argmax(logits, vocab);
  const float top = logits[best];
  if (top == -std::numeric_limits<float>::infinity()) return -1;  // everything banned
  // Below vLLM's sampling epsilon a temperature is greedy: dividing by it
  // would overflow the logits (1e-39 sampled the last token every time).
  if (options_.temperature < kGreedyTemperature) return best;

  // Shifted by the largest logit before dividing, so no value overflows.
  candidates_.resize(size_t(vocab));
  for (int32_t i = 0; i < vocab; ++i) candidates_[size_t(i)] = {(logits[i] - top) / options_.temperature, i};
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
  if (options_.min_p > 0.0f) {
    // Sorted by probability: cut where it falls below min_p x the first.
    const float floor = options_.min_p * candidates_.front().first;
    size_t cut = 1;
    while (cut < candidates_.size() && candidates_[cut].first >= floor) ++cut;
    if (cut < candidates_.size()) {
      candidates_.resize(cut);
      total = 0;
      for (const auto& c : candidates_) total += c.first;
    }
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
