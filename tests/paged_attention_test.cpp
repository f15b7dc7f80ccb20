// Attention through scattered block tables equals a double-precision
// reference over the same tokens.
#include "attention/paged_attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "attention_test_support.h"
#include "kernels/vector_ops.h"

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
      {{KvDType::FP8}, {KvDType::FP8}},
      {{KvDType::FP8_E5M2}, {KvDType::FP8_E5M2}},
  };
  // Keys stored before RoPE: channel codecs rotate each key by its offset in
  // the block (score_offsets), the rest rotate the query per key.
  for (KvDType t : {KvDType::INT8, KvDType::INT4, KvDType::INT2}) {
    KvCodecConfig pre{t, KvGrouping::Channel, 0, {}, {}};
    pre.pre_rope = true;
    pre.scale_bits = t == KvDType::INT4 ? 8 : 16;
    codecs.push_back({pre, {KvDType::INT4}});
  }
  KvCodecConfig f16_pre{KvDType::INT4, KvGrouping::Token, 0, {}, {}};
  f16_pre.pre_rope = true;
  codecs.push_back({f16_pre, {KvDType::F16}});
  // Keys rotated within RoPE spans (the int2 presets' keys): channel codecs
  // score each span with its own query set (score_span), the others take
  // the default; FP16 staging blocks too. Spans shrink to divide the block.
  for (auto [t, span] : {std::pair{KvDType::INT2, 16}, std::pair{KvDType::INT4, 8}, std::pair{KvDType::F32, 4}}) {
    KvCodecConfig spans{t, t == KvDType::F32 ? KvGrouping::Token : KvGrouping::Channel, 0, {}, {}};
    spans.pre_rope = true;
    spans.rope_span = span;
    spans.scale_bits = t == KvDType::INT2 ? 8 : 16;
    codecs.push_back({spans, {KvDType::INT2}});
  }
  for (const auto& [kc, vc] : codecs) {
    for (int bs : {1, 5, 16, 32}) {  // 32: 4-bit channel keys take the 8-bit query kernel
      KvCacheOptions o;
      o.block_size = bs;
      o.k = kc;
      o.k.rope_span = std::gcd(kc.rope_span, bs);
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
          const double tolerance =
              2e-5 + testing_attention::rounding_allowance(cache, 1, table, ctx, h, group, head_dim, q.data());
          for (size_t i = 0; i < out.size(); ++i) EXPECT_NEAR(out[i], ref[i], tolerance) << kc.describe() << "+" << vc.describe() << " bs " << bs << " ctx " << ctx;
          // The same pass cut into parts of whole blocks and merged
          // (decode across threads) gives the same output.
          const int32_t blocks = (ctx + bs - 1) / bs;
          std::vector<int32_t> ids(static_cast<size_t>(blocks));
          std::iota(ids.begin(), ids.end(), 0);
          for (int parts : {2, 3}) {
            if (parts > blocks) continue;
            std::vector<float> outs(size_t(parts) * q.size()), stats(size_t(parts) * size_t(group) * 2), merged(q.size());
            for (int p = 0; p < parts; ++p) {
              AttentionSparsity sp;
              const int32_t b0 = blocks * p / parts, b1 = blocks * (p + 1) / parts;
              sp.blocks = std::span<const int32_t>(ids.data() + b0, size_t(b1 - b0));
              sp.softmax_stats = stats.data() + size_t(p) * size_t(group) * 2;
              attend_kv_head(cache, 1, table, ctx, h, group, head_dim, q.data(), outs.data() + size_t(p) * q.size(),
                             scratch, sp);
            }
            merge_attention_parts(outs.data(), stats.data(), parts, group, head_dim, merged.data());
            for (size_t i = 0; i < out.size(); ++i)
              EXPECT_NEAR(merged[i], ref[i], tolerance) << kc.describe() << "+" << vc.describe() << " bs " << bs << " ctx " << ctx << " parts " << parts;
          }
        }
      }
    }
  }
}

