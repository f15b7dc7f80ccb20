// Prefill attention at long context: one layer's attention for a chunk of
// query tokens at the end of a ctx-token context, at the 400M model's shape
// (head dim 64, 8 KV heads, GQA group 3, 12 layers of KV), per token
// (attend_kv_head, each token reading the whole KV) against tiles of
// consecutive tokens (attend_kv_head_tile, each block read once a tile).
//
// The two alternate layer by layer in one process, so the host's drift hits
// both alike; the layers cycle through all 12, so the KV streams from DRAM as
// in a forward pass. Reports each one's median layer time and their ratio.
//
//   build/prefill_attention_bench --benchmark_filter='Prefill/preset:(0|2)/ctx:16384'
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "attention/paged_attention.h"
#include "attention/tile_attention.h"
#include "kv/kv_cache.h"
#include "kv/kv_spec.h"
#include "util/thread_pool.h"

namespace kvserve {
namespace {

constexpr int kLayers = 12, kChunk = 64, kThreads = 2;
const char* const kPresets[] = {"fp16", "int8", "int4-small", "fp32", "int2-small"};

ModelConfig shape_400m(int32_t ctx) {
  ModelConfig c;
  c.dim = 1536;
  c.hidden_dim = 64;  // unused: attention only
  c.n_layers = kLayers;
  c.n_heads = 24;
  c.n_kv_heads = 8;
  c.vocab_size = 16;
  c.seq_len = ctx;
  return c;
}

double median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  return x[x.size() / 2];
}

// Args: preset index, context (tokens, the chunk included), tile tokens.
void BM_Prefill(benchmark::State& state) {
  const std::string preset = kPresets[state.range(0)];
  const int32_t ctx = int32_t(state.range(1));
  const int tile = int(state.range(2));
  const ModelConfig c = shape_400m(ctx);
  KvCacheOptions o;
  apply_kv_preset(o, preset, false);
  KvCache cache(c, o);
  BlockTable table;
  if (!cache.reserve(table, ctx)) {
    state.SkipWithError("out of KV blocks");
    return;
  }
  // As a forward pass over the chunk leaves the cache: every token written,
  // sealed to the chunk's end, not yet committed.
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> k(size_t(c.kv_dim())), v(size_t(c.kv_dim()));
  for (int layer = 0; layer < kLayers; ++layer) {
    for (int32_t pos = 0; pos < ctx; ++pos) {
      for (auto& x : k) x = normal(rng);
      for (auto& x : v) x = normal(rng);
      cache.write(layer, table, pos, k.data(), v.data());
    }
    cache.seal(layer, table, ctx);
  }
  const int head_dim = c.head_dim(), group = c.gqa_group(), q_dim = c.n_heads * head_dim;
  std::vector<float> q(size_t(kChunk) * size_t(q_dim)), out(q.size());
  for (auto& x : q) x = normal(rng) * 0.3f;
  const int32_t first = ctx - kChunk + 1;  // the chunk's first token sees this many slots
  ThreadPool pool(kThreads);
  std::vector<AttentionScratch> scratch(kThreads);

  // One layer: the 8 KV heads split between the threads, as the engine does.
  auto layer_seconds = [&](int layer, int tokens_per_tile) {
    const auto t0 = std::chrono::steady_clock::now();
    pool.parallel_for(c.n_kv_heads, 1, [&](int64_t h0, int64_t h1, int thread) {
      for (int64_t h = h0; h < h1; ++h)
        for (int t = 0; t < kChunk; t += tokens_per_tile) {
          const size_t off = size_t(t) * q_dim + size_t(h) * group * head_dim;
          if (tokens_per_tile == 1) {
            attend_kv_head(cache, layer, table, first + t, int(h), group, head_dim, q.data() + off, out.data() + off,
                           scratch[size_t(thread)]);
          } else {
            attend_kv_head_tile(cache, layer, table, first + t, std::min(tokens_per_tile, kChunk - t), int(h), group,
                                head_dim, q.data() + off, size_t(q_dim), out.data() + off, scratch[size_t(thread)]);
          }
        }
    });
    benchmark::DoNotOptimize(out.data());
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  std::vector<double> per_token, tiled;
  int layer = 0;
  for (auto _ : state) {
    per_token.push_back(layer_seconds(layer, 1));
    layer = (layer + 1) % kLayers;
    tiled.push_back(layer_seconds(layer, tile));
    layer = (layer + 1) % kLayers;
  }
  const double a = median(per_token), b = median(tiled);
  state.counters["per_token_ms"] = a * 1e3;
  state.counters["tiled_ms"] = b * 1e3;
  state.counters["speedup"] = a / b;
  state.counters["tiled_tok_s"] = kChunk / b / kLayers;  // attention alone, over all layers
  state.SetLabel(preset + ", chunk of " + std::to_string(kChunk) + ", tiles of " + std::to_string(tile));
}
BENCHMARK(BM_Prefill)
    ->ArgNames({"preset", "ctx", "tile"})
    ->ArgsProduct({{0, 1, 2, 3, 4}, {4096, 16384}, {16}})
    ->Args({0, 16384, 21})
    ->Args({2, 16384, 21})
    ->Args({0, 16384, 8})
    ->Args({0, 16384, 32})
    ->Args({2, 16384, 8})
    ->Args({2, 16384, 32})
    ->Iterations(24)
    ->UseRealTime();

}  // namespace
}  // namespace kvserve

BENCHMARK_MAIN();
