// The tiered store: records checked on every read (corrupt, other model, other
// codec: refused and counted), lookup tier by tier with one call per tier and
// promotion, the bounded asynchronous write queue (drops counted, put never
// waits), a disk tier found again after a restart, a real KvCache block moved
// through host, disk and Redis, and Redis killed under a host+Redis store.
#include "store/tiered_kv_store.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <random>

#include "attention/paged_attention.h"
#include "kv/kv_cache.h"
#include "kv/kv_spec.h"
#include "redis_test_support.h"
#include "test_support.h"
#include "store/disk_store.h"
#include "store/host_store.h"
#include "store/redis_store.h"
#include "store/store_metrics_export.h"
#include "util/error.h"
#include "util/timer.h"

namespace kvserve {
namespace {

using testing_shapes::stories_shape;

namespace fs = std::filesystem;
using namespace testing_redis;

const RecordIdentity kIdentity{0xabc, 0xdef};

BlockKey key_of(uint64_t n) {
  uint8_t b[16] = {};
  std::memcpy(b, &n, 8);
  b[15] = uint8_t(n * 13);
  return BlockKey::from_bytes(b);
}

std::vector<BlockKey> chain(uint64_t first, uint64_t n) {
  std::vector<BlockKey> out;
  for (uint64_t i = 0; i < n; ++i) out.push_back(key_of(first + i));
  return out;
}

Bytes payload_of(uint64_t id, size_t bytes) {
  Bytes p(bytes);
  for (size_t i = 0; i < bytes; ++i) p[i] = uint8_t(id * 29 + i);
  return p;
}

size_t put_chain(TieredKvStore& s, uint64_t first, uint64_t n, size_t bytes, const ChainTag& tag = std::nullopt) {
  std::vector<Bytes> payloads;
  std::vector<ByteView> views;
  for (uint64_t i = 0; i < n; ++i) payloads.push_back(payload_of(first + i, bytes));
  for (const Bytes& p : payloads) views.push_back(p);
  return s.put(chain(first, n), views, tag);
}

// The tiers that served each block of a lookup, after checking every payload.
std::vector<int> served_by(const std::vector<LoadedBlock>& found, uint64_t first, size_t bytes) {
  std::vector<int> tiers;
  for (size_t i = 0; i < found.size(); ++i) {
    const ByteView p = found[i].payload();
    EXPECT_EQ(Bytes(p.begin(), p.end()), payload_of(first + i, bytes)) << "block " << i;
    tiers.push_back(found[i].tier);
  }
  return tiers;
}

TieredKvStoreOptions options(uint64_t payload_bytes = 0) {
  TieredKvStoreOptions o;
  o.identity = kIdentity;
  o.payload_bytes = payload_bytes;
  return o;
}

class TieredKvStoreTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = make_temp_dir("tiered"); }
  void TearDown() override { fs::remove_all(dir_); }

  std::unique_ptr<HostStore> host(int64_t budget) { return std::make_unique<HostStore>(HostStoreOptions{budget}); }
  std::unique_ptr<DiskStore> disk(int64_t budget = 1 << 24) {
    return std::make_unique<DiskStore>(DiskStoreOptions{.dir = dir_ + "/disk", .budget_bytes = budget});
  }
  template <class... T>
  static std::vector<std::unique_ptr<KvStore>> tiers(T&&... t) {
    std::vector<std::unique_ptr<KvStore>> out;
    (out.push_back(std::forward<T>(t)), ...);
    return out;
  }

  std::string dir_;
};

constexpr size_t kRecord = 1000 + kRecordHeaderBytes;  // one record of a 1000-byte payload

TEST_F(TieredKvStoreTest, WritesThroughEveryTierAndReadsTheLeadingRun) {
  TieredKvStore s(tiers(host(1 << 20), disk()), options(1000));
  EXPECT_EQ(put_chain(s, 0, 6, 1000), 6u);
  s.flush();
  for (size_t t = 0; t < 2; ++t) {
    EXPECT_EQ(s.tier(t).stats().puts, 6u);
    EXPECT_EQ(s.tier(t).stats().bytes_written, 6 * kRecord);
  }
  // Keys 0..5 stored, 6 and 7 never: the run stops at 6.
  EXPECT_EQ(served_by(s.lookup(chain(0, 8)), 0, 1000), (std::vector<int>{0, 0, 0, 0, 0, 0}));
  EXPECT_TRUE(s.lookup(chain(6, 2)).empty());
  const TieredStats st = s.stats();
  EXPECT_EQ(st.lookups, 2u);
  EXPECT_EQ(st.blocks_requested, 10u);
  EXPECT_EQ(st.blocks_found, 6u);
  EXPECT_EQ(st.enqueued, 6u);
  EXPECT_EQ(st.written, 6u);
  EXPECT_EQ(st.dropped, 0u);
  EXPECT_EQ(st.queued_blocks, 0u);
}

