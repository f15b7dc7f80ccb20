#include "engine/sampler.h"

#include <gtest/gtest.h>

#include <cmath>
#include <set>

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

TEST(Sampler, MinPCutsTokensBelowItsShareOfTheBest) {
  // p = 0.5, 0.3, 0.15, 0.05: min_p 0.4 keeps p >= 0.2 (two tokens), 0.25
  // keeps p >= 0.125 (three).
  const float logits[] = {std::log(0.5f), std::log(0.3f), std::log(0.15f), std::log(0.05f)};
  SamplerOptions o{1.0f, 0, 1.0f, 3};
  o.min_p = 0.4f;
  Sampler two(o);
  o.min_p = 0.25f;
  Sampler three(o);
  int seen_two[4] = {}, seen_three[4] = {};
  for (int i = 0; i < 4000; ++i) {
    ++seen_two[two.sample(logits, 4)];
    ++seen_three[three.sample(logits, 4)];
  }
  EXPECT_GT(seen_two[1], 0);
  EXPECT_EQ(seen_two[2] + seen_two[3], 0);
  EXPECT_GT(seen_three[2], 0);
  EXPECT_EQ(seen_three[3], 0);
  // Renormalised over what is kept: 0.3 / 0.8 of the draws for token 1.
  EXPECT_NEAR(seen_two[1] / 4000.0, 0.375, 0.03);
}

// Greedy choices after each adjustment, against the formulas.
TEST(Sampler, PenaltiesBiasAndBansMoveTheLogits) {
  const float logits[] = {2.0f, 1.9f, -0.5f, -0.6f, 1.0f};
  const std::vector<int32_t> prompt = {0, 3}, generated = {1, 1, 4};
  auto greedy = [&](SamplerOptions o, std::vector<int32_t> banned = {}) {
    o.temperature = 0;
    Sampler s(o);
    return s.sample(logits, 5, {prompt, generated, banned});
  };
  EXPECT_EQ(greedy({}), 0);
  // Repetition 1.5 over prompt and output: 2.0 -> 1.33 (0), 1.9 -> 1.27 (1),
  // 1.0 -> 0.67 (4), -0.6 -> -0.9 (3); token 2 (unseen) keeps -0.5.
  SamplerOptions rep;
  rep.repetition_penalty = 1.5f;
  EXPECT_EQ(greedy(rep), 0);
  rep.repetition_penalty = 5.0f;  // 0.4, 0.38, 0.2: still 0 over the unseen -0.5
  EXPECT_EQ(greedy(rep), 0);
  rep.logit_bias = {{2, 1.0f}};    // unseen token 2: -0.5 + 1 = 0.5 beats 0.4
  EXPECT_EQ(greedy(rep), 2);
  // Frequency 0.3 per occurrence in the output only: token 1 (twice) 1.3,
  // token 4 0.7; token 0 (prompt only) keeps 2.0.
  SamplerOptions freq;
  freq.frequency_penalty = 0.3f;
  freq.logit_bias = {{0, -0.8f}};  // 1.2 < token 1's 1.3
  EXPECT_EQ(greedy(freq), 1);
  freq.presence_penalty = 0.2f;    // token 1: 1.1 < 1.2
  EXPECT_EQ(greedy(freq), 0);
  // A negative penalty favours what was generated.
  SamplerOptions pres;
  pres.presence_penalty = -0.5f;
  EXPECT_EQ(greedy(pres), 1);      // 2.4 > 2.0
  // Banned tokens are never chosen, greedy or sampled.
  EXPECT_EQ(greedy({}, {0, 1}), 4);
  Sampler hot({2.0f, 0, 1.0f, 5});
  for (int i = 0; i < 500; ++i) EXPECT_NE(hot.sample(logits, 5, {prompt, generated, std::vector<int32_t>{0}}), 0);
}

