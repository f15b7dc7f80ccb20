// kvserve bench --server URL: load-tests a running OpenAI-compatible server
// with the load generator of src/server/load_client.h.
#pragma once

#include <CLI/CLI.hpp>

#include "server/load_client.h"

namespace kvserve::cli {

// Adds --server, --concurrency, --requests, --shared-prefix, --request-rate, --max-tokens,
// --api-key and --served-model-name (bench's own --prompt-tokens and --json apply too).
void add_server_bench_options(CLI::App& cmd, LoadOptions& o);
// Runs the load and prints the report (one JSON object with json).
void run_server_bench(const LoadOptions& o, bool json);

}  // namespace kvserve::cli
