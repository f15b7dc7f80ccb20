// Flags of the commands that run the serving engine (serve, bench --workload):
// scheduler limits and prefix caching, turned into EngineOptions.
#pragma once

#include <CLI/CLI.hpp>

#include <string>

#include "engine/engine.h"
#include "tools/cli_common.h"

namespace kvserve::cli {

struct EngineCliOptions {
  SchedulerOptions scheduler;
  int32_t max_waiting = 256;
  std::string prefix_cache = "on";       // on | off
  int32_t kv_events = 0;                 // prefix-cache events kept for GET /v1/kv/events (0 = off)
  std::string prefix_aware = "on";       // on | off: admit cached prefixes first, wait for in-flight ones
  std::string prefix_scope = "tenant";   // global | tenant
  std::string prefix_hash = "xxh3";      // xxh3 | sha256
  std::string prefix_eviction = "lru";   // lru | lfu | ttl
  double prefix_ttl_seconds = 600;
  double prefix_half_life_seconds = 300;
  int32_t pin_after_hits = 0;            // 0 = no automatic pinning
  double max_pinned_fraction = 0.2;
  int32_t tenant_quota_blocks = -1;
  std::string tenant_secret_file;        // empty = a random secret per process
  std::string kv_tiers;                  // e.g. host:2GiB,disk:/path:20GiB,redis://host:port
};

// Adds --max-num-seqs, --max-batch-prefill-tokens, --max-waiting and the
// --prefix-* flags and --kv-tiers.
void add_engine_options(CLI::App& cmd, EngineCliOptions& o);

// The engine configuration the common and engine flags describe; `sparsity`
// is the default policy of requests (the --kv-policy flags).
EngineOptions engine_options(const CommonOptions& common, const EngineCliOptions& o, const Model& model,
                             const SparsityOptions& sparsity);

}  // namespace kvserve::cli
