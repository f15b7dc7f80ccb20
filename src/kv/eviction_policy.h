// Which idle prefix-cache block to evict first: a policy is one priority
// function over a block's access history (SGLang's evict_policy), with time
// injected through a Clock so tests control it.
//
// The prefix cache computes a block's priority when the block becomes idle
// (its last reference goes) and keeps idle blocks ordered by it, lowest
// evicted first; ties go to the deeper block (chain tails before their
// parents), then to the block idle longest. Priorities therefore must not
// change while a block is idle: time enters through the block's history and
// the moment it went idle, never through a later `now`.
//
// Thread safety: policies are immutable; clocks as documented.
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>

namespace kvserve {

// Seconds on a monotonic clock.
class Clock {
 public:
  virtual ~Clock() = default;
  virtual double now() const = 0;
};

// std::chrono::steady_clock, from its epoch.
class SteadyClock final : public Clock {
 public:
  double now() const override;
};

// A clock the tests move by hand. Not thread-safe.
class ManualClock final : public Clock {
 public:
  explicit ManualClock(double start = 0.0) : now_(start) {}
  double now() const override { return now_; }
  void set(double t) { now_ = t; }
  void advance(double seconds) { now_ += seconds; }

 private:
  double now_;
};

// A cached block's history, kept by the prefix cache.
struct BlockMeta {
  double stored_at = 0.0;    // seconds, when it was published
  double last_access = 0.0;  // seconds, when it was last published, hit, or released by
                             // the last sequence using it
  int64_t hits = 0;          // times a match reused it
  double score = 0.0;        // policy state, changed only by touch (LFU: decayed access count
  double score_time = 0.0;   //   and the time it was decayed to, in seconds)
  int32_t depth = 0;         // block index in its chain (0 = first block of a prompt)
};

class EvictionPolicy {
 public:
  virtual ~EvictionPolicy() = default;
  virtual std::string_view name() const = 0;
  // Updates the policy's state in m for an access (publish or hit) at `now`.
  virtual void touch(BlockMeta& m, double now) const {}
  // Eviction order of an idle block: lower is evicted first.
  virtual double priority(const BlockMeta& m) const = 0;
  // Whether an idle block may be dropped now without memory pressure. Must
  // hold for a prefix of the priority order (expiry never skips a block that
  // is to be evicted earlier): PrefixCache::expire stops at the first live one.
  virtual bool expired(const BlockMeta& m, double now) const { return false; }
};

// Least recently used first.
class LruPolicy final : public EvictionPolicy {
 public:
  std::string_view name() const override { return "lru"; }
  double priority(const BlockMeta& m) const override { return m.last_access; }
};

// Least frequently used, with aging: each access adds 1 to a count that
// halves every `half_life` seconds, so a prefix that was hot an hour ago
// cannot hold the cache against today's. The priority, log2 of the count
// extrapolated to a common time, orders blocks as their counts at any single
// moment would: log2(score) + score_time / half_life.
class LfuAgingPolicy final : public EvictionPolicy {
 public:
  explicit LfuAgingPolicy(double half_life_seconds);
  std::string_view name() const override { return "lfu"; }
  void touch(BlockMeta& m, double now) const override;
  double priority(const BlockMeta& m) const override;

 private:
  double half_life_;
};

// Time to live: an idle block unused for `ttl` seconds expires (dropped by
// PrefixCache::expire or when a match reaches it); under memory pressure the
// soonest to expire goes first (which is LRU order).
class TtlPolicy final : public EvictionPolicy {
 public:
  explicit TtlPolicy(double ttl_seconds);
  std::string_view name() const override { return "ttl"; }
  double priority(const BlockMeta& m) const override { return m.last_access + ttl_; }
  bool expired(const BlockMeta& m, double now) const override { return now >= m.last_access + ttl_; }

 private:
  double ttl_;
};

enum class EvictionKind : uint8_t { Lru, LfuAging, Ttl };

struct EvictionOptions {
  EvictionKind kind = EvictionKind::Lru;
  double half_life_seconds = 300.0;  // LFU: seconds for an access to count half
  double ttl_seconds = 600.0;        // TTL: seconds an idle block stays cached
};

// Parses "lru", "lfu", "ttl"; throws kvserve::Error otherwise.
EvictionKind parse_eviction_kind(std::string_view name);
std::string_view eviction_kind_name(EvictionKind kind);
// Throws kvserve::Error for a non-positive half-life or TTL.
std::unique_ptr<EvictionPolicy> make_eviction_policy(const EvictionOptions& options);

}  // namespace kvserve
