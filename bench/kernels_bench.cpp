// Matmul throughput at the shapes of a ~400M-parameter model, against a plain
// memory-read benchmark.
//
// The machine's L3 (260 MiB) holds a whole weight matrix, so timing one matrix
// over and over would measure cache, not DRAM. Each benchmark therefore cycles
// through copies of the matrix totalling at least kWorkingSetBytes, the way
// decode streams a model far larger than the cache. bytes_per_second counts
// weight bytes; flops counts 2 * rows * cols * n per call.
//
//   build-kern/kernels_bench --benchmark_filter='Matmul|MemoryRead'
#include <benchmark/benchmark.h>

#include "util/simd.h"

#include <cstring>
#include <memory>
#include <random>
#include <tuple>
#include <vector>

#include "kernels/interleaved_weights.h"
#include "kernels/matmul.h"
#include "kernels/vector_ops.h"
#include "kernels/weight_matrix.h"
#include "util/aligned_buffer.h"
#include "util/half.h"
#include "util/memory_bandwidth.h"
#include "util/thread_pool.h"

namespace kvserve {
namespace {

constexpr size_t kWorkingSetBytes = size_t(768) << 20;  // ~3x the L3

uint64_t next_random(uint64_t& s) {
  s ^= s << 13;
  s ^= s >> 7;
  s ^= s << 17;
  return s;
}

// Copies of one weight matrix filled with valid random values.
struct WeightSet {
  WeightType type;
  int64_t rows, cols;
  std::vector<AlignedBuffer<uint8_t>> copies;

  WeightSet(WeightType t, int64_t r, int64_t c) : type(t), rows(r), cols(c) {
    const size_t bytes = weight_row_bytes(t, c) * size_t(r);
    const size_t count = std::max<size_t>(2, (kWorkingSetBytes + bytes - 1) / bytes);
    uint64_t seed = 0x9E3779B97F4A7C15ull;
    for (size_t i = 0; i < count; ++i) {
      AlignedBuffer<uint8_t> buf(bytes);
      fill(buf.data(), bytes, seed);
      copies.push_back(std::move(buf));
    }
  }

  void fill(uint8_t* p, size_t bytes, uint64_t& seed) const {
    for (size_t i = 0; i + 8 <= bytes; i += 8) {
      const uint64_t v = next_random(seed);
      std::memcpy(p + i, &v, 8);
    }
    // Overwrite anything that must be a finite value with one.
    const fp16_t scale = fp32_to_fp16(0.01f);
    switch (type) {
      case WeightType::F32:
        for (size_t i = 0; i < bytes / 4; ++i) {
          const float f = float(int32_t(p[4 * i]) - 128) / 128.0f;
          std::memcpy(p + 4 * i, &f, 4);
        }
        break;
      case WeightType::F16:
        for (size_t i = 0; i < bytes / 2; ++i) {
          const fp16_t h = fp32_to_fp16(float(int32_t(p[2 * i]) - 128) / 128.0f);
          std::memcpy(p + 2 * i, &h, 2);
        }
        break;
      case WeightType::Q8_0:
        for (size_t b = 0; b < bytes / 34; ++b) std::memcpy(p + 34 * b, &scale, 2);
        break;
      case WeightType::Q4_0:
        for (size_t b = 0; b < bytes / 18; ++b) std::memcpy(p + 18 * b, &scale, 2);
        break;
      case WeightType::Q4_1: {
        const fp16_t min = fp32_to_fp16(-0.08f);
        for (size_t b = 0; b < bytes / 20; ++b) {
          std::memcpy(p + 20 * b, &scale, 2);
          std::memcpy(p + 20 * b + 2, &min, 2);
        }
        break;
      }
    }
  }

  WeightMatrix matrix(size_t i) const { return {type, copies[i % copies.size()].data(), rows, cols}; }
};

// Keeps only the most recent set alive so benchmarks do not pile up memory.
const WeightSet& weight_set(WeightType t, int64_t rows, int64_t cols) {
  static std::unique_ptr<WeightSet> current;
  if (!current || current->type != t || current->rows != rows || current->cols != cols) {
    current.reset();
    current = std::make_unique<WeightSet>(t, rows, cols);
  }
  return *current;
}

// Times call(i, x, y, pool), call i using weight copy i, on n random
// activation rows; reports weight bytes and flops per second.
template <class Call>
void time_matmul(benchmark::State& state, WeightType type, int64_t rows, int64_t cols, int64_t n, int threads,
                 Call call) {
  std::unique_ptr<ThreadPool> pool;
  if (threads > 1) pool = std::make_unique<ThreadPool>(threads);
  std::vector<float> x(static_cast<size_t>(n * cols)), y(static_cast<size_t>(n * rows));
  uint64_t seed = 42;
  for (auto& v : x) v = float(int64_t(next_random(seed) % 2001) - 1000) / 1000.0f;
  size_t i = 0;
  for (auto _ : state) {
    call(i++, x.data(), y.data(), pool.get());
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  const double calls = double(state.iterations());
  state.SetBytesProcessed(int64_t(calls * double(weight_row_bytes(type, cols) * size_t(rows))));
  state.counters["flops"] = benchmark::Counter(calls * 2.0 * double(rows) * double(cols) * double(n),
                                               benchmark::Counter::kIsRate);
}

// Args: weight type, rows, cols, n (tokens), threads.
void BM_Matmul(benchmark::State& state) {
  const auto type = WeightType(state.range(0));
  const int64_t rows = state.range(1), cols = state.range(2), n = state.range(3);
  const WeightSet& set = weight_set(type, rows, cols);
  time_matmul(state, type, rows, cols, n, int(state.range(4)),
              [&](size_t i, const float* x, float* y, ThreadPool* pool) { matmul(set.matrix(i), x, y, n, pool); });
  state.SetLabel(std::string(weight_type_name(type)));
}

void matmul_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"type", "rows", "cols", "n", "threads"});
  for (WeightType t : {WeightType::Q8_0, WeightType::Q4_0, WeightType::F16, WeightType::F32})
    for (auto [rows, cols] : {std::pair<int64_t, int64_t>{4096, 1536}, {1536, 4096}})
      for (int64_t n : {1, 16, 64})
        for (int64_t threads : {1, 2}) b->Args({int64_t(t), rows, cols, n, threads});
  b->UseRealTime();
}
BENCHMARK(BM_Matmul)->Apply(matmul_args);

