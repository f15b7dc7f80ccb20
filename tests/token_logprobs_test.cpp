// Token log-probabilities equal a double-precision log-softmax of the
// logits, and the alternatives are the most likely tokens in order.
#include "engine/token_logprobs.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace kvserve {
namespace {

TEST(TokenLogprobs, MatchTheLogSoftmaxAndRankTheAlternatives) {
  std::vector<float> logits(300);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = 8.0f * std::sin(float(i) * 0.37f);
  logits[17] = logits[42];  // a tie: the lower id ranks first
  double z = 0;
  for (float l : logits) z += std::exp(double(l));
  auto reference = [&](int32_t t) { return double(logits[size_t(t)]) - std::log(z); };

  const TokenLogprobs lp = token_logprobs(logits.data(), int32_t(logits.size()), 42, 5);
  EXPECT_EQ(lp.token, 42);
  EXPECT_NEAR(lp.logprob, reference(42), 1e-5);
  ASSERT_EQ(lp.top.size(), 5u);
  for (size_t k = 0; k < lp.top.size(); ++k) {
    EXPECT_NEAR(lp.top[k].second, reference(lp.top[k].first), 1e-5);
    if (k > 0) {
      EXPECT_GE(lp.top[k - 1].second, lp.top[k].second);
    }
  }
  // The top five by value, found independently.
  std::vector<int32_t> order(logits.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = int32_t(i);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return logits[size_t(a)] > logits[size_t(b)]; });
  for (size_t k = 0; k < 5; ++k) EXPECT_EQ(lp.top[k].first, order[k]) << k;
  // Its rank in the whole vocabulary (1 = most likely; the tied 17 ranks first).
  EXPECT_EQ(lp.rank, int32_t(std::find(order.begin(), order.end(), 42) - order.begin()) + 1);
  EXPECT_EQ(token_logprobs(logits.data(), int32_t(logits.size()), order[0], 0).rank, 1);

  EXPECT_TRUE(token_logprobs(logits.data(), int32_t(logits.size()), 3, 0).top.empty());
  // Very large logits do not overflow.
  std::vector<float> big = {1000.0f, 999.0f, -1000.0f};
  const TokenLogprobs b = token_logprobs(big.data(), 3, 1, 3);
  EXPECT_NEAR(b.logprob, -1.0 - std::log1p(std::exp(-1.0)), 1e-5);
  EXPECT_EQ(b.top[0].first, 0);
  EXPECT_TRUE(std::isfinite(b.top[2].second));
}

}  // namespace
}  // namespace kvserve
