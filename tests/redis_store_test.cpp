// The Redis tier against real redis-server processes on loopback ports: a
// single server (round trip, TTL, AUTH/ACL, kill, hang, flush, late start) and
// a 3-node Redis Cluster (hash-tag routing, MOVED and ASK during a slot
// migration, a node killed). Plus the pure parts: CRC16 slots, redirections,
// addresses, credentials files, backoff.
#include "store/redis_store.h"

#include <gtest/gtest.h>
#include <hiredis/hiredis.h>
#include <sys/stat.h>

#include <cstring>
#include <filesystem>

#include "redis_test_support.h"
#include "test_support.h"
#include "util/error.h"
#include "util/timer.h"

namespace kvserve {
namespace {

namespace fs = std::filesystem;
using namespace testing_redis;
using std::chrono::milliseconds;

BlockKey key_of(uint64_t n) {
  uint8_t b[32] = {};
  std::memcpy(b, &n, 8);
  b[31] = uint8_t(n);
  return BlockKey::from_bytes(b);
}

Bytes block_of(size_t n, uint64_t seed) {
  Bytes b(n);
  for (size_t i = 0; i < n; ++i) b[i] = uint8_t(seed * 131 + i * 7);
  return b;
}

std::vector<BlockKey> keys_range(uint64_t first, uint64_t n) {
  std::vector<BlockKey> out;
  for (uint64_t i = 0; i < n; ++i) out.push_back(key_of(first + i));
  return out;
}

size_t put_range(KvStore& s, uint64_t first, uint64_t n, size_t bytes, const ChainTag& chain = std::nullopt) {
  std::vector<Bytes> blocks;
  std::vector<ByteView> views;
  for (uint64_t i = 0; i < n; ++i) blocks.push_back(block_of(bytes, first + i));
  for (const Bytes& b : blocks) views.push_back(b);
  return s.put(keys_range(first, n), views, chain);
}

// Expects every block of the range back, exactly.
void expect_range(KvStore& s, uint64_t first, uint64_t n, size_t bytes, const ChainTag& chain = std::nullopt) {
  const auto got = s.get(keys_range(first, n), chain);
  ASSERT_EQ(got.size(), n);
  for (uint64_t i = 0; i < n; ++i) {
    ASSERT_TRUE(got[i]) << "block " << first + i << " missing";
    EXPECT_EQ(*got[i], block_of(bytes, first + i)) << "block " << first + i;
  }
}

size_t hits(const std::vector<std::optional<Bytes>>& got) {
  return size_t(std::count_if(got.begin(), got.end(), [](const auto& g) { return g.has_value(); }));
}

// Short timeouts and backoff so fault tests take milliseconds.
RedisStoreOptions fast_options(const std::vector<RedisAddress>& seeds) {
  RedisStoreOptions o;
  o.seeds = seeds;
  o.connect_timeout = milliseconds(100);
  o.command_timeout = milliseconds(150);
  o.backoff.initial = milliseconds(20);
  o.backoff.max = milliseconds(200);
  o.pool_size = 2;
  return o;
}

// ---- pure parts ----

TEST(RedisSlots, Crc16AndHashTagsMatchTheRedisClusterSpec) {
  EXPECT_EQ(redis_crc16("123456789"), 0x31C3);
  EXPECT_EQ(redis_key_slot("foo"), 12182);
  EXPECT_EQ(redis_key_slot("bar"), 5061);
  EXPECT_EQ(redis_key_slot("{user1000}.following"), redis_key_slot("user1000"));
  EXPECT_EQ(redis_key_slot("{user1000}.followers"), redis_key_slot("{user1000}.following"));
  EXPECT_EQ(redis_key_slot("foo{}{bar}"), redis_key_slot("foo{}{bar}") );
  EXPECT_NE(redis_key_slot("foo{}{bar}"), redis_key_slot("bar"));  // an empty first tag hashes the whole key
  EXPECT_EQ(redis_key_slot("foo{{bar}}zap"), redis_key_slot("{bar"));
  EXPECT_EQ(redis_key_slot("foo{bar}{zap}"), redis_key_slot("bar"));
}

TEST(RedisRedirect, ParsesMovedAndAsk) {
  const RedisAddress asked{"10.0.0.1", 7000};
  auto moved = parse_redis_redirect("MOVED 3999 127.0.0.1:6381", asked);
  ASSERT_TRUE(moved);
  EXPECT_FALSE(moved->ask);
  EXPECT_EQ(moved->slot, 3999);
  EXPECT_EQ(moved->to, (RedisAddress{"127.0.0.1", 6381}));
  auto ask = parse_redis_redirect("ASK 12 [::1]:7001", asked);
  ASSERT_TRUE(ask);
  EXPECT_TRUE(ask->ask);
  EXPECT_EQ(ask->to, (RedisAddress{"::1", 7001}));
  auto unknown_host = parse_redis_redirect("MOVED 5 :7002", asked);
  ASSERT_TRUE(unknown_host);
  EXPECT_EQ(unknown_host->to, (RedisAddress{"10.0.0.1", 7002}));
  EXPECT_FALSE(parse_redis_redirect("ERR wrong number of arguments", asked));
  EXPECT_FALSE(parse_redis_redirect("MOVED 16384 h:1", asked));
  EXPECT_FALSE(parse_redis_redirect("MOVED x h:1", asked));
  EXPECT_FALSE(parse_redis_redirect("ASK 1 nohostport", asked));
}

TEST(RedisAddress, ParsesHostPortAndBracketedIpv6) {
  EXPECT_EQ(parse_redis_address("localhost:6379"), (RedisAddress{"localhost", 6379}));
  EXPECT_EQ(parse_redis_address("[::1]:7000"), (RedisAddress{"::1", 7000}));
  EXPECT_EQ((RedisAddress{"::1", 7000}).str(), "[::1]:7000");
  for (const char* bad : {"localhost", ":6379", "h:", "h:0", "h:65536", "h:12x", "::1:7000", "[::1]7000", "[::1"})
    EXPECT_FALSE(parse_redis_address(bad)) << bad;
}

TEST(RedisCredentials, ReadsAPrivateFileAndRefusesOthers) {
  const std::string dir = make_temp_dir("auth");
  const std::string path = dir + "/redis.auth";
  testing_files::write_all(path, "# kvserve\nuser = kvs\npassword = s3cret word  \n");
  ::chmod(path.c_str(), 0600);
  const RedisCredentials c = load_redis_credentials(path);
  EXPECT_EQ(c.user, "kvs");
  EXPECT_EQ(c.password, "s3cret word");
  ::chmod(path.c_str(), 0644);
  testing_files::expect_error_containing([&] { (void)load_redis_credentials(path); }, "chmod 600");
  testing_files::write_all(path, "user = kvs\n");
  ::chmod(path.c_str(), 0600);
  testing_files::expect_error_containing([&] { (void)load_redis_credentials(path); }, "no password");
  testing_files::write_all(path, "pasword = x\n");
  testing_files::expect_error_containing([&] { (void)load_redis_credentials(path); }, "unknown key 'pasword'");
  testing_files::expect_error_containing([&] { (void)load_redis_credentials(dir + "/missing"); }, "cannot read");
  fs::remove_all(dir);
}

TEST(Backoff, WaitsGrowGeometricallyUpToTheCapAndResetOnSuccess) {
  BackoffOptions o;
  o.initial = milliseconds(50);
  o.max = milliseconds(300);
  o.jitter = 0;
  Backoff b(o);
  const Backoff::TimePoint t0{};
  EXPECT_TRUE(b.ready(t0));
  const int64_t expected_ms[] = {50, 100, 200, 300, 300};
  Backoff::TimePoint now = t0;
  for (int64_t wait : expected_ms) {
    b.failed(now);
    EXPECT_EQ(b.next_attempt() - now, milliseconds(wait));
    EXPECT_FALSE(b.ready(now + milliseconds(wait - 1)));
    EXPECT_TRUE(b.ready(now + milliseconds(wait)));
    now += milliseconds(wait);
  }
  EXPECT_EQ(b.failures(), 5);
  b.succeeded();
  EXPECT_TRUE(b.ready(now));
  b.failed(now);
  EXPECT_EQ(b.next_attempt() - now, milliseconds(50));
}

TEST(Backoff, JitterOnlyShortensWaits) {
  BackoffOptions o;
  o.initial = milliseconds(100);
  o.max = milliseconds(100);
  o.jitter = 0.5;
  Backoff b(o, 42);
  for (int i = 0; i < 100; ++i) {
    b.failed({});
    const auto wait = b.next_attempt() - Backoff::TimePoint{};
    EXPECT_GE(wait, milliseconds(50));
    EXPECT_LE(wait, milliseconds(100));
  }
}

// ---- a single Redis server ----

class RedisServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!redis_installed()) GTEST_SKIP() << "redis-server is not installed (apt-get install redis-server)";
    dir_ = make_temp_dir("redis");
    server_ = std::make_unique<RedisServer>(free_port(), extra_args(), dir_);
  }
  void TearDown() override {
    server_.reset();
    if (!dir_.empty()) fs::remove_all(dir_);
  }
  virtual std::vector<std::string> extra_args() const { return {}; }

  std::string dir_;
  std::unique_ptr<RedisServer> server_;
};

