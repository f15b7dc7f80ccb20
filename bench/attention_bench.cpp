// Decode attention over a quantized KV cache at the 400M model's shape (head
// dim 64, 8 KV heads, GQA group 3; blocks of 16 tokens unless the codec pair
// names its own), against a plain memory read.
//
// One iteration is one layer of one decode step: for each KV head, score the
// 3 queries of its group against every K block, softmax, then accumulate every
// V block. Blocks live as the KV cache keeps them: per layer an arena indexed
// by block id holding the K block then the V block. The L3 (260 MiB) would
// hold one layer's KV at every codec, so iterations cycle through copies of
// the layer totalling at least working_set_bytes(), as a decode step over all
// layers of a long context streams from DRAM. bytes_per_second counts the K
// and V bytes read (block_bytes * blocks, metadata included). Contexts of 512
// and 1024 tokens fit in L2 even without that: their time per token is the
// kernels' compute cost alone.
//
//   build-codec/attention_bench --benchmark_filter='Attention|MemoryRead'
#include <benchmark/benchmark.h>

#include "util/simd.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "attention/head_slice_prefetch.h"
#include "kernels/vector_ops.h"
#include "kv/int_codecs.h"
#include "kv/kv_codec.h"
#include "util/aligned_buffer.h"
#include "util/memory_bandwidth.h"
#include "util/thread_pool.h"

namespace kvserve {
namespace {

// ~3x the L3; ATTENTION_BENCH_WORKING_SET_MB overrides it (a small value keeps
// the layer in cache, to see the kernels' compute-bound speed).
size_t working_set_bytes() {
  const char* mb = std::getenv("ATTENTION_BENCH_WORKING_SET_MB");
  return (mb != nullptr ? size_t(std::atoll(mb)) : size_t(768)) << 20;
}
constexpr int kHeadDim = 64, kKvHeads = 8, kGroup = 3;
constexpr int kDistinctBlocks = 64;  // encoded once, then copied across the arena

struct CodecPair {
  const char* name;
  KvCodecConfig k, v;
  int block = 16;  // tokens per block
};

std::vector<CodecPair> codec_pairs() {
  auto tok = [](KvDType t, int g) { return KvCodecConfig{t, KvGrouping::Token, g, {}, {}}; };
  auto chan = [](KvDType t, int g) { return KvCodecConfig{t, KvGrouping::Channel, g, {}, {}}; };
  auto s8 = [](KvCodecConfig c) {
    c.scale_bits = 8;
    return c;
  };
  return {
      {"fp32", {KvDType::F32}, {KvDType::F32}},
      {"fp16", {KvDType::F16}, {KvDType::F16}},
      {"bf16", {KvDType::BF16}, {KvDType::BF16}},
      {"int8/token/g64", tok(KvDType::INT8, 64), tok(KvDType::INT8, 64)},
      {"int4/token/g64", tok(KvDType::INT4, 64), tok(KvDType::INT4, 64)},
      {"int4 K channel/g16, V token/g64", chan(KvDType::INT4, 16), tok(KvDType::INT4, 64)},
      {"int2/token/g64", tok(KvDType::INT2, 64), tok(KvDType::INT2, 64)},
      {"int2 K channel/g16, V token/g64", chan(KvDType::INT2, 16), tok(KvDType::INT2, 64)},
      {"q4_0", {KvDType::Q4_0}, {KvDType::Q4_0}},
      {"int4-small in 32-token blocks (before the tenth session): K channel/g32, V token/g64, 8-bit scales",
       s8(chan(KvDType::INT4, 32)), s8(tok(KvDType::INT4, 64)), 32},
      {"int2-small in 32-token blocks (before the tenth session): K channel/g32, V token/g64, 8-bit scales",
       s8(chan(KvDType::INT2, 32)), s8(tok(KvDType::INT2, 64)), 32},
      {"int4-small's codecs in 64-token blocks, K channel/g32", s8(chan(KvDType::INT4, 32)), s8(tok(KvDType::INT4, 64)), 64},
      {"int4-small: K channel/g64, V token/g64, 8-bit scales, 64-token blocks", s8(chan(KvDType::INT4, 64)),
       s8(tok(KvDType::INT4, 64)), 64},
      {"int2-small: K channel/g64, V token/g64, 8-bit scales, 64-token blocks", s8(chan(KvDType::INT2, 64)),
       s8(tok(KvDType::INT2, 64)), 64},
      {"int4-small's codecs in 128-token blocks, K channel/g128", s8(chan(KvDType::INT4, 128)), s8(tok(KvDType::INT4, 64)),
       128},
      {"fp8 (E4M3)", {KvDType::FP8}, {KvDType::FP8}},
      {"fp8_e5m2", {KvDType::FP8_E5M2}, {KvDType::FP8_E5M2}},
      // Layouts a user can ask for beyond the presets (--kv-group 32,
      // --kv-grouping channel, --kv-group 128: groups spanning two heads).
      {"int4/token/g32", tok(KvDType::INT4, 32), tok(KvDType::INT4, 32)},
      {"int4 channel/g16, V channel/g16", chan(KvDType::INT4, 16), chan(KvDType::INT4, 16)},
      {"int4/token/g128 (token-major, two heads a group)", tok(KvDType::INT4, 128), tok(KvDType::INT4, 128)},
  };
}

// Copies of one layer's K/V arena for a context of n_ctx tokens.
struct LayerSet {
  int pair = -1;
  int n_ctx = 0;
  int block = 16;  // tokens per block
  std::unique_ptr<KvCodec> k, v;
  size_t k_bytes = 0, v_bytes = 0;  // one block, in bytes
  int n_blocks = 0;
  std::vector<AlignedBuffer<uint8_t>> copies;  // each (block, K then V) bytes
  // With `planar`, copies hold the same blocks in head planes instead: all
  // of K as (kv head, block) slices, then all of V so, so that one head's
  // slices of consecutive blocks are adjacent (BM_PlanarPair).
  bool planar = false;

