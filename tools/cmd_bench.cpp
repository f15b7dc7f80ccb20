// kvserve bench: prefill and decode speed, KV cost, and the share of the
// machine's memory bandwidth a decode step reaches, all in one run.
#include <algorithm>
#include <cstdio>
#include <random>

#include <fmt/ranges.h>

#include "engine/engine.h"
#include "engine/sampler.h"
#include "engine/transformer.h"
#include "engine/workload.h"
#include "kv/kv_spec.h"
#include "tools/bench_replicas.h"
#include "tools/bench_server.h"
#include "tools/cli_common.h"
#include "tools/engine_cli.h"
#include "tools/cmd_bench_attention.h"
#include "util/error.h"
#include "util/memory_bandwidth.h"
#include "util/simd.h"
#include "util/timer.h"

namespace kvserve::cli {
namespace {

struct BenchArgs {
  CommonOptions common;
  int32_t prompt_tokens = 512;
  int32_t gen_tokens = 64;
  int32_t batch = 512;
  int64_t bandwidth_mib = 1024;
  // Speed-only shortcut for long contexts: fill this many positions with
  // random K/V instead of running a prefill (decode cost does not depend on
  // the values), then prefill --prompt-tokens after them.
  int32_t fill_context = 0;
  // A second KV preset decoded in the same run, steps interleaved, for a
  // speed ratio that the host's noise between runs does not reach.
  std::string compare_preset;
  std::optional<int32_t> compare_block_size;  // not given: the run's --block-size
  // Serving workloads through the engine (--workload).
  WorkloadOptions workload;
  bool workload_given = false;
  int32_t replicas = 0;  // --replicas: serve processes sharing Redis (bench_replicas.h)
  EngineCliOptions engine;
  LoadOptions load;  // with --server: load-test a running server instead
  SparsityFlags sparsity;
};

void run_workload_bench(const BenchArgs& a) {
  auto model = load_model(a.common);
  EngineOptions eo = engine_options(a.common, a.engine, *model, sparsity_options(a.sparsity));
  eo.max_waiting = std::max(eo.max_waiting, a.workload.concurrency);
  Engine engine(*model, eo);
  const WorkloadReport r = run_workload(engine, a.workload);
  nlohmann::json j = kv_stats_json(engine.stats().kv);
  j["workload"] = a.workload.name;
  j["requests"] = r.requests;
  j["concurrency"] = a.workload.concurrency;
  j["request_rate"] = a.workload.request_rate;
  j["tenants"] = a.workload.tenants;
  j["prompt_tokens"] = r.prompt_tokens;
  j["prefill_tokens_computed"] = r.prefill_tokens_computed;
  j["cached_tokens"] = r.cached_tokens;
  j["prefix_hit_rate"] = r.prefix_hit_rate;
  if (a.workload.name == "shared-prefix") {
    j["same_prompt"] = a.workload.same_prompt;
    j["cross_tenant_cached_tokens"] = r.cross_tenant_cached_tokens;
    j["within_tenant_hit_rate"] = r.within_tenant_hit_rate;
  }
  if (a.workload.name == "returning") {
    j["turns"] = a.workload.turns;
    j["returning_prompt_tokens"] = r.returning_prompt_tokens;
    j["returning_cached_tokens"] = r.returning_cached_tokens;
    j["returning_hit_rate"] = r.returning_hit_rate;
  }
  if (a.workload.name == "hot-burst") {
    j["hot_every"] = a.workload.hot_every;
    j["hot_hit_rate"] = r.hot_hit_rate;
    j["prefix_blocks_pinned"] = engine.stats().prefix.blocks_pinned;
    j["prefix_blocks_evicted"] = engine.stats().prefix.counters.blocks_evicted;
  }
  engine.flush_tiers();  // tier_blocks_written counts blocks stored, which the writer may still be doing
  const EngineStats es = engine.stats();
  if (es.tiers) {
    j["tier_blocks_loaded"] = r.tier_blocks_loaded;
    j["tier_blocks_written"] = es.tier_blocks_written;
    j["tier_lookups_skipped"] = es.tier_lookups_skipped;
    j["tier_load_ms_per_block"] = es.tier_load_ms_per_block;
    j["recompute_ms_per_block"] = es.recompute_ms_per_block;
  }
  j["ttft_p50_ms"] = r.ttft_p50_ms;
  j["ttft_p99_ms"] = r.ttft_p99_ms;
  j["tpot_p50_ms"] = r.tpot_p50_ms;
  j["kv_bytes_peak"] = r.kv_bytes_peak;
  j["max_running"] = r.max_running;
  j["preemptions"] = r.preemptions;
  j["generated_tokens"] = r.generated_tokens;
  j["output_tok_s"] = r.seconds > 0 ? double(r.generated_tokens) / r.seconds : 0;
  j["seconds"] = r.seconds;
  j["failed"] = r.failed;
  j["kv_dtype"] = kv_description(engine.cache());
  j["prefix_cache"] = a.engine.prefix_cache;
  if (a.common.json) {
    print_json(j);
    return;
  }
  if (a.workload.name == "hot-burst")
    std::printf("hot prompt: %.1f%% of its tokens cached after the first\n", 100 * r.hot_hit_rate);
  if (a.workload.name == "returning")
    std::printf("returning turns: %.1f%% of their prompt tokens cached (%lld loaded from tiers)\n",
                100 * r.returning_hit_rate, (long long)r.tier_blocks_loaded);
  std::printf("%s: %d requests (%d in flight) | prefill computed %lld of %lld prompt tokens, prefix hit rate "
              "%.1f%% | TTFT p50 %.1f ms p99 %.1f ms | TPOT p50 %.1f ms | peak KV %lld bytes, %d running at "
              "most, %lld preemptions | %.1f output tok/s\n",
              a.workload.name.c_str(), r.requests, a.workload.concurrency,
              (long long)r.prefill_tokens_computed, (long long)r.prompt_tokens, 100 * r.prefix_hit_rate,
              r.ttft_p50_ms, r.ttft_p99_ms, r.tpot_p50_ms, (long long)r.kv_bytes_peak, r.max_running,
              (long long)r.preemptions, j["output_tok_s"].get<double>());
}

// Writes random K/V for n positions of every layer, as a prefill would.
void fill_random_kv(KvCache& cache, BlockTable& table, int32_t n, int n_layers, int kv_dim) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> k(static_cast<size_t>(kv_dim)), v(static_cast<size_t>(kv_dim));
  if (!cache.reserve(table, n)) fail("out of KV blocks filling {} positions; raise --kv-blocks or --kv-memory", n);
  for (int layer = 0; layer < n_layers; ++layer) {
    for (int32_t pos = 0; pos < n; ++pos) {
      for (auto& x : k) x = normal(rng);
      for (auto& x : v) x = normal(rng);
      cache.write(layer, table, table.num_tokens + pos, k.data(), v.data());
    }
    cache.seal(layer, table, table.num_tokens + n);
  }
  cache.commit(table, n);
}

// One KV configuration of the decode benchmark: its cache, its sequence
// (random prompt after --fill-context random positions) and its step times.
struct DecodeSubject {
  std::unique_ptr<KvCache> cache;
  std::unique_ptr<SparsityPolicy> policy;
  BlockTable table;
  std::vector<int32_t> tokens;
  Logits logits;
  std::vector<double> step_seconds;
  std::vector<BatchEntry> batch{1};

