// A prefill tile (consecutive query tokens reading each block once) gives
// every token the output of its own pass, for every codec pair, across the
// blocks that are staged in FP16 for a tile's first tokens and sealed for
// its last.
#include "attention/tile_attention.h"

#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <random>

#include "attention/paged_attention.h"
#include "attention_test_support.h"
#include "kernels/vector_ops.h"
#include "kv/int_codecs.h"

namespace kvserve {
namespace {

ModelConfig head_dim_64() {
  ModelConfig c;
  c.dim = 384;  // 6 query heads of 64 on 2 KV heads: groups of 3, as the 400M model
  c.hidden_dim = 64;
  c.n_layers = 2;
  c.n_heads = 6;
  c.n_kv_heads = 2;
  c.vocab_size = 16;
  c.seq_len = 512;
  return c;
}

// Every token of tiles over a 200-token context against its own pass, for
// each codec pair and block size (floats_only: the float caches alone).
void expect_tiles_equal_own_passes(const ModelConfig& c, bool floats_only = false) {
  const int hd = c.head_dim();
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto chan = [](KvDType t, int bits) {
    KvCodecConfig k{t, KvGrouping::Channel, 0, {}, {}};  // one group per block
    k.scale_bits = bits;
    return k;
  };
  auto tok = [&](KvDType t, int bits) {
    KvCodecConfig v{t, KvGrouping::Token, hd, {}, {}};
    v.scale_bits = bits;
    return v;
  };
  auto spans = [](KvCodecConfig k, int span) {
    k.pre_rope = true;
    k.rope_span = span;
    return k;
  };
  const std::vector<std::pair<KvCodecConfig, KvCodecConfig>> codecs = {
      {{KvDType::F32}, {KvDType::F32}},
      {{KvDType::F16}, {KvDType::F16}},
      {{KvDType::BF16}, {KvDType::Q4_0}},
      {{KvDType::FP8}, {KvDType::FP8}},
      {{KvDType::FP8_E5M2}, {KvDType::F16}},
      {chan(KvDType::INT8, 16), tok(KvDType::INT8, 16)},  // 16-bit scales
      {chan(KvDType::INT4, 8), tok(KvDType::INT4, 8)},  // int4-small's codecs: the byte kernels
      {chan(KvDType::INT2, 8), tok(KvDType::INT2, 8)},
      {tok(KvDType::INT4, 16), {KvDType::INT2, KvGrouping::Channel, 0, {}, {}}},
      // Keys before RoPE in spans (the int2 presets' keys; the float ones
      // keep to the codec kernels).
      {spans(chan(KvDType::INT2, 8), 16), tok(KvDType::INT2, 8)},
      {spans(chan(KvDType::INT4, 16), 4), tok(KvDType::INT4, 16)},
      {spans({KvDType::F32}, 8), {KvDType::F16}},
  };
  for (const auto& [kc, vc] : codecs) {
    if (floats_only && (kv_dtype_is_quantized(kc.dtype) || kv_dtype_is_quantized(vc.dtype) || kc.pre_rope)) continue;
    for (int bs : {1, 5, 16, 64}) {
      KvCacheOptions o;
      o.block_size = bs;
      o.k = kc;
      o.k.rope_span = std::gcd(kc.rope_span, bs);  // spans divide the block
      o.v = vc;
      o.residual = 2 * bs;
      o.num_blocks = 300 / bs + 8;
      KvCache cache(c, o);
      BlockTable table;
      const int n_ctx = 200;
      ASSERT_TRUE(cache.reserve(table, n_ctx));
      std::vector<float> k(size_t(c.kv_dim())), v(size_t(c.kv_dim()));
      for (int pos = 0; pos < n_ctx; ++pos) {
        for (auto& x : k) x = normal(rng);
        for (auto& x : v) x = normal(rng);
        cache.write(1, table, pos, k.data(), v.data());
      }
      cache.seal(1, table, n_ctx);  // as a forward pass over a chunk ending at n_ctx
      const int head_dim = c.head_dim(), group = c.gqa_group();
      const size_t set = size_t(group) * size_t(head_dim), stride = size_t(c.n_kv_heads) * set;  // the two KV heads' groups per token
      AttentionScratch scratch;
      std::vector<float> own(set), ref(set);  // one token's own pass, the reference
      std::vector<float> q(70 * stride), out(q.size());  // the longest tile's queries and outputs
      // Tiles that start at the context's first token, inside a block, and
      // just before the end, some crossing the staged blocks' edge.
      for (auto [first, tokens] : {std::pair{0, 16}, std::pair{37, 9}, std::pair{130, 70}, std::pair{198, 2}}) {
        for (auto& x : q) x = normal(rng) * 0.3f;
        std::fill(out.begin(), out.end(), NAN);
        for (int h = 0; h < c.n_kv_heads; ++h) {
          // Spans of one token (a block size the span does not divide
          // past 1) are keys exactly before RoPE: per-token passes.
          const bool tiles = !o.k.pre_rope || o.k.rope_span > 1;
          // The context in one part, and in parts of 40 tokens (whole blocks).
          const int32_t part = (first + tokens + h) % 2 == 0 ? kTilePartTokens : 40;
          ASSERT_EQ(attend_kv_head_tile(cache, 1, table, first + 1, tokens, h, group, head_dim, q.data() + h * set,
                                        stride, out.data() + h * set, scratch, part),
                    tiles);
          if (!tiles) continue;
          // 4-bit and 2-bit values meet 8-bit weights, rounded against each
          // block's largest (token_weight_steps): with the context in parts,
          // each part's weights are scaled by its own largest score, and a
          // last-bit change can move one weight by a step (up to ~3e-4 here).
          const float own_tolerance =
              part != kTilePartTokens && token_weight_steps(cache.v_codec(1).config(), cache.v_codec(1).shape()) == 127
                  ? 1e-3f
                  : 1e-5f;
          for (int t = 0; t < tokens; ++t) {
            const float* qt = q.data() + size_t(t) * stride + h * set;
            attend_kv_head(cache, 1, table, first + 1 + t, h, group, head_dim, qt, own.data(), scratch);
            attend_kv_head_reference(cache, 1, table, first + 1 + t, h, group, head_dim, qt, ref.data());
            // Against the double-precision reference: a coarse check (the
            // 8-bit value weights' rounding, which the per-token tests bound,
            // moves outputs by ~2e-5 here); the tile's claim is equality with own.
            const double tolerance =
                2e-4 + testing_attention::rounding_allowance(cache, 1, table, first + 1 + t, h, group, head_dim, qt);
            for (size_t i = 0; i < set; ++i) {
              const float got = out[size_t(t) * stride + h * set + i];
              ASSERT_NEAR(got, own[i], own_tolerance) << kc.describe() << "+" << vc.describe() << " bs " << bs
                                              << " token " << first + t << " head " << h << " part " << part;
              ASSERT_NEAR(got, ref[i], tolerance) << kc.describe() << "+" << vc.describe() << " bs " << bs;
            }
          }
        }
      }
    }
  }
}

TEST(TileAttention, EveryTokenGetsItsOwnPass) {
  expect_tiles_equal_own_passes(head_dim_64());
  ModelConfig small = head_dim_64();  // stories260K's shape: head dim 8, groups of 2 (scalar kernels)
  small.dim = 64;
  small.n_heads = 8;
  small.n_kv_heads = 4;
  expect_tiles_equal_own_passes(small);
  ModelConfig wide = head_dim_64();  // groups of 56, head dim 16: one token a float pass, 4 vectors of rows
  wide.dim = 112 * 16;
  wide.n_heads = 112;
  expect_tiles_equal_own_passes(wide, true);
}

// A value that overflows an FP16 cache (or FP16 staging) is infinite; the
// tile's tokens before it do not see it and must stay finite, as in their
// own passes (a weight of 0 times an infinite value would be NaN).
TEST(TileAttention, ValuesPastATokensContextNeverReachIt) {
  ModelConfig c = head_dim_64();
  c.n_kv_heads = 1;
  c.n_heads = 3;
  c.dim = 3 * 64;
  for (bool staged : {false, true}) {  // the float path; int8 with FP16 staging (codec kernels)
    KvCacheOptions o;
    o.block_size = 16;
    o.num_blocks = 16;
    if (staged) {
      o.k = {KvDType::INT8, KvGrouping::Channel, 0, {}, {}};
      o.v = {KvDType::INT8, KvGrouping::Token, 64, {}, {}};
      o.residual = 32;
    } else {
      o.set_dtype(KvDType::F16);
    }
    KvCache cache(c, o);
    BlockTable table;
    ASSERT_TRUE(cache.reserve(table, 40));
    std::mt19937 rng(1);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> k(64), v(64);
    for (int pos = 0; pos < 40; ++pos) {
      for (auto& x : k) x = normal(rng);
      for (auto& x : v) x = normal(rng);
      if (pos == 39) v[5] = 1e5f;  // past FP16's range: stored as infinity
      cache.write(0, table, pos, k.data(), v.data());
    }
    cache.seal(0, table, 40);
    const int tokens = 8, set = 3 * 64;
    std::vector<float> q(size_t(tokens) * set), out(q.size()), own(set);
    for (auto& x : q) x = normal(rng);
    AttentionScratch scratch;
    ASSERT_TRUE(attend_kv_head_tile(cache, 0, table, 40 - tokens + 1, tokens, 0, 3, 64, q.data(), set, out.data(),
                                    scratch));
    for (int t = 0; t + 1 < tokens; ++t) {  // the last token sees the infinite value
      attend_kv_head(cache, 0, table, 40 - tokens + 1 + t, 0, 3, 64, q.data() + size_t(t) * set, own.data(), scratch);
      for (int i = 0; i < set; ++i) {
        ASSERT_TRUE(std::isfinite(out[size_t(t) * set + i])) << (staged ? "int8, staged" : "fp16") << " token " << t;
        ASSERT_NEAR(out[size_t(t) * set + i], own[i], 1e-5f);
      }
    }
  }
}

// After eviction and compaction slots are no longer positions: keys stored
// after RoPE still take tiles (equal to per-token passes), keys in RoPE
// spans go back to per-token passes (their rotations follow positions).
TEST(TileAttention, CompactedTablesTileOnlyKeysAfterRope) {
  const ModelConfig c = head_dim_64();
  for (bool spans : {false, true}) {
    KvCacheOptions o;
    o.block_size = 16;
    o.num_blocks = 32;
    o.k = {KvDType::INT4, KvGrouping::Channel, 0, {}, {}};
    o.k.pre_rope = spans;
    o.k.rope_span = spans ? 4 : 1;
    o.v = {KvDType::INT4, KvGrouping::Token, 64, {}, {}};
    o.residual = 32;
    KvCache cache(c, o);
    BlockTable table;
    table.positions_in_cache = true;  // sinks' positions (StreamingLLM): rotations follow the cache
    std::mt19937 rng(3);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> k(size_t(c.kv_dim())), v(size_t(c.kv_dim()));
    auto write = [&](int32_t from, int32_t to) {
      for (int32_t s = from; s < to; ++s) {
        for (auto& x : k) x = normal(rng);
        for (auto& x : v) x = normal(rng);
        if (spans) rope(k.data(), c.n_kv_heads, c.head_dim(), table.position_of_new(s) % 4, c.rope_theta);
        cache.write(0, table, s, k.data(), v.data());
      }
    };
    ASSERT_TRUE(cache.reserve(table, 50));
    write(0, 50);
    cache.seal(0, table, 50);
    cache.commit(table, 50);
    const std::vector<int32_t> evicted = {5, 9, 22, 5, 9, 22, 5, 9, 22, 5, 9, 22};  // 3 slots of each (layer, KV head), not whole spans
    cache.evict(table, evicted, 3);
    ASSERT_TRUE(cache.compact(table));
    ASSERT_FALSE(table.slot_positions.empty());
    const int32_t n0 = table.num_tokens, chunk = 20;
    ASSERT_TRUE(cache.reserve(table, chunk));
    write(n0, n0 + chunk);
    cache.seal(0, table, n0 + chunk);
    const int group = c.gqa_group(), hd = c.head_dim();
    const size_t set = size_t(group) * hd, stride = 2 * set;
    std::vector<float> q(size_t(chunk) * stride), out(q.size(), NAN), own(set);
    for (auto& x : q) x = normal(rng);
    AttentionScratch scratch;
    const bool took = attend_kv_head_tile(cache, 0, table, n0 + 1, chunk, 1, group, hd, q.data() + set, stride,
                                          out.data() + set, scratch);
    EXPECT_EQ(took, !spans);
    if (!took) continue;
    for (int t = 0; t < chunk; ++t) {
      attend_kv_head(cache, 0, table, n0 + 1 + t, 1, group, hd, q.data() + size_t(t) * stride + set, own.data(),
                     scratch);
      for (size_t i = 0; i < set; ++i) ASSERT_NEAR(out[size_t(t) * stride + set + i], own[i], 1e-5f) << "token " << t;
    }
  }
}

// Layers whose queries must be rotated per key position, and tables with
// evicted slots, are left to attend_kv_head.
TEST(TileAttention, DeclinesPreRopeKeysAndEvictedSlots) {
  const ModelConfig c = head_dim_64();
  KvCacheOptions o;
  o.block_size = 16;
  o.k = {KvDType::INT2, KvGrouping::Channel, 0, {}, {}};
  o.k.pre_rope = true;
  o.v = {KvDType::INT2};
  o.num_blocks = 8;
  KvCache cache(c, o);
  BlockTable table;
  ASSERT_TRUE(cache.reserve(table, 20));
  std::vector<float> kv(size_t(c.kv_dim()), 0.5f);
  for (int pos = 0; pos < 20; ++pos) cache.write(0, table, pos, kv.data(), kv.data());
  cache.seal(0, table, 20);
  const size_t set = size_t(c.gqa_group()) * size_t(c.head_dim());
  std::vector<float> q(4 * set, 0.1f), out(q.size(), 7.0f);
  AttentionScratch scratch;
  EXPECT_FALSE(attend_kv_head_tile(cache, 0, table, 17, 4, 0, c.gqa_group(), c.head_dim(), q.data(), set,
                                   out.data(), scratch));
  for (float x : out) EXPECT_EQ(x, 7.0f);  // nothing written

  KvCacheOptions plain;
  plain.block_size = 16;
  plain.num_blocks = 8;
  KvCache dense(c, plain);
  BlockTable evicted;
  ASSERT_TRUE(dense.reserve(evicted, 20));
  for (int pos = 0; pos < 20; ++pos) dense.write(0, evicted, pos, kv.data(), kv.data());
  evicted.dead = 1;
  EXPECT_FALSE(attend_kv_head_tile(dense, 0, evicted, 17, 4, 0, c.gqa_group(), c.head_dim(), q.data(), set,
                                   out.data(), scratch));
  evicted.dead = 0;
  EXPECT_TRUE(attend_kv_head_tile(dense, 0, evicted, 17, 4, 0, c.gqa_group(), c.head_dim(), q.data(), set,
                                  out.data(), scratch));
  for (float x : out) EXPECT_NEAR(x, 0.5f, 1e-6f);  // every value is 0.5
}

}  // namespace
}  // namespace kvserve
