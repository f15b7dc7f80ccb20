// Quest block summaries: exact per-channel ranges under any append pattern,
// bounds that really bound every key's score, the AVX-512 kernel against the
// double-precision reference, and block selection.
#include "attention/block_summary.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "test_support.h"

namespace kvserve {
namespace {

using testing_files::expect_error_containing;

// (n, heads, d) keys with a few outlier channels, as real keys have.
std::vector<float> random_keys(int64_t n, int heads, int d, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> k(size_t(n) * size_t(heads) * size_t(d));
  for (size_t i = 0; i < k.size(); ++i) k[i] = normal(rng) * ((i % size_t(d)) % 11 == 3 ? 6.0f : 1.0f) + 0.5f;
  return k;
}

// Appends keys in chunks of 1, 7, 16, 3, 40 ... tokens, crossing block edges.
void append_in_chunks(BlockSummary& s, const std::vector<float>& keys, int kv_dim) {
  const int64_t n = int64_t(keys.size()) / kv_dim;
  const int sizes[] = {1, 7, 16, 3, 40, 1, 1, 29};
  int64_t at = 0;
  for (int i = 0; at < n; ++i) {
    const int64_t m = std::min<int64_t>(sizes[i % 8], n - at);
    s.append(std::span<const float>(keys.data() + size_t(at) * size_t(kv_dim), size_t(m) * size_t(kv_dim)));
    at += m;
  }
}

TEST(BlockSummary, RangesAreExactPerChannelUnderAnyAppendPattern) {
  const int heads = 3, d = 24, bs = 16;
  const int64_t n = 16 * 9 + 5;  // the last block partly filled
  const std::vector<float> keys = random_keys(n, heads, d, 1);
  BlockSummary chunked({bs, heads, d}), whole({bs, heads, d});
  append_in_chunks(chunked, keys, heads * d);
  whole.append(keys);
  ASSERT_EQ(chunked.num_tokens(), n);
  ASSERT_EQ(chunked.num_blocks(), 10);
  for (int64_t b = 0; b < chunked.num_blocks(); ++b)
    for (int h = 0; h < heads; ++h)
      for (int c = 0; c < d; ++c) {
        float mn = INFINITY, mx = -INFINITY;
        for (int64_t t = b * bs; t < std::min<int64_t>(n, (b + 1) * bs); ++t) {
          mn = std::min(mn, keys[size_t(t) * heads * d + size_t(h) * d + size_t(c)]);
          mx = std::max(mx, keys[size_t(t) * heads * d + size_t(h) * d + size_t(c)]);
        }
        ASSERT_EQ(chunked.block_min(b, h)[c], mn) << "block " << b << " head " << h << " channel " << c;
        ASSERT_EQ(chunked.block_max(b, h)[c], mx);
        ASSERT_EQ(whole.block_min(b, h)[c], mn);
        ASSERT_EQ(whole.block_max(b, h)[c], mx);
      }
  chunked.clear();
  EXPECT_EQ(chunked.num_blocks(), 0);
  chunked.append(std::span<const float>(keys.data(), size_t(heads) * d));
  EXPECT_EQ(chunked.block_min(0, 1)[5], keys[size_t(d) + 5]);
}

TEST(BlockSummary, BoundIsAtLeastEveryKeyScoreOfTheBlock) {
  for (int d : {8, 24, 64, 128}) {
    const int heads = 2, bs = 16, group = 3;
    const int64_t n = 16 * 40 + 11;
    const std::vector<float> keys = random_keys(n, heads, d, uint32_t(d));
    BlockSummary s({bs, heads, d});
    append_in_chunks(s, keys, heads * d);
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.0f, 2.0f);
    for (int trial = 0; trial < 5; ++trial) {
      std::vector<float> q(size_t(group) * d);
      for (auto& x : q) x = normal(rng) + 1.0f;  // queries are off the keys' centre
      for (int h = 0; h < heads; ++h) {
        std::vector<float> bound(size_t(s.num_blocks()));
        for (GroupCombine combine : {GroupCombine::Max, GroupCombine::Sum}) {
          s.upper_bounds(h, q.data(), group, combine, bound.data());
          for (int64_t b = 0; b < s.num_blocks(); ++b) {
            double best_any = -INFINITY, sum_best = 0.0;
            for (int i = 0; i < group; ++i) {
              double best = -INFINITY, magnitude = 0.0;
              for (int64_t t = b * bs; t < std::min<int64_t>(n, (b + 1) * bs); ++t) {
                double x = 0.0;
                for (int c = 0; c < d; ++c) {
                  const double kc = keys[size_t(t) * heads * d + size_t(h) * d + size_t(c)];
                  x += double(q[size_t(i) * d + size_t(c)]) * kc;
                  magnitude += std::abs(double(q[size_t(i) * d + size_t(c)]) * kc);
                }
                best = std::max(best, x);
              }
              best_any = std::max(best_any, best);
              sum_best += best;
              // Float rounding of the bound is the only slack allowed.
              if (combine == GroupCombine::Max) {
                ASSERT_GE(double(bound[size_t(b)]) + 1e-5 * magnitude, best) << "d " << d << " block " << b;
              }
            }
            if (combine == GroupCombine::Sum) ASSERT_GE(bound[size_t(b)] + 1e-3, sum_best) << "d " << d;
            else ASSERT_GE(bound[size_t(b)] + 1e-3, best_any);
          }
        }
      }
    }
  }
}

TEST(BlockSummary, KernelMatchesScalarReference) {
  for (int d : {8, 13, 24, 64, 128}) {
    for (int group : {1, 4}) {
      const int heads = 2;
      const int64_t n = 16 * 37 + 3;  // 38 blocks: two full tiles of 16 and a tail
      const std::vector<float> keys = random_keys(n, heads, d, uint32_t(d + group));
      BlockSummary s({16, heads, d});
      s.append(keys);
      std::mt19937 rng(3);
      std::normal_distribution<float> normal(0.0f, 1.0f);
      std::vector<float> q(size_t(group) * d);
      for (auto& x : q) x = normal(rng);
      double q_abs = 0.0;
      for (float x : q) q_abs += std::abs(x);
      for (GroupCombine combine : {GroupCombine::Max, GroupCombine::Sum}) {
        std::vector<float> got(size_t(s.num_blocks()));
        std::vector<double> want(size_t(s.num_blocks()));
        s.upper_bounds(1, q.data(), group, combine, got.data());
        s.upper_bounds_reference(1, q.data(), group, combine, want.data());
        // Keys are below ~30 in magnitude: relative float error of a sum of
        // group * d terms stays far below 1e-5 of sum |q| * 30.
        for (size_t b = 0; b < got.size(); ++b)
          ASSERT_NEAR(got[b], want[b], 1e-5 * q_abs * 30.0) << "d " << d << " group " << group << " block " << b;
      }
    }
  }
}

TEST(BlockSummary, SelectsThePlantedBlockAndTheLargestBounds) {
  const int d = 32, bs = 16, heads = 1;
  const int64_t n = 16 * 50;
  std::vector<float> keys = random_keys(n, heads, d, 5);
  std::vector<float> q(d, 0.0f);
  for (int c = 0; c < d; ++c) q[size_t(c)] = (c % 2 == 0) ? 1.0f : -1.0f;
  // Token 16 * 23 + 9 points straight along q, far longer than any other key.
  for (int c = 0; c < d; ++c) keys[size_t(16 * 23 + 9) * d + size_t(c)] = 40.0f * q[size_t(c)];
  BlockSummary s({bs, heads, d});
  s.append(keys);
  EXPECT_EQ(s.select(0, q.data(), 1, 1), std::vector<int32_t>{23});

  std::vector<int32_t> blocks;
  std::vector<float> bounds;
  s.select(0, q.data(), 1, 5, GroupCombine::Max, blocks, bounds);
  ASSERT_EQ(bounds.size(), 50u);
  std::vector<int32_t> order(50);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return bounds[size_t(a)] > bounds[size_t(b)]; });
  std::vector<int32_t> want(order.begin(), order.begin() + 5);
  std::sort(want.begin(), want.end());
  EXPECT_EQ(blocks, want);
  EXPECT_TRUE(std::is_sorted(blocks.begin(), blocks.end()));

  std::vector<int32_t> all(50);
  std::iota(all.begin(), all.end(), 0);
  EXPECT_EQ(s.select(0, q.data(), 1, 50), all);
  EXPECT_EQ(s.select(0, q.data(), 1, 1000), all);
  EXPECT_EQ(s.memory_bytes() >= size_t(50) * 2 * d * sizeof(float), true);
}

