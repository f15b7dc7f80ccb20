#include "server/load_client.h"

#include <fmt/format.h>
#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <random>
#include <set>
#include <thread>

#include "util/error.h"

namespace kvserve {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

void configure(httplib::Client& c, const LoadOptions& o) {
  const auto whole = time_t(o.timeout_seconds);
  const auto micros = time_t((o.timeout_seconds - double(whole)) * 1e6);
  c.set_connection_timeout(whole, micros);
  c.set_read_timeout(whole, micros);
  c.set_write_timeout(whole, micros);
  c.set_keep_alive(true);
  c.set_tcp_nodelay(true);  // chunks are small: do not wait to coalesce them
}

// What GET /v1/models says about the model to load.
struct ServedModel {
  std::string name;
  int64_t max_model_len = 0;  // 0 = not reported
  int64_t vocab_size = 0;     // 0 = not reported
};

ServedModel discover(const LoadOptions& o) {
  httplib::Client c(o.server);
  if (!c.is_valid()) fail("'{}' is not a server URL (expected http://HOST:PORT)", o.server);
  configure(c, o);
  httplib::Headers headers;
  if (!o.api_key.empty()) headers.emplace("Authorization", "Bearer " + o.api_key);
  auto res = c.Get("/v1/models", headers);
  if (!res) fail("cannot reach {}: {}", o.server, httplib::to_string(res.error()));
  if (res->status != 200) fail("GET {}/v1/models answered {}: {}", o.server, res->status, res->body);
  const json j = json::parse(res->body, nullptr, false);
  if (j.is_discarded() || !j.contains("data") || !j["data"].is_array() || j["data"].empty())
    fail("GET {}/v1/models lists no model", o.server);
  const json* pick = &j["data"][0];
  if (!o.model.empty()) {
    pick = nullptr;
    for (const json& m : j["data"])
      if (m.value("id", "") == o.model) pick = &m;
    if (!pick) fail("{} does not serve model '{}'", o.server, o.model);
  }
  ServedModel m;
  m.name = pick->value("id", "");
  m.max_model_len = pick->value("max_model_len", int64_t(0));
  m.vocab_size = pick->value("vocab_size", int64_t(0));
  return m;
}

// Token ids from [3, vocab): 0-2 are unknown/BOS/EOS in Llama vocabularies.
std::vector<int32_t> random_tokens(std::mt19937_64& rng, int32_t n, int64_t vocab) {
  std::uniform_int_distribution<int32_t> pick(3, int32_t(vocab - 1));
  std::vector<int32_t> t(size_t(std::max(0, n)));
  for (int32_t& x : t) x = pick(rng);
  return t;
}

// One streamed request, parsed as it arrives.
RequestSample run_one(httplib::Client& client, const std::string& body, const LoadOptions& o) {
  RequestSample s;
  std::string buffer, error_body;
  bool finished = false, done = false;
  Clock::time_point first_text{}, last_text{};
  const Clock::time_point t0 = Clock::now();

  auto on_event = [&](const std::string& data) {
    if (data == "[DONE]") {
      done = true;
      return;
    }
    const json j = json::parse(data, nullptr, false);
    if (j.is_discarded()) {
      s.error = "a stream event is not JSON";
      return;
    }
    if (j.contains("error")) {
      s.error = j["error"].value("message", "error event");
      return;
    }
    if (j.contains("usage") && j["usage"].is_object()) {
      s.prompt_tokens = j["usage"].value("prompt_tokens", 0);
      s.completion_tokens = j["usage"].value("completion_tokens", 0);
      if (j["usage"].contains("prompt_tokens_details") && j["usage"]["prompt_tokens_details"].is_object())
        s.cached_tokens = j["usage"]["prompt_tokens_details"].value("cached_tokens", 0);
    }
    if (!j.contains("choices") || !j["choices"].is_array() || j["choices"].empty()) return;
    const json& c = j["choices"][0];
    if (c.contains("text") && c["text"].is_string() && !c["text"].get<std::string>().empty()) {
      last_text = Clock::now();
      if (first_text == Clock::time_point{}) first_text = last_text;
    }
    if (c.contains("finish_reason") && !c["finish_reason"].is_null()) finished = true;
  };

  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.body = body;
  req.set_header("Content-Type", "application/json");
  if (!o.api_key.empty()) req.set_header("Authorization", "Bearer " + o.api_key);
  req.response_handler = [&](const httplib::Response& res) {
    s.status = res.status;
    return true;
  };
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    if (s.status != 200) {
      error_body.append(data, n);
      return true;
    }
    buffer.append(data, n);
    size_t end;
    while ((end = buffer.find("\n\n")) != std::string::npos) {
      const std::string event = buffer.substr(0, end);
      buffer.erase(0, end + 2);
      if (event.rfind("data: ", 0) == 0) on_event(event.substr(6));
    }
    return true;
  };
  httplib::Response res;
  httplib::Error err = httplib::Error::Success;
  client.send(req, res, err);
  s.e2e = since(t0);
  if (s.status != 200) {
    if (s.status == 0) {
      s.error = "no response: " + httplib::to_string(err);
    } else {
      s.outcome = RequestSample::Outcome::Refused;
      const json j = json::parse(error_body, nullptr, false);
      s.error = fmt::format("HTTP {}: {}", s.status,
                            !j.is_discarded() && j.contains("error") ? j["error"].value("message", error_body) : error_body);
    }
    return s;
  }
  if (!s.error.empty()) {
    s.outcome = RequestSample::Outcome::StreamError;
  } else if (finished && done) {
    s.outcome = RequestSample::Outcome::Complete;
  } else {
    s.error = err != httplib::Error::Success ? "stream cut short: " + httplib::to_string(err) : "stream ended without [DONE]";
  }
  if (first_text != Clock::time_point{}) {
    s.ttft = std::chrono::duration<double>(first_text - t0).count();
    if (s.completion_tokens > 1)
      s.tpot = std::chrono::duration<double>(last_text - first_text).count() / (s.completion_tokens - 1);
  }
  return s;
}

