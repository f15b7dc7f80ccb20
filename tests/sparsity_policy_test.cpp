// Sparsity policies on hand-made attention patterns: the exact positions each
// (layer, KV head) keeps, the blocks and keys a read-time policy picks,
// memory freed as tokens are evicted, and option errors.
#include "attention/sparsity_policy.h"

#include <gtest/gtest.h>

#include <functional>

#include "attention/topk_policy.h"
#include "test_support.h"

namespace kvserve {
namespace {

using testing_files::expect_error_containing;

// 1 layer, 2 KV heads of 4 dims: two rows that may keep different tokens.
ModelConfig two_heads() {
  ModelConfig c;
  c.dim = 16;
  c.hidden_dim = 32;
  c.n_layers = 1;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.vocab_size = 16;
  c.seq_len = 64;
  return c;
}

// Weight the query at position q gives the token at position p, for KV head h.
using Pattern = std::function<float(int kv_head, int32_t q, int32_t p)>;

// Drives a policy as Transformer::forward does, one decode token at a time,
// with attention weights taken from `pattern` (evicted slots get 0).
class Driver {
 public:
  Driver(const SparsityOptions& options, int32_t block_size = 4, int64_t blocks = 16) {
    KvCacheOptions o;
    o.block_size = block_size;
    o.num_blocks = blocks;
    cache = std::make_unique<KvCache>(two_heads(), o);
    policy = make_sparsity_policy(options, *cache);
  }
  ~Driver() { cache->release(table); }

  void step(const Pattern& pattern) {
    ASSERT_TRUE(cache->reserve(table, 1));
    policy->begin_forward(*cache, table, 1);
    const int32_t n_ctx = table.num_tokens + 1, q = table.position_of_new(table.num_tokens);
    if (policy->wants_kv()) {  // keys zero; every value element = value_of(position)
      const std::vector<float> k(8, 0.0f), v(8, value_of(q));
      policy->on_kv(0, table.num_tokens, k.data(), v.data());
    }
    std::vector<float> w(static_cast<size_t>(n_ctx));
    for (int h = 0; h < 2; ++h) {
      for (int32_t s = 0; s < n_ctx; ++s) {
        const int32_t p = cache->slot_position(table, 0, h, s);
        w[size_t(s)] = p < 0 ? 0.0f : pattern(h, q, p);
      }
      if (policy->wants_attention_weights()) policy->observe(0, h, w.data(), n_ctx);
    }
    cache->commit(table, 1);
    policy->after_forward(*cache, table, 1);
  }
  void steps(int n, const Pattern& pattern) {
    for (int i = 0; i < n; ++i) step(pattern);
  }
  // Positions KV head h keeps, in slot order.
  std::vector<int32_t> kept(int h) const {
    std::vector<int32_t> out;
    for (int32_t s = 0; s < table.num_tokens; ++s)
      if (int32_t p = cache->slot_position(table, 0, h, s); p >= 0) out.push_back(p);
    return out;
  }

