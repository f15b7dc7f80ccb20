#include "server/http_server.h"

#include <httplib.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fmt/ranges.h>
#include <functional>

#include "server/connection_probe.h"
#include "server/connection_threads.h"
#include "server/event_queue.h"
#include "server/http_responses.h"
#include "server/http_framing.h"
#include "server/utf8_stream.h"
#include "util/error.h"

namespace kvserve {
namespace {

using json = nlohmann::json;
using SteadyTime = std::chrono::steady_clock;

// cpp-httplib 0.11 listens with a backlog of 5, compiled into Debian's
// library: a burst of clients connecting at once (a load test, a batch job)
// would see SYNs dropped and retried a second later. Listening again on the
// bound socket only raises the kernel's queue.
class Listener : public httplib::Server {
 public:
  void set_backlog(int n) { ::listen(svr_sock_, n); }
};

// Hands res's body to httplib as a content provider whose releaser, called
// once the response is written or abandoned, calls release(). REQUIRES: a body.
void release_after_write(httplib::Response& res, std::function<void()> release) {
  auto body = std::make_shared<std::string>(std::move(res.body));
  res.body.clear();
  const std::string type = res.get_header_value("Content-Type");
  res.headers.erase("Content-Type");  // set_content_provider sets it again
  res.set_content_provider(
      body->size(), type,
      [body](size_t offset, size_t length, httplib::DataSink& sink) {
        return sink.write(body->data() + offset, std::min(length, body->size() - offset));
      },
      [release = std::move(release)](bool) { release(); });
}

// Answers with e and closes the connection once the answer is written:
// httplib 0.11 keeps a connection alive whatever the response's Connection
// header says, and would read what follows as the next request.
void send_error_and_close(const httplib::Request& req, httplib::Response& res, const ApiError& e) {
  send_error(res, e);
  res.set_header("Connection", "close");
  const ConnectionProbe connection = ConnectionProbe::find(req.remote_addr, req.remote_port, req.local_port);
  release_after_write(res, [connection] { connection.shut_down(); });
}

ApiError shutting_down() {
  return error_of(503, "the server is shutting down", "server_error", "server_shutting_down");
}

// What the client sees when its request ends without a result.
ApiError finish_error(const RequestEvent& e) {
  if (e.finish == FinishReason::Cancelled)
    return error_of(503, "the server shut down before the request finished", "server_error", "server_shutting_down");
  if (e.request_error) return error_of(400, e.error, "invalid_request_error", "invalid_request");
  return error_of(500, "the engine failed to run the request: " + e.error, "server_error", "engine_error");
}

struct Route {
  const char* path;
  const char* method;
};
constexpr Route kRoutes[] = {{"/v1/completions", "POST"}, {"/v1/chat/completions", "POST"},
                             {"/v1/models", "GET"},        {"/health", "GET"},
                             {"/metrics", "GET"},          {"/v1/kv/events", "GET"},
                             {"/tokenize", "POST"},        {"/detokenize", "POST"}};

// The route a path counts under in kvserve_http_responses_total (bounded label values).
std::string route_label(const std::string& path) {
  for (const Route& r : kRoutes)
    if (path == r.path) return r.path;
  if (path.rfind("/v1/models/", 0) == 0) return "/v1/models/{id}";
  return "other";
}

// A bad word's token sequences, as vLLM finds them: the word as it is and,
// when that tokenizes to as many tokens with a different first one, after a
// space (a word inside a sentence).
void add_bad_word(const Tokenizer& tokenizer, const std::string& word, std::vector<std::vector<int32_t>>& out) {
  const std::string bare = word.substr(word.find_first_not_of(" \t\n"));
  const std::vector<int32_t> alone = tokenizer.encode(bare, false);
  const std::vector<int32_t> spaced = tokenizer.encode(" " + bare, false);
  if (!alone.empty()) out.push_back(alone);
  if (!spaced.empty() && spaced.size() == alone.size() && spaced[0] != alone[0]) out.push_back(spaced);
}

int64_t unix_seconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

// One completion request: n choices, one engine request each (they share the
// prompt's KV through the prefix cache).
struct HttpServer::Completion {
  struct Choice {
    RequestId id = 0;
    Utf8Stream utf8;
    bool finished = false;        // its final event was handled
    RequestEvent last;            // that event (finish reason, usage, error)
    std::string text;             // respond_whole: the text so far
    bool echo = false;            // the echoed prompt is still to send
    std::string echo_text;        // completions' echo: its prompt's text
    bool first_of_prompt = false; // the first of its prompt's n choices (usage counts the prompt once)
    // Log-probabilities: entries not yet sent, the token before the next
    // one (its text depends on it after BOS), completions' next text
    // offset, and (echo) the prompt whose entries come with the first event.
    std::vector<LogprobEntry> pending;
    int32_t prev_token = -1;
    size_t text_offset = 0;
    std::vector<int32_t> prompt;
    // prompt_logprobs: the prompt's first token (what the second follows),
    // then its entries once the first event brings them.
    int32_t first_prompt_token = -1;
    std::vector<PromptLogprob> prompt_entries;
  };
  Endpoint endpoint = Endpoint::Completions;
  ResponseMeta meta;
  bool include_usage = false;
  bool logprobs = false;          // asked for "logprobs"
  int32_t top_n = 0;              // alternatives per reported token ("logprobs" N / "top_logprobs")
  int32_t prompt_top_n = -1;      // vLLM's prompt_logprobs N; -1 = none
  std::vector<Choice> choices;
  std::map<RequestId, size_t> choice_of;  // engine request -> its choice
  std::shared_ptr<EventQueue> events = std::make_shared<EventQueue>();
  ConnectionProbe probe;
  bool finished = false;          // every choice finished (or one failed)
  bool started = false;           // streaming: the response has begun
  SteadyTime::time_point last_write = SteadyTime::now();

