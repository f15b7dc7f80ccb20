// The KV store below the in-memory KV cache: tiers in order (typically host
// memory, local disk, Redis), one record format, an asynchronous write path
// and per-tier metrics. This is what the engine talks to.
//
// Write path: put() copies each block into a record buffer and queues it; a
// background writer fills the record header (block_record.h: model, codec,
// key, checksum) and stores it in every
// tier (write-through, so a block reaches the shared Redis at once for other
// replicas, and disk at once so a restart finds it). put() never waits on I/O:
// the queue is bounded in blocks and bytes, and a block that does not fit is
// dropped and counted (it will simply be recomputed if needed again).
//
// Read path: lookup() takes the keys of the next blocks of a chain and asks
// the tiers in order, one batched call per tier, each for the keys no earlier
// tier had; it returns the leading run of blocks found (stopping at the first
// key no tier has). Blocks still waiting in the write queue (or being written)
// are served from there first: a block put a moment ago is found whether or
// not the writer has caught up, so a preempted sequence readmitted at once
// gets its blocks back on a busy machine as on an idle one. A block found in
// a lower tier is copied into the tiers above it (promotion, through the
// writer). A record that fails its check in a tier (damaged, or another
// model's, codec's or block size's) is counted as corrupt there and treated
// as a miss there: the next tier may still hold a good copy, otherwise the
// block is recomputed. It is never used. Damaged records are also removed
// from the tier; foreign ones are left to age out.
//
// Thread safety: all methods, from any thread. queue_mu_ guards the queue and
// the writer's state; the tiers are thread-safe themselves.
#pragma once

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "store/block_record.h"
#include "store/kv_store.h"

namespace kvserve {

struct TieredKvStoreOptions {
  RecordIdentity identity;               // model id and KvCache::block_codec_hash(): records must match
  uint64_t payload_bytes = 0;            // exact payload size, KvCache::block_record_bytes(); 0 = any
  size_t queue_blocks = 1024;            // blocks waiting to be written, at most
  int64_t queue_bytes = int64_t(256) << 20;  // bytes of records waiting to be written, at most
  size_t write_batch = 32;               // blocks per tier call made by the writer
  bool promote = true;                   // copy blocks found lower down into the tiers above
};

// One block found by lookup().
struct LoadedBlock {
  std::shared_ptr<const Bytes> record;  // header + payload, already checked
  int tier = 0;                         // index of the tier that served it; kFromWriteQueue if none yet had it
  static constexpr int kFromWriteQueue = -1;
  ByteView payload() const { return ByteView(*record).subspan(kRecordHeaderBytes); }
};

struct TieredStats {
  std::vector<TierStats> tiers;  // in lookup order
  uint64_t lookups = 0;          // lookup() calls
  uint64_t blocks_requested = 0; // keys passed to lookup()
  uint64_t blocks_found = 0;     // blocks lookup() returned
  uint64_t queue_hits = 0;       // of those, served from the write queue before any tier had them
  uint64_t enqueued = 0;         // blocks put() accepted
  uint64_t dropped = 0;          // blocks put() (or a promotion) refused: queue full
  uint64_t written = 0;          // blocks put() accepted that at least one tier then stored (tier stats say which);
                                 // promotions are not counted here
  uint64_t promotions = 0;       // blocks queued for copying into the tiers above the one that had them
  uint64_t queued_blocks = 0;    // waiting now
  int64_t queued_bytes = 0;      // waiting now
  LatencySnapshot lookup_latency;  // per lookup() call, all tiers together
};

class TieredKvStore {
 public:
  // tiers: in lookup order, at least one. Starts the writer thread.
  TieredKvStore(std::vector<std::unique_ptr<KvStore>> tiers, const TieredKvStoreOptions& options);
  // Writes what is queued, then stops the writer.
  ~TieredKvStore();
  TieredKvStore(const TieredKvStore&) = delete;
  TieredKvStore& operator=(const TieredKvStore&) = delete;

  // Queues blocks (payloads: the KvCache::export_block bytes) for every tier
  // and returns how many were accepted; the rest were dropped (queue full) and
  // counted. Copies the payloads; never waits on I/O.
  // REQUIRES: keys.size() == payloads.size().
  size_t put(std::span<const BlockKey> keys, std::span<const ByteView> payloads, const ChainTag& chain = std::nullopt);
  bool put(const BlockKey& key, ByteView payload, const ChainTag& chain = std::nullopt);

