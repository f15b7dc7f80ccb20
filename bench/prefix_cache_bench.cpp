// Cost of the prefix cache's bookkeeping per KV block, for both key hashes:
// hashing a block's key, and the whole admission path of a 1024-token prompt
// (64 blocks of 16 tokens) when it hits (keys + match + release) and when it
// misses (keys + match + reserve/commit + publish + release, evicting older
// prompts' blocks once the pool is full). No KV bytes are written: this is
// the overhead the cache adds to a prefill, not the prefill.
//
//   build/prefix_cache_bench
#include <benchmark/benchmark.h>

#include <memory>
#include <vector>

#include "kv/kv_spec.h"
#include "kv/prefix_cache.h"

namespace kvserve {
namespace {

constexpr int32_t kBlockSize = 16;
constexpr int32_t kPromptBlocks = 64;

BlockHashAlgo algo_of(const benchmark::State& state) {
  return state.range(0) == 0 ? BlockHashAlgo::Xxh3_128 : BlockHashAlgo::Sha256;
}

// A prompt of kPromptBlocks full blocks and one more token, distinct per seed.
std::vector<int32_t> prompt(int64_t seed) {
  std::vector<int32_t> t(size_t(kPromptBlocks * kBlockSize + 1));
  for (size_t i = 0; i < t.size(); ++i) t[i] = int32_t((seed * 7919 + int64_t(i)) % 32000);
  return t;
}

// The stories260K shape; the cache's bookkeeping does not depend on it.
struct Setup {
  ModelConfig model;
  std::unique_ptr<KvCache> cache;
  ManualClock clock;
  std::unique_ptr<PrefixCache> pc;

  explicit Setup(BlockHashAlgo algo, int32_t num_blocks) {
    model.dim = 64;
    model.hidden_dim = 172;
    model.n_layers = 5;
    model.n_heads = 8;
    model.n_kv_heads = 4;
    model.vocab_size = 32000;
    model.seq_len = 2048;
    KvCacheOptions o;
    o.block_size = kBlockSize;
    o.num_blocks = num_blocks;
    apply_kv_preset(o, "fp16");
    cache = std::make_unique<KvCache>(model, o);
    PrefixCacheOptions po;
    po.model_id = "bench";
    po.hash = algo;
    pc = std::make_unique<PrefixCache>(*cache, po, clock);
  }
};

void BM_BlockKey(benchmark::State& state) {
  const BlockHasher hasher(algo_of(state), "model and codecs");
  const std::vector<int32_t> tokens = prompt(1);
  BlockKey key;
  for (auto _ : state) {
    key = hasher.block_key(key, std::span(tokens).first(kBlockSize));
    benchmark::DoNotOptimize(key);
  }
  state.SetItemsProcessed(state.iterations());
  state.SetLabel(std::string(block_hash_algo_name(algo_of(state))) + ", per block");
}
BENCHMARK(BM_BlockKey)->Arg(0)->Arg(1);

void BM_AdmitHit(benchmark::State& state) {
  Setup s(algo_of(state), 4 * kPromptBlocks);
  const std::vector<int32_t> tokens = prompt(1);
  s.clock.advance(1.0);
  const CacheScope scope;
  {
    std::vector<BlockKey> keys;
    s.pc->block_keys(scope, tokens, keys);
    BlockTable t;
    (void)s.pc->match(scope, keys, int32_t(tokens.size()), t);
    if (!s.cache->reserve(t, int32_t(tokens.size()))) state.SkipWithError("reserve failed");
    s.cache->commit(t, int32_t(tokens.size()));
    s.pc->release(scope, t, keys);
  }
  std::vector<BlockKey> keys;
  for (auto _ : state) {
    keys.clear();
    s.pc->block_keys(scope, tokens, keys);
    BlockTable t;
    const PrefixMatch m = s.pc->match(scope, keys, int32_t(tokens.size()), t);
    if (m.cached_blocks != kPromptBlocks) state.SkipWithError("expected a full hit");
    s.pc->publish(scope, t, keys);
    s.cache->release(t);
  }
  state.SetItemsProcessed(state.iterations() * kPromptBlocks);
  state.SetLabel(std::string(block_hash_algo_name(algo_of(state))) + ", per block");
}
BENCHMARK(BM_AdmitHit)->Arg(0)->Arg(1);

void BM_AdmitMissAndPublish(benchmark::State& state) {
  Setup s(algo_of(state), 16 * kPromptBlocks);
  const CacheScope scope;
  std::vector<std::vector<int32_t>> prompts;
  for (int64_t i = 0; i < 64; ++i) prompts.push_back(prompt(i + 2));
  std::vector<BlockKey> keys;
  size_t next = 0;
  for (auto _ : state) {
    s.clock.advance(1.0);  // LRU: the prompt seen 64 iterations ago is long gone
    const std::vector<int32_t>& tokens = prompts[next++ % prompts.size()];
    keys.clear();
    s.pc->block_keys(scope, tokens, keys);
    BlockTable t;
    const PrefixMatch m = s.pc->match(scope, keys, int32_t(tokens.size()), t);
    if (m.cached_blocks != 0) state.SkipWithError("expected a miss");
    if (!s.cache->reserve(t, int32_t(tokens.size()))) state.SkipWithError("reserve failed");
    s.cache->commit(t, int32_t(tokens.size()));
    s.pc->publish(scope, t, keys);
    s.pc->release(scope, t, keys);
  }
  state.SetItemsProcessed(state.iterations() * kPromptBlocks);
  state.SetLabel(std::string(block_hash_algo_name(algo_of(state))) + ", per block");
  state.counters["evicted"] = double(s.pc->stats().counters.blocks_evicted);
}
BENCHMARK(BM_AdmitMissAndPublish)->Arg(0)->Arg(1);

}  // namespace
}  // namespace kvserve

BENCHMARK_MAIN();
