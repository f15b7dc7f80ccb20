// Wall-clock timing for benchmarks and metrics.
#pragma once

#include <chrono>
#include <ctime>

namespace kvserve {

class Timer {
 public:
  Timer() : start_(std::chrono::steady_clock::now()) {}
  void reset() { start_ = std::chrono::steady_clock::now(); }
  double seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }

 private:
  std::chrono::steady_clock::time_point start_;
};

// CPU time of the calling thread: on a shared machine, time the thread was
// descheduled does not count (time stalled on memory does).
class ThreadCpuTimer {
 public:
  ThreadCpuTimer() : start_(now()) {}
  void reset() { start_ = now(); }
  double seconds() const { return now() - start_; }

 private:
  static double now() {
    timespec ts{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return double(ts.tv_sec) + double(ts.tv_nsec) * 1e-9;
  }
  double start_;
};

}  // namespace kvserve
