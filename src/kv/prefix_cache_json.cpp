#include "kv/prefix_cache_json.h"

namespace kvserve {

nlohmann::json to_json(const PrefixCacheCounters& c) {
  return {{"queries", c.queries},
          {"query_tokens", c.query_tokens},
          {"hit_tokens", c.hit_tokens},
          {"query_blocks", c.query_blocks},
          {"hit_blocks", c.hit_blocks},
          {"token_hit_rate", c.token_hit_rate()},
          {"block_hit_rate", c.block_hit_rate()},
          {"blocks_stored", c.blocks_stored},
          {"blocks_evicted", c.blocks_evicted},
          {"blocks_expired", c.blocks_expired}};
}

nlohmann::json to_json(const PrefixCacheStats& s) {
  nlohmann::json j = to_json(s.counters);
  j["blocks_cached"] = s.blocks_cached;
  j["blocks_idle"] = s.blocks_idle;
  j["blocks_pinned"] = s.blocks_pinned;
  j["pin_cap_blocks"] = s.pin_cap_blocks;
  j["sidecars"] = s.sidecars;
  j["bytes_per_block"] = s.bytes_per_block;
  j["memory_saved_bytes"] = s.memory_saved_bytes;
  j["events_dropped"] = s.events_dropped;
  j["hash"] = s.hash;
  j["policy"] = s.policy;
  nlohmann::json tenants = nlohmann::json::array();
  for (const PrefixCacheTenantStats& t : s.tenants) {
    nlohmann::json tj = to_json(t.counters);
    tj["tenant"] = t.tenant;
    tj["name"] = t.name;
    tj["quota_blocks"] = t.quota_blocks;
    tj["blocks_cached"] = t.blocks_cached;
    tj["blocks_idle"] = t.blocks_idle;
    tj["blocks_pinned"] = t.blocks_pinned;
    tj["memory_saved_bytes"] = t.memory_saved_bytes;
    tenants.push_back(std::move(tj));
  }
  j["tenants"] = std::move(tenants);
  return j;
}

nlohmann::json to_json(const PrefixMatch& m) {
  return {{"cached_blocks", m.cached_blocks}, {"cached_tokens", m.cached_tokens},
          {"checkpoint_tokens", m.checkpoint_tokens}};
}

nlohmann::json to_json(const CacheEvent& e, BlockHashAlgo algo) {
  const bool first = e.parent == BlockKey{};
  return {{"kind", cache_event_kind_name(e.kind)},
          {"reason", cache_remove_reason_name(e.reason)},
          {"key", e.key.hex(algo)},
          {"parent", first ? std::string() : e.parent.hex(algo)},
          {"block", e.block},
          {"depth", e.depth},
          {"tenant", e.tenant},
          {"time", e.time}};
}

}  // namespace kvserve
