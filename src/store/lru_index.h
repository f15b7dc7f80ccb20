// Keys in recency order with a size each and the total: the eviction policy of
// the host and disk tiers. Insert, touch, erase and popping the least recently
// used key are all O(1) (a hash map into an intrusive recency list), so a
// tier's cost per block does not grow with the number of blocks it holds.
//
// Invariant: the map and the list hold the same keys; bytes() is the sum of
// their sizes; the list runs from most to least recently used.
//
// Thread safety: none; the owning tier guards it with its mutex.
#pragma once

#include <cstdint>
#include <iterator>
#include <list>
#include <optional>
#include <unordered_map>
#include <utility>

#include "store/block_key.h"

namespace kvserve {

template <class Value>
class LruIndex {
 public:
  struct Entry {
    BlockKey key;
    Value value;
    uint64_t bytes = 0;  // what the entry counts against the budget, in bytes
  };

  size_t size() const { return map_.size(); }
  uint64_t bytes() const { return bytes_; }
  bool contains(const BlockKey& key) const { return map_.count(key) != 0; }

  // The entry without changing its recency; nullptr when absent.
  const Entry* find(const BlockKey& key) const {
    auto it = map_.find(key);
    return it == map_.end() ? nullptr : &*it->second;
  }
  // The entry, now the most recently used; nullptr when absent.
  Entry* touch(const BlockKey& key) {
    auto it = map_.find(key);
    if (it == map_.end()) return nullptr;
    order_.splice(order_.begin(), order_, it->second);
    return &*it->second;
  }
  // Adds key as the most recently used, replacing (and returning) an existing entry.
  std::optional<Entry> insert(const BlockKey& key, Value value, uint64_t bytes) {
    std::optional<Entry> old = erase(key);
    order_.push_front(Entry{key, std::move(value), bytes});
    map_.emplace(key, order_.begin());
    bytes_ += bytes;
    return old;
  }
  std::optional<Entry> erase(const BlockKey& key) {
    auto it = map_.find(key);
    if (it == map_.end()) return std::nullopt;
    Entry e = std::move(*it->second);
    order_.erase(it->second);
    map_.erase(it);
    bytes_ -= e.bytes;
    return e;
  }
  // The least recently used entry, removed; nullopt when empty.
  std::optional<Entry> pop_lru() {
    if (order_.empty()) return std::nullopt;
    return erase(order_.back().key);
  }
  // Keys from least to most recently used (for tests and inspection).
  template <class F>
  void for_each_lru_first(F&& f) const {
    for (auto it = order_.rbegin(); it != order_.rend(); ++it) f(*it);
  }

 private:
  std::list<Entry> order_;  // front = most recently used
  std::unordered_map<BlockKey, typename std::list<Entry>::iterator, BlockKeyHash> map_;
  uint64_t bytes_ = 0;
};

}  // namespace kvserve
