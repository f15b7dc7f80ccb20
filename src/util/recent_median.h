// The median of the last few samples of a noisy measurement. The engine's
// load-or-recompute choice compares two such costs; a moving average let one
// descheduled lookup (1 ms among 0.005 ms ones) flip the choice for dozens
// of admissions, where the median of the last 9 needs most of them slow.
#pragma once

#include <array>
#include <cstddef>

namespace kvserve {

class RecentMedian {
 public:
  static constexpr size_t kWindow = 9;

  void add(double sample);
  // The median of the samples kept (the last kWindow); 0 before the first.
  double value() const;
  size_t count() const { return count_ < kWindow ? count_ : kWindow; }

 private:
  std::array<double, kWindow> samples_{};
  size_t count_ = 0;  // samples ever added; the next goes to count_ % kWindow
};

}  // namespace kvserve
