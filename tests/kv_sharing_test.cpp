// KvCache's sharing primitives: fork, copy-on-write in reserve, attaching a
// cached prefix, reference-counted staging slots, tail-first release.
// Exact block ids, reference counts and bytes.
#include <gtest/gtest.h>

#include <vector>

#include "kv/kv_cache.h"
#include "kv/kv_spec.h"
#include "test_support.h"

namespace kvserve {
namespace {

using testing_shapes::stories_shape;

KvCacheOptions fp32_options(int32_t num_blocks) {
  KvCacheOptions o;
  o.block_size = 4;
  o.num_blocks = num_blocks;
  o.set_dtype(KvDType::F32);
  return o;
}

// Writes token values v(pos) = pos * 100 + layer (K) and its negation (V) in
// every layer, then commits: what a forward pass would leave.
void fill(KvCache& cache, BlockTable& t, int32_t n, float offset = 0.0f) {
  ASSERT_TRUE(cache.reserve(t, n));
  const int kv_dim = 32;
  std::vector<float> k(kv_dim), v(kv_dim);
  for (int32_t pos = t.num_tokens; pos < t.num_tokens + n; ++pos)
    for (int l = 0; l < cache.n_layers(); ++l) {
      for (int i = 0; i < kv_dim; ++i) k[size_t(i)] = offset + float(pos * 100 + l), v[size_t(i)] = -k[size_t(i)];
      cache.write(l, t, pos, k.data(), v.data());
    }
  for (int l = 0; l < cache.n_layers(); ++l) cache.seal(l, t, t.num_tokens + n);
  cache.commit(t, n);
}

float key_at(const KvCache& cache, const BlockTable& t, int layer, int32_t pos) {
  const KvBlockView view = cache.k_view(layer, t, pos / cache.block_size(), t.num_tokens);
  std::vector<float> out(32);
  view.codec->decode_token(view.data, pos % cache.block_size(), out.data());
  return out[0];
}

TEST(KvSharing, ForkSharesBlocksAndCopyOnWriteSplitsThePartialBlock) {
  KvCache cache(stories_shape(2), fp32_options(8));
  BlockTable a;
  fill(cache, a, 6);  // blocks 0 (full), 1 (2 of 4 tokens)
  ASSERT_EQ(a.blocks, (std::vector<int32_t>{0, 1}));
  BlockTable b;
  ASSERT_TRUE(cache.fork(a, b));
  EXPECT_EQ(b.blocks, (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(b.num_tokens, 6);
  EXPECT_EQ(cache.pool().ref_count(0), 2);
  EXPECT_EQ(cache.pool().ref_count(1), 2);
  EXPECT_EQ(cache.stats().blocks_used, 2);

  // b writes next: its partial block is shared, so b gets a copy (block 2).
  fill(cache, b, 1, 0.5f);
  EXPECT_EQ(b.blocks, (std::vector<int32_t>{0, 2}));
  EXPECT_EQ(cache.pool().ref_count(1), 1);
  EXPECT_EQ(cache.pool().ref_count(2), 1);
  // a's block no longer shared: it writes in place.
  fill(cache, a, 3, 0.25f);
  EXPECT_EQ(a.blocks, (std::vector<int32_t>{0, 1, 3}));
  // The copy kept the shared tokens; each sequence sees its own continuation.
  for (int l = 0; l < 2; ++l) {
    EXPECT_EQ(key_at(cache, b, l, 5), float(500 + l));
    EXPECT_EQ(key_at(cache, a, l, 5), float(500 + l));
    EXPECT_EQ(key_at(cache, b, l, 6), 0.5f + float(600 + l));
    EXPECT_EQ(key_at(cache, a, l, 6), 0.25f + float(600 + l));
  }
  cache.release(a);
  EXPECT_EQ(cache.pool().ref_count(0), 1);
  cache.release(b);
  EXPECT_EQ(cache.stats().blocks_free, 8);
  EXPECT_EQ(cache.stats().tokens_stored, 0);
}

TEST(KvSharing, CopyOnWriteFailsWithoutChangingAnythingWhenNoBlockIsFree) {
  KvCache cache(stories_shape(2), fp32_options(2));
  BlockTable a, b;
  fill(cache, a, 6);
  ASSERT_TRUE(cache.fork(a, b));
  EXPECT_FALSE(cache.reserve(b, 1));  // the copy needs a third block
  EXPECT_EQ(b.blocks, (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(cache.pool().ref_count(1), 2);
  EXPECT_EQ(b.num_tokens, 6);
  cache.release(a);
  EXPECT_TRUE(cache.reserve(b, 1));  // no longer shared: written in place
  EXPECT_EQ(b.blocks, (std::vector<int32_t>{0, 1}));
  cache.release(b);
}

TEST(KvSharing, ForkDoesNotShareBlocksReservedBeyondTheTokens) {
  KvCache cache(stories_shape(2), fp32_options(8));
  BlockTable a, b;
  fill(cache, a, 4);
  ASSERT_TRUE(cache.reserve(a, 4));  // block 1 reserved, nothing written yet
  ASSERT_EQ(a.blocks, (std::vector<int32_t>{0, 1}));
  ASSERT_TRUE(cache.fork(a, b));
  EXPECT_EQ(b.blocks, (std::vector<int32_t>{0}));
  EXPECT_EQ(cache.pool().ref_count(1), 1);
  ASSERT_TRUE(cache.reserve(b, 1));  // a full shared block is never written: a new block
  EXPECT_EQ(b.blocks, (std::vector<int32_t>{0, 2}));
  cache.release(a);
  cache.release(b);
}

TEST(KvSharing, ReleaseReturnsBlocksTailFirst) {
  KvCache cache(stories_shape(2), fp32_options(4));
  BlockTable a;
  fill(cache, a, 12);
  ASSERT_EQ(a.blocks, (std::vector<int32_t>{0, 1, 2}));
  cache.release(a);
  // Released tail first, each to the head of the free queue: 0, 1, 2, then
  // the never-used 3 (head first would have left 2, 1, 0, 3).
  BlockTable b;
  ASSERT_TRUE(cache.reserve(b, 16));
  EXPECT_EQ(b.blocks, (std::vector<int32_t>{0, 1, 2, 3}));
  cache.release(b);
}

// The int4 preset: residual window of two blocks, so one full block stays in
// FP16 staging behind the open one.
KvCacheOptions int4_options(int32_t num_blocks) {
  KvCacheOptions o;
  o.block_size = 4;
  o.num_blocks = num_blocks;
  apply_kv_preset(o, "int4", /*keep_block_size=*/true);
  return o;
}

TEST(KvSharing, ForkSharesFullStagingAndCopiesTheOpenBlocksSlot) {
  KvCache cache(stories_shape(2), int4_options(8));
  ASSERT_EQ(cache.residual(), 8);
  EXPECT_EQ(cache.staged_before(3), 1);
  BlockTable a;
  fill(cache, a, 10);  // blocks 0 (sealed), 1 (full, in staging), 2 (open)
  ASSERT_EQ(a.staging, (std::vector<int32_t>{-1, 1, 2}));
  EXPECT_FALSE(cache.block_final(a, 1));
  EXPECT_TRUE(cache.block_final(a, 0));
  BlockTable b;
  ASSERT_TRUE(cache.fork(a, b));
  // Block 1's staging is shared; block 2's is copied into the free slot used
  // last (0, which block 0 returned when it was sealed).
  EXPECT_EQ(b.staging, (std::vector<int32_t>{-1, 1, 0}));
  EXPECT_EQ(cache.stats().staging_used, 3);
  for (int l = 0; l < 2; ++l) {
    EXPECT_EQ(key_at(cache, b, l, 9), key_at(cache, a, l, 9));
    EXPECT_EQ(key_at(cache, b, l, 5), float(500 + l));  // FP16 staging: exact for these values
  }
  // a seals block 1 as it moves on; b later skips it (already encoded) and
  // reads the same bytes.
  fill(cache, a, 3, 0.25f);
  EXPECT_TRUE(cache.block_final(a, 1));
  EXPECT_TRUE(cache.block_final(b, 1));
  EXPECT_EQ(a.blocks, (std::vector<int32_t>{0, 1, 3, 4}));  // block 2 copied on write to 3
  EXPECT_EQ(a.staging, (std::vector<int32_t>{-1, -1, 2, 3}));
  EXPECT_EQ(cache.stats().staging_used, 4);  // a: 2, 3; b: 1 (still in its window), 0
  fill(cache, b, 3, 0.5f);
  for (int l = 0; l < 2; ++l) EXPECT_EQ(key_at(cache, a, l, 5), key_at(cache, b, l, 5));
  cache.release(a);
  cache.release(b);
  EXPECT_EQ(cache.stats().staging_used, 0);
  EXPECT_EQ(cache.stats().blocks_free, 8);
}

TEST(KvSharing, AttachPrefixSharesFinalBlocksAndStagingSlots) {
  KvCache cache(stories_shape(2), int4_options(8));
  BlockTable a;
  fill(cache, a, 10);
  cache.seal_full_blocks(a);  // block 1 encoded now, keeps its staging slot
  EXPECT_TRUE(cache.block_final(a, 1));
  EXPECT_FALSE(cache.block_final(a, 2));
  cache.retain_staging(a.staging[1]);  // as the prefix cache keeps a sidecar
  const std::vector<int32_t> blocks = {a.blocks[0], a.blocks[1]};
  const std::vector<int32_t> staging = {-1, a.staging[1]};
  BlockTable b;
  cache.attach_prefix(b, blocks, staging);
  EXPECT_EQ(b.num_tokens, 8);
  EXPECT_EQ(b.blocks, blocks);
  EXPECT_EQ(b.staging, staging);
  EXPECT_EQ(cache.pool().ref_count(a.blocks[1]), 2);
  const int32_t slot = a.staging[1];
  cache.release(a);
  fill(cache, b, 5, 0.5f);  // seals nothing shared again, drops its staging reference
  EXPECT_EQ(b.staging[1], -1);
  for (int l = 0; l < 2; ++l) EXPECT_EQ(key_at(cache, b, l, 5), float(500 + l));
  cache.release(b);
  EXPECT_EQ(cache.stats().staging_used, 1);  // the sidecar reference
  cache.release_staging(slot);
  EXPECT_EQ(cache.stats().staging_used, 0);
}

}  // namespace
}  // namespace kvserve
