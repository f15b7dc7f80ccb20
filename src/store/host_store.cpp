#include "store/host_store.h"

#include "util/error.h"

namespace kvserve {

HostStore::HostStore(const HostStoreOptions& options) : KvStore("host"), options_(options) {
  if (options.budget_bytes <= 0) fail("the host tier needs a positive byte budget, got {}", options.budget_bytes);
}

std::vector<bool> HostStore::do_put(std::span<const BlockKey> keys, std::span<const ByteView> values,
                                    const ChainTag&) {
  std::vector<bool> stored(keys.size(), false);
  const uint64_t budget = uint64_t(options_.budget_bytes);
  for (size_t i = 0; i < keys.size(); ++i) {
    if (values[i].size() > budget) {
      counters().add(counters().rejected, 1);
      continue;
    }
    // Copy outside the lock: blocks are tens to hundreds of KB.
    auto copy = std::make_shared<const Bytes>(values[i].begin(), values[i].end());
    uint64_t evicted = 0;
    {
      std::lock_guard lock(mu_);
      index_.erase(keys[i]);
      while (index_.bytes() + copy->size() > budget) {
        index_.pop_lru();
        ++evicted;
      }
      index_.insert(keys[i], std::move(copy), values[i].size());
    }
    counters().add(counters().evictions, evicted);
    stored[i] = true;
  }
  return stored;
}

std::vector<std::optional<Bytes>> HostStore::do_get(std::span<const BlockKey> keys, const ChainTag&,
                                                    bool leading_only) {
  std::vector<std::shared_ptr<const Bytes>> found(keys.size());
  {
    std::lock_guard lock(mu_);
    for (size_t i = 0; i < keys.size(); ++i) {
      auto* entry = index_.touch(keys[i]);
      if (entry) found[i] = entry->value;
      else if (leading_only) break;
    }
  }
  std::vector<std::optional<Bytes>> out(keys.size());
  for (size_t i = 0; i < keys.size(); ++i)
    if (found[i]) out[i] = *found[i];
  return out;
}

std::vector<bool> HostStore::do_contains(std::span<const BlockKey> keys, const ChainTag&) {
  std::vector<bool> out(keys.size());
  std::lock_guard lock(mu_);
  for (size_t i = 0; i < keys.size(); ++i) out[i] = index_.contains(keys[i]);
  return out;
}

void HostStore::do_remove(std::span<const BlockKey> keys, const ChainTag&) {
  std::lock_guard lock(mu_);
  for (const BlockKey& key : keys) index_.erase(key);
}

void HostStore::fill_resident(TierStats& out) const {
  std::lock_guard lock(mu_);
  out.resident_blocks = int64_t(index_.size());
  out.resident_bytes = int64_t(index_.bytes());
  out.capacity_bytes = options_.budget_bytes;
}

std::vector<BlockKey> HostStore::keys_lru_first() const {
  std::vector<BlockKey> out;
  std::lock_guard lock(mu_);
  index_.for_each_lru_first([&](const auto& e) { out.push_back(e.key); });
  return out;
}

}  // namespace kvserve
