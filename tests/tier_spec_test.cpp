// --kv-tiers parsing: every tier kind and Redis option, a tiers file, and a
// clear error for each kind of bad spec; byte sizes; opening the tiers.
#include "store/tier_spec.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>

#include "redis_test_support.h"
#include "test_support.h"
#include "util/byte_size.h"
#include "util/error.h"

namespace kvserve {
namespace {

namespace fs = std::filesystem;
using testing_files::expect_error_containing;

TEST(ByteSize, ParsesBinaryAndDecimalUnits) {
  EXPECT_EQ(parse_byte_size("4096"), 4096);
  EXPECT_EQ(parse_byte_size("512KiB"), 512 * 1024);
  EXPECT_EQ(parse_byte_size("2GiB"), int64_t(2) << 30);
  EXPECT_EQ(parse_byte_size("1.5MiB"), 1536 * 1024);
  EXPECT_EQ(parse_byte_size("20GB"), int64_t(20'000'000'000));
  EXPECT_EQ(parse_byte_size("1TiB"), int64_t(1) << 40);
  EXPECT_EQ(parse_byte_size("3G"), int64_t(3) << 30);
  expect_error_containing([] { (void)parse_byte_size("GiB"); }, "not a size");
  expect_error_containing([] { (void)parse_byte_size("1.2.3MiB"); }, "not a size");
  expect_error_containing([] { (void)parse_byte_size("."); }, "not a size");
  expect_error_containing([] { (void)parse_byte_size("5 GiB"); }, "unknown size unit");
  expect_error_containing([] { (void)parse_byte_size("3PiB"); }, "unknown size unit");
  expect_error_containing([] { (void)parse_byte_size("99999999999TB"); }, "too large");
}

TEST(TierSpec, ParsesTheIssueExample) {
  const auto tiers = parse_kv_tiers("host:2GiB,disk:/path:20GiB,redis://host:6379");
  ASSERT_EQ(tiers.size(), 3u);
  EXPECT_EQ(std::get<HostStoreOptions>(tiers[0]).budget_bytes, int64_t(2) << 30);
  const auto& d = std::get<DiskStoreOptions>(tiers[1]);
  EXPECT_EQ(d.dir, "/path");
  EXPECT_EQ(d.budget_bytes, int64_t(20) << 30);
  const auto& r = std::get<RedisTierSpec>(tiers[2]);
  ASSERT_EQ(r.options.seeds.size(), 1u);
  EXPECT_EQ(r.options.seeds[0], (RedisAddress{"host", 6379}));
  EXPECT_EQ(r.options.cluster, RedisClusterMode::Auto);
  EXPECT_EQ(r.options.ttl_seconds, 86400);
  EXPECT_EQ(r.options.key_prefix, "kvs:");
  EXPECT_TRUE(r.auth_file.empty());
  EXPECT_TRUE(r.options.credentials.user.empty());
}

TEST(TierSpec, ParsesEveryRedisOption) {
  const auto tiers = parse_kv_tiers(
      " redis://kvs@10.0.0.5:7000/?auth_file=/etc/kvserve/redis.auth&ttl=600&cluster=1&seed=10.0.0.6:7001"
      "&seed=[::1]:7002&pool=8&timeout_ms=250&connect_timeout_ms=50&prefix=fleetA: ");
  ASSERT_EQ(tiers.size(), 1u);
  const auto& r = std::get<RedisTierSpec>(tiers[0]);
  EXPECT_EQ(r.auth_file, "/etc/kvserve/redis.auth");
  EXPECT_EQ(r.options.credentials.user, "kvs");
  EXPECT_TRUE(r.options.credentials.password.empty());
  EXPECT_EQ(r.options.ttl_seconds, 600);
  EXPECT_EQ(r.options.cluster, RedisClusterMode::Cluster);
  EXPECT_EQ(r.options.seeds, (std::vector<RedisAddress>{{"10.0.0.5", 7000}, {"10.0.0.6", 7001}, {"::1", 7002}}));
  EXPECT_EQ(r.options.pool_size, 8);
  EXPECT_EQ(r.options.command_timeout, std::chrono::milliseconds(250));
  EXPECT_EQ(r.options.connect_timeout, std::chrono::milliseconds(50));
  EXPECT_EQ(r.options.key_prefix, "fleetA:");
  EXPECT_EQ(std::get<RedisTierSpec>(parse_kv_tiers("redis://h:1?cluster=0")[0]).options.cluster,
            RedisClusterMode::Standalone);
  EXPECT_EQ(std::get<RedisTierSpec>(parse_kv_tiers("redis://h:1?ttl=0")[0]).options.ttl_seconds, 0);
}

TEST(TierSpec, DiskPathsMayContainColons) {
  const auto tiers = parse_kv_tiers("disk:/mnt/a:b/kv:1.5GiB");
  EXPECT_EQ(std::get<DiskStoreOptions>(tiers[0]).dir, "/mnt/a:b/kv");
  EXPECT_EQ(std::get<DiskStoreOptions>(tiers[0]).budget_bytes, int64_t(3) << 29);
}

TEST(TierSpec, ReadsATiersFile) {
  const std::string dir = testing_redis::make_temp_dir("spec");
  testing_files::write_all(dir + "/tiers.conf", "# tiers, fastest first\nhost:1GiB\n\n  disk:/var/kv:10GiB  # local SSD\nredis://r:6379?ttl=60\n");
  const auto tiers = parse_kv_tiers("@" + dir + "/tiers.conf");
  ASSERT_EQ(tiers.size(), 3u);
  EXPECT_EQ(std::get<DiskStoreOptions>(tiers[1]).dir, "/var/kv");
  EXPECT_EQ(std::get<RedisTierSpec>(tiers[2]).options.ttl_seconds, 60);
  testing_files::write_all(dir + "/empty.conf", "# nothing\n");
  expect_error_containing([&] { (void)parse_kv_tiers("@" + dir + "/empty.conf"); }, "names no tier");
  expect_error_containing([&] { (void)parse_kv_tiers("@" + dir + "/missing.conf"); }, "cannot read");
  fs::remove_all(dir);
}

TEST(TierSpec, BadSpecsGetClearErrors) {
  const std::pair<const char*, const char*> cases[] = {
      {"", "empty tier"},
      {"host:1GiB,,disk:/x:1GiB", "empty tier"},
      {"ssd:/x:1GiB", "unknown tier 'ssd:/x:1GiB'"},
      {"host:", "bad size in 'host:'"},
      {"host:lots", "bad size in 'host:lots'"},
      {"host:0", "must be positive"},
      {"host:1GiB,host:2GiB", "more than one host tier"},
      {"disk:/x", "must be disk:PATH:SIZE"},
      {"disk::1GiB", "must be disk:PATH:SIZE"},
      {"disk:/x:1GiB,disk:/x:2GiB", "given twice"},
      {"redis://h", "'h' in 'redis://h' is not HOST:PORT"},
      {"redis://h:99999", "is not HOST:PORT"},
      {"redis://u:secret@h:1", "password in the URL"},
      {"redis://u@h:1", "no auth_file"},
      {"redis://@h:1", "empty user"},
      {"redis://h:1?ttl=-5", "ttl=-5"},
      {"redis://h:1?ttl", "not NAME=VALUE"},
      {"redis://h:1?cluster=maybe", "cluster=maybe"},
      {"redis://h:1?pool=0", "pool=0"},
      {"redis://h:1?tls=1", "unknown Redis option 'tls'"},
      {"redis://h:1?seed=nope", "'nope' in"},
  };
  for (const auto& [spec, message] : cases) expect_error_containing([&] { (void)parse_kv_tiers(spec); }, message);
}

TEST(TierSpec, OpensTiersAndReadsTheAuthFile) {
  const std::string dir = testing_redis::make_temp_dir("open");
  const std::string auth = dir + "/redis.auth";
  testing_files::write_all(auth, "user = other\npassword = pw\n");
  ::chmod(auth.c_str(), 0600);
  // Nothing listens on port 1: the Redis tier opens anyway and reconnects in the background.
  auto store = open_tiered_kv_store(fmt::format("host:1MiB,disk:{}/d:1MiB,redis://127.0.0.1:1?auth_file={}&connect_timeout_ms=50", dir, auth), {});
  ASSERT_EQ(store->tier_count(), 3u);
  EXPECT_EQ(store->tier(0).name(), "host");
  EXPECT_EQ(store->tier(1).name(), "disk:" + dir + "/d");
  EXPECT_EQ(store->tier(2).name(), "redis://127.0.0.1:1");
  EXPECT_FALSE(store->tier(2).stats().available);
  store.reset();
  expect_error_containing([&] { (void)open_tier(parse_kv_tiers(fmt::format("redis://kvs@127.0.0.1:1?auth_file={}", auth))[0]); },
                          "names user other");
  ::chmod(auth.c_str(), 0644);
  expect_error_containing([&] { (void)open_tier(parse_kv_tiers(fmt::format("redis://127.0.0.1:1?auth_file={}", auth))[0]); },
                          "chmod 600");
  fs::remove_all(dir);
}

// A host or disk tier smaller than one record would refuse every block: it is
// refused at start, by name, before a disk tier evicts what its directory holds.
TEST(TierSpec, RefusesATierSmallerThanOneRecord) {
  const std::string dir = testing_redis::make_temp_dir("small");
  TieredKvStoreOptions o;
  o.payload_bytes = 20 * 1024;
  expect_error_containing([&] { (void)open_tiered_kv_store("host:10KiB", o); },
                          "the host tier's budget of 10240 bytes cannot hold one block record of 20552 bytes");
  expect_error_containing([&] { (void)open_tiered_kv_store(fmt::format("host:1MiB,disk:{}/d:10KiB", dir), o); },
                          fmt::format("the disk:{}/d tier's budget of 10240 bytes", dir));
  EXPECT_FALSE(fs::exists(dir + "/d"));
  // One record exactly fits; a Redis budget is the server's.
  EXPECT_EQ(open_tiered_kv_store("host:20552,redis://127.0.0.1:1?connect_timeout_ms=50", o)->tier_count(), 2u);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace kvserve
