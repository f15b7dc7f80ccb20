// Eviction policies: exact priorities for given histories, LFU's aging and the
// TTL boundary.
#include "kv/eviction_policy.h"

#include <gtest/gtest.h>

#include <cmath>

#include "util/error.h"

namespace kvserve {
namespace {

// What the prefix cache does on an access.
void access(const EvictionPolicy& p, BlockMeta& m, double now) {
  p.touch(m, now);
  m.last_access = now;
}

TEST(EvictionPolicy, LruOrdersByLastAccess) {
  LruPolicy lru;
  BlockMeta a, b;
  access(lru, a, 5.0);
  access(lru, b, 3.0);
  access(lru, b, 7.0);
  EXPECT_EQ(lru.priority(a), 5.0);
  EXPECT_EQ(lru.priority(b), 7.0);
  EXPECT_FALSE(lru.expired(a, 1e9));
}

TEST(EvictionPolicy, LfuCountsHalveEveryHalfLife) {
  LfuAgingPolicy lfu(10.0);
  BlockMeta hot, cold;
  for (int i = 0; i < 4; ++i) access(lfu, hot, 0.0);
  EXPECT_DOUBLE_EQ(hot.score, 4.0);
  EXPECT_DOUBLE_EQ(lfu.priority(hot), 2.0);  // log2(4) + 0 / 10
  // One access 10 s later: the old four count as two.
  BlockMeta again = hot;
  access(lfu, again, 10.0);
  EXPECT_DOUBLE_EQ(again.score, 3.0);
  // A single access is worth less than four until 20 s have passed (4 -> 1).
  access(lfu, cold, 19.0);
  EXPECT_LT(lfu.priority(cold), lfu.priority(hot));
  BlockMeta late;
  access(lfu, late, 21.0);
  EXPECT_GT(lfu.priority(late), lfu.priority(hot));
  EXPECT_THROW(LfuAgingPolicy(0.0), Error);
}

TEST(EvictionPolicy, TtlExpiresAtLastAccessPlusTtl) {
  TtlPolicy ttl(100.0);
  BlockMeta m;
  access(ttl, m, 50.0);
  EXPECT_EQ(ttl.priority(m), 150.0);
  EXPECT_FALSE(ttl.expired(m, 149.9));
  EXPECT_TRUE(ttl.expired(m, 150.0));
  EXPECT_THROW(TtlPolicy(-1.0), Error);
}

TEST(EvictionPolicy, FactoryAndNames) {
  for (const char* name : {"lru", "lfu", "ttl"}) {
    EvictionOptions o;
    o.kind = parse_eviction_kind(name);
    EXPECT_EQ(eviction_kind_name(o.kind), name);
    EXPECT_EQ(make_eviction_policy(o)->name(), name);
  }
  EXPECT_THROW(parse_eviction_kind("fifo"), Error);
  ManualClock clock(3.0);
  clock.advance(2.0);
  EXPECT_EQ(clock.now(), 5.0);
}

}  // namespace
}  // namespace kvserve
