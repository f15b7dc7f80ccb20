#include "store/store_metrics_export.h"

#include <fmt/format.h>

#include <cmath>

namespace kvserve {
namespace {

std::string escape_label(const std::string& value) {
  std::string out;
  for (const char c : value) {
    if (c == '\\') out += "\\\\";
    else if (c == '"') out += "\\\"";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

void header(std::string& out, std::string_view name, std::string_view type, std::string_view help) {
  out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
}

void histogram(std::string& out, std::string_view name, const std::string& labels, const LatencySnapshot& s) {
  uint64_t cumulative = 0;
  const std::string sep = labels.empty() ? "" : ",";
  for (int i = 0; i < LatencySnapshot::kBuckets; ++i) {
    cumulative += s.counts[size_t(i)];
    const double le = LatencySnapshot::bucket_upper_seconds(i);
    const std::string bound = std::isinf(le) ? "+Inf" : fmt::format("{:g}", le);
    out += fmt::format("{}_bucket{{{}{}le=\"{}\"}} {}\n", name, labels, sep, bound, cumulative);
  }
  const std::string braces = labels.empty() ? "" : "{" + labels + "}";
  out += fmt::format("{}_sum{} {:.9g}\n{}_count{} {}\n", name, braces, s.sum_seconds, name, braces, s.count);
}

double micros(double seconds) { return std::isinf(seconds) ? -1.0 : seconds * 1e6; }

}  // namespace

void append_prometheus(const TieredStats& stats, std::string& out) {
  struct Counter {
    const char* name;
    const char* help;
    uint64_t TierStats::*field;
  };
  static const Counter kCounters[] = {
      {"kvserve_kv_tier_hits_total", "Blocks looked up and found.", &TierStats::hits},
      {"kvserve_kv_tier_misses_total", "Blocks looked up and not found (or refused by the record check).", &TierStats::misses},
      {"kvserve_kv_tier_read_bytes_total", "Bytes returned by hits.", &TierStats::bytes_read},
      {"kvserve_kv_tier_puts_total", "Blocks stored.", &TierStats::puts},
      {"kvserve_kv_tier_written_bytes_total", "Bytes of the blocks stored.", &TierStats::bytes_written},
      {"kvserve_kv_tier_rejected_total", "Blocks larger than the tier's budget.", &TierStats::rejected},
      {"kvserve_kv_tier_removes_total", "Blocks removed on request.", &TierStats::removes},
      {"kvserve_kv_tier_evictions_total", "Blocks evicted to stay within the budget.", &TierStats::evictions},
      {"kvserve_kv_tier_errors_total", "Blocks whose read or write failed (I/O, connection, timeout).",
       &TierStats::errors},
      {"kvserve_kv_tier_corrupt_total", "Blocks refused by the record check (recomputed instead).",
       &TierStats::corrupt},
  };
  for (const Counter& c : kCounters) {
    header(out, c.name, "counter", c.help);
    for (const TierStats& t : stats.tiers)
      out += fmt::format("{}{{tier=\"{}\"}} {}\n", c.name, escape_label(t.name), t.*(c.field));
  }
  struct Gauge {
    const char* name;
    const char* help;
    int64_t TierStats::*field;
  };
  static const Gauge kGauges[] = {
      {"kvserve_kv_tier_resident_blocks", "Blocks held now.", &TierStats::resident_blocks},
      {"kvserve_kv_tier_resident_bytes", "Bytes held now.", &TierStats::resident_bytes},
      {"kvserve_kv_tier_capacity_bytes", "The tier's byte budget.", &TierStats::capacity_bytes},
  };
  for (const Gauge& g : kGauges) {
    header(out, g.name, "gauge", g.help);
    for (const TierStats& t : stats.tiers)
      if (t.*(g.field) >= 0) out += fmt::format("{}{{tier=\"{}\"}} {}\n", g.name, escape_label(t.name), t.*(g.field));
  }
  header(out, "kvserve_kv_tier_available", "gauge", "1 when the tier can be reached.");
  for (const TierStats& t : stats.tiers)
    out += fmt::format("kvserve_kv_tier_available{{tier=\"{}\"}} {}\n", escape_label(t.name), t.available ? 1 : 0);
  header(out, "kvserve_kv_tier_get_seconds", "histogram", "Duration of one batched get call.");
  for (const TierStats& t : stats.tiers)
    histogram(out, "kvserve_kv_tier_get_seconds", fmt::format("tier=\"{}\"", escape_label(t.name)), t.get_latency);
  header(out, "kvserve_kv_tier_put_seconds", "histogram", "Duration of one batched put call.");
  for (const TierStats& t : stats.tiers)
    histogram(out, "kvserve_kv_tier_put_seconds", fmt::format("tier=\"{}\"", escape_label(t.name)), t.put_latency);

  const std::pair<const char*, uint64_t> store_counters[] = {
      {"kvserve_kv_store_lookups_total", stats.lookups},
      {"kvserve_kv_store_blocks_requested_total", stats.blocks_requested},
      {"kvserve_kv_store_blocks_found_total", stats.blocks_found},
      {"kvserve_kv_store_queue_hits_total", stats.queue_hits},
      {"kvserve_kv_store_enqueued_total", stats.enqueued},
      {"kvserve_kv_store_dropped_total", stats.dropped},
      {"kvserve_kv_store_written_total", stats.written},
      {"kvserve_kv_store_promotions_total", stats.promotions},
  };
  for (const auto& [name, value] : store_counters) {
    header(out, name, "counter", "Tiered KV store, in blocks.");
    out += fmt::format("{} {}\n", name, value);
  }
  header(out, "kvserve_kv_store_queued_blocks", "gauge", "Blocks waiting to be written.");
  out += fmt::format("kvserve_kv_store_queued_blocks {}\n", stats.queued_blocks);
  header(out, "kvserve_kv_store_queued_bytes", "gauge", "Bytes waiting to be written.");
  out += fmt::format("kvserve_kv_store_queued_bytes {}\n", stats.queued_bytes);
  header(out, "kvserve_kv_store_lookup_seconds", "histogram", "Duration of one chain lookup over all tiers.");
  histogram(out, "kvserve_kv_store_lookup_seconds", "", stats.lookup_latency);
}

nlohmann::json tiered_stats_json(const TieredStats& stats) {
  nlohmann::json tiers = nlohmann::json::array();
  for (const TierStats& t : stats.tiers) {
    tiers.push_back({
        {"name", t.name},
        {"hits", t.hits},
        {"misses", t.misses},
        {"read_bytes", t.bytes_read},
        {"puts", t.puts},
        {"written_bytes", t.bytes_written},
        {"rejected", t.rejected},
        {"removes", t.removes},
        {"evictions", t.evictions},
        {"errors", t.errors},
        {"corrupt", t.corrupt},
        {"resident_blocks", t.resident_blocks},
        {"resident_bytes", t.resident_bytes},
        {"capacity_bytes", t.capacity_bytes},
        {"available", t.available},
        {"get_calls", t.get_latency.count},
        {"get_mean_us", t.get_latency.mean_seconds() * 1e6},
        {"get_p99_us", micros(t.get_latency.quantile_seconds(0.99))},
        {"put_calls", t.put_latency.count},
        {"put_mean_us", t.put_latency.mean_seconds() * 1e6},
        {"put_p99_us", micros(t.put_latency.quantile_seconds(0.99))},
    });
  }
  return {
      {"tiers", tiers},
      {"lookups", stats.lookups},
      {"blocks_requested", stats.blocks_requested},
      {"blocks_found", stats.blocks_found},
      {"queue_hits", stats.queue_hits},
      {"hit_rate", stats.blocks_requested == 0 ? 0.0 : double(stats.blocks_found) / double(stats.blocks_requested)},
      {"enqueued", stats.enqueued},
      {"dropped", stats.dropped},
      {"written", stats.written},
      {"promotions", stats.promotions},
      {"queued_blocks", stats.queued_blocks},
      {"queued_bytes", stats.queued_bytes},
      {"lookup_mean_us", stats.lookup_latency.mean_seconds() * 1e6},
      {"lookup_p99_us", micros(stats.lookup_latency.quantile_seconds(0.99))},
  };
}

}  // namespace kvserve