// written counts blocks some tier stored, not blocks offered: a write every
// tier refuses is not written, one any tier takes is, and promotions are not
// put() blocks.
TEST_F(TieredKvStoreTest, WrittenCountsBlocksSomeTierStored) {
  {
    TieredKvStore s(tiers(host(kRecord - 1)), options(1000));
    EXPECT_EQ(put_chain(s, 0, 3, 1000), 3u);
    s.flush();
    EXPECT_EQ(s.stats().enqueued, 3u);
    EXPECT_EQ(s.stats().written, 0u);
    EXPECT_EQ(s.tier(0).stats().rejected, 3u);
  }
  TieredKvStore s(tiers(host(kRecord - 1), disk()), options(1000));
  put_chain(s, 0, 3, 1000);
  s.flush();
  EXPECT_EQ(s.stats().written, 3u);
  EXPECT_EQ(s.lookup(chain(0, 3)).size(), 3u);  // from the disk, promoted (and refused) above
  s.flush();
  EXPECT_EQ(s.stats().promotions, 3u);
  EXPECT_EQ(s.stats().written, 3u);
}

TEST_F(TieredKvStoreTest, LooksUpTierByTierWithOneCallEachAndPromotesHits) {
  // The host tier holds 2 records; the disk tier holds all 6.
  TieredKvStore s(tiers(host(2 * kRecord), disk()), options(1000));
  put_chain(s, 0, 6, 1000);
  s.flush();
  ASSERT_EQ(s.tier(0).stats().resident_blocks, 2);  // 4 and 5, the latest
  s.tier(0).remove(chain(4, 2));
  put_chain(s, 0, 2, 1000);  // the host now has 0 and 1
  s.flush();
  const uint64_t host_calls = s.tier(0).stats().get_latency.count, disk_calls = s.tier(1).stats().get_latency.count;
  EXPECT_EQ(served_by(s.lookup(chain(0, 6)), 0, 1000), (std::vector<int>{0, 0, 1, 1, 1, 1}));
  EXPECT_EQ(s.tier(0).stats().get_latency.count, host_calls + 1);
  EXPECT_EQ(s.tier(1).stats().get_latency.count, disk_calls + 1);
  // The disk tier was asked only for what the host lacked.
  EXPECT_EQ(s.tier(1).stats().hits, 4u);
  s.flush();
  EXPECT_EQ(s.stats().promotions, 4u);
  // Promoted into the host tier, which keeps the most recent two.
  EXPECT_EQ(s.tier(0).contains(chain(0, 6)), (std::vector<bool>{false, false, false, false, true, true}));
  EXPECT_EQ(s.locate(chain(3, 4)), (std::vector<int>{1, 0, 0, -1}));
}

TEST_F(TieredKvStoreTest, ACorruptFileIsRefusedCountedRemovedAndRecomputed) {
  TieredKvStore s(tiers(disk()), options(1000));
  put_chain(s, 0, 4, 1000);
  s.flush();
  const std::string path = static_cast<DiskStore&>(s.tier(0)).path_of(key_of(2));
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(kRecordHeaderBytes + 500);
    f.put('\x5a' ^ char(payload_of(2, 1000)[500]));
  }
  EXPECT_EQ(served_by(s.lookup(chain(0, 4)), 0, 1000), (std::vector<int>{0, 0}));
  s.flush();
  EXPECT_EQ(s.tier(0).stats().corrupt, 1u);
  EXPECT_FALSE(fs::exists(path));
  EXPECT_EQ(s.tier(0).contains(chain(0, 4)), (std::vector<bool>{true, true, false, true}));
  // Recomputed and written again, it is served again.
  put_chain(s, 2, 1, 1000);
  s.flush();
  EXPECT_EQ(s.lookup(chain(0, 4)).size(), 4u);
}

