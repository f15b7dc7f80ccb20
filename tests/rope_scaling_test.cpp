// RoPE scaling: the frequencies of each scaling against values worked out by
// hand from llama.cpp's formulas, the loader reading what the converters
// write, and the forward pass turning every key and query by the scaled
// angles on every path (keys stored after RoPE, before it, within spans).
#include "model/rope_scaling.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "engine/transformer.h"
#include "kernels/vector_ops.h"
#include "model/model.h"
#include "model/synthetic_model.h"
#include "chunked_logits.h"
#include "test_support.h"

namespace kvserve {
namespace {

using testing_files::expect_error_containing;

std::string temp_path(const std::string& name) { return ::testing::TempDir() + "kvserve_rope_" + name; }

TEST(RopeScaling, UnscaledIsRopesOwnExpression) {
  const std::vector<float> f = rope_frequencies(64, 10000.0f, RopeScaling{}, 512);
  ASSERT_EQ(f.size(), 32u);
  for (int i = 0; i < 32; ++i) EXPECT_EQ(f[size_t(i)], 1.0f / powf(10000.0f, float(2 * i) / 64.0f)) << i;
  // rope() by frequencies and by base turn a head identically, bit for bit.
  std::vector<float> a(128), b;
  std::mt19937 rng(3);
  std::normal_distribution<float> n;
  for (float& x : a) x = n(rng);
  b = a;
  rope(a.data(), 2, 64, 300, f.data());
  rope(b.data(), 2, 64, 300, 10000.0f);
  for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], b[i]) << i;
}

TEST(RopeScaling, LinearAndFactorsDivideEachFrequency) {
  const std::vector<float> base = unscaled_rope_frequencies(16, 10000.0f);
  RopeScaling linear;
  linear.type = RopeScalingType::Linear;
  linear.factor = 4.0f;
  RopeScaling factors;
  factors.freq_factors = {1, 1, 2, 3, 4, 5, 8, 8};
  const std::vector<float> l = rope_frequencies(16, 10000.0f, linear, 512);
  const std::vector<float> ff = rope_frequencies(16, 10000.0f, factors, 512);
  for (size_t i = 0; i < 8; ++i) {
    EXPECT_EQ(l[i], base[i] * 0.25f) << i;
    EXPECT_EQ(ff[i], base[i] / factors.freq_factors[i]) << i;
  }
  EXPECT_EQ(rope_score_scale(linear), 1.0f);
  EXPECT_EQ(rope_score_scale(factors), 1.0f);
}

// head_dim 64, base 10000, original context 4096: the ramp's bounds are the
// pairs turning 32 and 1 times over 4096 positions, 64 ln(4096 / (b 2 pi)) /
// (2 ln 10000): 10.47 -> 10 (floor) and 22.51 -> 23 (ceil).
TEST(RopeScaling, YarnKeepsFastPairsAndInterpolatesSlowOnes) {
  RopeScaling y;
  y.type = RopeScalingType::Yarn;
  y.factor = 4.0f;
  y.original_context = 4096;
  const std::vector<float> base = unscaled_rope_frequencies(64, 10000.0f);
  const std::vector<float> f = rope_frequencies(64, 10000.0f, y, 16384);
  for (int i = 0; i <= 10; ++i) EXPECT_EQ(f[size_t(i)], base[size_t(i)]) << i;
  for (int i = 23; i < 32; ++i) EXPECT_EQ(f[size_t(i)], base[size_t(i)] * 0.25f) << i;
  const float mix = 1.0f - 6.0f / 13.0f;  // pair 16: (16 - 10) / (23 - 10) of the way
  EXPECT_NEAR(f[16] / base[16], 0.25f * (1.0f - mix) + mix, 1e-6f);
  for (int i = 11; i < 32; ++i) EXPECT_LT(f[size_t(i)] / base[size_t(i)], f[size_t(i - 1)] / base[size_t(i - 1)] + 1e-7f);
  // Without original_context the model's context places the ramp.
  RopeScaling same = y;
  same.original_context = 0;
  EXPECT_EQ(rope_frequencies(64, 10000.0f, same, 4096), f);

  // mscale = 1 + 0.1 ln 4 on q and k alike: scores by its square.
  EXPECT_NEAR(rope_score_scale(y), std::pow(1.0 + 0.1 * std::log(4.0), 2.0), 1e-6);
  y.attn_factor = 0.5f;
  EXPECT_NEAR(rope_score_scale(y), std::pow(0.5 * (1.0 + 0.1 * std::log(4.0)), 2.0), 1e-6);
  y.ext_factor = 0.0f;  // no extrapolation: plain interpolation, no log correction
  EXPECT_NEAR(rope_score_scale(y), 0.25, 1e-7);
  for (int i = 0; i < 32; ++i) EXPECT_EQ(rope_frequencies(64, 10000.0f, y, 4096)[size_t(i)], base[size_t(i)] * 0.25f);
  y.ext_factor = 1.0f;
  y.factor = 0.5f;  // a compressing factor has no log term (llama.cpp since its PR #17945)
  EXPECT_NEAR(rope_score_scale(y), 0.25, 1e-7);
  RopeScaling linear;
  linear.type = RopeScalingType::Linear;
  linear.factor = 4.0f;
  linear.attn_factor = 0.5f;  // attn_factor applies to any type
  EXPECT_NEAR(rope_score_scale(linear), 0.25, 1e-7);
}