  LayerSet(int pair_index, int ctx, bool head_planes = false) : pair(pair_index), n_ctx(ctx), planar(head_planes) {
    const CodecPair& p = codec_pairs()[size_t(pair_index)];
    block = p.block;
    const KvBlockShape shape{block, kKvHeads, kHeadDim};
    k = make_kv_codec(p.k, shape);
    v = make_kv_codec(p.v, shape);
    k_bytes = k->block_bytes();
    v_bytes = v->block_bytes();
    n_blocks = (ctx + block - 1) / block;
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const int kv_dim = shape.kv_dim();
    std::vector<float> x(size_t(block) * kv_dim);
    std::vector<uint8_t> distinct(size_t(kDistinctBlocks) * (k_bytes + v_bytes));
    for (int b = 0; b < kDistinctBlocks; ++b) {
      for (size_t i = 0; i < x.size(); ++i) x[i] = normal(rng) * (i % 7 == 3 ? 4.0f : 1.0f);
      uint8_t* dst = distinct.data() + size_t(b) * (k_bytes + v_bytes);
      k->encode_block(dst, x.data(), block);
      for (auto& e : x) e = normal(rng);
      v->encode_block(dst + k_bytes, x.data(), block);
    }
    const size_t layer_bytes = size_t(n_blocks) * (k_bytes + v_bytes);
    const size_t count = std::max<size_t>(2, (working_set_bytes() + layer_bytes - 1) / layer_bytes);
    for (size_t c = 0; c < count; ++c) {
      AlignedBuffer<uint8_t> buf(layer_bytes);
      for (int b = 0; b < n_blocks; ++b) {
        const uint8_t* src = distinct.data() + size_t((b + c) % kDistinctBlocks) * (k_bytes + v_bytes);
        if (!planar) {
          std::memcpy(buf.data() + size_t(b) * (k_bytes + v_bytes), src, k_bytes + v_bytes);
          continue;
        }
        for (int h = 0; h < kKvHeads; ++h) {
          std::memcpy(buf.data() + k_offset(b, h) + h * head_k(), src + h * head_k(), head_k());
          std::memcpy(buf.data() + v_offset(b, h) + h * head_v(), src + k_bytes + h * head_v(), head_v());
        }
      }
      copies.push_back(std::move(buf));
    }
  }

