// Attention over a subset of keys: equals full attention when the subset is
// everything, matches the double-precision reference on any subset, and the
// subsets are composed exactly from sinks, windows, blocks and retrieved ids.
#include "attention/sparse_attention.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "attention/retrieval_metrics.h"
#include "test_support.h"

namespace kvserve {
namespace {

using testing_files::expect_error_containing;

struct Head {
  std::vector<float> keys, values;  // (n, d) each
  HeadKv kv() const { return {keys.data(), values.data(), int64_t(keys.size() / size_t(d)), d}; }
  int d = 0;
};

Head random_head(int64_t n, int d, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Head h;
  h.d = d;
  h.keys.resize(size_t(n) * size_t(d));
  h.values.resize(size_t(n) * size_t(d));
  for (auto& x : h.keys) x = normal(rng) * 2.0f;
  for (auto& x : h.values) x = normal(rng);
  return h;
}

std::vector<float> random_queries(int group, int d, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> q(size_t(group) * size_t(d));
  for (auto& x : q) x = normal(rng);
  return q;
}

TEST(SparseAttention, EverythingSelectedIsFullAttention) {
  for (int d : {8, 20, 64, 128}) {
    const int64_t n = 1000, group = 3;
    const Head h = random_head(n, d, uint32_t(d));
    const std::vector<float> q = random_queries(group, d, 1);
    const float scale = 1.0f / std::sqrt(float(d));
    SparseAttentionScratch scratch;
    std::vector<float> full(size_t(group) * d), pieces(full.size()), retrieved(full.size()), ref(full.size());
    const std::vector<KeyRange> one{{0, n}};
    attend_ranges(h.kv(), q.data(), group, scale, one, full.data(), scratch);
    attend_ranges_reference(h.kv(), q.data(), group, scale, one, ref.data());
    // The same keys cut into uneven runs.
    const std::vector<KeyRange> cut{{0, 1}, {1, 17}, {17, 18}, {18, 500}, {500, 999}, {999, 1000}};
    attend_ranges(h.kv(), q.data(), group, scale, cut, pieces.data(), scratch);
    // Every id retrieved (with duplicates), plus sinks and window.
    std::vector<int64_t> ids;
    for (int64_t t = n - 1; t >= 0; --t) ids.push_back(t / 2 * 2);
    for (int64_t t = 1; t < n; t += 2) ids.push_back(t);
    const std::vector<KeyRange> all = retrieval_ranges(ids, n, 4, 16);
    ASSERT_EQ(all, one);
    attend_ranges(h.kv(), q.data(), group, scale, all, retrieved.data(), scratch);
    for (size_t i = 0; i < full.size(); ++i) {
      ASSERT_NEAR(full[i], ref[i], 2e-5) << "d " << d;
      ASSERT_NEAR(pieces[i], full[i], 2e-6) << "d " << d;
      ASSERT_EQ(retrieved[i], full[i]);
    }
  }
}

TEST(SparseAttention, SubsetMatchesReference) {
  for (int d : {8, 24, 64, 128}) {
    for (int group : {1, 4}) {
      const int64_t n = 4096;
      const Head h = random_head(n, d, uint32_t(d * group));
      const std::vector<float> q = random_queries(group, d, uint32_t(group));
      const std::vector<KeyRange> ranges{{0, 4}, {100, 101}, {333, 400}, {1024, 1040}, {4000, 4096}};
      std::vector<float> got(size_t(group) * d), want(got.size());
      SparseAttentionScratch scratch;
      attend_ranges(h.kv(), q.data(), group, 0.3f, ranges, got.data(), scratch);
      attend_ranges_reference(h.kv(), q.data(), group, 0.3f, ranges, want.data());
      EXPECT_LT(relative_error(got.data(), want.data(), got.size()), 1e-5) << "d " << d << " group " << group;
    }
  }
}

TEST(SparseAttention, OneKeySelectedReturnsItsValue) {
  const Head h = random_head(50, 16, 9);
  const std::vector<float> q = random_queries(2, 16, 2);
  std::vector<float> out(32);
  SparseAttentionScratch scratch;
  const std::vector<KeyRange> r{{17, 18}};
  attend_ranges(h.kv(), q.data(), 2, 1.0f, r, out.data(), scratch);
  for (int i = 0; i < 2; ++i)
    for (int c = 0; c < 16; ++c) EXPECT_FLOAT_EQ(out[size_t(i * 16 + c)], h.values[size_t(17 * 16 + c)]);
}

TEST(SparseAttention, RetrievalRangesJoinSinksIdsAndWindow) {
  const std::vector<int64_t> ids{50, 3, 51, 95, -1, 10, 10, 91, -1};  // -1: a search's padding
  EXPECT_EQ(retrieval_ranges(ids, 100, 4, 8),
            (std::vector<KeyRange>{{0, 4}, {10, 11}, {50, 52}, {91, 100}}));
  EXPECT_EQ(retrieval_ranges(ids, 100, 0, 0),
            (std::vector<KeyRange>{{3, 4}, {10, 11}, {50, 52}, {91, 92}, {95, 96}}));
  EXPECT_EQ(retrieval_ranges({}, 10, 20, 0), (std::vector<KeyRange>{{0, 10}}));
  EXPECT_EQ(ranges_size(retrieval_ranges(ids, 100, 4, 8)), 4 + 1 + 2 + 9);
}

TEST(SparseAttention, BlockRangesCoverChosenBlocksSinksAndWindow) {
  const std::vector<int32_t> blocks{0, 3, 6};
  EXPECT_EQ(block_ranges(blocks, 16, 100, 4, 10), (std::vector<KeyRange>{{0, 16}, {48, 64}, {90, 100}}));
  // Block 3 is cut at the window's start and joins it: one run [32, 60).
  EXPECT_EQ(block_ranges(std::vector<int32_t>{2, 3}, 16, 60, 1, 5), (std::vector<KeyRange>{{0, 1}, {32, 60}}));
  expect_error_containing([] { (void)block_ranges(std::vector<int32_t>{3, 2}, 16, 100, 0, 0); }, "out of order");
  expect_error_containing([] { (void)block_ranges(std::vector<int32_t>{7}, 16, 100, 0, 0); }, "past the 100 keys");
}

TEST(SparseAttention, MetricsAreExact) {
  // Keys along one axis with distinct lengths: the top-k order is known.
  const int d = 4;
  std::vector<float> keys(size_t(10) * d, 0.0f);
  const float len[10] = {3, -1, 7, 7, 0, 9, 2, -5, 8, 1};
  for (int t = 0; t < 10; ++t) keys[size_t(t) * d] = len[t];
  const float q[4] = {1, 0, 0, 0};
  EXPECT_EQ(exact_top_k(keys.data(), 10, d, q, 4), (std::vector<int64_t>{5, 8, 2, 3}));
  const std::vector<int64_t> exact{5, 8, 2, 3};
  EXPECT_DOUBLE_EQ(recall(exact, std::vector<KeyRange>{{2, 4}, {8, 9}}), 0.75);
  EXPECT_DOUBLE_EQ(recall(exact, std::vector<int64_t>{3, 9, 5}), 0.5);
  const float a[2] = {3, 4}, b[2] = {3, 4.5f};
  EXPECT_NEAR(relative_error(b, a, 2), 0.1, 1e-9);
  expect_error_containing([&] { (void)exact_top_k(keys.data(), 10, d, q, 11); }, "k = 11 must be in [1, 10]");
}

TEST(SparseAttention, BadInputsGetClearErrors) {
  const Head h = random_head(20, 8, 1);
  const std::vector<float> q = random_queries(1, 8, 1);
  std::vector<float> out(8);
  SparseAttentionScratch scratch;
  auto run = [&](std::vector<KeyRange> r) { attend_ranges(h.kv(), q.data(), 1, 1.0f, r, out.data(), scratch); };
  expect_error_containing([&] { run({}); }, "no keys selected");
  expect_error_containing([&] { run({{0, 5}, {4, 8}}); }, "overlaps");
  expect_error_containing([&] { run({{10, 21}}); }, "passes the 20 keys");
  expect_error_containing([&] { run({{3, 3}}); }, "is empty");
  expect_error_containing([&] { (void)retrieval_ranges(std::vector<int64_t>{20}, 20, 0, 0); }, "outside [0, 20)");
  expect_error_containing([&] { (void)retrieval_ranges(std::vector<int64_t>{-2}, 20, 0, 0); }, "id -2 is outside");
  expect_error_containing([&] { (void)retrieval_ranges({}, 20, -1, 0); }, "must be >= 0");
  HeadKv empty{};
  expect_error_containing([&] { attend_ranges(empty, q.data(), 1, 1.0f, std::vector<KeyRange>{{0, 1}}, out.data(), scratch); },
                          "no keys to attend to");
}

}  // namespace
}  // namespace kvserve
