// Kernels of read-time sparsity, warm caches, one thread: Quest's upper
// bounds (AVX-512 against the scalar reference) and exact attention over key
// ranges (all keys, and a 1/16 subset in blocks of 16). The end-to-end,
// cache-flushed comparison is `kvserve bench --attention-only`.
//
//   build/retrieval_bench --benchmark_filter='Quest|Attend'
#include <benchmark/benchmark.h>

#include <random>
#include <vector>

#include "attention/block_summary.h"
#include "attention/sparse_attention.h"

namespace kvserve {
namespace {

std::vector<float> random_floats(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(n);
  for (auto& v : x) v = normal(rng);
  return x;
}

// Args: head dim, keys. Bytes = the summaries read (2 rows per block).
void BM_QuestBounds(benchmark::State& state, bool reference) {
  const int d = int(state.range(0));
  const int64_t n = state.range(1);
  BlockSummary s({16, 1, d});
  s.append(random_floats(size_t(n) * size_t(d), 1));
  const std::vector<float> q = random_floats(size_t(d), 2);
  std::vector<float> bounds(size_t(s.num_blocks()));
  std::vector<double> bounds_ref(size_t(s.num_blocks()));
  for (auto _ : state) {
    if (reference) s.upper_bounds_reference(0, q.data(), 1, GroupCombine::Max, bounds_ref.data());
    else s.upper_bounds(0, q.data(), 1, GroupCombine::Max, bounds.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * s.num_blocks() * 2 * d * int64_t(sizeof(float)));
}
BENCHMARK_CAPTURE(BM_QuestBounds, avx512, false)->ArgNames({"d", "keys"})->Args({64, 65536})->Args({128, 65536});
BENCHMARK_CAPTURE(BM_QuestBounds, scalar_reference, true)->ArgNames({"d", "keys"})->Args({64, 65536})->Args({128, 65536});

// Args: head dim, keys, 1 = every 16th block of 16 keys only. Bytes = K and V read.
void BM_AttendRanges(benchmark::State& state) {
  const int d = int(state.range(0));
  const int64_t n = state.range(1);
  const bool subset = state.range(2) != 0;
  const std::vector<float> keys = random_floats(size_t(n) * size_t(d), 3), values = random_floats(keys.size(), 4);
  const std::vector<float> q = random_floats(size_t(d), 5);
  std::vector<KeyRange> ranges;
  if (subset) for (int64_t b = 0; b < n; b += 256) ranges.push_back({b, b + 16});
  else ranges.push_back({0, n});
  std::vector<float> out(static_cast<size_t>(d));
  SparseAttentionScratch scratch;
  const HeadKv kv{keys.data(), values.data(), n, d};
  for (auto _ : state) {
    attend_ranges(kv, q.data(), 1, 0.125f, ranges, out.data(), scratch);
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * ranges_size(ranges) * 2 * d * int64_t(sizeof(float)));
}
BENCHMARK(BM_AttendRanges)->ArgNames({"d", "keys", "subset"})->Args({64, 16384, 0})->Args({128, 16384, 0})
    ->Args({128, 65536, 1});

}  // namespace
}  // namespace kvserve

BENCHMARK_MAIN();
