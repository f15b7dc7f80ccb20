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
// each codec pair and block size.
void expect_tiles_equal_own_passes(const ModelConfig& c) {
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
              ASSERT_NEAR(got, own[i], 1e-5f) << kc.describe() << "+" << vc.describe() << " bs " << bs
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
