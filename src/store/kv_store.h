// One tier of the KV store: a map from BlockKey to bytes with a budget.
// Implementations: HostStore (memory, LRU), DiskStore (one directory, LRU,
// survives restarts), RedisStore (a Redis server or cluster, TTL). The
// TieredKvStore composes them and owns the record format; a tier stores bytes
// opaquely and returns exactly what was put, or nothing.
//
// Batch-first: every call takes a batch of keys (the next blocks of one chain)
// so a remote tier pays one round trip per call, not per block.
//
// Failures are results, not exceptions: a key that cannot be read is a miss,
// a block that cannot be written is not stored, and both are counted in
// stats().errors. Callers never need a try block around a tier.
//
// Thread safety: every method may be called concurrently from any thread (the
// engine reads while the TieredKvStore's writer thread writes).
#pragma once

#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "store/block_key.h"
#include "store/store_metrics.h"

namespace kvserve {

class KvStore {
 public:
  virtual ~KvStore() = default;
  KvStore(const KvStore&) = delete;
  KvStore& operator=(const KvStore&) = delete;

  // A short description for metrics and logs, e.g. "disk:/var/cache/kv".
  const std::string& name() const { return name_; }

  // Stores values[i] under keys[i], replacing any earlier value, and returns
  // how many were stored (a block over the tier's whole budget is rejected, a
  // failed write is an error; both leave the key absent). May evict least
  // recently used blocks.  REQUIRES: keys.size() == values.size().
  size_t put(std::span<const BlockKey> keys, std::span<const ByteView> values, const ChainTag& chain = std::nullopt);
  // As put, but says which: one entry per key, true if it was stored.
  [[nodiscard]] std::vector<bool> put_each(std::span<const BlockKey> keys, std::span<const ByteView> values,
                                           const ChainTag& chain = std::nullopt);
  // One entry per key: its bytes, or nullopt for a miss. A hit refreshes the
  // block's recency.
  [[nodiscard]] std::vector<std::optional<Bytes>> get(std::span<const BlockKey> keys,
                                                      const ChainTag& chain = std::nullopt);
  // Judges a value found for keys[i] before it is counted: false refuses it,
  // and it is counted in stats().corrupt and as a miss (not a hit, its bytes
  // not as read) and returned as nullopt.
  using ValueCheck = std::function<bool(size_t i, const Bytes& value)>;
  // As get, but only the leading run of hits matters: entries from the first
  // miss (or refused value) on are nullopt. Local tiers stop reading there; a
  // remote tier still answers the whole batch in its one round trip and drops
  // the rest. `check` (if any) is called for the values of the run, in order.
  [[nodiscard]] std::vector<std::optional<Bytes>> get_leading(std::span<const BlockKey> keys,
                                                              const ChainTag& chain = std::nullopt,
                                                              const ValueCheck& check = nullptr);
  // Whether each key is present (a bitmap over keys), without reading values
  // or refreshing recency. Unreachable = absent.
  [[nodiscard]] std::vector<bool> contains(std::span<const BlockKey> keys, const ChainTag& chain = std::nullopt);
  // Removes the keys that are present.
  void remove(std::span<const BlockKey> keys, const ChainTag& chain = std::nullopt);

  TierStats stats() const;

  // A secret this tier keeps beside its blocks, for salting tenants' keys
  // the same way after a restart (the disk tier's); nullopt for tiers that
  // do not outlive the process or are shared between processes.
  virtual std::optional<std::string> kept_secret() { return std::nullopt; }

 protected:
  explicit KvStore(std::string name) : name_(std::move(name)) {}

  // The operations, without metrics; the public wrappers time them and count
  // hits, misses, stores and bytes. Implementations count evictions,
  // rejections and errors themselves in counters().
  // Returns which blocks were stored.
  virtual std::vector<bool> do_put(std::span<const BlockKey> keys, std::span<const ByteView> values,
                                   const ChainTag& chain) = 0;
  // When leading_only, may leave every entry after the first miss empty.
  virtual std::vector<std::optional<Bytes>> do_get(std::span<const BlockKey> keys, const ChainTag& chain,
                                                   bool leading_only) = 0;
  virtual std::vector<bool> do_contains(std::span<const BlockKey> keys, const ChainTag& chain) = 0;
  virtual void do_remove(std::span<const BlockKey> keys, const ChainTag& chain) = 0;
  // Fills the resident and availability fields of `out`.
  virtual void fill_resident(TierStats& out) const = 0;

  TierCounters& counters() { return counters_; }

 private:
  std::vector<std::optional<Bytes>> timed_get(std::span<const BlockKey> keys, const ChainTag& chain, bool leading,
                                              const ValueCheck& check);

  std::string name_;
  TierCounters counters_;
};

}  // namespace kvserve
