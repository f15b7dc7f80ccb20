// BlockPool's cached blocks: idle instead of free at ref count 0, revived by
// retain, reclaimed through the reclaimer only when the free queue is empty.
#include "kv/block_pool.h"

#include <gtest/gtest.h>

#include <deque>
#include <vector>

#include "util/error.h"

namespace kvserve {
namespace {

// Evicts idle blocks in the order they went idle.
class FifoReclaimer : public BlockReclaimer {
 public:
  explicit FifoReclaimer(BlockPool& pool) : pool_(pool) { pool.set_reclaimer(this); }
  void on_idle(int32_t id) override { idle.push_back(id); }
  void reclaim(int32_t n) override {
    for (int32_t i = 0; i < n; ++i) {
      evicted.push_back(idle.front());
      idle.pop_front();
      pool_.evict(evicted.back());
    }
  }
  std::deque<int32_t> idle;
  std::vector<int32_t> evicted;

 private:
  BlockPool& pool_;
};

TEST(BlockPoolCache, CachedBlockGoesIdleAndComesBackWithItsId) {
  BlockPool pool(3);
  FifoReclaimer r(pool);
  const int32_t a = *pool.allocate(), b = *pool.allocate();
  pool.mark_cached(a);
  pool.release(a);
  pool.release(b);
  EXPECT_EQ(r.idle, (std::deque<int32_t>{a}));
  EXPECT_EQ(pool.num_idle(), 1);
  EXPECT_EQ(pool.num_free(), 2);
  EXPECT_EQ(pool.num_used(), 0);
  EXPECT_EQ(pool.num_available(), 3);
  // A hit revives it: the reclaimer forgets it, retain takes it back.
  r.idle.clear();
  pool.retain(a);
  EXPECT_EQ(pool.ref_count(a), 1);
  EXPECT_EQ(pool.num_idle(), 0);
  EXPECT_EQ(pool.num_used(), 1);
  EXPECT_TRUE(pool.cached(a));
}

TEST(BlockPoolCache, AllocationReclaimsOnlyWhatTheFreeQueueLacks) {
  BlockPool pool(3);
  FifoReclaimer r(pool);
  std::vector<int32_t> ids;
  ASSERT_TRUE(pool.allocate(3, ids));
  pool.mark_cached(0);
  pool.mark_cached(1);
  for (int32_t id : ids) pool.release(id);
  EXPECT_EQ(r.idle, (std::deque<int32_t>{0, 1}));
  EXPECT_EQ(*pool.allocate(), 2);  // the free block first, nothing evicted
  EXPECT_TRUE(r.evicted.empty());
  EXPECT_EQ(*pool.allocate(), 0);  // then an idle one, through the reclaimer
  EXPECT_EQ(r.evicted, (std::vector<int32_t>{0}));
  EXPECT_FALSE(pool.cached(0));
  std::vector<int32_t> more;
  EXPECT_FALSE(pool.allocate(2, more));  // all or nothing: no eviction either
  EXPECT_EQ(r.evicted.size(), 1u);
  ASSERT_TRUE(pool.allocate(1, more));
  EXPECT_EQ(more, (std::vector<int32_t>{1}));
  EXPECT_FALSE(pool.allocate().has_value());
}

TEST(BlockPoolCache, UnmarkedBlockIsFreedAtItsLastRelease) {
  BlockPool pool(2);
  FifoReclaimer r(pool);
  const int32_t a = *pool.allocate();
  pool.mark_cached(a);
  pool.retain(a);
  pool.unmark_cached(a);
  pool.release(a);
  pool.release(a);
  EXPECT_TRUE(r.idle.empty());
  EXPECT_EQ(pool.num_free(), 2);
}

TEST(BlockPoolCache, IdleBlocksAreNotAvailableWithoutAReclaimer) {
  BlockPool pool(1);
  EXPECT_EQ(pool.num_available(), 1);
  EXPECT_THROW(BlockPool(-3), Error);
}

}  // namespace
}  // namespace kvserve
