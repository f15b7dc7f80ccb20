// Every KV codec: round-trip error within its format's bound, and the
// attention kernels (score, accumulate) equal the decode-based reference.
#include "kv/kv_codec.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <set>
#include <string>

#include "kernels/rope_table.h"
#include "kernels/vector_ops.h"
#include "kv/channel_codec.h"
#include "kv/int_codecs.h"
#include "kv/scale8.h"
#include "util/error.h"
#include "util/half.h"

namespace kvserve {
namespace {

struct Case {
  KvCodecConfig config;
  KvBlockShape shape;
};

std::string name(const Case& c) {
  return c.config.describe() + " hd" + std::to_string(c.shape.head_dim) + " bs" + std::to_string(c.shape.block_size);
}

// Values with a few outlier channels, like real keys.
std::vector<float> sample_rows(int n, int kv_dim, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(size_t(n) * size_t(kv_dim));
  for (int t = 0; t < n; ++t)
    for (int d = 0; d < kv_dim; ++d) x[size_t(t) * kv_dim + d] = normal(rng) * (d % 7 == 3 ? 6.0f : 1.0f) + (d % 5 == 1 ? 2.0f : 0.0f);
  return x;
}

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  const KvBlockShape small{16, 4, 8}, wide{16, 2, 64};
  for (KvDType t : {KvDType::F32, KvDType::F16, KvDType::BF16, KvDType::FP8, KvDType::FP8_E5M2})
    cases.push_back({{t}, small});
  for (KvDType t : {KvDType::INT8, KvDType::INT4, KvDType::INT2}) {
    cases.push_back({{t, KvGrouping::Token, 0, {}, {}}, small});     // one group per head
    cases.push_back({{t, KvGrouping::Token, 4, {}, {}}, small});     // finer groups
    cases.push_back({{t, KvGrouping::Token, 32, {}, {}}, small});    // across all four heads
    cases.push_back({{t, KvGrouping::Token, 32, {}, {}}, wide});
    cases.push_back({{t, KvGrouping::Channel, 0, {}, {}}, small});   // whole block
    cases.push_back({{t, KvGrouping::Channel, 8, {}, {}}, wide});    // half blocks
    for (KvCodecConfig c8 : {KvCodecConfig{t, KvGrouping::Token, 0, {}, {}}, KvCodecConfig{t, KvGrouping::Token, 4, {}, {}},
                             KvCodecConfig{t, KvGrouping::Channel, 0, {}, {}}}) {  // 8-bit scales
      c8.scale_bits = 8;
      cases.push_back({c8, small});
      cases.push_back({c8, wide});
    }
    KvCodecConfig st{t, KvGrouping::Token, 0, {}, {}};
    st.static_min.assign(32, -3.0f);
    st.static_max.assign(32, 4.0f);
    cases.push_back({st, small});
  }
  cases.push_back({{KvDType::Q4_0}, small});
  cases.push_back({{KvDType::Q4_0}, wide});
  // 4-bit values with one group per head in 32-token blocks meet 8-bit
  // weights (token_weight_steps); 8-dim heads through the scalar loop.
  for (const KvBlockShape& s : {KvBlockShape{32, 4, 8}, KvBlockShape{32, 2, 64}})
    for (int bits : {16, 8}) {
      KvCodecConfig c{KvDType::INT4, KvGrouping::Token, 0, {}, {}};
      c.scale_bits = bits;
      cases.push_back({c, s});
    }
  // The small presets' layout since the tenth session: 64-token blocks, keys
  // in one 64-token channel group (or two of 32), values one group per head,
  // 8-bit scales; 4-bit keys take the 8-bit query kernel there.
  for (KvDType t : {KvDType::INT4, KvDType::INT2})
    for (KvCodecConfig c : {KvCodecConfig{t, KvGrouping::Channel, 0, {}, {}},
                            KvCodecConfig{t, KvGrouping::Channel, 32, {}, {}},
                            KvCodecConfig{t, KvGrouping::Token, 0, {}, {}}}) {
      c.scale_bits = 8;
      cases.push_back({c, KvBlockShape{64, 2, 64}});
    }
  // The int2 presets' keys: channel-major like post-RoPE keys, stored
  // rotated within 16-token RoPE spans (score is then every span at once).
  for (KvDType t : {KvDType::INT4, KvDType::INT2}) {
    KvCodecConfig c{t, KvGrouping::Channel, 0, {}, {}};
    c.scale_bits = 8;
    c.pre_rope = true;
    c.rope_span = 16;
    cases.push_back({c, KvBlockShape{64, 2, 64}});
  }
  // Keys exactly before RoPE keep token rows with per-channel groups (the
  // vector kernels' dynamic token-row source).
  for (KvDType t : {KvDType::INT8, KvDType::INT4, KvDType::INT2}) {
    KvCodecConfig c{t, KvGrouping::Channel, 16, {}, {}};
    c.pre_rope = true;
    cases.push_back({c, KvBlockShape{32, 2, 64}});
  }
  return cases;
}

// The worst error a codec may make on value x of a group spanning [lo, hi].
// run_lo: with 8-bit scales, the largest |lo| of the groups sharing the
// group's header (the min is rounded down by at most run_lo / 127 plus an
// fp16 rounding, and the scale up by at most 2^(1/16) and an fp16 rounding).
double bound(const KvCodecConfig& c, double lo, double hi, double amax, double run_lo) {
  if (c.scale_bits == 8) {
    const double levels = (1 << kv_dtype_bits(c.dtype)) - 1;
    return 0.5 * (hi - lo + run_lo / 127 * 1.002 + run_lo / 1024) * 1.046 / levels + 1e-6;
  }
  switch (c.dtype) {
    case KvDType::F32: return 0;
    case KvDType::F16: return amax * 4.9e-4;
    case KvDType::BF16: return amax * 3.9e-3;
    case KvDType::FP8: return amax / 16 + 1.0 / 1024;  // half of a 3-bit mantissa's step; half a subnormal step
    case KvDType::FP8_E5M2: return amax / 8 + 1.0 / 131072;  // the same for a 2-bit mantissa
    case KvDType::Q4_0: return amax / 8 * 1.01 + 1e-6;  // the side opposite the max clips by one step
    default: {
      const double levels = (1 << kv_dtype_bits(c.dtype)) - 1;
      // Half a step, plus the fp16 rounding of the scale (over all levels) and the min.
      return 0.5 * (hi - lo) / levels + (hi - lo) * 1e-3 + std::fabs(lo) * 1e-3 + 1e-6;
    }
  }
}

TEST(KvCodec, RoundTripWithinFormatBound) {
  for (const Case& c : all_cases()) {
    auto codec = make_kv_codec(c.config, c.shape);
    const int kv_dim = c.shape.kv_dim(), bs = c.shape.block_size;
    std::vector<float> x = sample_rows(bs, kv_dim, 1);
    if (c.config.is_static()) for (auto& v : x) v = std::clamp(v, -3.0f, 4.0f);
    std::vector<uint8_t> block(codec->block_bytes());
    codec->encode_block(block.data(), x.data(), bs);
    const int g = codec->config().group_size;
    std::vector<float> y(static_cast<size_t>(kv_dim));
    for (int t = 0; t < bs; ++t) {
      codec->decode_token(block.data(), t, y.data());
      for (int d = 0; d < kv_dim; ++d) {
        // The group this value was quantized with.
        double lo = 1e30, hi = -1e30, amax = 0;
        auto visit = [&](float v) { lo = std::min(lo, double(v)); hi = std::max(hi, double(v)); amax = std::max(amax, std::fabs(double(v))); };
        if (c.config.is_static()) {
          lo = -3, hi = 4, amax = 4;
        } else if (c.config.dtype == KvDType::Q4_0) {
          for (int e = d / 32 * 32; e < d / 32 * 32 + 32; ++e) visit(x[size_t(t) * kv_dim + e]);
        } else if (c.config.grouping == KvGrouping::Channel && kv_dtype_is_quantized(c.config.dtype)) {
          for (int s = t / g * g; s < t / g * g + g; ++s) visit(x[size_t(s) * kv_dim + d]);
        } else if (kv_dtype_is_quantized(c.config.dtype)) {
          for (int e = d / g * g; e < d / g * g + g; ++e) visit(x[size_t(t) * kv_dim + e]);
        } else {
          visit(x[size_t(t) * kv_dim + d]);
        }
        // 8-bit scales: the groups sharing this group's header (a head's
        // channels for channel groups, a head's whole block for token groups).
        double run_lo = 0;
        if (c.config.scale_bits == 8) {
          const int hd = c.shape.head_dim, h0 = d / hd * hd;
          const bool channel = c.config.grouping == KvGrouping::Channel;
          const int s0 = channel ? t / g * g : 0, s1 = channel ? s0 + g : bs;
          for (int s = s0; s < s1; ++s)
            for (int e = h0; e < h0 + hd; e += channel ? 1 : g) {
              const int span = channel ? 1 : g;
              double group_lo = 1e30;
              if (channel) {
                for (int u = s0; u < s1; ++u) group_lo = std::min(group_lo, double(x[size_t(u) * kv_dim + e]));
              } else {
                for (int f = e; f < e + span; ++f) group_lo = std::min(group_lo, double(x[size_t(s) * kv_dim + f]));
              }
              run_lo = std::max(run_lo, std::fabs(group_lo));
            }
        }
        const double err = std::fabs(double(y[size_t(d)]) - x[size_t(t) * kv_dim + d]);
        ASSERT_LE(err, bound(c.config, lo, hi, amax, run_lo)) << name(c) << " token " << t << " channel " << d;
      }
    }
  }
}

TEST(KvCodec, TokenEncodingEqualsBlockEncoding) {
  for (const Case& c : all_cases()) {
    auto codec = make_kv_codec(c.config, c.shape);
    if (!codec->encodes_tokens()) continue;
    const int kv_dim = c.shape.kv_dim();
    std::vector<float> x = sample_rows(c.shape.block_size, kv_dim, 2);
    std::vector<uint8_t> a(codec->block_bytes()), b(codec->block_bytes());
    codec->encode_block(a.data(), x.data(), c.shape.block_size);
    for (int t = 0; t < c.shape.block_size; ++t) codec->encode_token(b.data(), t, x.data() + size_t(t) * kv_dim);
    EXPECT_EQ(a, b) << name(c);
  }
}

// Whether the vector kernels round a folded operand to 16 bits
// (int_codecs.cpp) for dynamic integer codes of this grouping.
bool rounds_folded(const KvCodec& codec, KvGrouping grouping) {
  const KvCodecConfig& c = codec.config();
  return kv_dtype_is_quantized(c.dtype) && c.dtype != KvDType::Q4_0 && c.grouping == grouping && !c.is_static();
}
// The largest magnitude among the first n decoded tokens of a KV head.
double max_decoded(const KvCodec& codec, const uint8_t* block, int n, int kv_head) {
  const int hd = codec.shape().head_dim;
  std::vector<float> x(size_t(codec.shape().kv_dim()));
  double top = 0;
  for (int t = 0; t < n; ++t) {
    codec.decode_token(block, t, x.data());
    for (int d = 0; d < hd; ++d) top = std::max(top, std::fabs(double(x[size_t(kv_head * hd + d)])));
  }
  return top;
}
double max_abs(const float* x, int n) {
  double top = 0;
  for (int i = 0; i < n; ++i) top = std::max(top, std::fabs(double(x[i])));
  return top;
}

// Dynamic channel-grouped keys are scored against the query folded with the
// channel scales and rounded to L = channel_query_steps steps (16 or 8 bits):
// per channel at most half a step of max_c |q_c scale_c| / L against a code
// of at most 2^B - 1, and scale_c (2^B - 1) is the channel's range, at most
// 2 max |k|. Token-grouped and q4_0 keys scored as integers
// (token_query_steps) round the query itself to steps of max |q| / L,
// against codes centred on their group's midpoint: at most half a step of
// max |q| / L against half the range, so the same bound holds with room to
// spare.
double folded_query_error(const KvCodec& codec, const float* q, const uint8_t* block, int n, int kv_head,
                          float scale) {
  const int steps = rounds_folded(codec, KvGrouping::Channel) ? channel_query_steps(codec.config(), codec.shape())
                                                             : token_query_steps(codec.config(), codec.shape());
  if (steps == 0) return 0;
  const int hd = codec.shape().head_dim;
  return 1.01 * scale * hd * max_abs(q, hd) * max_decoded(codec, block, n, kv_head) / steps;
}

// Values with one group per head are accumulated with u_t = w_t scale_t
// rounded to 16 bits, or 8 where the codec says so (token_weight_steps):
// per token at most half a step of max_t u_t / steps against a code of at
// most 2^B - 1, and scale_t (2^B - 1) is the token's range: at most 2 max |v|,
// or (2^B - 1) / 7 max |v| with 8-bit scales (rounded up by up to 4.4%,
// the top value can land on code 14). No credit is taken for the 8-bit
// path's midpoint correction. w: the weights of one query.
double folded_weight_error(const KvCodec& codec, const float* w, const uint8_t* block, int n, int kv_head) {
  if (!rounds_folded(codec, KvGrouping::Token)) return 0;
  const int steps = token_weight_steps(codec.config(), codec.shape());
  return 1.08 * n * max_abs(w, n) * max_decoded(codec, block, n, kv_head) / (steps > 0 ? steps : 32767);
}

// What float summation order alone may change in sum_t w_t v_t: n rounding
// errors of a running sum, each at most 2^-24 of its terms' magnitudes. The
// kernels factor the sum (scale_c sum_t w_t code_tc + min_c sum_t w_t for
// channel groups): two sums whose terms are each at most 2 max |v| |w_t|,
// and can cancel (the scalar path measured 2.7e-4 on an output of -0.063
// over 64 tokens, beyond the 1e-4 relative bound).
double reordering_error(const KvCodec& codec, const float* w, const uint8_t* block, int n, int kv_head) {
  double wsum = 0;
  for (int t = 0; t < n; ++t) wsum += std::fabs(double(w[t]));
  return 4 * n * std::ldexp(1.0, -24) * wsum * max_decoded(codec, block, n, kv_head);
}

TEST(KvCodec, ScoreAndAccumulateMatchReference) {
  for (const Case& c : all_cases()) {
    auto codec = make_kv_codec(c.config, c.shape);
    const int kv_dim = c.shape.kv_dim(), hd = c.shape.head_dim, bs = c.shape.block_size;
    std::vector<float> x = sample_rows(bs, kv_dim, 3);
    std::vector<uint8_t> block(codec->block_bytes());
    const int n = bs - 3;  // a partly filled block
    codec->encode_block(block.data(), x.data(), n);
    const int n_q = 3, stride = bs + 5;
    std::vector<float> q = sample_rows(n_q, hd, 4);
    for (int h = 0; h < c.shape.n_kv_heads; ++h) {
      std::vector<float> s1(size_t(n_q) * stride), s2(s1.size());
      codec->score(q.data(), n_q, block.data(), n, h, 0.3f, s1.data(), stride);
      score_reference(*codec, q.data(), n_q, block.data(), n, h, 0.3f, s2.data(), stride);
      for (int i = 0; i < n_q; ++i)
        for (int t = 0; t < n; ++t)
          ASSERT_NEAR(s1[size_t(i * stride + t)], s2[size_t(i * stride + t)],
                      1e-4 * (1 + std::fabs(s2[size_t(i * stride + t)])) +
                          folded_query_error(*codec, q.data() + size_t(i) * hd, block.data(), n, h, 0.3f))
              << name(c) << " head " << h;
      std::vector<float> w(s1.size());
      for (size_t i = 0; i < w.size(); ++i) w[i] = std::fabs(std::sin(float(i)));
      // Then the first n of a full block: what lies past n must not count.
      std::vector<uint8_t> full(codec->block_bytes());
      codec->encode_block(full.data(), x.data(), bs);
      for (const std::vector<uint8_t>* b : {&block, &full}) {
        std::vector<float> o1(size_t(n_q) * hd, 0.25f), o2(o1);
        codec->accumulate(w.data(), n_q, stride, b->data(), n, h, o1.data());
        accumulate_reference(*codec, w.data(), n_q, stride, b->data(), n, h, o2.data());
        double allowance = 0;  // of the query of element i
        for (size_t i = 0; i < o1.size(); ++i) {
          if (i % size_t(hd) == 0) {
            const float* wi = w.data() + i / size_t(hd) * stride;
            allowance = folded_weight_error(*codec, wi, b->data(), n, h) + reordering_error(*codec, wi, b->data(), n, h);
          }
          ASSERT_NEAR(o1[i], o2[i], 1e-4 * (1 + std::fabs(o2[i])) + allowance)
              << name(c) << (b == &full ? " (full block)" : "");
        }
      }
    }
  }
}

// The vector kernels at model shapes: whole-head, finer and cross-head token
// groups, channel groups, static scales, blocks longer than one 16-token tile,
// partial blocks of odd length, and GQA groups that need several passes.
std::vector<Case> model_cases() {
  // Every layout at one shape, with the given channel groups.
  auto add_shape = [](std::vector<Case>& cases, const KvBlockShape& s, std::initializer_list<int> channel_groups) {
    for (KvDType t : {KvDType::F32, KvDType::F16, KvDType::BF16, KvDType::FP8, KvDType::FP8_E5M2, KvDType::Q4_0})
      cases.push_back({{t}, s});
    for (KvDType t : {KvDType::INT8, KvDType::INT4, KvDType::INT2}) {
      for (int g : {0, 4, 16, 2 * s.head_dim}) {
        if (g > s.kv_dim()) continue;
        cases.push_back({{t, KvGrouping::Token, g, {}, {}}, s});
      }
      // 32: two key groups per 64-token block for the 8-bit query kernel (groups of 32+ tokens).
      for (int g : channel_groups)
        if (g < s.block_size) cases.push_back({{t, KvGrouping::Channel, g, {}, {}}, s});
      for (KvCodecConfig c8 : {KvCodecConfig{t, KvGrouping::Token, 0, {}, {}}, KvCodecConfig{t, KvGrouping::Token, 16, {}, {}},
                               KvCodecConfig{t, KvGrouping::Channel, 0, {}, {}}, KvCodecConfig{t, KvGrouping::Channel, 8, {}, {}}}) {
        c8.scale_bits = 8;  // the kernels read decoded 8-bit scales
        cases.push_back({c8, s});
      }
      KvCodecConfig st{t, KvGrouping::Token, 0, {}, {}};
      st.static_min.assign(size_t(s.kv_dim()), -3.0f);
      st.static_max.assign(size_t(s.kv_dim()), 4.0f);
      for (int d = 0; d < s.kv_dim(); ++d) st.static_max[size_t(d)] += float(d % 5);  // distinct channels
      cases.push_back({st, s});
    }
  };
  // Every combination at these shapes is valid: a codec that refuses one
  // fails the test.
  std::vector<Case> cases, extra;
  for (const KvBlockShape& s : {KvBlockShape{16, 8, 64}, KvBlockShape{32, 2, 128}, KvBlockShape{16, 4, 32},
                                KvBlockShape{64, 2, 64}}) {
    add_shape(cases, s, {0, 8, 32});
    for (KvDType t : {KvDType::INT8, KvDType::INT4, KvDType::INT2})
      for (int g : {12, 4}) extra.push_back({{t, KvGrouping::Channel, g, {}, {}}, s});
  }
  // These reach the 8-bit query kernel's three-tile and second-call paths
  // (44, 128 tokens), AVX2 tails (20, 12, 36), and 4-bit heads that are not
  // whole octets (12 channels, which keep byte rows) or end in one (40).
  // Some of their combinations (and of the extra channel groups above) are
  // invalid, a group not dividing the block or the row; they are dropped
  // here, and ParsesNamesAndRejectsBadCombinations covers them.
  for (const KvBlockShape& s : {KvBlockShape{44, 2, 64}, KvBlockShape{128, 2, 64}, KvBlockShape{20, 2, 64},
                                KvBlockShape{16, 2, 12}, KvBlockShape{12, 3, 8}, KvBlockShape{48, 2, 40},
                                KvBlockShape{36, 2, 12}})
    add_shape(extra, s, {0, 8, 32, 12, 4});
  for (const Case& c : extra) {
    try {
      make_kv_codec(c.config, c.shape);
      cases.push_back(c);
    } catch (const Error&) {
    }
  }
  return cases;
}

// A full block of one KV head's rows x whose codes are the intended ones
// (every value exact in the format); empty, with a failure, otherwise.
std::vector<uint8_t> encode_exactly(const KvCodec& codec, const std::vector<float>& x) {
  const int hd = codec.shape().head_dim, bs = codec.shape().block_size;
  std::vector<uint8_t> block(codec.block_bytes());
  codec.encode_block(block.data(), x.data(), bs);
  std::vector<float> decoded(static_cast<size_t>(hd));
  for (int t = 0; t < bs; ++t) {
    codec.decode_token(block.data(), t, decoded.data());
    for (int d = 0; d < hd; ++d)
      if (decoded[size_t(d)] != x[size_t(t) * hd + d]) {
        ADD_FAILURE() << "token " << t << " channel " << d << " decodes to " << decoded[size_t(d)] << ", not "
                      << x[size_t(t) * hd + d];
        return {};
      }
  }
  return block;
}

// The 8-bit query kernel (4-bit keys, groups of 32+ tokens) adds the part of
// its rounding residuals at the codes' midpoint to the bias: what remains,
// step sum_c r_c (code_tc - 7.5), averages to zero over tokens whose codes
// cover 0..15 evenly. Keys here give every channel each code exactly twice
// in 32 tokens (exact fp16 ranges), so the mean error over the block must be
// far below one step; without the correction it is tens of steps.
TEST(KvCodec, EightBitQueryResidualAveragesOut) {
  const KvBlockShape shape{32, 1, 64};
  const KvCodecConfig config{KvDType::INT4, KvGrouping::Channel, 0, {}, {}};
  if (channel_query_steps(config, shape) != 127) GTEST_SKIP() << "no 8-bit query kernel in this build";
  auto codec = make_kv_codec(config, shape);
  const int hd = shape.head_dim, bs = shape.block_size;
  std::vector<float> x(size_t(bs) * hd);
  for (int t = 0; t < bs; ++t)
    for (int c = 0; c < hd; ++c) {
      const float w = 0.25f * float(1 + c % 4);  // exact in fp16, as are the mins
      x[size_t(t) * hd + c] = w * float((t + 3 * c) % 16 - 8);
    }
  const std::vector<uint8_t> block = encode_exactly(*codec, x);
  ASSERT_FALSE(block.empty());
  const int n_q = 3;
  std::vector<float> q = sample_rows(n_q, hd, 9);
  std::vector<float> s1(size_t(n_q) * bs), s2(s1.size());
  codec->score(q.data(), n_q, block.data(), bs, 0, 1.0f, s1.data(), bs);
  score_reference(*codec, q.data(), n_q, block.data(), bs, 0, 1.0f, s2.data(), bs);
  for (int i = 0; i < n_q; ++i) {
    double top = 0, mean = 0;  // max_c |q_c scale_c|, the mean error
    for (int c = 0; c < hd; ++c) top = std::max(top, std::fabs(double(q[size_t(i * hd + c)]) * 0.25 * (1 + c % 4)));
    for (int t = 0; t < bs; ++t) mean += (double(s1[size_t(i * bs + t)]) - s2[size_t(i * bs + t)]) / bs;
    const double step = top / 127;
    EXPECT_LT(std::fabs(mean), 0.5 * step + 1e-5) << "query " << i << ": mean error " << mean / step << " steps";
  }
}

// The same for token-grouped keys scored as integers (token_query_steps):
// the query's rounding residual meets codes centred on each group's
// midpoint, so over tokens whose codes cover every level of each channel
// equally the mean error vanishes; uncentred it would be the midpoint
// times the residuals' sum, steps large. Codes (t + c) mod 2^B, scale 1 and
// min 0 in every group (each token's group holds every level).
TEST(KvCodec, IntegerKeyQueryResidualAveragesOut) {
  const KvBlockShape shape{32, 1, 64};
  int ran = 0;
  for (KvDType type : {KvDType::INT4, KvDType::INT2})
    for (int group : {64, 16}) {
      const KvCodecConfig config{type, KvGrouping::Token, group, {}, {}};
      const int steps = token_query_steps(config, shape);
      if (steps == 0) continue;
      auto codec = make_kv_codec(config, shape);
      const int hd = shape.head_dim, bs = shape.block_size, levels = type == KvDType::INT4 ? 16 : 4;
      std::vector<float> x(size_t(bs) * hd);
      for (int t = 0; t < bs; ++t)
        for (int c = 0; c < hd; ++c) x[size_t(t) * hd + c] = float((t + c) % levels);
      const std::vector<uint8_t> block = encode_exactly(*codec, x);
      ASSERT_FALSE(block.empty());
      const int n_q = 3;
      const std::vector<float> q = sample_rows(n_q, hd, 9);
      std::vector<float> s1(size_t(n_q) * bs), s2(s1.size());
      codec->score(q.data(), n_q, block.data(), bs, 0, 1.0f, s1.data(), bs);
      score_reference(*codec, q.data(), n_q, block.data(), bs, 0, 1.0f, s2.data(), bs);
      for (int i = 0; i < n_q; ++i) {
        const double step = max_abs(q.data() + size_t(i) * hd, hd) / steps;
        double mean = 0;
        for (int t = 0; t < bs; ++t) mean += (double(s1[size_t(i * bs + t)]) - s2[size_t(i * bs + t)]) / bs;
        EXPECT_LT(std::fabs(mean), 0.05 * step) << config.describe() << " query " << i << ": mean error " << mean / step
                                                << " steps";
      }
      ++ran;
    }
  if (ran == 0) GTEST_SKIP() << "no integer key kernel in this build";
  EXPECT_EQ(ran, 4);
}

// The same for 8-bit value weights, 4- and 2-bit codes: the residual's
// midpoint part joins the bias, so where each token's codes cover 0..2^B - 1
// evenly across the channels the channels' mean error is that of float
// arithmetic alone; without the correction it is (2^B - 1) / 2 steps times
// the sum of the residuals.
TEST(KvCodec, EightBitWeightResidualAveragesOut) {
  const KvBlockShape shape{32, 1, 64};
  int checked = 0;  // builds without the 8-bit kernels skip
  for (const auto& [type, levels] : {std::pair{KvDType::INT4, 16}, std::pair{KvDType::INT2, 4}}) {
    const KvCodecConfig config{type, KvGrouping::Token, 64, {}, {}};
    if (token_weight_steps(config, shape) != 127) continue;
    ++checked;
    auto codec = make_kv_codec(config, shape);
    const int hd = shape.head_dim, bs = shape.block_size;
    std::vector<float> x(size_t(bs) * hd);
    for (int t = 0; t < bs; ++t)
      for (int d = 0; d < hd; ++d)
        x[size_t(t) * hd + d] = 0.25f * float(1 + t % 4) * float((t + 5 * d) % levels - levels / 2);
    const std::vector<uint8_t> block = encode_exactly(*codec, x);  // each code 64 / levels times per token
    ASSERT_FALSE(block.empty());
    const int n_q = 3;
    std::vector<float> w(size_t(n_q) * bs);
    for (size_t i = 0; i < w.size(); ++i) w[i] = std::fabs(std::sin(float(3 * i + 1)));
    std::vector<float> o1(size_t(n_q) * hd, 0.0f), o2(o1);
    codec->accumulate(w.data(), n_q, bs, block.data(), bs, 0, o1.data());
    accumulate_reference(*codec, w.data(), n_q, bs, block.data(), bs, 0, o2.data());
    for (int i = 0; i < n_q; ++i) {
      double top = 0, mean = 0;  // max_t w_t scale_t, the channels' mean error
      for (int t = 0; t < bs; ++t) top = std::max(top, double(w[size_t(i * bs + t)]) * 0.25 * (1 + t % 4));
      for (int d = 0; d < hd; ++d) mean += (double(o1[size_t(i * hd + d)]) - o2[size_t(i * hd + d)]) / hd;
      const double step = top / 127;
      EXPECT_LT(std::fabs(mean), 0.05 * step) << config.describe() << " query " << i << ": mean error "
                                              << mean / step << " steps";
    }
  }
  if (checked == 0) GTEST_SKIP() << "no 8-bit weight kernel in this build";
}

// 2-bit heads that are not whole bytes (6, 10, 14 channels: rows stored
// token by token, not head by head) in blocks the 8-bit weight kernels
// would take: they must not read these blocks as per-head runs (they did,
// giving errors of hundreds of times the weights' sum, or inf).
TEST(KvCodec, ValuesOfPartByteHeadsMatchReference) {
  for (int hd : {6, 10, 14})
    for (KvDType t : {KvDType::INT2, KvDType::INT4}) {  // (8-bit scales refuse these layouts)
      const KvCodecConfig c{t, KvGrouping::Token, 0, {}, {}};
      const KvBlockShape shape{32, 2, hd};
      auto codec = make_kv_codec(c, shape);
      const int bs = shape.block_size, n_q = 3;
      const std::vector<float> x = sample_rows(bs, shape.kv_dim(), 13);
      std::vector<uint8_t> block(codec->block_bytes());
      codec->encode_block(block.data(), x.data(), bs);
      std::vector<float> w(size_t(n_q) * bs);
      for (size_t i = 0; i < w.size(); ++i) w[i] = std::fabs(std::sin(float(i) * 0.9f));
      for (int h = 0; h < shape.n_kv_heads; ++h) {
        std::vector<float> o1(size_t(n_q) * hd, 0.0f), o2(o1);
        codec->accumulate(w.data(), n_q, bs, block.data(), bs, h, o1.data());
        accumulate_reference(*codec, w.data(), n_q, bs, block.data(), bs, h, o2.data());
        for (int i = 0; i < n_q; ++i) {
          const float* wi = w.data() + size_t(i) * bs;
          const double allowance =
              folded_weight_error(*codec, wi, block.data(), bs, h) + reordering_error(*codec, wi, block.data(), bs, h);
          for (int d = 0; d < hd; ++d) {
            const float ref = o2[size_t(i * hd + d)];
            ASSERT_NEAR(o1[size_t(i * hd + d)], ref, 1e-4 * (1 + std::fabs(ref)) + allowance)
                << c.describe() << " head dim " << hd << " head " << h << " query " << i;
          }
        }
      }
    }
}

// The 8-bit kernels keep partial sums in 16 bits for a few octets or token
// pairs before widening them. Every code at its largest against every query
// or weight byte at 127 is the most those sums can hold: keys with all codes
// 15 against a query whose folded bytes are all 127, and 4- and 2-bit values
// with all codes 15 (3) against weights that all fold to 127, over 64 and 128
// tokens. Everything here is exact, so any wrapped sum shows.
TEST(KvCodec, EightBitKernelsHoldTheirSumsAtFullScale) {
  int ran = 0;
  for (int bits : {16, 8}) {
    // Keys: each channel spans 0..15 over the block (scale 1, min 0), then
    // every code is set to 15; q_c = 1 folds to 127 in every channel.
    KvCodecConfig kc{KvDType::INT4, KvGrouping::Channel, 0, {}, {}};
    kc.scale_bits = bits;
    const KvBlockShape ks{64, 1, 64};
    if (channel_query_steps(kc, ks) == 127) {
      auto codec = make_kv_codec(kc, ks);
      std::vector<float> x(size_t(ks.block_size) * ks.head_dim);
      for (int t = 0; t < ks.block_size; ++t)
        for (int c = 0; c < ks.head_dim; ++c) x[size_t(t) * ks.head_dim + c] = float(t % 16);
      std::vector<uint8_t> block(codec->block_bytes());
      codec->encode_block(block.data(), x.data(), ks.block_size);
      std::fill(block.begin(), block.begin() + ks.block_size * ks.head_dim / 2, uint8_t(0xFF));  // codes first
      const std::vector<float> q(size_t(ks.head_dim), 1.0f);
      std::vector<float> got(size_t(ks.block_size)), ref(got.size());
      codec->score(q.data(), 1, block.data(), ks.block_size, 0, 1.0f, got.data(), ks.block_size);
      score_reference(*codec, q.data(), 1, block.data(), ks.block_size, 0, 1.0f, ref.data(), ks.block_size);
      for (int t = 0; t < ks.block_size; ++t) ASSERT_NEAR(got[size_t(t)], ref[size_t(t)], 1e-3) << kc.describe() << " token " << t;
      ++ran;
    }
    // Values: each token spans 0..15 (or 0..3) over its channels, then
    // every code is set to the largest; weights of 1 fold to 127.
    for (const auto& [type, levels, bs] : {std::tuple{KvDType::INT4, 16, 64}, std::tuple{KvDType::INT2, 4, 128}}) {
      KvCodecConfig vc{type, KvGrouping::Token, 64, {}, {}};
      vc.scale_bits = bits;
      const KvBlockShape vs{bs, 1, 64};
      if (token_weight_steps(vc, vs) != 127) continue;
      auto codec = make_kv_codec(vc, vs);
      std::vector<float> x(size_t(bs) * vs.head_dim);
      for (int t = 0; t < bs; ++t)
        for (int d = 0; d < vs.head_dim; ++d) x[size_t(t) * vs.head_dim + d] = float(d % levels);
      std::vector<uint8_t> block(codec->block_bytes());
      codec->encode_block(block.data(), x.data(), bs);
      const int code_bytes = bs * vs.head_dim * (type == KvDType::INT4 ? 4 : 2) / 8;
      std::fill(block.begin(), block.begin() + code_bytes, uint8_t(0xFF));
      const std::vector<float> w(size_t(bs), 1.0f);
      std::vector<float> got(size_t(vs.head_dim), 0.0f), ref(got);
      codec->accumulate(w.data(), 1, bs, block.data(), bs, 0, got.data());
      accumulate_reference(*codec, w.data(), 1, bs, block.data(), bs, 0, ref.data());
      for (int d = 0; d < vs.head_dim; ++d)
        ASSERT_NEAR(got[size_t(d)], ref[size_t(d)], 1e-3 * std::fabs(ref[size_t(d)])) << vc.describe() << " channel " << d;
      ++ran;
    }
  }
  if (ran == 0) GTEST_SKIP() << "no 8-bit kernels in this build";
}

// Token-grouped keys scored as integers (token_query_steps > 0) against a
// query the rounding leaves exact: every element a whole number of steps
// (j 2^-6, |j| <= L, one of them L). What remains is float rounding of the
// sums, so a code, lane, group or scale read in the wrong place shows at
// full size instead of hiding in the rounding allowance. 8-bit codes meet
// 16-bit queries here, 4- and 2-bit ones 8-bit queries; groups of a whole
// head, finer groups (the lanes scaled per group), 8-bit scales and groups
// spanning two heads (token-major rows).
TEST(KvCodec, IntegerKeyScoresAreExactForRepresentableQueries) {
  int ran = 0;
  std::set<std::string> covered;  // dtype and how its groups sit in a 64-wide head
  std::vector<Case> cases = model_cases();
  // Groups of 8: whole lanes of 4- and 8-bit codes; a 2-bit lane spans two
  // such groups, so int2 must take the float kernel here.
  for (KvDType t : {KvDType::INT8, KvDType::INT4, KvDType::INT2})
    cases.push_back({{t, KvGrouping::Token, 8, {}, {}}, KvBlockShape{16, 2, 64}});
  // Heads of 192 channels: unit counts the kernels only know at run time.
  for (KvDType t : {KvDType::INT8, KvDType::INT4, KvDType::INT2})
    for (int g : {0, 64}) cases.push_back({{t, KvGrouping::Token, g, {}, {}}, KvBlockShape{16, 1, 192}});
  cases.push_back({{KvDType::Q4_0}, KvBlockShape{16, 1, 192}});
  for (const Case& c : cases) {
    const int steps = token_query_steps(c.config, c.shape);
    if (c.config.dtype == KvDType::INT2 && c.config.group_size == 8) {
      EXPECT_EQ(steps, 0) << name(c);
    }
    if (steps == 0) continue;
    if (c.shape.head_dim == 64 && c.config.scale_bits == 16) {
      const int g = c.config.group_size > 0 ? c.config.group_size : 64;
      covered.insert(c.config.dtype == KvDType::Q4_0
                         ? std::string("q4_0")
                         : std::string(kv_dtype_name(c.config.dtype)) + (g < 64 ? "/sub" : g > 64 ? "/span" : "/head"));
    }
    auto codec = make_kv_codec(c.config, c.shape);
    const int kv_dim = c.shape.kv_dim(), hd = c.shape.head_dim, bs = c.shape.block_size;
    const std::vector<float> x = sample_rows(bs, kv_dim, 41);
    std::vector<uint8_t> block(codec->block_bytes());
    std::mt19937 rng(43);
    std::uniform_int_distribution<int> step_count(-steps, steps);
    for (int n : {bs, bs - 3, 1}) {
      codec->encode_block(block.data(), x.data(), n);
      for (int n_q : {1, 3, 5}) {
        std::vector<float> q(size_t(n_q) * hd);
        for (size_t e = 0; e < q.size(); ++e) q[e] = std::ldexp(float(e % size_t(hd) == 5 ? steps : step_count(rng)), -6);
        const int stride = bs + 1;
        for (int h = 0; h < c.shape.n_kv_heads; ++h) {
          std::vector<float> got(size_t(n_q) * stride), ref(got.size());
          codec->score(q.data(), n_q, block.data(), n, h, 0.125f, got.data(), stride);
          score_reference(*codec, q.data(), n_q, block.data(), n, h, 0.125f, ref.data(), stride);
          // The same queries at another scale (a thread reuses its last rounding of them): twice the scores.
          std::vector<float> twice(got.size());
          codec->score(q.data(), n_q, block.data(), n, h, 0.25f, twice.data(), stride);
          const double top = max_decoded(*codec, block.data(), n, h);
          for (int i = 0; i < n_q; ++i) {
            for (int t = 0; t < n; ++t)
              ASSERT_FLOAT_EQ(twice[size_t(i * stride + t)], 2 * got[size_t(i * stride + t)]) << name(c) << " token " << t;
            double terms = 0;  // the size of what the sums add: float rounding is relative to it
            for (int d = 0; d < hd; ++d) terms += std::fabs(double(q[size_t(i) * hd + d])) * top;
            for (int t = 0; t < n; ++t) {
              const float r = ref[size_t(i * stride + t)];
              ASSERT_NEAR(got[size_t(i * stride + t)], r, 1e-5 * (1 + std::fabs(r)) + 2e-6 * 0.125 * terms)
                  << name(c) << " n " << n << " n_q " << n_q << " head " << h << " query " << i << " token " << t;
            }
          }
        }
      }
    }
    ++ran;
  }
  if (ran == 0) GTEST_SKIP() << "no integer key kernel in this build";
  // Every width with groups of a head, finer ones and ones spanning two
  // heads; and q4_0 (its blocks the groups).
  EXPECT_EQ(covered.size(), 10u);
}

TEST(KvCodec, VectorKernelsMatchReferenceAtModelShapes) {
  for (const Case& c : model_cases()) {
    auto codec = make_kv_codec(c.config, c.shape);
    const int kv_dim = c.shape.kv_dim(), hd = c.shape.head_dim, bs = c.shape.block_size;
    std::vector<float> x = sample_rows(bs, kv_dim, 5);
    std::vector<uint8_t> block(codec->block_bytes());
    for (int n : {bs, bs - 1, 5, 1, bs * 13 / 16, bs * 5 / 8 + 1}) {
      codec->encode_block(block.data(), x.data(), n);
      for (int n_q : {1, 2, 3, 4, 5, 8}) {
        const int stride = bs + 3;
        std::vector<float> q = sample_rows(n * n_q, hd, 6);  // (n, n_q, hd): per-token queries
        for (int h = 0; h < c.shape.n_kv_heads; h += std::max(1, c.shape.n_kv_heads - 1)) {
          std::vector<float> s1(size_t(n_q) * stride), s2(s1.size());
          codec->score(q.data(), n_q, block.data(), n, h, 0.125f, s1.data(), stride);
          score_reference(*codec, q.data(), n_q, block.data(), n, h, 0.125f, s2.data(), stride);
          for (int i = 0; i < n_q; ++i) {
            const double allowance = folded_query_error(*codec, q.data() + size_t(i) * hd, block.data(), n, h, 0.125f);
            for (int t = 0; t < n; ++t) {
              const float ref = s2[size_t(i * stride + t)];
              ASSERT_NEAR(s1[size_t(i * stride + t)], ref, 1e-4 * (1 + std::fabs(ref)) + allowance)
                  << name(c) << " n " << n << " n_q " << n_q << " head " << h << " query " << i << " token " << t;
            }
          }
          // score_tokens: token t against its own query set, reference one token at a time.
          codec->score_tokens(q.data(), n_q, block.data(), n, h, 0.125f, s1.data(), stride);
          for (int t = 0; t < n; ++t) {
            score_reference(*codec, q.data() + size_t(t) * n_q * hd, n_q, block.data(), t + 1, h, 0.125f, s2.data(), stride);
            for (int i = 0; i < n_q; ++i) {
              const float ref = s2[size_t(i * stride + t)];
              ASSERT_NEAR(s1[size_t(i * stride + t)], ref, 1e-4 * (1 + std::fabs(ref)))
                  << name(c) << " score_tokens n " << n << " n_q " << n_q << " head " << h << " token " << t;
            }
          }
          std::vector<float> w(s1.size());
          for (size_t i = 0; i < w.size(); ++i) w[i] = std::fabs(std::sin(float(i) * 0.7f));
          std::vector<float> o1(size_t(n_q) * hd), o2(o1.size());
          for (size_t i = 0; i < o1.size(); ++i) o1[i] = o2[i] = 0.1f * float(i % 7);
          codec->accumulate(w.data(), n_q, stride, block.data(), n, h, o1.data());
          accumulate_reference(*codec, w.data(), n_q, stride, block.data(), n, h, o2.data());
          double allowance = 0;  // of the query of element i
          for (size_t i = 0; i < o1.size(); ++i) {
            if (i % size_t(hd) == 0) {
              const float* wi = w.data() + i / size_t(hd) * stride;
              allowance = folded_weight_error(*codec, wi, block.data(), n, h) + reordering_error(*codec, wi, block.data(), n, h);
            }
            ASSERT_NEAR(o1[i], o2[i], 1e-4 * (1 + std::fabs(o2[i])) + allowance)
                << name(c) << " accumulate n " << n << " n_q " << n_q << " head " << h << " at " << i;
          }
        }
      }
    }
  }
}

// Pre-RoPE keys scored with each key rotated by its offset in the block
// (score_offsets) equal the reference: decode, rope(key, t), dot. Channel
// codecs with token rows have the kernel (AVX-512, AVX2); 8-, 4- and 2-bit codes
// keep a pair's partner in a neighbouring lane or vector, each checked.
TEST(KvCodec, PreRopeOffsetScoresMatchRotatedReference) {
  int ran = 0;
  for (const KvBlockShape& s : {KvBlockShape{16, 4, 64}, KvBlockShape{32, 2, 128}, KvBlockShape{16, 2, 32}}) {
    const RopeTable table(64, s.head_dim, 10000.0f);
    for (KvDType t : {KvDType::INT8, KvDType::INT4, KvDType::INT2}) {
      KvCodecConfig c{t, KvGrouping::Channel, 0, {}, {}};
      c.pre_rope = true;
      for (int bits : {16, 8}) {
        c.scale_bits = bits;
        auto codec = make_kv_codec(c, s);
        const int kv_dim = s.kv_dim(), hd = s.head_dim, bs = s.block_size;
        const std::vector<float> x = sample_rows(bs, kv_dim, 12);
        std::vector<uint8_t> block(codec->block_bytes());
        // One pass of query rows, and more (the AVX2 kernels then decode the block once).
        for (auto [n, n_q] : {std::pair{bs, 3}, {bs, 5}, {bs - 3, 3}, {bs - 3, 5}, {1, 3}, {1, 5}}) {
          codec->encode_block(block.data(), x.data(), n);
          const int stride = bs + 1;
          const std::vector<float> q = sample_rows(n_q, hd, 13);
          std::vector<float> got(size_t(n_q) * stride), key(static_cast<size_t>(kv_dim));
          for (int h = 0; h < s.n_kv_heads; ++h) {
            const bool has_kernel =
                codec->score_offsets(q.data(), n_q, block.data(), n, h, 0.125f, table, got.data(), stride);
#if defined(__AVX512F__)
            // Every width and scale format has the kernel where a head is whole
            // chunks of 16 * 8 / bits codes (AVX2: 8 * 8 / bits).
            EXPECT_EQ(has_kernel, hd % (16 * 8 / kv_dtype_bits(t)) == 0) << c.describe() << " hd " << hd;
#elif defined(__AVX2__) && defined(__FMA__)
            EXPECT_EQ(has_kernel, hd % (8 * 8 / kv_dtype_bits(t)) == 0) << c.describe() << " hd " << hd;
#endif
            if (!has_kernel) continue;
            ++ran;
            for (int tok = 0; tok < n; ++tok) {
              codec->decode_token(block.data(), tok, key.data());
              rope(key.data() + size_t(h) * hd, 1, hd, tok, 10000.0f);
              for (int i = 0; i < n_q; ++i) {
                double ref = 0;
                for (int d = 0; d < hd; ++d) ref += double(q[size_t(i * hd + d)]) * key[size_t(h * hd + d)];
                ref *= 0.125;
                ASSERT_NEAR(got[size_t(i * stride + tok)], ref, 2e-4 * (1 + std::fabs(ref)))
                    << c.describe() << " hd " << hd << " n " << n << " head " << h << " token " << tok;
              }
            }
          }
        }
      }
    }
  }
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  EXPECT_GT(ran, 0);  // the kernel exists on this build
#endif
  // Codecs without the kernel say so and write nothing.
  auto f16 = make_kv_codec({KvDType::F16}, KvBlockShape{16, 1, 64});
  std::vector<uint8_t> block(f16->block_bytes());
  std::vector<float> q(64, 1.0f), scores(16, -7.0f);
  EXPECT_FALSE(f16->score_offsets(q.data(), 1, block.data(), 16, 0, 1.0f, RopeTable(64, 64, 10000.0f), scores.data(), 16));
  EXPECT_EQ(scores[0], -7.0f);
}

// Keys in RoPE spans are scored one span at a time, each with its own query
// set (score_span): the span's scores equal score_reference's and the rest
// of each row is left alone. Channel codecs run their channel-major kernels
// from the span's first token (mid-tile, mid-group); the others take
// KvCodec's default.
TEST(KvCodec, SpanScoresMatchReferenceAndLeaveTheRestAlone) {
  std::vector<Case> cases;
  for (const KvBlockShape& s : {KvBlockShape{64, 2, 64}, KvBlockShape{32, 4, 8}, KvBlockShape{16, 2, 12}})
    for (KvDType t : {KvDType::INT8, KvDType::INT4, KvDType::INT2})
      for (int bits : {16, 8})
        for (int span : {4, 16}) {
          // Spans within a channel group, and spans over several (16-token blocks, 4-token groups).
          KvCodecConfig c{t, KvGrouping::Channel, s.block_size == 64 ? 32 : s.block_size == 16 ? 4 : 0, {}, {}};
          c.pre_rope = true;
          c.rope_span = span;
          c.scale_bits = bits;
          cases.push_back({c, s});
        }
  for (int bits : {16, 8}) {  // spans of 32 tokens: the 8-bit query kernel, folded once per span
    KvCodecConfig c{KvDType::INT4, KvGrouping::Channel, 0, {}, {}};
    c.pre_rope = true;
    c.rope_span = 32;
    c.scale_bits = bits;
    cases.push_back({c, KvBlockShape{64, 2, 64}});
  }
  KvCodecConfig f16{KvDType::F16}, tokens{KvDType::INT4, KvGrouping::Token, 0, {}, {}};
  f16.pre_rope = tokens.pre_rope = true;
  f16.rope_span = 16;
  tokens.rope_span = 8;
  cases.push_back({f16, KvBlockShape{32, 2, 64}});
  cases.push_back({tokens, KvBlockShape{32, 2, 64}});
  KvCodecConfig outliers{KvDType::INT2, KvGrouping::Channel, 0, {}, {}};  // int2-small with a key outlier
  outliers.pre_rope = true;
  outliers.rope_span = 16;
  outliers.scale_bits = 8;
  outliers.outliers = 1;
  cases.push_back({outliers, KvBlockShape{64, 2, 64}});
  for (const Case& c : cases) {
    auto codec = make_kv_codec(c.config, c.shape);
    const int kv_dim = c.shape.kv_dim(), hd = c.shape.head_dim, bs = c.shape.block_size, span = c.config.rope_span;
    const std::vector<float> x = sample_rows(bs, kv_dim, 21);
    std::vector<uint8_t> block(codec->block_bytes());
    for (int n : {bs, bs - 3}) {
      codec->encode_block(block.data(), x.data(), n);
      const int n_q = 3, stride = bs + 2;
      for (int h = 0; h < c.shape.n_kv_heads; ++h)
        for (int begin = 0; begin < n; begin += span) {
          const int end = std::min(n, begin + span);
          const std::vector<float> q = sample_rows(n_q, hd, uint32_t(30 + begin));
          std::vector<float> got(size_t(n_q) * stride, -7.0f), ref(got.size());
          codec->score_span(q.data(), n_q, block.data(), begin, end, h, 0.3f, got.data(), stride);
          score_reference(*codec, q.data(), n_q, block.data(), end, h, 0.3f, ref.data(), stride);
          for (int i = 0; i < n_q; ++i)
            for (int t = 0; t < stride; ++t) {
              const float g = got[size_t(i * stride + t)], r = ref[size_t(i * stride + t)];
              if (t < begin || t >= end) {
                ASSERT_EQ(g, -7.0f) << name(c) << " wrote token " << t << " outside [" << begin << ", " << end << ")";
                continue;
              }
              ASSERT_NEAR(g, r, 1e-4 * (1 + std::fabs(r)) + folded_query_error(*codec, q.data() + size_t(i) * hd,
                                                                              block.data(), end, h, 0.3f))
                  << name(c) << " n " << n << " head " << h << " token " << t;
            }
        }
      // score_spans: every span at once, each against its own query set,
      // exactly as span by span.
      for (int h = 0; h < c.shape.n_kv_heads; ++h) {
        const int n_q = 3, stride = bs;
        std::vector<float> q_spans, all(size_t(n_q) * stride), one(all.size());
        for (int begin = 0; begin < n; begin += span) {
          const std::vector<float> q = sample_rows(n_q, hd, uint32_t(30 + begin));
          q_spans.insert(q_spans.end(), q.begin(), q.end());
          codec->score_span(q.data(), n_q, block.data(), begin, std::min(n, begin + span), h, 0.3f, one.data(), stride);
        }
        codec->score_spans(q_spans.data(), n_q, block.data(), n, span, h, 0.3f, all.data(), stride);
        for (int i = 0; i < n_q; ++i)
          for (int t = 0; t < n; ++t)
            ASSERT_EQ(all[size_t(i * stride + t)], one[size_t(i * stride + t)]) << name(c) << " n " << n << " token " << t;
      }
    }
  }
}

// Head-major layouts: everything stored for KV head h (codes and metadata, all
// tokens) lies in the h-th of n_kv_heads equal slices of the block, so changing
// only head h's values changes only bytes there. Token groups spanning heads
// stay token-major and are skipped.
TEST(KvCodec, HeadMajorBlocksKeepEachHeadInItsSlice) {
  for (const Case& c : model_cases()) {
    if (c.config.grouping == KvGrouping::Token && c.config.group_size > c.shape.head_dim && !c.config.is_static())
      continue;
    auto codec = make_kv_codec(c.config, c.shape);
    const int kv_dim = c.shape.kv_dim(), hd = c.shape.head_dim, bs = c.shape.block_size;
    const size_t slice = codec->block_bytes() / size_t(c.shape.n_kv_heads);
    ASSERT_EQ(slice * size_t(c.shape.n_kv_heads), codec->block_bytes()) << name(c);
    const std::vector<float> x = sample_rows(bs, kv_dim, 8);
    std::vector<uint8_t> base(codec->block_bytes()), changed(base.size());
    codec->encode_block(base.data(), x.data(), bs);
    for (int h = 0; h < c.shape.n_kv_heads; ++h) {
      std::vector<float> y = x;
      for (int t = 0; t < bs; ++t)
        for (int d = 0; d < hd; ++d) y[size_t(t) * kv_dim + h * hd + d] = -0.7f * y[size_t(t) * kv_dim + h * hd + d] + 0.3f;
      codec->encode_block(changed.data(), y.data(), bs);
      bool any = false;
      for (size_t i = 0; i < base.size(); ++i) {
        if (base[i] == changed[i]) continue;
        any = true;
        ASSERT_EQ(i / slice, size_t(h)) << name(c) << " head " << h << " byte " << i;
      }
      EXPECT_TRUE(any) << name(c) << " head " << h;
    }
  }
}

// decode_head (prefill tiles' float path) gives a head's slice of
// decode_token for the first n tokens, for every codec; the float types say
// they store floats, the others do not.
TEST(KvCodec, DecodeHeadIsTheHeadsSliceOfEachToken) {
  for (const Case& c : all_cases()) {
    auto codec = make_kv_codec(c.config, c.shape);
    const int kv_dim = c.shape.kv_dim(), hd = c.shape.head_dim, bs = c.shape.block_size;
    const std::vector<float> x = sample_rows(bs, kv_dim, 3);
    std::vector<uint8_t> block(codec->block_bytes());
    codec->encode_block(block.data(), x.data(), bs);
    EXPECT_EQ(codec->stores_floats(), !kv_dtype_is_quantized(c.config.dtype)) << name(c);
    std::vector<float> row(static_cast<size_t>(kv_dim)), head(static_cast<size_t>(bs * hd));
    const int n = std::max(1, bs - 1);
    for (int h = 0; h < c.shape.n_kv_heads; ++h) {
      codec->decode_head(block.data(), n, h, head.data());
      for (int t = 0; t < n; ++t) {
        codec->decode_token(block.data(), t, row.data());
        for (int d = 0; d < hd; ++d)
          ASSERT_EQ(head[size_t(t) * hd + d], row[size_t(h * hd + d)]) << name(c) << " head " << h << " token " << t;
      }
    }
  }
}

// FP8's vector loads move each code's bits into an FP16 (util/half.h): every
// finite code must read as its value in every kernel, and a head's slice
// that holds a NaN code must give NaN where that token counts, not the
// finite value its bits shift to (E4M3; E5M2's NaNs are FP16's).
class Fp8Kernels : public ::testing::TestWithParam<KvDType> {};

TEST_P(Fp8Kernels, ReadEveryCodeAndKeepNaN) {
  const KvDType type = GetParam();
  const KvBlockShape shape{16, 2, 64};
  auto codec = make_kv_codec({type}, shape);
  const int hd = shape.head_dim, bs = shape.block_size, kv_dim = shape.kv_dim();
  auto code_value = [type](int c) { return type == KvDType::FP8 ? fp8_to_fp32(fp8_t(c)) : fp8_e5m2_to_fp32(fp8_e5m2_t(c)); };
  std::vector<float> x(size_t(bs) * size_t(kv_dim));
  int code = 0;
  for (int t = 0; t < bs; ++t)
    for (int d = 0; d < kv_dim; ++d, code = (code + 1) % 256) {
      while (!std::isfinite(code_value(code))) code = (code + 1) % 256;
      x[size_t(t) * kv_dim + d] = code_value(code);  // every finite code, both heads
    }
  const int nan_token = 5;
  const int nan_channel = 17;
  x[size_t(nan_token) * kv_dim + hd + nan_channel] = std::nanf("");  // head 1 only
  std::vector<uint8_t> block(codec->block_bytes());
  codec->encode_block(block.data(), x.data(), bs);

  const int n_q = 3, stride = bs;
  const std::vector<float> q = sample_rows(n_q, hd, 11);
  std::vector<float> w(size_t(n_q) * stride);
  for (size_t i = 0; i < w.size(); ++i) w[i] = 0.5f + std::fabs(std::sin(float(i)));
  for (int h = 0; h < 2; ++h) {
    // Token t's channel d of this head, and the sum of term(k) for k < count
    // with the sum of their magnitudes (the rounding allowance's scale).
    auto value = [&](int t, int d) { return double(x[size_t(t) * kv_dim + size_t(h) * hd + d]); };
    auto sums = [](int count, auto term) {
      double sum = 0, size = 0;
      for (int k = 0; k < count; ++k) {
        const double p = term(k);
        sum += p;
        size += std::fabs(p);
      }
      return std::pair{sum, size};
    };
    std::vector<float> head(size_t(bs) * hd), scores(size_t(n_q) * stride), out(size_t(n_q) * hd, 0.0f);
    codec->decode_head(block.data(), bs, h, head.data());
    codec->score(q.data(), n_q, block.data(), bs, h, 0.125f, scores.data(), stride);
    codec->accumulate(w.data(), n_q, stride, block.data(), bs, h, out.data());
    for (int t = 0; t < bs; ++t)
      for (int d = 0; d < hd; ++d) {
        const float want = float(value(t, d));
        if (std::isnan(want))
          EXPECT_TRUE(std::isnan(head[size_t(t) * hd + d])) << "token " << t;
        else
          ASSERT_EQ(head[size_t(t) * hd + d], want) << "head " << h << " token " << t << " channel " << d;
      }
    for (int i = 0; i < n_q; ++i) {
      for (int t = 0; t < bs; ++t) {
        const auto [want, size] = sums(hd, [&](int d) { return q[size_t(i) * hd + d] * value(t, d); });
        const float got = scores[size_t(i) * stride + t];
        if (h == 1 && t == nan_token)
          EXPECT_TRUE(std::isnan(got)) << "query " << i;
        else
          ASSERT_NEAR(got, 0.125 * want, 1e-6 * 0.125 * size) << "head " << h << " query " << i << " token " << t;
      }
      for (int d = 0; d < hd; ++d) {
        const auto [want, size] = sums(bs, [&](int t) { return w[size_t(i) * stride + t] * value(t, d); });
        const float got = out[size_t(i) * hd + d];
        if (h == 1 && d == nan_channel)
          EXPECT_TRUE(std::isnan(got)) << "query " << i;
        else
          ASSERT_NEAR(got, want, 1e-6 * size) << "query " << i << " channel " << d;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(KvCodec, Fp8Kernels, ::testing::Values(KvDType::FP8, KvDType::FP8_E5M2),
                         [](const auto& info) { return std::string(kv_dtype_name(info.param)); });

TEST(KvCodec, BlockBytesAreExact) {
  const KvBlockShape s{16, 8, 64};  // the 400M model: kv_dim 512
  auto bytes = [&](KvCodecConfig c) { return make_kv_codec(c, s)->block_bytes(); };
  EXPECT_EQ(bytes({KvDType::F16}), 16u * 512 * 2);
  EXPECT_EQ(bytes({KvDType::INT8, KvGrouping::Token, 64, {}, {}}), 16u * (512 + 8 * 4));
  EXPECT_EQ(bytes({KvDType::INT4, KvGrouping::Token, 64, {}, {}}), 16u * (256 + 8 * 4));
  EXPECT_EQ(bytes({KvDType::INT2, KvGrouping::Channel, 16, {}, {}}), 16u * 128 + 512 * 4);
  EXPECT_EQ(bytes({KvDType::Q4_0}), 16u * 16 * 18);
  // 8-bit scales, 32-token blocks (the small presets' layout): per head the
  // codes, a 4-byte header, and a byte of scale and of min per group.
  const KvBlockShape s32{32, 8, 64};
  KvCodecConfig k8{KvDType::INT4, KvGrouping::Channel, 0, {}, {}}, v8{KvDType::INT4, KvGrouping::Token, 0, {}, {}};
  k8.scale_bits = v8.scale_bits = 8;
  EXPECT_EQ(make_kv_codec(k8, s32)->block_bytes(), 8u * (32 * 32 + 4 + 2 * 64));
  EXPECT_EQ(make_kv_codec(v8, s32)->block_bytes(), 8u * (32 * 32 + 4 + 2 * 32));
  k8.dtype = v8.dtype = KvDType::INT2;
  EXPECT_EQ(make_kv_codec(k8, s32)->block_bytes(), 8u * (32 * 16 + 4 + 2 * 64));
  EXPECT_EQ(make_kv_codec(v8, s32)->block_bytes(), 8u * (32 * 16 + 4 + 2 * 32));
  // 64-token blocks (the small presets since the tenth session): one key
  // group per channel per block, so the key metadata is half per token.
  const KvBlockShape s64{64, 8, 64};
  k8.dtype = v8.dtype = KvDType::INT4;
  EXPECT_EQ(make_kv_codec(k8, s64)->block_bytes(), 8u * (64 * 32 + 4 + 2 * 64));
  EXPECT_EQ(make_kv_codec(v8, s64)->block_bytes(), 8u * (64 * 32 + 4 + 2 * 64));
}

// scale8 (8-bit scale and min per group, an fp16 header per run): the stored
// pairs cover every group without clipping and are at most one log step
// (2^(1/16)) coarser than needed plus the min's rounding; every decoder
// (vector, pairs, single group) returns exactly what the encoder quantized with.
TEST(KvCodec, EightBitScalesCoverEachGroupAndDecodeExactly) {
  std::mt19937 rng(9);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int count : {1, 8, 16, 37, 64}) {
    for (int levels : {3, 15, 255}) {
      const size_t n = static_cast<size_t>(count);
      std::vector<float> lo(n), hi(n);
      for (int g = 0; g < count; ++g) {
        const float center = g % 5 == 1 ? 20.0f * normal(rng) : normal(rng);  // a few offset groups
        const float width = g % 7 == 3 ? 0.0f : std::fabs(normal(rng)) * (g % 3 == 0 ? 8.0f : 1.0f);
        lo[size_t(g)] = center - width;
        hi[size_t(g)] = center + width;
      }
      std::vector<uint8_t> run(scale8::run_bytes(count));
      std::vector<float> sc(n), mn(n), sc2(n), mn2(n);
      scale8::encode_run(lo.data(), hi.data(), count, levels, run.data(), sc.data(), mn.data());
      scale8::decode_run(run.data(), count, sc2.data(), mn2.data());
      std::vector<fp16_t> pairs(2 * n);
      scale8::decode_run_pairs(run.data(), count, pairs.data());
      double lo_max = 0, need_max = 0;
      for (int g = 0; g < count; ++g) lo_max = std::max(lo_max, std::fabs(double(lo[size_t(g)])));
      for (int g = 0; g < count; ++g) need_max = std::max(need_max, (hi[size_t(g)] - lo[size_t(g)] + lo_max / 127 * 1.002 + lo_max / 1024) / levels);
      for (int g = 0; g < count; ++g) {
        const size_t i = size_t(g);
        ASSERT_EQ(sc[i], sc2[i]) << count << " " << g;
        ASSERT_EQ(mn[i], mn2[i]) << count << " " << g;
        ASSERT_EQ(sc[i], fp16_to_fp32(pairs[2 * i])) << count << " " << g;
        ASSERT_EQ(mn[i], fp16_to_fp32(pairs[2 * i + 1])) << count << " " << g;
        float s1, m1;
        scale8::decode_one(run.data(), count, g, &s1, &m1);
        ASSERT_EQ(s1, sc[i]);
        ASSERT_EQ(m1, mn[i]);
        ASSERT_LE(mn[i], lo[i]) << count << " " << g;
        // One step of the min grid, and the fp16 rounding of the min (which may
        // push it one step further down).
        ASSERT_LE(lo[i] - mn[i], lo_max / 127 * 1.002 + lo_max / 1024 + 1e-7) << count << " " << g;
        ASSERT_GE(double(mn[i]) + double(levels) * sc[i], hi[i]) << count << " " << g;
        const double need = (double(hi[i]) - mn[i]) / levels;
        ASSERT_LE(sc[i], std::max(need * 1.046, need_max * std::ldexp(1.0, -15)) + 1e-7) << count << " " << g;
      }
    }
  }
}

TEST(KvCodec, ParsesNamesAndRejectsBadCombinations) {
  EXPECT_EQ(parse_kv_dtype("int4"), KvDType::INT4);
  EXPECT_EQ(parse_kv_dtype("q4_0"), KvDType::Q4_0);
  EXPECT_EQ(parse_kv_grouping("channel"), KvGrouping::Channel);
  EXPECT_THROW(parse_kv_dtype("int3"), Error);
  EXPECT_THROW(parse_kv_grouping("row"), Error);
  const KvBlockShape s{16, 4, 8};
  EXPECT_THROW(make_kv_codec({KvDType::INT4, KvGrouping::Channel, 32, {}, {}}, s), Error);  // > block
  EXPECT_THROW(make_kv_codec({KvDType::INT4, KvGrouping::Token, 12, {}, {}}, s), Error);
  EXPECT_THROW(make_kv_codec({KvDType::Q4_0}, KvBlockShape{16, 1, 8}), Error);  // kv_dim 8 < 32
  KvCodecConfig st{KvDType::INT4};
  st.static_min.assign(3, 0.0f);
  st.static_max.assign(3, 1.0f);
  EXPECT_THROW(make_kv_codec(st, s), Error);
  KvCodecConfig c8{KvDType::INT4, KvGrouping::Token, 32, {}, {}};  // spans heads: token-major
  c8.scale_bits = 8;
  EXPECT_THROW(make_kv_codec(c8, s), Error);
  c8.group_size = 0;
  c8.scale_bits = 12;
  EXPECT_THROW(make_kv_codec(c8, s), Error);
  c8.scale_bits = 8;
  auto codec = make_kv_codec(c8, s);
  EXPECT_FALSE(codec->encodes_tokens());  // the header spans the block's tokens
  std::vector<uint8_t> block(codec->block_bytes());
  std::vector<float> x(size_t(s.kv_dim()), 1.0f);
  EXPECT_THROW(codec->encode_token(block.data(), 0, x.data()), Error);
  // RoPE spans: for pre-RoPE keys only, at least a token, dividing the block.
  KvCodecConfig spans{KvDType::INT2, KvGrouping::Channel, 0, {}, {}};
  spans.rope_span = 8;
  EXPECT_THROW(make_kv_codec(spans, s), Error);
  spans.pre_rope = true;
  EXPECT_NO_THROW(make_kv_codec(spans, s));
  EXPECT_EQ(spans.describe(), "int2/channel/g0+prerope8");
  spans.rope_span = 3;
  EXPECT_THROW(make_kv_codec(spans, s), Error);
  spans.rope_span = 0;
  EXPECT_THROW(make_kv_codec(spans, s), Error);
}

}  // namespace
}  // namespace kvserve
