// The pool of physical KV blocks. A block id names the same slot in every
// layer's arena (as in vLLM), so one block table per sequence covers all layers.
//
// Invariant: every block id in [0, num_blocks) is in exactly one state:
//   free    on the free queue, ref_count 0, holds nothing
//   in use  ref_count >= 1 (tables, pins)
//   idle    ref_count 0 but cached: it holds a prefix-cache block that no one
//           references; it stays out of the free queue so its content can be
//           reused, and is handed back to the free queue only when the
//           reclaimer evicts it (lazily, when allocation finds no free block)
// The free queue is an intrusive doubly-linked list over block ids so a block
// can leave it from the middle in O(1). Freed blocks go to the head and
// allocation takes from the head: the most recently freed block first, whose
// pages are already committed, ahead of never-used blocks (ascending ids at
// the tail). A never-used block's first write faults its pages in (~3 ms per
// 16-token block of the 400M model in a VM), and reusing warm blocks keeps
// the resident size at the peak of blocks in use instead of growing to the
// whole pool.
//
// Running out of blocks is an ordinary result (an empty optional / false), not
// an exception: the scheduler decides what to do about it.
//
// Thread safety: none; owned by one engine thread (the reclaimer is called on
// the thread that allocates or releases).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

namespace kvserve {

// The owner of cached blocks (the prefix cache). It decides which idle block
// to evict; the pool only asks.
class BlockReclaimer {
 public:
  virtual ~BlockReclaimer() = default;
  // A cached block's last reference went: it is now idle (kept, evictable).
  virtual void on_idle(int32_t id) = 0;
  // Evicts exactly n idle blocks (BlockPool::evict each).  REQUIRES: n <= num_idle().
  virtual void reclaim(int32_t n) = 0;
};

class BlockPool {
 public:
  explicit BlockPool(int32_t num_blocks);

  int32_t num_blocks() const { return num_blocks_; }
  // Blocks on the free queue (holding nothing).
  int32_t num_free() const { return num_free_; }
  // Cached blocks no one references; allocation can reclaim them.
  int32_t num_idle() const { return num_idle_; }
  // Blocks an allocation can get: free plus reclaimable idle ones.
  int32_t num_available() const { return num_free_ + (reclaimer_ ? num_idle_ : 0); }
  // Blocks with ref_count >= 1.
  int32_t num_used() const { return num_blocks_ - num_free_ - num_idle_; }

  // Takes the block at the head of the free queue with ref_count 1 (reclaiming
  // an idle block first when the queue is empty), or nullopt when none is left.
  [[nodiscard]] std::optional<int32_t> allocate();
  // Takes n blocks or none at all; returns false (and changes nothing) when
  // fewer than n are available. Idle blocks are reclaimed only for the part
  // the free queue cannot cover.
  [[nodiscard]] bool allocate(int32_t n, std::vector<int32_t>& out);

  // Adds a reference (sharing). An idle block comes back into use; its owner
  // must already have dropped it from its eviction order.
  // REQUIRES: ref_count(id) > 0 or cached(id).
  void retain(int32_t id);
  // Drops a reference; at zero the block goes to the head of the free queue,
  // or, when cached, becomes idle and is reported to the reclaimer.
  // REQUIRES: ref_count(id) > 0.
  void release(int32_t id);

  int32_t ref_count(int32_t id) const { return ref_count_[size_t(id)]; }

  // ---- Cached blocks (the prefix cache's side) ----
  // Installs (or with nullptr removes) the owner of cached blocks.
  // REQUIRES when removing: no block is cached.
  void set_reclaimer(BlockReclaimer* reclaimer) { reclaimer_ = reclaimer; }
  bool cached(int32_t id) const { return cached_[size_t(id)] != 0; }
  // Marks a block in use as cached.  REQUIRES: ref_count(id) > 0, a reclaimer.
  void mark_cached(int32_t id);
  // Ends caching of a block in use: at ref_count 0 it will be freed.
  // REQUIRES: ref_count(id) > 0, cached(id).
  void unmark_cached(int32_t id);
  // Frees an idle block (the reclaimer evicting it): it leaves the cache and
  // goes to the head of the free queue.  REQUIRES: idle.
  void evict(int32_t id);

 private:
  void push_free_tail(int32_t id);
  void push_free_head(int32_t id);
  void unlink_free(int32_t id);

  static constexpr int32_t kNone = -1;
  int32_t num_blocks_;
  int32_t num_free_ = 0;
  int32_t num_idle_ = 0;
  std::vector<int32_t> ref_count_;  // (num_blocks)
  std::vector<uint8_t> cached_;     // (num_blocks) 1 when the reclaimer owns the block's content
  std::vector<int32_t> prev_free_;  // (num_blocks) free-queue links, kNone at the ends
  std::vector<int32_t> next_free_;  // (num_blocks)
  int32_t free_head_ = kNone;
  int32_t free_tail_ = kNone;
  BlockReclaimer* reclaimer_ = nullptr;
};

}  // namespace kvserve
