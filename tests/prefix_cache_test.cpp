// The prefix cache, in the style of vLLM's test_prefix_caching.py: exact
// block ids reused, exact eviction order (LRU, LFU with aging, TTL), pin cap,
// quotas, salt isolation, fairness across tenants, events and stats. KV
// contents do not matter here (tests/prefix_cache_model_test.cpp runs the
// real model), so prefill is reserve + commit.
#include "kv/prefix_cache.h"

#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "kv/kv_spec.h"
#include "kv/prefix_cache_json.h"
#include "util/error.h"
#include "test_support.h"

namespace kvserve {
namespace {

using testing_shapes::stories_shape;

// first, first + 1, ..., n tokens.
std::vector<int32_t> toks(int32_t first, int32_t n) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) t[size_t(i)] = first + i;
  return t;
}

std::vector<int32_t> concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

struct Seq {
  std::vector<int32_t> tokens;
  CacheScope scope;
  std::vector<BlockKey> keys;
  BlockTable table;
  PrefixMatch match;
};

class PrefixCacheTest : public ::testing::Test {
 protected:
  // A fresh cache of num_blocks fp32 blocks of 4 tokens (or the int4 preset).
  void make(int32_t num_blocks, PrefixCacheOptions o = {}, const char* preset = "fp32") {
    pc.reset();
    KvCacheOptions ko;
    ko.block_size = 4;
    ko.num_blocks = num_blocks;
    apply_kv_preset(ko, preset, /*keep_block_size=*/true);
    cache = std::make_unique<KvCache>(stories_shape(2), ko);
    o.model_id = "test-model";
    pc = std::make_unique<PrefixCache>(*cache, o, clock);
  }

  // Runs n more tokens of s as a forward pass would leave them (reserve,
  // seal, commit), then publishes.
  void prefill(Seq& s, int32_t n) {
    ASSERT_TRUE(cache->reserve(s.table, n));
    for (int l = 0; l < cache->n_layers(); ++l) cache->seal(l, s.table, s.table.num_tokens + n);
    cache->commit(s.table, n);
    pc->publish(s.scope, s.table, s.keys);
  }

  // Admits a prompt: keys, match, prefill of the rest.
  Seq admit(const std::vector<int32_t>& tokens, const CacheScope& scope = {}) {
    Seq s;
    s.tokens = tokens;
    s.scope = scope;
    pc->block_keys(scope, tokens, s.keys);
    s.match = pc->match(scope, s.keys, int32_t(tokens.size()), s.table);
    EXPECT_EQ(s.table.num_tokens, s.match.cached_tokens);
    prefill(s, int32_t(tokens.size()) - s.table.num_tokens);
    return s;
  }

  void finish(Seq& s) { pc->release(s.scope, s.table, s.keys); }

  // Block ids of the removed events drained now, in order.
  std::vector<int32_t> removed() {
    std::vector<int32_t> ids;
    for (const CacheEvent& e : pc->drain_events())
      if (e.kind == CacheEventKind::Removed) ids.push_back(e.block);
    return ids;
  }

  ManualClock clock;
  std::unique_ptr<KvCache> cache;  // declared first: outlives pc
  std::unique_ptr<PrefixCache> pc;
};