// Llama 3.1's own numbers: head_dim 128, base 500000, factor 8, low and high
// frequency factors 1 and 4, original context 8192. Pair 32 has wavelength
// 2 pi 500000^0.5 = 4442.9, between 8192 / 4 and 8192: smooth = (8192 /
// 4442.9 - 1) / 3 = 0.28128, divisor 1 / ((1 - 0.28128) / 8 + 0.28128) = 2.6945.
TEST(RopeScaling, Llama3FactorsFollowTheWavelengths) {
  const std::vector<float> f = llama3_freq_factors(128, 500000.0f, 8.0f, 1.0f, 4.0f, 8192);
  ASSERT_EQ(f.size(), 64u);
  EXPECT_EQ(f.front(), 1.0f);
  EXPECT_EQ(f[28], 1.0f);  // wavelength 2 pi 500000^(28/64) = 1975 < 2048
  EXPECT_NEAR(f[32], 2.6945f, 1e-3f);
  EXPECT_EQ(f[35], 8.0f);  // 2 pi 500000^(35/64) = 8253 > 8192
  EXPECT_EQ(f.back(), 8.0f);
  for (size_t i = 1; i < f.size(); ++i) EXPECT_GE(f[i], f[i - 1]) << i;
}

TEST(RopeScaling, BadValuesAreNamed) {
  RopeScaling s;
  s.freq_factors = {1, 2, 3};
  expect_error_containing([&] { s.validate("m", 8); }, "rope_freqs.weight has 3 values; the head dimension 8 has 4 pairs");
  s.freq_factors = {1, 2, 0, 4};
  expect_error_containing([&] { s.validate("m", 8); }, "rope_freqs.weight[2] = 0 must be positive");
  s.freq_factors.clear();
  s.type = RopeScalingType::Linear;
  s.factor = -2.0f;
  expect_error_containing([&] { s.validate("m", 8); }, "RoPE scaling factor = -2 must be positive");
  s.type = RopeScalingType::Yarn;
  s.factor = 2.0f;
  s.ext_factor = 1.5f;
  expect_error_containing([&] { s.validate("m", 8); }, "ext_factor = 1.5 is out of range");
}

SyntheticModelOptions tiny(const RopeScaling& scaling) {
  SyntheticModelOptions o;
  o.dim = 64;
  o.hidden_dim = 128;
  o.n_layers = 2;
  o.n_heads = 4;
  o.n_kv_heads = 2;
  o.vocab_size = 64;
  o.seq_len = 256;
  o.weights = GgmlType::F32;
  o.rope_scaling = scaling;
  return o;
}

std::unique_ptr<Model> tiny_model(const std::string& name, const RopeScaling& scaling) {
  const std::string path = temp_path(name + ".gguf");
  write_synthetic_gguf(path, tiny(scaling));
  return Model::load(path);
}

RopeScaling yarn(float factor, int32_t original) {
  RopeScaling y;
  y.type = RopeScalingType::Yarn;
  y.factor = factor;
  y.original_context = original;
  return y;
}

TEST(RopeScalingModel, LoaderReadsWhatTheConvertersWrite) {
  RopeScaling llama3;
  llama3.freq_factors = llama3_freq_factors(16, 10000.0f, 8.0f, 1.0f, 4.0f, 64);
  RopeScaling y = yarn(4.0f, 64);
  y.attn_factor = 0.75f;  // llama.rope.scaling.attn_factor
  for (const RopeScaling& want : {llama3, y}) {
    const RopeScaling got = tiny_model("read", want)->config().rope_scaling;
    EXPECT_EQ(got.type, want.type);
    EXPECT_EQ(got.factor, want.factor);
    EXPECT_EQ(got.original_context, want.original_context);
    EXPECT_EQ(got.attn_factor, want.attn_factor);
    EXPECT_EQ(got.freq_factors, want.freq_factors);
  }
  // YaRN without an original context: the file's context, fixed at load.
  EXPECT_EQ(tiny_model("read_default", yarn(4.0f, 0))->config().rope_scaling.original_context, 256);
  EXPECT_FALSE(tiny_model("plain", RopeScaling{})->config().rope_scaling.scales());
}

