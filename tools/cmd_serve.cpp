// kvserve serve: the OpenAI-compatible HTTP server (src/server/http_server.h)
// around one engine. Prints "kvserve: listening on http://HOST:PORT" on stderr
// once requests are accepted; SIGTERM or SIGINT drains running requests (up
// to --drain-timeout seconds), cancels the rest, and exits 0. A second signal
// during the drain exits at once (status 1).
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
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
  std::vector<std::string> served_model_names;  // the first names responses; requests may use any
};

// SIGTERM and SIGINT, whichever thread the kernel hands them to. Blocking
// them and calling sigwait does not cover every thread: OpenBLAS starts its
// workers when the library loads, before main, with no signal blocked, and a
// signal delivered to one of them took its default action (a second signal
// during a drain killed the process with status 143, no message, and cut the
// running responses). A handler is process-wide; it only writes the signal's
// number into a pipe (write is async-signal-safe), and ordinary threads read
// it. SIGINT is handled even when inherited as ignored (how a shell starts a
// background job): kill -INT stops such a server as kill -TERM does.
//
// One per process, alive until it exits (its handler writes to its pipe).
class ShutdownSignals {
 public:
  ShutdownSignals() {
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) fail("cannot create the signal pipe: {}", std::strerror(errno));
    ::fcntl(fds[1], F_SETFL, O_NONBLOCK);  // the handler never blocks (a full pipe has signals enough)
    read_fd_ = fds[0];
    write_fd_ = fds[1];
    sigemptyset(&set_);
    sigaddset(&set_, SIGTERM);
    sigaddset(&set_, SIGINT);
    struct sigaction sa {};
    sa.sa_handler = &ShutdownSignals::on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    ::sigaction(SIGTERM, &sa, nullptr);
    ::sigaction(SIGINT, &sa, nullptr);
  }
  // Blocks the signals in the calling thread and in the threads it starts
  // from now on (the engine's, httplib's), so that only the threads that
  // wait() and OpenBLAS's run the handler; the others' system calls are
  // never interrupted.
  void block() const { pthread_sigmask(SIG_BLOCK, &set_, nullptr); }
  // The next signal's number; unblocks the signals in the calling thread
  // (one thread at least must take them when OpenBLAS runs none).
  int wait() const {
    pthread_sigmask(SIG_UNBLOCK, &set_, nullptr);
    unsigned char sig = 0;
    while (::read(read_fd_, &sig, 1) != 1)
      if (errno != EINTR) fail("cannot read the signal pipe: {}", std::strerror(errno));
    return sig;
  }

 private:
  static void on_signal(int sig) {
    const int saved = errno;
    const unsigned char byte = static_cast<unsigned char>(sig);
    [[maybe_unused]] const ssize_t n = ::write(write_fd_, &byte, 1);
    errno = saved;
  }

  static inline int write_fd_ = -1;  // the handler's end of the pipe
  int read_fd_ = -1;
  sigset_t set_;
};

void run(ServeArgs& a) {
  static const ShutdownSignals signals;  // before any thread of ours starts
  signals.block();
  if (!a.served_model_names.empty()) {
    for (const std::string& name : a.served_model_names)
      if (name.empty()) fail("--served-model-name: a name is empty");
    a.http.served_model_name = a.served_model_names.front();
    a.http.served_model_aliases.assign(a.served_model_names.begin() + 1, a.served_model_names.end());
  }

  auto model = load_model(a.common);
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
  if (eo.cache_event_log > 0 && !a.api_keys.empty() && a.http.kv_events_admin.empty())  // a router sees less
    std::fprintf(stderr, "kvserve: GET /v1/kv/events: each key reads its own tenant's events and the shared scope's "
                         "(--kv-events-admin TENANT names a router's tenant that reads all)\n");
  std::fprintf(stderr, "kvserve: listening on http://%s:%d\n", a.http.host.c_str(), port);

  const int sig = signals.wait();
  std::fprintf(stderr, "kvserve: %s: draining running requests (up to %.0f s)\n", sig == SIGTERM ? "SIGTERM" : "SIGINT",
               a.drain_timeout);
  std::thread second([] {
    signals.wait();
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
  cmd->add_option("--port", a->http.port, "port (0 = any free port, printed on stderr)")
      ->check(CLI::Range(0, 65535))  // httplib would bind the value modulo 2^16 and print another
      ->capture_default_str();
  cmd->add_option("--api-keys", a->api_keys, "file of `KEY TENANT` lines; unknown keys get 401");
  cmd->add_flag("--require-api-key", a->http.require_api_key, "with --api-keys: requests without a key get 401");
  cmd->add_option("--kv-events-admin", a->http.kv_events_admin,
                  "with --api-keys and --kv-events: the tenant whose keys read every tenant's GET /v1/kv/events (a "
                  "KV-aware router); other keys read their own tenant's and the shared scope's");
  cmd->add_option("--served-model-name", a->served_model_names,
                  "model name(s) clients send: requests may use any (or none), responses carry the first "
                  "(default: the model file's name without extension)")
      ->expected(1, -1);
  cmd->add_option("--chat-template", a->http.chat_template,
                  "chat format: plain | chatml | llama2 | llama3 (default: from the GGUF, else plain)");
  add_engine_options(*cmd, a->engine_flags);
  add_sparsity_options(*cmd, a->sparsity);
  cmd->add_option("--drain-timeout", a->drain_timeout, "seconds running requests may take to finish on SIGTERM")
      ->check(finite_in(0, 1e6))  // seconds; larger would overflow the drain's deadline
      ->capture_default_str();
  cmd->add_option("--http-threads", a->http.http_threads,
                  "connection threads (default: max-num-seqs + max-waiting + 16)");
  cmd->callback([a] { run(*a); });
}

}  // namespace kvserve::cli
