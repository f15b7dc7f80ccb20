#include "store/store_metrics.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace kvserve {

double LatencySnapshot::bucket_upper_seconds(int i) {
  if (i >= kBuckets - 1) return std::numeric_limits<double>::infinity();
  return std::ldexp(1e-6, i);
}

double LatencySnapshot::quantile_seconds(double q) const {
  if (count == 0) return 0.0;
  const double rank = std::clamp(q, 0.0, 1.0) * double(count);
  uint64_t seen = 0;
  for (int i = 0; i < kBuckets; ++i) {
    seen += counts[size_t(i)];
    if (double(seen) >= rank && counts[size_t(i)] > 0) return bucket_upper_seconds(i);
  }
  return bucket_upper_seconds(kBuckets - 1);
}

void LatencyHistogram::record(double seconds) {
  const double us = std::max(seconds, 0.0) * 1e6;
  int bucket = 0;
  // Smallest i with us < 2^i; frexp gives us = m * 2^e with m in [0.5, 1).
  if (us >= 1.0) {
    int e = 0;
    std::frexp(us, &e);
    bucket = std::min(e, LatencySnapshot::kBuckets - 1);
  }
  counts_[size_t(bucket)].fetch_add(1, std::memory_order_relaxed);
  sum_ns_.fetch_add(uint64_t(std::max(seconds, 0.0) * 1e9), std::memory_order_relaxed);
}

LatencySnapshot LatencyHistogram::snapshot() const {
  LatencySnapshot s;
  for (int i = 0; i < LatencySnapshot::kBuckets; ++i) {
    s.counts[size_t(i)] = counts_[size_t(i)].load(std::memory_order_relaxed);
    s.count += s.counts[size_t(i)];
  }
  s.sum_seconds = double(sum_ns_.load(std::memory_order_relaxed)) * 1e-9;
  return s;
}

void TierCounters::snapshot(TierStats& out) const {
  const auto get = [](const std::atomic<uint64_t>& c) { return c.load(std::memory_order_relaxed); };
  out.hits = get(hits);
  out.misses = get(misses);
  out.bytes_read = get(bytes_read);
  out.puts = get(puts);
  out.bytes_written = get(bytes_written);
  out.rejected = get(rejected);
  out.removes = get(removes);
  out.evictions = get(evictions);
  out.errors = get(errors);
  out.corrupt = get(corrupt);
  out.get_latency = get_latency.snapshot();
  out.put_latency = put_latency.snapshot();
}

}  // namespace kvserve