TEST_F(RedisServerTest, RoundTripsBatchesWithTtlAndChainTags) {
  RedisStoreOptions o = fast_options({server_->address()});
  o.ttl_seconds = 600;
  RedisStore s(o);
  EXPECT_TRUE(s.available());
  EXPECT_FALSE(s.is_cluster());
  EXPECT_EQ(s.name(), "redis://127.0.0.1:" + std::to_string(server_->port()));

  const BlockKey root = key_of(1000);
  EXPECT_EQ(put_range(s, 0, 32, 129024, root), 32u);  // 32 blocks of a 400M-model INT4 block
  expect_range(s, 0, 32, 129024, root);
  EXPECT_EQ(put_range(s, 100, 3, 4480), 3u);
  expect_range(s, 100, 3, 4480);
  // The same key under another chain tag is another Redis key.
  EXPECT_EQ(hits(s.get(keys_range(0, 32))), 0u);

  const std::string redis_key = s.redis_key(key_of(5), root);
  EXPECT_EQ(redis_key, "kvs:{" + root.hex().substr(0, 32) + "}" + key_of(5).hex());
  const long long ttl = redis_command(server_->port(), {"TTL", redis_key})->integer;
  EXPECT_GT(ttl, 590);
  EXPECT_LE(ttl, 600);
  EXPECT_EQ(reply_string(redis_command(server_->port(), {"STRLEN", redis_key})), "129024");

  EXPECT_EQ(s.contains(keys_range(30, 4), root), (std::vector<bool>{true, true, false, false}));
  s.remove(keys_range(0, 2), root);
  EXPECT_EQ(s.contains(keys_range(0, 3), root), (std::vector<bool>{false, false, true}));

  const TierStats st = s.stats();
  EXPECT_EQ(st.puts, 35u);
  EXPECT_EQ(st.bytes_written, 32u * 129024 + 3 * 4480);
  EXPECT_EQ(st.hits, 35u);
  EXPECT_EQ(st.misses, 32u);
  EXPECT_EQ(st.errors, 0u);
  EXPECT_EQ(st.resident_blocks, -1);
  EXPECT_TRUE(st.available);
}