  bool all_finished() const {
    return std::all_of(choices.begin(), choices.end(), [](const Choice& x) { return x.finished; });
  }
  // The usage of all choices: each prompt once, the completions summed.
  RequestUsage usage() const {
    RequestUsage u;
    for (const Choice& x : choices) {
      u.completion_tokens += x.last.usage.completion_tokens;
      if (!x.first_of_prompt) continue;
      u.prompt_tokens += x.last.usage.prompt_tokens;
      u.cached_tokens += x.last.usage.cached_tokens;
    }
    return u;
  }
};

HttpServer::HttpServer(Engine& engine, const EngineOptions& engine_options, ApiKeys keys, HttpServerOptions options)
    : engine_(engine),
      keys_(std::move(keys)),
      options_(std::move(options)),
      started_(SteadyTime::now()),
      seeds_(std::random_device{}()) {
  if (options_.http_threads < 0) fail("the HTTP thread count must be >= 0 (got {})", options_.http_threads);
  if (options_.poll_interval_ms < 1 || options_.heartbeat_ms < 1 || options_.keep_alive_timeout_seconds < 1 ||
      options_.retry_after_seconds < 0 || options_.listen_backlog < 1)
    fail("HTTP server timings must be positive");
  cache_events_ = engine_options.cache_event_log > 0;
  key_hash_ = engine_options.prefix.hash;
  if (options_.http_threads == 0)
    options_.http_threads = engine_options.scheduler.max_num_seqs + engine_options.max_waiting + 16;
  if (options_.require_api_key && keys_.size() == 0) fail("requiring API keys needs a key file (--api-keys)");
  // Requests without a key are the default tenant: naming it would show every tenant's events to them.
  if (options_.kv_events_admin == kDefaultTenant)
    fail("the prefix-cache events admin cannot be the '{}' tenant of requests without a key: give the router's key "
         "a tenant of its own", kDefaultTenant);
  if (!options_.kv_events_admin.empty() && !keys_.has_tenant(options_.kv_events_admin))
    fail("the prefix-cache events admin '{}' is the tenant of no API key (--api-keys)", options_.kv_events_admin);
  if (!options_.kv_events_admin.empty() && !cache_events_)
    fail("the prefix-cache events admin '{}' reads no events: --kv-events N is off", options_.kv_events_admin);

  const Model& model = engine.model();
  model_names_ = {options_.served_model_name.empty() ? std::filesystem::path(model.path()).stem().string()
                                                     : options_.served_model_name};
  for (const std::string& alias : options_.served_model_aliases) {
    if (alias.empty()) fail("a served model name is empty");
    if (std::find(model_names_.begin(), model_names_.end(), alias) == model_names_.end()) model_names_.push_back(alias);
  }
  context_length_ = model.config().seq_len;
  // With a byte budget, FP16 staging takes part of the pool (Engine::max_sequence_tokens).
  kv_capacity_tokens_ = engine.max_sequence_tokens();
  tokenizer_ = model.tokenizer();
  if (tokenizer_) {
    chat_template_ = ChatTemplate::for_model(model, options_.chat_template);
  } else if (!options_.chat_template.empty()) {
    fail("a chat template needs a model with a vocabulary");
  }
  kv_limits_ = kv_request_limits(engine.cache());
  id_prefix_ = fmt::format("{:08x}", uint32_t(seeds_()));
  created_ = unix_seconds();

  auto listener = std::make_unique<Listener>();
  httplib::Server& s = *listener;
  // The POST routes read their bodies themselves: httplib (0.11) caps a
  // body with a Content-Length but buffers a chunked one whole.
  s.Post("/v1/completions",
         [this](const httplib::Request& req, httplib::Response& res, const httplib::ContentReader& read) {
           if (std::optional<std::string> body = read_body(req, res, read)) handle_completion(req, *body, res, Endpoint::Completions);
         });
  s.Post("/v1/chat/completions",
         [this](const httplib::Request& req, httplib::Response& res, const httplib::ContentReader& read) {
           if (std::optional<std::string> body = read_body(req, res, read))
             handle_completion(req, *body, res, Endpoint::ChatCompletions);
         });
  s.Post("/tokenize", [this](const httplib::Request& req, httplib::Response& res, const httplib::ContentReader& read) {
    if (std::optional<std::string> body = read_body(req, res, read)) handle_tokenize(req, *body, res);
  });
  s.Post("/detokenize", [this](const httplib::Request& req, httplib::Response& res, const httplib::ContentReader& read) {
    if (std::optional<std::string> body = read_body(req, res, read)) handle_detokenize(req, *body, res);
  });
  // Before any of the body is read: a request whose framing is unsound, or
  // whose declared length is past 4x the cap, is answered at once and its
  // connection closed (http_framing.h). Up to 4x the cap httplib reads the
  // body, drops it and answers 413: clients that send a body whole without
  // waiting for 100 Continue (Python's http.client, the OpenAI SDKs) read
  // no answer while they are still writing (a reviewer saw broken pipes and
  // 10 s timeouts for a 17 MiB body answered at once). A POST with neither Content-Length
  // nor chunked encoding has an empty body (RFC 9112); httplib would read
  // until the client closes or its read timeout fires. Answer at once.
  s.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (std::optional<ApiError> e = framing_error(req, options_.max_body_bytes, 4 * options_.max_body_bytes)) {
      send_error_and_close(req, res, *e);
      return httplib::Server::HandlerResponse::Handled;
    }
    if (req.method != "POST" || req.has_header("Content-Length") || req.has_header("Transfer-Encoding"))
      return httplib::Server::HandlerResponse::Unhandled;
    send_error(res, invalid_request("the request body is empty (send a JSON object with a Content-Length)", {},
                                    "invalid_json"));
    return httplib::Server::HandlerResponse::Handled;
  });
  // A client that waits for "100 Continue" before sending its body gets the
  // same answer instead (httplib would say 100 and read the body first).
  s.set_expect_100_continue_handler([this](const httplib::Request& req, httplib::Response& res) {
    const std::optional<ApiError> e = framing_error(req, options_.max_body_bytes);
    if (!e) return 100;
    send_error_and_close(req, res, *e);
    return e->status;
  });
  s.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
    json models = json::array();  // one card per name, as vLLM lists them
    for (const std::string& name : model_names_)
      models.push_back(model_json(name, created_, context_length_, engine_.config().vocab_size));
    send_json(res, 200, {{"object", "list"}, {"data", std::move(models)}});
  });
  s.Get(R"(/v1/models/(.+))", [this](const httplib::Request& req, httplib::Response& res) {
    const std::string id = req.matches[1];
    if (std::find(model_names_.begin(), model_names_.end(), id) == model_names_.end()) {
      send_error(res, error_of(404, fmt::format("model '{}' is not served here (this server serves '{}')", id,
                                                fmt::join(model_names_, "', '")),
                               "invalid_request_error", "model_not_found", "model"));
      return;
    }
    send_json(res, 200, model_json(id, created_, context_length_, engine_.config().vocab_size));
  });
  s.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    std::lock_guard<std::mutex> lock(state_mutex_);
    send_json(res, draining_ ? 503 : 200, {{"status", draining_ ? "draining" : "ok"}});
  });
  s.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics_text(), "text/plain; version=0.0.4; charset=utf-8");
  });
  s.Get("/v1/kv/events", [this](const httplib::Request& req, httplib::Response& res) { handle_cache_events(req, res); });
  s.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty() || res.content_length_ > 0) return;  // a handler's own error object (maybe handed over)
    if (res.status == 404) {
      for (const Route& r : kRoutes) {
        if (req.path == r.path) {
          res.set_header("Allow", r.method);
          send_error(res, error_of(405, fmt::format("{} needs {} (got {})", r.path, r.method, req.method),
                                   "invalid_request_error", "method_not_allowed"));
          return;
        }
      }
      send_error(res, error_of(404, fmt::format("unknown route: {} {}", req.method, req.path),
                               "invalid_request_error", "unknown_route"));
    } else if (res.status == 413) {
      send_error(res, error_of(413, "the request body is too large", "invalid_request_error", "payload_too_large"));
    } else if (res.status == 414) {
      send_error(res, error_of(414, fmt::format("the request line is longer than {} bytes", CPPHTTPLIB_REQUEST_URI_MAX_LENGTH),
                               "invalid_request_error", "uri_too_long"));
    } else if (res.status == 400) {  // httplib could not parse the request
      send_error(res, error_of(400, fmt::format("malformed HTTP request: the request line, a header or a chunked body "
                                                "could not be parsed (lines are limited to {} bytes)",
                                                CPPHTTPLIB_HEADER_MAX_LENGTH),
                               "invalid_request_error", "invalid_http_request"));
    } else {
      send_error(res, error_of(res.status, fmt::format("HTTP {}", res.status),
                               res.status < 500 ? "invalid_request_error" : "server_error", {}));
    }
  });
  s.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "unknown error";
    try {
      std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    send_error(res, error_of(500, "internal error: " + what, "server_error", "internal_error"));
  });
  s.set_logger([this](const httplib::Request& req, const httplib::Response& res) {
    responses_.record(route_label(req.path), res.status);
  });
  s.set_payload_max_length(options_.max_body_bytes);
  // SO_REUSEADDR only: httplib's default also sets SO_REUSEPORT, which let a
  // second server bind a port in use and take half its connections.
  s.set_socket_options([](socket_t sock) {
    int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
  });
  s.set_tcp_nodelay(true);  // one small SSE chunk per token: send each at once
  s.set_keep_alive_timeout(options_.keep_alive_timeout_seconds);
  s.set_keep_alive_max_count(100000);
  const size_t threads = size_t(options_.http_threads);
  s.new_task_queue = [this, threads] {
    auto* pool = new ConnectionThreads(threads);  // owned by httplib
    connection_threads_ = pool;
    return pool;
  };
  // Keep-alive only while a connection thread is free (connection_threads.h).
  s.set_post_routing_handler([this](const httplib::Request&, httplib::Response& res) {
    const ConnectionThreads* pool = connection_threads_;
    if (pool && pool->saturated()) res.set_header("Connection", "close");
  });
  http_ = std::move(listener);
}

