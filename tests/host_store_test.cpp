// The host-memory tier, its LRU index and the tier metrics: exact bytes back,
// exact eviction order under the byte budget, exact counters.
#include "store/host_store.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <thread>

#include "store/lru_index.h"
#include "util/error.h"

namespace kvserve {
namespace {

BlockKey key_of(uint64_t n) {
  uint8_t b[8];
  std::memcpy(b, &n, 8);
  return BlockKey::from_bytes(b);
}

Bytes block_of(size_t n, uint8_t fill) {
  Bytes b(n);
  for (size_t i = 0; i < n; ++i) b[i] = uint8_t(fill + i);
  return b;
}

std::vector<BlockKey> keys_of(std::initializer_list<uint64_t> ids) {
  std::vector<BlockKey> out;
  for (uint64_t id : ids) out.push_back(key_of(id));
  return out;
}

// Puts one block per key, block i filled from i.
void put_blocks(KvStore& s, std::initializer_list<uint64_t> ids, size_t bytes) {
  std::vector<Bytes> blocks;
  std::vector<ByteView> views;
  for (uint64_t id : ids) blocks.push_back(block_of(bytes, uint8_t(id)));
  for (const Bytes& b : blocks) views.push_back(b);
  EXPECT_EQ(s.put(keys_of(ids), views), ids.size());
}

TEST(LruIndex, PopsLeastRecentlyUsedFirstAndTracksBytes) {
  LruIndex<int> index;
  index.insert(key_of(1), 10, 100);
  index.insert(key_of(2), 20, 200);
  index.insert(key_of(3), 30, 300);
  EXPECT_EQ(index.bytes(), 600u);
  ASSERT_NE(index.touch(key_of(1)), nullptr);  // order now 2, 3, 1
  const auto replaced = index.insert(key_of(3), 31, 50);  // replacing makes it most recent: 2, 1, 3
  ASSERT_TRUE(replaced);
  EXPECT_EQ(replaced->value, 30);
  EXPECT_EQ(index.bytes(), 350u);
  EXPECT_EQ(index.pop_lru()->key, key_of(2));
  EXPECT_EQ(index.pop_lru()->key, key_of(1));
  const auto last = index.pop_lru();
  EXPECT_EQ(last->value, 31);
  EXPECT_FALSE(index.pop_lru());
  EXPECT_EQ(index.bytes(), 0u);
  EXPECT_EQ(index.size(), 0u);
}

TEST(HostStore, RoundTripsExactBytesAndCountsHitsAndMisses) {
  HostStore s({.budget_bytes = 1 << 20});
  put_blocks(s, {1, 2, 3}, 1000);
  const auto got = s.get(keys_of({1, 4, 3}));
  ASSERT_EQ(got.size(), 3u);
  EXPECT_EQ(got[0], block_of(1000, 1));
  EXPECT_FALSE(got[1]);
  EXPECT_EQ(got[2], block_of(1000, 3));
  const TierStats st = s.stats();
  EXPECT_EQ(st.name, "host");
  EXPECT_EQ(st.hits, 2u);
  EXPECT_EQ(st.misses, 1u);
  EXPECT_EQ(st.bytes_read, 2000u);
  EXPECT_EQ(st.puts, 3u);
  EXPECT_EQ(st.bytes_written, 3000u);
  EXPECT_EQ(st.resident_blocks, 3);
  EXPECT_EQ(st.resident_bytes, 3000);
  EXPECT_EQ(st.capacity_bytes, 1 << 20);
  EXPECT_EQ(st.get_latency.count, 1u);
  EXPECT_EQ(st.put_latency.count, 1u);
}

TEST(HostStore, EvictsLeastRecentlyUsedToStayWithinBudget) {
  HostStore s({.budget_bytes = 300});
  put_blocks(s, {0, 1, 2}, 100);
  (void)s.get(keys_of({0}));       // 0 becomes the most recent: order 1, 2, 0
  put_blocks(s, {3}, 100);         // evicts 1
  EXPECT_EQ(s.keys_lru_first(), keys_of({2, 0, 3}));
  put_blocks(s, {4}, 200);         // evicts 2 and 0
  EXPECT_EQ(s.keys_lru_first(), keys_of({3, 4}));
  EXPECT_EQ(s.contains(keys_of({0, 1, 2, 3, 4})), (std::vector<bool>{false, false, false, true, true}));
  const TierStats st = s.stats();
  EXPECT_EQ(st.evictions, 3u);
  EXPECT_EQ(st.resident_bytes, 300);
}

TEST(HostStore, ContainsDoesNotRefreshRecency) {
  HostStore s({.budget_bytes = 200});
  put_blocks(s, {0, 1}, 100);
  EXPECT_EQ(s.contains(keys_of({0})), (std::vector<bool>{true}));
  put_blocks(s, {2}, 100);
  EXPECT_EQ(s.keys_lru_first(), keys_of({1, 2}));
}

TEST(HostStore, RejectsABlockLargerThanTheBudget) {
  HostStore s({.budget_bytes = 100});
  put_blocks(s, {0}, 60);
  const Bytes big = block_of(101, 0);
  const ByteView view = big;
  EXPECT_EQ(s.put(keys_of({1}), std::span(&view, 1)), 0u);
  EXPECT_EQ(s.stats().rejected, 1u);
  EXPECT_EQ(s.keys_lru_first(), keys_of({0}));  // nothing was evicted for it
  EXPECT_THROW(HostStore({.budget_bytes = 0}), Error);
}

TEST(HostStore, LeadingLookupStopsAtTheFirstMiss) {
  HostStore s({.budget_bytes = 1 << 20});
  put_blocks(s, {0, 1, 3}, 10);
  const auto got = s.get_leading(keys_of({0, 1, 2, 3}));
  EXPECT_TRUE(got[0] && got[1]);
  EXPECT_FALSE(got[2]);
  EXPECT_FALSE(got[3]);  // present, but after the miss
  const TierStats st = s.stats();
  EXPECT_EQ(st.hits, 2u);
  EXPECT_EQ(st.misses, 1u);
  // 3 was not touched: it is still the least recent after 0 and 1 were read.
  EXPECT_EQ(s.keys_lru_first(), keys_of({3, 0, 1}));
}

TEST(HostStore, RemoveAndReplace) {
  HostStore s({.budget_bytes = 1000});
  put_blocks(s, {0, 1}, 100);
  s.remove(keys_of({0, 7}));
  EXPECT_EQ(s.contains(keys_of({0, 1})), (std::vector<bool>{false, true}));
  const Bytes v = block_of(50, 9);
  const ByteView view = v;
  EXPECT_EQ(s.put(keys_of({1}), std::span(&view, 1)), 1u);
  EXPECT_EQ(s.get(keys_of({1}))[0], v);
  EXPECT_EQ(s.stats().resident_bytes, 50);
  EXPECT_EQ(s.stats().removes, 2u);
}

TEST(HostStore, ConcurrentReadersAndWritersStayWithinBudget) {
  HostStore s({.budget_bytes = 64 * 1000});
  std::atomic<bool> bad{false};
  std::thread writer([&] {
    for (uint64_t i = 0; i < 2000; ++i) {
      const Bytes b = block_of(1000, uint8_t(i));
      const ByteView v = b;
      const BlockKey k = key_of(i % 200);
      (void)s.put(std::span(&k, 1), std::span(&v, 1));
    }
  });
  std::thread reader([&] {
    for (uint64_t i = 0; i < 2000; ++i) {
      const auto got = s.get(std::vector<BlockKey>{key_of(i % 200)});
      if (got[0] && got[0]->size() != 1000) bad = true;
    }
  });
  writer.join();
  reader.join();
  EXPECT_FALSE(bad);
  EXPECT_LE(s.stats().resident_bytes, 64 * 1000);
  EXPECT_EQ(s.stats().resident_blocks, 64);
}

TEST(LatencyHistogram, BucketsArePowersOfTwoMicroseconds) {
  LatencyHistogram h;
  h.record(0.5e-6);  // < 1 us
  h.record(1.5e-6);  // [1, 2) us
  h.record(3e-6);    // [2, 4) us
  h.record(3e-6);
  h.record(100.0);   // past the last bound
  const LatencySnapshot s = h.snapshot();
  EXPECT_EQ(s.count, 5u);
  EXPECT_EQ(s.counts[0], 1u);
  EXPECT_EQ(s.counts[1], 1u);
  EXPECT_EQ(s.counts[2], 2u);
  EXPECT_EQ(s.counts[LatencySnapshot::kBuckets - 1], 1u);
  EXPECT_NEAR(s.sum_seconds, 100.0 + 8e-6, 1e-9);
  EXPECT_DOUBLE_EQ(s.quantile_seconds(0.5), 4e-6);
  EXPECT_DOUBLE_EQ(s.quantile_seconds(0.2), 1e-6);
  EXPECT_TRUE(std::isinf(s.quantile_seconds(1.0)));
  EXPECT_EQ(LatencySnapshot{}.quantile_seconds(0.5), 0.0);
}

}  // namespace
}  // namespace kvserve
