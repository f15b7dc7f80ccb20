// Synthetic serving workloads driven through an Engine in this thread: a
// closed loop keeps `concurrency` requests in flight until all are done, and
// the report says what the KV cache and the scheduler did. Token ids are
// random (speed, memory and hit rates do not depend on which tokens they are).
//
// shared-prefix: every tenant has one system prompt of prefix_tokens tokens
//   (BOS first); request i belongs to tenant i % tenants and appends its own
//   suffix_tokens random tokens. With same_prompt, all tenants send the same
//   system prompt: what one tenant computed another could reuse, if the
//   cache let it (global scope) -- the workload that measures tenant isolation.
// returning: requests / turns conversations, each starting from its own
//   prefix_tokens context; a turn sends the whole history (every earlier
//   prompt and answer) plus suffix_tokens new tokens. Turns go round-robin
//   over the conversations, so between two turns of one conversation all the
//   others run (and, in a small cache, evict it): the workload of chats that
//   come back after a pause.
// hot-burst: every hot_every-th request sends the same hot prompt
//   (prefix_tokens + suffix_tokens); all the others send one-off prompts of
//   prefix_tokens tokens. With far more one-off tokens than the cache holds,
//   the hot prompt survives only if it is pinned (or kept hot enough).
#pragma once

#include <cstdint>
#include <string>

#include "engine/engine.h"

namespace kvserve {

struct WorkloadOptions {
  std::string name = "shared-prefix";
  int32_t requests = 64;
  int32_t prefix_tokens = 384;    // shared system prompt per tenant, BOS included
  int32_t suffix_tokens = 32;     // unique tokens per request
  int32_t tenants = 1;
  bool same_prompt = false;       // shared-prefix: every tenant sends the same system prompt
  int32_t turns = 3;              // returning: turns per conversation
  int32_t hot_every = 10;         // hot-burst: one hot request in this many
  bool pin_hot = true;            // hot-burst: hot requests ask for their prompt to be pinned
  int32_t max_tokens = 16;        // tokens generated per request
  int32_t concurrency = 8;        // requests in flight at once (closed loop)
  // Open loop: requests arrive at this mean rate (req/s, Poisson, seeded)
  // whatever is in flight, as independent users do; 0 = closed loop.
  double request_rate = 0;
  uint64_t seed = 1;

  // Throws kvserve::Error for non-positive counts or prompts past the context.
  void validate(int32_t context_length) const;
};

struct WorkloadReport {
  int32_t requests = 0;
  int64_t prompt_tokens = 0;            // over all requests
  int64_t prefill_tokens_computed = 0;  // prompt tokens actually run through the model
  int64_t cached_tokens = 0;            // prompt tokens served by the prefix cache
  double prefix_hit_rate = 0;           // cached_tokens / prompt_tokens
  // Cached tokens of each tenant's first request: before it, its tenant had
  // computed nothing, so every one of them came from another tenant's work.
  int64_t cross_tenant_cached_tokens = 0;
  double within_tenant_hit_rate = 0;    // hit rate of the requests after each tenant's first
  int64_t returning_prompt_tokens = 0;  // returning: prompt tokens of turns after the first
  int64_t returning_cached_tokens = 0;  //   of them served from a cache (memory or tiers)
  double returning_hit_rate = 0;        //   their ratio
  int64_t tier_blocks_loaded = 0;       // blocks loaded from KV tiers
  int64_t hot_prompt_tokens = 0;        // hot-burst: hot-prefix tokens of hot requests after the first
  int64_t hot_cached_tokens = 0;        //   of them served from the cache
  double hot_hit_rate = 0;              //   their ratio: the hot prefix's hit rate
  double ttft_p50_ms = 0, ttft_p99_ms = 0;  // exact, from every request's first token
  double tpot_p50_ms = 0;
  int64_t kv_bytes_peak = 0;
  int32_t max_running = 0;              // most sequences running in one step
  int64_t preemptions = 0;
  int64_t generated_tokens = 0;
  double seconds = 0;                   // wall time of the whole workload
  int32_t failed = 0;                   // requests that ended in an error
};

// Runs the workload on `engine` (which must not have been start()ed); the
// engine is stepped in this thread, which sleeps when idle until the next
// open-loop arrival.
WorkloadReport run_workload(Engine& engine, const WorkloadOptions& options);

}  // namespace kvserve