HttpServer::~HttpServer() { shutdown(0); }

int HttpServer::start() {
  if (listener_.joinable()) fail("the HTTP server is already running");
  int port = options_.port;
  if (port == 0) {
    port = http_->bind_to_any_port(options_.host);
  } else if (!http_->bind_to_port(options_.host, port)) {
    port = -1;
  }
  if (port < 0) fail("cannot listen on {}:{} (address in use or not available)", options_.host, options_.port);
  static_cast<Listener&>(*http_).set_backlog(options_.listen_backlog);
  port_ = port;
  listener_done_ = false;
  listener_ = std::thread([this] {
    http_->listen_after_bind();
    listener_done_ = true;
  });
  // httplib's stop() only reaches a server already running: a shutdown
  // right after start would leave the listener to run on, and join forever.
  while (!http_->is_running() && !listener_done_) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return port;
}

void HttpServer::shutdown(double drain_seconds) {
  std::lock_guard<std::mutex> once(shutdown_mutex_);
  if (!listener_.joinable()) return;
  const auto deadline = SteadyTime::now() + std::chrono::duration_cast<SteadyTime::duration>(
                                           std::chrono::duration<double>(std::max(0.0, drain_seconds)));
  {
    std::unique_lock<std::mutex> lock(state_mutex_);
    draining_ = true;
    auto idle = [&] { return in_flight_.empty() && active_responses_ == 0; };
    state_cv_.wait_until(lock, deadline, idle);
    // Past the deadline: cancel what still runs (repeatedly: a handler may
    // have submitted just before draining began) until every response is written.
    while (!idle()) {
      for (const auto& [ticket, id] : in_flight_)
        if (id != 0) engine_.cancel(id);
      state_cv_.wait_for(lock, std::chrono::milliseconds(options_.poll_interval_ms), idle);
    }
  }
  http_->stop();
  // Every response is written: close idle keep-alive connections now rather
  // than after their keep-alive timeout.
  ConnectionProbe::shutdown_all(port_);
  listener_.join();
}