// Parts that read nothing (every slot evicted) add nothing; a query whose
// parts all read nothing gets a zero output, as one pass gives.
TEST(PagedAttention, MergeSkipsPartsWithoutWeight) {
  const int group = 2, head_dim = 3;
  // Part 0: query 0 max 1, sum 2; query 1 read nothing (max -inf, sum 0,
  // output NaN). Part 1: query 0 max 3, sum 1; query 1 max 0.5, sum 3.
  const float nan = std::nanf("");
  std::vector<float> outs = {1, 2, 3, nan, nan, nan, 5, 6, 7, 8, 9, 10};
  std::vector<float> stats = {1, 2, -INFINITY, 0, 3, 1, 0.5f, 3};
  std::vector<float> out(6, 42.0f);
  merge_attention_parts(outs.data(), stats.data(), 2, group, head_dim, out.data());
  const double w0 = 2 * std::exp(1.0 - 3.0), w1 = 1;  // each part's weight mass against the largest score
  for (int d = 0; d < head_dim; ++d) {
    EXPECT_NEAR(out[size_t(d)], (w0 * outs[size_t(d)] + w1 * outs[size_t(6 + d)]) / (w0 + w1), 1e-6);
    EXPECT_NEAR(out[size_t(head_dim + d)], outs[size_t(9 + d)], 1e-6);  // part 1 alone
  }
  // Every part empty for a query: a zero output.
  std::vector<float> empty_stats = {-INFINITY, 0, -INFINITY, 0, -INFINITY, 0, -INFINITY, 0};
  merge_attention_parts(outs.data(), empty_stats.data(), 2, group, head_dim, out.data());
  for (float x : out) EXPECT_EQ(x, 0.0f);
}

TEST(PagedAttention, PartsOnlyWhenThreadsWouldIdle) {
  EXPECT_EQ(attention_parts(8, 16, 16384, 64, 1024), 2);   // 8 KV heads on 16 threads: 16 passes
  EXPECT_EQ(attention_parts(3, 16, 16384, 64, 1024), 16);  // 48 passes, 3 a thread
  EXPECT_EQ(attention_parts(1, 2, 16384, 64, 1024), 2);
  EXPECT_EQ(attention_parts(3, 16, 4096, 64, 1024), 4);    // capped by the part's least size
  EXPECT_EQ(attention_parts(8, 16, 1500, 16, 1024), 1);    // under two parts' worth
  EXPECT_EQ(attention_parts(2, 6, 100, 1, 1), 3);
  // More passes than threads, not evenly shared: 3 KV heads on 2 threads
  // (2 passes against 1.5), 8 on 3 or 6 threads.
  EXPECT_EQ(attention_parts(3, 2, 16384, 64, 1024), 2);
  EXPECT_EQ(attention_parts(8, 3, 16384, 64, 1024), 3);
  EXPECT_EQ(attention_parts(8, 6, 16384, 64, 1024), 3);
  // Evenly shared already, or too little to gain: no split.
  EXPECT_EQ(attention_parts(8, 2, 16384, 64, 1024), 1);
  EXPECT_EQ(attention_parts(8, 8, 16384, 64, 1024), 1);
  EXPECT_EQ(attention_parts(25, 8, 16384, 64, 1024), 8);   // 4 passes against 3.125 in eighths
  EXPECT_EQ(attention_parts(81, 8, 16384, 64, 1024), 1);   // 11 against 10.125: under a tenth
  EXPECT_EQ(attention_parts(1, 1, 16384, 64, 1024), 1);    // one thread
}