  // A head's share of a block's K (V) bytes: head-major codecs only.
  size_t head_k() const { return k_bytes / kKvHeads; }
  size_t head_v() const { return v_bytes / kKvHeads; }
  // Where, from the arena's start, the codecs' block pointer for block b's K
  // (V) lies when they read KV head h: they add h * head_k() (head_v()) to it.
  size_t k_offset(int b, int h) const {
    return planar ? (size_t(h) * (n_blocks - 1) + size_t(b)) * head_k() : size_t(b) * (k_bytes + v_bytes);
  }
  size_t v_offset(int b, int h) const {
    return planar ? size_t(n_blocks) * k_bytes + (size_t(h) * (n_blocks - 1) + size_t(b)) * head_v()
                  : size_t(b) * (k_bytes + v_bytes) + k_bytes;
  }
  const uint8_t* k_at(const uint8_t* arena, int b, int h) const { return arena + k_offset(b, h); }
  const uint8_t* v_at(const uint8_t* arena, int b, int h) const { return arena + v_offset(b, h); }
};

// Keeps only the most recent set alive so benchmarks do not pile up memory.
const LayerSet& layer_set(int pair, int n_ctx) {
  static std::unique_ptr<LayerSet> current;
  if (!current || current->pair != pair || current->n_ctx != n_ctx) {
    current.reset();
    current = std::make_unique<LayerSet>(pair, n_ctx);
  }
  return *current;
}

// One KV head of one layer, as attend_kv_head does it, with its prefetch
// hints (attention/head_slice_prefetch.h). scores: (kGroup, stride).
void attend_head(const LayerSet& set, const uint8_t* arena, int kv_head, const float* q, float* scores,
                 float* out, const KvCodec* v_codec = nullptr) {
  const KvCodec& v = v_codec != nullptr ? *v_codec : *set.v;
  const int stride = set.n_blocks * set.block;
  const float scale = 1.0f / std::sqrt(float(kHeadDim));
  HeadSlicePrefetch prefetch_k(kv_head, set.n_blocks, [&](int32_t i) {
    return KvBlockView{set.k.get(), set.k_at(arena, i, kv_head)};
  });
  HeadSlicePrefetch prefetch_v(kv_head, set.n_blocks, [&](int32_t i) {
    return KvBlockView{&v, set.v_at(arena, i, kv_head)};
  });
  for (int b = 0; b < set.n_blocks; ++b) {
    const int n = std::min(set.block, set.n_ctx - b * set.block);
    prefetch_k.before(b);
    set.k->score(q, kGroup, set.k_at(arena, b, kv_head), n, kv_head, scale, scores + b * set.block, stride);
  }
  float inv_sum[kGroup];  // unnormalized weights, as attend_kv_head
  for (int i = 0; i < kGroup; ++i) inv_sum[i] = 1.0f / exp_shifted(scores + size_t(i) * stride, set.n_ctx);
  std::fill(out, out + kGroup * kHeadDim, 0.0f);
  for (int b = 0; b < set.n_blocks; ++b) {
    const int n = std::min(set.block, set.n_ctx - b * set.block);
    prefetch_v.before(b);
    v.accumulate(scores + b * set.block, kGroup, stride, set.v_at(arena, b, kv_head), n, kv_head, out);
  }
  for (int i = 0; i < kGroup; ++i)
    for (int d = 0; d < kHeadDim; ++d) out[i * kHeadDim + d] *= inv_sum[i];
}

// The queries of every KV head's group: (kv head, group, head_dim), fixed seed.
std::vector<float> random_queries() {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> q(size_t(kKvHeads) * kGroup * kHeadDim);
  for (auto& e : q) e = normal(rng);
  return q;
}

// Seconds one layer (every KV head of arena) takes, as attend_head runs it.
double time_layer(const LayerSet& set, const uint8_t* arena, const std::vector<float>& q, float* scores,
                  std::vector<float>& out, const KvCodec* v_codec = nullptr) {
  const auto t0 = std::chrono::steady_clock::now();
  for (int h = 0; h < kKvHeads; ++h)
    attend_head(set, arena, h, q.data() + size_t(h) * kGroup * kHeadDim, scores,
                out.data() + size_t(h) * kGroup * kHeadDim, v_codec);
  benchmark::DoNotOptimize(out.data());
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  return x[x.size() / 2];
}

// Args: codec pair, context (tokens), threads.
void BM_Attention(benchmark::State& state) {
  const int pair = int(state.range(0)), n_ctx = int(state.range(1)), threads = int(state.range(2));
  const LayerSet& set = layer_set(pair, n_ctx);
  std::unique_ptr<ThreadPool> pool;
  if (threads > 1) pool = std::make_unique<ThreadPool>(threads);

  const std::vector<float> q = random_queries();
  std::vector<float> out(q.size());
  const size_t stride = size_t(set.n_blocks) * set.block;
  std::vector<std::vector<float>> scores(size_t(std::max(threads, 1)), std::vector<float>(kGroup * stride));

  size_t layer = 0;
  for (auto _ : state) {
    const uint8_t* arena = set.copies[layer++ % set.copies.size()].data();
    auto heads = [&](int64_t begin, int64_t end, int t) {
      for (int64_t h = begin; h < end; ++h)
        attend_head(set, arena, int(h), q.data() + size_t(h) * kGroup * kHeadDim, scores[size_t(t)].data(),
                    out.data() + size_t(h) * kGroup * kHeadDim);
    };
    if (pool) pool->parallel_for(kKvHeads, 1, heads);
    else heads(0, kKvHeads, 0);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  const double layer_bytes = double(set.n_blocks) * double(set.k_bytes + set.v_bytes);
  state.SetBytesProcessed(int64_t(double(state.iterations()) * layer_bytes));
  state.counters["layer_MiB"] = layer_bytes / double(1 << 20);
  state.SetLabel(codec_pairs()[size_t(pair)].name);
}

// 8-bit against 16-bit value weights (int_codecs.h) on one layer, one
// thread: the two codecs read the same blocks and alternate layer by layer,
// so the host's drift (±15% between runs here) hits both alike. Reports the
// median layer time of each and their ratio.
void BM_ValueWeights(benchmark::State& state) {
  const int pair = int(state.range(0)), n_ctx = int(state.range(1));
  const LayerSet& set = layer_set(pair, n_ctx);
  set_byte_value_weights(false);
  const std::unique_ptr<KvCodec> v16 = make_kv_codec(codec_pairs()[size_t(pair)].v, set.v->shape());
  set_byte_value_weights(true);
  const std::vector<float> q = random_queries();
  std::vector<float> out(q.size());
  std::vector<float> scores(kGroup * size_t(set.n_blocks) * set.block);
  std::vector<double> seconds[2];  // 8-bit, 16-bit
  size_t layer = 0;
  for (auto _ : state)
    for (int w = 0; w < 2; ++w)
      seconds[w].push_back(time_layer(set, set.copies[layer++ % set.copies.size()].data(), q, scores.data(), out,
                                      w == 0 ? set.v.get() : v16.get()));
  const double w8 = median(seconds[0]), w16 = median(seconds[1]);
  state.counters["w8_us"] = w8 * 1e6;
  state.counters["w16_us"] = w16 * 1e6;
  state.counters["w8_over_w16"] = w8 / w16;
  state.SetLabel(codec_pairs()[size_t(pair)].name);
}
// int4-small (32- and 64-token blocks) at 4K and 16K; fp16 (no folded
// weights) as the control.
BENCHMARK(BM_ValueWeights)->ArgNames({"codec", "ctx"})->Args({9, 4096})->Args({9, 16384})->Args({12, 4096})
    ->Args({12, 16384})->Args({1, 4096});

// Two layouts (codec pairs a and b, each with its own block size) on one
// layer, one thread, their layers alternating in one process so the host's
// drift hits both alike. Reports each one's median layer time and b / a.
void BM_LayoutPair(benchmark::State& state) {
  const int pair_a = int(state.range(0)), pair_b = int(state.range(1)), n_ctx = int(state.range(2));
  const LayerSet sets[2] = {LayerSet(pair_a, n_ctx), LayerSet(pair_b, n_ctx)};
  const std::vector<float> q = random_queries();
  std::vector<float> out(q.size());
  std::vector<float> scores[2];
  for (int w = 0; w < 2; ++w) scores[w].resize(kGroup * size_t(sets[w].n_blocks) * size_t(sets[w].block));
  std::vector<double> seconds[2];
  size_t layer = 0;
  for (auto _ : state) {
    for (int w = 0; w < 2; ++w)
      seconds[w].push_back(
          time_layer(sets[w], sets[w].copies[layer % sets[w].copies.size()].data(), q, scores[w].data(), out));
    ++layer;
  }
  const double a = median(seconds[0]), b = median(seconds[1]);
  state.counters["a_us"] = a * 1e6;
  state.counters["b_us"] = b * 1e6;
  state.counters["b_over_a"] = b / a;
  state.SetLabel(std::string(codec_pairs()[size_t(pair_b)].name) + " vs " + codec_pairs()[size_t(pair_a)].name);
}
// int4-small in 32-token blocks (before the tenth session) against its
// 64-token layout (now) and 128-token blocks, at 4K and 16K.
BENCHMARK(BM_LayoutPair)->ArgNames({"a", "b", "ctx"})->Args({9, 12, 4096})->Args({9, 12, 16384})
    ->Args({9, 14, 16384})->Args({12, 14, 16384})->Iterations(200);
// FP8 (E4M3) against FP16, both in 16-token blocks.
BENCHMARK(BM_LayoutPair)->ArgNames({"a", "b", "ctx"})->Args({1, 15, 4096})->Args({1, 15, 16384})->Iterations(200);
// FP8 E5M2 against FP16 and against E4M3.
BENCHMARK(BM_LayoutPair)->ArgNames({"a", "b", "ctx"})->Args({1, 16, 4096})->Args({1, 16, 16384})
    ->Args({15, 16, 16384})->Iterations(200);

// The cache's arena (per block: K of every head, then V) against head planes
// (LayerSet::planar: a head's slices of consecutive blocks adjacent), one
// codec pair, 2 threads splitting the heads as decode does; the layers
// alternate in one process. Reports each one's median layer time and
// planar / blocks. What a head-planar arena would buy decode attention
// (BENCHMARKS.md, "What FP16 attention reads at").
void BM_PlanarPair(benchmark::State& state) {
  const int pair = int(state.range(0)), n_ctx = int(state.range(1));
  const LayerSet sets[2] = {LayerSet(pair, n_ctx), LayerSet(pair, n_ctx, true)};
  if (sets[0].k->shared_bytes().size != 0 || sets[0].v->shared_bytes().size != 0 || sets[0].k_bytes % kKvHeads != 0 ||
      sets[0].v_bytes % kKvHeads != 0) {
    state.SkipWithError("head planes need head-major codecs without shared bytes");
    return;
  }
  ThreadPool pool(2);
  const std::vector<float> q = random_queries();
  std::vector<float> out(q.size());
  const size_t stride = size_t(sets[0].n_blocks) * sets[0].block;
  std::vector<std::vector<float>> scores(2, std::vector<float>(kGroup * stride));
  {  // Same blocks, same kernels: the planes must give the same layer, bit for bit.
    std::vector<float> planes_out(q.size());
    time_layer(sets[0], sets[0].copies[0].data(), q, scores[0].data(), out);
    time_layer(sets[1], sets[1].copies[0].data(), q, scores[0].data(), planes_out);
    if (std::memcmp(out.data(), planes_out.data(), out.size() * sizeof(float)) != 0) {
      state.SkipWithError("the head planes read other bytes than the blocks");
      return;
    }
  }
  std::vector<double> seconds[2];
  size_t layer = 0;
  for (auto _ : state) {
    for (int i = 0; i < 2; ++i) {
      const int w = (layer % 2 == 0) ? i : 1 - i;  // the order flips every round
      const LayerSet& set = sets[w];
      const uint8_t* arena = set.copies[layer % set.copies.size()].data();
      const auto t0 = std::chrono::steady_clock::now();
      pool.parallel_for(kKvHeads, 1, [&](int64_t begin, int64_t end, int t) {
        for (int64_t h = begin; h < end; ++h)
          attend_head(set, arena, int(h), q.data() + size_t(h) * kGroup * kHeadDim, scores[size_t(t)].data(),
                      out.data() + size_t(h) * kGroup * kHeadDim);
      });
      seconds[w].push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      benchmark::DoNotOptimize(out.data());
    }
    ++layer;
  }
  const double blocks = median(seconds[0]), planes = median(seconds[1]);
  state.counters["blocks_us"] = blocks * 1e6;
  state.counters["planes_us"] = planes * 1e6;
  state.counters["planes_over_blocks"] = planes / blocks;
  state.SetLabel(codec_pairs()[size_t(pair)].name);
}
BENCHMARK(BM_PlanarPair)->ArgNames({"codec", "ctx"})->Args({1, 16384})->Args({12, 16384})->Args({15, 16384})
    ->Args({3, 16384})->Iterations(200)->UseRealTime();

void attention_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"codec", "ctx", "threads"});
  for (int64_t ctx : {16384, 4096, 1024, 512})
    for (int64_t p = 0; p < int64_t(codec_pairs().size()); ++p)
      for (int64_t threads : {1, 2}) b->Args({p, ctx, threads});
  b->UseRealTime();
}
BENCHMARK(BM_Attention)->Apply(attention_args);