// Garbage appended to a record is damage, not another fleet's record: it is
// deleted like any damaged record (it was left in place, refused at every read).
TEST_F(TieredKvStoreTest, ARecordWithTrailingGarbageIsRemoved) {
  TieredKvStore s(tiers(disk()), options(1000));
  put_chain(s, 0, 2, 1000);
  s.flush();
  const std::string path = static_cast<DiskStore&>(s.tier(0)).path_of(key_of(1));
  std::ofstream(path, std::ios::binary | std::ios::app) << "garbage";
  EXPECT_EQ(served_by(s.lookup(chain(0, 2)), 0, 1000), (std::vector<int>{0}));
  s.flush();
  EXPECT_EQ(s.tier(0).stats().corrupt, 1u);
  EXPECT_FALSE(fs::exists(path));
}

// A refused record served nothing: the tier counts it as corrupt and as a
// miss, and its bytes as not read (it was counted as a hit first).
TEST_F(TieredKvStoreTest, ARefusedRecordIsAMissNotAHit) {
  TieredKvStore s(tiers(disk()), options(1000));
  put_chain(s, 0, 3, 1000);
  s.flush();
  std::ofstream(static_cast<DiskStore&>(s.tier(0)).path_of(key_of(1)), std::ios::binary | std::ios::trunc) << "junk";
  EXPECT_EQ(s.lookup(chain(0, 3)).size(), 1u);
  const TierStats st = s.tier(0).stats();
  EXPECT_EQ(st.hits, 1u);
  EXPECT_EQ(st.misses, 1u);
  EXPECT_EQ(st.corrupt, 1u);
  EXPECT_EQ(st.bytes_read, kRecord);
}

TEST_F(TieredKvStoreTest, ACorruptCopyFallsThroughToTheNextTier) {
  TieredKvStore s(tiers(host(1 << 20), disk()), options(1000));
  put_chain(s, 0, 3, 1000);
  s.flush();
  // Replace the host's copy of block 1 with a record of another block.
  const Bytes wrong = encode_record(kIdentity, key_of(99), payload_of(1, 1000));
  const ByteView view = wrong;
  const BlockKey k1 = key_of(1);
  ASSERT_EQ(s.tier(0).put(std::span(&k1, 1), std::span(&view, 1)), 1u);
  // Block 0 from the host; from the refused block 1 on, the disk tier's one call serves the rest.
  EXPECT_EQ(served_by(s.lookup(chain(0, 3)), 0, 1000), (std::vector<int>{0, 1, 1}));
  EXPECT_EQ(s.tier(0).stats().corrupt, 1u);
  s.flush();
  EXPECT_EQ(served_by(s.lookup(chain(0, 3)), 0, 1000), (std::vector<int>{0, 0, 0}));  // removed, then promoted
}

TEST_F(TieredKvStoreTest, RecordsOfAnotherModelOrCodecAreNeverUsed) {
  {
    TieredKvStore writer(tiers(disk()), options(1000));
    put_chain(writer, 0, 3, 1000);
  }  // the destructor writes what is queued
  for (const RecordIdentity other : {RecordIdentity{0xabd, 0xdef}, RecordIdentity{0xabc, 0xdee}}) {
    TieredKvStoreOptions o = options(1000);
    o.identity = other;
    TieredKvStore reader(tiers(disk()), o);
    EXPECT_TRUE(reader.lookup(chain(0, 3)).empty());
    EXPECT_EQ(reader.tier(0).stats().corrupt, 1u);  // the first is refused; the lookup stops there
    reader.flush();
    EXPECT_EQ(reader.tier(0).stats().resident_blocks, 3);  // a sound foreign record is left alone
  }
  TieredKvStoreOptions o = options(999);  // a different block size
  TieredKvStore reader(tiers(disk()), o);
  EXPECT_TRUE(reader.lookup(chain(1, 2)).empty());
  EXPECT_EQ(reader.tier(0).stats().corrupt, 1u);
}

TEST_F(TieredKvStoreTest, KeysAreTheOnlyMatch) {
  // Two tenants' salted keys for the same tokens differ; neither sees the other's blocks.
  TieredKvStore s(tiers(host(1 << 20)), options(1000));
  put_chain(s, 0, 4, 1000);
  s.flush();
  std::vector<BlockKey> tenant_b = chain(0, 4);
  for (BlockKey& k : tenant_b) k.bytes[31] ^= 1;
  EXPECT_TRUE(s.lookup(tenant_b).empty());
  EXPECT_EQ(s.lookup(chain(0, 4)).size(), 4u);
}

