// The OpenAI-compatible HTTP server around an Engine.
//
//   POST /v1/completions, POST /v1/chat/completions   (stream true: server-sent events)
//   GET  /v1/models, /v1/models/{id}, /health, /metrics
//
// Each completion request is parsed and validated (openai_protocol,
// kv_request), turned into prompt tokens (the tokenizer, or the chat
// template), and submitted to the engine. The engine's events reach the HTTP
// thread serving the request through an EventQueue; a streaming response is a
// chunked content provider that writes one SSE chunk per event. A client that
// goes away (a failed write, or end-of-file seen by the ConnectionProbe while
// waiting) cancels its request, so its KV blocks return to the pool.
//
// Status codes: 400 for every client mistake (OpenAI error object), 401 bad or
// missing API key, 404 unknown route or model id, 405 wrong method, 413 body
// too large, 414 request line too long, 429 waiting queue full (with
// Retry-After), 501 a transfer coding other than chunked, 503 while shutting
// down; 500 only for failures inside the engine. Unsound body framing
// (http_framing.h) closes the connection after the answer.
//
// Shutdown (shutdown()): new completion requests get 503 and /health reports
// "draining"; running requests finish until the drain deadline, then those
// left are cancelled (a stream ends with an error event, a non-streamed
// request gets 503); when every response is written, the listener stops and
// idle keep-alive connections are closed.
//
// Thread safety: start() once; shutdown() from any thread, once or more.
// REQUIRES: the engine runs (Engine::start, or someone stepping it) until
// shutdown() returns, and outlives the server.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <thread>

#include "engine/engine.h"
#include "server/api_keys.h"
#include "server/chat_template.h"
#include "server/kv_request.h"
#include "server/metrics.h"
#include "server/openai_protocol.h"

namespace httplib {
class Server;
struct Request;
struct Response;
class ContentReader;
}  // namespace httplib

namespace kvserve {

class ConnectionThreads;

struct HttpServerOptions {
  std::string host = "127.0.0.1";
  int port = 8080;                      // 0 = any free port (start() returns it)
  std::string served_model_name;        // empty = the model file's name without its extension
  std::vector<std::string> served_model_aliases;  // other names requests may use (vLLM's --served-model-name
                                                  // A B ...); responses carry served_model_name
  std::string chat_template;            // chat format name; empty = from the GGUF, else plain
  bool require_api_key = false;         // with keys loaded: a request without a key gets 401
  std::string kv_events_admin;          // with keys: the tenant (of some key, not the default one) whose
                                        // keys read every tenant's GET /v1/kv/events, as a KV-aware
                                        // router must; empty = none: each key reads its own tenant's
                                        // events and the shared scope's
  int http_threads = 0;                 // connection threads (a streaming request holds one;
                                        // keep-alive only while one is free);
                                        // 0 = max_num_seqs + max_waiting + 16
  int retry_after_seconds = 1;          // Retry-After of a 429
  int poll_interval_ms = 50;            // how often a handler waiting for tokens checks its client
  int heartbeat_ms = 5000;              // an SSE comment after this long without output
  int keep_alive_timeout_seconds = 5;   // idle keep-alive connections close after this
  int listen_backlog = 1024;            // pending connections the kernel queues
  size_t max_body_bytes = 16u << 20;    // larger request bodies get 413
};

class HttpServer {
 public:
  // `engine_options` are the ones the engine was built with (for the default
  // thread count). Throws kvserve::Error for a bad chat template name.
  HttpServer(Engine& engine, const EngineOptions& engine_options, ApiKeys keys, HttpServerOptions options);
  ~HttpServer();  // shutdown(0) when still serving
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds and serves on background threads; returns the port. Throws
  // kvserve::Error when the address cannot be bound.
  int start();
  // Drains for up to drain_seconds, cancels what is left, stops listening.
  void shutdown(double drain_seconds);

  const std::string& model_name() const { return model_names_.front(); }  // the name responses carry
  // Null when the model has no vocabulary (then only token-id prompts work).
  const ChatTemplate* chat_template() const { return chat_template_ ? &*chat_template_ : nullptr; }
  std::string metrics_text() const;

 private:
  struct Completion;

