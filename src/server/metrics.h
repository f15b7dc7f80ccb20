// GET /metrics: the engine's and the server's counters in the Prometheus text
// exposition format (version 0.0.4). Names are documented in README.md
// ("Metrics"); rates (tokens/s, requests/s) are rate() over the counters.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "engine/engine.h"
#include "util/histogram.h"

namespace kvserve {

// Writes metric families: HELP and TYPE once per family, then its samples.
class PrometheusWriter {
 public:
  using Labels = std::vector<std::pair<std::string, std::string>>;

  // type: counter | gauge | histogram.
  void family(std::string_view name, std::string_view type, std::string_view help);
  void sample(std::string_view name, double value, const Labels& labels = {});
  // A whole histogram family: _bucket (cumulative, le="+Inf" last), _sum, _count.
  void histogram(std::string_view name, std::string_view help, const Histogram& h);
  // Shorthands for a family with one unlabelled sample.
  void counter(std::string_view name, std::string_view help, double value);
  void gauge(std::string_view name, std::string_view help, double value);

  const std::string& text() const { return out_; }

 private:
  std::string out_;
};

// Label values escaped as the format requires (backslash, quote, newline).
std::string escape_label_value(std::string_view v);

// HTTP responses by (route, status code).
//
// Thread safety: all methods; mutex_ guards counts_.
class ResponseCounter {
 public:
  void record(const std::string& route, int status);
  std::map<std::pair<std::string, int>, int64_t> snapshot() const;

 private:
  mutable std::mutex mutex_;
  std::map<std::pair<std::string, int>, int64_t> counts_;
};

// What the server adds to the engine's numbers.
struct ServerMetrics {
  std::string model;                 // served model name
  std::string kv_codec;              // the cache's codecs, the `codec` label of KV metrics
  std::map<std::pair<std::string, int>, int64_t> responses;  // (route, status) -> count
  int64_t in_flight = 0;             // completion requests submitted and not finished
  double uptime_seconds = 0;
};

[[nodiscard]] std::string render_metrics(const EngineStats& engine, const ServerMetrics& server);

}  // namespace kvserve