TEST_F(TieredKvStoreTest, RestartFindsDiskBlocks) {
  {
    TieredKvStore s(tiers(host(1 << 20), disk()), options(1000));
    put_chain(s, 0, 5, 1000);
  }
  TieredKvStore s(tiers(host(1 << 20), disk()), options(1000));
  EXPECT_EQ(served_by(s.lookup(chain(0, 5)), 0, 1000), (std::vector<int>{1, 1, 1, 1, 1}));
}

// A tier whose put blocks until released, to fill the queue deterministically.
class GatedStore final : public KvStore {
 public:
  GatedStore() : KvStore("gated") {}
  std::promise<void> entered;
  std::promise<void> release;
  HostStore inner{HostStoreOptions{1 << 20}};

 private:
  std::vector<bool> do_put(std::span<const BlockKey> keys, std::span<const ByteView> values, const ChainTag&) override {
    if (!gated_) {
      gated_ = true;
      entered.set_value();
      release.get_future().wait();
    }
    (void)inner.put(keys, values);
    return std::vector<bool>(keys.size(), true);
  }
  std::vector<std::optional<Bytes>> do_get(std::span<const BlockKey> keys, const ChainTag&, bool) override {
    return inner.get(keys);
  }
  std::vector<bool> do_contains(std::span<const BlockKey> keys, const ChainTag&) override { return inner.contains(keys); }
  void do_remove(std::span<const BlockKey> keys, const ChainTag&) override { inner.remove(keys); }
  void fill_resident(TierStats&) const override {}
  bool gated_ = false;
};

TEST_F(TieredKvStoreTest, AFullQueueDropsAndCountsWithoutWaiting) {
  auto gated = std::make_unique<GatedStore>();
  GatedStore& gate = *gated;
  std::future<void> entered = gate.entered.get_future();
  TieredKvStoreOptions o = options(1000);
  o.queue_blocks = 4;
  o.write_batch = 1;
  TieredKvStore s(tiers(std::move(gated)), o);
  ASSERT_EQ(put_chain(s, 0, 1, 1000), 1u);
  entered.wait();  // the writer is stuck in the tier with block 0
  Timer timer;
  EXPECT_EQ(put_chain(s, 1, 9, 1000), 4u);  // blocks 1-4 fit; 5-9 are dropped
  EXPECT_LT(timer.seconds(), 0.5);
  TieredStats st = s.stats();
  EXPECT_EQ(st.enqueued, 5u);
  EXPECT_EQ(st.dropped, 5u);
  EXPECT_EQ(st.queued_blocks, 4u);
  EXPECT_EQ(st.queued_bytes, int64_t(4 * kRecord));
  gate.release.set_value();
  s.flush();
  EXPECT_EQ(s.lookup(chain(0, 10)).size(), 5u);
  EXPECT_EQ(s.stats().written, 5u);
}

// A block put a moment ago is found before the writer reaches it: from the
// batch being written and from the queue, unless a later remove cancels it,
// and without waiting for the stuck writer.
TEST_F(TieredKvStoreTest, LookupServesBlocksStillWaitingToBeWritten) {
  auto gated = std::make_unique<GatedStore>();
  GatedStore& gate = *gated;
  std::future<void> entered = gate.entered.get_future();
  TieredKvStoreOptions o = options(1000);
  o.write_batch = 1;
  TieredKvStore s(tiers(std::move(gated)), o);
  ASSERT_EQ(put_chain(s, 0, 1, 1000), 1u);
  entered.wait();  // the writer is stuck in the tier with block 0
  ASSERT_EQ(put_chain(s, 1, 3, 1000), 3u);
  const std::vector<BlockKey> keys = chain(0, 4);
  s.remove(std::span(keys).subspan(2, 1));  // block 2: written, then removed
  Timer timer;
  const std::vector<LoadedBlock> found = s.lookup(keys);
  EXPECT_LT(timer.seconds(), 0.5);
  constexpr int q = LoadedBlock::kFromWriteQueue;
  EXPECT_EQ(served_by(found, 0, 1000), (std::vector<int>{q, q}));
  for (size_t i = 0; i < found.size(); ++i)  // sealed records, as a tier would return them
    EXPECT_EQ(decode_record(*found[i].record, {kIdentity, keys[i], 1000}).status, RecordStatus::Ok);
  EXPECT_EQ(s.stats().queue_hits, 2u);
  EXPECT_EQ(s.stats().blocks_found, 2u);
  gate.release.set_value();
  s.flush();
  EXPECT_EQ(served_by(s.lookup(keys), 0, 1000), (std::vector<int>{0, 0}));
  EXPECT_EQ(s.stats().queue_hits, 2u);
}

