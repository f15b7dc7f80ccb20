#include "kv/block_pool.h"

#include <algorithm>
#include <cassert>

#include "util/error.h"

namespace kvserve {

BlockPool::BlockPool(int32_t num_blocks)
    : num_blocks_(num_blocks),
      ref_count_(size_t(std::max(num_blocks, 0)), 0),
      cached_(size_t(std::max(num_blocks, 0)), 0),
      prev_free_(size_t(std::max(num_blocks, 0)), kNone),
      next_free_(size_t(std::max(num_blocks, 0)), kNone) {
  if (num_blocks <= 0) fail("KV block pool needs at least one block (got {})", num_blocks);
  for (int32_t id = 0; id < num_blocks; ++id) push_free_tail(id);
}

void BlockPool::push_free_tail(int32_t id) {
  prev_free_[size_t(id)] = free_tail_;
  next_free_[size_t(id)] = kNone;
  if (free_tail_ != kNone) next_free_[size_t(free_tail_)] = id;
  else free_head_ = id;
  free_tail_ = id;
  ++num_free_;
}

void BlockPool::push_free_head(int32_t id) {
  next_free_[size_t(id)] = free_head_;
  prev_free_[size_t(id)] = kNone;
  if (free_head_ != kNone) prev_free_[size_t(free_head_)] = id;
  else free_tail_ = id;
  free_head_ = id;
  ++num_free_;
}

void BlockPool::unlink_free(int32_t id) {
  int32_t p = prev_free_[size_t(id)], n = next_free_[size_t(id)];
  if (p != kNone) next_free_[size_t(p)] = n;
  else free_head_ = n;
  if (n != kNone) prev_free_[size_t(n)] = p;
  else free_tail_ = p;
  prev_free_[size_t(id)] = next_free_[size_t(id)] = kNone;
  --num_free_;
}

std::optional<int32_t> BlockPool::allocate() {
  if (free_head_ == kNone) {
    if (reclaimer_ == nullptr || num_idle_ == 0) return std::nullopt;
    reclaimer_->reclaim(1);
    assert(free_head_ != kNone);
  }
  int32_t id = free_head_;
  unlink_free(id);
  ref_count_[size_t(id)] = 1;
  return id;
}

bool BlockPool::allocate(int32_t n, std::vector<int32_t>& out) {
  if (n > num_available()) return false;
  if (n > num_free_) reclaimer_->reclaim(n - num_free_);
  assert(n <= num_free_);
  for (int32_t i = 0; i < n; ++i) out.push_back(*allocate());
  return true;
}

void BlockPool::retain(int32_t id) {
  if (ref_count_[size_t(id)] == 0) {
    assert(cached_[size_t(id)]);
    --num_idle_;
  }
  ++ref_count_[size_t(id)];
}

void BlockPool::release(int32_t id) {
  assert(ref_count_[size_t(id)] > 0);
  if (--ref_count_[size_t(id)] > 0) return;
  if (!cached_[size_t(id)]) {
    push_free_head(id);
    return;
  }
  ++num_idle_;
  reclaimer_->on_idle(id);
}

void BlockPool::mark_cached(int32_t id) {
  assert(ref_count_[size_t(id)] > 0 && reclaimer_ != nullptr);
  cached_[size_t(id)] = 1;
}

void BlockPool::unmark_cached(int32_t id) {
  assert(ref_count_[size_t(id)] > 0 && cached_[size_t(id)]);
  cached_[size_t(id)] = 0;
}

void BlockPool::evict(int32_t id) {
  assert(ref_count_[size_t(id)] == 0 && cached_[size_t(id)]);
  cached_[size_t(id)] = 0;
  --num_idle_;
  push_free_head(id);
}

}  // namespace kvserve
