// The engine with KV tiers below memory: blocks published by one engine are
// loaded by another (a restarted process from disk, a replica through Redis)
// instead of being computed, with exactly the tokens a no-tier run produces;
// Redis dying mid-run costs recomputation, never a request.
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <map>

#include "engine/engine.h"
#include "redis_test_support.h"
#include "test_support.h"

namespace kvserve {
namespace {

using testing_files::kStoriesGguf;

const std::string kSystem =
    "Once upon a time, there was a little girl named Lily. She liked to play outside in the park with her friends. "
    "One day, she saw a big dog. ";

struct Served {
  std::vector<int32_t> tokens;
  RequestUsage usage;
  FinishReason finish = FinishReason::None;
};

class EngineTiersTest : public ::testing::Test {
 protected:
  void SetUp() override { model = Model::load(kStoriesGguf); }
  EngineOptions options(const std::string& tiers) {
    EngineOptions o;
    o.threads = 1;
    o.kv.num_blocks = 64;
    o.kv_tiers = tiers;
    o.tenant_secret = "a secret every replica shares";
    return o;
  }
  // The system prompt and `question`, 10 greedy tokens, recorded into `out`.
  Request request(const std::string& question, const std::string& tenant, Served& out) {
    Request r;
    r.prompt = model->require_tokenizer().encode(kSystem + question, true);
    r.max_tokens = 10;
    r.sampling.temperature = 0;
    r.tenant = tenant;
    r.on_event = [&out](const RequestEvent& e) {
      if (e.token >= 0) out.tokens.push_back(e.token);
      out.usage = e.usage;
      out.finish = e.finish;
    };
    return r;
  }
  // Serves each question after the system prompt, one at a time, as `tenant`.
  std::vector<Served> serve(Engine& engine, const std::vector<std::string>& questions,
                            const std::string& tenant = "acme") {
    std::vector<Served> out(questions.size());
    for (size_t i = 0; i < questions.size(); ++i) {
      EXPECT_EQ(engine.submit(request(questions[i], tenant, out[i])).status, SubmitResult::Status::Accepted);
      engine.run_until_idle();
    }
    return out;
  }
  std::unique_ptr<Model> model;
};

TEST_F(EngineTiersTest, RestartedEngineLoadsItsBlocksFromDisk) {
  const std::string dir = testing_redis::make_temp_dir("engine-disk");
  std::vector<Served> first, again, plain;
  {
    Engine engine(*model, options("disk:" + dir + ":64MiB"));
    first = serve(engine, {"Lily"});
    engine.flush_tiers();
    EXPECT_GT(engine.stats().tier_blocks_written, 0);
    EXPECT_EQ(engine.stats().tier_blocks_written, engine.stats().tier_blocks_queued);
    // A cold tier's misses say nothing about what loading a block costs (one
    // recorded as a block's cost could turn loading off).
    EXPECT_GT(engine.stats().tier_lookups, 0);
    EXPECT_EQ(engine.stats().tier_load_ms_per_block, 0);
  }  // the store writes what is queued before it closes
  {
    Engine engine(*model, options("disk:" + dir + ":64MiB"));
    again = serve(engine, {"Lily"});
    const EngineStats s = engine.stats();
    EXPECT_GT(s.tier_blocks_loaded, 0);
    EXPECT_GT(s.tier_load_ms_per_block, 0);
    // Every full block but the one holding the last prompt token came from disk.
    EXPECT_EQ(again[0].usage.cached_tokens, (again[0].usage.prompt_tokens - 1) / 16 * 16);
    EXPECT_EQ(s.prefill_tokens_computed, again[0].usage.prompt_tokens - again[0].usage.cached_tokens);
    // The tenant's prefix-cache hits count the blocks its tier hit served.
    const auto acme = std::find_if(s.prefix.tenants.begin(), s.prefix.tenants.end(),
                                   [](const PrefixCacheTenantStats& t) { return t.name == "acme"; });
    ASSERT_NE(acme, s.prefix.tenants.end());
    EXPECT_EQ(acme->counters.hit_tokens, again[0].usage.cached_tokens);
    EXPECT_EQ(acme->counters.hit_blocks, s.tier_blocks_loaded);
  }
  {
    EngineOptions o = options("");
    Engine engine(*model, o);
    plain = serve(engine, {"Lily"});
  }
  EXPECT_EQ(first[0].tokens, plain[0].tokens);
  EXPECT_EQ(again[0].tokens, plain[0].tokens);
  std::filesystem::remove_all(dir);
}

// With no secret given, a disk tier keeps one in its directory: a restarted
// process salts tenants' keys as before and finds its blocks (a random
// secret per process left every record unreachable).
TEST_F(EngineTiersTest, DiskTierKeepsTheTenantSecretAcrossRestarts) {
  const std::string dir = testing_redis::make_temp_dir("engine-secret");
  EngineOptions o = options("disk:" + dir + ":64MiB");
  o.tenant_secret.clear();
  std::vector<Served> first;
  {
    Engine engine(*model, o);
    first = serve(engine, {"Lily"});
  }
  struct stat st;
  ASSERT_EQ(::stat((dir + "/tenant.secret").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(st.st_size, 32);
  {
    Engine engine(*model, o);
    const std::vector<Served> again = serve(engine, {"Lily"});
    EXPECT_EQ(again[0].usage.cached_tokens, (again[0].usage.prompt_tokens - 1) / 16 * 16);
    EXPECT_EQ(again[0].tokens, first[0].tokens);
  }
  std::filesystem::remove_all(dir);
}

TEST_F(EngineTiersTest, TenantsDoNotSeeEachOthersBlocksInTheTiers) {
  const std::string dir = testing_redis::make_temp_dir("engine-tenants");
  {
    Engine engine(*model, options("disk:" + dir + ":64MiB"));
    serve(engine, {"Lily"}, "alice");
  }
  {
    Engine engine(*model, options("disk:" + dir + ":64MiB"));
    EXPECT_EQ(serve(engine, {"Lily"}, "bob")[0].usage.cached_tokens, 0);
    EXPECT_EQ(engine.stats().tier_blocks_loaded, 0);
    EXPECT_GT(serve(engine, {"Lily"}, "alice")[0].usage.cached_tokens, 0);
  }  // its writer has finished before the directory goes
  std::filesystem::remove_all(dir);
}

TEST_F(EngineTiersTest, ReplicaReusesBlocksThroughRedisAndSurvivesItsDeath) {
  if (!testing_redis::redis_installed()) GTEST_SKIP() << "redis-server is not installed";
  const std::string dir = testing_redis::make_temp_dir("engine-redis");
  testing_redis::RedisServer redis(testing_redis::free_port(), {}, dir);
  const std::string url = "redis://127.0.0.1:" + std::to_string(redis.port());
  Engine a(*model, options(url));
  Engine b(*model, options(url));
  const std::vector<Served> from_a = serve(a, {"Lily"});
  // A's blocks reach Redis off its engine thread; B finds them.
  std::vector<Served> from_b;
  for (int attempt = 0; attempt < 50; ++attempt) {
    from_b = serve(b, {"Lily"});
    if (from_b[0].usage.cached_tokens > 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_GT(from_b[0].usage.cached_tokens, 0);
  EXPECT_EQ(from_b[0].tokens, from_a[0].tokens);
  // Redis dies: B recomputes, loses nothing, answers the same.
  redis.kill();
  Engine c(*model, options(url));
  const std::vector<Served> from_c = serve(c, {"Lily", "Tom"});
  EXPECT_EQ(from_c[0].tokens, from_a[0].tokens);
  EXPECT_EQ(from_c[0].finish, FinishReason::Length);
  EXPECT_EQ(from_c[1].finish, FinishReason::Length);
  EXPECT_EQ(c.stats().tier_blocks_loaded, 0);
  std::filesystem::remove_all(dir);
}

TEST_F(EngineTiersTest, RedisKilledMidRunLosesNoRequestAndChangesNoToken) {
  if (!testing_redis::redis_installed()) GTEST_SKIP() << "redis-server is not installed";
  const std::vector<std::string> names = {"Lily", "Tom", "Sue", "Max", "Ben", "Mia", "Sam", "Zoe", "Tim", "Amy"};
  Engine plain(*model, options(""));
  const std::vector<Served> expected = serve(plain, names);
  const std::string dir = testing_redis::make_temp_dir("engine-redis-kill");
  testing_redis::RedisServer redis(testing_redis::free_port(), {}, dir);
  EngineOptions o = options("redis://127.0.0.1:" + std::to_string(redis.port()));
  o.scheduler.max_num_seqs = 3;
  o.kv.num_blocks = 24;  // three sequences at most: published prompts are evicted and looked up again
  Engine engine(*model, o);
  // All at once; Redis dies while the first ones decode and the tiers' writer
  // has blocks in flight.
  std::vector<Served> got(names.size());
  for (size_t i = 0; i < names.size(); ++i)
    ASSERT_EQ(engine.submit(request(names[i], "acme", got[i])).status, SubmitResult::Status::Accepted);
  for (int step = 0; step < 6; ++step) engine.step();
  EXPECT_GT(engine.stats().tier_blocks_queued, 0);
  redis.kill();
  engine.run_until_idle();
  for (size_t i = 0; i < names.size(); ++i) {
    EXPECT_EQ(got[i].finish, FinishReason::Length) << names[i];
    EXPECT_EQ(got[i].tokens, expected[i].tokens) << names[i];
  }
  const EngineStats s = engine.stats();
  EXPECT_EQ(s.kv.blocks_used, 0);
  // The dead tier was asked and failed (counted), and nothing came from it.
  ASSERT_EQ(s.tier.tiers.size(), 1u);
  EXPECT_GT(s.tier.tiers[0].errors, 0u);
  std::filesystem::remove_all(dir);
}

// Blocks count as written once a tier stored them, not when queued: with
// Redis unreachable nothing is written (every queued block was counted).
TEST_F(EngineTiersTest, BlocksNoTierStoredAreNotCountedAsWritten) {
  Engine engine(*model, options("redis://127.0.0.1:" + std::to_string(testing_redis::free_port())));
  serve(engine, {"Lily"});
  engine.flush_tiers();
  const EngineStats s = engine.stats();
  EXPECT_GT(s.tier_blocks_queued, 0);
  EXPECT_EQ(s.tier_blocks_written, 0);
  EXPECT_EQ(s.tier.written, 0u);
  ASSERT_EQ(s.tier.tiers.size(), 1u);
  EXPECT_GE(s.tier.tiers[0].errors, uint64_t(s.tier_blocks_queued));  // every write failed (lookups too)
}

// Under memory pressure an admission that cannot fit its prompt fetches
// nothing: blocks fetched for it were dropped (or loaded, left idle and
// reclaimed) and fetched again at every retry.
TEST_F(EngineTiersTest, BlocksFetchedUnderMemoryPressureAreAllUsed) {
  const std::vector<std::string> names = {"Lily", "Tom", "Sue", "Max", "Ben", "Mia", "Sam", "Zoe"};
  const std::string dir = testing_redis::make_temp_dir("engine-pressure");
  std::vector<Served> expected;
  {
    Engine writer(*model, options("disk:" + dir + ":64MiB"));
    expected = serve(writer, names);
  }
  EngineOptions o = options("disk:" + dir + ":64MiB");
  o.kv.num_blocks = 7;  // one of these sequences at a time (4-5 blocks each): the others wait
  {
    Engine engine(*model, o);
    std::vector<Served> got(names.size());
    for (size_t i = 0; i < names.size(); ++i)
      ASSERT_EQ(engine.submit(request(names[i], "acme", got[i])).status, SubmitResult::Status::Accepted);
    engine.run_until_idle();
    for (size_t i = 0; i < names.size(); ++i) EXPECT_EQ(got[i].tokens, expected[i].tokens) << names[i];
    const EngineStats s = engine.stats();
    EXPECT_GT(s.tier_blocks_loaded, 0);
    EXPECT_EQ(s.tier.blocks_found, uint64_t(s.tier_blocks_loaded));
  }  // its writer has finished before the directory goes
  std::filesystem::remove_all(dir);
}

TEST_F(EngineTiersTest, RefusesTiersItCannotServeExactly) {
  EngineOptions o = options("host:1MiB");
  o.prefix_caching = false;
  testing_files::expect_error_containing([&] { Engine e(*model, o); }, "needs prefix caching");
  o = options("host:1MiB");
  o.kv.set_dtype(KvDType::INT4);
  o.kv.residual = 32;
  testing_files::expect_error_containing([&] { Engine e(*model, o); }, "residual window");
}

}  // namespace
}  // namespace kvserve
