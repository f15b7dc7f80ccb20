// Text forms of KV configurations: per-layer overrides, presets, calibration
// files, and the mixed-precision assignment solver.
#include "kv/kv_spec.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <random>
#include <string_view>

#include "attention/paged_attention.h"
#include "engine/kv_calibrator.h"
#include "kv/kv_cache.h"
#include "kv/kv_calibration.h"
#include "util/error.h"

namespace kvserve {
namespace {

TEST(KvLayers, ParsesRangesAndKvPairs) {
  const auto o = parse_kv_layers("0:fp16,1-3:int4,4:int8/int2", 5);
  ASSERT_EQ(o.size(), 3u);
  EXPECT_EQ(o[0].first, 0);
  EXPECT_EQ(o[0].last, 0);
  EXPECT_EQ(o[0].k, KvDType::F16);
  EXPECT_EQ(o[1].first, 1);
  EXPECT_EQ(o[1].last, 3);
  EXPECT_EQ(o[1].v, KvDType::INT4);
  EXPECT_EQ(o[2].k, KvDType::INT8);
  EXPECT_EQ(o[2].v, KvDType::INT2);
}

TEST(KvLayers, RejectsBadSpecs) {
  EXPECT_THROW(parse_kv_layers("5:int4", 5), Error);
  EXPECT_THROW(parse_kv_layers("3-1:int4", 5), Error);
  EXPECT_THROW(parse_kv_layers("x:int4", 5), Error);
  EXPECT_THROW(parse_kv_layers("1int4", 5), Error);
  EXPECT_THROW(parse_kv_layers("1:int3", 5), Error);
  EXPECT_THROW(parse_kv_layers(",", 5), Error);
}

TEST(KvLayers, OverridesKeepGroupingOfTheGlobalSetting) {
  KvCacheOptions o;
  o.k = {KvDType::INT4, KvGrouping::Channel, 8, {}, {}};
  o.v = {KvDType::INT4, KvGrouping::Token, 4, {}, {}};
  apply_kv_layers(o, parse_kv_layers("0:fp16,2:int2", 3), 3);
  ASSERT_EQ(o.layers.size(), 3u);
  EXPECT_EQ(o.layers[0].k.dtype, KvDType::F16);
  EXPECT_EQ(o.layers[1].k.dtype, KvDType::INT4);
  EXPECT_EQ(o.layers[2].k.dtype, KvDType::INT2);
  EXPECT_EQ(o.layers[2].k.grouping, KvGrouping::Channel);
  EXPECT_EQ(o.layers[2].v.group_size, 4);
}

// Pre-RoPE keys are a property of the layer's storage, not of one override:
// a layer set to a float type and back keeps them (the CLI drops them once,
// from the final float layers, unless asked to keep them).
TEST(KvLayers, OverlappingOverridesKeepPreRopeStorage) {
  KvCacheOptions o;
  apply_kv_preset(o, "int2");
  apply_kv_layers(o, parse_kv_layers("1:fp16,1:int2,2:fp16", 3), 3);
  EXPECT_EQ(o.layers[1].k.dtype, KvDType::INT2);
  EXPECT_TRUE(o.layers[1].k.pre_rope);
  EXPECT_EQ(o.layers[1].k.rope_span, 16);
  EXPECT_EQ(o.layers[2].k.dtype, KvDType::F16);
  EXPECT_TRUE(o.layers[2].k.pre_rope);
}

TEST(KvPreset, EveryPresetBuildsACache) {
  ModelConfig c;
  c.dim = 64, c.hidden_dim = 172, c.n_layers = 5, c.n_heads = 8, c.n_kv_heads = 4, c.vocab_size = 512, c.seq_len = 512;
  int64_t last = 1 << 30;
  for (const auto& name : kv_preset_names()) {
    KvCacheOptions o;
    apply_kv_preset(o, name);
    KvCache cache(c, o);
    // Presets are ordered from the largest to the smallest cache.
    EXPECT_LT(cache.stats().bytes_per_token, last) << name;
    last = cache.stats().bytes_per_token;
  }
  KvCacheOptions o;
  EXPECT_THROW(apply_kv_preset(o, "int3"), Error);
}

// The integer presets bring 32-token blocks (fewer metadata bytes and fixed
// costs per token; INT4's keys take the 8-bit query kernel) and a residual
// window of whole blocks; a block size the user chose is kept, with the
// window still counted in blocks. Float presets leave the block size alone.
TEST(KvPreset, IntegerPresetsPickTheirBlockSizeUnlessTheUserChose) {
  struct Expected {
    std::string name;
    int block, residual;
  };
  const Expected presets[] = {{"int8", 32, 32},        {"int4", 32, 64},  {"int4-small", 64, 128},
                              {"int2", 32, 64},        {"int2-small", 64, 128}};
  for (const auto& [name, block, residual] : presets) {
    KvCacheOptions o;
    o.block_size = 16;
    apply_kv_preset(o, name);
    EXPECT_EQ(o.block_size, block) << name;
    EXPECT_EQ(o.residual, residual) << name;
  }
  // The small presets' 128-token window is whole blocks of any block size
  // that divides it, else one block.
  for (const auto& [block, residual] : {std::pair{16, 128}, std::pair{32, 128}, std::pair{256, 256}}) {
    KvCacheOptions o;
    o.block_size = block;
    apply_kv_preset(o, "int4-small", /*keep_block_size=*/true);
    EXPECT_EQ(o.block_size, block);
    EXPECT_EQ(o.residual, residual) << block;
  }
  KvCacheOptions kept;
  kept.block_size = 8;
  apply_kv_preset(kept, "int4", /*keep_block_size=*/true);
  EXPECT_EQ(kept.block_size, 8);
  EXPECT_EQ(kept.residual, 16);
  EXPECT_FALSE(kept.k.pre_rope);
  // The int2 presets' keys: before RoPE, rotated within 16-token spans, or
  // spans that divide a smaller block the user chose.
  for (const auto& [block, span] : {std::pair{16, 16}, std::pair{8, 8}, std::pair{24, 8}}) {
    for (const std::string name : {"int2", "int2-small"}) {
      KvCacheOptions o;
      o.block_size = block;
      apply_kv_preset(o, name, /*keep_block_size=*/true);
      EXPECT_TRUE(o.k.pre_rope) << name;
      EXPECT_EQ(o.k.rope_span, span) << name << " block " << block;
    }
  }
  KvCacheOptions int2;
  apply_kv_preset(int2, "int2");
  EXPECT_EQ(int2.k.rope_span, 16);
  for (const std::string name : {"fp32", "fp16"}) {
    KvCacheOptions o;
    o.block_size = 16;
    apply_kv_preset(o, name);
    EXPECT_EQ(o.block_size, 16) << name;
  }
}

TEST(KvCalibrationFile, RoundTripsAndApplies) {
  KvCalibration c;
  c.model = "m";
  c.kv_dim = 2;
  c.tokens = 100;
  c.k = {{{-1, -2}, {1, 2}}, {{-3, -4}, {3, 4}}};
  c.v = c.k;
  c.assignment = {{KvDType::F16, KvDType::INT8}, {KvDType::INT4, KvDType::INT2}};
  c.target_bits = 5;
  c.sensitivity = {{0, true, KvDType::INT4, 0.25}};
  const std::string path = ::testing::TempDir() + "/calib.json";
  save_kv_calibration(path, c);
  const KvCalibration d = load_kv_calibration(path);
  EXPECT_EQ(d.kv_dim, 2);
  EXPECT_EQ(d.k[1].max, (std::vector<float>{3, 4}));
  ASSERT_EQ(d.assignment.size(), 2u);
  EXPECT_EQ(d.assignment[1].v, KvDType::INT2);

  KvCacheOptions o;
  apply_kv_calibration(o, d, 2, true);
  EXPECT_EQ(o.layers[0].k.dtype, KvDType::F16);
  EXPECT_FALSE(o.layers[0].k.is_static());  // fp16 has no scales
  EXPECT_EQ(o.layers[1].k.static_min, (std::vector<float>{-3, -4}));
  // Outliers asked for every layer stay only where the assignment keeps integer codes.
  KvCacheOptions with_outliers;
  with_outliers.k.outliers = with_outliers.v.outliers = 1;
  apply_kv_calibration(with_outliers, d, 2, false);
  EXPECT_EQ(with_outliers.layers[0].k.outliers, 0);  // fp16
  EXPECT_EQ(with_outliers.layers[0].v.outliers, 1);  // int8
  EXPECT_EQ(with_outliers.layers[1].k.outliers, 1);  // int4
  EXPECT_THROW(apply_kv_calibration(o, d, 3, true), Error);
  // Layers that later overrides make integer take their static ranges too.
  KvCacheOptions plain;  // fp32, no assignment
  KvCalibration ranges_only = d;
  ranges_only.assignment.clear();
  apply_kv_calibration(plain, ranges_only, 2, true);
  EXPECT_FALSE(plain.layers[0].k.is_static());
  apply_kv_layers(plain, parse_kv_layers("0:int4", 2), 2);
  apply_kv_static_ranges(plain, ranges_only, 2);
  EXPECT_EQ(plain.layers[0].k.static_min, (std::vector<float>{-1, -2}));
  EXPECT_FALSE(plain.layers[1].k.is_static());
  std::remove(path.c_str());
}

// An assignment is chosen under one layout; the file records it and the
// model's fingerprint, and applying the layout keeps each plane's type.
TEST(KvCalibrationFile, RecordsTheLayoutAndTheModel) {
  KvCalibration c;
  c.model = "m";
  c.model_fingerprint = "abc";
  c.kv_dim = 2;
  c.k = {{{-1, -2}, {1, 2}}};
  c.v = c.k;
  c.assignment = {{KvDType::INT4, KvDType::INT2}};
  c.target_bits = 3;
  KvCalibrationLayout& layout = c.layout.emplace();
  layout.block_size = 32;
  layout.residual = 64;
  layout.k.grouping = KvGrouping::Channel;
  layout.k.pre_rope = true;
  layout.k.rope_span = 16;
  layout.v.group_size = 4;
  layout.v.scale_bits = 8;
  layout.k.outliers = 1;
  layout.static_scales = false;
  const std::string path = ::testing::TempDir() + "/calib_layout.json";
  save_kv_calibration(path, c);
  const KvCalibration d = load_kv_calibration(path);
  EXPECT_EQ(d.model_fingerprint, "abc");
  ASSERT_TRUE(d.layout);
  EXPECT_EQ(d.layout->block_size, 32);
  EXPECT_EQ(d.layout->residual, 64);
  EXPECT_FALSE(d.layout->static_scales);
  EXPECT_EQ(d.layout->k.describe(), layout.k.describe());
  EXPECT_EQ(d.layout->v.describe(), layout.v.describe());

  KvCacheOptions o;
  o.block_size = 16;
  o.set_dtype(KvDType::INT4);
  apply_kv_calibration_layout(o, *d.layout, /*keep_block_size=*/false);
  EXPECT_EQ(o.block_size, 32);
  EXPECT_EQ(o.residual, 64);
  EXPECT_EQ(o.k.describe(), "int4/channel/g0+prerope16+o1");
  EXPECT_EQ(o.v.describe(), "int4/token/g4+s8");
  apply_kv_calibration_layout(o, *d.layout, /*keep_block_size=*/true);
  o.block_size = 8;
  apply_kv_calibration_layout(o, *d.layout, /*keep_block_size=*/true);
  EXPECT_EQ(o.block_size, 8);

  EXPECT_NO_THROW(check_kv_calibration_model(d, path, "abc"));
  try {
    check_kv_calibration_model(d, path, "def");
    ADD_FAILURE() << "a file from another model was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("was measured on another model"), std::string::npos) << e.what();
  }
  // Files written before the record load without a layout and pass any model.
  KvCalibration old = c;
  old.model_fingerprint.clear();
  old.layout.reset();
  save_kv_calibration(path, old);
  const KvCalibration e = load_kv_calibration(path);
  EXPECT_FALSE(e.layout);
  EXPECT_NO_THROW(check_kv_calibration_model(e, path, "def"));
  std::remove(path.c_str());
}

TEST(KvCalibrationFile, RejectsMalformedFiles) {
  const std::string path = ::testing::TempDir() + "/bad_calib.json";
  for (const char* text : {"not json", "{}", R"({"format":"kvserve-kv-calibration-1","kv_dim":2,"layers":[{"k_min":[1]}]})",
                           // kv_dim 0 with empty ranges, a fraction, past int, a string; no layers
                           R"({"format":"kvserve-kv-calibration-1","kv_dim":0,"layers":[{"k_min":[],"k_max":[],"v_min":[],"v_max":[]}]})",
                           R"({"format":"kvserve-kv-calibration-1","kv_dim":1.5,"layers":[{"k_min":[1],"k_max":[2],"v_min":[1],"v_max":[2]}]})",
                           R"({"format":"kvserve-kv-calibration-1","kv_dim":1099511627776,"layers":[]})",
                           R"({"format":"kvserve-kv-calibration-1","kv_dim":"2","layers":[]})",
                           R"({"format":"kvserve-kv-calibration-1","kv_dim":2,"layers":[]})"}) {
    std::ofstream(path) << text;
    EXPECT_THROW(load_kv_calibration(path), Error) << text;
  }
  EXPECT_THROW(load_kv_calibration(path + ".missing"), Error);
  EXPECT_THROW(load_kv_calibration(::testing::TempDir()), Error);  // a directory
  std::remove(path.c_str());
}

// Fuzzes the calibration loader and what follows it: a valid file with
// bytes cut, replaced, or whole numbers swapped for other JSON (huge, tiny,
// negative, null, strings, arrays). Every variant either loads or throws
// kvserve::Error; what loads either builds a cache or throws kvserve::Error
// (static ranges that are not finite, reversed or beyond fp16's range are
// refused, not turned into garbage codes); and a cache that builds stores a
// token whose attention output is finite.
TEST(KvCalibrationFile, FuzzedFilesLoadCleanlyOrFailWithAnError) {
  ModelConfig m;
  m.dim = 64;
  m.hidden_dim = 172;
  m.n_layers = 3;
  m.n_heads = 8;
  m.n_kv_heads = 4;
  m.vocab_size = 512;
  m.seq_len = 64;
  const int kv_dim = m.kv_dim(), group = m.gqa_group(), hd = m.head_dim();
  KvCalibration c;
  c.model = "fuzz";
  c.kv_dim = kv_dim;
  c.tokens = 1000;
  for (int l = 0; l < m.n_layers; ++l) {
    KvChannelRanges r;
    for (int d = 0; d < kv_dim; ++d) {
      r.min.push_back(-1.0f - 0.25f * float(d % 5));
      r.max.push_back(1.5f + 0.125f * float(d % 3));
    }
    c.k.push_back(r);
    c.v.push_back(r);
  }
  c.assignment = {{KvDType::F16, KvDType::INT8}, {KvDType::INT4, KvDType::INT4}, {KvDType::INT2, KvDType::INT8}};
  c.target_bits = 7;
  const std::string path = ::testing::TempDir() + "/fuzz_calib.json";
  save_kv_calibration(path, c);
  std::string valid;
  {
    std::ifstream in(path);
    valid.assign(std::istreambuf_iterator<char>(in), {});
  }
  // Where the numbers are, to swap whole ones.
  std::vector<std::pair<size_t, size_t>> numbers;
  for (size_t i = 0; i < valid.size();) {
    if ((valid[i] >= '0' && valid[i] <= '9') || valid[i] == '-') {
      size_t e = i;
      while (e < valid.size() && std::string_view("0123456789.-+eE").find(valid[e]) != std::string_view::npos) ++e;
      numbers.emplace_back(i, e - i);
      i = e;
    } else {
      ++i;
    }
  }
  const std::vector<std::string> swaps = {"1e39", "-1e39", "70000", "-70000", "1e-40", "0", "-0", "3.5",
                                          "null", "\"x\"", "[]", "{}", "true", "2147483648", "-7"};
  std::mt19937 rng(1234);
  int loaded = 0, built = 0;
  for (int iter = 0; iter < 600; ++iter) {
    std::string text = valid;
    switch (iter % 3) {
      case 0:  // one to three whole numbers swapped
        for (int k = 0; k < 1 + int(rng() % 3); ++k) {
          const auto [at, len] = numbers[rng() % numbers.size()];
          text = valid.substr(0, at) + swaps[rng() % swaps.size()] + valid.substr(at + len);
        }
        break;
      case 1:  // a few bytes replaced
        for (int k = 0; k < 1 + int(rng() % 4); ++k) text[rng() % text.size()] = char(32 + rng() % 95);
        break;
      default:  // cut short
        text.resize(rng() % text.size());
    }
    std::ofstream(path, std::ios::trunc) << text;
    KvCalibration d;
    try {
      d = load_kv_calibration(path);
    } catch (const Error&) {
      continue;
    }
    ++loaded;
    for (bool use_static : {true, false}) {
      KvCacheOptions o;
      o.block_size = 8;
      o.num_blocks = 4;
      o.set_dtype(KvDType::INT4);
      std::unique_ptr<KvCache> cache;
      try {
        apply_kv_calibration(o, d, m.n_layers, use_static);
        cache = std::make_unique<KvCache>(m, o);
      } catch (const Error&) {
        continue;
      }
      ++built;
      BlockTable t;
      ASSERT_TRUE(cache->reserve(t, 9));
      std::vector<float> k(static_cast<size_t>(kv_dim)), v(k.size()), q(static_cast<size_t>(group * hd)), out(q.size());
      for (int l = 0; l < m.n_layers; ++l) {
        for (int pos = 0; pos < 9; ++pos) {
          for (int i = 0; i < kv_dim; ++i) k[size_t(i)] = std::sin(float(pos + 3 * i)), v[size_t(i)] = std::cos(float(pos * i));
          cache->write(l, t, pos, k.data(), v.data());
        }
        cache->seal(l, t, 9);
      }
      cache->commit(t, 9);
      for (auto& x : q) x = 0.3f;
      AttentionScratch scratch;
      for (int l = 0; l < m.n_layers; ++l)
        for (int h = 0; h < m.n_kv_heads; ++h) {
          attend_kv_head(*cache, l, t, 9, h, group, hd, q.data(), out.data(), scratch);
          for (float x : out) ASSERT_TRUE(std::isfinite(x)) << "iteration " << iter << " layer " << l << ":\n" << text;
        }
    }
  }
  EXPECT_GT(loaded, 50);
  EXPECT_GT(built, 50);
  std::remove(path.c_str());
}

TEST(ChooseAssignment, FindsTheCheapestChoiceWithinTheBitBudget) {
  // Two items, options {16, 8, 4, 2} bits; item 0 is sensitive, item 1 is not.
  const std::vector<std::vector<double>> bits = {{16, 8, 4, 2}, {16, 8, 4, 2}};
  const std::vector<std::vector<double>> cost = {{0, 0.1, 1.0, 5.0}, {0, 0.01, 0.02, 0.05}};
  // Mean of 6 bits: 8 + 4 fits (cost 0.12); 4 + 8 costs 1.01; 8 + 2 costs 0.15 (fits too, dearer).
  EXPECT_EQ(choose_assignment(cost, bits, 6.0), (std::vector<int>{1, 2}));
  EXPECT_EQ(choose_assignment(cost, bits, 16.0), (std::vector<int>{0, 0}));
  EXPECT_EQ(choose_assignment(cost, bits, 2.0), (std::vector<int>{3, 3}));
  EXPECT_THROW(choose_assignment(cost, bits, 1.0), Error);
  // More bits than the widest choice: the widest everywhere, without a table
  // sized by the request; no budget at all is an error, not an empty table.
  EXPECT_EQ(choose_assignment(cost, bits, 1e12), (std::vector<int>{0, 0}));
  for (double bad : {0.0, -3.0, std::nan(""), HUGE_VAL}) EXPECT_THROW(choose_assignment(cost, bits, bad), Error) << bad;
}

}  // namespace
}  // namespace kvserve