TEST_F(TieredKvStoreTest, QueueByteBoundDropsToo) {
  TieredKvStoreOptions o = options(1000);
  o.queue_bytes = int64_t(kRecord) - 1;
  TieredKvStore s(tiers(host(1 << 20)), o);
  EXPECT_EQ(put_chain(s, 0, 3, 1000), 0u);
  EXPECT_EQ(s.stats().dropped, 3u);
}

TEST_F(TieredKvStoreTest, RejectsBadConstruction) {
  EXPECT_THROW(TieredKvStore(tiers(), options()), Error);
  TieredKvStoreOptions o = options();
  o.queue_blocks = 0;
  EXPECT_THROW(TieredKvStore(tiers(host(100)), o), Error);
}

TEST_F(TieredKvStoreTest, MetricsExportAsPrometheusTextAndJson) {
  std::vector<std::unique_ptr<KvStore>> t;
  t.push_back(host(1 << 20));
  t.push_back(std::make_unique<DiskStore>(DiskStoreOptions{.dir = dir_ + "/d\"q", .budget_bytes = 1 << 20}));
  TieredKvStore s(std::move(t), options(1000));
  put_chain(s, 0, 2, 1000);
  s.flush();
  ASSERT_EQ(s.lookup(chain(0, 3)).size(), 2u);
  std::string text;
  append_prometheus(s.stats(), text);
  const std::string disk = "disk:" + dir_ + "/d\\\"q";  // the quote escaped in the label
  for (const std::string& line : {
           std::string("# TYPE kvserve_kv_tier_hits_total counter"),
           std::string("kvserve_kv_tier_hits_total{tier=\"host\"} 2"),
           std::string("kvserve_kv_tier_misses_total{tier=\"host\"} 1"),
           "kvserve_kv_tier_misses_total{tier=\"" + disk + "\"} 1",
           std::string("kvserve_kv_tier_resident_bytes{tier=\"host\"} 2144"),
           std::string("kvserve_kv_tier_available{tier=\"host\"} 1"),
           std::string("kvserve_kv_tier_get_seconds_count{tier=\"host\"} 1"),
           std::string("kvserve_kv_tier_get_seconds_bucket{tier=\"host\",le=\"+Inf\"} 1"),
           std::string("kvserve_kv_store_blocks_requested_total 3"),
           std::string("kvserve_kv_store_blocks_found_total 2"),
           std::string("kvserve_kv_store_lookup_seconds_count 1"),
       })
    EXPECT_NE(text.find(line + "\n"), std::string::npos) << "missing: " << line;
  const nlohmann::json j = tiered_stats_json(s.stats());
  EXPECT_EQ(j["tiers"].size(), 2u);
  EXPECT_EQ(j["tiers"][0]["name"], "host");
  EXPECT_EQ(j["tiers"][0]["hits"], 2);
  EXPECT_EQ(j["tiers"][1]["misses"], 1);
  EXPECT_EQ(j["tiers"][1]["puts"], 2);
  EXPECT_EQ(j["tiers"][0]["written_bytes"], 2 * kRecord);
  EXPECT_DOUBLE_EQ(j["hit_rate"].get<double>(), 2.0 / 3.0);
  EXPECT_EQ(j["written"], 2);
}

// ---- a real KvCache block through every tier ----

std::unique_ptr<KvCache> int4_cache(const ModelConfig& c, const std::string& preset = "int4") {
  KvCacheOptions o;
  o.block_size = 16;
  o.num_blocks = 8;
  apply_kv_preset(o, preset, /*keep_block_size=*/true);
  return std::make_unique<KvCache>(c, o);
}

