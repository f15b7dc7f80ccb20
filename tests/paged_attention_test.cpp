// Attention through scattered block tables equals a double-precision
// reference over the same tokens.
#include "attention/paged_attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

namespace kvserve {
namespace {

TEST(PagedAttention, MatchesReferenceOverShuffledBlocks) {
  ModelConfig c;
  c.dim = 256;
  c.hidden_dim = 64;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.vocab_size = 16;
  c.seq_len = 256;
  std::mt19937 rng(11);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<std::pair<KvCodecConfig, KvCodecConfig>> codecs = {
      {{KvDType::F32}, {KvDType::F32}},
      {{KvDType::F16}, {KvDType::F16}},
      {{KvDType::INT8}, {KvDType::INT4, KvGrouping::Token, 16, {}, {}}},
      {{KvDType::INT4, KvGrouping::Channel, 0, {}, {}}, {KvDType::INT2}},
      {{KvDType::Q4_0}, {KvDType::BF16}},
  };
  for (const auto& [kc, vc] : codecs) {
    for (int bs : {1, 5, 16}) {
      KvCacheOptions o;
      o.block_size = bs;
      o.k = kc;
      o.v = vc;
      o.residual = 2 * bs;
      o.num_blocks = 200 / bs + 8;
      KvCache cache(c, o);
      // Take blocks from a shuffled pool order: the table is not contiguous.
      BlockTable scratch_table, table;
      ASSERT_TRUE(cache.reserve(scratch_table, 40));
      const int n_ctx = 150;
      ASSERT_TRUE(cache.reserve(table, n_ctx));
      std::shuffle(table.blocks.begin(), table.blocks.end(), rng);
      std::vector<float> k(static_cast<size_t>(c.kv_dim())), v(static_cast<size_t>(c.kv_dim()));
      for (int pos = 0; pos < n_ctx; ++pos) {
        for (auto& x : k) x = n(rng);
        for (auto& x : v) x = n(rng);
        cache.write(1, table, pos, k.data(), v.data());
      }
      // Attend as the forward pass does: sealed, but not yet committed, so a
      // query at any position still finds the blocks it saw in FP16 staging.
      cache.seal(1, table, n_ctx);
      const int head_dim = c.head_dim(), group = c.gqa_group();
      std::vector<float> q(static_cast<size_t>(group * head_dim));
      for (auto& x : q) x = n(rng) * 0.2f;
      AttentionScratch scratch;
      for (int ctx : {1, 7, n_ctx}) {
        for (int h = 0; h < c.n_kv_heads; ++h) {
          std::vector<float> out(q.size()), ref(q.size());
          attend_kv_head(cache, 1, table, ctx, h, group, head_dim, q.data(), out.data(), scratch);
          attend_kv_head_reference(cache, 1, table, ctx, h, group, head_dim, q.data(), ref.data());
          for (size_t i = 0; i < out.size(); ++i) EXPECT_NEAR(out[i], ref[i], 2e-5) << kc.describe() << "+" << vc.describe() << " bs " << bs << " ctx " << ctx;
        }
      }
    }
  }
}

}  // namespace
}  // namespace kvserve
