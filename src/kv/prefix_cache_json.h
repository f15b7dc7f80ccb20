// JSON forms of the prefix cache's observability structs, shared by the CLI's
// --json output and the server's metrics.
#pragma once

#include <nlohmann/json.hpp>

#include "kv/prefix_cache.h"

namespace kvserve {

// {"queries", "query_tokens", "hit_tokens", "query_blocks", "hit_blocks",
//  "token_hit_rate", "block_hit_rate", "blocks_stored", "blocks_evicted", "blocks_expired"}
nlohmann::json to_json(const PrefixCacheCounters& c);
// The counters plus "blocks_cached", "blocks_idle", "blocks_pinned", "pin_cap_blocks",
// "sidecars", "bytes_per_block", "memory_saved_bytes", "events_dropped", "hash",
// "policy" and "tenants": [{"tenant", "name", "quota_blocks", counters, "blocks_cached",
// "blocks_idle", "blocks_pinned", "memory_saved_bytes"}].
nlohmann::json to_json(const PrefixCacheStats& s);
// {"cached_blocks", "cached_tokens", "checkpoint_tokens"}
nlohmann::json to_json(const PrefixMatch& m);
// {"kind": "stored"|"removed", "reason", "key", "parent" (hex; "" for a first
//  block), "block", "depth", "tenant", "time"}. Keys are internal: for routers
//  and logs, never for clients.
nlohmann::json to_json(const CacheEvent& e, BlockHashAlgo algo);

}  // namespace kvserve