void HttpServer::end_after_write(httplib::Response& res) {
  // httplib writes a body after the handler returns. Ending the response at
  // the handler's return would let shutdown close the connection (it shuts
  // every socket of the port once no response is active) before the bytes
  // left.
  if (res.body.empty()) {
    end_response();
    return;
  }
  release_after_write(res, [this] { end_response(); });
}

bool HttpServer::begin_response() {
  std::lock_guard<std::mutex> lock(state_mutex_);
  if (draining_) return false;
  ++active_responses_;
  return true;
}

void HttpServer::end_response() {
  std::lock_guard<std::mutex> lock(state_mutex_);
  --active_responses_;
  state_cv_.notify_all();
}

uint64_t HttpServer::begin_request() {
  std::lock_guard<std::mutex> lock(state_mutex_);
  const uint64_t ticket = next_ticket_++;
  in_flight_.emplace(ticket, 0);
  return ticket;
}

void HttpServer::set_request_id(uint64_t ticket, RequestId id) {
  std::lock_guard<std::mutex> lock(state_mutex_);
  // The final event may already have ended the ticket.
  if (auto it = in_flight_.find(ticket); it != in_flight_.end()) it->second = id;
}

void HttpServer::end_request(uint64_t ticket) {
  std::lock_guard<std::mutex> lock(state_mutex_);
  in_flight_.erase(ticket);
  state_cv_.notify_all();
}

std::string HttpServer::metrics_text() const {
  ServerMetrics m;
  m.model = model_name();
  m.kv_codec = kv_limits_.description;
  m.responses = responses_.snapshot();
  m.uptime_seconds = std::chrono::duration<double>(SteadyTime::now() - started_).count();
  {
    std::lock_guard<std::mutex> lock(state_mutex_);
    m.in_flight = int64_t(in_flight_.size());
  }
  return render_metrics(engine_.stats(), m);
}

