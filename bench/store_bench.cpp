// Throughput and latency of each KV store tier for real block sizes: one
// stories260K block and one 400M-model block, each in FP16 and in the INT4
// preset (bytes from KvCache::stats() on the model shapes, record header
// included). One iteration is one batched call of kBatch blocks, the shape of
// a chain lookup; items/s is blocks per second and bytes/s block bytes.
//
//   host   process memory
//   disk   one file per block in --disk-dir (default /tmp); reads come from
//          the page cache once written, as for a warm local tier
//   redis  a redis-server given as --redis=HOST:PORT (bench/store_bench.sh
//          starts one on loopback); skipped without it
//   tiered TieredKvStore::put (what the engine pays on eviction: encode and
//          enqueue, no I/O) and lookup through host+disk
//
//   bench/store_bench.sh    (starts Redis, runs build/store_bench)
#include <benchmark/benchmark.h>

#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "kv/kv_cache.h"
#include "kv/kv_spec.h"
#include "store/block_record.h"
#include "store/disk_store.h"
#include "store/host_store.h"
#include "store/redis_store.h"
#include "store/tiered_kv_store.h"

namespace kvserve {
namespace {

constexpr int kBatch = 16;  // blocks per call

std::string g_redis;                    // --redis=HOST:PORT
std::string g_disk_dir = "/tmp";        // --disk-dir=PATH

struct BlockShape {
  const char* name;
  size_t bytes;  // one record: header + the encoded block over all layers
};

ModelConfig stories_shape() {
  ModelConfig c;
  c.dim = 64;
  c.hidden_dim = 172;
  c.n_layers = 5;
  c.n_heads = 8;
  c.n_kv_heads = 4;
  c.vocab_size = 512;
  c.seq_len = 512;
  return c;
}

ModelConfig m400_shape() {
  ModelConfig c;
  c.dim = 1536;
  c.hidden_dim = 4096;
  c.n_layers = 12;
  c.n_heads = 24;
  c.n_kv_heads = 8;
  c.vocab_size = 32000;
  c.seq_len = 16512;
  return c;
}

size_t record_bytes(const ModelConfig& c, const char* preset) {
  KvCacheOptions o;
  o.block_size = 16;
  o.num_blocks = 1;
  apply_kv_preset(o, preset, /*keep_block_size=*/true);  // 16-token records, as BENCHMARKS.md reports
  return KvCache(c, o).block_record_bytes() + kRecordHeaderBytes;
}

const std::vector<BlockShape>& shapes() {
  static const std::vector<BlockShape> s = {
      {"stories260K/fp16", record_bytes(stories_shape(), "fp16")},
      {"stories260K/int4", record_bytes(stories_shape(), "int4")},
      {"400M/fp16", record_bytes(m400_shape(), "fp16")},
      {"400M/int4", record_bytes(m400_shape(), "int4")},
  };
  return s;
}

BlockKey key_of(uint64_t n) {
  uint8_t b[16] = {};
  std::memcpy(b, &n, 8);
  b[15] = uint8_t(n * 13);
  return BlockKey::from_bytes(b);
}

// Distinct blocks cycled through, in whole batches: 512 MiB in memory (twice
// the L3, so reads come from DRAM), 64 MiB on disk and in Redis (file and
// key creation dominate the set-up there). Every benchmark writes them all
// once before timing, so puts measure replacing blocks in a full tier.
int64_t working_blocks(const std::string& tier, size_t bytes) {
  const int64_t working_bytes = tier == "host" ? int64_t(512) << 20 : int64_t(64) << 20;
  const int64_t n = std::max<int64_t>(kBatch * 4, working_bytes / int64_t(bytes));
  return n / kBatch * kBatch;
}

std::unique_ptr<KvStore> make_tier(const std::string& tier, int64_t budget) {
  if (tier == "host") return std::make_unique<HostStore>(HostStoreOptions{budget});
  if (tier == "disk") {
    const std::string dir = g_disk_dir + "/kvserve-store-bench";
    std::filesystem::remove_all(dir);
    return std::make_unique<DiskStore>(DiskStoreOptions{.dir = dir, .budget_bytes = budget});
  }
  RedisStoreOptions o;
  o.seeds = {*parse_redis_address(g_redis)};
  o.key_prefix = "kvs-bench:";
  o.ttl_seconds = 600;
  return std::make_unique<RedisStore>(o);
}

struct Batches {
  std::vector<std::vector<BlockKey>> keys;  // (batch, kBatch)
  Bytes block;
  std::vector<ByteView> views;              // kBatch views of `block`
};

Batches make_batches(size_t bytes, int64_t blocks) {
  Batches b;
  b.block.resize(bytes);
  for (size_t i = 0; i < bytes; ++i) b.block[i] = uint8_t(i * 31);
  b.views.assign(kBatch, ByteView(b.block));
  for (int64_t first = 0; first < blocks; first += kBatch) {
    std::vector<BlockKey> keys;
    for (int i = 0; i < kBatch; ++i) keys.push_back(key_of(uint64_t(first + i)));
    b.keys.push_back(std::move(keys));
  }
  return b;
}

void report(benchmark::State& state, size_t bytes) {
  state.SetItemsProcessed(int64_t(state.iterations()) * kBatch);
  state.SetBytesProcessed(int64_t(state.iterations()) * kBatch * int64_t(bytes));
  state.counters["us_per_block"] =
      benchmark::Counter(double(kBatch), benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}

void BM_Put(benchmark::State& state, std::string tier, BlockShape shape) {
  const int64_t blocks = working_blocks(tier, shape.bytes);
  auto store = make_tier(tier, blocks * int64_t(shape.bytes) * 2);
  Batches b = make_batches(shape.bytes, blocks);
  for (const auto& keys : b.keys) (void)store->put(keys, b.views, keys.front());
  size_t next = 0;
  for (auto _ : state) {
    const size_t stored = store->put(b.keys[next], b.views, b.keys[next].front());
    if (stored != size_t(kBatch)) state.SkipWithError("put failed");
    next = (next + 1) % b.keys.size();
  }
  report(state, shape.bytes);
}

void BM_Get(benchmark::State& state, std::string tier, BlockShape shape) {
  const int64_t blocks = working_blocks(tier, shape.bytes);
  auto store = make_tier(tier, blocks * int64_t(shape.bytes) * 2);
  Batches b = make_batches(shape.bytes, blocks);
  for (const auto& keys : b.keys) (void)store->put(keys, b.views, keys.front());
  size_t next = 0;
  for (auto _ : state) {
    const auto got = store->get(b.keys[next], b.keys[next].front());
    if (!got.back()) state.SkipWithError("get missed");
    benchmark::DoNotOptimize(got.data());
    next = (next + 1) % b.keys.size();
  }
  report(state, shape.bytes);
}

// What the engine pays to hand an evicted block to the store.
void BM_TieredPut(benchmark::State& state, BlockShape shape) {
  const size_t payload = shape.bytes - kRecordHeaderBytes;
  TieredKvStoreOptions o;
  o.payload_bytes = payload;
  o.queue_blocks = size_t(1) << 20;
  o.queue_bytes = int64_t(1) << 40;
  std::vector<std::unique_ptr<KvStore>> tiers;
  tiers.push_back(std::make_unique<HostStore>(HostStoreOptions{int64_t(1) << 30}));
  TieredKvStore store(std::move(tiers), o);
  Batches b = make_batches(payload, working_blocks("host", shape.bytes));
  size_t next = 0;
  for (auto _ : state) {
    if (store.put(b.keys[next], b.views, b.keys[next].front()) != size_t(kBatch)) state.SkipWithError("dropped");
    next = (next + 1) % b.keys.size();
    if (next == 0) {
      state.PauseTiming();
      store.flush();
      state.ResumeTiming();
    }
  }
  store.flush();
  report(state, payload);
}

// A chain lookup served by the disk tier below an empty host tier (promotion off
// so every iteration reads disk), records checked.
void BM_TieredLookupFromDisk(benchmark::State& state, BlockShape shape) {
  const size_t payload = shape.bytes - kRecordHeaderBytes;
  const int64_t blocks = working_blocks("disk", shape.bytes);
  TieredKvStoreOptions o;
  o.payload_bytes = payload;
  o.promote = false;
  o.queue_blocks = size_t(1) << 20;
  o.queue_bytes = int64_t(1) << 40;
  std::vector<std::unique_ptr<KvStore>> tiers;
  tiers.push_back(std::make_unique<HostStore>(HostStoreOptions{int64_t(1) << 30}));
  tiers.push_back(make_tier("disk", blocks * int64_t(shape.bytes) * 2));
  TieredKvStore store(std::move(tiers), o);
  Batches b = make_batches(payload, blocks);
  for (const auto& keys : b.keys) {
    std::vector<Bytes> records;
    std::vector<ByteView> views;
    for (const BlockKey& k : keys) records.push_back(encode_record(o.identity, k, b.block));
    for (const Bytes& r : records) views.push_back(r);
    (void)store.tier(1).put(keys, views, keys.front());
  }
  size_t next = 0;
  for (auto _ : state) {
    const auto found = store.lookup(b.keys[next], b.keys[next].front());
    if (found.size() != size_t(kBatch)) state.SkipWithError("lookup missed");
    next = (next + 1) % b.keys.size();
  }
  report(state, payload);
}

void register_all() {
  for (const BlockShape& shape : shapes())
    benchmark::AddCustomContext(std::string("record_bytes ") + shape.name, std::to_string(shape.bytes));
  std::vector<std::string> tiers = {"host", "disk"};
  if (!g_redis.empty()) tiers.push_back("redis");
  for (const BlockShape& shape : shapes()) {
    for (const std::string& tier : tiers) {
      benchmark::RegisterBenchmark(("Put/" + tier + "/" + shape.name).c_str(), BM_Put, tier, shape)->UseRealTime();
      benchmark::RegisterBenchmark(("Get/" + tier + "/" + shape.name).c_str(), BM_Get, tier, shape)->UseRealTime();
    }
    benchmark::RegisterBenchmark((std::string("TieredPut/") + shape.name).c_str(), BM_TieredPut, shape)->UseRealTime();
    benchmark::RegisterBenchmark((std::string("TieredLookup/disk/") + shape.name).c_str(), BM_TieredLookupFromDisk,
                                 shape)
        ->UseRealTime();
  }
}

}  // namespace
}  // namespace kvserve

int main(int argc, char** argv) {
  std::vector<char*> rest;
  for (int i = 0; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--redis=", 0) == 0) kvserve::g_redis = a.substr(8);
    else if (a.rfind("--disk-dir=", 0) == 0) kvserve::g_disk_dir = a.substr(11);
    else rest.push_back(argv[i]);
  }
  if (!kvserve::g_redis.empty() && !kvserve::parse_redis_address(kvserve::g_redis)) {
    std::fprintf(stderr, "store_bench: --redis=%s is not HOST:PORT\n", kvserve::g_redis.c_str());
    return 1;
  }
  int n = int(rest.size());
  benchmark::Initialize(&n, rest.data());
  kvserve::register_all();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  std::filesystem::remove_all(kvserve::g_disk_dir + "/kvserve-store-bench");
  return 0;
}
