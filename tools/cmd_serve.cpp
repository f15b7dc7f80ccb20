// kvserve serve: the OpenAI-compatible HTTP server (src/server/http_server.h)
// around one engine. Prints "kvserve: listening on http://HOST:PORT" on stderr
// once requests are accepted; SIGTERM or SIGINT drains running requests (up
// to --drain-timeout seconds), cancels the rest, and exits 0. A second signal
// during the drain exits at once (status 1).
#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "engine/engine.h"
#include "server/http_server.h"
#include "tools/cli_common.h"
#include "tools/engine_cli.h"
#include "util/error.h"

namespace kvserve::cli {
namespace {

struct ServeArgs {
  CommonOptions common;
  HttpServerOptions http;
  std::string api_keys;          // key file; empty = no keys
  EngineCliOptions engine_flags;
  SparsityFlags sparsity;        // the default policy of requests without "kv": {"policy": ...}
  double drain_timeout = 30;     // seconds running requests may take to finish after SIGTERM
};

void run(ServeArgs& a) {
  // Block the shutdown signals before any thread starts, so every thread
  // inherits the mask and sigwait below is the only receiver.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  if (a.drain_timeout < 0) fail("--drain-timeout must be >= 0 (got {})", a.drain_timeout);
  auto model = Model::load(a.common.model_path, a.common.tokenizer_path);
  EngineOptions eo = engine_options(a.common, a.engine_flags, *model, sparsity_options(a.sparsity));
  // A server shares one cache between many sequences: 1 GiB unless told.
  if (eo.kv.num_blocks == 0 && eo.kv.budget_bytes == 0)
    eo.kv.budget_bytes = int64_t(1) << 30;
  ApiKeys keys = a.api_keys.empty() ? ApiKeys() : ApiKeys::load(a.api_keys);

  Engine engine(*model, eo);
  // A server whose cache cannot hold a request of two tokens would start and
  // refuse everything: with a byte budget, FP16 staging takes pool blocks too.
  if (engine.max_sequence_tokens() < 2)
    fail("the KV cache ({} blocks of {} tokens) cannot hold a request of 2 tokens once the FP16 staging of its "
         "residual window and of a {}-token prefill chunk is paid for; raise --kv-memory{}",
         engine.cache().pool().num_blocks(), engine.cache().block_size(), eo.scheduler.max_batch_prefill_tokens,
         engine.cache().max_tokens(1) >= 2 ? " or lower --max-batch-prefill-tokens" : "");
  HttpServer server(engine, eo, std::move(keys), a.http);
  engine.start();
  const int port = server.start();
  const KvStats kv = engine.stats().kv;
  std::fprintf(stderr,
               "kvserve: model '%s' (context %d tokens), KV cache %s: %d blocks of %d tokens (%lld bytes/token; one "
               "request at most %lld tokens), max %d sequences, %d waiting, %s\n",
               server.model_name().c_str(), model->config().seq_len, kv_description(engine.cache()).c_str(),
               kv.blocks_total, kv.block_size, (long long)kv.bytes_per_token,
               (long long)std::min<int64_t>(engine.max_sequence_tokens(), model->config().seq_len), eo.scheduler.max_num_seqs,
               eo.max_waiting,
               server.chat_template() ? server.chat_template()->note().c_str() : "no vocabulary: token-id prompts only");
  std::fprintf(stderr, "kvserve: listening on http://%s:%d\n", a.http.host.c_str(), port);

  int sig = 0;
  sigwait(&signals, &sig);
  std::fprintf(stderr, "kvserve: %s: draining running requests (up to %.0f s)\n", sig == SIGTERM ? "SIGTERM" : "SIGINT",
               a.drain_timeout);
  std::thread second([signals] {
    int again = 0;
    sigwait(&signals, &again);
    std::fprintf(stderr, "kvserve: second signal: exiting now\n");
    std::_Exit(1);
  });
  second.detach();
  server.shutdown(a.drain_timeout);
  engine.shutdown(false);
  const EngineStats s = engine.stats();
  std::fprintf(stderr, "kvserve: stopped after %lld requests (%lld cancelled)\n", (long long)s.requests_finished,
               (long long)s.finished_cancelled);
}

}  // namespace

void register_serve(CLI::App& app) {
  auto a = std::make_shared<ServeArgs>();
  CLI::App* cmd = app.add_subcommand("serve", "OpenAI-compatible HTTP server (continuous batching)");
  add_common_options(*cmd, a->common);
  cmd->add_option("--host", a->http.host, "address to listen on")->capture_default_str();
  cmd->add_option("--port", a->http.port, "port (0 = any free port, printed on stderr)")->capture_default_str();
  cmd->add_option("--api-keys", a->api_keys, "file of `KEY TENANT` lines; unknown keys get 401");
  cmd->add_flag("--require-api-key", a->http.require_api_key, "with --api-keys: requests without a key get 401");
  cmd->add_option("--served-model-name", a->http.served_model_name,
                  "model name clients send (default: the model file's name without extension)");
  cmd->add_option("--chat-template", a->http.chat_template,
                  "chat format: plain | chatml | llama2 | llama3 (default: from the GGUF, else plain)");
  add_engine_options(*cmd, a->engine_flags);
  add_sparsity_options(*cmd, a->sparsity);
  cmd->add_option("--drain-timeout", a->drain_timeout, "seconds running requests may take to finish on SIGTERM")
      ->capture_default_str();
  cmd->add_option("--http-threads", a->http.http_threads,
                  "connection threads (default: max-num-seqs + max-waiting + 16)");
  cmd->callback([a] { run(*a); });
}

}  // namespace kvserve::cli
