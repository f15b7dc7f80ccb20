// Outlier isolation (dense-and-sparse storage): the values furthest from
// their group's centre come back exactly, the rest within the inner codec's
// error; the kernels add the outliers' terms to the inner kernels'; invalid
// settings are refused.
#include "kv/outlier_codec.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kernels/rope_table.h"
#include "kernels/vector_ops.h"
#include "util/error.h"

namespace kvserve {
namespace {

// Normal rows with a few planted outliers (value 30 at (t, 5 t % kv_dim)).
std::vector<float> rows_with_outliers(int n, int kv_dim, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(size_t(n) * size_t(kv_dim));
  for (auto& e : x) e = normal(rng);
  for (int t = 0; t < n; ++t) x[size_t(t) * kv_dim + size_t(5 * t % kv_dim)] = t % 2 ? 30.0f : -30.0f;
  return x;
}

KvCodecConfig with_outliers(KvCodecConfig c, int n) {
  c.outliers = n;
  return c;
}

std::vector<KvCodecConfig> configs() {
  std::vector<KvCodecConfig> v = {{KvDType::INT8, KvGrouping::Token, 0, {}, {}},
                                  {KvDType::INT4, KvGrouping::Token, 0, {}, {}},
                                  {KvDType::INT4, KvGrouping::Channel, 0, {}, {}},
                                  {KvDType::INT2, KvGrouping::Channel, 0, {}, {}}};
  KvCodecConfig small{KvDType::INT4, KvGrouping::Channel, 0, {}, {}};
  small.scale_bits = 8;  // int4-small's keys
  v.push_back(small);
  KvCodecConfig pre{KvDType::INT2, KvGrouping::Channel, 0, {}, {}};
  pre.pre_rope = true;  // the int2 preset's keys
  v.push_back(pre);
  return v;
}

double rms_error(const KvCodec& codec, const std::vector<float>& x, int n) {
  std::vector<uint8_t> block(codec.block_bytes());
  codec.encode_block(block.data(), x.data(), n);
  const int kv_dim = codec.shape().kv_dim();
  std::vector<float> out(static_cast<size_t>(kv_dim));
  double sum = 0;
  for (int t = 0; t < n; ++t) {
    codec.decode_token(block.data(), t, out.data());
    for (int d = 0; d < kv_dim; ++d) sum += std::pow(out[size_t(d)] - x[size_t(t) * kv_dim + d], 2);
  }
  return std::sqrt(sum / (double(n) * kv_dim));
}

TEST(OutlierCodec, KeepsTheFurthestValuesAndShrinksTheRest) {
  for (const KvBlockShape& s : {KvBlockShape{32, 2, 64}, KvBlockShape{32, 4, 8}})
    for (const KvCodecConfig& c : configs()) {
      auto plain = make_kv_codec(c, s);
      auto kept = make_kv_codec(with_outliers(c, 1), s);
      EXPECT_EQ(kept->block_bytes(), plain->block_bytes() + size_t(s.block_size) * 4) << c.describe();
      EXPECT_NE(kept->config().describe().find("+o1"), std::string::npos);
      const int n = s.block_size - 3, kv_dim = s.kv_dim();
      std::vector<float> x = rows_with_outliers(s.block_size, kv_dim, 3);
      std::vector<uint8_t> block(kept->block_bytes());
      kept->encode_block(block.data(), x.data(), n);
      std::vector<float> out(static_cast<size_t>(kv_dim));
      for (int t = 0; t < n; ++t) {
        kept->decode_token(block.data(), t, out.data());
        const size_t d = size_t(5 * t % kv_dim);
        // The planted value, exact but for the fp16 rounding of its delta.
        ASSERT_NEAR(out[d], x[size_t(t) * kv_dim + d], 40.0 / 1024) << c.describe() << " token " << t;
      }
      const double with = rms_error(*kept, x, n), without = rms_error(*plain, x, n);
      EXPECT_LT(with, without) << c.describe() << " hd " << s.head_dim;
    }
}

// Both the kernels and the reference see the same inner block plus exact
// outlier terms, so the outlier codec misses its reference by what the inner
// codec misses its own by (8-bit folds), up to float rounding.
TEST(OutlierCodec, KernelsAddTheOutliersToTheInnerKernels) {
  // 12-dim heads (not a power of two) take the scalar scan.
  for (const KvBlockShape& s : {KvBlockShape{32, 2, 64}, KvBlockShape{32, 2, 12}}) {
    for (const KvCodecConfig& c : configs()) {
      for (int count : {1, 2}) {
        if (c.pre_rope) continue;  // score is the post-RoPE path; score_tokens below covers pre-RoPE keys
        auto kept = make_kv_codec(with_outliers(c, count), s);
        auto inner = make_kv_codec(c, s);
        const int hd = s.head_dim, bs = s.block_size, n = bs - 5, n_q = 3, stride = bs + 3;
        std::vector<float> x = rows_with_outliers(bs, s.kv_dim(), 9);
        std::vector<uint8_t> block(kept->block_bytes());
        kept->encode_block(block.data(), x.data(), bs);  // the inner codec's block comes first
        std::vector<float> q = rows_with_outliers(n_q, hd, 10);
        std::vector<float> w(size_t(n_q) * stride);
        for (size_t i = 0; i < w.size(); ++i) w[i] = std::fabs(std::sin(float(i)));
        for (int h = 0; h < s.n_kv_heads; ++h) {
          std::vector<float> s1(size_t(n_q) * stride), r1(s1.size()), s2(s1.size()), r2(s1.size());
          kept->score(q.data(), n_q, block.data(), n, h, 0.125f, s1.data(), stride);
          score_reference(*kept, q.data(), n_q, block.data(), n, h, 0.125f, r1.data(), stride);
          inner->score(q.data(), n_q, block.data(), n, h, 0.125f, s2.data(), stride);
          score_reference(*inner, q.data(), n_q, block.data(), n, h, 0.125f, r2.data(), stride);
          bool any_term = false;
          for (int i = 0; i < n_q; ++i)
            for (int t = 0; t < n; ++t) {
              const size_t k = size_t(i * stride + t);
              any_term = any_term || std::fabs(r1[k] - r2[k]) > 0.1;
              ASSERT_NEAR(s1[k] - r1[k], s2[k] - r2[k], 1e-4 * (1 + std::fabs(r1[k]))) << c.describe() << " head " << h;
            }
          EXPECT_TRUE(any_term) << "no outlier in head " << h << ": the test plants one per token";
          std::vector<float> o1(size_t(n_q) * hd, 0.5f), p1(o1), o2(o1), p2(o1);
          kept->accumulate(w.data(), n_q, stride, block.data(), n, h, o1.data());
          accumulate_reference(*kept, w.data(), n_q, stride, block.data(), n, h, p1.data());
          inner->accumulate(w.data(), n_q, stride, block.data(), n, h, o2.data());
          accumulate_reference(*inner, w.data(), n_q, stride, block.data(), n, h, p2.data());
          for (size_t i = 0; i < o1.size(); ++i)
            ASSERT_NEAR(o1[i] - p1[i], o2[i] - p2[i], 1e-4 * (1 + std::fabs(p1[i]))) << c.describe();
        }
      }
    }
  }
}

// Pre-RoPE keys: with a query per token (score_tokens), and with one query
// rotated back to the block's start while each key turns by its offset
// (score_offsets), both against the decoded keys turned by rope().
TEST(OutlierCodec, PreRopeKeysMeetTheOutliersAtTheirPositions) {
  for (int count : {1, 2}) {
    SCOPED_TRACE(count);
    const KvBlockShape s{32, 2, 64};
    KvCodecConfig c{KvDType::INT2, KvGrouping::Channel, 0, {}, {}};
    c.pre_rope = true;
    auto kept = make_kv_codec(with_outliers(c, count), s);
    const int hd = s.head_dim, n = s.block_size - 2, n_q = 2, stride = s.block_size;
    std::vector<float> x = rows_with_outliers(s.block_size, s.kv_dim(), 4);
    std::vector<uint8_t> block(kept->block_bytes());
    kept->encode_block(block.data(), x.data(), s.block_size);
    std::vector<float> key(static_cast<size_t>(s.kv_dim()));
    auto key_at = [&](int t, int offset) {  // head 1 of token t, decoded, then turned by rope to `offset`
      kept->decode_token(block.data(), t, key.data());
      std::vector<float> k(key.begin() + hd, key.begin() + 2 * hd);
      rope(k.data(), 1, hd, offset, 10000.0f);
      return k;
    };
    std::vector<float> qt = rows_with_outliers(s.block_size * n_q, hd, 6);  // (token, n_q, hd)
    std::vector<float> got(size_t(n_q) * stride);
    kept->score_tokens(qt.data(), n_q, block.data(), n, 1, 1.0f, got.data(), stride);
    for (int t = 0; t < n; ++t) {
      const std::vector<float> k = key_at(t, 0);
      for (int i = 0; i < n_q; ++i) {
        double want = 0;
        for (int d = 0; d < hd; ++d) want += double(qt[(size_t(t) * n_q + i) * hd + d]) * k[size_t(d)];
        ASSERT_NEAR(got[size_t(i * stride + t)], want, 1e-3 * (1 + std::fabs(want)));
      }
    }
    const RopeTable table(s.block_size, hd, 10000.0f);
    std::vector<float> q = rows_with_outliers(n_q, hd, 8);
    // Builds without the inner codec's offset kernel (AVX2) take score_tokens.
    if (!kept->score_offsets(q.data(), n_q, block.data(), n, 1, 1.0f, table, got.data(), stride)) continue;
    for (int t = 0; t < n; ++t) {
      const std::vector<float> k = key_at(t, t);
      for (int i = 0; i < n_q; ++i) {
        double want = 0;
        for (int d = 0; d < hd; ++d) want += double(q[size_t(i) * hd + d]) * k[size_t(d)];
        // The inner offset kernel rounds its query to 16 bits per block.
        ASSERT_NEAR(got[size_t(i * stride + t)], want, 2e-3 * (1 + std::fabs(want))) << "token " << t;
      }
    }
  }
}

// Token codecs also encode one token at a time (no residual window): the
// same outliers, the same bytes for the token's slot as a block encoding.
TEST(OutlierCodec, TokenEncodingKeepsTheSameOutliers) {
  const KvBlockShape s{16, 2, 64};
  auto kept = make_kv_codec(with_outliers({KvDType::INT4, KvGrouping::Token, 0, {}, {}}, 2), s);
  const int kv_dim = s.kv_dim();
  std::vector<float> x = rows_with_outliers(s.block_size, kv_dim, 5);
  std::vector<uint8_t> by_token(kept->block_bytes()), by_block(kept->block_bytes());
  for (int t = 0; t < s.block_size; ++t) kept->encode_token(by_token.data(), t, x.data() + size_t(t) * kv_dim);
  kept->encode_block(by_block.data(), x.data(), s.block_size);
  EXPECT_EQ(by_token, by_block);
  std::vector<float> out(static_cast<size_t>(kv_dim));
  for (int t = 0; t < s.block_size; ++t) {
    kept->decode_token(by_token.data(), t, out.data());
    const size_t d = size_t(5 * t % kv_dim);
    ASSERT_NEAR(out[d], x[size_t(t) * kv_dim + d], 40.0 / 1024) << "token " << t;
  }
}

TEST(OutlierCodec, RefusesWhatItCannotKeep) {
  const KvBlockShape s{16, 2, 8};
  EXPECT_THROW(make_kv_codec(with_outliers({KvDType::F16}, 1), s), Error);
  EXPECT_THROW(make_kv_codec(with_outliers({KvDType::Q4_0}, 1), KvBlockShape{16, 4, 8}), Error);
  EXPECT_THROW(make_kv_codec(with_outliers({KvDType::INT4, KvGrouping::Token, 0, {}, {}}, 17), s), Error);  // > kv_dim 16
  EXPECT_THROW(make_kv_codec(with_outliers({KvDType::INT4, KvGrouping::Token, 0, {}, {}}, -1), s), Error);
  EXPECT_NO_THROW(make_kv_codec(with_outliers({KvDType::INT4, KvGrouping::Token, 0, {}, {}}, 16), s));
}

}  // namespace
}  // namespace kvserve
