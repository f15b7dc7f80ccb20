#include "engine/workload.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>
#include <thread>

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
  if (name != "shared-prefix" && name != "returning" && name != "hot-burst")
    fail("unknown workload '{}' (known: shared-prefix, returning, hot-burst)", name);
  if (name == "hot-burst" && hot_every < 2) fail("--hot-every must be at least 2 (got {})", hot_every);
  if (!(request_rate >= 0)) fail("--request-rate must be >= 0 (got {})", request_rate);
  if (request_rate > 0 && name == "returning")
    fail("the returning workload is a closed loop (a turn waits for the answer before it)");
  if (requests <= 0 || tenants <= 0 || concurrency <= 0 || max_tokens <= 0 || turns <= 0)
    fail("--requests, --tenants, --turns, --concurrency and --max-tokens must be positive");
  if (prefix_tokens <= 0 || suffix_tokens < 0) fail("--prefix-tokens must be positive and --suffix-tokens >= 0");
  const int32_t rounds = name == "returning" ? turns : 1;
  const int64_t longest = int64_t(prefix_tokens) + int64_t(rounds) * (suffix_tokens + max_tokens);
  if (longest > context_length)
    fail("the longest prompt plus its answer ({} tokens: --prefix-tokens + turns x (--suffix-tokens + "
         "--max-tokens)) exceeds the context length {}",
         longest, context_length);
  if (name == "returning" && requests % turns != 0)
    fail("--requests {} is not a multiple of --turns {}", requests, turns);
}

WorkloadReport run_workload(Engine& engine, const WorkloadOptions& o) {
  const ModelConfig& c = engine.config();
  o.validate(c.seq_len);
  const bool returning = o.name == "returning";
  const bool burst = o.name == "hot-burst";
  const int32_t conversations = returning ? o.requests / o.turns : 0;
  // shared-prefix: one system prompt per tenant. returning: each
  // conversation's history (its first context, then every turn's prompt and
  // answer), which its next turn extends.
  std::vector<std::vector<int32_t>> prefixes, history;
  for (int32_t t = 0; t < (returning ? conversations : o.tenants); ++t) {
    const uint64_t prompt_id = o.same_prompt && !returning ? 0 : uint64_t(t);
    prefixes.push_back(random_tokens(o.seed * 1000003 + prompt_id, o.prefix_tokens, c.vocab_size));
    prefixes.back()[0] = 1;  // BOS
  }
  history = prefixes;
  std::vector<char> done(size_t(o.requests), 0);

  WorkloadReport report;
  report.requests = o.requests;
  std::vector<double> ttft, tpot;
  int64_t later_prompt_tokens = 0, later_cached_tokens = 0;  // requests after each tenant's first
  int32_t submitted = 0, finished = 0;
  Timer wall;
  auto submit = [&](int32_t i) {
    Request r;
    const size_t owner = size_t(returning ? i % conversations : i % o.tenants);
    // hot-burst: every hot_every-th request uses the hot prompt, the others a
    // prompt of their own (one-off requests that flood the cache).
    const bool hot = burst && i % o.hot_every == 0;
    r.pin_prefix = hot && o.pin_hot;
    r.prompt = history[owner];
    if (burst && !hot) {
      r.prompt = random_tokens(o.seed * 104729 + uint64_t(i), o.prefix_tokens, c.vocab_size);
      r.prompt[0] = 1;
    }
    const auto suffix = random_tokens(o.seed * 7919 + uint64_t(i) + 1, o.suffix_tokens, c.vocab_size);
    r.prompt.insert(r.prompt.end(), suffix.begin(), suffix.end());
    r.max_tokens = o.max_tokens;
    r.sampling.temperature = 0;
    r.stop_at_eos = false;  // every request generates max_tokens: equal work with and without the cache
    r.tenant = "tenant-" + std::to_string(i % o.tenants);
    report.prompt_tokens += int64_t(r.prompt.size());
    const bool returning_turn = returning && i >= conversations;
    if (returning_turn) report.returning_prompt_tokens += int64_t(r.prompt.size());
    const bool hot_repeat = hot && i > 0;  // the first hot request computes it
    if (hot_repeat) report.hot_prompt_tokens += o.prefix_tokens;
    const bool tenant_first = i < o.tenants;
    if (!tenant_first) later_prompt_tokens += int64_t(r.prompt.size());
    if (returning) history[owner] = r.prompt;
    r.on_event = [&, i, owner, returning_turn, hot_repeat, tenant_first, first = true, last = 0.0](const RequestEvent& e) mutable {
      const double now = wall.seconds();
      if (e.token >= 0) {
        if (first) ttft.push_back(e.ttft_seconds * 1e3);
        else tpot.push_back((now - last) * 1e3);
        first = false;
        last = now;
        if (returning) history[owner].push_back(e.token);
      }
      if (e.finish == FinishReason::None) return;
      ++finished;
      done[size_t(i)] = 1;
      if (e.finish == FinishReason::Error) ++report.failed;
      report.cached_tokens += e.usage.cached_tokens;
      if (returning_turn) report.returning_cached_tokens += e.usage.cached_tokens;
      if (hot_repeat) report.hot_cached_tokens += e.usage.cached_tokens;
      if (tenant_first) report.cross_tenant_cached_tokens += e.usage.cached_tokens;
      else later_cached_tokens += e.usage.cached_tokens;
    };
    const SubmitResult s = engine.submit(std::move(r));
    if (s.status != SubmitResult::Status::Accepted) fail("workload request {} refused: {}", i, s.error);
    ++submitted;
  };
  // A conversation's next turn waits for its previous answer.
  auto ready = [&](int32_t i) { return !returning || i < conversations || done[size_t(i - conversations)]; };

  // Open loop: Poisson arrival times, seconds from the start.
  std::vector<double> arrival;
  if (o.request_rate > 0) {
    std::mt19937_64 rng(o.seed * 7717 + 1);
    std::exponential_distribution<double> gap(o.request_rate);
    double t = 0;
    for (int32_t i = 0; i < o.requests; ++i) arrival.push_back(i == 0 ? 0.0 : (t += gap(rng)));
  }
  auto due = [&](int32_t i) {
    return arrival.empty() ? submitted - finished < o.concurrency && ready(i) : wall.seconds() >= arrival[size_t(i)];
  };
  const EngineStats before = engine.stats();
  while (finished < o.requests) {
    while (submitted < o.requests && due(submitted)) submit(submitted);
    if (engine.step()) continue;
    if (finished < submitted) fail("the engine stalled with {} requests open", submitted - finished);
    if (!arrival.empty() && submitted < o.requests)  // idle until the next arrival
      std::this_thread::sleep_for(std::chrono::duration<double>(std::max(0.0, arrival[size_t(submitted)] - wall.seconds())));
  }
  report.seconds = wall.seconds();
  const EngineStats s = engine.stats();
  report.prefill_tokens_computed = s.prefill_tokens_computed - before.prefill_tokens_computed;
  report.prefix_hit_rate = report.prompt_tokens ? double(report.cached_tokens) / double(report.prompt_tokens) : 0;
  report.returning_hit_rate = report.returning_prompt_tokens
                                  ? double(report.returning_cached_tokens) / double(report.returning_prompt_tokens)
                                  : 0;
  report.within_tenant_hit_rate = later_prompt_tokens ? double(later_cached_tokens) / double(later_prompt_tokens) : 0;
  report.tier_blocks_loaded = s.tier_blocks_loaded - before.tier_blocks_loaded;
  report.hot_hit_rate = report.hot_prompt_tokens ? double(report.hot_cached_tokens) / double(report.hot_prompt_tokens) : 0;
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
