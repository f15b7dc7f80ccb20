#include "util/histogram.h"

#include <algorithm>
#include <cmath>

#include "util/error.h"

namespace kvserve {

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {
  if (!std::is_sorted(bounds_.begin(), bounds_.end()) ||
      std::adjacent_find(bounds_.begin(), bounds_.end()) != bounds_.end())
    fail("histogram bounds must be strictly increasing");
}

Histogram Histogram::latency_seconds() {
  return Histogram({0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                    20.0, 30.0, 60.0});
}

void Histogram::observe(double value) {
  const size_t i = size_t(std::lower_bound(bounds_.begin(), bounds_.end(), value) - bounds_.begin());
  ++counts_[i];
  ++count_;
  sum_ += value;
}

std::vector<uint64_t> Histogram::cumulative() const {
  std::vector<uint64_t> out(counts_.size());
  uint64_t run = 0;
  for (size_t i = 0; i < counts_.size(); ++i) out[i] = run += counts_[i];
  return out;
}

double Histogram::quantile(double q) const {
  if (count_ == 0) return 0;
  const double rank = std::clamp(q, 0.0, 1.0) * double(count_);
  uint64_t below = 0;
  for (size_t i = 0; i < counts_.size(); ++i) {
    if (counts_[i] > 0 && double(below + counts_[i]) >= rank) {
      const double lo = i == 0 ? 0.0 : bounds_[i - 1];
      if (i == bounds_.size()) return lo;  // the +Inf bucket: its lower bound is all we know
      const double frac = (rank - double(below)) / double(counts_[i]);
      return lo + (bounds_[i] - lo) * std::clamp(frac, 0.0, 1.0);
    }
    below += counts_[i];
  }
  return bounds_.empty() ? 0 : bounds_.back();
}

}  // namespace kvserve