std::optional<ApiError> HttpServer::prepare(const CompletionRequest& cr, size_t prompt, Request* r,
                                            bool* truncated) const {
  *truncated = false;
  const bool chat = cr.endpoint == Endpoint::ChatCompletions;
  const std::string param = chat ? "messages" : "prompt";
  if (chat) {
    if (!chat_template_)
      return invalid_request("this model has no vocabulary, so it cannot chat; send token ids to /v1/completions",
                             "messages", "invalid_value");
    try {
      r->prompt = chat_template_->render(cr.messages);
    } catch (const Error& e) {
      return invalid_request(e.what(), "messages", "invalid_value");
    }
  } else if (cr.prompts[prompt].is_tokens) {
    r->prompt = cr.prompts[prompt].tokens;
    if (auto e = check_token_ids(r->prompt, "", "prompt")) return e;
  } else {
    if (!tokenizer_) return invalid_request("this model has no vocabulary; send the prompt as token ids", "prompt", "invalid_value");
    r->prompt = tokenizer_->encode(cr.prompts[prompt].text, tokenizer_->add_bos_default());
  }
  if (cr.truncate_prompt_tokens != 0) {  // vLLM's: the prompt's last N tokens (BOS may go)
    const size_t keep = size_t(cr.truncate_prompt_tokens < 0 ? context_length_ : cr.truncate_prompt_tokens);
    if (r->prompt.size() > keep) {
      r->prompt.erase(r->prompt.begin(), r->prompt.end() - long(keep));
      *truncated = true;
    }
  }
  if (r->prompt.empty()) return invalid_request("the prompt has no tokens", param, "invalid_value");
  r->pin_prefix = cr.kv.pin;
  if (!cr.kv.policy.empty()) {
    // The engine checks the policy against its cache and budget (400 on error).
    // The server's own policy keeps the knobs it was started with (sinks,
    // window, scope...): a request naming it changes only the budget, if any.
    const SparsityOptions& served = engine_.options().sparsity;
    r->sparsity = served.policy == cr.kv.policy ? served : SparsityOptions{};
    r->sparsity.policy = cr.kv.policy;
    if (cr.kv.budget != 0 || served.policy != cr.kv.policy) r->sparsity.budget = cr.kv.budget;
    try {
      (void)resolve_sparsity_options(r->sparsity, engine_.cache());
    } catch (const Error& e) {
      return invalid_request(e.what(), "kv.policy", "unsupported_kv_config");
    }
  }

  const int64_t n = int64_t(r->prompt.size());
  if (n > context_length_ || (n == context_length_ && !cr.prompt_only))  // scoring a prompt needs no room after it
    return invalid_request(fmt::format("the prompt has {} tokens; this model's context length is {} tokens, and at "
                                       "least one must be left to generate",
                                       n, context_length_),
                           param, "context_length_exceeded");
  // Without max_tokens: OpenAI's 16 for completions, the rest of the context for chat.
  const int64_t room = std::min<int64_t>(context_length_, kv_capacity_tokens_) - n;
  int64_t max_tokens = cr.max_tokens;
  if (max_tokens == 0 && !cr.prompt_only) max_tokens = chat ? room : std::min<int64_t>(16, room);
  // The request's policy decides what it holds: an evicting one at most its
  // budget, sinks past the context (the engine checks the same).
  SequenceFootprint fp;
  try {
    fp = engine_.footprint(r->sparsity, n, n + std::max<int64_t>(max_tokens, cr.prompt_only ? 0 : 1));
  } catch (const Error& e) {
    if (!cr.kv.policy.empty()) return invalid_request(e.what(), "kv.policy", "unsupported_kv_config");
    // The server's default policy refused a request that named none: say
    // so, and what the client itself can change.
    return invalid_request(fmt::format("{} (the server's default KV policy '{}'; a request may lower the budget with "
                                       "'kv': {{\"policy\": \"{}\", \"budget\": N}}, or send a shorter prompt)",
                                       e.what(), engine_.options().sparsity.policy, engine_.options().sparsity.policy),
                           param, "unsupported_kv_config");
  }
  const std::string& limit_param = cr.max_tokens ? cr.max_tokens_param : param;  // the field the client sent
  if (max_tokens < (cr.prompt_only ? 0 : 1) || (n + max_tokens > context_length_ && !fp.unbounded_positions))
    return invalid_request(fmt::format("this model's context length is {} tokens; the request asks for {} prompt + "
                                       "{} completion tokens = {}",
                                       context_length_, n, max_tokens, n + max_tokens),
                           limit_param, "context_length_exceeded");
  if (fp.held_tokens > kv_capacity_tokens_)
    return invalid_request(fmt::format("the server's KV cache holds {} tokens; the request needs {} prompt + {} "
                                       "completion tokens = {}{}",
                                       kv_capacity_tokens_, n, max_tokens, n + max_tokens,
                                       fp.held_tokens < n + max_tokens
                                           ? fmt::format(", of which its KV policy keeps {}", fp.held_tokens)
                                           : ""),
                           limit_param, "context_length_exceeded");
  if (cr.min_tokens > max_tokens)
    return invalid_request(fmt::format("'min_tokens' ({}) is more than {} ({})", cr.min_tokens,
                                       cr.max_tokens ? cr.max_tokens_param : "max_tokens", max_tokens),
                           "min_tokens", "invalid_value");
  std::vector<int32_t> biased;
  for (const auto& [t, bias] : cr.sampling.logit_bias) biased.push_back(t);
  if (auto e = check_token_ids(cr.stop_token_ids, "stop ", "stop_token_ids")) return e;
  if (auto e = check_token_ids(biased, "logit_bias ", "logit_bias")) return e;
  if (auto e = check_token_ids(cr.allowed_token_ids, "allowed ", "allowed_token_ids")) return e;
  if (!cr.bad_words.empty() && !tokenizer_)
    return invalid_request("this model has no vocabulary, so it cannot read bad words", "bad_words", "invalid_value");
  r->max_tokens = int32_t(max_tokens);
  r->min_tokens = cr.min_tokens;
  r->include_stop_str = cr.include_stop_str;
  r->stop_token_ids = cr.stop_token_ids;
  r->logprobs = cr.logprobs;
  // echo with logprobs scores the prompt too; a prompt-only request needs
  // the engine's prompt pass whether or not the client reads the numbers.
  r->prompt_logprobs = (cr.echo && (cr.logprobs >= 0 || cr.prompt_only)) || cr.prompt_logprobs >= 0;
  // The engine computes the most alternatives either asks for; each list is
  // cut to its own count when reported.
  if (r->prompt_logprobs) r->logprobs = std::max({cr.logprobs, cr.prompt_logprobs, 0});
  r->sampling = cr.sampling;
  r->sampling.allowed_tokens = cr.allowed_token_ids;
  for (const std::string& word : cr.bad_words) add_bad_word(*tokenizer_, word, r->sampling.bad_words);
  if (!cr.seed_given) {
    std::lock_guard<std::mutex> lock(seed_mutex_);
    r->sampling.seed = seeds_();
  }
  r->stop = cr.stop;
  r->stop_at_eos = !cr.ignore_eos;
  return std::nullopt;
}

std::optional<AuthResult> HttpServer::authenticate(const httplib::Request& req, httplib::Response& res) const {
  const AuthResult auth = keys_.authenticate(req.get_header_value("Authorization"), options_.require_api_key);
  if (auth.status == AuthResult::Status::Ok) return auth;
  res.set_header("WWW-Authenticate", "Bearer");
  send_error(res, error_of(401,
                           auth.status == AuthResult::Status::Missing
                               ? "this server requires an API key (Authorization: Bearer KEY)"
                               : "the API key is not valid",
                           "invalid_request_error", "invalid_api_key"));
  return std::nullopt;
}

