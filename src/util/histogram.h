// A fixed-bucket histogram of seconds in the Prometheus style: cumulative
// counts per upper bound, plus the sum and the count of observations.
//
// Thread safety: none; the owner guards it.
#pragma once

#include <cstdint>
#include <vector>

namespace kvserve {

class Histogram {
 public:
  // bounds: increasing upper bounds of the buckets (an implicit +Inf follows).
  explicit Histogram(std::vector<double> bounds);
  // Buckets suited to latencies from 1 ms to 60 s.
  static Histogram latency_seconds();

  void observe(double value);

  const std::vector<double>& bounds() const { return bounds_; }
  // Observations <= bounds()[i], cumulative; size bounds().size() + 1 (the last is +Inf).
  std::vector<uint64_t> cumulative() const;
  uint64_t count() const { return count_; }
  double sum() const { return sum_; }
  // An estimate of quantile q in [0, 1] by linear interpolation within its bucket; 0 when empty.
  double quantile(double q) const;

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // (bounds + 1) per bucket, not cumulative
  uint64_t count_ = 0;
  double sum_ = 0;
};

}  // namespace kvserve
