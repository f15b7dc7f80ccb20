// Exponential backoff for reconnecting to a tier that failed: after the n-th
// consecutive failure the next attempt waits initial * multiplier^(n-1),
// capped at `max`, each wait shortened by up to `jitter` of itself (so
// replicas that lost Redis together do not reconnect in lockstep). Until then
// callers fail fast instead of waiting on a dead server.
//
// Time is an argument, never read here, so tests drive it.
//
// Thread safety: none; the owner guards it.
#pragma once

#include <chrono>
#include <cstdint>

namespace kvserve {

struct BackoffOptions {
  std::chrono::nanoseconds initial = std::chrono::milliseconds(50);  // wait after the first failure
  std::chrono::nanoseconds max = std::chrono::seconds(5);            // longest wait
  double multiplier = 2.0;                                           // growth per failure, >= 1
  double jitter = 0.2;                                               // fraction of a wait removed at random, 0..1
};

class Backoff {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;

  explicit Backoff(const BackoffOptions& options = {}, uint64_t seed = 1) : options_(options), rng_(seed | 1) {}

  // Whether an attempt may be made at `now` (no failure pending, or its wait over).
  bool ready(TimePoint now) const { return failures_ == 0 || now >= next_attempt_; }
  // Records a failed attempt at `now`; the next is allowed after the new wait.
  void failed(TimePoint now);
  // Records a success: the next failure starts again from `initial`.
  void succeeded() { failures_ = 0; }

  int failures() const { return failures_; }
  TimePoint next_attempt() const { return next_attempt_; }

 private:
  double next_random();  // uniform in [0, 1)

  BackoffOptions options_;
  uint64_t rng_;
  int failures_ = 0;       // consecutive failures
  TimePoint next_attempt_{};
};

}  // namespace kvserve
