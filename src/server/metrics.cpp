#include "server/metrics.h"

#include <fmt/format.h>

#include <cmath>

#include "store/store_metrics_export.h"

namespace kvserve {
namespace {

std::string format_value(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  return fmt::format("{}", v);  // shortest text that reads back as v
}

std::string format_labels(const PrometheusWriter::Labels& labels) {
  if (labels.empty()) return {};
  std::string out = "{";
  for (size_t i = 0; i < labels.size(); ++i) {
    if (i) out += ',';
    out += labels[i].first + "=\"" + escape_label_value(labels[i].second) + '"';
  }
  return out + '}';
}

}  // namespace

std::string escape_label_value(std::string_view v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\') out += "\\\\";
    else if (c == '"') out += "\\\"";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

void PrometheusWriter::family(std::string_view name, std::string_view type, std::string_view help) {
  out_ += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
}

void PrometheusWriter::sample(std::string_view name, double value, const Labels& labels) {
  out_ += fmt::format("{}{} {}\n", name, format_labels(labels), format_value(value));
}

void PrometheusWriter::histogram(std::string_view name, std::string_view help, const Histogram& h) {
  family(name, "histogram", help);
  const std::vector<uint64_t> cumulative = h.cumulative();
  const std::string bucket = std::string(name) + "_bucket";
  for (size_t i = 0; i < h.bounds().size(); ++i) sample(bucket, double(cumulative[i]), {{"le", format_value(h.bounds()[i])}});
  sample(bucket, double(cumulative.back()), {{"le", "+Inf"}});
  sample(std::string(name) + "_sum", h.sum());
  sample(std::string(name) + "_count", double(h.count()));
}

void PrometheusWriter::counter(std::string_view name, std::string_view help, double value) {
  family(name, "counter", help);
  sample(name, value);
}

void PrometheusWriter::gauge(std::string_view name, std::string_view help, double value) {
  family(name, "gauge", help);
  sample(name, value);
}

void ResponseCounter::record(const std::string& route, int status) {
  std::lock_guard<std::mutex> lock(mutex_);
  ++counts_[{route, status}];
}

std::map<std::pair<std::string, int>, int64_t> ResponseCounter::snapshot() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return counts_;
}

std::string render_metrics(const EngineStats& e, const ServerMetrics& s) {
  PrometheusWriter w;
  w.family("kvserve_info", "gauge", "The served model and its KV cache codecs (always 1).");
  w.sample("kvserve_info", 1, {{"model", s.model}, {"kv_codec", s.kv_codec}});
  w.gauge("kvserve_uptime_seconds", "Seconds since the server started.", s.uptime_seconds);

  w.counter("kvserve_requests_submitted_total", "Requests (sequences, one per prompt and choice) the engine accepted.", double(e.requests_submitted));
  w.counter("kvserve_requests_rejected_total", "Requests (sequences, one per prompt and choice) refused because the waiting queue was full (HTTP 429).",
            double(e.requests_rejected));
  w.family("kvserve_requests_finished_total", "counter", "Requests finished, by reason.");
  w.sample("kvserve_requests_finished_total", double(e.finished_stop), {{"reason", "stop"}});
  w.sample("kvserve_requests_finished_total", double(e.finished_length), {{"reason", "length"}});
  w.sample("kvserve_requests_finished_total", double(e.finished_cancelled), {{"reason", "cancelled"}});
  w.sample("kvserve_requests_finished_total", double(e.finished_error), {{"reason", "error"}});

  w.gauge("kvserve_sequences_running", "Sequences in the running batch.", e.running);
  w.gauge("kvserve_sequences_waiting", "Sequences waiting for admission (preempted ones included).", e.waiting);
  w.gauge("kvserve_sequences_running_max", "Most sequences that ran in one step.", e.max_running);
  w.counter("kvserve_preemptions_total", "Sequences preempted (blocks freed, to be recomputed).",
            double(e.preemptions));
  w.counter("kvserve_engine_steps_total", "Batched forward passes.", double(e.steps));
  w.counter("kvserve_engine_busy_seconds_total", "Seconds spent in steps that ran the model.", e.busy_seconds);

  w.counter("kvserve_prompt_tokens_total", "Prompt tokens of admitted requests.", double(e.prompt_tokens));
  w.counter("kvserve_prompt_tokens_cached_total", "Prompt tokens served by the prefix cache.",
            double(e.cached_prompt_tokens));
  w.gauge("kvserve_prefix_cache_hit_rate", "Cached prompt tokens / prompt tokens since start (0 before any).",
          e.prompt_tokens > 0 ? double(e.cached_prompt_tokens) / double(e.prompt_tokens) : 0.0);
  w.counter("kvserve_prefill_tokens_computed_total", "Tokens run through the model as prefill (recompute included).",
            double(e.prefill_tokens_computed));
  w.counter("kvserve_generation_tokens_total", "Tokens generated.", double(e.generated_tokens));

  if (e.prefix_caching) {
    // Per account (tenant name; "global" for the shared scope).
    const PrefixCacheStats& p = e.prefix;
    auto per_tenant = [&](std::string_view name, std::string_view type, std::string_view help, auto value) {
      w.family(name, type, help);
      for (const PrefixCacheTenantStats& t : p.tenants) w.sample(name, double(value(t)), {{"tenant", t.name}});
    };
    per_tenant("kvserve_prefix_cache_query_tokens_total", "counter", "Prompt tokens looked up in the prefix cache.",
               [](const PrefixCacheTenantStats& t) { return t.counters.query_tokens; });
    per_tenant("kvserve_prefix_cache_hit_tokens_total", "counter", "Prompt tokens the prefix cache served.",
               [](const PrefixCacheTenantStats& t) { return t.counters.hit_tokens; });
    per_tenant("kvserve_prefix_cache_query_blocks_total", "counter", "Full prompt blocks looked up.",
               [](const PrefixCacheTenantStats& t) { return t.counters.query_blocks; });
    per_tenant("kvserve_prefix_cache_hit_blocks_total", "counter", "Full prompt blocks the prefix cache served.",
               [](const PrefixCacheTenantStats& t) { return t.counters.hit_blocks; });
    per_tenant("kvserve_prefix_cache_blocks_evicted_total", "counter", "Cached blocks dropped for memory or quota.",
               [](const PrefixCacheTenantStats& t) { return t.counters.blocks_evicted; });
    per_tenant("kvserve_prefix_cache_blocks_cached", "gauge", "Blocks in the prefix cache (in use or idle).",
               [](const PrefixCacheTenantStats& t) { return t.blocks_cached; });
    per_tenant("kvserve_prefix_cache_blocks_pinned", "gauge", "Pinned prefix-cache blocks.",
               [](const PrefixCacheTenantStats& t) { return t.blocks_pinned; });
    per_tenant("kvserve_prefix_cache_memory_saved_bytes", "gauge", "KV bytes sharing saves right now.",
               [](const PrefixCacheTenantStats& t) { return t.memory_saved_bytes; });
    w.gauge("kvserve_prefix_cache_blocks_idle", "Cached blocks no sequence uses (reclaimable).", p.blocks_idle);
  }

  if (e.tiers) {
    w.counter("kvserve_tier_lookups_total", "Admissions that looked blocks up in the tiers.", double(e.tier_lookups));
    w.counter("kvserve_tier_lookups_skipped_total", "Admissions that recomputed because loading measured slower.",
              double(e.tier_lookups_skipped));
    w.counter("kvserve_tier_blocks_loaded_total", "Blocks imported from a tier instead of computed.",
              double(e.tier_blocks_loaded));
    w.counter("kvserve_tier_blocks_queued_total", "Published blocks queued for the tiers.", double(e.tier_blocks_queued));
    w.counter("kvserve_tier_blocks_written_total", "Published blocks stored in at least one tier.",
              double(e.tier_blocks_written));
    w.gauge("kvserve_tier_load_ms_per_block", "Measured lookup + import time per block found.", e.tier_load_ms_per_block);
    w.gauge("kvserve_recompute_ms_per_block", "Measured prefill time per block of tokens.", e.recompute_ms_per_block);
  }

  const PrometheusWriter::Labels codec = {{"codec", s.kv_codec}};
  w.family("kvserve_kv_blocks", "gauge", "KV cache blocks by state.");
  w.sample("kvserve_kv_blocks", e.kv.blocks_used, {{"codec", s.kv_codec}, {"state", "used"}});
  w.sample("kvserve_kv_blocks", e.kv.blocks_free, {{"codec", s.kv_codec}, {"state", "free"}});
  // Pool blocks paying for FP16 staging slots in use (byte budgets): with
  // used, free and the prefix cache's idle blocks they add up to the total.
  w.sample("kvserve_kv_blocks", e.kv.blocks_for_staging, {{"codec", s.kv_codec}, {"state", "staging"}});
  w.family("kvserve_kv_blocks_total", "gauge", "KV cache capacity in blocks.");
  w.sample("kvserve_kv_blocks_total", e.kv.blocks_total, codec);
  w.family("kvserve_kv_block_size_tokens", "gauge", "Tokens per KV block.");
  w.sample("kvserve_kv_block_size_tokens", e.kv.block_size, codec);
  w.family("kvserve_kv_bytes_per_token", "gauge", "Bytes of K and V per token over all layers.");
  w.sample("kvserve_kv_bytes_per_token", double(e.kv.bytes_per_token), codec);
  w.family("kvserve_kv_bytes_used", "gauge", "KV bytes in use (blocks and FP16 staging slots).");
  w.sample("kvserve_kv_bytes_used", double(e.kv.bytes_used), codec);
  w.family("kvserve_kv_bytes_capacity", "gauge", "KV cache capacity in bytes.");
  w.sample("kvserve_kv_bytes_capacity", double(e.kv.bytes_capacity), codec);
  w.gauge("kvserve_kv_bytes_peak", "Most KV bytes in use after a step.", double(e.kv_bytes_peak));
  w.gauge("kvserve_kv_tokens_stored", "Tokens with K/V in the cache.", double(e.kv.tokens_stored));
  w.gauge("kvserve_kv_fragmentation", "Unused fraction of the token slots in used blocks.", e.kv.fragmentation);
  w.gauge("kvserve_kv_staging_slots_used", "FP16 residual staging slots in use.", e.kv.staging_used);

  w.histogram("kvserve_time_to_first_token_seconds", "Arrival to first generated token.", e.ttft);
  w.histogram("kvserve_time_per_output_token_seconds", "Time between consecutive tokens of a request.", e.tpot);
  w.histogram("kvserve_request_latency_seconds", "Arrival to the last event of a request.", e.e2e);

  w.family("kvserve_http_responses_total", "counter", "HTTP responses by route and status code.");
  for (const auto& [key, count] : s.responses)
    w.sample("kvserve_http_responses_total", double(count), {{"route", key.first}, {"code", std::to_string(key.second)}});
  w.gauge("kvserve_http_requests_in_flight", "Completion requests submitted to the engine and not finished.",
          double(s.in_flight));
  std::string out = w.text();
  if (e.tiers) append_prometheus(e.tier, out);  // per-tier hits, misses, bytes, latency, errors
  return out;
}

}  // namespace kvserve
