// /metrics text: exact Prometheus exposition lines for counters, gauges,
// labelled samples and cumulative histograms, from given engine and server
// numbers.
#include "server/metrics.h"

#include <gtest/gtest.h>

namespace kvserve {
namespace {

TEST(Metrics, WriterEmitsFamiliesSamplesAndHistograms) {
  PrometheusWriter w;
  w.counter("a_total", "A counter.", 3);
  w.family("b", "gauge", "A labelled gauge.");
  w.sample("b", 0.25, {{"state", "used"}, {"codec", "say \"hi\"\\\n"}});
  Histogram h({0.1, 1.0});
  h.observe(0.05);
  h.observe(0.5);
  h.observe(0.5);
  h.observe(7);
  w.histogram("lat_seconds", "Latency.", h);
  EXPECT_EQ(w.text(),
            "# HELP a_total A counter.\n# TYPE a_total counter\na_total 3\n"
            "# HELP b A labelled gauge.\n# TYPE b gauge\nb{state=\"used\",codec=\"say \\\"hi\\\"\\\\\\n\"} 0.25\n"
            "# HELP lat_seconds Latency.\n# TYPE lat_seconds histogram\n"
            "lat_seconds_bucket{le=\"0.1\"} 1\nlat_seconds_bucket{le=\"1\"} 3\nlat_seconds_bucket{le=\"+Inf\"} 4\n"
            "lat_seconds_sum 8.05\nlat_seconds_count 4\n");
}

TEST(Metrics, EngineAndServerNumbersUnderTheirNames) {
  EngineStats e;
  e.requests_submitted = 10;
  e.requests_rejected = 2;
  e.finished_stop = 4;
  e.finished_length = 3;
  e.finished_cancelled = 1;
  e.running = 2;
  e.waiting = 5;
  e.preemptions = 6;
  e.prompt_tokens = 200;
  e.cached_prompt_tokens = 50;
  e.generated_tokens = 77;
  e.kv.blocks_used = 12;
  e.kv.blocks_free = 49;
  e.kv.blocks_for_staging = 3;
  e.kv.blocks_total = 64;
  e.kv.bytes_used = 12288;
  e.ttft.observe(0.02);
  ServerMetrics s;
  s.model = "m";
  s.kv_codec = "int4";
  s.responses[{"/v1/completions", 200}] = 9;
  s.responses[{"/v1/completions", 429}] = 2;
  s.in_flight = 3;
  const std::string m = render_metrics(e, s);
  for (const char* line : {
           "kvserve_info{model=\"m\",kv_codec=\"int4\"} 1\n",
           "kvserve_requests_submitted_total 10\n",
           "kvserve_requests_rejected_total 2\n",
           "kvserve_requests_finished_total{reason=\"stop\"} 4\n",
           "kvserve_requests_finished_total{reason=\"length\"} 3\n",
           "kvserve_requests_finished_total{reason=\"cancelled\"} 1\n",
           "kvserve_requests_finished_total{reason=\"error\"} 0\n",
           "kvserve_sequences_running 2\n",
           "kvserve_sequences_waiting 5\n",
           "kvserve_preemptions_total 6\n",
           "kvserve_prompt_tokens_total 200\n",
           "kvserve_prompt_tokens_cached_total 50\n",
           "kvserve_prefix_cache_hit_rate 0.25\n",
           "kvserve_generation_tokens_total 77\n",
           "kvserve_kv_blocks{codec=\"int4\",state=\"used\"} 12\n",
           "kvserve_kv_blocks{codec=\"int4\",state=\"free\"} 49\n",
           "kvserve_kv_blocks{codec=\"int4\",state=\"staging\"} 3\n",
           "kvserve_kv_blocks_total{codec=\"int4\"} 64\n",
           "kvserve_kv_bytes_used{codec=\"int4\"} 12288\n",
           "kvserve_time_to_first_token_seconds_bucket{le=\"0.025\"} 1\n",
           "kvserve_time_to_first_token_seconds_count 1\n",
           "kvserve_time_per_output_token_seconds_count 0\n",
           "kvserve_http_responses_total{route=\"/v1/completions\",code=\"200\"} 9\n",
           "kvserve_http_responses_total{route=\"/v1/completions\",code=\"429\"} 2\n",
           "kvserve_http_requests_in_flight 3\n",
       })
    EXPECT_NE(m.find(line), std::string::npos) << line;
  // Every family is declared once, before its samples.
  EXPECT_EQ(m.find("# TYPE kvserve_kv_blocks gauge\n"), m.rfind("# TYPE kvserve_kv_blocks gauge\n"));
  EXPECT_LT(m.find("# TYPE kvserve_kv_blocks gauge\n"), m.find("kvserve_kv_blocks{"));
}

TEST(Metrics, ResponseCounterCountsByRouteAndCode) {
  ResponseCounter c;
  c.record("/health", 200);
  c.record("/health", 200);
  c.record("other", 404);
  const auto snap = c.snapshot();
  EXPECT_EQ(snap.size(), 2u);
  EXPECT_EQ(snap.at({"/health", 200}), 2);
  EXPECT_EQ(snap.at({"other", 404}), 1);
}

}  // namespace
}  // namespace kvserve