TEST(BlockSummary, GroupCombineMaxKeepsEachHeadsBestBlock) {
  const int d = 16, bs = 4;
  std::vector<float> keys(size_t(8 * bs) * d, 0.0f);  // 8 blocks of zero keys
  // Block 2 suits query head 0 (channel 0), block 6 suits head 1 (channel 1)
  // slightly less strongly; block 4 is moderately good for both.
  keys[size_t(2 * bs) * d + 0] = 10.0f;
  keys[size_t(6 * bs) * d + 1] = 9.0f;
  keys[size_t(4 * bs) * d + 0] = 6.0f;
  keys[size_t(4 * bs) * d + 1] = 6.0f;
  BlockSummary s({bs, 1, d});
  s.append(keys);
  std::vector<float> q(size_t(2) * d, 0.0f);
  q[0] = 1.0f;          // head 0 looks along channel 0
  q[size_t(d) + 1] = 1.0f;  // head 1 along channel 1
  EXPECT_EQ(s.select(0, q.data(), 2, 2, GroupCombine::Max), (std::vector<int32_t>{2, 6}));
  EXPECT_EQ(s.select(0, q.data(), 2, 1, GroupCombine::Sum), (std::vector<int32_t>{4}));
}

TEST(BlockSummary, BadInputsGetClearErrors) {
  expect_error_containing([] { BlockSummary s({0, 1, 8}); }, "must be positive");
  BlockSummary s({16, 2, 8});
  std::vector<float> keys(17, 1.0f);
  expect_error_containing([&] { s.append(keys); }, "not whole rows");
  keys.resize(32);
  s.append(keys);
  std::vector<float> q(8, 1.0f);
  expect_error_containing([&] { (void)s.select(0, q.data(), 1, 0); }, "k must be at least 1");
  expect_error_containing([&] { (void)s.select(2, q.data(), 1, 1); }, "KV head 2 is out of range");
  expect_error_containing([&] { (void)s.select(0, q.data(), 0, 1); }, "at least one query head");
}

}  // namespace
}  // namespace kvserve