TEST_F(TieredKvStoreTest, KvCacheBlocksTravelAsEncodedBytesAndOtherCodecsAreRefused) {
  if (!redis_installed()) GTEST_SKIP() << "redis-server is not installed";
  RedisServer redis(free_port(), {}, dir_);
  const ModelConfig c = stories_shape();
  const auto a = int4_cache(c);
  BlockTable t;
  ASSERT_TRUE(a->reserve(t, 64));
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  std::vector<float> k(size_t(c.kv_dim())), v(k.size());
  for (int layer = 0; layer < c.n_layers; ++layer) {
    for (int pos = 0; pos < 64; ++pos) {
      for (auto& x : k) x = normal(rng);
      for (auto& x : v) x = normal(rng);
      a->write(layer, t, pos, k.data(), v.data());
    }
    a->seal(layer, t, 64);
  }
  a->commit(t, 64);
  const int32_t sealed = a->sealed_blocks(64);
  ASSERT_EQ(sealed, 3);

  TieredKvStoreOptions o;
  o.identity = {0x5107, a->block_codec_hash()};
  o.payload_bytes = a->block_record_bytes();
  EXPECT_EQ(o.payload_bytes, size_t(a->stats().bytes_per_block));  // INT4 codes + scales, not floats
  RedisStoreOptions ro;
  ro.seeds = {redis.address()};
  const BlockKey root = key_of(500);
  std::vector<Bytes> exported(static_cast<size_t>(sealed));
  {
    TieredKvStore s(tiers(host(1 << 20), disk(), std::make_unique<RedisStore>(ro)), o);
    for (int32_t b = 0; b < sealed; ++b) {
      a->export_block(t.blocks[size_t(b)], exported[size_t(b)]);
      EXPECT_TRUE(s.put(key_of(500 + uint64_t(b)), exported[size_t(b)], root));
    }
    s.flush();
    for (size_t tier = 0; tier < 3; ++tier) EXPECT_EQ(s.tier(tier).stats().puts, 3u) << tier;
  }
  // A fresh process sharing only Redis (another replica) finds the blocks there.
  TieredKvStore replica(tiers(host(1 << 20), std::make_unique<RedisStore>(ro)), o);
  const std::vector<LoadedBlock> found = replica.lookup(chain(500, 3), root);
  ASSERT_EQ(found.size(), 3u);
  const auto b = int4_cache(c);
  for (int32_t i = 0; i < sealed; ++i) {
    EXPECT_EQ(found[size_t(i)].tier, 1);
    b->import_block(i + 2, found[size_t(i)].payload());
    std::vector<uint8_t> back;
    b->export_block(i + 2, back);
    EXPECT_EQ(back, exported[size_t(i)]);
  }
  // A replica running INT8 KV has another codec hash: the same keys are refused.
  const auto int8 = int4_cache(c, "int8");
  TieredKvStoreOptions o8 = o;
  o8.identity.codec_hash = int8->block_codec_hash();
  o8.payload_bytes = int8->block_record_bytes();
  TieredKvStore other(tiers(std::make_unique<RedisStore>(ro)), o8);
  EXPECT_TRUE(other.lookup(chain(500, 3), root).empty());
  EXPECT_EQ(other.tier(0).stats().corrupt, 1u);
}

TEST_F(TieredKvStoreTest, RedisKilledMidRunLosesNothingAndReconnects) {
  if (!redis_installed()) GTEST_SKIP() << "redis-server is not installed";
  RedisServer redis(free_port(), {}, dir_);
  RedisStoreOptions ro;
  ro.seeds = {redis.address()};
  ro.connect_timeout = std::chrono::milliseconds(100);
  ro.command_timeout = std::chrono::milliseconds(150);
  ro.backoff.initial = std::chrono::milliseconds(20);
  ro.backoff.max = std::chrono::milliseconds(200);
  TieredKvStore s(tiers(host(1 << 20), std::make_unique<RedisStore>(ro)), options(1000));
  put_chain(s, 0, 4, 1000);
  s.flush();
  redis.kill();
  // Lookups are served by the host tier; new blocks still reach it; Redis errors are counted.
  Timer timer;
  EXPECT_EQ(served_by(s.lookup(chain(0, 4)), 0, 1000), (std::vector<int>{0, 0, 0, 0}));
  EXPECT_EQ(put_chain(s, 4, 4, 1000), 4u);
  s.flush();
  EXPECT_EQ(served_by(s.lookup(chain(0, 9)), 0, 1000), (std::vector<int>(8, 0)));
  EXPECT_LT(timer.seconds(), 2.0);
  const TierStats r = s.tier(1).stats();
  EXPECT_GE(r.errors, 4u);  // the four puts it could not store, plus the failed lookups
  EXPECT_FALSE(r.available);

  redis.start();
  ASSERT_TRUE(eventually([&] { return s.tier(1).stats().available; }));
  put_chain(s, 8, 2, 1000);
  s.flush();
  EXPECT_EQ(s.tier(1).contains(chain(8, 2)), (std::vector<bool>{true, true}));
}

}  // namespace
}  // namespace kvserve