// A double-precision reference over the slots read(slot) admits.
template <class Read>
std::vector<float> reference_reading(const KvCache& cache, int layer, const BlockTable& table, int32_t n_ctx,
                                     int kv_head, int group, int head_dim, const std::vector<float>& q, Read read,
                                     std::vector<double>* weights) {
  const int32_t bs = cache.block_size();
  const int kv_dim = cache.k_codec(layer).shape().kv_dim();
  std::vector<float> k(static_cast<size_t>(kv_dim)), v(static_cast<size_t>(kv_dim)), out(q.size());
  weights->assign(size_t(n_ctx), 0.0);
  for (int i = 0; i < group; ++i) {
    std::vector<double> s(size_t(n_ctx), -INFINITY);
    double max_s = -INFINITY;
    for (int32_t t = 0; t < n_ctx; ++t) {
      if (!read(t)) continue;
      const KvBlockView kb = cache.k_view(layer, table, t / bs, n_ctx);
      kb.codec->decode_token(kb.data, t % bs, k.data());
      if (cache.k_pre_rope(layer))  // stored before RoPE (or within a span): rotate to the key's position
        rope(k.data() + size_t(kv_head) * head_dim, 1, head_dim,
             cache.key_rope_position(table, layer, kv_head, t) -
                 cache.slot_position(table, layer, kv_head, t) % cache.k_rope_span(layer),
             cache.rope_frequencies());
      double dot = 0;
      for (int d = 0; d < head_dim; ++d) dot += double(q[size_t(i * head_dim + d)]) * k[size_t(kv_head * head_dim + d)];
      s[size_t(t)] = dot / std::sqrt(double(head_dim));
      max_s = std::max(max_s, s[size_t(t)]);
    }
    double sum = 0;
    for (auto& x : s) sum += (x = std::exp(x - max_s));
    std::vector<double> acc(size_t(head_dim), 0.0);
    for (int32_t t = 0; t < n_ctx; ++t) {
      if (s[size_t(t)] == 0) continue;
      const KvBlockView vb = cache.v_view(layer, table, t / bs, n_ctx);
      vb.codec->decode_token(vb.data, t % bs, v.data());
      (*weights)[size_t(t)] += s[size_t(t)] / sum;
      for (int d = 0; d < head_dim; ++d) acc[size_t(d)] += s[size_t(t)] / sum * v[size_t(kv_head * head_dim + d)];
    }
    for (int d = 0; d < head_dim; ++d) out[size_t(i * head_dim + d)] = float(acc[size_t(d)]);
  }
  return out;
}

