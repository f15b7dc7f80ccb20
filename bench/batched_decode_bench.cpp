// Batched decode: one Transformer::forward step in which N sequences each add
// one token, on a real checkpoint (the 400M random model for the issue 6
// target: 16 sequences reach >= 5x the tokens/s of one, since every weight
// matrix is read once per step for the whole batch). Each sequence has
// --context tokens of KV already; steps keep appending, so the context grows
// slowly during the run. items_per_second = generated tokens per second. On a
// shared machine, time a few steps per repetition, interleave the repetitions
// of all N at random, and read the "min" aggregate (the steps least disturbed
// by other work):
//
//   build/batched_decode_bench --model=/tmp/m400.gguf --threads=2 --context=32 --steps=2
//       --benchmark_repetitions=10 --benchmark_enable_random_interleaving=true
//       --benchmark_report_aggregates_only=true --benchmark_filter='seqs:(1|16)/'   (one line)
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "engine/transformer.h"
#include "kv/kv_cache.h"
#include "model/model.h"

namespace kvserve {
namespace {

struct Setup {
  std::string model_path;
  int threads = 2;
  int32_t context = 64;     // tokens of KV each sequence holds before timing
  int64_t steps = 0;        // timed steps per repetition; 0 = as many as Google Benchmark picks
};

void BM_BatchedDecode(benchmark::State& state, const Model* model, const Setup* setup) {
  const size_t n = static_cast<size_t>(state.range(0));
  ThreadPool pool(setup->threads);
  KvCacheOptions o;
  o.block_size = 16;
  o.num_blocks = static_cast<int64_t>(n) * ((setup->context + 4096) / 16 + 1);  // room for 4096 steps
  KvCache cache(model->config(), o);
  Transformer transformer(*model, pool);
  std::vector<BlockTable> tables(n);
  std::vector<std::vector<int32_t>> prompts(n);  // (sequence, context) token ids
  std::vector<BatchEntry> batch(n);
  Logits logits;
  for (size_t i = 0; i < n; ++i) {
    prompts[i].assign(static_cast<size_t>(setup->context), int32_t(3 + i));
    if (!cache.reserve(tables[i], setup->context)) state.SkipWithError("out of KV blocks");
    batch[i].table = &tables[i];
    batch[i].tokens = prompts[i];
  }
  transformer.forward(batch, cache, logits);  // prefill, untimed
  const int32_t next = 5;
  for (auto _ : state) {
    for (size_t i = 0; i < n; ++i) {
      if (!cache.reserve(tables[i], 1)) {
        state.SkipWithError("out of KV blocks");
        break;
      }
      batch[i].tokens = std::span<const int32_t>(&next, 1);
    }
    transformer.forward(batch, cache, logits);
  }
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations() * n));
  for (BlockTable& t : tables) cache.release(t);
}

}  // namespace
}  // namespace kvserve

int main(int argc, char** argv) {
  kvserve::Setup setup;
  // Our flags first (--model=PATH --threads=N --context=N); the rest go to Google Benchmark.
  std::vector<char*> rest = {argv[0]};
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--model=", 8) == 0) {
      setup.model_path = argv[i] + 8;
    } else if (std::strncmp(argv[i], "--threads=", 10) == 0) {
      setup.threads = std::atoi(argv[i] + 10);
    } else if (std::strncmp(argv[i], "--context=", 10) == 0) {
      setup.context = std::atoi(argv[i] + 10);
    } else if (std::strncmp(argv[i], "--steps=", 8) == 0) {
      setup.steps = std::atoll(argv[i] + 8);
    } else {
      rest.push_back(argv[i]);
    }
  }
  if (setup.model_path.empty() || setup.threads < 1 || setup.context < 1 || setup.steps < 0) {
    std::fprintf(stderr, "usage: %s --model=PATH [--threads=2] [--context=64] [--steps=N] [benchmark flags]\n", argv[0]);
    return 2;
  }
  const std::unique_ptr<kvserve::Model> model = kvserve::Model::load(setup.model_path);
  benchmark::internal::Benchmark* b =
      benchmark::RegisterBenchmark("BatchedDecode", kvserve::BM_BatchedDecode, model.get(), &setup);
  if (setup.steps > 0) b->Iterations(setup.steps);
  b->ArgName("seqs")
      ->Arg(1)->Arg(2)->Arg(4)->Arg(8)->Arg(16)
      ->Unit(benchmark::kMillisecond)
      ->UseRealTime()
      ->ComputeStatistics("min", [](const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); });
  int rest_argc = int(rest.size());
  benchmark::Initialize(&rest_argc, rest.data());
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