TEST_F(PrefixCacheTest, SecondRequestSharesTheFirstOnesBlocksById) {
  make(10);
  Seq a = admit(toks(1, 14));
  EXPECT_EQ(a.match.cached_tokens, 0);
  EXPECT_EQ(a.table.blocks, (std::vector<int32_t>{0, 1, 2, 3}));
  const std::vector<CacheEvent> stored = pc->drain_events();
  ASSERT_EQ(stored.size(), 3u);  // full blocks only
  for (int32_t i = 0; i < 3; ++i) {
    EXPECT_EQ(stored[size_t(i)].kind, CacheEventKind::Stored);
    EXPECT_EQ(stored[size_t(i)].block, i);
    EXPECT_EQ(stored[size_t(i)].depth, i);
    EXPECT_EQ(stored[size_t(i)].key, a.keys[size_t(i)]);
    EXPECT_EQ(stored[size_t(i)].parent, i == 0 ? BlockKey{} : a.keys[size_t(i - 1)]);
  }

  Seq b = admit(concat(toks(1, 12), toks(100, 5)));
  EXPECT_EQ(b.match.cached_blocks, 3);
  EXPECT_EQ(b.match.cached_tokens, 12);
  EXPECT_EQ(b.match.checkpoint_tokens, 0);
  EXPECT_EQ(b.table.blocks, (std::vector<int32_t>{0, 1, 2, 4, 5}));
  for (int32_t id : {0, 1, 2}) EXPECT_EQ(cache->pool().ref_count(id), 2);

  const PrefixCacheStats s = pc->stats();
  EXPECT_EQ(s.counters.queries, 2);
  EXPECT_EQ(s.counters.query_tokens, 14 + 17);
  EXPECT_EQ(s.counters.hit_tokens, 12);
  EXPECT_EQ(s.counters.query_blocks, 3 + 4);
  EXPECT_EQ(s.counters.hit_blocks, 3);
  EXPECT_EQ(s.blocks_cached, 4);  // a's 3, b's block 3 (b's block 4 is partial)
  EXPECT_EQ(s.blocks_idle, 0);
  // 2 layers x K,V x 4 tokens x 32 floats.
  EXPECT_EQ(s.bytes_per_block, 2 * 2 * 4 * 32 * 4);
  EXPECT_EQ(s.memory_saved_bytes, 3 * s.bytes_per_block);
  finish(a);
  finish(b);
  EXPECT_EQ(pc->stats().memory_saved_bytes, 0);
  EXPECT_EQ(pc->stats().blocks_idle, 4);
}

TEST_F(PrefixCacheTest, TheLastPromptTokenIsAlwaysRecomputed) {
  make(10);
  Seq a = admit(toks(1, 12));
  EXPECT_EQ(admit(toks(1, 12)).match.cached_blocks, 2);  // 3 cached, but block 3 holds the last token
  EXPECT_EQ(admit(toks(1, 13)).match.cached_blocks, 3);
  EXPECT_EQ(admit(toks(1, 3)).match.cached_blocks, 0);
}

TEST_F(PrefixCacheTest, PartialBlocksAreNeverPublished) {
  make(10);
  Seq a = admit(toks(1, 6));
  EXPECT_EQ(pc->stats().blocks_cached, 1);
  prefill(a, 1);  // 7 tokens: block 1 still partial
  EXPECT_EQ(pc->stats().blocks_cached, 1);
  prefill(a, 1);  // 8: now full
  EXPECT_EQ(pc->stats().blocks_cached, 1);  // keys cover only the first 6 tokens
  a.tokens = toks(1, 8);
  pc->block_keys(a.scope, a.tokens, a.keys);
  pc->publish(a.scope, a.table, a.keys);
  EXPECT_EQ(pc->stats().blocks_cached, 2);
  finish(a);
  EXPECT_EQ(cache->stats().blocks_cached_idle, 2);
}

TEST_F(PrefixCacheTest, IdleBlocksAreReclaimedTailFirstOnlyWhenNoFreeBlockIsLeft) {
  make(8);
  Seq a = admit(toks(1, 12));
  finish(a);
  EXPECT_EQ(cache->stats().blocks_free, 5);
  EXPECT_EQ(cache->stats().blocks_cached_idle, 3);
  pc->drain_events();
  BlockTable u;  // a sequence without prefix caching
  ASSERT_TRUE(cache->reserve(u, 20));
  EXPECT_EQ(u.blocks, (std::vector<int32_t>{3, 4, 5, 6, 7}));
  EXPECT_TRUE(removed().empty());
  ASSERT_TRUE(cache->reserve(u, 24));  // no free block left: the chain's tail goes
  EXPECT_EQ(u.blocks.back(), 2);
  EXPECT_EQ(removed(), (std::vector<int32_t>{2}));
  cache->release(u);  // tail first, each to the head: free queue 3, 4, 5, 6, 7, 2
  Seq b = admit(concat(toks(1, 12), {99}));
  EXPECT_EQ(b.match.cached_blocks, 2);
  EXPECT_EQ(b.table.blocks, (std::vector<int32_t>{0, 1, 3, 4}));
  finish(b);
}