// The same Q8_0/Q4_0 matrices (and Q4_1, on AVX2) through their interleaved
// copies (what Model loads on AVX-512 VNNI and AVX2 machines). Args: weight
// type, rows, cols, n, threads.
void BM_MatmulInterleaved(benchmark::State& state) {
  const auto type = WeightType(state.range(0));
  const int64_t rows = state.range(1), cols = state.range(2), n = state.range(3);
  const int threads = int(state.range(4));
  if (!interleaved_weights_supported() || (type == WeightType::Q4_1 && !native_q4_1_supported())) {
    state.SkipWithError("no interleaved kernel for this type in this build (needs AVX2)");
    return;
  }
  // Built from one plain set at a time, then the plain copies are dropped.
  static std::vector<std::unique_ptr<InterleavedWeights>> packed;
  static std::tuple<WeightType, int64_t, int64_t> packed_shape;
  if (packed.empty() || packed_shape != std::tuple{type, rows, cols}) {
    packed.clear();
    {
      const WeightSet plain(type, rows, cols);
      for (size_t i = 0; i < plain.copies.size(); ++i) packed.push_back(make_interleaved(plain.matrix(i)));
    }
    packed_shape = {type, rows, cols};
  }
  time_matmul(state, type, rows, cols, n, threads, [&](size_t i, const float* x, float* y, ThreadPool* pool) {
    interleaved_matmul(*packed[i % packed.size()], x, y, n, pool);
  });
  state.SetLabel(std::string(weight_type_name(type)) + " interleaved");
}
BENCHMARK(BM_MatmulInterleaved)
    ->ArgNames({"type", "rows", "cols", "n", "threads"})
    ->ArgsProduct({{int64_t(WeightType::Q8_0), int64_t(WeightType::Q4_0), int64_t(WeightType::Q4_1)},
                   {4096},
                   {1536},
                   {1, 16, 64, 512},
                   {1, 2}})
    ->Args({int64_t(WeightType::Q8_0), 1536, 4096, 1, 2})
    ->Args({int64_t(WeightType::Q8_0), 1536, 4096, 16, 2})
    ->UseRealTime();

// Prefill-sized batch, to see compute efficiency with a large n.
BENCHMARK(BM_Matmul)
    ->ArgNames({"type", "rows", "cols", "n", "threads"})
    ->Args({int64_t(WeightType::Q8_0), 4096, 1536, 512, 2})
    ->Args({int64_t(WeightType::Q4_0), 4096, 1536, 512, 2})
    ->Args({int64_t(WeightType::F16), 4096, 1536, 512, 2})
    ->UseRealTime();

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

// A softmax row's exponentials (exp_shifted: the row's maximum, then
// e^(x - max) and their sum), as decode attention runs them once per query
// head and context token: ns per score. Scores spread like attention logits
// (sd 3); the row is restored from a copy each time, and the copy is timed
// with it.
void BM_ExpShifted(benchmark::State& state) {
  const int64_t n = state.range(0);
  std::vector<float> scores(static_cast<size_t>(n)), row(static_cast<size_t>(n));
  std::mt19937 rng(1);
  std::normal_distribution<float> logit(0.0f, 3.0f);
  for (float& s : scores) s = logit(rng);
  for (auto _ : state) {
    std::memcpy(row.data(), scores.data(), sizeof(float) * size_t(n));
    benchmark::DoNotOptimize(exp_shifted(row.data(), n));
  }
  state.counters["ns_per_score"] =
      benchmark::Counter(double(state.iterations()) * double(n), benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}
BENCHMARK(BM_ExpShifted)->ArgName("scores")->Arg(1024)->Arg(16384);

}  // namespace
}  // namespace kvserve

BENCHMARK_MAIN();
