#include "engine/token_logprobs.h"

#include <algorithm>
#include <cmath>

namespace kvserve {

TokenLogprobs token_logprobs(const float* logits, int32_t vocab, int32_t token, int32_t top_n) {
  float top = logits[0];
  for (int32_t i = 1; i < vocab; ++i) top = std::max(top, logits[i]);
  double sum = 0;
  for (int32_t i = 0; i < vocab; ++i) sum += std::exp(double(logits[i]) - double(top));
  const double log_z = double(top) + std::log(sum);
  TokenLogprobs out;
  out.token = token;
  out.logprob = float(double(logits[token]) - log_z);
  out.rank = 1;
  for (int32_t i = 0; i < vocab; ++i) out.rank += logits[i] > logits[token] || (logits[i] == logits[token] && i < token);
  const int32_t n = std::clamp(top_n, 0, vocab);
  if (n == 0) return out;
  thread_local std::vector<int32_t> ids;
  ids.resize(size_t(vocab));
  for (int32_t i = 0; i < vocab; ++i) ids[size_t(i)] = i;
  auto higher = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  std::partial_sort(ids.begin(), ids.begin() + n, ids.end(), higher);
  out.top.reserve(size_t(n));
  for (int32_t k = 0; k < n; ++k) out.top.emplace_back(ids[size_t(k)], float(double(logits[ids[size_t(k)]]) - log_z));
  return out;
}

}  // namespace kvserve