// Sums a 512 MiB buffer with 64-byte loads, split over `threads` threads: the
// read bandwidth a memory-bound decode step can hope for.
void BM_MemoryRead(benchmark::State& state) {
  const size_t bytes = size_t(512) << 20;
  static AlignedBuffer<float> buffer(bytes / sizeof(float));  // zeroed, so every page is really mapped
  ThreadPool pool(int(state.range(0)));
  for (auto _ : state) benchmark::DoNotOptimize(sum_buffer(pool, buffer.data(), buffer.size()));
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(bytes));
}
BENCHMARK(BM_MemoryRead)->ArgName("threads")->Arg(1)->Arg(2)->UseRealTime();

// The read pattern of decode attention without its arithmetic: a 1 GiB
// arena of blocks, each `slices` slices of `slice` bytes (a KV head's K or V
// in one block: FP16 in 16-token blocks is 2048 bytes, 16 slices of K and
// V), and 2 threads that each walk half the slices, one slice through every
// block before the next, hinting (prefetcht1) the whole slice `ahead`
// blocks on (0: no hints; attention spreads each slice's hints over two
// blocks, HeadSlicePrefetch). Against BM_MemoryRead/threads:2 it shows what this host
// gives scattered 2 KB runs (BENCHMARKS.md, "What FP16 attention reads at").
void BM_HeadSliceRead(benchmark::State& state) {
  const size_t slice = size_t(state.range(0)), slices = size_t(state.range(1));
  const int64_t ahead = state.range(2);
  const size_t block = slice * slices, blocks = (size_t(1) << 30) / block;
  static AlignedBuffer<float> arena((size_t(1) << 30) / sizeof(float));  // zeroed: every page mapped
  const char* base = reinterpret_cast<const char*>(arena.data());
  ThreadPool pool(2);
  std::vector<float> sinks(2 * 16);
  for (auto _ : state) {
    pool.parallel_for(int64_t(slices), 1, [&](int64_t begin, int64_t end, int thread) {
      float sum = 0;
      for (int64_t h = begin; h < end; ++h)
        for (size_t b = 0; b < blocks; ++b) {
          const char* p = base + b * block + size_t(h) * slice;
          if (ahead > 0 && b + size_t(ahead) < blocks)
            for (size_t off = 0; off < slice; off += 64) _mm_prefetch(p + size_t(ahead) * block + off, _MM_HINT_T1);
          sum += sum_floats(reinterpret_cast<const float*>(p), int64_t(slice / sizeof(float)));
        }
      sinks[size_t(thread) * 16] += sum;
    });
    benchmark::DoNotOptimize(sinks.data());
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(blocks * block));
}
BENCHMARK(BM_HeadSliceRead)
    ->ArgNames({"slice", "slices", "ahead"})
    ->Args({2048, 16, 0})
    ->Args({2048, 16, 4})
    ->Args({2176, 16, 4})    // int4-small's K or V slice (64 tokens, 8-bit scales)
    ->Args({131072, 16, 0})  // 128 KiB runs
    ->Args({int64_t(1) << 26, 16, 0})  // 64 MiB runs: nearly sequential
    ->UseRealTime();