// Extreme values stay well defined (a helper's 1e-39 temperature sampled
// the last token every step; a 1e-40 repetition penalty sampled bytes).
TEST(Sampler, ExtremeTemperaturesAndPenaltiesStayFinite) {
  const float logits[] = {0.5f, 3.0f, -1.0f, 2.0f, 0.1f};
  for (float t : {1e-39f, 1e-10f, 9e-6f}) {
    Sampler s({t, 0, 1.0f, 3});
    for (int i = 0; i < 20; ++i) EXPECT_EQ(s.sample(logits, 5), 1) << t;  // greedy
  }
  Sampler cold({1e-4f, 0, 1.0f, 3});  // sampled, but nearly greedy: no overflow to NaN
  for (int i = 0; i < 20; ++i) EXPECT_EQ(cold.sample(logits, 5), 1);
  SamplerOptions o{1.0f, 0, 1.0f, 7};
  o.repetition_penalty = 1e-40f;  // seen positive logits become huge, seen negative ones vanish
  Sampler rep(o);
  const std::vector<int32_t> prompt = {0, 2}, generated = {4};
  for (int i = 0; i < 50; ++i) {
    const int32_t t = rep.sample(logits, 5, {prompt, generated, {}});
    EXPECT_TRUE(t == 0 || t == 4) << t;
  }
}

// vLLM's allowed_token_ids and bad_words: outside the allowed set, or
// completing a bad word after the generated tokens, a token is never
// sampled; with nothing left, sample says so (-1).
TEST(Sampler, AllowedTokensAndBadWordsRestrictWhatIsSampled) {
  const float logits[] = {2.0f, 1.9f, -0.5f, -0.6f, 1.0f};
  const std::vector<int32_t> prompt = {0, 3};
  auto greedy = [&](SamplerOptions o, const std::vector<int32_t>& generated) {
    o.temperature = 0;
    Sampler s(o);
    return s.sample(logits, 5, {prompt, generated, {}});
  };
  SamplerOptions allowed;
  allowed.allowed_tokens = {2, 3};
  EXPECT_EQ(greedy(allowed, {}), 2);  // the best of the allowed
  SamplerOptions sampled = allowed;
  sampled.seed = 9;
  Sampler only(sampled);
  std::set<int32_t> seen;
  for (int i = 0; i < 300; ++i) seen.insert(only.sample(logits, 5, {prompt, {}, {}}));
  EXPECT_EQ(seen, (std::set<int32_t>{2, 3}));

  SamplerOptions bad;
  bad.bad_words = {{1}, {4, 0}};  // token 1 never; token 0 never right after 4
  EXPECT_EQ(greedy(bad, {}), 0);
  EXPECT_EQ(greedy(bad, {1, 2}), 0);
  EXPECT_EQ(greedy(bad, {2, 4}), 4);  // 0 would complete "4 0": next best after 1 is 4
  EXPECT_EQ(greedy(bad, {4, 2}), 0);  // the prefix must end the generated tokens
  bad.bad_words = {{3, 4, 0}};
  EXPECT_EQ(greedy(bad, {4}), 0);     // the prompt's 3 does not count (vLLM reads generated tokens only)
  EXPECT_EQ(greedy(bad, {3, 4}), 1);

  SamplerOptions none;
  none.allowed_tokens = {2};
  none.bad_words = {{2}};
  EXPECT_EQ(greedy(none, {}), -1);
  none.temperature = 1;
  Sampler s(none);
  EXPECT_EQ(s.sample(logits, 5, {prompt, {}, {}}), -1);
}

TEST(Sampler, RejectsInvalidOptions) {
  EXPECT_THROW(Sampler({-1.0f, 0, 1.0f, 0}), Error);
  EXPECT_THROW(Sampler({1.0f, -2, 1.0f, 0}), Error);
  EXPECT_THROW(Sampler({1.0f, 0, 0.0f, 0}), Error);
  EXPECT_THROW(Sampler({1.0f, 0, 1.5f, 0}), Error);
  auto with = [](auto edit) {
    SamplerOptions o;
    edit(o);
    return o;
  };
  EXPECT_THROW(Sampler(with([](SamplerOptions& o) { o.min_p = 1.5f; })), Error);
  EXPECT_THROW(Sampler(with([](SamplerOptions& o) { o.repetition_penalty = 0; })), Error);
  EXPECT_THROW(Sampler(with([](SamplerOptions& o) { o.presence_penalty = NAN; })), Error);
  EXPECT_THROW(Sampler(with([](SamplerOptions& o) { o.logit_bias = {{-1, 1.0f}}; })), Error);
  EXPECT_THROW(Sampler(with([](SamplerOptions& o) { o.allowed_tokens = {3, -1}; })), Error);
  EXPECT_THROW(Sampler(with([](SamplerOptions& o) { o.bad_words = {{}}; })), Error);
  EXPECT_THROW(Sampler(with([](SamplerOptions& o) { o.bad_words = {{2, -3}}; })), Error);
}

}  // namespace
}  // namespace kvserve
