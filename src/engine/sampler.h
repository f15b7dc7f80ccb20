// Picks the next token from logits: greedy at temperature 0, otherwise
// temperature-scaled sampling restricted by top-k, top-p (nucleus) and
// min-p. Before either, the logits may be adjusted for the tokens already
// seen: OpenAI's presence and frequency penalties, the CTRL/vLLM repetition
// penalty and a logit bias, and tokens that may not be sampled: outside
// vLLM's allowed_token_ids, completing a bad word, or banned by the caller
// (end tokens before min_tokens).
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <utility>
#include <vector>

namespace kvserve {

// Temperatures below this sample greedily (vLLM's sampling epsilon).
inline constexpr float kGreedyTemperature = 1e-5f;

struct SamplerOptions {
  float temperature = 1.0f;  // 0 (or below kGreedyTemperature) = greedy (argmax, lowest id on ties)
  int32_t top_k = 0;         // keep the k most likely tokens; 0 = all
  float top_p = 1.0f;        // keep the smallest set with probability mass >= top_p; 1 = all
  uint64_t seed = 0;         // seeds the random stream; same seed, same samples
  float min_p = 0.0f;        // drop tokens less likely than min_p x the most likely one; 0 = off
  // OpenAI's penalties over the generated tokens: a token's logit loses
  // presence_penalty once it has appeared, and frequency_penalty per time.
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  // Over prompt and generated tokens (CTRL, vLLM, llama.cpp's repeat
  // penalty): a seen token's logit is divided by it when positive,
  // multiplied when negative. 1 = off.
  float repetition_penalty = 1.0f;
  std::vector<std::pair<int32_t, float>> logit_bias;  // (token, added to its logit)
  // vLLM's allowed_token_ids: only these may be sampled; empty = all.
  std::vector<int32_t> allowed_tokens;
  // vLLM's bad_words, as token sequences: the last token of a sequence may
  // not follow the rest of it in the generated tokens (a one-token sequence
  // is banned outright).
  std::vector<std::vector<int32_t>> bad_words;

  // Throws kvserve::Error for negative temperature/top_k, top_p outside
  // (0, 1], min_p outside [0, 1], a non-positive repetition penalty, a
  // non-finite penalty or bias, negative token ids or an empty bad word.
  void validate() const;
  // Whether any adjustment of the logits applies.
  bool adjusts_logits() const;
};

// What the sampled sequence holds so far, for the penalties, and the tokens
// that may not be sampled now.
struct SamplingContext {
  std::span<const int32_t> prompt;
  std::span<const int32_t> generated;
  std::span<const int32_t> banned;
};

class Sampler {
 public:
  explicit Sampler(const SamplerOptions& options);

  // logits: (vocab) floats. Deterministic for a given seed and call sequence.
  // -1 when the bans (allowed tokens, bad words, context.banned) leave no
  // token to sample.
  int32_t sample(const float* logits, int32_t vocab, const SamplingContext& context = {});

 private:
  // The logits with the penalties, the bias and the bans applied.
  const float* adjust(const float* logits, int32_t vocab, const SamplingContext& context);

  SamplerOptions options_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, int32_t>> candidates_;  // (probability, id) scratch
  std::vector<float> adjusted_;                        // (vocab) adjusted logits
  std::vector<int32_t> counts_;                        // (vocab) occurrences in the generated tokens
  std::vector<uint8_t> seen_;                          // (vocab) in the prompt or generated tokens
  std::vector<uint8_t> allowed_;                       // (vocab) allowed_tokens as a mask; empty = all
};

// Index of the largest value (the lowest index among equal maxima).
int32_t argmax(const float* x, int32_t n);

}  // namespace kvserve
