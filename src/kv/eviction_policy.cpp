#include "kv/eviction_policy.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "util/error.h"

namespace kvserve {

double SteadyClock::now() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

LfuAgingPolicy::LfuAgingPolicy(double half_life_seconds) : half_life_(half_life_seconds) {
  if (!(half_life_seconds > 0)) fail("LFU half-life must be positive (got {} s)", half_life_seconds);
}

void LfuAgingPolicy::touch(BlockMeta& m, double now) const {
  m.score = m.score * std::exp2(-(now - m.score_time) / half_life_) + 1.0;
  m.score_time = now;
}

double LfuAgingPolicy::priority(const BlockMeta& m) const {
  // score >= 1 after the first touch (every cached block was published).
  return std::log2(std::max(m.score, 1.0)) + m.score_time / half_life_;
}

TtlPolicy::TtlPolicy(double ttl_seconds) : ttl_(ttl_seconds) {
  if (!(ttl_seconds > 0)) fail("prefix-cache TTL must be positive (got {} s)", ttl_seconds);
}

EvictionKind parse_eviction_kind(std::string_view name) {
  if (name == "lru") return EvictionKind::Lru;
  if (name == "lfu") return EvictionKind::LfuAging;
  if (name == "ttl") return EvictionKind::Ttl;
  fail("unknown eviction policy '{}' (expected lru, lfu or ttl)", name);
}

std::string_view eviction_kind_name(EvictionKind kind) {
  switch (kind) {
    case EvictionKind::Lru: return "lru";
    case EvictionKind::LfuAging: return "lfu";
    case EvictionKind::Ttl: return "ttl";
  }
  return "?";
}

std::unique_ptr<EvictionPolicy> make_eviction_policy(const EvictionOptions& options) {
  switch (options.kind) {
    case EvictionKind::Lru: return std::make_unique<LruPolicy>();
    case EvictionKind::LfuAging: return std::make_unique<LfuAgingPolicy>(options.half_life_seconds);
    case EvictionKind::Ttl: return std::make_unique<TtlPolicy>(options.ttl_seconds);
  }
  fail("unknown eviction policy");
}

}  // namespace kvserve
