#include "engine/workload.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "util/error.h"
#include "util/timer.h"

namespace kvserve {
namespace {

std::vector<int32_t> random_tokens(uint64_t seed, int32_t n, int32_t vocab) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> pick(3, vocab - 1);  // past BOS/EOS/UNK
  std::vector<int32_t> out(static_cast<size_t>(n));
  for (auto& t : out) t = pick(rng);
  return out;
}

// The exact q-quantile of samples (nearest rank).
double quantile(std::vector<double> samples, double q) {
  if (samples.empty()) return 0;
  std::sort(samples.begin(), samples.end());
  const size_t rank = size_t(std::ceil(q * double(samples.size())));
  return samples[std::min(samples.size() - 1, rank == 0 ? 0 : rank - 1)];
}

}  // namespace

void WorkloadOptions::validate(int32_t context_length) const {
  if (name != "shared-prefix") fail("unknown workload '{}' (known: shared-prefix)", name);
  if (requests <= 0 || tenants <= 0 || concurrency <= 0 || max_tokens <= 0)
    fail("--requests, --tenants, --concurrency and --max-tokens must be positive");
  if (prefix_tokens <= 0 || suffix_tokens < 0) fail("--prefix-tokens must be positive and --suffix-tokens >= 0");
  if (int64_t(prefix_tokens) + suffix_tokens + max_tokens > context_length)
    fail("--prefix-tokens + --suffix-tokens + --max-tokens = {} exceeds the context length {}",
         int64_t(prefix_tokens) + suffix_tokens + max_tokens, context_length);
}

WorkloadReport run_workload(Engine& engine, const WorkloadOptions& o) {
  const ModelConfig& c = engine.config();
  o.validate(c.seq_len);
  std::vector<std::vector<int32_t>> prefixes;
  for (int32_t t = 0; t < o.tenants; ++t) {
    prefixes.push_back(random_tokens(o.seed * 1000003 + uint64_t(t), o.prefix_tokens, c.vocab_size));
    prefixes.back()[0] = 1;  // BOS
  }

  WorkloadReport report;
  report.requests = o.requests;
  std::vector<double> ttft, tpot;
  int32_t submitted = 0, finished = 0;
  Timer wall;
  auto submit = [&](int32_t i) {
    Request r;
    r.prompt = prefixes[size_t(i % o.tenants)];
    const auto suffix = random_tokens(o.seed * 7919 + uint64_t(i) + 1, o.suffix_tokens, c.vocab_size);
    r.prompt.insert(r.prompt.end(), suffix.begin(), suffix.end());
    r.max_tokens = o.max_tokens;
    r.sampling.temperature = 0;
    r.stop_at_eos = false;  // every request generates max_tokens: equal work with and without the cache
    r.tenant = "tenant-" + std::to_string(i % o.tenants);
    report.prompt_tokens += int64_t(r.prompt.size());
    r.on_event = [&, first = true, last = 0.0](const RequestEvent& e) mutable {
      const double now = wall.seconds();
      if (e.token >= 0) {
        if (first) ttft.push_back(e.ttft_seconds * 1e3);
        else tpot.push_back((now - last) * 1e3);
        first = false;
        last = now;
      }
      if (e.finish == FinishReason::None) return;
      ++finished;
      if (e.finish == FinishReason::Error) ++report.failed;
      report.cached_tokens += e.usage.cached_tokens;
    };
    const SubmitResult s = engine.submit(std::move(r));
    if (s.status != SubmitResult::Status::Accepted) fail("workload request {} refused: {}", i, s.error);
    ++submitted;
  };

  const EngineStats before = engine.stats();
  while (finished < o.requests) {
    while (submitted < o.requests && submitted - finished < o.concurrency) submit(submitted);
    if (!engine.step() && finished < submitted) fail("the engine stalled with {} requests open", submitted - finished);
  }
  report.seconds = wall.seconds();
  const EngineStats s = engine.stats();
  report.prefill_tokens_computed = s.prefill_tokens_computed - before.prefill_tokens_computed;
  report.prefix_hit_rate = report.prompt_tokens ? double(report.cached_tokens) / double(report.prompt_tokens) : 0;
  report.ttft_p50_ms = quantile(ttft, 0.5);
  report.ttft_p99_ms = quantile(ttft, 0.99);
  report.tpot_p50_ms = quantile(tpot, 0.5);
  report.kv_bytes_peak = s.kv_bytes_peak;
  report.max_running = s.max_running;
  report.preemptions = s.preemptions - before.preemptions;
  report.generated_tokens = s.generated_tokens - before.generated_tokens;
  return report;
}

}  // namespace kvserve