TEST_F(RedisServerTest, NoTtlMeansNoExpiry) {
  RedisStoreOptions o = fast_options({server_->address()});
  o.ttl_seconds = 0;
  RedisStore s(o);
  put_range(s, 0, 1, 100);
  EXPECT_EQ(redis_command(server_->port(), {"TTL", s.redis_key(key_of(0), std::nullopt)})->integer, -1);
}

TEST_F(RedisServerTest, KilledServerMeansFastMissesAndDroppedPutsThenReconnects) {
  RedisStore s(fast_options({server_->address()}));
  ASSERT_EQ(put_range(s, 0, 8, 4096), 8u);
  server_->kill();
  // Megabytes written into the dead pooled connection: EPIPE, not a SIGPIPE that kills the test.
  EXPECT_EQ(put_range(s, 200, 8, 1 << 20), 0u);
  const uint64_t big_put_errors = s.stats().errors;
  EXPECT_EQ(big_put_errors, 8u);

  Timer timer;
  size_t found = 0, stored = 0;
  for (int i = 0; i < 50; ++i) {
    found += hits(s.get(keys_range(0, 8)));
    stored += put_range(s, 100, 4, 4096);
  }
  // 100 calls against a dead server: each fails at once instead of waiting.
  EXPECT_LT(timer.seconds(), 2.0);
  EXPECT_EQ(found, 0u);
  EXPECT_EQ(stored, 0u);
  TierStats st = s.stats();
  EXPECT_EQ(st.errors, big_put_errors + 50u * 8 + 50u * 4);
  EXPECT_EQ(st.misses, 50u * 8);
  EXPECT_FALSE(st.available);

  server_->start();  // same port; nothing persisted, as after a crash
  ASSERT_TRUE(eventually([&] { return s.available(); })) << "the store did not reconnect";
  EXPECT_EQ(hits(s.get(keys_range(0, 8))), 0u);
  EXPECT_EQ(put_range(s, 0, 8, 4096), 8u);
  expect_range(s, 0, 8, 4096);
}