  std::unique_ptr<KvCache> cache;
  std::unique_ptr<SparsityPolicy> policy;
  BlockTable table;
  std::function<float(int32_t)> value_of = [](int32_t) { return 1.0f; };
};

const Pattern kUniform = [](int, int32_t, int32_t) { return 0.1f; };

SparsityOptions policy(const std::string& name, int32_t budget) {
  SparsityOptions o;
  o.policy = name;
  o.budget = budget;
  return o;
}

TEST(WindowPolicy, KeepsTheLastBudgetTokensAndFreesBlocks) {
  Driver d(policy("window", 5));
  d.steps(8, kUniform);
  EXPECT_EQ(d.kept(0), (std::vector<int32_t>{3, 4, 5, 6, 7}));
  EXPECT_EQ(d.kept(1), (std::vector<int32_t>{3, 4, 5, 6, 7}));
  // Three evicted slots: below one block, still in place (masked).
  EXPECT_EQ(d.table.dead, 3);
  EXPECT_EQ(d.table.num_tokens, 8);
  EXPECT_EQ(d.cache->stats().blocks_used, 2);
  d.step(kUniform);  // the fourth eviction compacts: 5 tokens in 2 blocks
  EXPECT_EQ(d.kept(0), (std::vector<int32_t>{4, 5, 6, 7, 8}));
  EXPECT_EQ(d.table.num_tokens, 5);
  EXPECT_EQ(d.table.dead, 0);
  EXPECT_EQ(d.policy->stats().compactions, 1);
  d.steps(40, kUniform);
  EXPECT_EQ(d.kept(1), (std::vector<int32_t>{44, 45, 46, 47, 48}));
  // Never more than budget + one block of evicted slots: at most 3 blocks.
  EXPECT_LE(d.cache->stats().blocks_used, 3);
  EXPECT_EQ(d.cache->stats().tokens_stored, 5);
  EXPECT_EQ(d.policy->stats().tokens_evicted, 44);
  // The next token's position counts every token, evicted or not.
  EXPECT_EQ(d.table.position_of_new(d.table.num_tokens), 49);
}

TEST(SinksPolicy, KeepsTheFirstTokensAndTheLastWindow) {
  SparsityOptions o = policy("sinks", 5);
  o.sinks = 2;
  o.positions = SparsityPositions::Original;  // the cache stores keys after RoPE here
  Driver d(o);
  d.steps(9, kUniform);
  EXPECT_EQ(d.kept(0), (std::vector<int32_t>{0, 1, 6, 7, 8}));
  d.steps(30, kUniform);
  EXPECT_EQ(d.kept(1), (std::vector<int32_t>{0, 1, 36, 37, 38}));
}

// Heavy hitters differ per head: head 0 attends to positions 1 and 3, head 1
// to 0 and 2; everything else gets a little.
const Pattern kTwoHitters = [](int h, int32_t q, int32_t p) {
  if (h == 0) return p == 1 || p == 3 ? 1.0f : 0.01f;
  return p == 0 || p == 2 ? 1.0f : 0.01f;
};

TEST(H2oPolicy, KeepsEachHeadsHeavyHittersAndTheRecentWindow) {
  SparsityOptions o = policy("h2o", 4);
  o.window = 2;
  Driver d(o);
  d.steps(12, kTwoHitters);
  EXPECT_EQ(d.kept(0), (std::vector<int32_t>{1, 3, 10, 11}));
  EXPECT_EQ(d.kept(1), (std::vector<int32_t>{0, 2, 10, 11}));
  // Compaction moved the scores with their tokens: the choice holds on.
  EXPECT_GE(d.policy->stats().compactions, 1);
  d.steps(20, kTwoHitters);
  EXPECT_EQ(d.kept(0), (std::vector<int32_t>{1, 3, 30, 31}));
  EXPECT_EQ(d.kept(1), (std::vector<int32_t>{0, 2, 30, 31}));
}

TEST(H2oPolicy, AggregateScopeKeepsOneSetForAllHeads) {
  // Head 0 likes position 1, head 1 likes 2, both like 3 a fair amount:
  // summed over heads, 3 and then 1 win, and head 1 loses its favourite.
  const Pattern pattern = [](int h, int32_t, int32_t p) {
    if (p == 1) return h == 0 ? 1.0f : 0.0f;
    if (p == 2) return h == 1 ? 1.0f : 0.0f;
    if (p == 3) return 0.9f;
    return 0.01f;
  };
  SparsityOptions o = policy("h2o", 4);
  o.window = 2;
  o.scope = SparsityScope::Aggregate;
  Driver d(o);
  d.steps(10, pattern);
  EXPECT_EQ(d.kept(0), (std::vector<int32_t>{1, 3, 8, 9}));
  EXPECT_EQ(d.kept(1), (std::vector<int32_t>{1, 3, 8, 9}));
  o.scope = SparsityScope::Head;
  Driver e(o);
  e.steps(10, pattern);
  EXPECT_EQ(e.kept(0), (std::vector<int32_t>{1, 3, 8, 9}));
  EXPECT_EQ(e.kept(1), (std::vector<int32_t>{2, 3, 8, 9}));
}

TEST(H2oPolicy, MeanScoreForgetsTokensNoLongerAttended) {
  // Position 1 was attended strongly by the first queries only; position 6
  // modestly by every later query. The sum keeps 1, the mean keeps 6.
  const Pattern fading = [](int, int32_t q, int32_t p) {
    if (p == 1) return q < 6 ? 1.0f : 0.0f;
    if (p == 6) return 0.7f;
    return 0.01f;
  };
  SparsityOptions o = policy("h2o", 3);
  o.window = 2;
  Driver sum(o);
  sum.steps(14, fading);
  EXPECT_EQ(sum.kept(0), (std::vector<int32_t>{1, 12, 13}));
  o.score = H2oScore::Mean;
  Driver mean(o);
  mean.steps(14, fading);
  EXPECT_EQ(mean.kept(0), (std::vector<int32_t>{6, 12, 13}));
}

TEST(H2oPolicy, ValueNormDropsASinkWhoseValueIsNearZero) {
  // Position 0 takes most of the attention (a sink) but its value is tiny;
  // position 2 takes less attention and carries a real value.
  const Pattern sink = [](int, int32_t, int32_t p) { return p == 0 ? 0.8f : p == 2 ? 0.3f : 0.01f; };
  SparsityOptions o = policy("h2o", 2);
  o.window = 1;
  Driver plain(o);
  plain.value_of = [](int32_t p) { return p == 0 ? 0.001f : 1.0f; };
  plain.steps(8, sink);
  EXPECT_EQ(plain.kept(0), (std::vector<int32_t>{0, 7}));
  o.value_weighted = true;
  Driver weighted(o);
  weighted.value_of = plain.value_of;
  weighted.steps(8, sink);
  EXPECT_EQ(weighted.kept(0), (std::vector<int32_t>{2, 7}));
}

TEST(SnapKvPolicy, ScoresByTheObservationWindowOnly) {
  // Queries before 8 attend to position 1; from 8 on, to position 7.
  const Pattern shifting = [](int, int32_t q, int32_t p) {
    if (p == 1) return q < 8 ? 1.0f : 0.0f;
    if (p == 7) return q >= 8 ? 0.5f : 0.0f;
    return 0.01f;
  };
  SparsityOptions o = policy("snapkv", 3);
  o.observe = 2;
  o.window = 1;
  o.pool = 1;
  Driver d(o);
  d.steps(10, shifting);
  // The last two queries (8, 9) no longer look at 1: it goes.
  EXPECT_EQ(d.kept(0), (std::vector<int32_t>{7, 8, 9}));
  // h2o with the same budget holds on to 1 for its past attention.
  SparsityOptions h = policy("h2o", 3);
  h.window = 1;
  Driver e(h);
  e.steps(10, shifting);
  EXPECT_EQ(e.kept(0), (std::vector<int32_t>{1, 7, 9}));
}

TEST(SnapKvPolicy, PoolingKeepsTheNeighboursOfAChosenToken) {
  const Pattern spike = [](int, int32_t, int32_t p) { return p == 3 ? 1.0f : 0.01f; };
  SparsityOptions o = policy("snapkv", 4);
  o.observe = 4;
  o.window = 1;
  o.pool = 3;
  Driver d(o);
  d.steps(9, spike);
  // 3 and its neighbours 2 and 4 share its pooled score.
  EXPECT_EQ(d.kept(0), (std::vector<int32_t>{2, 3, 4, 8}));
}

TEST(EvictingPolicy, HorizonEvictsFarTokensFirst) {
  SparsityOptions o = policy("h2o", 4);
  o.window = 1;
  o.horizon = 5;
  Driver d(o);
  d.steps(12, kTwoHitters);
  // The heavy hitters 1 and 3 went once they were 5 positions back; within
  // the horizon, h2o's scores decide (10, the newest candidate, has the least).
  EXPECT_EQ(d.kept(0), (std::vector<int32_t>{7, 8, 9, 11}));
}

TEST(TopKPolicy, ReadsTheBlocksWithTheLargestBoundsAndItsOwn) {
  KvCacheOptions o;
  o.block_size = 4;
  o.num_blocks = 8;
  KvCache cache(two_heads(), o);
  SparsityOptions so = policy("topk", 8);  // two blocks
  std::unique_ptr<SparsityPolicy> p = make_sparsity_policy(so, cache);
  ASSERT_TRUE(p->selects_reads());
  // 20 tokens, 5 blocks; head 0's keys are zero except in block 2, whose
  // keys point along +x. Head 1's block 1 points along -x.
  std::vector<float> k(8), v(8);
  for (int32_t slot = 0; slot < 20; ++slot) {
    std::fill(k.begin(), k.end(), 0.0f);
    if (slot / 4 == 2) k[0] = 1.0f;
    if (slot / 4 == 1) k[4] = -1.0f;
    p->on_kv(0, slot, k.data(), v.data());
  }
  const std::vector<float> q = {2, 0, 0, 0, 1, 0, 0, 0};  // (group 2, head_dim 4), both heads along +x
  ReadSet reads;
  p->select(0, 0, q.data(), 2, 20, reads);
  EXPECT_EQ(reads.blocks, (std::vector<int32_t>{2, 4}));
  EXPECT_TRUE(reads.keep.empty());
  const std::vector<float> neg = {-1, 0, 0, 0, 0, 0, 0, 0};
  p->select(0, 1, neg.data(), 2, 20, reads);
  EXPECT_EQ(reads.blocks, (std::vector<int32_t>{1, 4}));
  // Everything fits the budget: read all (empty choice).
  p->select(0, 0, q.data(), 2, 8, reads);
  EXPECT_TRUE(reads.blocks.empty());
}

TEST(AnnPolicy, ReadsSinksWindowAndTheBestRetrievedKeys) {
  KvCacheOptions o;
  o.block_size = 4;
  o.num_blocks = 12;
  KvCache cache(two_heads(), o);
  SparsityOptions so = policy("ann", 8);
  so.sinks = 2;
  so.window = 3;  // 3 keys retrieved
  for (KeyIndexBackend backend : {KeyIndexBackend::Hnsw, KeyIndexBackend::IvfPq}) {
    so.ann_backend = backend;
    std::unique_ptr<SparsityPolicy> p = make_sparsity_policy(so, cache);
    // 40 keys of head 0 along -x, except 5 and 9 (strongly +x) and 20 (+x);
    // head 1's keys all along +y.
    std::vector<float> k(8), v(8);
    for (int32_t slot = 0; slot < 40; ++slot) {
      std::fill(k.begin(), k.end(), 0.0f);
      k[0] = slot == 5 || slot == 9 ? 3.0f : slot == 20 ? 2.0f : -1.0f - 0.01f * float(slot);
      k[5] = 1.0f;
      p->on_kv(0, slot, k.data(), v.data());
    }
    const std::vector<float> q = {1, 0, 0, 0, 0.5f, 0, 0, 0};  // group of 2, both along +x
    ReadSet reads;
    p->select(0, 0, q.data(), 2, 40, reads);
    std::vector<int32_t> kept;
    for (int32_t s = 0; s < 40; ++s)
      if (reads.keep[size_t(s)]) kept.push_back(s);
    EXPECT_EQ(kept, (std::vector<int32_t>{0, 1, 5, 9, 20, 37, 38, 39})) << key_index_backend_name(backend);
    EXPECT_EQ(reads.blocks, (std::vector<int32_t>{0, 1, 2, 5, 9}));
    // Within the budget, everything is read.
    p->select(0, 0, q.data(), 2, 8, reads);
    EXPECT_TRUE(reads.keep.empty());
  }
}

TEST(SparsityOptions, RejectsOptionsThatDoNotFit) {
  KvCacheOptions o;
  KvCache cache(two_heads(), o);
  auto make = [&](SparsityOptions so) { return make_sparsity_policy(so, cache); };
  expect_error_containing([&] { make(policy("lru", 8)); }, "unknown --kv-policy 'lru'");
  expect_error_containing([&] { make(policy("h2o", 0)); }, "needs --kv-budget");
  SparsityOptions so = policy("h2o", 8);
  so.sinks = 4;
  so.window = 6;
  expect_error_containing([&] { make(so); }, "exceed --kv-budget 8");
  // Positions within the cache need keys stored before RoPE.
  expect_error_containing([&] { make(policy("sinks", 8)); }, "--kv-k-pre-rope");
  so = policy("snapkv", 8);
  so.pool = 2;
  expect_error_containing([&] { make(so); }, "--kv-pool");
  so = policy("window", 8);
  so.horizon = 4;
  expect_error_containing([&] { make(so); }, "--kv-horizon");
  EXPECT_EQ(make(policy("full", 0))->name(), "full");
  o.k.pre_rope = true;
  KvCache pre_rope(two_heads(), o);
  EXPECT_TRUE(sparsity_limits(policy("sinks", 8), pre_rope, 4).unbounded_positions);
  EXPECT_FALSE(sparsity_limits(policy("window", 8), pre_rope, 4).unbounded_positions);
  // An evicting policy holds its budget, a chunk and a block of dead slots.
  EXPECT_EQ(sparsity_limits(policy("h2o", 8), pre_rope, 4).max_tokens_held, 8 + 4 + pre_rope.block_size());
  EXPECT_EQ(sparsity_limits(policy("topk", 8), pre_rope, 4).max_tokens_held, -1);
  EXPECT_EQ(describe(resolve_sparsity_options(policy("sinks", 8), pre_rope)),
            "sinks budget 8 (sinks 4, window 4, cache positions)");
}

// Sinks at or past the budget left window and snapkv a negative window: their
// eviction then read past the live slots (a probe saw "slot -1051619142").
TEST(SparsityOptions, RejectsSinksThatLeaveNoWindow) {
  KvCache cache(two_heads(), KvCacheOptions{});
  for (const char* name : {"window", "snapkv"}) {
    SparsityOptions so = policy(name, 5);
    so.sinks = 8;
    expect_error_containing([&] { (void)resolve_sparsity_options(so, cache); }, "leaves no window in --kv-budget 5");
    so.sinks = 5;
    expect_error_containing([&] { (void)resolve_sparsity_options(so, cache); }, "leaves no window");
    so.sinks = 4;
    EXPECT_GE(resolve_sparsity_options(so, cache).window, 1) << name;
  }
  // window and sinks keep the last B - S: another window is a contradiction.
  SparsityOptions so = policy("window", 64);
  so.window = 10;
  expect_error_containing([&] { (void)resolve_sparsity_options(so, cache); }, "--kv-window 10 says otherwise");
  so.window = 64;
  EXPECT_EQ(resolve_sparsity_options(so, cache).window, 64);
}

// Defaults are filled in only for knobs the policy reads: resolved options
// resolve again unchanged (filled-in knobs were refused the second time).
TEST(SparsityOptions, ResolvedOptionsResolveAgainUnchanged) {
  KvCacheOptions o;
  o.k.pre_rope = true;
  KvCache cache(two_heads(), o);
  for (const char* name : {"window", "sinks", "h2o", "snapkv", "topk", "ann"}) {
    const SparsityOptions once = resolve_sparsity_options(policy(name, 16), cache);
    EXPECT_EQ(describe(resolve_sparsity_options(once, cache)), describe(once)) << name;
  }
}

// A knob the policy never reads was accepted and silently ignored.
TEST(SparsityOptions, RejectsKnobsThePolicyDoesNotRead) {
  KvCache cache(two_heads(), KvCacheOptions{});
  struct Case {
    const char* policy;
    std::function<void(SparsityOptions&)> knob;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"full", [](SparsityOptions&) {}, "--kv-budget applies to a sparsity policy"},
      {"topk", [](SparsityOptions& o) { o.sinks = 4; }, "do not apply to --kv-policy topk"},
      {"h2o", [](SparsityOptions& o) { o.observe = 8; }, "--kv-observe and --kv-pool apply to --kv-policy snapkv only"},
      {"window", [](SparsityOptions& o) { o.ann_backend = KeyIndexBackend::IvfPq; }, "apply to --kv-policy ann only"},
      {"window", [](SparsityOptions& o) { o.scope = SparsityScope::Aggregate; }, "--kv-scope applies to h2o and snapkv"},
      {"snapkv", [](SparsityOptions& o) { o.score = H2oScore::Mean; }, "--kv-score applies to h2o"},
      {"ann", [](SparsityOptions& o) { o.compact_slack = 16; }, "--kv-compact-slack applies to evicting policies only"},
  };
  for (const Case& c : cases) {
    SparsityOptions so = policy(c.policy, 64);
    c.knob(so);
    expect_error_containing([&] { (void)resolve_sparsity_options(so, cache); }, c.message);
  }
  // The knobs of the policies that read them still pass.
  SparsityOptions so = policy("snapkv", 64);
  so.observe = 8;
  so.pool = 3;
  EXPECT_EQ(resolve_sparsity_options(so, cache).pool, 3);
  EXPECT_EQ(resolve_sparsity_options(policy("snapkv", 64), cache).pool, 7);
}

// The FP16 residual window is counted in slots: compacting at every eviction
// packed the newest tokens into encoded blocks (window-64 q4_0 PPL 11.3
// against 6.1 at one block of slack).
TEST(SparsityOptions, RefusesCompactingWithinABlockOnAStagedCache) {
  KvCacheOptions o;
  o.k.dtype = o.v.dtype = KvDType::INT4;
  KvCache staged(two_heads(), o);
  ASSERT_TRUE(staged.staged());
  SparsityOptions so = policy("window", 16);
  so.compact_slack = staged.block_size() - 1;
  expect_error_containing([&] { (void)resolve_sparsity_options(so, staged); }, "below one block");
  so.compact_slack = staged.block_size();
  EXPECT_NO_THROW((void)resolve_sparsity_options(so, staged));
  so.compact_slack = 0;
  KvCache floats(two_heads(), KvCacheOptions{});
  EXPECT_NO_THROW((void)resolve_sparsity_options(so, floats));
}

}  // namespace
}  // namespace kvserve