std::optional<ApiError> HttpServer::check_token_ids(std::span<const int32_t> ids, std::string_view what,
                                                    const char* param) const {
  // The parser refused negative ids; the vocabulary is the model's.
  const int32_t vocab = engine_.config().vocab_size;
  for (int32_t t : ids)
    if (t >= vocab)
      return invalid_request(fmt::format("{}token id {} is out of range (the vocabulary has {} tokens)", what, t, vocab),
                             param, "invalid_value");
  return std::nullopt;
}

bool HttpServer::check_model(const std::string& model, httplib::Response& res) const {
  if (model.empty() || std::find(model_names_.begin(), model_names_.end(), model) != model_names_.end()) return true;
  send_error(res, invalid_request(fmt::format("model '{}' is not served here; this server serves '{}' (GET /v1/models)",
                                              model, fmt::join(model_names_, "', '")),
                                  "model", "model_not_found"));
  return false;
}

std::optional<std::string> HttpServer::read_body(const httplib::Request& req, httplib::Response& res,
                                                 const httplib::ContentReader& read) const {
  // A chunked body past the cap is read on and dropped, up to a few times
  // the cap, so that the 413 reaches the client and the next request on the
  // connection starts where it should. A client sending more than that has
  // its connection shut down: what follows could be parsed as requests. (A
  // Content-Length past the cap: httplib's reader reads the body on, drops
  // it and fails, and the answer is 413 here; past 4x the cap framing_error
  // answered at once.)
  const size_t cap = options_.max_body_bytes, drain = 4 * cap;
  std::string body;
  size_t seen = 0;
  bool abandoned = false;  // stopped reading mid-body
  const bool complete = read([&](const char* data, size_t n) {
    seen += n;
    if (seen <= cap) {
      body.append(data, n);
      return true;
    }
    std::string().swap(body);
    abandoned = seen > drain;
    return !abandoned;
  });
  if (complete && seen <= cap) return body;
  if (abandoned) ConnectionProbe::find(req.remote_addr, req.remote_port, req.local_port).shut_down();
  const bool declared_past_cap = req.has_header("Content-Length") &&
                                 req.get_header_value<uint64_t>("Content-Length") > uint64_t(cap);
  if (seen > cap || declared_past_cap) {
    send_error(res, error_of(413, fmt::format("the request body is too large (limit {} bytes)", cap),
                             "invalid_request_error", "payload_too_large"));
  } else {
    send_error(res, invalid_request("the request body could not be read (truncated or malformed chunked encoding)", {},
                                    "invalid_json"));
  }
  return std::nullopt;
}

void HttpServer::handle_completion(const httplib::Request& req, const std::string& body, httplib::Response& res,
                                   Endpoint endpoint) {
  if (!begin_response()) {
    send_error(res, shutting_down());
    return;
  }
  // Until a stream's releaser takes it over, this handler ends the response
  // (once its body is written: see end_after_write).
  bool handed_over = false;
  struct EndGuard {
    HttpServer* server;
    bool* handed_over;
    httplib::Response* res;
    ~EndGuard() {
      if (!*handed_over) server->end_after_write(*res);
    }
  } guard{this, &handed_over, &res};

  const std::optional<AuthResult> auth = authenticate(req, res);
  if (!auth) return;
  const auto parsed = parse_completion_request(body, endpoint);
  const CompletionRequest* request = parsed_or_sent(parsed, res);
  if (!request || !check_model(request->model, res)) return;
  const CompletionRequest& cr = *request;
  if (auto e = check_kv_request(cr.kv, kv_limits_)) {
    send_error(res, *e);
    return;
  }
  // One engine request per prompt (chat: one) and choice.
  const size_t n_prompts = endpoint == Endpoint::ChatCompletions ? 1 : cr.prompts.size();
  std::vector<Request> prompts(n_prompts);
  std::vector<char> truncated(n_prompts, 0);
  for (size_t p = 0; p < n_prompts; ++p) {
    bool cut = false;
    std::optional<ApiError> e = prepare(cr, p, &prompts[p], &cut);
    truncated[p] = cut;
    if (e) {
      if (n_prompts > 1) e->message = fmt::format("prompt {}: {}", p, e->message);
      send_error(res, *e);
      return;
    }
    prompts[p].tenant = auth->tenant;
  }

  auto c = std::make_shared<Completion>();
  c->endpoint = endpoint;
  c->include_usage = cr.include_usage;
  c->logprobs = cr.logprobs >= 0;
  c->top_n = std::max(cr.logprobs, 0);
  c->prompt_top_n = cr.prompt_logprobs;
  c->meta.created = unix_seconds();
  c->meta.model = model_name();
  // Choice p * n + i: prompt p's i-th (vLLM's order).
  c->choices.resize(n_prompts * size_t(cr.n));
  for (size_t k = 0; k < c->choices.size(); ++k) {
    Completion::Choice& x = c->choices[k];
    const size_t p = k / size_t(cr.n);
    const std::vector<int32_t>& prompt = prompts[p].prompt;
    x.first_of_prompt = k % size_t(cr.n) == 0;
    x.prev_token = prompt.back();
    x.echo = cr.echo;
    if (cr.prompt_logprobs >= 0) x.first_prompt_token = prompt[0];
    if (!cr.echo) continue;
    if (!x.first_of_prompt) {  // the prompt's first choice has its text already
      x.echo_text = c->choices[k - k % size_t(cr.n)].echo_text;
    } else if (cr.prompts[p].is_tokens || truncated[p]) {
      // The tokens the model saw, spelled as their log-probability entries
      // spell them, so text_offset points into this text.
      if (tokenizer_)
        for (size_t t = 0; t < prompt.size(); ++t)
          x.echo_text += tokenizer_->decode_piece(t == 0 ? -1 : prompt[t - 1], prompt[t]);
    } else {
      x.echo_text = cr.prompts[p].text;
    }
    if (c->logprobs) x.prompt = prompt;
  }
  // Choice i > 0 of a seeded prompt samples with seed + i, so the choices
  // differ but repeat. All are queued together or none is.
  std::vector<Request> requests;
  std::vector<uint64_t> tickets;
  for (int32_t i = 0; i < int32_t(c->choices.size()); ++i) {
    Request ri = prompts[size_t(i / cr.n)];
    ri.sampling.seed += uint64_t(i % cr.n);
    const uint64_t ticket = begin_request();
    ri.on_event = [events = c->events, this, ticket](const RequestEvent& e) {
      events->push(e);
      if (e.finish != FinishReason::None) end_request(ticket);
    };
    requests.push_back(std::move(ri));
    tickets.push_back(ticket);
  }
  const SubmitBatchResult s = engine_.submit_all(std::move(requests));
  if (s.status != SubmitResult::Status::Accepted) {
    for (uint64_t ticket : tickets) end_request(ticket);
    if (s.status == SubmitResult::Status::Invalid) {
      send_error(res, invalid_request(s.error, {}, "invalid_request"));
    } else {
      bool draining;
      {
        std::lock_guard<std::mutex> lock(state_mutex_);
        draining = draining_;
      }
      if (draining) {
        send_error(res, shutting_down());
      } else {
        res.set_header("Retry-After", std::to_string(options_.retry_after_seconds));
        send_error(res, error_of(429, "the server is at capacity (" + s.error + "); retry later", "rate_limit_error",
                                 "queue_full"));
      }
    }
    return;
  }
  for (size_t i = 0; i < s.ids.size(); ++i) {
    set_request_id(tickets[i], s.ids[i]);
    c->choices[i].id = s.ids[i];
    c->choice_of[s.ids[i]] = i;
  }
  c->meta.id = fmt::format("{}-{}{:x}", endpoint == Endpoint::ChatCompletions ? "chatcmpl" : "cmpl", id_prefix_,
                           c->choices[0].id);
  c->probe = ConnectionProbe::find(req.remote_addr, req.remote_port, req.local_port);
  if (cr.stream) {
    respond_stream(res, c, req.version == "HTTP/1.0");
    handed_over = true;
  } else {
    respond_whole(res, c);
  }
}

