#include "store/tiered_kv_store.h"

#include <cassert>
#include <cstring>
#include <unordered_map>

#include "util/error.h"
#include "util/timer.h"

namespace kvserve {

TieredKvStore::TieredKvStore(std::vector<std::unique_ptr<KvStore>> tiers, const TieredKvStoreOptions& options)
    : tiers_(std::move(tiers)), options_(options) {
  if (tiers_.empty()) fail("a tiered KV store needs at least one tier");
  for (const auto& t : tiers_)
    if (!t) fail("a tiered KV store was given a null tier");
  if (options.queue_blocks == 0 || options.queue_bytes <= 0 || options.write_batch == 0)
    fail("the KV store's write queue needs positive bounds and batch size");
  writer_ = std::thread([this] { writer_loop(); });
}

TieredKvStore::~TieredKvStore() {
  {
    std::lock_guard lock(queue_mu_);
    stop_ = true;
  }
  queue_cv_.notify_all();
  writer_.join();
}

size_t TieredKvStore::enqueue_writes(std::vector<Job> jobs, uint64_t& count) {
  size_t accepted = 0;
  {
    std::lock_guard lock(queue_mu_);
    for (Job& job : jobs) {
      const int64_t bytes = int64_t(job.bytes());
      if (stop_ || queued_writes_ >= options_.queue_blocks || queued_bytes_ + bytes > options_.queue_bytes) {
        ++dropped_;
        continue;
      }
      queued_bytes_ += bytes;
      ++queued_writes_;
      queue_.push_back(std::move(job));
      ++accepted;
    }
    count += accepted;
  }
  if (accepted > 0) queue_cv_.notify_one();
  return accepted;
}

void TieredKvStore::enqueue_remove(std::vector<Job> jobs) {
  {
    std::lock_guard lock(queue_mu_);
    // Removes are never dropped: they are small, and dropping one could leave
    // a block the caller asked to be gone.
    for (Job& job : jobs) queue_.push_back(std::move(job));
  }
  queue_cv_.notify_one();
}

size_t TieredKvStore::put(std::span<const BlockKey> keys, std::span<const ByteView> payloads, const ChainTag& chain) {
  assert(keys.size() == payloads.size());
  std::vector<Job> jobs;
  jobs.reserve(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    Job job;
    job.key = keys[i];
    job.chain = chain;
    job.unsealed = std::make_shared<Bytes>(kRecordHeaderBytes + payloads[i].size());
    if (!payloads[i].empty())
      std::memcpy(job.unsealed->data() + kRecordHeaderBytes, payloads[i].data(), payloads[i].size());
    job.first_tier = 0;
    job.end_tier = tiers_.size();
    jobs.push_back(std::move(job));
  }
  return enqueue_writes(std::move(jobs), enqueued_);
}

bool TieredKvStore::put(const BlockKey& key, ByteView payload, const ChainTag& chain) {
  return put(std::span(&key, 1), std::span(&payload, 1), chain) == 1;
}

std::vector<std::shared_ptr<const Bytes>> TieredKvStore::pending_writes(std::span<const BlockKey> keys) const {
  std::vector<std::shared_ptr<const Bytes>> found(keys.size());
  std::unordered_map<BlockKey, size_t, BlockKeyHash> index;
  for (size_t i = 0; i < keys.size(); ++i) index.emplace(keys[i], i);
  // In queue order, so the latest write or remove of a key decides.
  auto see = [&](bool remove, const BlockKey& key, const std::shared_ptr<const Bytes>& buffer) {
    const auto it = index.find(key);
    if (it != index.end()) found[it->second] = remove ? nullptr : buffer;
  };
  std::lock_guard lock(queue_mu_);
  if (queue_.empty() && in_flight_.empty()) return found;
  for (const InFlight& f : in_flight_) see(f.remove, f.key, f.buffer);
  for (const Job& job : queue_) see(job.remove, job.key, job.buffer());
  return found;
}

std::optional<std::string> TieredKvStore::kept_secret() {
  for (const std::unique_ptr<KvStore>& tier : tiers_)
    if (std::optional<std::string> s = tier->kept_secret()) return s;
  return std::nullopt;
}

std::vector<LoadedBlock> TieredKvStore::lookup(std::span<const BlockKey> keys, const ChainTag& chain) {
  Timer timer;
  std::vector<LoadedBlock> out;
  out.reserve(keys.size());
  const std::vector<std::shared_ptr<const Bytes>> pending = pending_writes(keys);
  // Extends the run with queued blocks: a sealed copy of the payload (the
  // writer may be filling the queued buffer's header right now).
  auto take_pending = [&] {
    while (out.size() < keys.size() && pending[out.size()]) {
      const Bytes& queued = *pending[out.size()];
      auto record = std::make_shared<Bytes>(queued.size());
      std::memcpy(record->data() + kRecordHeaderBytes, queued.data() + kRecordHeaderBytes,
                  queued.size() - kRecordHeaderBytes);
      write_record_header(options_.identity, keys[out.size()], *record);
      out.push_back(LoadedBlock{std::move(record), LoadedBlock::kFromWriteQueue});
      queue_hits_.fetch_add(1, std::memory_order_relaxed);
    }
  };
  take_pending();
  for (size_t t = 0; t < tiers_.size() && out.size() < keys.size(); ++t) {
    const std::span<const BlockKey> rest = keys.subspan(out.size());
    // The tier counts a refused record as corrupt and as a miss; the run ends there.
    std::optional<std::pair<size_t, RecordStatus>> refused;
    auto check = [&](size_t i, const Bytes& value) {
      const RecordStatus status = decode_record(value, {options_.identity, rest[i], options_.payload_bytes}).status;
      if (status != RecordStatus::Ok) refused.emplace(i, status);
      return status == RecordStatus::Ok;
    };
    std::vector<std::optional<Bytes>> got = tiers_[t]->get_leading(rest, chain, check);
    std::vector<Job> promote;
    for (size_t i = 0; i < rest.size() && got[i]; ++i) {
      auto record = std::make_shared<const Bytes>(std::move(*got[i]));
      if (options_.promote && t > 0) promote.push_back(Job{false, rest[i], chain, nullptr, record, 0, t, true});
      out.push_back(LoadedBlock{std::move(record), int(t)});
    }
    // Damaged bytes are deleted. A sound record of another model, codec or
    // block size is only refused: in a shared Redis it may be another
    // fleet's, and it ages out by TTL or LRU like any block.
    if (refused && !record_is_foreign(refused->second))
      enqueue_remove({Job{true, rest[refused->first], chain, nullptr, nullptr, t, t + 1}});
    if (!promote.empty()) enqueue_writes(std::move(promote), promotions_);
    take_pending();
  }
  lookups_.fetch_add(1, std::memory_order_relaxed);
  blocks_requested_.fetch_add(keys.size(), std::memory_order_relaxed);
  blocks_found_.fetch_add(out.size(), std::memory_order_relaxed);
  lookup_latency_.record(timer.seconds());
  return out;
}

std::vector<int> TieredKvStore::locate(std::span<const BlockKey> keys, const ChainTag& chain) {
  std::vector<int> where(keys.size(), -1);
  for (size_t t = 0; t < tiers_.size(); ++t) {
    std::vector<size_t> open;
    std::vector<BlockKey> ask;
    for (size_t i = 0; i < keys.size(); ++i)
      if (where[i] < 0) {
        open.push_back(i);
        ask.push_back(keys[i]);
      }
    if (ask.empty()) break;
    const std::vector<bool> found = tiers_[t]->contains(ask, chain);
    for (size_t j = 0; j < open.size(); ++j)
      if (found[j]) where[open[j]] = int(t);
  }
  return where;
}

void TieredKvStore::remove(std::span<const BlockKey> keys, const ChainTag& chain) {
  std::vector<Job> jobs;
  for (const BlockKey& key : keys) jobs.push_back(Job{true, key, chain, nullptr, nullptr, 0, tiers_.size()});
  enqueue_remove(std::move(jobs));
}

void TieredKvStore::flush() {
  std::unique_lock lock(queue_mu_);
  idle_cv_.wait(lock, [&] { return queue_.empty() && !writing_; });
}

void TieredKvStore::writer_loop() {
  std::vector<Job> batch;
  for (;;) {
    {
      std::unique_lock lock(queue_mu_);
      queue_cv_.wait(lock, [&] { return !queue_.empty() || stop_; });
      if (queue_.empty()) return;  // stopping, and everything is written
      // One batch: consecutive jobs that go to the same tiers the same way.
      const bool remove = queue_.front().remove;
      const ChainTag chain = queue_.front().chain;
      const size_t first_tier = queue_.front().first_tier, end_tier = queue_.front().end_tier;
      while (!queue_.empty() && batch.size() < options_.write_batch && queue_.front().remove == remove &&
             queue_.front().chain == chain && queue_.front().first_tier == first_tier &&
             queue_.front().end_tier == end_tier) {
        Job& job = queue_.front();
        if (!job.remove) {
          queued_bytes_ -= int64_t(job.bytes());
          --queued_writes_;
        }
        in_flight_.push_back(InFlight{job.remove, job.key, job.buffer()});
        batch.push_back(std::move(job));
        queue_.pop_front();
      }
      writing_ = true;
    }
    const uint64_t written = run(batch);
    {
      std::lock_guard lock(queue_mu_);
      written_ += written;
      writing_ = false;
      in_flight_.clear();
      if (queue_.empty()) idle_cv_.notify_all();
    }
    batch.clear();
  }
}

uint64_t TieredKvStore::run(std::span<Job> batch) {
  std::vector<BlockKey> keys;
  std::vector<ByteView> values;
  for (Job& job : batch) {
    keys.push_back(job.key);
    if (job.unsealed) {
      write_record_header(options_.identity, job.key, *job.unsealed);
      job.record = std::move(job.unsealed);
    }
    if (!job.remove) values.push_back(ByteView(*job.record));
  }
  const Job& head = batch.front();
  // Write-through: a block counts as written once any tier holds it.
  std::vector<bool> stored(batch.size(), false);
  for (size_t t = head.first_tier; t < head.end_tier; ++t) {
    if (head.remove) {
      tiers_[t]->remove(keys, head.chain);
      continue;
    }
    const std::vector<bool> in_tier = tiers_[t]->put_each(keys, values, head.chain);
    for (size_t i = 0; i < batch.size(); ++i) stored[i] = stored[i] || in_tier[i];
  }
  uint64_t written = 0;
  for (size_t i = 0; i < batch.size(); ++i) written += stored[i] && !batch[i].promotion;
  return written;
}

TieredStats TieredKvStore::stats() const {
  TieredStats s;
  for (const auto& t : tiers_) s.tiers.push_back(t->stats());
  s.lookups = lookups_.load(std::memory_order_relaxed);
  s.blocks_requested = blocks_requested_.load(std::memory_order_relaxed);
  s.blocks_found = blocks_found_.load(std::memory_order_relaxed);
  s.queue_hits = queue_hits_.load(std::memory_order_relaxed);
  s.lookup_latency = lookup_latency_.snapshot();
  std::lock_guard lock(queue_mu_);
  s.enqueued = enqueued_;
  s.dropped = dropped_;
  s.written = written_;
  s.promotions = promotions_;
  s.queued_blocks = queued_writes_;
  s.queued_bytes = queued_bytes_;
  return s;
}

}  // namespace kvserve