// What sparsity policies ask of attend_kv_head: a subset of blocks (the
// query's own partial block last), keep flags, slots evicted but still in
// place, and the per-slot weights, against the reference over exactly the
// slots read, pre-RoPE keys included.
TEST(PagedAttention, SparseReadsMatchReference) {
  ModelConfig c;
  c.dim = 768;  // head_dim 64, GQA group 3: the 400M model's head shape
  c.hidden_dim = 64;
  c.n_layers = 2;
  c.n_heads = 12;
  c.n_kv_heads = 4;
  c.vocab_size = 16;
  c.seq_len = 512;
  std::mt19937 rng(17);
  std::normal_distribution<float> n(0.0f, 1.0f);
  KvCodecConfig int4_channel{KvDType::INT4, KvGrouping::Channel, 0, {}, {}};
  std::vector<std::pair<KvCodecConfig, KvCodecConfig>> codecs = {
      {{KvDType::F16}, {KvDType::F16}},
      {int4_channel, {KvDType::INT4, KvGrouping::Token, 0, {}, {}}},
      {{KvDType::INT2, KvGrouping::Channel, 8, {}, {}}, {KvDType::INT2, KvGrouping::Token, 0, {}, {}}},
      {{KvDType::Q4_0}, {KvDType::INT8}},
  };
  KvCodecConfig f32_pre{KvDType::F32}, int2_pre{KvDType::INT2, KvGrouping::Channel, 0, {}, {}};
  f32_pre.pre_rope = int2_pre.pre_rope = true;
  codecs.push_back({f32_pre, {KvDType::F32}});
  codecs.push_back({int2_pre, {KvDType::INT2, KvGrouping::Token, 0, {}, {}}});
  int2_pre.rope_span = 16;  // the int2 presets' keys: after an eviction each key's query is its own
  codecs.push_back({int2_pre, {KvDType::INT2, KvGrouping::Token, 0, {}, {}}});
  const int n_ctx = 300, layer = 1;
  for (const auto& [kc, vc] : codecs)
  for (int bs : {16, 32}) {  // 32: 4-bit channel keys take the 8-bit query kernel
    if (bs == 32 && kc.describe() != int4_channel.describe()) continue;
    KvCacheOptions o;
    o.block_size = bs;
    o.k = kc;
    o.v = vc;
    o.residual = 2 * bs;
    o.num_blocks = 64;
    KvCache cache(c, o);
    BlockTable table;
    ASSERT_TRUE(cache.reserve(table, n_ctx));
    std::vector<float> k(size_t(c.kv_dim())), v(size_t(c.kv_dim()));
    for (int pos = 0; pos < n_ctx; ++pos) {
      for (int l = 0; l < c.n_layers; ++l) {
        for (auto& x : k) x = n(rng);
        for (auto& x : v) x = n(rng);
        cache.write(l, table, pos, k.data(), v.data());
      }
    }
    for (int l = 0; l < c.n_layers; ++l) cache.seal(l, table, n_ctx);
    cache.commit(table, n_ctx);
    // Evict three slots of every (layer, head), leaving them masked in place.
    std::vector<int32_t> evicted;
    for (int r = 0; r < c.n_layers * c.n_kv_heads; ++r)
      for (int32_t slot : {5 + r, 100, 170 + 3 * r}) evicted.push_back(slot);
    cache.evict(table, evicted, 3);
    ASSERT_GT(table.dead, 0);

    const int head_dim = c.head_dim(), group = c.gqa_group();
    std::vector<float> q(size_t(group * head_dim));
    for (auto& x : q) x = n(rng) * 0.3f;
    const int32_t n_blocks = (n_ctx + bs - 1) / bs;
    std::vector<int32_t> some_blocks;
    for (int32_t b : {0, 1, 2, 5, 6, 9, 12, 13, 14, 16})
      if (b < n_blocks - 2) some_blocks.push_back(b);
    some_blocks.push_back(n_blocks - 2);
    some_blocks.push_back(n_blocks - 1);
    std::vector<uint8_t> keep(size_t(n_ctx), 1);
    for (int32_t t = 0; t < n_ctx; t += 7) keep[size_t(t)] = 0;
    keep[size_t(n_ctx - 1)] = 1;
    const double tolerance = 2e-5;
    AttentionScratch scratch;
    for (int variant = 0; variant < 3; ++variant) {
      AttentionSparsity sp;
      if (variant >= 1) sp.blocks = some_blocks;
      if (variant == 2) sp.keep = keep;
      for (int h = 0; h < c.n_kv_heads; ++h) {
        auto read = [&](int32_t t) {
          if (cache.slot_position(table, layer, h, t) < 0) return false;
          if (!sp.keep.empty() && keep[size_t(t)] == 0) return false;
          return sp.blocks.empty() || std::count(some_blocks.begin(), some_blocks.end(), t / bs) > 0;
        };
        std::vector<float> out(q.size()), weights(size_t(n_ctx), -1.0f);
        sp.weights = weights.data();
        attend_kv_head(cache, layer, table, n_ctx, h, group, head_dim, q.data(), out.data(), scratch, sp);
        std::vector<double> ref_w;
        const std::vector<float> ref = reference_reading(cache, layer, table, n_ctx, h, group, head_dim, q, read, &ref_w);
        // 8-bit folded queries: weights within a factor e^(±2 delta), summed over the group's queries.
        const double delta = testing_attention::rounded_query_delta(cache, layer, table, n_ctx, h, group, head_dim, q.data());
        const double out_tolerance =
            tolerance + std::expm1(2 * delta) * testing_attention::max_value(cache, layer, table, n_ctx, h, head_dim) +
            testing_attention::weight_rounding_bound(cache, layer, table, n_ctx, h, head_dim, ref_w, 1, delta);
        for (size_t i = 0; i < out.size(); ++i)
          ASSERT_NEAR(out[i], ref[i], out_tolerance) << kc.describe() << "+" << vc.describe() << " variant " << variant;
        for (int32_t t = 0; t < n_ctx; ++t)
          ASSERT_NEAR(weights[size_t(t)], ref_w[size_t(t)], tolerance + std::expm1(2 * delta) * ref_w[size_t(t)])
              << kc.describe() << " variant " << variant << " slot " << t;
      }
    }
  }
}

}  // namespace
}  // namespace kvserve
