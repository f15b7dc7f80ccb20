// Text forms of KV configurations: per-layer overrides, presets, calibration
// files, and the mixed-precision assignment solver.
#include "kv/kv_spec.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>

#include "engine/kv_calibrator.h"
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
  std::remove(path.c_str());
}

TEST(KvCalibrationFile, RejectsMalformedFiles) {
  const std::string path = ::testing::TempDir() + "/bad_calib.json";
  for (const char* text : {"not json", "{}", R"({"format":"kvserve-kv-calibration-1","kv_dim":2,"layers":[{"k_min":[1]}]})"}) {
    std::ofstream(path) << text;
    EXPECT_THROW(load_kv_calibration(path), Error) << text;
  }
  EXPECT_THROW(load_kv_calibration(path + ".missing"), Error);
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
}

}  // namespace
}  // namespace kvserve