  DecodeSubject(const ModelConfig& c, const KvCacheOptions& kvo, const SparsityOptions& sparsity,
                const std::vector<int32_t>& prompt)
      : cache(std::make_unique<KvCache>(c, kvo)), policy(make_sparsity_policy(sparsity, *cache)), tokens(prompt) {
    batch[0].table = &table;
    batch[0].policy = policy.get();
  }

  void forward(Transformer& transformer, std::span<const int32_t> new_tokens, const char* phase) {
    if (!cache->reserve(table, int32_t(new_tokens.size()))) fail("out of KV blocks during {}; raise --kv-blocks or --kv-memory", phase);
    batch[0].tokens = new_tokens;
    batch[0].decode = std::string_view(phase) == "decode";
    transformer.forward(batch, *cache, logits);
  }
  void fill(int32_t positions, const ModelConfig& c) {
    if (positions > 0) fill_random_kv(*cache, table, positions, c.n_layers, c.kv_dim());
  }
  void prefill(Transformer& transformer, int32_t prompt_tokens, int32_t step) {
    for (int32_t done = 0; done < prompt_tokens; done += step)
      forward(transformer, std::span<const int32_t>(tokens.data() + done, size_t(std::min(step, prompt_tokens - done))),
              "prefill");
  }
  void decode_step(Transformer& transformer) {
    tokens.push_back(argmax(logits.row(0), logits.vocab));
    const Timer step;
    forward(transformer, std::span<const int32_t>(&tokens.back(), 1), "decode");
    step_seconds.push_back(step.seconds());
  }
  double total_steps() const {
    double s = 0;
    for (double t : step_seconds) s += t;
    return s;
  }
  double median_step() const {  // the upper middle of an even count
    std::vector<double> s = step_seconds;
    std::nth_element(s.begin(), s.begin() + s.size() / 2, s.end());
    return s[s.size() / 2];
  }
};

void run(const BenchArgs& a) {
  if (a.workload_given) return run_workload_bench(a);
  if (a.prompt_tokens <= 0 || a.gen_tokens <= 0) fail("--prompt-tokens and --gen-tokens must be positive");
  if (a.batch <= 0) fail("--batch must be positive");
  auto model = load_model(a.common);
  const ModelConfig& c = model->config();
  if (a.fill_context < 0) fail("--fill-context must be >= 0");
  const int64_t total = int64_t(a.fill_context) + a.prompt_tokens + a.gen_tokens;
  if (total > c.seq_len)
    fail("--fill-context + --prompt-tokens + --gen-tokens = {} exceeds the context length {}", total, c.seq_len);

  ThreadPool pool(thread_count(a.common));
  const double bandwidth = measure_read_bandwidth_gbs(pool, size_t(a.bandwidth_mib) << 20, 3);
  const SparsityOptions sparsity = sparsity_options(a.sparsity);
  auto cache_options = [&](const CommonOptions& o) {
    KvCacheOptions kvo = kv_options(o, *model);
    fit_kv_to_sparsity(sparsity, kvo);
    if (kvo.num_blocks == 0 && kvo.budget_bytes == 0) kvo.num_blocks = (total + kvo.block_size - 1) / kvo.block_size;
    return kvo;
  };
  Transformer transformer(*model, pool);

  // A random prompt: speed does not depend on which tokens they are.
  std::mt19937 rng(7);
  std::uniform_int_distribution<int32_t> pick(3, c.vocab_size - 1);
  std::vector<int32_t> prompt(static_cast<size_t>(a.prompt_tokens));
  prompt[0] = 1;
  for (size_t i = 1; i < prompt.size(); ++i) prompt[i] = pick(rng);

  DecodeSubject subject(c, cache_options(a.common), sparsity, prompt);
  // --compare-preset: a second cache decodes the same way in this process, its
  // steps alternating with the first's (the order flipping every step), so
  // that both meet the same moments of the host's memory traffic.
  std::unique_ptr<DecodeSubject> baseline;
  if (!a.compare_preset.empty()) {
    CommonOptions o;  // the preset alone; the other KV flags shape this run's cache only
    o.kv_preset = a.compare_preset;
    // A chosen block size applies to both (the preset keeps it), unless
    // --compare-block-size gives the baseline its own.
    o.block_size = a.compare_block_size ? a.compare_block_size : a.common.block_size;
    baseline = std::make_unique<DecodeSubject>(c, cache_options(o), sparsity, prompt);
  }
  subject.fill(a.fill_context, c);
  Timer timer;
  subject.prefill(transformer, a.prompt_tokens, a.batch);
  const double prefill_s = timer.seconds();
  if (baseline) {
    baseline->fill(a.fill_context, c);
    baseline->prefill(transformer, a.prompt_tokens, a.batch);
  }
  timer.reset();
  for (int32_t i = 0; i < a.gen_tokens; ++i) {
    if (baseline && i % 2 == 1) baseline->decode_step(transformer);
    subject.decode_step(transformer);
    if (baseline && i % 2 == 0) baseline->decode_step(transformer);
  }
  // With a comparison the loop also runs the other cache's steps: this one's
  // time is then the sum of its steps (the argmax between them left out).
  const double decode_s = baseline ? subject.total_steps() : timer.seconds();
  const KvStats kv = subject.cache->stats();

  // Bytes one decode step must read: every weight matrix except the embedding
  // table (one row of it), plus the KV of the context so far (mean over steps).
  const Weights& w = model->weights();
  const bool tied = w.classifier.data == w.token_embedding.data;
  const double weight_bytes = double(w.bytes()) - (tied ? 0.0 : double(w.token_embedding.bytes()));
  const double mean_ctx = a.fill_context + a.prompt_tokens + (a.gen_tokens + 1) / 2.0;
  // What attention reads: the kept tokens (evicting policies) or the share a
  // read-time policy chose, times the cache's bytes per token.
  auto kv_bytes_read = [&](const DecodeSubject& s) {
    const SparsityPolicy& policy = *s.policy;
    const double tokens = policy.evicts() ? std::min<double>(mean_ctx, resolve_sparsity_options(sparsity, *s.cache).budget)
                                          : mean_ctx * policy.stats().read_fraction();
    return tokens * double(s.cache->stats().bytes_per_token);
  };
  const SparsityPolicy& policy = *subject.policy;
  const double kv_bytes = kv_bytes_read(subject);
  const double decode_tok_s = a.gen_tokens / decode_s;
  const double fraction = (weight_bytes + kv_bytes) * decode_tok_s / (bandwidth * 1e9);
  subject.cache->release(subject.table);

  nlohmann::json j = kv_stats_json(kv);
  j["prefill_tok_s"] = a.prompt_tokens / prefill_s;
  j["decode_tok_s"] = decode_tok_s;
  j["mem_bandwidth_gbs"] = bandwidth;
  j["bandwidth_fraction"] = fraction;
  j["decode_bytes_per_token"] = weight_bytes + kv_bytes;
  j["weight_bytes"] = w.bytes();
  j["prompt_tokens"] = a.prompt_tokens;
  j["fill_context"] = a.fill_context;
  j["decode_context"] = mean_ctx;
  j["gen_tokens"] = a.gen_tokens;
  j["threads"] = pool.num_threads();
  j["kernels"] = simd::kernel_tier();
  j["kv_dtype"] = kv_description(*subject.cache);
  j["weight_type"] = std::string(weight_type_name(w.layers.at(0).wq.type));
  j.update(sparsity_json(resolve_sparsity_options(sparsity, *subject.cache), policy.stats()));
  j["decode_step_ms_median"] = 1e3 * subject.median_step();  // steadier than the mean on a shared host
  if (baseline) {
    j["compare_preset"] = a.compare_preset;
    j["compare_kv_dtype"] = kv_description(*baseline->cache);
    j["compare_kv_bytes_per_token"] = baseline->cache->stats().bytes_per_token;
    j["compare_block_size"] = baseline->cache->block_size();
    j["block_size"] = subject.cache->block_size();
    j["compare_decode_tok_s"] = a.gen_tokens / baseline->total_steps();
    j["compare_decode_step_ms_median"] = 1e3 * baseline->median_step();
    // How many times faster this configuration decodes than the comparison:
    // the ratio of median step times (the mean's ratio is in the tok/s).
    j["decode_speedup"] = baseline->median_step() / subject.median_step();
    // The speedup if both steps read their bytes (weights and KV) at the same
    // bandwidth: what a smaller KV cache can give a memory-bound decode. A
    // decode_speedup above it means the comparison reads its bytes slower.
    const double compare_bytes = weight_bytes + kv_bytes_read(*baseline);
    j["compare_decode_bytes_per_token"] = compare_bytes;
    j["bytes_bound_speedup"] = compare_bytes / (weight_bytes + kv_bytes);
    baseline->cache->release(baseline->table);
  }
  if (a.common.json) {
    print_json(j);
    return;
  }
  std::printf("prefill %.1f tok/s | decode %.2f tok/s | %.1f MB read per decode token | bandwidth %.1f GB/s, "
              "decode reaches %.0f%% | KV %lld bytes/token (%s) | %s kernels\n",
              a.prompt_tokens / prefill_s, decode_tok_s, (weight_bytes + kv_bytes) / 1e6, bandwidth,
              fraction * 100, (long long)kv.bytes_per_token, kv_description(*subject.cache).c_str(),
              simd::kernel_tier());
  if (baseline)
    std::printf("steps alternating with --compare-preset %s (%s, %.2f tok/s): median step %.2f ms there, %.2f ms "
                "here: %.2fx faster (%.2fx if both steps read their bytes at the same bandwidth)\n",
                a.compare_preset.c_str(), j["compare_kv_dtype"].get<std::string>().c_str(),
                j["compare_decode_tok_s"].get<double>(), j["compare_decode_step_ms_median"].get<double>(),
                j["decode_step_ms_median"].get<double>(), j["decode_speedup"].get<double>(),
                j["bytes_bound_speedup"].get<double>());
}

}  // namespace

