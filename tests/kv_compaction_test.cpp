// Eviction and compaction in the KV cache (issue 4): kept tokens survive
// compaction exactly (byte moves) or within the stated bound (re-encoded
// channel groups), attention over the compacted table equals a reference
// over the kept tokens of an untouched copy, blocks and staging slots return
// to the pool exactly, positions follow the tokens, and shared blocks are
// copied, never written.
#include "kv/kv_cache.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "attention/paged_attention.h"
#include "attention_test_support.h"
#include "test_support.h"
#include "util/error.h"

namespace kvserve {
namespace {

// 2 layers, 2 KV heads of 8 dims, GQA group 2.
ModelConfig small_model() {
  ModelConfig c;
  c.dim = 32;
  c.hidden_dim = 64;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.vocab_size = 16;
  c.seq_len = 128;
  return c;
}

// Appends n tokens of random K/V one at a time, as decode does (write every
// layer, seal, commit).
void append_tokens(KvCache& cache, BlockTable& table, const ModelConfig& c, int n, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> k(static_cast<size_t>(c.kv_dim())), v(k.size());
  for (int i = 0; i < n; ++i) {
    ASSERT_TRUE(cache.reserve(table, 1));
    for (int layer = 0; layer < c.n_layers; ++layer) {
      for (auto& x : k) x = normal(rng);
      for (auto& x : v) x = normal(rng);
      cache.write(layer, table, table.num_tokens, k.data(), v.data());
      cache.seal(layer, table, table.num_tokens + 1);
    }
    cache.commit(table, 1);
  }
}

// One layer's K (or V) of the token in `slot`, decoded: (kv_dim) floats.
std::vector<float> decoded(const KvCache& cache, const BlockTable& t, int layer, int32_t slot, bool key) {
  const int32_t bs = cache.block_size();
  const KvBlockView view = key ? cache.k_view(layer, t, slot / bs, t.num_tokens)
                               : cache.v_view(layer, t, slot / bs, t.num_tokens);
  std::vector<float> out(static_cast<size_t>(view.codec->shape().kv_dim()));
  view.codec->decode_token(view.data, slot % bs, out.data());
  return out;
}

// The evictions used below: per (layer, KV head) row r, four different slots,
// all before slot 24 so that no token crosses the FP16 residual boundary.
std::vector<int32_t> scattered_evictions(int rows) {
  std::vector<int32_t> slots;
  for (int r = 0; r < rows; ++r)
    for (int32_t s : {r, 6 + 2 * r, 13, 18 + r}) slots.push_back(s);
  return slots;
}

// Attention over positions `kept` of the untouched cache, in double: the
// reference a compacted cache must reproduce.
std::vector<float> reference_over(const KvCache& full, const BlockTable& t, int layer, int kv_head,
                                  const std::vector<int32_t>& kept, const std::vector<float>& q, int group,
                                  int head_dim) {
  std::vector<float> out(q.size());
  for (int i = 0; i < group; ++i) {
    std::vector<double> s;
    double max_s = -INFINITY;
    for (int32_t p : kept) {
      const std::vector<float> k = decoded(full, t, layer, p, true);
      double dot = 0;
      for (int d = 0; d < head_dim; ++d) dot += double(q[size_t(i * head_dim + d)]) * k[size_t(kv_head * head_dim + d)];
      s.push_back(dot / std::sqrt(double(head_dim)));
      max_s = std::max(max_s, s.back());
    }
    double sum = 0;
    for (double& x : s) sum += (x = std::exp(x - max_s));
    for (int d = 0; d < head_dim; ++d) {
      double acc = 0;
      for (size_t j = 0; j < kept.size(); ++j) acc += s[j] / sum * decoded(full, t, layer, kept[j], false)[size_t(kv_head * head_dim + d)];
      out[size_t(i * head_dim + d)] = float(acc);
    }
  }
  return out;
}

struct CodecCase {
  const char* name;
  KvCodecConfig k, v;
  int32_t residual;
  bool keys_reencoded;  // channel-grouped keys: blocks that change are re-encoded (else bytes move exactly)
  float attention_tolerance;
};
void PrintTo(const CodecCase& c, std::ostream* os) { *os << c.name; }

class Compaction : public ::testing::TestWithParam<CodecCase> {};

TEST_P(Compaction, KeptTokensAndAttentionSurvive) {
  const CodecCase& cc = GetParam();
  const ModelConfig c = small_model();
  KvCacheOptions o;
  o.block_size = 4;
  o.num_blocks = 12;
  o.k = cc.k;
  o.v = cc.v;
  o.residual = cc.residual;
  KvCache cache(c, o), full(c, o);
  BlockTable t, f;
  std::mt19937 rng_a(5), rng_b(5);
  append_tokens(cache, t, c, 30, rng_a);
  append_tokens(full, f, c, 30, rng_b);  // the same tokens, never evicted
  const int rows = c.n_layers * c.n_kv_heads;
  const std::vector<int32_t> evict = scattered_evictions(rows);
  cache.evict(t, evict, 4);
  ASSERT_TRUE(cache.compact(t));
  ASSERT_EQ(t.num_tokens, 26);
  EXPECT_EQ(t.dead, 0);

  const int head_dim = c.head_dim(), group = c.gqa_group();
  std::normal_distribution<float> normal(0.0f, 0.5f);
  std::vector<float> q(static_cast<size_t>(group * head_dim));
  for (auto& x : q) x = normal(rng_a);
  AttentionScratch scratch;
  for (int layer = 0; layer < c.n_layers; ++layer) {
    for (int h = 0; h < c.n_kv_heads; ++h) {
      const int row = layer * c.n_kv_heads + h;
      std::vector<int32_t> kept;  // positions this row keeps, in order
      for (int32_t p = 0; p < 30; ++p)
        if (std::find(evict.begin() + 4 * row, evict.begin() + 4 * row + 4, p) == evict.begin() + 4 * row + 4)
          kept.push_back(p);
      ASSERT_EQ(kept.size(), 26u);
      for (int32_t s = 0; s < 26; ++s) {
        ASSERT_EQ(cache.slot_position(t, layer, h, s), kept[size_t(s)]);
        const std::vector<float> k_now = decoded(cache, t, layer, s, true), k_was = decoded(full, f, layer, kept[size_t(s)], true);
        const std::vector<float> v_now = decoded(cache, t, layer, s, false), v_was = decoded(full, f, layer, kept[size_t(s)], false);
        for (int d = 0; d < head_dim; ++d) {
          const size_t e = size_t(h * head_dim + d);
          EXPECT_EQ(v_now[e], v_was[e]) << cc.name << " value of layer " << layer << " head " << h << " slot " << s;
          if (!cc.keys_reencoded || s >= 24) {  // slots 24.. stay in FP16 staging: moved exactly
            EXPECT_EQ(k_now[e], k_was[e]) << cc.name << " key, slot " << s;
            continue;
          }
          // Re-encoded: within half a step of the new block's grid, fitted to
          // the values it was given (4-bit codes: 15 steps), plus fp16 rounding.
          float lo = INFINITY, hi = -INFINITY;
          for (int32_t u = s / 4 * 4; u < s / 4 * 4 + 4; ++u) {
            const float x = decoded(full, f, layer, kept[size_t(u)], true)[e];
            lo = std::min(lo, x), hi = std::max(hi, x);
          }
          EXPECT_LE(std::fabs(k_now[e] - k_was[e]), (hi - lo) / 15 / 2 * 1.01f + 1e-3f) << cc.name << " key, slot " << s;
        }
      }
      std::vector<float> out(q.size()), ref_kept(q.size()), ref_now(q.size());
      attend_kv_head(cache, layer, t, t.num_tokens, h, group, head_dim, q.data(), out.data(), scratch);
      attend_kv_head_reference(cache, layer, t, t.num_tokens, h, group, head_dim, q.data(), ref_now.data());
      ref_kept = reference_over(full, f, layer, h, kept, q, group, head_dim);
      // Channel-grouped keys are scored with the query rounded to 16 bits
      // (logits within ~1e-4, outputs within 1e-4), or to 8 bits (channel_codec.cpp).
      const double now_tolerance =
          (cc.keys_reencoded ? 1e-4 : 2e-5) +
          testing_attention::rounding_allowance(cache, layer, t, t.num_tokens, h, group, head_dim, q.data());
      for (size_t i = 0; i < out.size(); ++i) {
        EXPECT_NEAR(out[i], ref_now[i], now_tolerance) << cc.name;
        EXPECT_NEAR(out[i], ref_kept[i], cc.attention_tolerance) << cc.name << " layer " << layer << " head " << h;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Codecs, Compaction,
    ::testing::Values(
        CodecCase{"fp32", {KvDType::F32}, {KvDType::F32}, 0, false, 2e-5f},
        CodecCase{"fp16", {KvDType::F16}, {KvDType::F16}, 0, false, 2e-5f},
        CodecCase{"int8-token", {KvDType::INT8}, {KvDType::INT8}, 0, false, 2e-5f},
        CodecCase{"int8-token+residual", {KvDType::INT8}, {KvDType::INT8}, 4, false, 2e-5f},
        // Channel-grouped keys: re-encoded blocks round once more (bounded
        // above); values (token groups) move exactly. The attention output
        // then differs from the untouched cache's by that rounding.
        CodecCase{"int4-channel",
                  {KvDType::INT4, KvGrouping::Channel, 0, {}, {}},
                  {KvDType::INT4, KvGrouping::Token, 0, {}, {}},
                  4,
                  true,
                  0.05f}),
    [](const ::testing::TestParamInfo<CodecCase>& info) {
      std::string n = info.param.name;
      std::replace(n.begin(), n.end(), '-', '_');
      std::replace(n.begin(), n.end(), '+', '_');
      return n;
    });

TEST(Compaction, ReturnsEmptiedBlocksAndStagingSlotsExactly) {
  const ModelConfig c = small_model();
  KvCacheOptions o;
  o.block_size = 4;
  o.num_blocks = 10;
  o.set_dtype(KvDType::INT8);
  o.residual = 8;  // two blocks of FP16 staging
  KvCache cache(c, o);
  std::mt19937 rng(3);
  BlockTable t;
  append_tokens(cache, t, c, 30, rng);  // 8 blocks: 0-5 encoded, 6-7 staged
  ASSERT_EQ(t.blocks, (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7}));
  // Staging slots are recycled LIFO as blocks seal: the open blocks hold 0 and 1.
  EXPECT_EQ(t.staging, (std::vector<int32_t>{-1, -1, -1, -1, -1, -1, 0, 1}));
  KvStats before = cache.stats();
  EXPECT_EQ(before.blocks_used, 8);
  EXPECT_EQ(before.staging_used, 2);

  // Evict the 9 oldest tokens of every (layer, head): 21 remain, 6 blocks.
  std::vector<int32_t> slots;
  for (int r = 0; r < c.n_layers * c.n_kv_heads; ++r)
    for (int32_t s = 0; s < 9; ++s) slots.push_back(s);
  cache.evict(t, slots, 9);
  EXPECT_EQ(cache.stats().tokens_stored, 21);
  EXPECT_EQ(cache.stats().blocks_used, 8);  // marked only
  ASSERT_TRUE(cache.compact(t));
  EXPECT_EQ(t.blocks, (std::vector<int32_t>{0, 1, 2, 3, 4, 5}));
  // 21 tokens: blocks 0-3 stay encoded, 4-5 return to FP16 staging (the
  // window is the newest 8 tokens again) in fresh slots 2 and 3; the slots of
  // the dropped blocks 6 and 7 are read while copying, then freed.
  EXPECT_EQ(cache.sealed_blocks(21), 4);
  EXPECT_EQ(t.staging, (std::vector<int32_t>{-1, -1, -1, -1, 2, 3}));
  const KvStats after = cache.stats();
  EXPECT_EQ(after.blocks_used, 6);
  EXPECT_EQ(after.blocks_free, 4);
  EXPECT_EQ(after.staging_used, 2);
  EXPECT_EQ(after.tokens_stored, 21);
  EXPECT_EQ(after.tokens_evicted, 9);
  EXPECT_EQ(after.compactions, 1);
  EXPECT_EQ(after.bytes_used, 6 * after.bytes_per_block + 2 * after.staging_bytes_per_block);
  EXPECT_EQ(before.bytes_used - after.bytes_used, 2 * after.bytes_per_block);
  // The dropped blocks went to the head of the free queue (6, then 7 on top):
  // they come back before the never-used 8.
  BlockTable u;
  ASSERT_TRUE(cache.reserve(u, 12));
  EXPECT_EQ(u.blocks, (std::vector<int32_t>{7, 6, 8}));
  // The positions moved with the tokens; the next token's is 30.
  EXPECT_EQ(cache.slot_position(t, 1, 1, 0), 9);
  EXPECT_EQ(cache.slot_position(t, 0, 0, 20), 29);
  EXPECT_EQ(t.position_of_new(t.num_tokens), 30);
  cache.release(u);
  cache.release(t);
  EXPECT_EQ(cache.stats().blocks_used, 0);
  EXPECT_EQ(cache.stats().staging_used, 0);
  EXPECT_EQ(cache.stats().tokens_stored, 0);
}

TEST(Compaction, TokensLeavingEncodedBlocksForStagingRoundToFp16Only) {
  // Evicting inside the residual window pulls encoded tokens back into FP16
  // staging: their decoded values survive up to fp16 rounding.
  const ModelConfig c = small_model();
  KvCacheOptions o;
  o.block_size = 4;
  o.num_blocks = 10;
  o.set_dtype(KvDType::INT8);
  o.residual = 4;
  KvCache cache(c, o), full(c, o);
  std::mt19937 a(9), b(9);
  BlockTable t, f;
  append_tokens(cache, t, c, 14, a);  // blocks 0-2 encoded, 3 staged (slots 12, 13)
  append_tokens(full, f, c, 14, b);
  std::vector<int32_t> slots;
  for (int r = 0; r < c.n_layers * c.n_kv_heads; ++r)
    for (int32_t s : {10, 11, 12}) slots.push_back(s);
  cache.evict(t, slots, 3);
  ASSERT_TRUE(cache.compact(t));
  ASSERT_EQ(t.num_tokens, 11);  // blocks 0-1 encoded, block 2 staged: slots 8, 9 (encoded before), 10 (slot 13)
  EXPECT_EQ(cache.k_view(0, t, 2, 11).codec->dtype(), KvDType::F16);
  for (int32_t s : {8, 9, 10}) {
    const int32_t p = s < 10 ? s : 13;
    const std::vector<float> now = decoded(cache, t, 1, s, true), was = decoded(full, f, 1, p, true);
    for (size_t e = 0; e < now.size(); ++e) EXPECT_NEAR(now[e], was[e], std::fabs(was[e]) * 1e-3f + 1e-6f) << s;
  }
}

TEST(Compaction, CopiesSharedBlocksInsteadOfWritingThem) {
  const ModelConfig c = small_model();
  KvCacheOptions o;
  o.block_size = 4;
  o.num_blocks = 6;
  KvCache cache(c, o);
  std::mt19937 rng(4);
  BlockTable t;
  append_tokens(cache, t, c, 10, rng);  // blocks 0, 1, 2
  // Another sequence shares block 0 (as a prefix cache would: one more reference).
  BlockTable other;
  other.blocks = {t.blocks[0]};
  other.num_tokens = 4;
  const_cast<BlockPool&>(cache.pool()).retain(t.blocks[0]);
  const std::vector<float> shared_before = decoded(cache, other, 0, 1, true);
  std::vector<int32_t> slots;
  for (int r = 0; r < c.n_layers * c.n_kv_heads; ++r) slots.push_back(1);
  cache.evict(t, slots, 1);
  ASSERT_TRUE(cache.compact(t));
  // Block 0 changed for t, so t got a fresh copy (block 3); the shared one is
  // untouched and now only the other sequence's.
  EXPECT_EQ(t.blocks, (std::vector<int32_t>{3, 1, 2}));
  EXPECT_EQ(cache.pool().ref_count(0), 1);
  EXPECT_EQ(decoded(cache, other, 0, 1, true), shared_before);
  EXPECT_EQ(decoded(cache, t, 0, 1, true), decoded(cache, other, 0, 2, true));  // t's slot 1 is position 2
  // Without a free block, compaction refuses and leaves the table as it was.
  BlockTable filler;
  ASSERT_TRUE(cache.reserve(filler, 8));  // blocks 4, 5: the pool is full
  const_cast<BlockPool&>(cache.pool()).retain(t.blocks[0]);
  cache.evict(t, slots, 1);  // slot 1 again: now position 2
  const BlockTable snapshot = t;
  EXPECT_FALSE(cache.compact(t));
  EXPECT_EQ(t.blocks, snapshot.blocks);
  EXPECT_EQ(t.dead, 1);
  EXPECT_EQ(t.slot_positions, snapshot.slot_positions);
  cache.release(filler);
  ASSERT_TRUE(cache.compact(t));
  EXPECT_EQ(t.num_tokens, 8);
  const_cast<BlockPool&>(cache.pool()).release(3);
  const_cast<BlockPool&>(cache.pool()).release(0);
}

TEST(Compaction, EvictRejectsBadSlotsAndChangesNothing) {
  const ModelConfig c = small_model();
  KvCacheOptions o;
  o.block_size = 4;
  o.num_blocks = 4;
  KvCache cache(c, o);
  std::mt19937 rng(1);
  BlockTable t;
  append_tokens(cache, t, c, 6, rng);
  const int rows = c.n_layers * c.n_kv_heads;
  std::vector<int32_t> slots(size_t(rows), 2);
  slots.back() = 6;  // out of range in the last row
  testing_files::expect_error_containing([&] { cache.evict(t, slots, 1); }, "slot 6 of layer 1, KV head 1 is out of range");
  EXPECT_EQ(t.dead, 0);
  for (int32_t p : t.slot_positions) EXPECT_GE(p, 0);
  slots.back() = 2;
  cache.evict(t, slots, 1);
  testing_files::expect_error_containing([&] { cache.evict(t, slots, 1); }, "already evicted");
  EXPECT_EQ(t.dead, 1);
  testing_files::expect_error_containing([&] { cache.evict(t, slots, 2); }, "slots given");
  cache.release(t);
}

}  // namespace
}  // namespace kvserve