TEST_F(PrefixCacheTest, LruEvictsTheLeastRecentlyUsedChainFirst) {
  make(6);
  Seq a = admit(toks(1, 8));  // blocks 0, 1
  finish(a);
  clock.set(1.0);
  Seq b = admit(toks(50, 8));  // blocks 2, 3
  finish(b);
  clock.set(2.0);
  Seq a2 = admit(toks(1, 9));  // hits a's chain: now the most recent
  EXPECT_EQ(a2.table.blocks, (std::vector<int32_t>{0, 1, 4}));
  finish(a2);
  pc->drain_events();
  BlockTable u;
  ASSERT_TRUE(cache->reserve(u, 24));
  // The four idle blocks are reclaimed first (b's chain, then a's, tail
  // first), each to the head of the free queue, then all six are taken.
  EXPECT_EQ(u.blocks, (std::vector<int32_t>{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(removed(), (std::vector<int32_t>{3, 2, 1, 0}));
  cache->release(u);
}

TEST_F(PrefixCacheTest, LfuWithAgingKeepsFrequentBlocksUntilTheirCountDecays) {
  PrefixCacheOptions o;
  o.eviction.kind = EvictionKind::LfuAging;
  o.eviction.half_life_seconds = 10.0;
  for (double b_time : {1.0, 30.0}) {
    make(4, o);
    clock.set(0.0);
    for (int i = 0; i < 4; ++i) {  // stored, then hit three times: count 4
      Seq a = admit(toks(1, 5));
      EXPECT_EQ(a.match.cached_blocks, i == 0 ? 0 : 1);
      finish(a);
    }
    clock.set(b_time);
    Seq b = admit(toks(50, 5));  // count 1; a's open block 1 was freed and is reused
    EXPECT_EQ(b.table.blocks, (std::vector<int32_t>{1, 2}));
    finish(b);
    pc->drain_events();
    BlockTable u;
    ASSERT_TRUE(cache->reserve(u, 16));
    // At 1 s, b's single access is worth less than a's four; at 30 s a's four
    // have decayed to half an access.
    if (b_time == 1.0) EXPECT_EQ(removed(), (std::vector<int32_t>{1, 0}));
    else EXPECT_EQ(removed(), (std::vector<int32_t>{0, 1}));
    cache->release(u);
  }
}

TEST_F(PrefixCacheTest, TtlExpiresIdleBlocksButNeverBlocksInUse) {
  PrefixCacheOptions o;
  o.eviction.kind = EvictionKind::Ttl;
  o.eviction.ttl_seconds = 100.0;
  make(8, o);
  Seq running = admit(toks(200, 5));  // stays in use
  Seq a = admit(toks(1, 5));
  finish(a);
  clock.set(50.0);
  Seq b = admit(toks(50, 5));
  finish(b);
  pc->drain_events();
  clock.set(100.0);
  EXPECT_EQ(pc->expire(), 1);
  EXPECT_EQ(removed(), (std::vector<int32_t>{2}));  // a's block; b's lives until 150
  EXPECT_EQ(admit(toks(1, 5)).match.cached_blocks, 0);
  clock.set(160.0);
  // b expired at 150: a match reaching it drops it instead of hitting.
  EXPECT_EQ(admit(toks(50, 5)).match.cached_blocks, 0);
  const PrefixCacheStats s = pc->stats();
  EXPECT_EQ(s.counters.blocks_expired, 2);
  EXPECT_EQ(s.counters.blocks_evicted, 0);
  clock.set(1000.0);
  pc->expire();
  Seq again = admit(toks(200, 5));
  EXPECT_EQ(again.match.cached_blocks, 1);  // in use all along: never expired
  finish(running);
}

TEST_F(PrefixCacheTest, PinnedPrefixSurvivesABurstOfOneOffRequests) {
  make(10);  // pin cap: 20% of 10 blocks
  Seq hot = admit(toks(1, 13));
  finish(hot);
  EXPECT_EQ(pc->pin(hot.scope, hot.keys), 2);  // the cap stops the third block
  PrefixCacheStats s = pc->stats();
  EXPECT_EQ(s.pin_cap_blocks, 2);
  EXPECT_EQ(s.blocks_pinned, 2);
  EXPECT_EQ(cache->pool().ref_count(0), 1);
  for (int32_t i = 0; i < 40; ++i) {  // 80 one-off blocks through a pool of 10
    clock.advance(1.0);
    Seq once = admit(toks(1000 + 20 * i, 9));
    finish(once);
  }
  Seq again = admit(toks(1, 13));
  EXPECT_EQ(again.match.cached_blocks, 2);
  EXPECT_EQ(std::vector<int32_t>(again.table.blocks.begin(), again.table.blocks.begin() + 2),
            (std::vector<int32_t>{0, 1}));
  finish(again);
  pc->unpin(hot.scope, hot.keys);
  EXPECT_EQ(pc->stats().blocks_pinned, 0);
  EXPECT_EQ(cache->pool().ref_count(0), 0);  // idle again, evictable
}

TEST_F(PrefixCacheTest, HotPrefixesArePinnedAutomaticallyUpToTheCap) {
  PrefixCacheOptions o;
  o.pin_after_hits = 2;
  make(10, o);
  for (int i = 0; i < 3; ++i) {
    Seq hot = admit(toks(1, 13));
    finish(hot);
    EXPECT_EQ(pc->stats().blocks_pinned, i < 2 ? 0 : 2);
  }
  for (int32_t i = 0; i < 40; ++i) {
    Seq once = admit(toks(1000 + 20 * i, 9));
    finish(once);
  }
  EXPECT_EQ(admit(toks(1, 13)).match.cached_blocks, 2);
}

TEST_F(PrefixCacheTest, QuotaLimitsATenantsCachedBlocks) {
  make(16);
  CacheScope t{CacheScopeKind::Tenant, pc->add_tenant({"t", "salt-t", 2, 1.0}), ""};
  Seq a = admit(toks(1, 17), t);  // 4 full blocks, 2 cached
  EXPECT_EQ(pc->stats().tenants[size_t(t.tenant)].blocks_cached, 2);
  finish(a);
  pc->drain_events();
  Seq b = admit(toks(100, 9), t);  // its 2 blocks replace a's, tail first
  std::vector<std::pair<CacheEventKind, int32_t>> events;
  for (const CacheEvent& e : pc->drain_events()) {
    events.emplace_back(e.kind, e.block);
    if (e.kind == CacheEventKind::Removed) {
      EXPECT_EQ(e.reason, CacheRemoveReason::Quota);
    }
  }
  using K = CacheEventKind;
  EXPECT_EQ(events, (std::vector<std::pair<K, int32_t>>{
                        {K::Removed, 1}, {K::Stored, b.table.blocks[0]}, {K::Removed, 0}, {K::Stored, b.table.blocks[1]}}));
  const PrefixCacheTenantStats ts = pc->stats().tenants[size_t(t.tenant)];
  EXPECT_EQ(ts.blocks_cached, 2);
  EXPECT_EQ(ts.counters.blocks_evicted, 2);
  EXPECT_EQ(ts.quota_blocks, 2);
  // Quota full of blocks in use: nothing more is cached, nothing evicted.
  Seq c = admit(toks(300, 9), t);
  EXPECT_EQ(pc->stats().tenants[size_t(t.tenant)].blocks_cached, 2);
  EXPECT_EQ(admit(toks(300, 9), t).match.cached_blocks, 0);
  finish(b);
  finish(c);
}

TEST_F(PrefixCacheTest, TenantsNeverHitEachOthersBlocks) {
  make(32);
  CacheScope a{CacheScopeKind::Tenant, pc->add_tenant({"a", "secret-a", -1, 1.0}), ""};
  CacheScope b{CacheScopeKind::Tenant, pc->add_tenant({"b", "secret-b", -1, 1.0}), ""};
  const std::vector<int32_t> prompt = toks(1, 13);
  Seq first = admit(prompt, a);
  EXPECT_EQ(pc->stats().blocks_cached, 3);
  Seq other = admit(prompt, b);
  EXPECT_EQ(other.match.cached_tokens, 0);
  for (size_t i = 0; i < 3; ++i) EXPECT_NE(other.keys[i], first.keys[i]);
  // Even with a's keys (which the server never hands out), b gets nothing.
  BlockTable forged;
  EXPECT_EQ(pc->match(b, first.keys, 13, forged).cached_tokens, 0);
  EXPECT_EQ(admit(prompt).match.cached_tokens, 0);  // global scope
  EXPECT_EQ(admit(prompt, a).match.cached_tokens, 12);
  // Sessions of one tenant are separate too.
  CacheScope s1{CacheScopeKind::Session, a.tenant, "s1"}, s2{CacheScopeKind::Session, a.tenant, "s2"};
  Seq in_s1 = admit(prompt, s1);
  EXPECT_EQ(admit(prompt, s2).match.cached_tokens, 0);
  EXPECT_EQ(admit(prompt, s1).match.cached_tokens, 12);
  const PrefixCacheStats s = pc->stats();
  EXPECT_EQ(s.tenants[size_t(b.tenant)].counters.hit_tokens, 0);
  EXPECT_EQ(s.tenants[size_t(a.tenant)].counters.hit_tokens, 24);
  // The same salt gives the same keys: salts, not tenant ids, name blocks.
  make(4);
  CacheScope again{CacheScopeKind::Tenant, pc->add_tenant({"a", "secret-a", -1, 1.0}), ""};
  std::vector<BlockKey> keys;
  pc->block_keys(again, prompt, keys);
  EXPECT_EQ(keys, first.keys);
}

TEST_F(PrefixCacheTest, EvictionTakesFromTheTenantMostOverItsShare) {
  for (double b_weight : {1.0, 0.2}) {
    make(8);
    const TenantId a = pc->add_tenant({"a", "", -1, 1.0});
    const TenantId b = pc->add_tenant({"b", "", -1, b_weight});
    Seq old = admit(toks(1, 5), {CacheScopeKind::Tenant, b, ""});  // 1 block, least recent
    finish(old);
    clock.advance(1.0);
    Seq big = admit(toks(1, 17), {CacheScopeKind::Tenant, a, ""});  // 4 blocks
    finish(big);
    pc->drain_events();
    BlockTable u;
    ASSERT_TRUE(cache->reserve(u, 16));  // 3 free blocks, then one eviction
    const std::vector<CacheEvent> ev = pc->drain_events();
    ASSERT_EQ(ev.size(), 1u);
    // Equal weights: a holds 4 blocks to b's 1, so a's tail goes though b's
    // block is older. At weight 0.2 b's one block counts as 5.
    EXPECT_EQ(ev[0].tenant, b_weight == 1.0 ? a : b);
    EXPECT_EQ(ev[0].depth, b_weight == 1.0 ? 3 : 0);
    cache->release(u);
  }
}

TEST_F(PrefixCacheTest, ResidualWindowHitsWaitForTheFp16FormOfTheBoundaryBlocks) {
  make(32, {}, "int4");  // residual 8 tokens = 2 blocks: 1 full block read in FP16
  ASSERT_EQ(cache->staged_before(3), 1);
  const std::vector<int32_t> shared = toks(1, 12);
  Seq a = admit(concat(shared, toks(100, 6)));  // 18 tokens: blocks 0-2 sealed, 3 in staging
  EXPECT_EQ(pc->stats().blocks_cached, 3);
  finish(a);  // seals block 3 and keeps its FP16 form
  PrefixCacheStats s = pc->stats();
  EXPECT_EQ(s.blocks_cached, 4);
  EXPECT_EQ(s.sidecars, 1);

  // b diverges after block 2, which has no FP16 form: no hit, but a checkpoint.
  Seq b;
  b.tokens = concat(shared, toks(200, 6));
  pc->block_keys(b.scope, b.tokens, b.keys);
  b.match = pc->match(b.scope, b.keys, 18, b.table);
  EXPECT_EQ(b.match.cached_tokens, 0);
  EXPECT_EQ(b.match.checkpoint_tokens, 12);
  prefill(b, 12);  // the chunk ends at the checkpoint: b's block 2 is full, in staging
  EXPECT_EQ(pc->stats().sidecars, 2);
  prefill(b, 6);

  Seq c;
  c.tokens = concat(shared, toks(300, 6));
  pc->block_keys(c.scope, c.tokens, c.keys);
  c.match = pc->match(c.scope, c.keys, 18, c.table);
  EXPECT_EQ(c.match.cached_blocks, 3);
  EXPECT_EQ(c.match.checkpoint_tokens, 0);
  // a's blocks; block 2's FP16 form is the staging slot b left (slot 1).
  EXPECT_EQ(std::vector<int32_t>(c.table.blocks.begin(), c.table.blocks.begin() + 3),
            (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(std::vector<int32_t>(c.table.staging.begin(), c.table.staging.begin() + 3),
            (std::vector<int32_t>{-1, -1, 1}));
  prefill(c, 6);
  EXPECT_EQ(c.table.staging[2], -1);  // sealed long ago: c let go of the FP16 form
  EXPECT_EQ(pc->stats().sidecars, 2);
  // A continuation of a (the next turn) hits all of a's full blocks: the last
  // one's FP16 form was kept when a finished.
  Seq next_turn = admit(concat(concat(shared, toks(100, 4)), toks(400, 3)));
  EXPECT_EQ(next_turn.match.cached_blocks, 4);
  finish(b);
  finish(c);
  finish(next_turn);
}

TEST_F(PrefixCacheTest, EventsStatsAndJson) {
  PrefixCacheOptions o;
  o.max_events = 2;
  make(8, o);
  std::vector<CacheEvent> heard;
  pc->set_event_listener([&heard](const CacheEvent& e) { heard.push_back(e); });
  clock.set(7.0);
  Seq a = admit(toks(1, 13));
  EXPECT_EQ(heard.size(), 3u);
  const std::vector<CacheEvent> queued = pc->drain_events();
  ASSERT_EQ(queued.size(), 2u);  // the oldest dropped
  EXPECT_EQ(queued[0].block, 1);
  EXPECT_EQ(queued[1].block, 2);
  EXPECT_EQ(pc->stats().events_dropped, 1);
  Seq b = admit(toks(1, 13));

  const nlohmann::json j = to_json(pc->stats());
  EXPECT_EQ(j["queries"], 2);
  EXPECT_EQ(j["hit_tokens"], 12);
  EXPECT_EQ(j["query_tokens"], 26);
  EXPECT_DOUBLE_EQ(j["token_hit_rate"].get<double>(), 12.0 / 26.0);
  EXPECT_DOUBLE_EQ(j["block_hit_rate"].get<double>(), 0.5);
  EXPECT_EQ(j["blocks_cached"], 3);
  EXPECT_EQ(j["memory_saved_bytes"], 3 * 2048);
  EXPECT_EQ(j["hash"], "xxh3");
  EXPECT_EQ(j["policy"], "lru");
  ASSERT_EQ(j["tenants"].size(), 1u);
  EXPECT_EQ(j["tenants"][0]["name"], "global");
  EXPECT_EQ(j["tenants"][0]["hit_blocks"], 3);
  EXPECT_EQ(to_json(b.match)["cached_tokens"], 12);
  const nlohmann::json e = to_json(heard[1], BlockHashAlgo::Xxh3_128);
  EXPECT_EQ(e["kind"], "stored");
  EXPECT_EQ(e["key"], a.keys[1].hex(BlockHashAlgo::Xxh3_128));
  EXPECT_EQ(e["parent"], a.keys[0].hex(BlockHashAlgo::Xxh3_128));
  EXPECT_EQ(e["depth"], 1);
  EXPECT_EQ(e["time"], 7.0);
  EXPECT_EQ(to_json(heard[0], BlockHashAlgo::Xxh3_128)["parent"], "");
  finish(a);
  finish(b);
  pc->set_event_listener(nullptr);  // heard dies before the fixture's cache
}

TEST_F(PrefixCacheTest, DestroyingTheCacheFreesIdleBlocksAndReleasesTheRest) {
  make(8);
  Seq a = admit(toks(1, 12));
  Seq b = admit(toks(50, 12));
  finish(b);
  EXPECT_EQ(cache->stats().blocks_cached_idle, 3);
  pc.reset();
  EXPECT_EQ(cache->stats().blocks_free, 5);
  EXPECT_EQ(cache->stats().blocks_cached_idle, 0);
  cache->release(a.table);
  EXPECT_EQ(cache->stats().blocks_free, 8);
  // Without a prefix cache, reserve works as before.
  BlockTable t;
  EXPECT_TRUE(cache->reserve(t, 32));
  EXPECT_FALSE(cache->reserve(t, 33));
}

TEST_F(PrefixCacheTest, RejectsBadOptionsAndScopes) {
  make(4);
  KvCacheOptions ko;
  ko.block_size = 4;
  ko.num_blocks = 4;
  KvCache other(stories_shape(2), ko);
  PrefixCacheOptions o;
  EXPECT_THROW({ PrefixCache p(other, o, clock); }, Error);  // no model id
  o.model_id = "m";
  o.max_pinned_fraction = 1.5;
  EXPECT_THROW({ PrefixCache p(other, o, clock); }, Error);
  EXPECT_THROW(pc->add_tenant({"w", "", -1, 0.0}), Error);
  std::vector<BlockKey> keys;
  EXPECT_THROW(pc->block_keys({CacheScopeKind::Tenant, 7, ""}, toks(1, 8), keys), Error);
  EXPECT_THROW(pc->block_keys({CacheScopeKind::Tenant, kGlobalTenant, ""}, toks(1, 8), keys), Error);
  const TenantId t = pc->add_tenant({"t", "", -1, 1.0});
  EXPECT_THROW(pc->block_keys({CacheScopeKind::Session, t, ""}, toks(1, 8), keys), Error);
  EXPECT_EQ(parse_cache_scope("session"), CacheScopeKind::Session);
  EXPECT_THROW(parse_cache_scope("everyone"), Error);
}

}  // namespace
}  // namespace kvserve