json percentiles_json(const Percentiles& p) {
  return {{"count", p.count},          {"mean_ms", p.mean * 1e3}, {"p50_ms", p.p50 * 1e3},
          {"p90_ms", p.p90 * 1e3},     {"p99_ms", p.p99 * 1e3},   {"max_ms", p.max * 1e3}};
}

}  // namespace

void LoadOptions::validate() const {
  if (server.empty()) fail("--server is required");
  if (concurrency < 1) fail("--concurrency must be at least 1 (got {})", concurrency);
  if (requests < 1) fail("--requests must be at least 1 (got {})", requests);
  if (first_request < 0) fail("the first request index must be >= 0 (got {})", first_request);
  if (prompt_tokens < 1) fail("--prompt-tokens must be at least 1 (got {})", prompt_tokens);
  if (shared_prefix < 0 || shared_prefix > prompt_tokens)
    fail("--shared-prefix must be between 0 and --prompt-tokens ({}) (got {})", prompt_tokens, shared_prefix);
  if (max_tokens < 1) fail("--max-tokens must be at least 1 (got {})", max_tokens);
  if (!(timeout_seconds > 0)) fail("the request timeout must be positive");
  if (!(request_rate >= 0)) fail("--request-rate must be >= 0 (got {})", request_rate);
}

Percentiles percentiles(std::vector<double> v) {
  Percentiles p;
  if (v.empty()) return p;
  std::sort(v.begin(), v.end());
  auto at = [&](double q) {
    const double rank = q * double(v.size() - 1);
    const size_t lo = size_t(std::floor(rank));
    const size_t hi = std::min(lo + 1, v.size() - 1);
    return v[lo] + (v[hi] - v[lo]) * (rank - double(lo));
  };
  p.count = int32_t(v.size());
  double sum = 0;
  for (double x : v) sum += x;
  p.mean = sum / double(v.size());
  p.p50 = at(0.5);
  p.p90 = at(0.9);
  p.p99 = at(0.99);
  p.max = v.back();
  return p;
}

