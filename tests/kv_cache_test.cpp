// BlockPool and KvCache: exact block ids, all-or-nothing allocation, exact
// byte accounting, and slab placement.
#include "kv/kv_cache.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "util/error.h"

namespace kvserve {
namespace {

ModelConfig stories_shape() {
  ModelConfig c;
  c.dim = 64;
  c.hidden_dim = 172;
  c.n_layers = 5;
  c.n_heads = 8;
  c.n_kv_heads = 4;
  c.vocab_size = 512;
  c.seq_len = 512;
  return c;
}

TEST(BlockPool, AllocatesInIdOrderAndReusesFreedBlocksLast) {
  BlockPool pool(4);
  EXPECT_EQ(*pool.allocate(), 0);
  EXPECT_EQ(*pool.allocate(), 1);
  EXPECT_EQ(*pool.allocate(), 2);
  pool.release(1);
  // Freed blocks go to the tail: 3 is handed out before 1 comes back.
  EXPECT_EQ(*pool.allocate(), 3);
  EXPECT_EQ(*pool.allocate(), 1);
  EXPECT_FALSE(pool.allocate().has_value());
  EXPECT_EQ(pool.num_free(), 0);
}

TEST(BlockPool, BatchAllocationIsAllOrNothing) {
  BlockPool pool(5);
  std::vector<int32_t> got;
  ASSERT_TRUE(pool.allocate(3, got));
  EXPECT_EQ(got, (std::vector<int32_t>{0, 1, 2}));
  EXPECT_FALSE(pool.allocate(3, got));
  EXPECT_EQ(got.size(), 3u);
  EXPECT_EQ(pool.num_free(), 2);
}

TEST(BlockPool, SharedBlockReturnsOnlyAfterLastRelease) {
  BlockPool pool(2);
  int32_t b = *pool.allocate();
  pool.retain(b);
  EXPECT_EQ(pool.ref_count(b), 2);
  pool.release(b);
  EXPECT_EQ(pool.num_free(), 1);
  pool.release(b);
  EXPECT_EQ(pool.num_free(), 2);
}

TEST(BlockPool, RejectsEmptyPool) { EXPECT_THROW(BlockPool(0), Error); }

TEST(KvCache, BytesPerTokenIsExact) {
  const ModelConfig c = stories_shape();
  // 5 layers x (K + V) x 4 KV heads x 8 dims.
  KvCacheOptions o;
  o.dtype = KvDType::F32;
  EXPECT_EQ(KvCache(c, o).stats().bytes_per_token, 5 * 2 * 4 * 8 * 4);
  o.dtype = KvDType::F16;
  EXPECT_EQ(KvCache(c, o).stats().bytes_per_token, 5 * 2 * 4 * 8 * 2);
}

TEST(KvCache, DefaultCapacityIsOneFullContext) {
  KvCacheOptions o;
  o.block_size = 16;
  KvCache cache(stories_shape(), o);
  EXPECT_EQ(cache.stats().blocks_total, 512 / 16);
}

TEST(KvCache, ByteBudgetRoundsDownToWholeBlocks) {
  KvCacheOptions o;
  o.block_size = 16;
  o.budget_bytes = 1280 * 16 * 10 + 100;  // ten fp32 blocks and change
  KvCache cache(stories_shape(), o);
  EXPECT_EQ(cache.stats().blocks_total, 10);
  o.budget_bytes = 1000;
  EXPECT_THROW(KvCache(stories_shape(), o), Error);
}

TEST(KvCache, RejectsBadBlockSize) {
  KvCacheOptions o;
  o.block_size = 0;
  EXPECT_THROW(KvCache(stories_shape(), o), Error);
  o.block_size = -4;
  EXPECT_THROW(KvCache(stories_shape(), o), Error);
}

TEST(KvCache, ReserveAllocatesBlocksAsTokensArriveAndAccountsFragmentation) {
  KvCacheOptions o;
  o.block_size = 16;
  o.num_blocks = 4;
  KvCache cache(stories_shape(), o);
  BlockTable a;
  ASSERT_TRUE(cache.reserve(a, 17));
  EXPECT_EQ(a.blocks, (std::vector<int32_t>{0, 1}));
  cache.commit(a, 17);
  KvStats s = cache.stats();
  EXPECT_EQ(s.blocks_used, 2);
  EXPECT_EQ(s.tokens_stored, 17);
  EXPECT_EQ(s.bytes_used, 2 * 16 * 1280);
  EXPECT_DOUBLE_EQ(s.fragmentation, 15.0 / 32.0);

  // Filling the second block needs no new block; the 33rd token does.
  ASSERT_TRUE(cache.reserve(a, 15));
  EXPECT_EQ(a.blocks.size(), 2u);
  cache.commit(a, 15);
  ASSERT_TRUE(cache.reserve(a, 1));
  EXPECT_EQ(a.blocks, (std::vector<int32_t>{0, 1, 2}));
  cache.commit(a, 1);

  // Out of blocks is a result, and leaves the table untouched.
  BlockTable b;
  EXPECT_FALSE(cache.reserve(b, 17));
  EXPECT_TRUE(b.blocks.empty());
  ASSERT_TRUE(cache.reserve(b, 16));
  EXPECT_EQ(b.blocks, (std::vector<int32_t>{3}));

  cache.release(a);
  EXPECT_TRUE(a.blocks.empty());
  EXPECT_EQ(a.num_tokens, 0);
  s = cache.stats();
  EXPECT_EQ(s.blocks_free, 3);
  EXPECT_EQ(s.tokens_stored, 0);
}

TEST(KvCache, WritePlacesEachHeadInItsSlabSlot) {
  const ModelConfig c = stories_shape();
  KvCacheOptions o;
  o.block_size = 4;
  o.num_blocks = 8;
  KvCache cache(c, o);
  BlockTable t;
  ASSERT_TRUE(cache.reserve(t, 4));  // block 0
  BlockTable u;
  ASSERT_TRUE(cache.reserve(u, 6));  // blocks 1, 2
  std::vector<float> k(static_cast<size_t>(c.kv_dim())), v(static_cast<size_t>(c.kv_dim()));
  for (int i = 0; i < c.kv_dim(); ++i) k[size_t(i)] = float(i), v[size_t(i)] = float(-i);
  cache.write(3, u, 5, k.data(), v.data());  // block 2, slot 1
  std::vector<float> out(8);
  for (int h = 0; h < c.n_kv_heads; ++h) {
    cache.k_codec(3).decode(cache.k_slab(3, u.blocks[1], h), 1, out.data(), 8);
    for (int d = 0; d < 8; ++d) EXPECT_EQ(out[size_t(d)], float(h * 8 + d));
    cache.v_codec(3).decode(cache.v_slab(3, u.blocks[1], h), 1, out.data(), 8);
    for (int d = 0; d < 8; ++d) EXPECT_EQ(out[size_t(d)], float(-(h * 8 + d)));
    // Other layers and slots stay zero.
    cache.k_codec(2).decode(cache.k_slab(2, u.blocks[1], h), 1, out.data(), 8);
    for (int d = 0; d < 8; ++d) EXPECT_EQ(out[size_t(d)], 0.0f);
  }
}

TEST(KvCodec, Fp16RoundTripWithinHalfPrecision) {
  const KvCodec& codec = kv_codec(KvDType::F16);
  std::mt19937 rng(3);
  std::normal_distribution<float> n(0.0f, 3.0f);
  std::vector<uint8_t> slab(codec.slab_bytes(16, 64));
  std::vector<float> x(64), y(64);
  for (int slot = 0; slot < 16; ++slot) {
    for (auto& v : x) v = n(rng);
    codec.encode(slab.data(), slot, x.data(), 64);
    codec.decode(slab.data(), slot, y.data(), 64);
    // fp16 has an 11-bit significand: relative error <= 2^-11.
    for (int d = 0; d < 64; ++d) EXPECT_LE(std::fabs(y[size_t(d)] - x[size_t(d)]), std::fabs(x[size_t(d)]) * 4.9e-4f);
  }
}

TEST(KvCodec, ScoreAndAccumulateMatchReference) {
  std::mt19937 rng(5);
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (KvDType dt : {KvDType::F32, KvDType::F16}) {
    const KvCodec& codec = kv_codec(dt);
    for (int head_dim : {8, 64, 72}) {
      const int bs = 16, n_q = 3, count = 13, stride = 20;
      std::vector<uint8_t> slab(codec.slab_bytes(bs, head_dim));
      std::vector<float> x(static_cast<size_t>(head_dim));
      for (int t = 0; t < bs; ++t) {
        for (auto& v : x) v = n(rng);
        codec.encode(slab.data(), t, x.data(), head_dim);
      }
      std::vector<float> q(static_cast<size_t>(n_q * head_dim));
      for (auto& v : q) v = n(rng);
      std::vector<float> s1(static_cast<size_t>(n_q * stride)), s2(static_cast<size_t>(n_q * stride));
      codec.score(q.data(), n_q, slab.data(), count, head_dim, 0.125f, s1.data(), stride);
      score_reference(codec, q.data(), n_q, slab.data(), count, head_dim, 0.125f, s2.data(), stride);
      for (int i = 0; i < n_q; ++i)
        for (int t = 0; t < count; ++t) EXPECT_NEAR(s1[size_t(i * stride + t)], s2[size_t(i * stride + t)], 1e-4);
      std::vector<float> o1(static_cast<size_t>(n_q * head_dim), 0.5f), o2(o1);
      codec.accumulate(s1.data(), n_q, stride, slab.data(), count, head_dim, o1.data());
      accumulate_reference(codec, s1.data(), n_q, stride, slab.data(), count, head_dim, o2.data());
      for (size_t i = 0; i < o1.size(); ++i) EXPECT_NEAR(o1[i], o2[i], 1e-4);
    }
  }
}

TEST(KvCodec, ParsesDtypeNames) {
  EXPECT_EQ(parse_kv_dtype("fp32"), KvDType::F32);
  EXPECT_EQ(parse_kv_dtype("fp16"), KvDType::F16);
  EXPECT_THROW(parse_kv_dtype("int3"), Error);
}

}  // namespace
}  // namespace kvserve