  // The body of a POST, at most max_body_bytes; nullopt after sending the
  // 413 (or the 400 for a body that could not be read).
  std::optional<std::string> read_body(const httplib::Request& req, httplib::Response& res,
                                       const httplib::ContentReader& read) const;
  void handle_completion(const httplib::Request& req, const std::string& body, httplib::Response& res,
                         Endpoint endpoint);
  // POST /tokenize and /detokenize (vLLM's): text or a chat to token ids, and back.
  void handle_tokenize(const httplib::Request& req, const std::string& body, httplib::Response& res);
  void handle_detokenize(const httplib::Request& req, const std::string& body, httplib::Response& res);
  // The caller's API key, or nullopt after sending the 401.
  std::optional<AuthResult> authenticate(const httplib::Request& req, httplib::Response& res) const;
  // The 400 for the first id past the vocabulary ("{what}token id N is out
  // of range ..."), naming `param`.
  std::optional<ApiError> check_token_ids(std::span<const int32_t> ids, std::string_view what, const char* param) const;
  // Whether model (empty: not given) is one of the served names; false after
  // sending the 400 model_not_found.
  bool check_model(const std::string& model, httplib::Response& res) const;
  // GET /v1/kv/events?after=SEQ&limit=N: the engine's logged prefix-cache
  // events of the caller's tenant and of the shared scope (every tenant's
  // for the kv_events_admin).
  void handle_cache_events(const httplib::Request& req, httplib::Response& res);
  // The engine request for prompt `prompt` of a parsed request (chat: its
  // messages), or the 400.
  // *truncated: truncate_prompt_tokens cut the prompt.
  std::optional<ApiError> prepare(const CompletionRequest& cr, size_t prompt, Request* out, bool* truncated) const;
  void respond_whole(httplib::Response& res, std::shared_ptr<Completion> c);
  // close_delimited: an HTTP/1.0 client; the body ends when the connection
  // closes, since HTTP/1.0 has no chunked encoding.
  void respond_stream(httplib::Response& res, std::shared_ptr<Completion> c, bool close_delimited);
  bool stream_step(Completion& c, std::string* out);  // true when the last event was written into *out
  // The text an event of choice i adds (the echoed prompt first, on its first).
  std::string event_text(Completion& c, size_t i, const RequestEvent& e) const;
  // Turns an event's token log-probabilities into text entries of choice i.
  void add_logprobs(Completion& c, size_t i, const RequestEvent& e) const;
  // Choice i's "logprobs" for its pending entries (null when not asked for); clears them.
  nlohmann::json take_logprobs(Completion& c, size_t i) const;
  void cancel_unfinished(const Completion& c);

  // Bookkeeping for a graceful shutdown.
  bool begin_response();                              // false while draining
  void end_response();
  // end_response once httplib has written res's body (now when it has none).
  void end_after_write(httplib::Response& res);
  uint64_t begin_request();                           // a ticket for one submitted request
  void set_request_id(uint64_t ticket, RequestId id);
  void end_request(uint64_t ticket);

  Engine& engine_;
  bool cache_events_ = false;               // the engine logs prefix-cache events
  BlockHashAlgo key_hash_ = BlockHashAlgo::Xxh3_128;  // how event keys print
  ApiKeys keys_;
  HttpServerOptions options_;
  std::vector<std::string> model_names_;  // the served name, then the aliases: every name a request may use
  int32_t context_length_ = 0;
  int64_t kv_capacity_tokens_ = 0;
  const Tokenizer* tokenizer_ = nullptr;
  std::optional<ChatTemplate> chat_template_;
  KvRequestLimits kv_limits_;
  std::string id_prefix_;                 // random per server run, so response ids do not repeat
  int64_t created_ = 0;                   // Unix seconds at start-up
  std::chrono::steady_clock::time_point started_;
  std::unique_ptr<httplib::Server> http_;
  std::thread listener_;
  std::atomic<bool> listener_done_{false};  // listen_after_bind returned
  int port_ = 0;                          // the bound port, once started
  // httplib's connection threads (httplib owns them); set when listening starts.
  std::atomic<const ConnectionThreads*> connection_threads_{nullptr};
  ResponseCounter responses_;

  mutable std::mutex seed_mutex_;         // guards seeds_
  mutable std::mt19937_64 seeds_;         // sampling seeds for requests that give none

  mutable std::mutex state_mutex_;        // guards draining_, active_responses_, in_flight_, next_ticket_
  std::condition_variable state_cv_;
  bool draining_ = false;
  int64_t active_responses_ = 0;          // completion responses not yet fully written
  std::map<uint64_t, RequestId> in_flight_;  // ticket -> engine id (0 until known), until the final event
  uint64_t next_ticket_ = 1;

  std::mutex shutdown_mutex_;             // serializes shutdown()
};

}  // namespace kvserve