TEST_F(RedisServerTest, HungServerCostsOneTimeoutThenFailsFast) {
  RedisStore s(fast_options({server_->address()}));
  ASSERT_EQ(put_range(s, 0, 4, 1024), 4u);
  server_->pause();
  Timer first;
  EXPECT_EQ(hits(s.get(keys_range(0, 4))), 0u);
  EXPECT_LT(first.seconds(), 1.0);  // the 150 ms command timeout, not forever
  Timer rest;
  for (int i = 0; i < 20; ++i) EXPECT_EQ(hits(s.get(keys_range(0, 4))), 0u);
  EXPECT_LT(rest.seconds(), 1.0);  // down: no more waiting on it
  EXPECT_GE(s.stats().errors, 4u * 21);
  server_->resume();
  ASSERT_TRUE(eventually([&] { return s.available(); }));
  expect_range(s, 0, 4, 1024);
}

TEST_F(RedisServerTest, FlushedServerYieldsMissesNotErrors) {
  RedisStore s(fast_options({server_->address()}));
  ASSERT_EQ(put_range(s, 0, 4, 1024), 4u);
  ASSERT_EQ(reply_string(redis_command(server_->port(), {"FLUSHALL"})), "OK");
  EXPECT_EQ(hits(s.get(keys_range(0, 4))), 0u);
  EXPECT_EQ(s.stats().errors, 0u);
  EXPECT_EQ(s.stats().misses, 4u);
}

TEST(RedisStoreStart, ServerStartedLaterIsFoundInTheBackground) {
  if (!redis_installed()) GTEST_SKIP() << "redis-server is not installed";
  const std::string dir = make_temp_dir("late");
  const int port = free_port();
  Timer timer;
  RedisStore s(fast_options({RedisAddress{"127.0.0.1", port}}));
  EXPECT_LT(timer.seconds(), 1.0);
  EXPECT_FALSE(s.available());
  EXPECT_EQ(put_range(s, 0, 2, 100), 0u);
  {
    RedisServer server(port, {}, dir);
    ASSERT_TRUE(eventually([&] { return s.available(); }));
    EXPECT_EQ(put_range(s, 0, 2, 100), 2u);
    expect_range(s, 0, 2, 100);
  }
  fs::remove_all(dir);
}

TEST(RedisStoreOptions, RejectsInvalidOptions) {
  RedisStoreOptions o;
  EXPECT_THROW(RedisStore{o}, Error);  // no seed
  o.seeds = {RedisAddress{"127.0.0.1", 1}};
  o.pool_size = 0;
  EXPECT_THROW(RedisStore{o}, Error);
  o.pool_size = 1;
  o.ttl_seconds = -1;
  EXPECT_THROW(RedisStore{o}, Error);
}