// Logits of every position of `tokens`, run in chunks of `chunk` tokens.
std::vector<float> logits_of(const Model& model, const KvCacheOptions& kv, const std::vector<int32_t>& tokens,
                             size_t chunk) {
  ThreadPool pool(2);
  Transformer tf(model, pool);
  KvCache cache(model.config(), kv);
  return testing_files::chunked_logits(tf, cache, tokens, chunk);
}

float max_difference(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  float worst = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) worst = std::max(worst, std::fabs(a[i] - b[i]));
  return worst;
}

std::vector<int32_t> some_tokens(int n) {
  std::vector<int32_t> t;
  std::mt19937 rng(11);
  for (int i = 0; i < n; ++i) t.push_back(int32_t(3 + rng() % 60));
  return t;
}

// Keys stored after RoPE, before it (queries turned back through the RoPE
// table) and within 4-token spans all see the scaled angles: one model, the
// same logits. The scaling does change them against the plain model.
TEST(RopeScalingModel, EveryKeyPathTurnsByTheScaledAngles) {
  RopeScaling llama3;
  llama3.freq_factors = llama3_freq_factors(16, 10000.0f, 8.0f, 1.0f, 4.0f, 32);
  const std::vector<int32_t> tokens = some_tokens(150);
  KvCacheOptions after;
  after.num_blocks = 32;
  KvCacheOptions before = after, spans = after;
  before.k.pre_rope = true;
  spans.k.pre_rope = true;
  spans.k.rope_span = 4;
  const std::vector<float> plain = logits_of(*tiny_model("plain", RopeScaling{}), after, tokens, 150);
  for (const RopeScaling& s : {llama3, yarn(4.0f, 32)}) {
    auto m = tiny_model("paths", s);
    const std::vector<float> want = logits_of(*m, after, tokens, 150);
    EXPECT_LE(max_difference(logits_of(*m, after, tokens, 1), want), 1e-4f);  // decode, token by token
    EXPECT_LE(max_difference(logits_of(*m, before, tokens, 150), want), 1e-4f);
    EXPECT_LE(max_difference(logits_of(*m, before, tokens, 1), want), 1e-4f);
    EXPECT_LE(max_difference(logits_of(*m, spans, tokens, 1), want), 1e-4f);
    EXPECT_GT(max_difference(plain, want), 1e-2f) << s.describe();
  }
}

// Linear x2 and factors of 2 on every pair are the same rotation.
TEST(RopeScalingModel, LinearEqualsUniformFactors) {
  RopeScaling linear;
  linear.type = RopeScalingType::Linear;
  linear.factor = 2.0f;
  RopeScaling factors;
  factors.freq_factors.assign(8, 2.0f);
  KvCacheOptions kv;
  kv.num_blocks = 32;
  const std::vector<int32_t> tokens = some_tokens(100);
  const std::vector<float> by_linear = logits_of(*tiny_model("linear", linear), kv, tokens, 100);
  EXPECT_EQ(max_difference(by_linear, logits_of(*tiny_model("factors", factors), kv, tokens, 100)), 0.0f);
  EXPECT_GT(max_difference(by_linear, logits_of(*tiny_model("unscaled", RopeScaling{}), kv, tokens, 100)), 1e-2f);
}

