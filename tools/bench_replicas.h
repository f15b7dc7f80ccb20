// kvserve bench --workload shared-prefix --replicas N: N `kvserve serve`
// processes sharing one Redis tier (issue 7). Replica 0 serves the first
// request and computes the shared prompt, whose blocks it writes through to
// Redis; then the other replicas serve the remaining requests (same prefix,
// each its own suffix) and load the prefix's blocks instead of computing
// them. Reports the time to first token of computing against loading.
//
// Redis: the redis:// tier of --kv-tiers when given, else a redis-server
// started on a free loopback port for the run (needs redis-server on PATH).
// Every replica gets the bench's engine and KV flags, a free port and one
// tenant secret, so one tenant's blocks have the same keys on all of them.
#pragma once

#include <CLI/CLI.hpp>

#include "engine/workload.h"
#include "server/load_client.h"

namespace kvserve::cli {

struct ReplicaBenchOptions {
  int32_t replicas = 0;             // processes; 0 = no replica benchmark
  std::string model_path;
  std::string kv_tiers;             // the bench's --kv-tiers, if any
  WorkloadOptions workload;         // prefix_tokens, suffix_tokens, requests, concurrency, max_tokens
  bool json = false;
};

// Runs the benchmark. `bench` is the parsed bench subcommand: its options
// that `kvserve serve` also takes (KV layout, engine, threads...) are passed
// on to every replica.
void run_replica_bench(const ReplicaBenchOptions& o, const CLI::App& bench);

}  // namespace kvserve::cli
