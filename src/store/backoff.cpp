#include "store/backoff.h"

#include <algorithm>
#include <cmath>

namespace kvserve {

double Backoff::next_random() {
  // xorshift64*: a few instructions, and deterministic for a given seed.
  rng_ ^= rng_ >> 12;
  rng_ ^= rng_ << 25;
  rng_ ^= rng_ >> 27;
  return double((rng_ * 0x2545F4914F6CDD1DULL) >> 11) * 0x1.0p-53;
}

void Backoff::failed(TimePoint now) {
  ++failures_;
  const double base = double(options_.initial.count()) * std::pow(options_.multiplier, double(failures_ - 1));
  const double wait = std::min(base, double(options_.max.count()));
  const double jittered = wait * (1.0 - std::clamp(options_.jitter, 0.0, 1.0) * next_random());
  next_attempt_ = now + std::chrono::nanoseconds(int64_t(jittered));
}

}  // namespace kvserve