#if defined(__AVX512VNNI__)
// What one core can issue: the clock (a chain of dependent scalar adds, one
// cycle each) and the rate of vpdpbusd on 512-bit vectors (twelve
// independent chains, so latency does not bound it). The integer attention
// kernels' floor follows: int4-small needs six vpdpbusd per token and KV
// head (three queries x 64 channels, keys and values), before unpacking
// codes, folds and softmax (BENCHMARKS.md, "The instruction floor, and the
// octet layout for 4-bit keys").
void BM_InstructionRate(benchmark::State& state) {
  constexpr int64_t kAdds = 100'000'000, kRounds = 10'000'000, kChains = 12;
  double add_ns = 0, dot_ns = 0;
  for (auto _ : state) {
    auto t0 = std::chrono::steady_clock::now();
    int64_t x = 0;
    for (int64_t i = 0; i < kAdds; ++i) asm volatile("add $1, %0" : "+r"(x));
    auto t1 = std::chrono::steady_clock::now();
    add_ns = std::chrono::duration<double, std::nano>(t1 - t0).count() / double(kAdds);
    __m512i acc[kChains];
    for (int k = 0; k < kChains; ++k) acc[k] = _mm512_set1_epi32(k);
    __m512i a = _mm512_set1_epi8(3);
    const __m512i b = _mm512_set1_epi8(5);
    t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < kRounds; ++i) {
      #pragma GCC unroll 12
      for (int k = 0; k < kChains; ++k) acc[k] = _mm512_dpbusd_epi32(acc[k], a, b);
      asm volatile("" : "+v"(a));  // keeps the loop from being folded away
    }
    t1 = std::chrono::steady_clock::now();
    dot_ns = std::chrono::duration<double, std::nano>(t1 - t0).count() / double(kRounds * kChains);
    for (int k = 0; k < kChains; ++k) benchmark::DoNotOptimize(acc[k]);
  }
  state.counters["clock_ghz"] = 1.0 / add_ns;
  state.counters["vpdpbusd_ns"] = dot_ns;
  state.counters["vpdpbusd_per_cycle"] = add_ns / dot_ns;
}
BENCHMARK(BM_InstructionRate)->Iterations(3)->UseRealTime();
#elif defined(__AVX2__) && defined(__FMA__)
// The AVX2 counterpart: the clock, and how many 256-bit vpmaddubsw (the
// integer kernels' multiply without VNNI: int4-small needs twelve per token
// and KV head, 6 for the keys and 6 for the values, two 16-lane vectors per
// query and 64 channels) and FMAs (the exponential's polynomial, the FP16
// kernels) one core issues per cycle, from twelve independent chains each
// (more than latency times throughput for either).
// Written out chain by chain: an array of chains was spilled to the stack,
// and the store-to-load latency then bounded the loop.
template <class Op>
double chains_ns_per_op(Op op) {
  constexpr int64_t kRounds = 10'000'000;
  __m256i a0 = _mm256_set1_epi8(1), a1 = _mm256_set1_epi8(2), a2 = _mm256_set1_epi8(3), a3 = _mm256_set1_epi8(4),
          a4 = _mm256_set1_epi8(5), a5 = _mm256_set1_epi8(6), a6 = _mm256_set1_epi8(7), a7 = _mm256_set1_epi8(8),
          a8 = _mm256_set1_epi8(9), a9 = _mm256_set1_epi8(10), a10 = _mm256_set1_epi8(11), a11 = _mm256_set1_epi8(12);
  __m256i b = _mm256_set1_epi8(1);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < kRounds; ++i) {
    a0 = op(a0, b), a1 = op(a1, b), a2 = op(a2, b), a3 = op(a3, b);
    a4 = op(a4, b), a5 = op(a5, b), a6 = op(a6, b), a7 = op(a7, b);
    a8 = op(a8, b), a9 = op(a9, b), a10 = op(a10, b), a11 = op(a11, b);
    asm volatile("" : "+x"(b));  // keeps the loop from being folded away
  }
  const auto t1 = std::chrono::steady_clock::now();
  // Consumed in registers (DoNotOptimize on each made GCC store every chain
  // every round, and the stores then bounded the loop).
  asm volatile("" ::"x"(a0), "x"(a1), "x"(a2), "x"(a3), "x"(a4), "x"(a5));
  asm volatile("" ::"x"(a6), "x"(a7), "x"(a8), "x"(a9), "x"(a10), "x"(a11));
  return std::chrono::duration<double, std::nano>(t1 - t0).count() / double(kRounds * 12);
}
void BM_InstructionRate(benchmark::State& state) {
  constexpr int64_t kAdds = 100'000'000;
  double add_ns = 0, maddubs_ns = 0, fma_ns = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    int64_t x = 0;
    for (int64_t i = 0; i < kAdds; ++i) asm volatile("add $1, %0" : "+r"(x));
    add_ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / double(kAdds);
    // What the chains hold does not matter: vpmaddubsw takes the same time saturated or not.
    maddubs_ns = chains_ns_per_op([](__m256i a, __m256i b) { return _mm256_maddubs_epi16(a, b); });
    fma_ns = chains_ns_per_op([](__m256i a, __m256i) {  // converges to 1.0: no subnormal operands
      return _mm256_castps_si256(
          _mm256_fmadd_ps(_mm256_castsi256_ps(a), _mm256_set1_ps(0.999f), _mm256_set1_ps(1e-3f)));
    });
  }
  state.counters["clock_ghz"] = 1.0 / add_ns;
  state.counters["vpmaddubsw_per_cycle"] = add_ns / maddubs_ns;
  state.counters["vfmadd_per_cycle"] = add_ns / fma_ns;
}
BENCHMARK(BM_InstructionRate)->Iterations(3)->UseRealTime();
#endif

}  // namespace
}  // namespace kvserve

BENCHMARK_MAIN();