void register_bench(CLI::App& app) {
  auto a = std::make_shared<BenchArgs>();
  auto attention = std::make_shared<AttentionBenchArgs>();
  CLI::App* cmd = app.add_subcommand("bench", "prefill/decode speed and memory-bandwidth use");
  add_common_options(*cmd, a->common, /*model_required=*/false);
  add_attention_bench_options(*cmd, *attention);
  cmd->add_option("--prompt-tokens", a->prompt_tokens, "prompt length (with --server: default 64)")->capture_default_str();
  cmd->add_option("--gen-tokens", a->gen_tokens, "tokens to decode")->capture_default_str();
  cmd->add_option("--batch", a->batch, "prefill tokens per forward pass")->capture_default_str();
  cmd->add_option("--bandwidth-mib", a->bandwidth_mib, "buffer size of the bandwidth probe")->capture_default_str();
  cmd->add_option("--fill-context", a->fill_context,
                  "speed only: positions of random K/V placed before the prompt instead of a long prefill")
      ->capture_default_str();
  cmd->add_option("--compare-preset", a->compare_preset,
                  "also decode with this KV preset in the same run, steps alternating, and report the speed ratio "
                  "(decode_speedup); it takes --block-size but no other KV flag");
  cmd->add_option("--compare-block-size", a->compare_block_size,
                  "block size of the --compare-preset cache (default: --block-size, or the preset's own)");
  WorkloadOptions& w = a->workload;
  cmd->add_option_function<std::string>("--workload", [a](const std::string& v) {
    a->workload.name = v;
    a->workload_given = true;
  }, "run a serving workload through the engine instead: shared-prefix | returning | hot-burst");
  cmd->add_option("--turns", w.turns, "workload returning: turns per conversation")->capture_default_str();
  cmd->add_option("--hot-every", w.hot_every, "workload hot-burst: one hot request in this many")->capture_default_str();
  cmd->add_option("--pin-hot", w.pin_hot, "workload hot-burst: hot requests pin their prompt (true|false)")
      ->capture_default_str();
  cmd->add_option("--prefix-tokens", w.prefix_tokens, "workload: shared prompt tokens per tenant")->capture_default_str();
  cmd->add_option("--suffix-tokens", w.suffix_tokens, "workload: unique prompt tokens per request")->capture_default_str();
  cmd->add_option("--tenants", w.tenants, "workload: tenants, each with its own shared prompt")->capture_default_str();
  cmd->add_option("--replicas", a->replicas,
                  "workload shared-prefix: N serve processes sharing one Redis tier; replica 0 computes the "
                  "prefix, the others load it (redis-server started unless --kv-tiers names one)");
  cmd->add_option("--same-prompt", w.same_prompt,
                  "workload shared-prefix: every tenant sends the same system prompt (true|false)")
      ->capture_default_str();
  add_engine_options(*cmd, a->engine);
  // --requests, --concurrency and --max-tokens serve both --server and --workload.
  add_server_bench_options(*cmd, a->load);
  add_sparsity_options(*cmd, a->sparsity);
  cmd->callback([a, cmd, attention] {
    // --dump-qk and --attention-only are the long-context attention benchmark
    // (cmd_bench_attention.cpp).
    if (!a->compare_preset.empty()) {
      if (attention->attention_only || !attention->dump_qk.empty() || !a->load.server.empty() || a->workload_given)
        fail("--compare-preset applies to the decode benchmark only (not with --attention-only, --dump-qk, --server "
             "or --workload)");
      const std::vector<std::string> names = kv_preset_names();
      if (std::find(names.begin(), names.end(), a->compare_preset) == names.end())
        fail("unknown --compare-preset '{}' (expected {})", a->compare_preset, fmt::join(names, ", "));
    }
    if (a->compare_block_size && a->compare_preset.empty()) fail("--compare-block-size needs --compare-preset");
    if (a->compare_block_size && (*a->compare_block_size <= 0 || *a->compare_block_size > kMaxBlockSize))
      fail("--compare-block-size {} is out of range (1..{})", *a->compare_block_size, kMaxBlockSize);
    if (a->bandwidth_mib < 1 || a->bandwidth_mib > 16384)  // the probe's buffer is allocated
      fail("--bandwidth-mib must be in 1..16384 (got {})", a->bandwidth_mib);
    if (attention->attention_only || !attention->dump_qk.empty()) return run_attention_bench(*attention, a->common);
    if (!a->load.server.empty()) {
      if (cmd->count("--prompt-tokens")) a->load.prompt_tokens = a->prompt_tokens;
      run_server_bench(a->load, a->common.json);
      return;
    }
    if (a->common.model_path.empty())
      fail("--model is required (except with --attention-only, or --server URL to load-test a running server)");
    if (a->workload_given && cmd->count("--gen-tokens"))
      fail("--gen-tokens is the decode benchmark's; a --workload generates --max-tokens per request");
    if (cmd->count("--requests")) a->workload.requests = a->load.requests;
    if (cmd->count("--concurrency")) a->workload.concurrency = a->load.concurrency;
    if (cmd->count("--max-tokens")) a->workload.max_tokens = a->load.max_tokens;
    if (cmd->count("--request-rate")) a->workload.request_rate = a->load.request_rate;
    if (a->replicas > 0) {
      ReplicaBenchOptions r{.replicas = a->replicas, .model_path = a->common.model_path,
                            .kv_tiers = a->engine.kv_tiers, .workload = a->workload, .json = a->common.json};
      if (!a->workload_given) fail("--replicas needs --workload shared-prefix");
      return run_replica_bench(r, *cmd);
    }
    run(*a);
  });
}

}  // namespace kvserve::cli
