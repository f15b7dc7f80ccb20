// Log-probabilities of a sampled token and of the most likely alternatives
// (OpenAI's `logprobs`), from the model's raw distribution: the log-softmax
// of the logits before temperature, penalties and top-k/top-p, as vLLM
// reports them by default.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace kvserve {

struct TokenLogprobs {
  int32_t token = -1;
  float logprob = 0;                          // of `token`
  int32_t rank = 0;                           // of `token` in the vocabulary, 1 = most likely (ties: lower id first)
  std::vector<std::pair<int32_t, float>> top; // (token, logprob), most likely first (ties: lower id)
};

// The most we report per token (OpenAI's limit for top_logprobs).
inline constexpr int32_t kMaxTopLogprobs = 20;

// logits: (vocab) floats. top_n: alternatives wanted, 0..vocab.
TokenLogprobs token_logprobs(const float* logits, int32_t vocab, int32_t token, int32_t top_n);

}  // namespace kvserve
