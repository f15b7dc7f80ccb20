// The tiered store's metrics as the server's /metrics (Prometheus text
// exposition format) and as JSON for the CLI's --json. Names and fields are
// a contract: add, never rename.
//
// Prometheus, per tier (label tier="<TierStats::name>"):
//   kvserve_kv_tier_{hits,misses,puts,rejected,evictions,errors,corrupt,removes}_total   counters, in blocks
//   kvserve_kv_tier_{read,written}_bytes_total                                          counters, in bytes
//   kvserve_kv_tier_resident_{blocks,bytes}, kvserve_kv_tier_capacity_bytes             gauges (omitted when unknown)
//   kvserve_kv_tier_available                                                           gauge, 0 or 1
//   kvserve_kv_tier_{get,put}_seconds                                                   histograms, per call
// and for the store as a whole:
//   kvserve_kv_store_{lookups,blocks_requested,blocks_found,enqueued,dropped,written,promotions}_total
//   kvserve_kv_store_queued_{blocks,bytes}                                              gauges
//   kvserve_kv_store_lookup_seconds                                                     histogram, per lookup()
#pragma once

#include <nlohmann/json.hpp>

#include <string>

#include "store/tiered_kv_store.h"

namespace kvserve {

// Appends the metrics in the Prometheus text format (with # HELP and # TYPE lines).
void append_prometheus(const TieredStats& stats, std::string& out);

// {"tiers": [{"name", "hits", "misses", "read_bytes", "puts", "written_bytes",
//   "rejected", "removes", "evictions", "errors", "corrupt", "resident_blocks",
//   "resident_bytes", "capacity_bytes" (-1 = unknown), "available",
//   "get_calls", "get_mean_us", "get_p99_us", "put_calls", "put_mean_us",
//   "put_p99_us"}...], "lookups", "blocks_requested", "blocks_found",
//   "hit_rate" (blocks_found / blocks_requested, 0 when none), "enqueued",
//   "dropped", "written", "promotions", "queued_blocks", "queued_bytes",
//   "lookup_mean_us", "lookup_p99_us"}. p99 values are histogram bucket bounds.
nlohmann::json tiered_stats_json(const TieredStats& stats);

}  // namespace kvserve
