// A load generator for an OpenAI-compatible server (`kvserve bench --server`):
// N streamed completion requests with at most C in flight, sent as soon as a
// slot frees (closed loop) or at a fixed arrival rate (open loop, as an
// overload test needs: refused requests do not speed up arrivals), each with a prompt of
// random token ids (the first `shared_prefix` shared by all, so a prefix cache
// can hit), temperature 0 and ignore_eos, so every request generates exactly
// max_tokens tokens. It measures what a client sees:
//   TTFT  request sent -> first chunk with text
//   TPOT  (last text chunk - first text chunk) / (completion tokens - 1), per request
//   e2e   request sent -> end of the response
// and reports throughput, percentiles over the completed requests (computed
// from the samples, not from histogram buckets), status counts and lost
// requests (no response, or a stream that ended without [DONE]).
//
// Thread safety: run_load is reentrant; it runs its own client threads.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace kvserve {

struct LoadOptions {
  std::string server;              // base URL, e.g. "http://127.0.0.1:8080"
  int32_t concurrency = 1;         // requests in flight
  int32_t requests = 16;           // requests in all
  int32_t shared_prefix = 0;       // leading prompt tokens every request shares
  int32_t prompt_tokens = 64;      // prompt length in tokens, shared prefix included
  int32_t max_tokens = 32;         // tokens generated per request
  double request_rate = 0;         // requests started per second (open loop); 0 = closed loop
  std::string model;               // empty = the first model of GET /v1/models
  std::string api_key;             // sent as "Authorization: Bearer KEY" when not empty
  double timeout_seconds = 600;    // per request (connect and each read)
  uint64_t seed = 1;               // of the random prompts
  // Request i's own tokens are those of request first_request + i: runs
  // with the same seed and disjoint ranges share the prefix, not the rest.
  int32_t first_request = 0;

  // Throws kvserve::Error naming the first bad field.
  void validate() const;
};

// One request as the client saw it.
struct RequestSample {
  enum class Outcome : uint8_t {
    Complete,     // 200, a finish reason, then [DONE]
    Refused,      // an HTTP error status (429, 400, 503...)
    StreamError,  // 200, then an error event in the stream
    Lost,         // no response, or a 200 stream cut short
  };
  Outcome outcome = Outcome::Lost;
  int status = 0;                  // HTTP status; 0 = no response
  double ttft = 0;                 // seconds
  double tpot = 0;                 // seconds; 0 with fewer than 2 tokens
  double e2e = 0;                  // seconds
  int32_t prompt_tokens = 0;       // from the final usage chunk
  int32_t completion_tokens = 0;
  int32_t cached_tokens = 0;
  std::string error;               // what went wrong, when not complete
};

// Latency percentiles in seconds over some samples.
struct Percentiles {
  int32_t count = 0;
  double mean = 0, p50 = 0, p90 = 0, p99 = 0, max = 0;
};
// Linear interpolation between the closest ranks (numpy's default); zeros when empty.
[[nodiscard]] Percentiles percentiles(std::vector<double> samples);

struct LoadReport {
  LoadOptions options;
  std::string model;
  double seconds = 0;                      // wall time of the whole run
  std::map<int, int32_t> status_counts;    // HTTP status -> requests (0 = no response)
  int32_t late_starts = 0;                 // open loop: requests that found no free slot on time
  int32_t completed = 0;                   // complete 200 streams
  int32_t lost = 0;                        // no response, or a 200 stream cut short
  int32_t stream_errors = 0;               // 200 streams that ended with an error event
  int64_t prompt_tokens = 0;               // over completed requests
  int64_t output_tokens = 0;
  int64_t cached_tokens = 0;
  double request_throughput = 0;           // completed requests / s
  double output_throughput = 0;            // output tokens / s
  Percentiles ttft, tpot, e2e;             // over completed requests
  std::vector<std::string> errors;         // distinct error texts (first 8)
  std::vector<RequestSample> samples;      // in request order
};

// Runs the load. Throws kvserve::Error when the server cannot be reached or
// names no model.
[[nodiscard]] LoadReport run_load(const LoadOptions& options);

// The report as JSON (fields documented in README.md) and as a short text.
[[nodiscard]] nlohmann::json load_report_json(const LoadReport& r);
[[nodiscard]] std::string load_report_text(const LoadReport& r);

}  // namespace kvserve
