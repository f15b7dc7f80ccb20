// What every store tier reports: hits, misses, bytes, errors and call
// latencies, updated lock-free by the tier's callers and read as a snapshot
// (TierStats) for /metrics, the CLI's --json and benchmarks.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <string>

namespace kvserve {

// Call latencies in power-of-two buckets: bucket i counts calls that took less
// than 2^i microseconds (and at least 2^(i-1)); the last bucket counts the rest.
struct LatencySnapshot {
  static constexpr int kBuckets = 24;  // the last finite bound is 2^22 us ≈ 4.2 s
  std::array<uint64_t, kBuckets> counts{};
  uint64_t count = 0;        // calls
  double sum_seconds = 0;    // total time of those calls

  // Upper bound of bucket i in seconds (infinity for the last).
  static double bucket_upper_seconds(int i);
  // The upper bound of the bucket holding quantile q (0..1) of the calls, in
  // seconds: an overestimate by at most 2x. 0 when no call was recorded.
  double quantile_seconds(double q) const;
  double mean_seconds() const { return count == 0 ? 0.0 : sum_seconds / double(count); }
};

class LatencyHistogram {
 public:
  void record(double seconds);
  LatencySnapshot snapshot() const;

 private:
  std::array<std::atomic<uint64_t>, LatencySnapshot::kBuckets> counts_{};
  std::atomic<uint64_t> sum_ns_{0};
};

// A tier's counters and resident size at one moment. Counts are in blocks
// unless named bytes.
struct TierStats {
  std::string name;             // e.g. "host", "disk:/var/cache/kv", "redis://10.0.0.5:6379"
  uint64_t hits = 0;            // keys looked up and found
  uint64_t misses = 0;          // keys looked up and not found (including failed lookups and refused records)
  uint64_t bytes_read = 0;      // bytes returned by hits
  uint64_t puts = 0;            // blocks stored
  uint64_t bytes_written = 0;   // bytes of the blocks stored
  uint64_t rejected = 0;        // blocks refused: larger than the tier's whole budget
  uint64_t removes = 0;         // remove() calls' keys
  uint64_t evictions = 0;       // blocks evicted to stay within the budget
  uint64_t errors = 0;          // blocks whose operation failed (I/O, connection, timeout, protocol)
  uint64_t corrupt = 0;         // blocks found but refused by the record check: damaged, or another
                                // model's or codec's (counted as misses above, not hits)
  int64_t resident_blocks = -1; // blocks held now; -1 = unknown (Redis)
  int64_t resident_bytes = -1;  // bytes held now; -1 = unknown
  int64_t capacity_bytes = -1;  // budget; -1 = set by the server (Redis maxmemory)
  bool available = true;        // false while the tier cannot be reached (Redis down, backing off)
  LatencySnapshot get_latency;  // per get() call
  LatencySnapshot put_latency;  // per put() call
};

// The live counters behind TierStats (relaxed atomics: each is independent).
struct TierCounters {
  std::atomic<uint64_t> hits{0}, misses{0}, bytes_read{0}, puts{0}, bytes_written{0}, rejected{0}, removes{0},
      evictions{0}, errors{0}, corrupt{0};
  LatencyHistogram get_latency, put_latency;

  void add(std::atomic<uint64_t>& counter, uint64_t n) { counter.fetch_add(n, std::memory_order_relaxed); }
  // Copies every counter into `out` (not the resident fields).
  void snapshot(TierStats& out) const;
};

}  // namespace kvserve
