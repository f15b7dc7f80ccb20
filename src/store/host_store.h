// The host-memory tier: blocks in process memory under a byte budget, least
// recently used evicted first. The fastest tier below the KV cache itself: a
// hit costs one copy of the block.
//
// The budget counts value bytes only (not the ~100 bytes of bookkeeping per
// block). A block larger than the whole budget is rejected.
//
// Thread safety: all methods; one mutex (mu_) guards the index.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>

#include "store/kv_store.h"
#include "store/lru_index.h"

namespace kvserve {

struct HostStoreOptions {
  int64_t budget_bytes = int64_t(1) << 30;  // value bytes held at most; must be > 0
};

class HostStore final : public KvStore {
 public:
  // Throws kvserve::Error when the budget is not positive.
  explicit HostStore(const HostStoreOptions& options);

  // Keys from least to most recently used.
  std::vector<BlockKey> keys_lru_first() const;

 private:
  std::vector<bool> do_put(std::span<const BlockKey> keys, std::span<const ByteView> values,
                           const ChainTag& chain) override;
  std::vector<std::optional<Bytes>> do_get(std::span<const BlockKey> keys, const ChainTag& chain,
                                           bool leading_only) override;
  std::vector<bool> do_contains(std::span<const BlockKey> keys, const ChainTag& chain) override;
  void do_remove(std::span<const BlockKey> keys, const ChainTag& chain) override;
  void fill_resident(TierStats& out) const override;

  const HostStoreOptions options_;
  mutable std::mutex mu_;
  // Values are shared so a reader copies a block after releasing mu_ even if
  // the writer replaces or evicts it meanwhile.
  LruIndex<std::shared_ptr<const Bytes>> index_;  // guarded by mu_
};

}  // namespace kvserve
