#include "store/kv_store.h"

#include <algorithm>
#include <cassert>

#include "util/timer.h"

namespace kvserve {

size_t KvStore::put(std::span<const BlockKey> keys, std::span<const ByteView> values, const ChainTag& chain) {
  const std::vector<bool> stored = put_each(keys, values, chain);
  return size_t(std::count(stored.begin(), stored.end(), true));
}

std::vector<bool> KvStore::put_each(std::span<const BlockKey> keys, std::span<const ByteView> values,
                                    const ChainTag& chain) {
  assert(keys.size() == values.size());
  if (keys.empty()) return {};
  Timer timer;
  std::vector<bool> stored = do_put(keys, values, chain);
  counters_.put_latency.record(timer.seconds());
  assert(stored.size() == keys.size());
  uint64_t n = 0, bytes = 0;
  for (size_t i = 0; i < stored.size(); ++i) {
    if (!stored[i]) continue;
    ++n;
    bytes += values[i].size();
  }
  counters_.add(counters_.puts, n);
  counters_.add(counters_.bytes_written, bytes);
  return stored;
}

std::vector<std::optional<Bytes>> KvStore::timed_get(std::span<const BlockKey> keys, const ChainTag& chain,
                                                     bool leading, const ValueCheck& check) {
  if (keys.empty()) return {};
  Timer timer;
  std::vector<std::optional<Bytes>> out = do_get(keys, chain, leading);
  counters_.get_latency.record(timer.seconds());
  assert(out.size() == keys.size());
  uint64_t hits = 0, misses = 0, bytes = 0, refused = 0;
  bool missed = false;
  for (size_t i = 0; i < out.size(); ++i) {
    std::optional<Bytes>& value = out[i];
    // In a leading lookup nothing after the first miss counts, found or not.
    if (leading && missed) {
      value.reset();
      continue;
    }
    // Checked before counting: a refused value served nothing, so it is a
    // miss, not a hit whose bytes were read.
    if (value && check && !check(i, *value)) {
      value.reset();
      ++refused;
    }
    if (value) {
      ++hits;
      bytes += value->size();
    } else {
      ++misses;
      missed = true;
    }
  }
  counters_.add(counters_.hits, hits);
  counters_.add(counters_.misses, misses);
  counters_.add(counters_.bytes_read, bytes);
  counters_.add(counters_.corrupt, refused);
  return out;
}

std::vector<std::optional<Bytes>> KvStore::get(std::span<const BlockKey> keys, const ChainTag& chain) {
  return timed_get(keys, chain, false, nullptr);
}

std::vector<std::optional<Bytes>> KvStore::get_leading(std::span<const BlockKey> keys, const ChainTag& chain,
                                                       const ValueCheck& check) {
  return timed_get(keys, chain, true, check);
}

std::vector<bool> KvStore::contains(std::span<const BlockKey> keys, const ChainTag& chain) {
  if (keys.empty()) return {};
  return do_contains(keys, chain);
}

void KvStore::remove(std::span<const BlockKey> keys, const ChainTag& chain) {
  if (keys.empty()) return;
  counters_.add(counters_.removes, keys.size());
  do_remove(keys, chain);
}

TierStats KvStore::stats() const {
  TierStats s;
  s.name = name_;
  counters_.snapshot(s);
  fill_resident(s);
  return s;
}

}  // namespace kvserve