LoadReport run_load(const LoadOptions& o) {
  o.validate();
  const ServedModel model = discover(o);
  if (model.max_model_len > 0 && o.prompt_tokens + o.max_tokens > model.max_model_len)
    fail("--prompt-tokens + --max-tokens = {} exceeds the model's context length of {}", o.prompt_tokens + o.max_tokens,
         model.max_model_len);
  // Without a reported vocabulary, ids below 256 exist in every real one.
  const int64_t vocab = model.vocab_size > 3 ? model.vocab_size : 256;

  std::mt19937_64 prefix_rng(o.seed);
  const std::vector<int32_t> prefix = random_tokens(prefix_rng, o.shared_prefix, vocab);
  std::vector<std::string> bodies(size_t(o.requests));
  for (int32_t i = 0; i < o.requests; ++i) {
    std::mt19937_64 rng(o.seed + 1 + uint64_t(o.first_request) + uint64_t(i));
    std::vector<int32_t> prompt = prefix;
    const std::vector<int32_t> rest = random_tokens(rng, o.prompt_tokens - o.shared_prefix, vocab);
    prompt.insert(prompt.end(), rest.begin(), rest.end());
    bodies[size_t(i)] = json{{"model", model.name},
                             {"prompt", prompt},
                             {"max_tokens", o.max_tokens},
                             {"temperature", 0},
                             {"ignore_eos", true},
                             {"stream", true},
                             {"stream_options", {{"include_usage", true}}}}
                            .dump();
  }

  LoadReport r;
  r.options = o;
  r.model = model.name;
  r.samples.resize(size_t(o.requests));
  std::atomic<int32_t> next{0};
  std::atomic<int32_t> late{0};
  const Clock::time_point t0 = Clock::now();
  std::vector<std::thread> workers;
  for (int32_t w = 0; w < std::min(o.concurrency, o.requests); ++w) {
    workers.emplace_back([&] {
      httplib::Client client(o.server);
      configure(client, o);
      for (int32_t i = next++; i < o.requests; i = next++) {
        if (o.request_rate > 0) {
          // Request i is due at i / rate; a worker that gets it later was busy (all slots taken).
          const auto due = t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(i / o.request_rate));
          if (Clock::now() > due + std::chrono::milliseconds(10)) ++late;
          std::this_thread::sleep_until(due);
        }
        r.samples[size_t(i)] = run_one(client, bodies[size_t(i)], o);
      }
    });
  }
  for (std::thread& t : workers) t.join();
  r.seconds = since(t0);
  r.late_starts = late;

  std::vector<double> ttft, tpot, e2e;
  std::set<std::string> errors;
  for (const RequestSample& s : r.samples) {
    ++r.status_counts[s.status];
    if (!s.error.empty() && errors.size() < 8) errors.insert(s.error);
    r.lost += s.outcome == RequestSample::Outcome::Lost;
    r.stream_errors += s.outcome == RequestSample::Outcome::StreamError;
    if (s.outcome != RequestSample::Outcome::Complete) continue;
    ++r.completed;
    r.prompt_tokens += s.prompt_tokens;
    r.output_tokens += s.completion_tokens;
    r.cached_tokens += s.cached_tokens;
    ttft.push_back(s.ttft);
    if (s.completion_tokens > 1) tpot.push_back(s.tpot);
    e2e.push_back(s.e2e);
  }
  r.errors.assign(errors.begin(), errors.end());
  r.request_throughput = r.completed / r.seconds;
  r.output_throughput = double(r.output_tokens) / r.seconds;
  r.ttft = percentiles(ttft);
  r.tpot = percentiles(tpot);
  r.e2e = percentiles(e2e);
  return r;
}

json load_report_json(const LoadReport& r) {
  json status = json::object();
  for (const auto& [code, n] : r.status_counts) status[std::to_string(code)] = n;
  return {{"server", r.options.server},
          {"model", r.model},
          {"requests", r.options.requests},
          {"concurrency", r.options.concurrency},
          {"prompt_tokens_per_request", r.options.prompt_tokens},
          {"shared_prefix", r.options.shared_prefix},
          {"max_tokens", r.options.max_tokens},
          {"request_rate", r.options.request_rate},
          {"late_starts", r.late_starts},
          {"seconds", r.seconds},
          {"status_counts", status},
          {"completed", r.completed},
          {"lost", r.lost},
          {"stream_errors", r.stream_errors},
          {"prompt_tokens", r.prompt_tokens},
          {"output_tokens", r.output_tokens},
          {"cached_tokens", r.cached_tokens},
          {"request_throughput", r.request_throughput},
          {"output_tok_s", r.output_throughput},
          {"ttft", percentiles_json(r.ttft)},
          {"tpot", percentiles_json(r.tpot)},
          {"e2e", percentiles_json(r.e2e)},
          {"errors", r.errors}};
}

std::string load_report_text(const LoadReport& r) {
  std::string status;
  for (const auto& [code, n] : r.status_counts)
    status += fmt::format("{}{} x{}", status.empty() ? "" : ", ", code == 0 ? "no response" : std::to_string(code), n);
  std::string out = fmt::format(
      "{} requests to {} ({}), concurrency {}{}, {} prompt tokens ({} shared), {} max tokens\n"
      "status: {} | completed {}, lost {}, stream errors {}\n"
      "throughput: {:.2f} req/s, {:.1f} output tok/s over {:.2f} s; cached prompt tokens {} of {}\n"
      "TTFT ms: p50 {:.1f} p90 {:.1f} p99 {:.1f} | TPOT ms: p50 {:.2f} p90 {:.2f} p99 {:.2f} | e2e ms: p50 {:.0f} p99 {:.0f}\n",
      r.options.requests, r.options.server, r.model, r.options.concurrency,
      r.options.request_rate > 0 ? fmt::format(", {} req/s offered ({} started late)", r.options.request_rate, r.late_starts)
                                 : std::string(),
      r.options.prompt_tokens,
      r.options.shared_prefix, r.options.max_tokens, status, r.completed, r.lost, r.stream_errors, r.request_throughput,
      r.output_throughput, r.seconds, r.cached_tokens, r.prompt_tokens, r.ttft.p50 * 1e3, r.ttft.p90 * 1e3,
      r.ttft.p99 * 1e3, r.tpot.p50 * 1e3, r.tpot.p90 * 1e3, r.tpot.p99 * 1e3, r.e2e.p50 * 1e3, r.e2e.p99 * 1e3);
  for (const std::string& e : r.errors) out += "error: " + e + "\n";
  return out;
}

}  // namespace kvserve
