#include "util/recent_median.h"

#include <algorithm>

namespace kvserve {

void RecentMedian::add(double sample) { samples_[count_++ % kWindow] = sample; }

double RecentMedian::value() const {
  const size_t n = count();
  if (n == 0) return 0;
  std::array<double, kWindow> sorted = samples_;
  std::nth_element(sorted.begin(), sorted.begin() + long(n / 2), sorted.begin() + long(n));
  if (n % 2 == 1) return sorted[n / 2];
  // Even: the mean of the two middle samples; the lower one is the largest below n / 2.
  const double upper = sorted[n / 2];
  const double lower = *std::max_element(sorted.begin(), sorted.begin() + long(n / 2));
  return (lower + upper) / 2;
}

}  // namespace kvserve
