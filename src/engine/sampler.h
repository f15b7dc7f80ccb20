// Picks the next token from logits: greedy at temperature 0, otherwise
// temperature-scaled sampling restricted by top-k and top-p (nucleus).
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace kvserve {

struct SamplerOptions {
  float temperature = 1.0f;  // 0 = greedy (argmax, lowest id on ties)
  int32_t top_k = 0;         // keep the k most likely tokens; 0 = all
  float top_p = 1.0f;        // keep the smallest set with probability mass >= top_p; 1 = all
  uint64_t seed = 0;         // seeds the random stream; same seed, same samples

  // Throws kvserve::Error for negative temperature/top_k or top_p outside (0, 1].
  void validate() const;
};

class Sampler {
 public:
  explicit Sampler(const SamplerOptions& options);

  // logits: (vocab) floats. Deterministic for a given seed and call sequence.
  int32_t sample(const float* logits, int32_t vocab);

 private:
  SamplerOptions options_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, int32_t>> candidates_;  // (probability, id) scratch
};

// Index of the largest value (the lowest index among equal maxima).
int32_t argmax(const float* x, int32_t n);

}  // namespace kvserve
