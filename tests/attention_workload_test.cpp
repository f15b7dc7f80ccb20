// Long-context workloads: the real one is exactly the dump's heads
// concatenated (BOS copies dropped) and re-rotated to sequence positions,
// the fitted one has the dump's mean, the synthetic one is deterministic and
// as sharp as it claims.
#include "attention/attention_workload.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "attention/retrieval_metrics.h"
#include "kernels/vector_ops.h"
#include "test_support.h"

namespace kvserve {
namespace {

using testing_files::expect_error_containing;

// Every value encodes where it came from: kind*1e6 + layer*1e5 + head*1e4 + token*10 + dim.
QkDump coded_dump() {
  QkDump d;
  d.n_layers = 2;
  d.n_heads = 4;
  d.n_kv_heads = 2;
  d.head_dim = 4;
  d.chunk = 8;
  d.n_tokens = 64;
  d.allocate();
  for (int l = 0; l < 2; ++l)
    for (int64_t t = 0; t < 64; ++t)
      for (int j = 0; j < 4; ++j) {
        for (int h = 0; h < 4; ++h) d.queries(l, h)[t * 4 + j] = float(1e6 + l * 1e5 + h * 1e4 + t * 10 + j);
        for (int h = 0; h < 2; ++h) {
          d.keys(l, h)[t * 4 + j] = float(2e6 + l * 1e5 + h * 1e4 + t * 10 + j);
          d.values(l, h)[t * 4 + j] = float(3e6 + l * 1e5 + h * 1e4 + t * 10 + j);
        }
      }
  return d;
}

TEST(AttentionWorkload, RealConcatenatesHeadsDropsRepeatedBosAndMovesToSequencePositions) {
  const QkDump d = coded_dump();
  const WorkloadShape s{20, 8, 2, 3, 1};
  const AttentionWorkload w = workload_from_dump(d, s);
  EXPECT_EQ(w.kind, "real");
  EXPECT_FLOAT_EQ(w.scale, 1.0f / std::sqrt(8.0f));
  // Usable tokens: 0..7, then 9..15, 17..23, 25.. (8, 16, 24 are BOS copies).
  const int64_t token_of[23] = {0, 1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 14, 15, 17, 18, 19, 20, 21, 22, 23, 25};
  // The last 2 (layer, KV head) pairs: layer 1, heads 0 and 1, side by side.
  auto concat = [&](float kind, int64_t t, int head0) {
    std::vector<float> row(8);
    for (int part = 0; part < 2; ++part)
      for (int j = 0; j < 4; ++j) row[size_t(part * 4 + j)] = float(kind + 1e5 + (head0 + part) * 1e4 + t * 10 + j);
    return row;
  };
  for (int64_t i = 0; i < 20; ++i) {
    const int64_t t = token_of[i];
    EXPECT_EQ(std::vector<float>(w.values.begin() + i * 8, w.values.begin() + (i + 1) * 8), concat(3e6f, t, 0));
    // Keys move from chunk position t % 8 to sequence position i.
    std::vector<float> key = concat(2e6f, t, 0);
    rope(key.data(), 2, 4, int(i - t % 8), d.rope_theta);
    EXPECT_EQ(std::vector<float>(w.keys.begin() + i * 8, w.keys.begin() + (i + 1) * 8), key) << "key " << i;
    if (i < 8) {
      EXPECT_EQ(key, concat(2e6f, t, 0)) << "the first chunk is already in place";
    }
  }
  // Queries: tokens 22, 23, 25 at sequence positions 20, 21, 22; member g
  // takes query head (KV head) * gqa + g.
  for (int i = 0; i < 3; ++i)
    for (int g = 0; g < 2; ++g) {
      const int64_t t = token_of[20 + i];
      std::vector<float> q(8);
      for (int part = 0; part < 2; ++part)
        for (int j = 0; j < 4; ++j) q[size_t(part * 4 + j)] = float(1e6 + 1e5 + (part * 2 + g) * 1e4 + t * 10 + j);
      rope(q.data(), 2, 4, int(20 + i - t % 8), d.rope_theta);
      EXPECT_EQ(std::vector<float>(w.query(i) + g * 8, w.query(i) + g * 8 + 8), q) << "step " << i << " member " << g;
    }
  ASSERT_EQ(w.prompt_queries.size(), size_t(20) * 8);

  // A dump of a RoPE-scaled model re-places its keys by the model's angles.
  QkDump scaled = d;
  scaled.rope_freqs = {0.5f, 0.03f};
  const AttentionWorkload ws = workload_from_dump(scaled, s);
  for (int64_t i = 8; i < 20; ++i) {
    std::vector<float> key = concat(2e6f, token_of[i], 0);
    rope(key.data(), 2, 4, int(i - token_of[i] % 8), scaled.rope_freqs.data());
    EXPECT_EQ(std::vector<float>(ws.keys.begin() + i * 8, ws.keys.begin() + (i + 1) * 8), key) << "key " << i;
  }
}

TEST(AttentionWorkload, BadShapesGetClearErrors) {
  const QkDump d = coded_dump();
  expect_error_containing([&] { (void)workload_from_dump(d, {20, 6, 1, 1, 1}); }, "not a multiple of the dump's head dim 4");
  expect_error_containing([&] { (void)workload_from_dump(d, {20, 20, 1, 1, 1}); }, "needs 5 heads of the dump, which has 4");
  expect_error_containing([&] { (void)workload_from_dump(d, {20, 8, 3, 1, 1}); }, "exceeds the dump's GQA group of 2");
  expect_error_containing([&] { (void)workload_from_dump(d, {56, 8, 1, 2, 1}); }, "57 usable tokens, fewer than 56 keys + 2");
  expect_error_containing([&] { (void)workload_synthetic({0, 8, 1, 1, 1}); }, "must be positive");
}

TEST(AttentionWorkload, GaussianFitMatchesTheRealMean) {
  // A dump of correlated Gaussian keys with a large mean on channel 1.
  QkDump d = coded_dump();
  d.n_tokens = 4096;
  d.allocate();
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto* buf : {&d.q, &d.k, &d.v})
    for (size_t i = 0; i < buf->size(); i += 4) {
      const float z = normal(rng);
      (*buf)[i] = z;
      (*buf)[i + 1] = 5.0f + 0.5f * z;  // outlier channel, correlated with channel 0
      (*buf)[i + 2] = normal(rng);
      (*buf)[i + 3] = normal(rng);
    }
  const AttentionWorkload w = workload_gaussian_fit(d, {20000, 8, 1, 4, 7});
  EXPECT_EQ(w.kind, "fit");
  double mean1 = 0.0, mean0 = 0.0, cov01 = 0.0;
  for (int64_t t = 0; t < 20000; ++t) {
    mean0 += w.keys[size_t(t) * 8];
    mean1 += w.keys[size_t(t) * 8 + 1];
    cov01 += double(w.keys[size_t(t) * 8]) * (w.keys[size_t(t) * 8 + 1] - 5.0);
  }
  EXPECT_NEAR(mean0 / 20000, 0.0, 0.05);
  EXPECT_NEAR(mean1 / 20000, 5.0, 0.05);
  EXPECT_NEAR(cov01 / 20000, 0.5, 0.05);
}

TEST(AttentionWorkload, SyntheticIsDeterministicAndSharp) {
  const WorkloadShape s{8192, 64, 2, 8, 5};
  const AttentionWorkload a = workload_synthetic(s), b = workload_synthetic(s);
  EXPECT_EQ(a.keys, b.keys);
  EXPECT_EQ(a.queries, b.queries);
  WorkloadShape other = s;
  other.seed = 6;
  EXPECT_NE(workload_synthetic(other).keys, a.keys);
  ASSERT_EQ(a.prompt_queries.size(), size_t(8192) * 64);
  // Sharp: the top 256 of 8192 keys hold most of each query's attention.
  for (int i = 0; i < s.n_queries; ++i) {
    const float* q = a.query(i);
    std::vector<double> logit(8192);
    double mx = -INFINITY;
    for (int64_t t = 0; t < 8192; ++t) {
      double x = 0.0;
      for (int c = 0; c < 64; ++c) x += double(q[c]) * a.keys[size_t(t) * 64 + size_t(c)];
      logit[size_t(t)] = x * a.scale;
      mx = std::max(mx, logit[size_t(t)]);
    }
    std::vector<int64_t> top = exact_top_k(a.keys.data(), 8192, 64, q, 256);
    double total = 0.0, in_top = 0.0;
    for (double x : logit) total += std::exp(x - mx);
    for (int64_t t : top) in_top += std::exp(logit[size_t(t)] - mx);
    EXPECT_GT(in_top / total, 0.5) << "query " << i;
  }
}

}  // namespace
}  // namespace kvserve
