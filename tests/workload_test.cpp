// The serving workloads on the real model measure what the prefix cache
// promises (issue 5): a shared prompt is computed once, a tenant never reuses
// another tenant's blocks (while reuse within a tenant is untouched), and a
// pinned hot prompt survives a flood of one-off requests that an unpinned one
// does not.
#include "engine/workload.h"

#include <gtest/gtest.h>

#include "test_support.h"
#include "util/error.h"

namespace kvserve {
namespace {

using testing_files::kStoriesGguf;

class WorkloadTest : public ::testing::Test {
 public:
  void SetUp() override { model = Model::load(kStoriesGguf); }
  EngineOptions options(int32_t blocks) const {
    EngineOptions o;
    o.threads = 1;
    o.kv.num_blocks = blocks;
    return o;
  }
  WorkloadReport run(const EngineOptions& eo, const WorkloadOptions& wo) {
    Engine engine(*model, eo);
    return run_workload(engine, wo);
  }
  std::unique_ptr<Model> model;
};

WorkloadOptions shared_prefix(int32_t requests, int32_t tenants, bool same_prompt) {
  WorkloadOptions w;
  w.name = "shared-prefix";
  w.requests = requests;
  w.tenants = tenants;
  w.same_prompt = same_prompt;
  w.prefix_tokens = 128;
  w.suffix_tokens = 8;
  w.max_tokens = 4;
  w.concurrency = 1;  // each tenant's first request runs after the earlier tenants' finished
  return w;
}

TEST_F(WorkloadTest, SharedPromptIsComputedOnce) {
  WorkloadOptions w = shared_prefix(16, 1, false);
  w.concurrency = 4;  // requests that arrive together wait for the one computing the prompt
  EngineOptions off = options(256);
  off.prefix_caching = false;
  const WorkloadReport cold = run(off, w);
  const WorkloadReport warm = run(options(256), w);
  EXPECT_EQ(cold.failed + warm.failed, 0);
  EXPECT_EQ(cold.prefill_tokens_computed, cold.prompt_tokens);
  EXPECT_EQ(cold.cached_tokens, 0);
  // The first request computes the 128-token prompt; the 15 others reuse its
  // 8 full blocks and compute only their own 8 tokens (and the prompt's
  // last partial-block tail, none here).
  EXPECT_EQ(warm.cached_tokens, 15 * 128);
  EXPECT_EQ(warm.prefill_tokens_computed, warm.prompt_tokens - 15 * 128);
  // Four sequences at once: the shared prompt's blocks are held once, not
  // four times (the bytes of four 8-block copies, against one and the
  // sequences' own blocks).
  EXPECT_EQ(warm.max_running, 4);
  EXPECT_LT(warm.kv_bytes_peak * 2, cold.kv_bytes_peak);
}

TEST_F(WorkloadTest, OpenLoopArrivalsRunEveryRequestAtItsTime) {
  WorkloadOptions w = shared_prefix(12, 1, false);
  w.request_rate = 40;  // Poisson arrivals, mean gap 25 ms: the 11 gaps take ~0.27 s
  const WorkloadReport r = run(options(256), w);
  EXPECT_EQ(r.failed, 0);
  EXPECT_EQ(r.generated_tokens, 12 * 4);
  EXPECT_EQ(r.cached_tokens, 11 * 128);  // every later request finds the prompt
  EXPECT_GT(r.seconds, 0.1);            // the engine waited for arrivals
  w.name = "returning";
  w.turns = 2;
  EXPECT_THROW(w.validate(512), Error);  // a turn waits for its answer: closed loop only
}

TEST_F(WorkloadTest, TenantScopeHasNoCrossTenantHitsAndKeepsHitsWithinATenant) {
  const WorkloadOptions w = shared_prefix(12, 3, true);  // three tenants, one system prompt
  EngineOptions global = options(256);
  global.prefix_scope = CacheScopeKind::Global;
  EngineOptions tenant = options(256);
  tenant.prefix_scope = CacheScopeKind::Tenant;
  const WorkloadReport g = run(global, w);
  const WorkloadReport t = run(tenant, w);
  // Global: tenants 1 and 2 reuse what tenant 0 computed.
  EXPECT_EQ(g.cross_tenant_cached_tokens, 2 * 128);
  // Tenant scope: exactly zero, and the same reuse inside each tenant.
  EXPECT_EQ(t.cross_tenant_cached_tokens, 0);
  EXPECT_DOUBLE_EQ(t.within_tenant_hit_rate, g.within_tenant_hit_rate);
  EXPECT_GT(t.within_tenant_hit_rate, 0.9);
}

TEST_F(WorkloadTest, PinnedHotPromptSurvivesABurstOfOneOffRequests) {
  WorkloadOptions w;
  w.name = "hot-burst";
  w.requests = 120;
  w.hot_every = 10;
  w.prefix_tokens = 128;
  w.suffix_tokens = 8;
  w.max_tokens = 2;
  w.concurrency = 2;
  // 64 blocks of 16 tokens hold 1,024 tokens; the one-off prompts total
  // 108 x 128 = 13,824 tokens, 13x the cache.
  w.pin_hot = true;
  const WorkloadReport pinned = run(options(64), w);
  w.pin_hot = false;
  const WorkloadReport lru = run(options(64), w);
  EXPECT_EQ(pinned.failed + lru.failed, 0);
  EXPECT_GE(pinned.hot_hit_rate, 0.95);
  EXPECT_LT(lru.hot_hit_rate, 0.5);
}

}  // namespace
}  // namespace kvserve