class RedisAclTest : public RedisServerTest {
 protected:
  std::vector<std::string> extra_args() const override {
    return {"--user", "default", "off", "--user", "kvs", "on", ">s3cret", "~kvs:*", "&*", "+@all"};
  }
};

TEST_F(RedisAclTest, AuthenticatesAsAnAclUser) {
  RedisStoreOptions o = fast_options({server_->address()});
  o.credentials = {"kvs", "s3cret"};
  RedisStore s(o);
  EXPECT_TRUE(s.available());
  ASSERT_EQ(put_range(s, 0, 3, 500), 3u);
  expect_range(s, 0, 3, 500);

  o.credentials.password = "wrong";
  RedisStore wrong(o);
  EXPECT_FALSE(wrong.available());
  EXPECT_EQ(put_range(wrong, 0, 3, 500), 0u);
  EXPECT_EQ(hits(wrong.get(keys_range(0, 3))), 0u);
  EXPECT_EQ(wrong.stats().errors, 6u);

  o.credentials = {};
  RedisStore anonymous(o);  // the default user is off: every command is refused, and counted
  EXPECT_EQ(put_range(anonymous, 0, 1, 500), 0u);
  EXPECT_GE(anonymous.stats().errors, 1u);
}

// ---- a 3-node Redis Cluster ----

class RedisClusterTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (redis_installed()) cluster_ = new RedisCluster();
  }
  static void TearDownTestSuite() {
    delete cluster_;
    cluster_ = nullptr;
  }
  void SetUp() override {
    if (!cluster_) GTEST_SKIP() << "redis-server is not installed";
  }
  RedisStoreOptions options() const {
    // One seed is enough: the rest of the topology comes from CLUSTER SLOTS.
    RedisStoreOptions o = fast_options({cluster_->node(0).address()});
    o.connect_timeout = milliseconds(500);
    o.command_timeout = milliseconds(2000);
    return o;
  }
  static RedisCluster* cluster_;
};

RedisCluster* RedisClusterTest::cluster_ = nullptr;

TEST_F(RedisClusterTest, ChainsLandInOneSlotAndUntaggedBlocksSpread) {
  RedisStore s(options());
  ASSERT_TRUE(s.is_cluster());
  ASSERT_TRUE(s.available());
  for (uint64_t chain = 0; chain < 6; ++chain) {
    const BlockKey root = key_of(5000 + chain);
    ASSERT_EQ(put_range(s, chain * 100, 20, 2048, root), 20u);
    // Every key of the chain is in the slot Redis itself computes for the tag.
    const std::string first = s.redis_key(key_of(chain * 100), root);
    const long long server_slot = redis_command(cluster_->node(0).port(), {"CLUSTER", "KEYSLOT", first})->integer;
    EXPECT_EQ(redis_key_slot(first), server_slot);
    for (const BlockKey& k : keys_range(chain * 100, 20)) EXPECT_EQ(redis_key_slot(s.redis_key(k, root)), server_slot);
  }
  for (uint64_t chain = 0; chain < 6; ++chain) expect_range(s, chain * 100, 20, 2048, key_of(5000 + chain));

  // Without a tag, keys spread over every node and a batch still comes back whole.
  ASSERT_EQ(put_range(s, 10000, 60, 512), 60u);
  expect_range(s, 10000, 60, 512);
  for (size_t n = 0; n < cluster_->size(); ++n)
    EXPECT_GT(redis_command(cluster_->node(n).port(), {"DBSIZE"})->integer, 0) << "node " << n;
  // Our slot function agrees with the server's on untagged keys too.
  for (const BlockKey& k : keys_range(10000, 20)) {
    const std::string rk = s.redis_key(k, std::nullopt);
    EXPECT_EQ(redis_key_slot(rk), redis_command(cluster_->node(1).port(), {"CLUSTER", "KEYSLOT", rk})->integer);
  }
  EXPECT_EQ(s.stats().errors, 0u);
}