std::string HttpServer::event_text(Completion& c, size_t i, const RequestEvent& e) const {
  Completion::Choice& x = c.choices[i];
  std::string text = x.utf8.push(e.text);
  if (!x.echo) return text;
  x.echo = false;  // the first event: the prompt goes first
  return x.echo_text + text;
}

void HttpServer::add_logprobs(Completion& c, size_t i, const RequestEvent& e) const {
  Completion::Choice& x = c.choices[i];
  if (c.prompt_top_n >= 0 && !e.prompt_logprobs.empty()) {
    auto piece = [&](int32_t prev, int32_t token) {
      return tokenizer_ ? tokenizer_->decode_piece(prev, token) : fmt::format("token_id:{}", token);
    };
    int32_t prev = x.first_prompt_token;
    for (const TokenLogprobs& t : e.prompt_logprobs) {
      PromptLogprob p{t.token, t.logprob, t.rank, piece(prev, t.token), {}};
      for (size_t k = 0; k < t.top.size() && k < size_t(c.prompt_top_n); ++k)
        p.top.push_back({t.top[k].first, t.top[k].second, piece(prev, t.top[k].first)});
      x.prompt_entries.push_back(std::move(p));
      prev = t.token;
    }
  }
  if (!c.logprobs) return;
  auto text = [&](int32_t token) {
    return tokenizer_ ? tokenizer_->decode_piece(x.prev_token, token) : fmt::format("token_id:{}", token);
  };
  // One token's entry, its alternatives' texts after the same predecessor.
  auto add = [&](const TokenLogprobs& t) {
    LogprobEntry entry{text(t.token), t.logprob, {}};
    for (size_t k = 0; k < t.top.size() && k < size_t(c.top_n); ++k) entry.top.emplace_back(text(t.top[k].first), t.top[k].second);
    x.prev_token = t.token;
    x.pending.push_back(std::move(entry));
  };
  if (!x.prompt.empty()) {  // echo: the prompt's entries, the first unscored
    x.prev_token = -1;
    x.pending.push_back({text(x.prompt[0]), 0, {}, false});
    x.prev_token = x.prompt[0];
    for (const TokenLogprobs& p : e.prompt_logprobs) add(p);
    x.prompt.clear();
  }
  if (e.logprobs) add(*e.logprobs);
}

json HttpServer::take_logprobs(Completion& c, size_t i) const {
  if (!c.logprobs) return nullptr;
  Completion::Choice& x = c.choices[i];
  json j = logprobs_json(c.endpoint, x.pending, x.text_offset);
  for (const LogprobEntry& e : x.pending) x.text_offset += text_characters(e.token);
  x.pending.clear();
  return j;
}

void HttpServer::cancel_unfinished(const Completion& c) {
  for (const Completion::Choice& x : c.choices)
    if (!x.finished) engine_.cancel(x.id);
}