// YaRN with an original context so long that every pair keeps its angle
// changes only the scores' scale: layer 0's queries are the plain model's
// times mscale^2.
TEST(RopeScalingModel, YarnScalesTheQueries) {
  const RopeScaling y = yarn(4.0f, 1 << 24);
  ASSERT_EQ(rope_frequencies(16, 10000.0f, y, 256), unscaled_rope_frequencies(16, 10000.0f));
  const std::vector<int32_t> tokens = some_tokens(20);
  std::vector<float> q[2];
  int which = 0;
  for (const RopeScaling& s : {RopeScaling{}, y}) {
    auto m = tiny_model(which == 0 ? "q_plain" : "q_yarn", s);
    ThreadPool pool(1);
    Transformer tf(*m, pool);
    tf.set_query_observer([&](int layer, const float* rows, int64_t n) {
      if (layer == 0) q[which].assign(rows, rows + n * 64);
    });
    KvCacheOptions kv;
    kv.num_blocks = 8;
    KvCache cache(m->config(), kv);
    BlockTable table;
    ASSERT_TRUE(cache.reserve(table, int32_t(tokens.size())));
    std::vector<BatchEntry> batch(1);
    batch[0].table = &table;
    batch[0].tokens = tokens;
    Logits logits;
    tf.forward(batch, cache, logits);
    ++which;
  }
  ASSERT_EQ(q[0].size(), tokens.size() * 64);
  const float scale = rope_score_scale(y);
  for (size_t i = 0; i < q[0].size(); ++i) ASSERT_NEAR(q[1][i], q[0][i] * scale, 1e-5f) << i;
}

// llama.cpp's flags over a file: a factor alone stretches as linear, YaRN's
// original context defaults to the trained one, the file's factors stay, and
// a plain file with overrides runs exactly as a file written with them.
TEST(RopeScalingModel, OverridesApplyOverTheFile) {
  const std::string plain = temp_path("override_plain.gguf");
  write_synthetic_gguf(plain, tiny(RopeScaling{}));
  ModelOverrides scale;
  scale.rope_scale = 2.0f;
  auto m = Model::load(plain, "", scale);
  EXPECT_EQ(m->config().rope_scaling.type, RopeScalingType::Linear);
  RopeScaling linear;
  linear.type = RopeScalingType::Linear;
  linear.factor = 2.0f;
  KvCacheOptions kv;
  kv.num_blocks = 32;
  const std::vector<int32_t> tokens = some_tokens(100);
  EXPECT_EQ(max_difference(logits_of(*m, kv, tokens, 100), logits_of(*tiny_model("written", linear), kv, tokens, 100)),
            0.0f);
  EXPECT_NE(m->fingerprint(), Model::load(plain)->fingerprint());

  ModelOverrides y;
  y.rope_scaling = RopeScalingType::Yarn;
  y.rope_scale = 4.0f;
  y.context_length = 1024;
  auto ym = Model::load(plain, "", y);
  EXPECT_EQ(ym->config().seq_len, 1024);
  EXPECT_EQ(ym->trained_context_length(), 256);
  EXPECT_EQ(ym->config().rope_scaling.original_context, 256);
  // A longer run alone is the same model: its KV blocks and calibrations stay valid.
  ModelOverrides longer_only;
  longer_only.context_length = 1024;
  EXPECT_EQ(Model::load(plain, "", longer_only)->fingerprint(), Model::load(plain)->fingerprint());
  y.yarn_original_context = 128;
  EXPECT_EQ(Model::load(plain, "", y)->config().rope_scaling.original_context, 128);

  RopeScaling llama3;
  llama3.freq_factors = llama3_freq_factors(16, 10000.0f, 8.0f, 1.0f, 4.0f, 32);
  const std::string factors = temp_path("override_factors.gguf");
  write_synthetic_gguf(factors, tiny(llama3));
  ModelOverrides longer;
  longer.context_length = 4096;
  auto lm = Model::load(factors, "", longer);
  EXPECT_EQ(lm->config().rope_scaling.freq_factors, llama3.freq_factors);
  EXPECT_EQ(lm->config().seq_len, 4096);

  ModelOverrides bad;
  bad.yarn_ext_factor = 3.0f;
  bad.rope_scaling = RopeScalingType::Yarn;
  expect_error_containing([&] { (void)Model::load(plain, "", bad); }, "ext_factor = 3 is out of range");
  ModelOverrides ramp_without_yarn;  // the ramp's knobs on a linear stretch: refused, not ignored
  ramp_without_yarn.rope_scale = 2.0f;
  ramp_without_yarn.yarn_beta_fast = 16.0f;
  expect_error_containing([&] { (void)Model::load(plain, "", ramp_without_yarn); }, "apply to YaRN only");
}

TEST(RopeScalingModel, FingerprintNamesTheScaling) {
  const std::string plain = tiny_model("fp_plain", RopeScaling{})->fingerprint();
  RopeScaling linear;
  linear.type = RopeScalingType::Linear;
  linear.factor = 2.0f;
  const std::string scaled = tiny_model("fp_linear", linear)->fingerprint();
  linear.factor = 3.0f;
  EXPECT_NE(plain, scaled);
  EXPECT_NE(scaled, tiny_model("fp_linear3", linear)->fingerprint());
}

}  // namespace
}  // namespace kvserve