TEST_F(RedisClusterTest, FollowsAskDuringASlotMigrationAndMovedAfterIt) {
  RedisStore s(options());
  ASSERT_TRUE(s.is_cluster());
  const BlockKey root = key_of(777);
  ASSERT_EQ(put_range(s, 50000, 10, 1000, root), 10u);
  const std::string any_key = s.redis_key(key_of(50000), root);
  const int slot = redis_key_slot(any_key);
  const size_t from = cluster_->owner_of(slot);
  const size_t to = (from + 1) % cluster_->size();
  const std::string from_id = cluster_->node_id(from), to_id = cluster_->node_id(to);
  const int from_port = cluster_->node(from).port(), to_port = cluster_->node(to).port();
  const std::string slot_text = std::to_string(slot);

  // Redis's slot migration protocol: mark both ends, then move the keys.
  ASSERT_EQ(reply_string(redis_command(to_port, {"CLUSTER", "SETSLOT", slot_text, "IMPORTING", from_id})), "OK");
  ASSERT_EQ(reply_string(redis_command(from_port, {"CLUSTER", "SETSLOT", slot_text, "MIGRATING", to_id})), "OK");
  std::vector<std::string> migrate = {"MIGRATE", "127.0.0.1", std::to_string(to_port), "", "0", "5000", "KEYS"};
  for (const BlockKey& k : keys_range(50000, 10)) migrate.push_back(s.redis_key(k, root));
  ASSERT_EQ(reply_string(redis_command(from_port, migrate)), "OK");
  // The old owner answers ASK for keys it no longer has; the store, whose map
  // still names the old owner, follows it.
  EXPECT_TRUE(reply_string(redis_command(from_port, {"GET", any_key})).starts_with("ASK "));
  expect_range(s, 50000, 10, 1000, root);

  for (size_t n = 0; n < cluster_->size(); ++n)
    ASSERT_EQ(reply_string(redis_command(cluster_->node(n).port(), {"CLUSTER", "SETSLOT", slot_text, "NODE", to_id})), "OK");
  cluster_->wait_ok();
  // Now MOVED: the store updates its map and still finds every block.
  EXPECT_TRUE(reply_string(redis_command(from_port, {"GET", any_key})).starts_with("MOVED "));
  expect_range(s, 50000, 10, 1000, root);
  ASSERT_EQ(put_range(s, 50010, 5, 1000, root), 5u);
  expect_range(s, 50000, 15, 1000, root);
  EXPECT_EQ(cluster_->owner_of(slot), to);
  EXPECT_EQ(s.stats().errors, 0u);
}

TEST_F(RedisClusterTest, AKilledNodeCostsOnlyItsSlots) {
  RedisStore s(options());
  ASSERT_TRUE(s.is_cluster());
  // One chain per node, found by trying roots until each node owns one.
  std::vector<BlockKey> roots(cluster_->size());
  std::vector<bool> have(cluster_->size(), false);
  for (uint64_t r = 0; std::count(have.begin(), have.end(), true) < int(cluster_->size()); ++r) {
    const BlockKey root = key_of(90000 + r);
    const size_t owner = cluster_->owner_of(redis_key_slot(s.redis_key(key_of(0), root)));
    if (!have[owner]) {
      roots[owner] = root;
      have[owner] = true;
    }
  }
  for (size_t n = 0; n < roots.size(); ++n) ASSERT_EQ(put_range(s, 0, 4, 256, roots[n]), 4u);

  cluster_->node(2).kill();
  EXPECT_EQ(hits(s.get(keys_range(0, 4), roots[2])), 0u);
  const uint64_t errors = s.stats().errors;
  EXPECT_GE(errors, 4u);
  expect_range(s, 0, 4, 256, roots[0]);
  expect_range(s, 0, 4, 256, roots[1]);

  cluster_->node(2).start();  // rejoins with its saved node id; its data is gone
  cluster_->wait_ok();
  ASSERT_TRUE(eventually([&] { return s.available(); }));
  EXPECT_EQ(put_range(s, 0, 4, 256, roots[2]), 4u);
  expect_range(s, 0, 4, 256, roots[2]);
}

}  // namespace
}  // namespace kvserve
