// The pool of physical KV blocks. A block id names the same slot in every
// layer's arena (as in vLLM), so one block table per sequence covers all layers.
//
// Invariant: every block id in [0, num_blocks) is either free (on the free
// queue, ref_count 0) or in use (ref_count >= 1), never both. The free queue is
// an intrusive doubly-linked list over block ids so a block can leave it from
// the middle in O(1) — the prefix cache needs that to revive a cached block.
// Allocation takes from the head (least recently freed first).
//
// Running out of blocks is an ordinary result (an empty optional / false), not
// an exception: the scheduler decides what to do about it.
//
// Thread safety: none; owned by one engine thread.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

namespace kvserve {

class BlockPool {
 public:
  explicit BlockPool(int32_t num_blocks);

  int32_t num_blocks() const { return num_blocks_; }
  int32_t num_free() const { return num_free_; }
  int32_t num_used() const { return num_blocks_ - num_free_; }

  // Takes the block at the head of the free queue with ref_count 1, or nullopt
  // when none is free.
  [[nodiscard]] std::optional<int32_t> allocate();
  // Takes n blocks or none at all; returns false (and changes nothing) when
  // fewer than n are free.
  [[nodiscard]] bool allocate(int32_t n, std::vector<int32_t>& out);

  // Adds a reference to a block in use (sharing).  REQUIRES: ref_count(id) > 0.
  void retain(int32_t id);
  // Drops a reference; at zero the block goes to the tail of the free queue.
  // REQUIRES: ref_count(id) > 0.
  void release(int32_t id);

  int32_t ref_count(int32_t id) const { return ref_count_[size_t(id)]; }

 private:
  void push_free_tail(int32_t id);
  void unlink_free(int32_t id);

  static constexpr int32_t kNone = -1;
  int32_t num_blocks_;
  int32_t num_free_ = 0;
  std::vector<int32_t> ref_count_;  // (num_blocks)
  std::vector<int32_t> prev_free_;  // (num_blocks) free-queue links, kNone at the ends
  std::vector<int32_t> next_free_;  // (num_blocks)
  int32_t free_head_ = kNone;
  int32_t free_tail_ = kNone;
};

}  // namespace kvserve
