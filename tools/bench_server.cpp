#include "tools/bench_server.h"

#include <signal.h>

#include <cstdio>

#include "tools/cli_common.h"

namespace kvserve::cli {

void add_server_bench_options(CLI::App& cmd, LoadOptions& o) {
  cmd.add_option("--server", o.server, "load-test this server instead of running a model, e.g. http://127.0.0.1:8080");
  cmd.add_option("--concurrency", o.concurrency, "with --server or --workload: requests in flight (--workload default 8)")->capture_default_str();
  cmd.add_option("--requests", o.requests, "with --server or --workload: requests in all (--workload default 64)")->capture_default_str();
  cmd.add_option("--shared-prefix", o.shared_prefix, "with --server: leading prompt tokens all requests share")
      ->capture_default_str();
  cmd.add_option("--request-rate", o.request_rate,
                 "with --server or --workload: start requests at this rate (req/s, open loop) instead of when a slot frees")
      ->capture_default_str();
  cmd.add_option("--max-tokens", o.max_tokens, "with --server or --workload: tokens generated per request (--workload default 16)")->capture_default_str();
  cmd.add_option("--api-key", o.api_key, "with --server: sent as a Bearer token");
  cmd.add_option("--served-model-name", o.model, "with --server: model name (default: the server's first)");
}

void run_server_bench(const LoadOptions& o, bool json) {
  // A server closing a connection mid-write must not kill the load generator.
  signal(SIGPIPE, SIG_IGN);
  const LoadReport r = run_load(o);
  if (json) {
    print_json(load_report_json(r));
  } else {
    std::fputs(load_report_text(r).c_str(), stdout);
  }
}

}  // namespace kvserve::cli
