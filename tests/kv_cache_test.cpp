// BlockPool and KvCache: exact block ids, all-or-nothing allocation, exact
// byte accounting, and slab placement.
#include "kv/kv_cache.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "attention/paged_attention.h"
#include "kernels/vector_ops.h"
#include "kv/kv_spec.h"
#include "util/error.h"
#include "test_support.h"

namespace kvserve {
namespace {

using testing_shapes::stories_shape;

TEST(BlockPool, AllocatesInIdOrderAndReusesFreedBlocksFirst) {
  BlockPool pool(4);
  EXPECT_EQ(*pool.allocate(), 0);
  EXPECT_EQ(*pool.allocate(), 1);
  EXPECT_EQ(*pool.allocate(), 2);
  pool.release(1);
  // Freed blocks go to the head (their pages are committed): 1 comes back
  // before the never-used 3.
  EXPECT_EQ(*pool.allocate(), 1);
  EXPECT_EQ(*pool.allocate(), 3);
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
  o.set_dtype(KvDType::F32);
  EXPECT_EQ(KvCache(c, o).stats().bytes_per_token, 5 * 2 * 4 * 8 * 4);
  o.set_dtype(KvDType::F16);
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

TEST(KvCache, WritePlacesTokensInTheirBlockSlot) {
  const ModelConfig c = stories_shape();
  KvCacheOptions o;
  o.block_size = 4;
  o.num_blocks = 8;
  KvCache cache(c, o);
  BlockTable t;
  ASSERT_TRUE(cache.reserve(t, 4));  // block 0
  BlockTable u;
  ASSERT_TRUE(cache.reserve(u, 6));  // blocks 1, 2
  EXPECT_EQ(u.blocks, (std::vector<int32_t>{1, 2}));
  std::vector<float> k(static_cast<size_t>(c.kv_dim())), v(static_cast<size_t>(c.kv_dim()));
  for (int i = 0; i < c.kv_dim(); ++i) k[size_t(i)] = float(i), v[size_t(i)] = float(-i);
  cache.write(3, u, 5, k.data(), v.data());  // logical block 1 = block 2, slot 1
  std::vector<float> out(static_cast<size_t>(c.kv_dim()));
  KvBlockView kv = cache.k_view(3, u, 1, 6);
  kv.codec->decode_token(kv.data, 1, out.data());
  EXPECT_EQ(out, k);
  KvBlockView vv = cache.v_view(3, u, 1, 6);
  vv.codec->decode_token(vv.data, 1, out.data());
  EXPECT_EQ(out, v);
  // Other layers and slots stay zero.
  KvBlockView other = cache.k_view(2, u, 1, 6);
  other.codec->decode_token(other.data, 1, out.data());
  EXPECT_EQ(out, std::vector<float>(out.size(), 0.0f));
  other = cache.k_view(3, u, 1, 6);
  other.codec->decode_token(other.data, 0, out.data());
  EXPECT_EQ(out, std::vector<float>(out.size(), 0.0f));
}

// read_keys gives the keys attention scores: as written when stored after
// RoPE, rotated the rest of the way by their position when stored before it
// (exactly, or by position mod a span).
TEST(KvCache, ReadKeysReturnsKeysAfterRope) {
  ModelConfig yarn = stories_shape();  // and under RoPE scaling: the scaled angles
  yarn.rope_scaling.type = RopeScalingType::Yarn;
  yarn.rope_scaling.factor = 4.0f;
  yarn.rope_scaling.original_context = 64;
  for (const ModelConfig& c : {stories_shape(), yarn}) {
    const std::vector<float> freqs = c.rope_frequencies();
    const int head_dim = c.head_dim(), n = 10;
    std::mt19937 rng(7);
    std::normal_distribution<float> dist;
    std::vector<float> raw(size_t(n) * size_t(c.kv_dim())), after = raw, v(size_t(c.kv_dim()));
    for (float& x : raw) x = dist(rng);
    for (auto [pre_rope, span] : {std::pair{false, 1}, std::pair{true, 1}, std::pair{true, 4}}) {
      KvCacheOptions o;
      o.block_size = 4;
      o.num_blocks = 8;
      o.k.pre_rope = pre_rope;
      o.k.rope_span = span;
      KvCache cache(c, o);
      BlockTable t;
      ASSERT_TRUE(cache.reserve(t, n));
      for (int p = 0; p < n; ++p) {
        const size_t at = size_t(p) * size_t(c.kv_dim());
        std::copy(raw.begin() + long(at), raw.begin() + long(at) + c.kv_dim(), after.begin() + long(at));
        rope(after.data() + at, c.n_kv_heads, head_dim, p, freqs.data());
        std::vector<float> stored(raw.begin() + long(at), raw.begin() + long(at) + c.kv_dim());
        if (!pre_rope) stored.assign(after.begin() + long(at), after.begin() + long(at) + c.kv_dim());
        else rope(stored.data(), c.n_kv_heads, head_dim, p % span, freqs.data());
        for (int l = 0; l < c.n_layers; ++l) cache.write(l, t, p, stored.data(), v.data());
      }
      for (int l = 0; l < c.n_layers; ++l) cache.seal(l, t, n);
      cache.commit(t, n);
      std::vector<float> got(size_t(n - 3) * size_t(c.kv_dim()));
      cache.read_keys(2, t, 3, n, got.data());
      for (size_t i = 0; i < got.size(); ++i)
        ASSERT_NEAR(got[i], after[size_t(3 * c.kv_dim()) + i], pre_rope ? 1e-5f : 0.0f)
            << "pre_rope " << pre_rope << " span " << span << " value " << i;
      cache.release(t);
    }
  }
}

TEST(KvCache, ResidualWindowStagesRecentTokensAndEncodesFullBlocks) {
  const ModelConfig c = stories_shape();
  KvCacheOptions o;
  o.block_size = 4;
  o.num_blocks = 8;
  o.set_dtype(KvDType::INT8);
  o.residual = 8;  // two blocks: a full block waits for four newer tokens
  KvCache cache(c, o);
  EXPECT_EQ(cache.sealed_blocks(3), 0);
  EXPECT_EQ(cache.sealed_blocks(7), 0);
  EXPECT_EQ(cache.sealed_blocks(8), 1);
  EXPECT_EQ(cache.sealed_blocks(12), 2);
  BlockTable t;
  ASSERT_TRUE(cache.reserve(t, 9));
  EXPECT_EQ(t.staging, (std::vector<int32_t>{0, 1, 2}));
  std::vector<float> k(static_cast<size_t>(c.kv_dim())), v(k.size());
  for (int layer = 0; layer < c.n_layers; ++layer) {
    for (int pos = 0; pos < 9; ++pos) {
      for (size_t i = 0; i < k.size(); ++i) k[i] = float(pos) + 0.01f * float(i), v[i] = -k[i];
      cache.write(layer, t, pos, k.data(), v.data());
    }
    cache.seal(layer, t, 9);
  }
  cache.commit(t, 9);
  // Block 0 is encoded and its staging slot came back; blocks 1 and 2 are in FP16.
  EXPECT_EQ(t.staging, (std::vector<int32_t>{-1, 1, 2}));
  KvStats s = cache.stats();
  EXPECT_EQ(s.staging_used, 2);
  EXPECT_EQ(s.residual, 8);
  EXPECT_EQ(s.bytes_used, 3 * s.bytes_per_block + 2 * s.staging_bytes_per_block);
  // Attention for a query seeing all 9 tokens reads block 0 as INT8, block 1 as FP16.
  EXPECT_EQ(cache.k_view(0, t, 0, 9).codec->dtype(), KvDType::INT8);
  EXPECT_EQ(cache.k_view(0, t, 1, 9).codec->dtype(), KvDType::F16);
  // A query at position 5 (n_ctx 6) saw block 0 still in FP16.
  EXPECT_EQ(cache.k_view(0, t, 0, 6).codec->dtype(), KvDType::F16);
  std::vector<float> out(k.size());
  KvBlockView view = cache.k_view(4, t, 0, 9);
  view.codec->decode_token(view.data, 2, out.data());
  for (size_t i = 0; i < out.size(); ++i) EXPECT_NEAR(out[i], 2.0f + 0.01f * float(i), 0.02f);
  cache.release(t);
  EXPECT_EQ(cache.stats().staging_used, 0);
}

// Reserving a whole prompt takes staging slots only for the chunk written
// next; the next chunk's reserve takes its own.
TEST(KvCache, StagingSlotsFollowTheWriteNotTheReservation) {
  const ModelConfig c = stories_shape();
  KvCacheOptions o;
  o.block_size = 4;
  o.num_blocks = 16;
  o.set_dtype(KvDType::INT8);
  o.residual = 4;
  KvCache cache(c, o);
  BlockTable t;
  ASSERT_TRUE(cache.reserve(t, 40, 6));  // 10 blocks; the first chunk of 6 tokens lands in blocks 0-1
  EXPECT_EQ(t.blocks.size(), 10u);
  EXPECT_EQ(t.staging, (std::vector<int32_t>{0, 1, -1, -1, -1, -1, -1, -1, -1, -1}));
  std::vector<float> k(static_cast<size_t>(c.kv_dim()), 0.5f), v(k.size(), -0.5f);
  for (int layer = 0; layer < c.n_layers; ++layer) {
    for (int pos = 0; pos < 6; ++pos) cache.write(layer, t, pos, k.data(), v.data());
    cache.seal(layer, t, 6);
  }
  cache.commit(t, 6);
  EXPECT_EQ(cache.stats().staging_used, 1);  // block 0 encoded, block 1 open
  ASSERT_TRUE(cache.reserve(t, 8));          // the next chunk: tokens 6-13, blocks 1-3
  EXPECT_EQ(t.blocks.size(), 10u);
  EXPECT_EQ(cache.stats().staging_used, 3);
  EXPECT_EQ(t.staging[1], 1);
  EXPECT_GE(t.staging[2], 0);
  EXPECT_GE(t.staging[3], 0);
  EXPECT_EQ(t.staging[4], -1);
  cache.release(t);
  EXPECT_EQ(cache.stats().staging_used, 0);
}

// With a byte budget, FP16 staging slots are paid for out of it: blocks plus
// staging in use never exceed the budget, however many sequences run.
TEST(KvCache, ByteBudgetPaysForStagingSlots) {
  const ModelConfig c = stories_shape();
  KvCacheOptions o;
  o.block_size = 16;
  o.k = {KvDType::INT4, KvGrouping::Channel, 16, {}, {}};
  o.v = {KvDType::INT4, KvGrouping::Token, 8, {}, {}};
  o.residual = 32;
  const int64_t block_bytes = 5 * (384 + 512);
  o.budget_bytes = 64 * block_bytes;
  KvCache cache(c, o);
  const KvStats empty = cache.stats();
  ASSERT_EQ(empty.blocks_total, 64);
  // An FP16 staging slot (K and V, 5 layers, 16 tokens x 32 values x 2 bytes) is
  // 10,240 bytes: 2.3 INT4 blocks, so each slot in use holds 3 pool blocks.
  EXPECT_EQ(empty.staging_bytes_per_block, 5 * 2 * 16 * 32 * 2);
  EXPECT_EQ(cache.staging_cost_blocks(), 3);
  std::vector<BlockTable> tables;
  for (;;) {
    BlockTable t;
    if (!cache.reserve(t, 20)) break;  // two blocks, both written: two slots
    tables.push_back(std::move(t));
    const KvStats s = cache.stats();
    EXPECT_LE(s.bytes_used, s.bytes_capacity);
    EXPECT_EQ(s.blocks_for_staging, 3 * s.staging_used);
    EXPECT_EQ(s.blocks_used + s.blocks_for_staging + s.blocks_free, s.blocks_total);
  }
  // Each sequence costs 2 blocks + 2 slots x 3 blocks = 8 of the 64.
  EXPECT_EQ(tables.size(), 8u);
  for (auto& t : tables) cache.release(t);
  const KvStats s = cache.stats();
  EXPECT_EQ(s.blocks_free, 64);
  EXPECT_EQ(s.blocks_for_staging, 0);
  EXPECT_FALSE(cache.fits(64 * 16));  // the whole pool leaves nothing for the write's staging
  EXPECT_TRUE(cache.fits(40 * 16, 16));
  // max_tokens: the edge fits() draws. Written 16 at a time, the window (2
  // blocks), the block behind the write and the chunk's hold 4 slots of 3
  // blocks: 64 - 12 = 52 blocks of tokens. A 512-token chunk holds more.
  EXPECT_EQ(cache.max_tokens(16), 52 * 16);
  EXPECT_TRUE(cache.fits(cache.max_tokens(16), 16));
  EXPECT_FALSE(cache.fits(cache.max_tokens(16) + 1, 16));
  EXPECT_FALSE(cache.fits(cache.max_tokens(512) + 1, 512));
  EXPECT_LT(cache.max_tokens(512), cache.max_tokens(16));
  // A capacity in blocks counts encoded blocks only.
  o.budget_bytes = 0;
  o.num_blocks = 64;
  EXPECT_EQ(KvCache(c, o).staging_cost_blocks(), 0);
  EXPECT_EQ(KvCache(c, o).max_tokens(512), 64 * 16);
}

TEST(KvCache, QuantizedBytesPerTokenIncludeMetadata) {
  ModelConfig c = stories_shape();  // kv_dim 32, head_dim 8, 5 layers
  KvCacheOptions o;
  o.block_size = 16;
  o.k = {KvDType::INT4, KvGrouping::Channel, 16, {}, {}};
  o.v = {KvDType::INT4, KvGrouping::Token, 8, {}, {}};
  KvCache cache(c, o);
  // K: 16 tokens x 32 codes x 4 bits = 256 bytes + 32 channels x 4 bytes = 384 per block.
  // V: per token 16 bytes of codes + 4 groups x 4 bytes = 32 bytes -> 512 per block.
  EXPECT_EQ(cache.stats().bytes_per_block, 5 * (384 + 512));
  EXPECT_EQ(cache.stats().bytes_per_token, 5 * (384 + 512) / 16);
}

TEST(KvCache, RejectsInvalidCodecCombinations) {
  const ModelConfig c = stories_shape();
  KvCacheOptions o;
  o.k = {KvDType::INT4, KvGrouping::Channel, 32, {}, {}};  // group larger than the block
  EXPECT_THROW(KvCache(c, o), Error);
  o.k = {KvDType::INT4, KvGrouping::Channel, 16, {}, {}};
  o.residual = 0;  // channel groups need the window
  EXPECT_THROW(KvCache(c, o), Error);
  o.residual = 10;  // not a multiple of the block
  EXPECT_THROW(KvCache(c, o), Error);
  o = KvCacheOptions{};
  o.k = {KvDType::INT4, KvGrouping::Token, 3, {}, {}};
  EXPECT_THROW(KvCache(c, o), Error);
}

// --- Block export and import (the tiered KV store, issue 7) ---

// Writes n tokens of seeded random K/V into every layer of `table`, seals and
// commits them, as the forward pass does. Positions below `garbage_before`
// get other values (from another seed).
void fill_tokens(KvCache& cache, const ModelConfig& c, BlockTable& table, int n, uint32_t seed,
                 int garbage_before = 0) {
  ASSERT_TRUE(cache.reserve(table, n));
  std::mt19937 rng(seed), other(seed + 1000);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> k(size_t(c.kv_dim())), v(k.size());
  for (int layer = 0; layer < c.n_layers; ++layer) {
    for (int pos = 0; pos < n; ++pos) {
      for (auto& x : k) x = normal(rng);
      for (auto& x : v) x = normal(rng);
      if (pos < garbage_before) {
        for (auto& x : k) x = normal(other) * 3.0f;
        for (auto& x : v) x = normal(other) * 3.0f;
      }
      cache.write(layer, table, pos, k.data(), v.data());
    }
    cache.seal(layer, table, n);
  }
  cache.commit(table, n);
}

// Attention outputs of every layer and KV head for a query seeing n_ctx tokens.
std::vector<float> attention_outputs(const KvCache& cache, const ModelConfig& c, const BlockTable& table, int n_ctx) {
  std::mt19937 rng(99);
  std::normal_distribution<float> normal(0.0f, 0.3f);
  const int group = c.gqa_group(), head_dim = c.head_dim();
  std::vector<float> q(size_t(group * head_dim)), out(q.size()), all;
  AttentionScratch scratch;
  for (int layer = 0; layer < c.n_layers; ++layer)
    for (int h = 0; h < c.n_kv_heads; ++h) {
      for (auto& x : q) x = normal(rng);
      attend_kv_head(cache, layer, table, n_ctx, h, group, head_dim, q.data(), out.data(), scratch);
      all.insert(all.end(), out.begin(), out.end());
    }
  return all;
}

TEST(KvCacheBlockExport, ImportedSealedBlocksGiveIdenticalAttention) {
  const ModelConfig c = stories_shape();
  for (const std::string preset : {"fp16", "int8", "int4", "int2"}) {
    KvCacheOptions o;
    o.block_size = 16;
    o.num_blocks = 12;
    apply_kv_preset(o, preset, /*keep_block_size=*/true);
    KvCache a(c, o), b(c, o);
    EXPECT_EQ(a.block_record_bytes(), size_t(a.stats().bytes_per_block));
    EXPECT_EQ(a.block_codec_hash(), b.block_codec_hash());
    const int n = 80;
    BlockTable ta;
    fill_tokens(a, c, ta, n, 7);
    const int32_t sealed = a.sealed_blocks(n);
    ASSERT_GE(sealed, 3) << preset;

    // B holds other values in the sealed blocks, at other block ids.
    BlockTable pad, tb;
    ASSERT_TRUE(b.reserve(pad, 3 * 16));
    fill_tokens(b, c, tb, n, 7, sealed * 16);
    ASSERT_NE(tb.blocks, ta.blocks);
    EXPECT_NE(attention_outputs(b, c, tb, n), attention_outputs(a, c, ta, n)) << preset;

    std::vector<uint8_t> bytes;
    for (int32_t i = 0; i < sealed; ++i) {
      a.export_block(ta.blocks[size_t(i)], bytes);
      ASSERT_EQ(bytes.size(), a.block_record_bytes());
      b.import_block(tb.blocks[size_t(i)], bytes);
    }
    EXPECT_EQ(attention_outputs(b, c, tb, n), attention_outputs(a, c, ta, n)) << preset;
    std::vector<uint8_t> again;
    b.export_block(tb.blocks[0], again);
    a.export_block(ta.blocks[0], bytes);
    EXPECT_EQ(again, bytes);
  }
}

TEST(KvCacheBlockExport, CodecHashSeparatesLayoutsAndImportChecksTheSize) {
  const ModelConfig c = stories_shape();
  auto cache_with = [&](const std::string& preset, int block_size) {
    KvCacheOptions o;
    o.block_size = block_size;
    o.num_blocks = 4;
    apply_kv_preset(o, preset, /*keep_block_size=*/true);
    return std::make_unique<KvCache>(c, o);
  };
  const auto int4 = cache_with("int4", 16), int8 = cache_with("int8", 16), int4_bs8 = cache_with("int4", 8);
  EXPECT_NE(int4->block_codec_hash(), int8->block_codec_hash());
  EXPECT_NE(int4->block_codec_hash(), int4_bs8->block_codec_hash());
  EXPECT_EQ(int4->block_codec_hash(), cache_with("int4", 16)->block_codec_hash());

  // Same types, different static ranges: the codes mean different values.
  KvCacheOptions s1;
  s1.block_size = 16;
  s1.num_blocks = 4;
  s1.residual = 16;
  s1.set_dtype(KvDType::INT8);
  s1.k.static_min.assign(size_t(c.kv_dim()), -1.0f);
  s1.k.static_max.assign(size_t(c.kv_dim()), 1.0f);
  KvCacheOptions s2 = s1;
  s2.k.static_max[3] = 2.0f;
  EXPECT_NE(KvCache(c, s1).block_codec_hash(), KvCache(c, s2).block_codec_hash());

  std::vector<uint8_t> bytes;
  int8->export_block(0, bytes);
  ASSERT_NE(bytes.size(), int4->block_record_bytes());
  EXPECT_THROW(int4->import_block(0, bytes), Error);
}

}  // namespace
}  // namespace kvserve
