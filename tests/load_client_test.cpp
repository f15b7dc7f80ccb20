// The load generator against a real in-process server: every request is
// accounted for (completed, refused or lost), token counts are exact with
// ignore_eos, percentiles are exact order statistics, and bad options or an
// unreachable server are clear errors.
#include "server/load_client.h"

#include <gtest/gtest.h>

#include "server/http_server.h"
#include "test_support.h"

namespace kvserve {
namespace {

using testing_files::expect_error_containing;

TEST(LoadClient, PercentilesInterpolateBetweenRanks) {
  const Percentiles p = percentiles({4, 1, 3, 2});
  EXPECT_EQ(p.count, 4);
  EXPECT_DOUBLE_EQ(p.mean, 2.5);
  EXPECT_DOUBLE_EQ(p.p50, 2.5);
  EXPECT_DOUBLE_EQ(p.p90, 3.7);
  EXPECT_DOUBLE_EQ(p.p99, 3.97);
  EXPECT_DOUBLE_EQ(p.max, 4);
  EXPECT_EQ(percentiles({}).count, 0);
  EXPECT_DOUBLE_EQ(percentiles({7}).p99, 7);
}

TEST(LoadClient, BadOptionsAndUnreachableServers) {
  LoadOptions o;
  expect_error_containing([&] { o.validate(); }, "--server is required");
  o.server = "http://127.0.0.1:1";
  o.shared_prefix = 100;
  expect_error_containing([&] { o.validate(); }, "--shared-prefix must be between 0 and --prompt-tokens");
  o.shared_prefix = 0;
  o.concurrency = 0;
  expect_error_containing([&] { o.validate(); }, "--concurrency");
  o.concurrency = 1;
  o.timeout_seconds = 2;
  expect_error_containing([&] { (void)run_load(o); }, "cannot reach http://127.0.0.1:1");
}

class LoadClientServerTest : public ::testing::Test {
 protected:
  void start(int32_t max_num_seqs, int32_t max_waiting) {
    model = Model::load(testing_files::kStoriesGguf);
    EngineOptions eo;
    eo.threads = 1;
    eo.kv.num_blocks = 256;
    eo.scheduler.max_num_seqs = max_num_seqs;
    eo.max_waiting = max_waiting;
    engine = std::make_unique<Engine>(*model, eo);
    HttpServerOptions ho;
    ho.port = 0;
    server = std::make_unique<HttpServer>(*engine, eo, ApiKeys(), ho);
    engine->start();
    url = "http://127.0.0.1:" + std::to_string(server->start());
  }
  void TearDown() override {
    server->shutdown(0);
    engine->shutdown(false);
  }
  std::unique_ptr<Model> model;
  std::unique_ptr<Engine> engine;
  std::unique_ptr<HttpServer> server;
  std::string url;
};

TEST_F(LoadClientServerTest, EveryRequestCompletesWithExactTokenCounts) {
  start(8, 64);
  LoadOptions o;
  o.server = url;
  o.concurrency = 4;
  o.requests = 12;
  o.prompt_tokens = 16;
  o.shared_prefix = 8;
  o.max_tokens = 10;
  const LoadReport r = run_load(o);
  EXPECT_EQ(r.model, "stories260K");
  EXPECT_EQ(r.completed, 12);
  EXPECT_EQ(r.lost, 0);
  EXPECT_EQ(r.stream_errors, 0);
  EXPECT_EQ(r.status_counts, (std::map<int, int32_t>{{200, 12}}));
  EXPECT_EQ(r.prompt_tokens, 12 * 16);
  EXPECT_EQ(r.output_tokens, 12 * 10);
  EXPECT_EQ(r.ttft.count, 12);
  EXPECT_EQ(r.tpot.count, 12);
  EXPECT_GT(r.ttft.p50, 0);
  EXPECT_LE(r.ttft.p50, r.ttft.p99);
  EXPECT_LE(r.ttft.p99, r.ttft.max);
  EXPECT_LE(r.ttft.max, r.e2e.max);
  EXPECT_GT(r.output_throughput, 0);
  EXPECT_TRUE(r.errors.empty());
  const nlohmann::json j = load_report_json(r);
  for (const char* f : {"completed", "lost", "status_counts", "output_tok_s", "request_throughput", "ttft", "tpot"})
    EXPECT_TRUE(j.contains(f)) << f;
  EXPECT_EQ(j["status_counts"]["200"], 12);
  EXPECT_NE(load_report_text(r).find("completed 12, lost 0"), std::string::npos);
  // The server saw the same prompt tokens the client sent.
  EXPECT_EQ(engine->stats().prompt_tokens, 12 * 16);
}

TEST_F(LoadClientServerTest, OpenLoopStartsRequestsAtTheOfferedRate) {
  start(8, 64);
  LoadOptions o;
  o.server = url;
  o.concurrency = 8;
  o.requests = 10;
  o.prompt_tokens = 8;
  o.max_tokens = 4;
  o.request_rate = 50;  // one every 20 ms: the last starts at 180 ms
  const LoadReport r = run_load(o);
  EXPECT_EQ(r.completed, 10);
  EXPECT_GE(r.seconds, 0.18);
  EXPECT_EQ(load_report_json(r)["request_rate"], 50.0);
}

TEST_F(LoadClientServerTest, OverloadIsRefusedNeverLost) {
  start(1, 2);
  LoadOptions o;
  o.server = url;
  o.concurrency = 12;
  o.requests = 24;
  o.prompt_tokens = 8;
  o.max_tokens = 32;
  const LoadReport r = run_load(o);
  EXPECT_EQ(r.lost, 0);
  EXPECT_EQ(r.stream_errors, 0);
  int32_t counted = 0;
  for (const auto& [status, n] : r.status_counts) {
    EXPECT_TRUE(status == 200 || status == 429) << status;
    counted += n;
  }
  EXPECT_EQ(counted, 24);
  EXPECT_EQ(r.completed, r.status_counts.count(200) ? r.status_counts.at(200) : 0);
  EXPECT_EQ(r.output_tokens, int64_t(r.completed) * 32);
}

}  // namespace
}  // namespace kvserve
