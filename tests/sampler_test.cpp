#include "engine/sampler.h"

#include <gtest/gtest.h>

#include <cmath>

#include "util/error.h"

namespace kvserve {
namespace {

TEST(Sampler, GreedyTakesTheLowestIdAmongMaxima) {
  const float logits[] = {0.1f, 2.0f, -1.0f, 2.0f};
  Sampler s({0.0f, 0, 1.0f, 0});
  EXPECT_EQ(s.sample(logits, 4), 1);
  EXPECT_EQ(argmax(logits, 4), 1);
}

TEST(Sampler, SameSeedSameSamples) {
  std::vector<float> logits(50);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = std::sin(float(i));
  Sampler a({0.9f, 0, 1.0f, 42}), b({0.9f, 0, 1.0f, 42}), c({0.9f, 0, 1.0f, 43});
  std::vector<int32_t> sa, sb, sc;
  for (int i = 0; i < 64; ++i) {
    sa.push_back(a.sample(logits.data(), 50));
    sb.push_back(b.sample(logits.data(), 50));
    sc.push_back(c.sample(logits.data(), 50));
  }
  EXPECT_EQ(sa, sb);
  EXPECT_NE(sa, sc);
}

TEST(Sampler, FrequenciesFollowTheSoftmax) {
  const float logits[] = {std::log(0.5f), std::log(0.3f), std::log(0.2f)};
  Sampler s({1.0f, 0, 1.0f, 7});
  int counts[3] = {0, 0, 0};
  const int n = 20000;
  for (int i = 0; i < n; ++i) ++counts[s.sample(logits, 3)];
  EXPECT_NEAR(counts[0] / double(n), 0.5, 0.015);
  EXPECT_NEAR(counts[1] / double(n), 0.3, 0.015);
  EXPECT_NEAR(counts[2] / double(n), 0.2, 0.015);
}

TEST(Sampler, TopKAndTopPCutTheTail) {
  const float logits[] = {std::log(0.5f), std::log(0.3f), std::log(0.15f), std::log(0.05f)};
  Sampler k2({1.0f, 2, 1.0f, 1});
  Sampler p({1.0f, 0, 0.75f, 1});  // 0.5 + 0.3 reaches 0.75: two tokens remain
  Sampler k1({1.0f, 1, 1.0f, 1});
  for (int i = 0; i < 2000; ++i) {
    EXPECT_LT(k2.sample(logits, 4), 2);
    EXPECT_LT(p.sample(logits, 4), 2);
    EXPECT_EQ(k1.sample(logits, 4), 0);
  }
}

TEST(Sampler, RejectsInvalidOptions) {
  EXPECT_THROW(Sampler({-1.0f, 0, 1.0f, 0}), Error);
  EXPECT_THROW(Sampler({1.0f, -2, 1.0f, 0}), Error);
  EXPECT_THROW(Sampler({1.0f, 0, 0.0f, 0}), Error);
  EXPECT_THROW(Sampler({1.0f, 0, 1.5f, 0}), Error);
}

}  // namespace
}  // namespace kvserve