  // The leading run of keys found in some tier, in key order: result[i] is
  // keys[i] for i < result.size(). Waits on the tiers (one call each).
  [[nodiscard]] std::vector<LoadedBlock> lookup(std::span<const BlockKey> keys, const ChainTag& chain = std::nullopt);
  // The first tier's kept secret (KvStore::kept_secret), if any tier keeps one.
  [[nodiscard]] std::optional<std::string> kept_secret();
  // The first tier holding each key, or -1; one contains() per tier, no data moved.
  [[nodiscard]] std::vector<int> locate(std::span<const BlockKey> keys, const ChainTag& chain = std::nullopt);
  // Removes the keys from every tier, after any queued writes of them.
  void remove(std::span<const BlockKey> keys, const ChainTag& chain = std::nullopt);

  // Waits until everything queued so far has been written (tests, benchmarks, shutdown).
  void flush();

  size_t tier_count() const { return tiers_.size(); }
  KvStore& tier(size_t i) { return *tiers_[i]; }
  const TieredKvStoreOptions& options() const { return options_; }
  TieredStats stats() const;

 private:
  struct Job {
    bool remove = false;
    BlockKey key;
    ChainTag chain;
    // Writes only: a new block's record, whose header the writer fills (so
    // hashing stays off the caller's thread), or a finished record (promotion).
    std::shared_ptr<Bytes> unsealed;
    std::shared_ptr<const Bytes> record;
    size_t bytes() const { return unsealed ? unsealed->size() : record ? record->size() : 0; }
    // The record's bytes, sealed or not (null for a remove).
    std::shared_ptr<const Bytes> buffer() const { return unsealed ? unsealed : record; }
    size_t first_tier = 0, end_tier = 0;  // applies to tiers [first_tier, end_tier)
    bool promotion = false;               // a copy of a block found lower down, not a put()
  };

  // For each key, the payload of its latest write still queued or being
  // written (null if none, or if a later remove cancels it).
  std::vector<std::shared_ptr<const Bytes>> pending_writes(std::span<const BlockKey> keys) const;
  // Queues write jobs unless the bounds say no; returns how many were queued
  // and adds that to `count` (enqueued_ or promotions_) under the same lock,
  // so stats() never sees a job written before it was counted.
  size_t enqueue_writes(std::vector<Job> jobs, uint64_t& count);
  void enqueue_remove(std::vector<Job> jobs);
  void writer_loop();
  // Applies one batch to its tiers; returns how many put() blocks (not
  // promotions) at least one tier stored.
  uint64_t run(std::span<Job> batch);

  std::vector<std::unique_ptr<KvStore>> tiers_;
  const TieredKvStoreOptions options_;

  mutable std::mutex queue_mu_;
  std::condition_variable queue_cv_;  // the writer waits for work
  std::condition_variable idle_cv_;   // flush() waits for an empty queue and an idle writer
  std::deque<Job> queue_;             // guarded by queue_mu_
  int64_t queued_bytes_ = 0;          // guarded by queue_mu_: record bytes of queued writes
  size_t queued_writes_ = 0;          // guarded by queue_mu_: write jobs queued
  bool writing_ = false;              // guarded by queue_mu_: the writer holds a batch
  // guarded by queue_mu_: the batch the writer holds, as (remove, key, buffer)
  // so lookups still see it. Only the payload bytes are read through buffer:
  // the writer fills the header of an unsealed one meanwhile.
  struct InFlight {
    bool remove;
    BlockKey key;
    std::shared_ptr<const Bytes> buffer;
  };
  std::vector<InFlight> in_flight_;
  bool stop_ = false;                 // guarded by queue_mu_
  uint64_t enqueued_ = 0, dropped_ = 0, written_ = 0, promotions_ = 0;  // guarded by queue_mu_
  std::atomic<uint64_t> lookups_{0}, blocks_requested_{0}, blocks_found_{0}, queue_hits_{0};
  LatencyHistogram lookup_latency_;
  std::thread writer_;
};

}  // namespace kvserve