void HttpServer::respond_whole(httplib::Response& res, std::shared_ptr<Completion> c) {
  std::vector<RequestEvent> events;
  const Completion::Choice* failed = nullptr;
  while (!c->finished) {
    if (c->probe.closed()) {
      // Nobody is left to answer: free the sequences. 499 (nginx's "client
      // closed request") is what the metrics record.
      cancel_unfinished(*c);
      res.status = 499;
      return;
    }
    events.clear();
    if (!c->events->pop_all(&events, std::chrono::milliseconds(options_.poll_interval_ms))) continue;
    for (RequestEvent& e : events) {
      const size_t i = c->choice_of.at(e.id);
      Completion::Choice& x = c->choices[i];
      x.text += event_text(*c, i, e);
      add_logprobs(*c, i, e);
      if (e.finish == FinishReason::None) continue;
      x.text += x.utf8.finish();
      x.finished = true;
      x.last = std::move(e);
      if (x.last.finish != FinishReason::Stop && x.last.finish != FinishReason::Length && !failed) failed = &x;
    }
    c->finished = failed || c->all_finished();
  }
  if (failed) {
    // The response is an error whatever the other choices make: stop them
    // now, as the streamed path does, instead of letting them run out.
    cancel_unfinished(*c);
    send_error(res, finish_error(failed->last));
    return;
  }
  json choices = json::array();
  for (size_t i = 0; i < c->choices.size(); ++i) {
    Completion::Choice& x = c->choices[i];
    choices.push_back(choice_json(c->endpoint, int(i), x.text, client_finish_reason(x.last.finish), take_logprobs(*c, i)));
    // vLLM's places: on each completion choice, once at the top of a chat.
    if (c->prompt_top_n >= 0 && c->endpoint == Endpoint::Completions)
      choices.back()["prompt_logprobs"] = prompt_logprobs_json(x.prompt_entries);
  }
  json response = completion_response(c->endpoint, c->meta, std::move(choices), c->usage());
  if (c->prompt_top_n >= 0 && c->endpoint == Endpoint::ChatCompletions)
    response["prompt_logprobs"] = prompt_logprobs_json(c->choices[0].prompt_entries);
  send_json(res, 200, response);
}

bool HttpServer::stream_step(Completion& c, std::string* out) {
  std::vector<RequestEvent> events;
  if (!c.events->pop_all(&events, std::chrono::milliseconds(options_.poll_interval_ms))) return false;
  const bool usage_null = c.include_usage;
  // A token's log-probabilities ride on the next chunk of its choice with
  // text (text held back for a stop string or an incomplete character comes
  // later), the rest on the choice's finish chunk.
  for (const RequestEvent& e : events) {
    if (c.finished) break;  // a choice failed: the stream has ended
    const size_t i = c.choice_of.at(e.id);
    const int index = int(i);
    Completion::Choice& x = c.choices[i];
    std::string text = event_text(c, i, e);
    add_logprobs(c, i, e);
    if (e.finish == FinishReason::None) {
      if (!text.empty())
        *out += sse_event(completion_chunk(c.endpoint, c.meta, text, {}, false, usage_null, take_logprobs(c, i), index));
      continue;
    }
    text += x.utf8.finish();
    x.finished = true;
    x.last = e;
    if (!text.empty())
      *out += sse_event(completion_chunk(c.endpoint, c.meta, text, {}, false, usage_null, take_logprobs(c, i), index));
    if (e.finish != FinishReason::Stop && e.finish != FinishReason::Length) {
      *out += sse_event(error_json(finish_error(e)));
      *out += kSseDone;
      cancel_unfinished(c);
      c.finished = true;
      break;
    }
    const json rest = x.pending.empty() ? json(nullptr) : take_logprobs(c, i);
    *out += sse_event(
        completion_chunk(c.endpoint, c.meta, "", client_finish_reason(e.finish), false, usage_null, rest, index));
    if (c.all_finished()) {
      if (c.include_usage) *out += sse_event(usage_chunk(c.endpoint, c.meta, c.usage()));
      *out += kSseDone;
      c.finished = true;
    }
  }
  return true;
}

void HttpServer::respond_stream(httplib::Response& res, std::shared_ptr<Completion> c, bool close_delimited) {
  res.status = 200;
  res.set_header("Cache-Control", "no-cache");
  auto provider = [this, c](size_t, httplib::DataSink& sink) {
    std::string out;
    if (!c->started) {
      c->started = true;
      // Chat's first chunk names the role, at once (clients see the stream open).
      if (c->endpoint == Endpoint::ChatCompletions)
        for (size_t i = 0; i < c->choices.size(); ++i)
          out += sse_event(completion_chunk(c->endpoint, c->meta, "", {}, true, c->include_usage, nullptr, int(i)));
    } else if (c->probe.closed()) {
      return false;  // the releaser cancels the request
    } else if (!stream_step(*c, &out) &&
               SteadyTime::now() - c->last_write > std::chrono::milliseconds(options_.heartbeat_ms)) {
      out = ": keep-alive\n\n";
    }
    if (!out.empty()) {
      if (!sink.write(out.data(), out.size())) return false;
      c->last_write = SteadyTime::now();
    }
    if (c->finished) sink.done();
    return true;
  };
  auto release = [this, c, close_delimited](bool) {
    if (!c->finished) cancel_unfinished(*c);
    if (close_delimited) c->probe.shut_down();  // the end of the body (httplib would keep a keep-alive one open)
    end_response();
  };
  if (close_delimited) {
    // HTTP/1.0 has no chunked encoding: the body ends where the connection does.
    res.set_header("Connection", "close");
    res.set_content_provider("text/event-stream", provider, release);
  } else {
    res.set_chunked_content_provider("text/event-stream", provider, release);
  }
}

}  // namespace kvserve
