// The HTTP server on the real model, over real loopback HTTP: outputs at
// temperature 0 equal `kvserve generate` (the llama2.c reference) and the
// engine's greedy outputs, streamed or not, for completions and chat; every
// client mistake gets its OpenAI-style 400/401/404/405; a full queue gets 429
// with Retry-After and no request is lost; a client that disconnects cancels
// its sequence and the blocks come back; shutdown drains, then cancels.
//
// Tests that need exact timing drive the engine by hand (Engine::step from a
// stepper the test can pause), so they do not depend on the machine's speed.
#include "server/http_server.h"

#include <gtest/gtest.h>
#include <httplib.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <latch>
#include <set>
#include <thread>

#include "engine/generator.h"
#include "reference_logits.h"
#include "test_support.h"

namespace kvserve {
namespace {

using json = nlohmann::json;
using testing_files::kStoriesGguf;

const std::string kReference = KVSERVE_SHARED_DIR "/data/reference/stories260K_greedy_once_upon_a_time_256.txt";

// What one HTTP exchange returned; for streams, the parsed SSE data lines.
struct Reply {
  int status = 0;
  json body;                     // non-streamed JSON body
  std::vector<json> chunks;      // streamed "data: {...}" objects
  bool done = false;             // "data: [DONE]" seen last
  std::string retry_after;
  std::string content_encoding;
  std::string raw;
};

// Splits a server-sent-event body into its data objects.
void parse_sse(Reply& r) {
  size_t pos = 0;
  while (pos < r.raw.size()) {
    const size_t end = r.raw.find("\n\n", pos);
    if (end == std::string::npos) break;
    const std::string event = r.raw.substr(pos, end - pos);
    pos = end + 2;
    if (event.rfind(":", 0) == 0) continue;  // comment (keep-alive)
    ASSERT_EQ(event.rfind("data: ", 0), 0u) << event;
    EXPECT_FALSE(r.done) << "data after [DONE]";
    const std::string data = event.substr(6);
    if (data == "[DONE]") {
      r.done = true;
    } else {
      r.chunks.push_back(json::parse(data));
    }
  }
  EXPECT_EQ(pos, r.raw.size()) << "incomplete event at the end";
}

// The text of a stream's chunks (completions or chat deltas).
std::string stream_text(const Reply& r) {
  std::string text;
  for (const json& c : r.chunks) {
    if (!c.contains("choices") || c["choices"].empty()) continue;
    const json& ch = c["choices"][0];
    if (ch.contains("text")) text += ch["text"].get<std::string>();
    if (ch.contains("delta") && ch["delta"].contains("content")) text += ch["delta"]["content"].get<std::string>();
  }
  return text;
}

// A raw client connection to 127.0.0.1:port, for what httplib's client
// will not send (chunked bodies of any size, no length at all).
class RawConnection {
 public:
  explicit RawConnection(int port, int timeout_s) : fd_(::socket(AF_INET, SOCK_STREAM, 0)) {
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(uint16_t(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::connect(fd_, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0);
    timeval tv{timeout_s, 0};
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  }
  ~RawConnection() { ::close(fd_); }
  // Sends until done or the server shuts the connection.
  void send(const std::string& bytes) {
    for (size_t sent = 0; sent < bytes.size();) {
      const ssize_t n = ::send(fd_, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) return;
      sent += size_t(n);
    }
  }
  // One response (headers and a Content-Length body), or what came before
  // the connection closed or the timeout passed.
  std::string response() {
    std::string out;
    char buf[4096];
    for (;;) {
      const size_t head = out.find("\r\n\r\n");
      if (head != std::string::npos) {
        const size_t at = out.find("Content-Length: ");
        const size_t length = at < head ? std::stoul(out.substr(at + 16)) : 0;
        if (out.size() >= head + 4 + length) return out;
      }
      const ssize_t n = ::recv(fd_, buf, sizeof(buf), 0);
      if (n <= 0) return out;
      out.append(buf, size_t(n));
    }
  }
  // Everything until the server closes the connection or the timeout
  // passes; *closed: the server closed it.
  std::string until_close(bool* closed) {
    std::string out;
    char buf[4096];
    for (;;) {
      const ssize_t n = ::recv(fd_, buf, sizeof(buf), 0);
      *closed = n == 0 || (n < 0 && errno == ECONNRESET);
      if (n <= 0) return out;
      out.append(buf, size_t(n));
    }
  }

 private:
  int fd_;
};

class HttpServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { model_ = Model::load(kStoriesGguf).release(); }
  static void TearDownTestSuite() {
    delete model_;
    model_ = nullptr;
  }

  // An engine (free-running, or stepped by hand when manual) and a server on a free port.
  void start(EngineOptions eo = {}, HttpServerOptions ho = {}, ApiKeys keys = {}, bool manual = false) {
    eo.threads = 1;
    if (eo.kv.num_blocks == 0 && eo.kv.budget_bytes == 0) eo.kv.num_blocks = 512;
    engine_options_ = eo;
    engine_ = std::make_unique<Engine>(*model_, eo);
    ho.port = 0;
    ho.poll_interval_ms = 10;
    server_ = std::make_unique<HttpServer>(*engine_, eo, std::move(keys), ho);
    manual_ = manual;
    if (manual) {
      paused_ = true;
      stepper_ = std::thread([this] {
        while (!stop_stepper_) {
          bool worked = false;
          if (!paused_) {
            std::lock_guard<std::mutex> lock(step_mutex_);
            worked = engine_->step();
          }
          if (!worked) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
      });
    } else {
      engine_->start();
    }
    port_ = server_->start();
  }

  void TearDown() override {
    if (!server_) return;
    paused_ = false;  // shutdown needs the engine to run
    server_->shutdown(0);
    if (manual_) {
      stop_stepper_ = true;
      stepper_.join();
    } else {
      engine_->shutdown(false);
    }
  }

  // One engine step while the stepper is paused.
  bool step() {
    std::lock_guard<std::mutex> lock(step_mutex_);
    return engine_->step();
  }
  // Steps (paused stepper) until pred() holds; false after ~10 s.
  template <class Pred>
  bool step_until(Pred pred) {
    for (int i = 0; i < 2000; ++i) {
      if (pred()) return true;
      step();
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return pred();
  }

  // The engine publishes its stats after the step whose events completed the
  // responses, so a client may see a response first: wait for `pred`.
  template <class Pred>
  EngineStats stats_when(Pred pred) const {
    for (int i = 0; i < 500 && !pred(engine_->stats()); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    EngineStats s = engine_->stats();
    EXPECT_TRUE(pred(s)) << "the engine's stats never settled";
    return s;
  }

  httplib::Client client(int read_timeout_s = 30) const {
    httplib::Client c("127.0.0.1", port_);
    c.set_read_timeout(read_timeout_s, 0);
    return c;
  }

  // POST with the body streamed into Reply::raw; stream replies are parsed as SSE.
  // stop_after_chunks > 0: the client hangs up after that many data events.
  Reply post(const std::string& path, const json& body, const httplib::Headers& headers = {},
             int stop_after_chunks = 0, int read_timeout_s = 30) const {
    return post_raw(path, body.dump(), headers, stop_after_chunks, read_timeout_s);
  }
  Reply post_raw(const std::string& path, const std::string& body, const httplib::Headers& headers = {},
                 int stop_after_chunks = 0, int read_timeout_s = 30) const {
    httplib::Client c = client(read_timeout_s);
    Reply r;
    httplib::Request req;
    req.method = "POST";
    req.path = path;
    req.headers = headers;
    req.body = body;
    req.set_header("Content-Type", "application/json");
    std::string content_type;
    req.response_handler = [&](const httplib::Response& res) {
      r.status = res.status;
      r.retry_after = res.get_header_value("Retry-After");
      r.content_encoding = res.get_header_value("Content-Encoding");
      content_type = res.get_header_value("Content-Type");
      return true;
    };
    req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
      r.raw.append(data, n);
      if (stop_after_chunks > 0) {
        size_t events = 0;
        for (size_t p = r.raw.find("data: "); p != std::string::npos; p = r.raw.find("data: ", p + 1)) ++events;
        if (int(events) >= stop_after_chunks) return false;
      }
      return true;
    };
    httplib::Response res;
    httplib::Error err = httplib::Error::Success;
    c.send(req, res, err);
    if (stop_after_chunks > 0 || err == httplib::Error::Read) return r;  // hung up, or timed out
    EXPECT_EQ(err, httplib::Error::Success) << httplib::to_string(err);
    if (content_type.rfind("text/event-stream", 0) == 0) {
      parse_sse(r);
    } else if (!r.raw.empty()) {
      r.body = json::parse(r.raw);
    }
    return r;
  }

  Reply get(const std::string& path, const httplib::Headers& headers = {}) const {
    httplib::Client c = client();
    auto res = c.Get(path, headers);
    Reply r;
    if (!res) return r;
    r.status = res->status;
    r.raw = res->body;
    if (res->get_header_value("Content-Type") == "application/json") r.body = json::parse(res->body);
    return r;
  }

  // Greedy text and token count generate() produces for `prompt` and max_tokens new tokens.
  // The prompt and then the tokens a greedy run generates after it.
  std::vector<int32_t> greedy_tokens(const std::vector<int32_t>& prompt, int32_t max_tokens) const {
    ThreadPool pool(1);
    KvCacheOptions o;
    KvCache cache(model_->config(), o);
    Transformer tf(*model_, pool);
    const Tokenizer& tok = model_->require_tokenizer();
    GenerateOptions g;
    g.max_tokens = int32_t(prompt.size()) + max_tokens - 1;  // positions, as llama2.c counts them
    g.sampling.temperature = 0;
    return generate(tf, cache, prompt, g, [](int32_t, int32_t) {}, tok.bos_id(), tok.eos_id()).tokens;
  }
  std::pair<std::string, int32_t> greedy(const std::vector<int32_t>& prompt, int32_t max_tokens) const {
    const std::vector<int32_t> all = greedy_tokens(prompt, max_tokens);
    const Tokenizer& tok = model_->require_tokenizer();
    std::string text;
    for (size_t k = prompt.size(); k < all.size(); ++k) text += tok.decode_piece(all[k - 1], all[k]);
    return {text, int32_t(all.size() - prompt.size())};
  }
  std::vector<int32_t> encode(const std::string& text) const {
    const Tokenizer& tok = model_->require_tokenizer();
    return tok.encode(text, tok.add_bos_default());
  }

  json completion(const std::string& prompt, int32_t max_tokens, bool stream = false) const {
    json b = {{"model", "stories260K"}, {"prompt", prompt}, {"max_tokens", max_tokens}, {"temperature", 0}};
    if (stream) b["stream"] = true;
    return b;
  }

  static Model* model_;
  std::unique_ptr<Engine> engine_;
  EngineOptions engine_options_;
  std::unique_ptr<HttpServer> server_;
  int port_ = 0;
  bool manual_ = false;
  std::thread stepper_;
  std::mutex step_mutex_;
  std::atomic<bool> paused_{false};
  std::atomic<bool> stop_stepper_{false};
};

Model* HttpServerTest::model_ = nullptr;

const std::vector<std::string> kPrompts = {"Once upon a time", "Lily had a red ball", "The sun was hot. Tom",
                                           "One day, a little bird", "There was a big tree", "A cat"};

TEST_F(HttpServerTest, CompletionAtTemperatureZeroEqualsGenerateReference) {
  start();
  // kvserve generate --max-tokens 256 runs 256 positions: 5 prompt tokens
  // (BOS included), so 252 generated tokens; it prints the prompt first and a
  // newline last.
  std::string want = testing_files::read_all(kReference);
  ASSERT_EQ(want.rfind("Once upon a time", 0), 0u);
  want = want.substr(16, want.size() - 17);
  const Reply r = post("/v1/completions", completion("Once upon a time", 252));
  ASSERT_EQ(r.status, 200) << r.raw;
  EXPECT_EQ(r.body["object"], "text_completion");
  EXPECT_EQ(r.body["model"], "stories260K");
  EXPECT_EQ(r.body["choices"][0]["text"], want);
  EXPECT_EQ(r.body["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(r.body["usage"]["prompt_tokens"], 5);
  EXPECT_EQ(r.body["usage"]["completion_tokens"], 252);
  EXPECT_EQ(r.body["usage"]["total_tokens"], 257);
  EXPECT_EQ(r.body["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  EXPECT_EQ(r.body["id"].get<std::string>().rfind("cmpl-", 0), 0u);
}

TEST_F(HttpServerTest, ConcurrentStreamedAndWholeRequestsEqualGreedyAlone) {
  EngineOptions eo;
  eo.scheduler.max_batch_prefill_tokens = 7;  // prompts arrive in chunks, mixed with decodes
  start(eo);
  std::vector<std::future<Reply>> replies;
  for (size_t i = 0; i < kPrompts.size(); ++i) {
    json body = completion(kPrompts[i], 40 + int32_t(i));
    if (i % 2) body["stream"] = true, body["stream_options"] = {{"include_usage", true}};
    replies.push_back(std::async(std::launch::async, [this, body] { return post("/v1/completions", body); }));
  }
  for (size_t i = 0; i < kPrompts.size(); ++i) {
    const Reply r = replies[i].get();
    ASSERT_EQ(r.status, 200) << r.raw;
    const std::vector<int32_t> prompt = encode(kPrompts[i]);
    const auto [want, n] = greedy(prompt, 40 + int32_t(i));
    if (i % 2 == 0) {
      EXPECT_EQ(r.body["choices"][0]["text"], want) << kPrompts[i];
      EXPECT_EQ(r.body["usage"]["completion_tokens"], n);
      continue;
    }
    EXPECT_TRUE(r.done);
    ASSERT_GE(r.chunks.size(), 3u);
    EXPECT_EQ(stream_text(r), want) << kPrompts[i];
    // The last chunk carries the usage and no choices; the one before, the finish reason.
    const json& usage = r.chunks.back();
    EXPECT_TRUE(usage["choices"].empty());
    EXPECT_EQ(usage["usage"]["prompt_tokens"], int(prompt.size()));
    EXPECT_EQ(usage["usage"]["completion_tokens"], n);
    EXPECT_EQ(r.chunks[r.chunks.size() - 2]["choices"][0]["finish_reason"], n == 40 + int32_t(i) ? "length" : "stop");
    for (size_t k = 0; k + 1 < r.chunks.size(); ++k) {
      EXPECT_TRUE(r.chunks[k]["usage"].is_null());
      EXPECT_EQ(r.chunks[k]["object"], "text_completion");
      EXPECT_EQ(r.chunks[k]["id"], usage["id"]);
    }
  }
  const EngineStats s = stats_when([](const EngineStats& s) { return s.requests_finished == int64_t(kPrompts.size()); });
  EXPECT_EQ(s.kv.blocks_used, 0);
}

TEST_F(HttpServerTest, TokenIdPromptAndStopStrings) {
  start();
  const std::vector<int32_t> prompt = encode("Once upon a time");
  const auto [greedy_text, n] = greedy(prompt, 60);
  json body = {{"model", "stories260K"}, {"prompt", prompt}, {"max_tokens", 60}, {"temperature", 0}};
  Reply r = post("/v1/completions", body);
  ASSERT_EQ(r.status, 200) << r.raw;
  EXPECT_EQ(r.body["choices"][0]["text"], greedy_text);
  // A stop string ends the text before it, streamed or not.
  const size_t cut = greedy_text.find("Lily");
  ASSERT_NE(cut, std::string::npos);
  body["stop"] = json::array({"Lily", "never appears"});
  r = post("/v1/completions", body);
  ASSERT_EQ(r.status, 200) << r.raw;
  EXPECT_EQ(r.body["choices"][0]["text"], greedy_text.substr(0, cut));
  EXPECT_EQ(r.body["choices"][0]["finish_reason"], "stop");
  body["stream"] = true;
  r = post("/v1/completions", body);
  EXPECT_EQ(stream_text(r), greedy_text.substr(0, cut));
  EXPECT_EQ(r.chunks.back()["choices"][0]["finish_reason"], "stop");

  // vLLM's sampling extensions reach the engine: a stop token id ends the
  // text at it (and counts as a completion token); a logit bias of -100 on
  // the greedy first token makes the text start otherwise.
  const Tokenizer& tok = model_->require_tokenizer();
  const std::vector<int32_t> lily = tok.encode("Lily", false);
  body = {{"model", "stories260K"}, {"prompt", prompt}, {"max_tokens", 60}, {"temperature", 0},
          {"stop_token_ids", {lily[0]}}};
  r = post("/v1/completions", body);
  ASSERT_EQ(r.status, 200) << r.raw;
  EXPECT_EQ(r.body["choices"][0]["finish_reason"], "stop");
  const std::string stopped = r.body["choices"][0]["text"];
  EXPECT_EQ(stopped, greedy_text.substr(0, stopped.size()));
  EXPECT_LE(stopped.size(), cut);
  ThreadPool pool(1);
  KvCache cache(model_->config(), KvCacheOptions{});
  Transformer tf(*model_, pool);
  GenerateOptions g;
  g.max_tokens = int32_t(prompt.size());  // one generated token
  g.sampling.temperature = 0;
  const int32_t first = generate(tf, cache, prompt, g, [](int32_t, int32_t) {}, tok.bos_id(), tok.eos_id()).tokens.back();
  body.erase("stop_token_ids");
  body["max_tokens"] = 4;
  body["logit_bias"] = {{std::to_string(first), -100}};
  r = post("/v1/completions", body);
  ASSERT_EQ(r.status, 200) << r.raw;
  EXPECT_NE(r.body["choices"][0]["text"], greedy_text.substr(0, r.body["choices"][0]["text"].get<std::string>().size()));
}

// Log-probabilities: one entry per generated token whose texts make up the
// text, the greedy token the most likely, streamed entries equal to whole
// ones; chat's entries carry bytes and top_logprobs alternatives.
TEST_F(HttpServerTest, LogprobsDescribeEveryGeneratedToken) {
  start();
  json body = completion("Once upon a time", 12);
  body["logprobs"] = 3;
  const Reply whole = post("/v1/completions", body);
  ASSERT_EQ(whole.status, 200) << whole.raw;
  const json& choice = whole.body["choices"][0];
  const json& lp = choice["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), 12u) << lp;
  std::string joined;
  for (size_t k = 0; k < 12; ++k) {
    EXPECT_EQ(lp["text_offset"][k], joined.size());
    joined += lp["tokens"][k].get<std::string>();
    const float sampled = lp["token_logprobs"][k];
    EXPECT_LE(sampled, 0.0f);
    const json& top = lp["top_logprobs"][k];
    EXPECT_GE(top.size(), 3u);
    EXPECT_LE(top.size(), 4u);
    for (const auto& [text, value] : top.items()) EXPECT_LE(value.get<float>(), sampled) << "greedy is the most likely";
    EXPECT_EQ(top[lp["tokens"][k].get<std::string>()], sampled);
  }
  EXPECT_EQ(joined, choice["text"]);
  // Streamed: the same entries, spread over the chunks.
  body["stream"] = true;
  const Reply streamed = post("/v1/completions", body);
  json tokens = json::array(), values = json::array();
  for (const json& c : streamed.chunks) {
    const json& l = c["choices"][0]["logprobs"];
    if (l.is_null()) continue;
    for (const json& t : l["tokens"]) tokens.push_back(t);
    for (const json& v : l["token_logprobs"]) values.push_back(v);
  }
  EXPECT_EQ(tokens, lp["tokens"]);
  EXPECT_EQ(values, lp["token_logprobs"]);

  json chat = {{"model", "stories260K"}, {"messages", {{{"role", "user"}, {"content", "Tell me a story"}}}},
               {"max_tokens", 5}, {"temperature", 0}, {"logprobs", true}, {"top_logprobs", 2}};
  const Reply c = post("/v1/chat/completions", chat);
  ASSERT_EQ(c.status, 200) << c.raw;
  const json& content = c.body["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), 5u);
  std::string text;
  for (const json& e : content) {
    text += e["token"].get<std::string>();
    EXPECT_EQ(e["bytes"].size(), e["token"].get<std::string>().size());
    ASSERT_EQ(e["top_logprobs"].size(), 2u);
    EXPECT_EQ(e["top_logprobs"][0]["token"], e["token"]);  // greedy: the most likely
    EXPECT_EQ(e["top_logprobs"][0]["logprob"], e["logprob"]);
  }
  EXPECT_EQ(text, c.body["choices"][0]["message"]["content"]);
  // Not asked for: null.
  EXPECT_TRUE(post("/v1/completions", completion("Once", 2)).body["choices"][0]["logprobs"].is_null());
}

// A generation that ends on an end token (EOS) has no logprobs entry for it,
// streamed or not (README: the end token counts in completion_tokens but adds
// no text and no entry), and one cut by a stop string keeps the entry of the
// token that matched: streamed entries equal whole ones in both endpoints.
TEST_F(HttpServerTest, StreamedAndWholeLogprobsAgreeAtTheEnd) {
  start();
  auto entries = [](const json& logprobs, bool chat) {
    json out = json::array();
    if (logprobs.is_null()) return out;
    if (chat) {
      for (const json& e : logprobs["content"]) out.push_back({e["token"], e["logprob"]});
    } else {
      for (size_t k = 0; k < logprobs["tokens"].size(); ++k)
        out.push_back({logprobs["tokens"][k], logprobs["token_logprobs"][k]});
    }
    return out;
  };
  int eos_stops = 0;
  for (const bool chat : {false, true}) {
    for (const std::string& prompt : kPrompts) {
      for (const bool stop_string : {false, true}) {
        SCOPED_TRACE(prompt + (chat ? " chat" : " completion") + (stop_string ? " stop string" : ""));
        json body = completion(prompt, 250);
        if (chat) {
          body.erase("prompt");
          body["messages"] = {{{"role", "user"}, {"content", prompt}}};
          body["logprobs"] = true;
          body["top_logprobs"] = 1;
        } else {
          body["logprobs"] = 1;
        }
        if (stop_string) body["stop"] = {"."};
        const std::string path = chat ? "/v1/chat/completions" : "/v1/completions";
        const Reply whole = post(path, body);
        ASSERT_EQ(whole.status, 200) << whole.raw;
        const json& choice = whole.body["choices"][0];
        const json want = entries(choice["logprobs"], chat);
        body["stream"] = true;
        body["stream_options"] = {{"include_usage", true}};
        const Reply streamed = post(path, body);
        json got = json::array();
        for (const json& c : streamed.chunks)
          if (!c["choices"].empty())
            for (const json& e : entries(c["choices"][0]["logprobs"], chat)) got.push_back(e);
        EXPECT_EQ(got, want);
        const int completion_tokens = whole.body["usage"]["completion_tokens"];
        EXPECT_EQ(streamed.chunks.back()["usage"]["completion_tokens"], completion_tokens);
        std::string joined;
        for (const json& e : want) joined += e[0].get<std::string>();
        if (choice["finish_reason"] == "stop" && !stop_string) {
          ++eos_stops;
          EXPECT_EQ(int(want.size()), completion_tokens - 1);  // no entry for the end token
          EXPECT_EQ(joined, chat ? choice["message"]["content"] : choice["text"]);
        } else {
          EXPECT_EQ(int(want.size()), completion_tokens);
        }
      }
    }
  }
  EXPECT_GT(eos_stops, 0);  // some prompt ended on EOS
}

// echo with logprobs scores the prompt (lm-eval's loglikelihood requests):
// each prompt token after the first gets the log-softmax its prefix's logits
// give it, as a direct forward pass computes them, also when the same
// prompt was just cached; max_tokens 0 generates nothing.
TEST_F(HttpServerTest, EchoScoresThePromptTokens) {
  start();
  const std::string prompt = "Lily and Ben went to the park. They saw a big dog and a small cat.";
  const std::vector<int32_t> tokens = encode(prompt);
  // The reference: every position's logits in one pass.
  std::vector<double> want;
  const Logits logits = testing_files::every_position_logits(*model_, tokens);
  for (size_t p = 0; p + 1 < tokens.size(); ++p) {
    const float* row = logits.row(int32_t(p));
    double z = 0;
    for (int32_t v = 0; v < logits.vocab; ++v) z += std::exp(double(row[v]));
    want.push_back(double(row[tokens[p + 1]]) - std::log(z));
  }
  json body = {{"model", "stories260K"}, {"prompt", prompt}, {"max_tokens", 0}, {"echo", true}, {"logprobs", 1}};
  for (int round = 0; round < 2; ++round) {  // the second finds the prompt in the prefix cache
    const Reply r = post("/v1/completions", body);
    ASSERT_EQ(r.status, 200) << r.raw;
    const json& choice = r.body["choices"][0];
    EXPECT_EQ(choice["text"], prompt);
    EXPECT_EQ(choice["finish_reason"], "length");
    EXPECT_EQ(r.body["usage"]["completion_tokens"], 0);
    EXPECT_EQ(r.body["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    const json& lp = choice["logprobs"];
    ASSERT_EQ(lp["tokens"].size(), tokens.size());
    EXPECT_TRUE(lp["token_logprobs"][0].is_null());
    EXPECT_TRUE(lp["top_logprobs"][0].is_null());
    std::string joined;
    for (const json& t : lp["tokens"]) joined += t.get<std::string>();
    EXPECT_EQ(joined, prompt);
    for (size_t k = 1; k < tokens.size(); ++k)
      EXPECT_NEAR(lp["token_logprobs"][k].get<double>(), want[k - 1], 1e-4) << "token " << k;
  }
  // With generated tokens after the prompt, streamed: the same prompt
  // entries, then one per generated token.
  body["max_tokens"] = 3;
  body["temperature"] = 0;
  body["stream"] = true;
  const Reply s = post("/v1/completions", body);
  json values = json::array();
  for (const json& c : s.chunks)
    if (!c["choices"][0]["logprobs"].is_null())
      for (const json& v : c["choices"][0]["logprobs"]["token_logprobs"]) values.push_back(v);
  ASSERT_EQ(values.size(), tokens.size() + 3);
  for (size_t k = 1; k < tokens.size(); ++k) EXPECT_NEAR(values[k].get<double>(), want[k - 1], 1e-4);
  EXPECT_EQ(stream_text(s).rfind(prompt, 0), 0u);
  // max_tokens 0 needs echo.
  EXPECT_EQ(post("/v1/completions", completion("x", 0)).status, 400);
  // A prompt filling the whole context can be scored (lm-eval's rolling
  // windows of max_length), though no token could follow it.
  std::vector<int32_t> full(512, 400);
  full[0] = 1;
  json whole = {{"model", "stories260K"}, {"prompt", full}, {"max_tokens", 0}, {"echo", true}, {"logprobs", 0}};
  const Reply w = post("/v1/completions", whole);
  ASSERT_EQ(w.status, 200) << w.raw.substr(0, 300);
  EXPECT_EQ(w.body["choices"][0]["logprobs"]["tokens"].size(), 512u);
  whole["max_tokens"] = 1;
  EXPECT_EQ(post("/v1/completions", whole).status, 400);
}

// n choices: one sequence each, sharing the prompt's KV. Greedy choices are
// all the greedy text; seeded ones repeat (choice i samples with seed + i);
// usage counts the prompt once; streamed choices carry their index. A batch
// of prompts gets n choices each.
// vLLM's prompt_logprobs: each prompt token's log-probability and rank
// under one direct pass, with N alternatives, on each choice (chat: at the
// top); generated tokens keep their own logprobs count.
TEST_F(HttpServerTest, PromptLogprobsGiveEachPromptTokensRankAndAlternatives) {
  start();
  const std::string prompt = "Lily and Ben went to the park.";
  const std::vector<int32_t> tokens = encode(prompt);
  const Logits logits = testing_files::every_position_logits(*model_, tokens);
  json body = completion(prompt, 2);
  body["prompt_logprobs"] = 3;
  body["logprobs"] = 1;
  body["n"] = 2;
  const Reply r = post("/v1/completions", body);
  ASSERT_EQ(r.status, 200) << r.raw;
  for (const json& choice : r.body["choices"]) {
    const json& pl = choice["prompt_logprobs"];
    ASSERT_EQ(pl.size(), tokens.size());
    EXPECT_TRUE(pl[0].is_null());
    for (size_t k = 1; k < tokens.size(); ++k) {
      const float* row = logits.row(int32_t(k - 1));
      double z = 0;
      int32_t rank = 1;
      for (int32_t v = 0; v < logits.vocab; ++v) {
        z += std::exp(double(row[v]));
        rank += row[v] > row[tokens[k]];
      }
      const json& at = pl[k];
      const json& mine = at[std::to_string(tokens[k])];
      EXPECT_NEAR(mine["logprob"].get<double>(), double(row[tokens[k]]) - std::log(z), 1e-4) << k;
      EXPECT_EQ(mine["rank"], rank) << k;
      // Three alternatives (ranks 1-3), plus the prompt token when it is not one of them.
      EXPECT_EQ(at.size(), rank <= 3 ? 3u : 4u) << at.dump();
      for (const auto& [id, entry] : at.items()) EXPECT_TRUE(entry["rank"] <= 3 || id == std::to_string(tokens[k]));
    }
    for (const json& top : choice["logprobs"]["top_logprobs"]) EXPECT_LE(top.size(), 2u);  // 1 + the sampled one
  }
  // Chat: once, at the top of the response; streaming is refused (as vLLM).
  const json chat = {{"model", "stories260K"},
                     {"messages", {{{"role", "user"}, {"content", "A cat."}}}},
                     {"max_tokens", 1},
                     {"prompt_logprobs", 0}};
  const Reply c = post("/v1/chat/completions", chat);
  ASSERT_EQ(c.status, 200) << c.raw;
  const std::vector<int32_t> rendered = server_->chat_template()->render({{"user", "A cat."}});
  ASSERT_EQ(c.body["prompt_logprobs"].size(), rendered.size());
  EXPECT_EQ(c.body["prompt_logprobs"][1].size(), 1u);  // no alternatives: the prompt token alone
  EXPECT_FALSE(c.body["choices"][0].contains("prompt_logprobs"));
  body["stream"] = true;
  EXPECT_EQ(post("/v1/completions", body).status, 400);
}

TEST_F(HttpServerTest, SeveralChoicesAndPromptsPerRequest) {
  start();
  const std::vector<int32_t> prompt = encode("Once upon a time");
  const auto [greedy_text, n_greedy] = greedy(prompt, 20);
  json body = completion("Once upon a time", 20);
  body["n"] = 3;
  Reply r = post("/v1/completions", body);
  ASSERT_EQ(r.status, 200) << r.raw;
  ASSERT_EQ(r.body["choices"].size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(r.body["choices"][i]["index"], i);
    EXPECT_EQ(r.body["choices"][i]["text"], greedy_text);
  }
  EXPECT_EQ(r.body["usage"]["prompt_tokens"], int(prompt.size()));
  EXPECT_EQ(r.body["usage"]["completion_tokens"], 3 * n_greedy);

  body["temperature"] = 1.0;
  body["seed"] = 11;
  body["n"] = 4;
  const Reply a = post("/v1/completions", body);
  ASSERT_EQ(a.status, 200) << a.raw;
  std::set<std::string> texts;
  for (const json& c : a.body["choices"]) texts.insert(c["text"].get<std::string>());
  EXPECT_GT(texts.size(), 1u) << a.raw;  // the choices sample apart
  // Streamed, the same seeds give the same texts, choice by choice.
  body["stream"] = true;
  const Reply s = post("/v1/completions", body);
  std::vector<std::string> streamed(4);
  int finishes = 0;
  for (const json& c : s.chunks) {
    if (c["choices"].empty()) continue;
    const json& ch = c["choices"][0];
    streamed[ch["index"].get<size_t>()] += ch["text"].get<std::string>();
    finishes += !ch["finish_reason"].is_null();
  }
  EXPECT_EQ(finishes, 4);
  EXPECT_TRUE(s.done);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(streamed[size_t(i)], a.body["choices"][i]["text"]) << "choice " << i;

  // A batch of prompts (lm-eval sends them so), each with n choices:
  // choice p * n + i is prompt p's i-th; usage counts each prompt once.
  const std::vector<std::string> batch = {"Once upon a time", "Lily had a red ball", "A cat"};
  json b = {{"model", "stories260K"}, {"prompt", {batch[0], encode(batch[1]), batch[2]}}, {"max_tokens", 8},
            {"temperature", 0}, {"n", 2}, {"echo", true}};
  const Reply many = post("/v1/completions", b);
  ASSERT_EQ(many.status, 200) << many.raw;
  ASSERT_EQ(many.body["choices"].size(), 6u);
  int prompt_tokens = 0, completion_tokens = 0;
  for (size_t p = 0; p < batch.size(); ++p) {
    const std::vector<int32_t> tokens = encode(batch[p]);
    const auto [want, n_want] = greedy(tokens, 8);
    prompt_tokens += int(tokens.size());
    completion_tokens += 2 * n_want;
    for (size_t i = 0; i < 2; ++i) {
      const json& ch = many.body["choices"][p * 2 + i];
      EXPECT_EQ(ch["index"], p * 2 + i);
      EXPECT_EQ(ch["text"], batch[p] + want) << "prompt " << p;
    }
  }
  EXPECT_EQ(many.body["usage"]["prompt_tokens"], prompt_tokens);
  EXPECT_EQ(many.body["usage"]["completion_tokens"], completion_tokens);
  // One bad prompt refuses the batch, naming it.
  b["prompt"] = {batch[0], {1, 99999}};
  const Reply bad = post("/v1/completions", b);
  EXPECT_EQ(bad.status, 400);
  EXPECT_EQ(bad.body["error"]["message"].get<std::string>().rfind("prompt 1: ", 0), 0u) << bad.raw;
  const EngineStats st = stats_when([](const EngineStats& s) { return s.requests_finished == 17; });
  EXPECT_EQ(st.kv.blocks_used, 0);
}

// The waiting queue takes a request's choices together: on an idle server n
// up to --max-waiting is always accepted, and more is a 400 (a retry could
// never succeed) that submits nothing.
TEST_F(HttpServerTest, ChoicesFitTheWaitingQueueTogether) {
  EngineOptions eo;
  eo.max_waiting = 6;
  start(eo);
  json body = completion("Once upon a time", 4);
  body["n"] = 6;
  for (int round = 0; round < 3; ++round) {
    const Reply r = post("/v1/completions", body);
    EXPECT_EQ(r.status, 200) << r.raw;
    stats_when([&](const EngineStats& s) { return s.requests_finished == 6 * (round + 1); });
  }
  body["n"] = 7;
  const Reply r = post("/v1/completions", body);
  EXPECT_EQ(r.status, 400) << r.raw;
  EXPECT_NE(r.body["error"]["message"].get<std::string>().find("waiting queue"), std::string::npos) << r.raw;
  const EngineStats st = engine_->stats();
  EXPECT_EQ(st.requests_submitted, 18);
  EXPECT_EQ(st.finished_cancelled, 0);
}

TEST_F(HttpServerTest, ChatEqualsGreedyOnTheTemplatePrompt) {
  start();
  ASSERT_NE(server_->chat_template(), nullptr);
  EXPECT_EQ(server_->chat_template()->format(), ChatFormat::Plain);  // stories260K has no template
  const std::vector<ChatMessage> messages = {{"system", "You tell stories."}, {"user", "Tell me about a cat."}};
  const auto [want, n] = greedy(server_->chat_template()->render(messages), 30);
  json body = {{"model", "stories260K"},
               {"messages", {{{"role", "system"}, {"content", "You tell stories."}},
                             {{"role", "user"}, {"content", {{{"type", "text"}, {"text", "Tell me about a cat."}}}}}}},
               {"max_completion_tokens", 30},
               {"temperature", 0}};
  Reply r = post("/v1/chat/completions", body);
  ASSERT_EQ(r.status, 200) << r.raw;
  EXPECT_EQ(r.body["object"], "chat.completion");
  EXPECT_EQ(r.body["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(r.body["choices"][0]["message"]["content"], want);
  EXPECT_EQ(r.body["usage"]["completion_tokens"], n);
  EXPECT_EQ(r.body["id"].get<std::string>().rfind("chatcmpl-", 0), 0u);

  body["stream"] = true;
  r = post("/v1/chat/completions", body);
  ASSERT_EQ(r.status, 200);
  ASSERT_GE(r.chunks.size(), 2u);
  EXPECT_EQ(r.chunks[0]["choices"][0]["delta"]["role"], "assistant");
  EXPECT_EQ(r.chunks[0]["object"], "chat.completion.chunk");
  EXPECT_EQ(stream_text(r), want);
  EXPECT_EQ(r.chunks.back()["choices"][0]["delta"], json::object());
  EXPECT_TRUE(r.done);
}

// A conversation that comes back with the reply as it was generated (its
// leading space included) finds its first turn and that reply in the prefix
// cache, as far as the rendered reply tokenizes as the model generated it:
// the plain transcript renders the reply right after "Assistant:". (With a
// space added, the match ended at "Assistant:".)
TEST_F(HttpServerTest, AReturningChatFindsItsReplyInThePrefixCache) {
  start();
  const ChatTemplate& chat = *server_->chat_template();
  std::vector<ChatMessage> turns = {{"user", "Tell me a story about a big red ball."}};
  json body = {{"model", "stories260K"},
               {"messages", {{{"role", "user"}, {"content", turns[0].content}}}},
               {"max_tokens", 48},
               {"temperature", 0}};
  const Reply first = post("/v1/chat/completions", body);
  ASSERT_EQ(first.status, 200) << first.raw;
  const std::string reply = first.body["choices"][0]["message"]["content"];
  ASSERT_EQ(reply.rfind(' ', 0), 0u) << reply;  // SentencePiece replies begin with a space
  const size_t asked = chat.render(turns).size();
  std::vector<int32_t> ran = greedy_tokens(chat.render(turns), 48);  // the first turn's prompt and reply
  ran.pop_back();                                                   // the last token's KV is not computed
  turns.push_back({"assistant", reply});
  turns.push_back({"user", "And then?"});
  const std::vector<int32_t> resent = chat.render(turns);
  const size_t common =
      size_t(std::mismatch(ran.begin(), ran.end(), resent.begin(), resent.end()).first - ran.begin());
  EXPECT_GT(common, asked + 8) << "the reply's tokens differ from the generated ones from its first word on";
  body["messages"].push_back({{"role", "assistant"}, {"content", reply}});
  body["messages"].push_back({{"role", "user"}, {"content", "And then?"}});
  const Reply second = post("/v1/chat/completions", body);
  ASSERT_EQ(second.status, 200) << second.raw;
  const size_t block = size_t(engine_->cache().block_size());
  EXPECT_EQ(second.body["usage"]["prompt_tokens_details"]["cached_tokens"].get<size_t>(), common / block * block);
}

TEST_F(HttpServerTest, TokenizeAndDetokenizeAgreeWithTheCompletionRoutes) {
  start();
  // A prompt: the tokens a completion of it runs (its usage counts them).
  Reply r = post("/tokenize", {{"prompt", "Once upon a time"}});
  ASSERT_EQ(r.status, 200) << r.raw;
  const std::vector<int32_t> want = encode("Once upon a time");
  EXPECT_EQ(r.body["tokens"].get<std::vector<int32_t>>(), want);
  EXPECT_EQ(r.body["count"], want.size());
  EXPECT_EQ(r.body["max_model_len"], 512);
  EXPECT_FALSE(r.body.contains("token_strs"));
  Reply c = post("/v1/completions", completion("Once upon a time", 2));
  ASSERT_EQ(c.status, 200) << c.raw;
  EXPECT_EQ(c.body["usage"]["prompt_tokens"], r.body["count"]);
  // Without special tokens: no BOS; the vocabulary's pieces on request.
  r = post("/tokenize", {{"model", "stories260K"}, {"prompt", "Once upon"}, {"add_special_tokens", false},
                         {"return_token_strs", true}});
  ASSERT_EQ(r.status, 200) << r.raw;
  EXPECT_EQ(r.body["tokens"].get<std::vector<int32_t>>(), std::vector<int32_t>(want.begin() + 1, want.begin() + 3));
  EXPECT_EQ(r.body["token_strs"], json::parse(R"(["\u2581Once", "\u2581upon"])"));

  // A chat: the template's tokens, as the chat route counts them.
  const std::vector<ChatMessage> messages = {{"system", "You tell stories."}, {"user", "A cat."}};
  const json chat = {{{"role", "system"}, {"content", "You tell stories."}}, {{"role", "user"}, {"content", "A cat."}}};
  r = post("/tokenize", {{"messages", chat}});
  ASSERT_EQ(r.status, 200) << r.raw;
  EXPECT_EQ(r.body["tokens"].get<std::vector<int32_t>>(), server_->chat_template()->render(messages));
  c = post("/v1/chat/completions", {{"model", "stories260K"}, {"messages", chat}, {"max_tokens", 1}});
  ASSERT_EQ(c.status, 200) << c.raw;
  EXPECT_EQ(c.body["usage"]["prompt_tokens"], r.body["count"]);

  // Back to text: BOS drops out; no tokens, no text.
  r = post("/detokenize", {{"tokens", want}});
  ASSERT_EQ(r.status, 200) << r.raw;
  EXPECT_EQ(r.body["prompt"], "Once upon a time");
  EXPECT_EQ(post("/detokenize", {{"tokens", json::array()}}).body["prompt"], "");

  // Mistakes.
  auto refused = [&](const std::string& path, const json& body, const std::string& code, const std::string& param) {
    const Reply x = post(path, body);
    EXPECT_EQ(x.status, 400) << body.dump();
    EXPECT_EQ(x.body["error"]["code"], code) << x.raw;
    EXPECT_EQ(x.body["error"]["param"], param) << x.raw;
  };
  refused("/tokenize", json::object(), "missing_required_parameter", "prompt");
  refused("/tokenize", {{"prompt", "a"}, {"messages", chat}}, "missing_required_parameter", "messages");
  refused("/tokenize", {{"prompt", 3}}, "invalid_type", "prompt");
  refused("/tokenize", {{"prompt", "a"}, {"model", "other"}}, "model_not_found", "model");
  refused("/tokenize", {{"messages", chat}, {"add_generation_prompt", false}}, "unsupported_parameter",
          "add_generation_prompt");
  refused("/detokenize", json::object(), "missing_required_parameter", "tokens");
  refused("/detokenize", {{"tokens", {1, 512}}}, "invalid_value", "tokens");
  refused("/detokenize", {{"tokens", {1, -1}}}, "invalid_value", "tokens");
  EXPECT_EQ(get("/tokenize").status, 405);
}

// vLLM's sampling extensions: bad_words, allowed_token_ids,
// truncate_prompt_tokens and include_stop_str_in_output.
TEST_F(HttpServerTest, VllmSamplingExtensions) {
  start();
  const std::string free = greedy(encode("Once upon a time"), 30).first;
  ASSERT_NE(free.find(" Lily"), std::string::npos) << free;
  // A bad word: the same text up to where it would start, never the word.
  json body = completion("Once upon a time", 30);
  body["bad_words"] = {"Lily"};
  Reply r = post("/v1/completions", body);
  ASSERT_EQ(r.status, 200) << r.raw;
  const std::string text = r.body["choices"][0]["text"];
  EXPECT_EQ(text.find("Lily"), std::string::npos) << text;
  EXPECT_EQ(text.substr(0, free.find(" Lily")), free.substr(0, free.find(" Lily")));
  EXPECT_NE(text, free);

  // Allowed tokens: each generated token is one of them (logprobs name them).
  const std::vector<int32_t> allowed = {403, 407, 261, 378};  // " Once", " upon", " a", " time"
  body = completion("Once upon a time", 12);
  body["allowed_token_ids"] = allowed;
  body["logprobs"] = 0;
  r = post("/v1/completions", body);
  ASSERT_EQ(r.status, 200) << r.raw;
  const Tokenizer& tok = model_->require_tokenizer();
  std::set<std::string> pieces;
  for (int32_t t : allowed) pieces.insert(tok.decode_piece(5, t));
  ASSERT_EQ(r.body["choices"][0]["logprobs"]["tokens"].size(), 12u);
  for (const json& t : r.body["choices"][0]["logprobs"]["tokens"]) EXPECT_TRUE(pieces.count(t)) << t;
  body["allowed_token_ids"] = {2};
  body["min_tokens"] = 1;
  r = post("/v1/completions", body);
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(r.body["error"]["message"].get<std::string>().find("leave no token"), std::string::npos) << r.raw;
  // Bans that leave nothing only after some tokens: still the request's own
  // doing, a 400 (not a 500 engine error).
  body.erase("min_tokens");
  body["allowed_token_ids"] = {407};  // " upon"
  body["bad_words"] = {"upon upon"};
  r = post("/v1/completions", body);
  EXPECT_EQ(r.status, 400) << r.raw;
  EXPECT_NE(r.body["error"]["message"].get<std::string>().find("no token may be sampled"), std::string::npos)
      << r.raw;
  body.erase("bad_words");

  // Truncation keeps the prompt's last tokens: the same as sending them.
  const std::vector<int32_t> prompt = encode("Once upon a time, there was a cat");
  const std::vector<int32_t> tail(prompt.end() - 4, prompt.end());
  body = completion("Once upon a time, there was a cat", 8);
  body["truncate_prompt_tokens"] = 4;
  body["echo"] = true;
  body["logprobs"] = 0;
  r = post("/v1/completions", body);
  ASSERT_EQ(r.status, 200) << r.raw;
  EXPECT_EQ(r.body["usage"]["prompt_tokens"], 4);
  const auto [want, n] = greedy(tail, 8);
  // The echo spells the kept tokens as their entries do (" was", with its
  // space), so every text_offset points at its token in the text.
  std::string echoed;
  for (size_t t = 0; t < tail.size(); ++t) echoed += tok.decode_piece(t == 0 ? -1 : tail[t - 1], tail[t]);
  const std::string echo_text = r.body["choices"][0]["text"];
  EXPECT_EQ(echo_text, echoed + want);
  const json& lp = r.body["choices"][0]["logprobs"];
  for (size_t k = 0; k < lp["tokens"].size(); ++k) {
    const std::string token = lp["tokens"][k];
    EXPECT_EQ(echo_text.substr(lp["text_offset"][k].get<size_t>(), token.size()), token) << k;
  }
  body.erase("logprobs");
  body["truncate_prompt_tokens"] = -1;  // the context length: nothing to cut here
  r = post("/v1/completions", body);
  EXPECT_EQ(r.body["usage"]["prompt_tokens"], prompt.size()) << r.raw;

  // The stop string kept.
  body = completion("Once upon a time", 30);
  body["stop"] = {" Lily"};
  body["include_stop_str_in_output"] = true;
  r = post("/v1/completions", body);
  EXPECT_EQ(r.body["choices"][0]["text"], free.substr(0, free.find(" Lily") + 5)) << r.raw;
  EXPECT_EQ(r.body["choices"][0]["finish_reason"], "stop");
}

TEST_F(HttpServerTest, CacheEventsRouteListsStoredBlocksForRouters) {
  EngineOptions eo;
  eo.cache_event_log = 100;
  start(eo);
  const json body = {{"model", "stories260K"}, {"prompt", "Once upon a time, there was a little girl named Lily"},
                     {"max_tokens", 4}, {"temperature", 0}};
  ASSERT_EQ(post("/v1/completions", body).status, 200);
  Reply r = get("/v1/kv/events?after=0&limit=1000");
  ASSERT_EQ(r.status, 200);
  ASSERT_FALSE(r.body["data"].empty());
  const json& first = r.body["data"][0];
  EXPECT_EQ(first["type"], "stored");
  EXPECT_EQ(first["depth"], 0);
  EXPECT_TRUE(first["parent_key"].is_null());
  EXPECT_EQ(first["block_key"].get<std::string>().size(), 32u);  // xxh3-128 in hex
  EXPECT_TRUE(get("/v1/kv/events?after=" + std::to_string(r.body["next"].get<uint64_t>())).body["data"].empty());
  EXPECT_EQ(get("/v1/kv/events?after=-1").status, 400);
  // Without API keys every caller is the default tenant, a key sent or not,
  // and reads the engine's whole log.
  const size_t logged = engine_->cache_events({.after = 0, .max = 1000}).events.size();
  EXPECT_EQ(r.body["data"].size(), logged);
  EXPECT_EQ(get("/v1/kv/events?after=0&limit=1000", {{"Authorization", "Bearer sk-any"}}).body["data"].size(), logged);
}

// With API keys a key reads only its own tenant's events (and the shared
// scope's, which no request here uses): though salted, another tenant's
// keys would say when it sent prompts, how long and which share a prefix.
// Paged one event at a time, a key moves past the other tenant's events.
// The events admin the server names (a KV-aware router) reads all.
TEST_F(HttpServerTest, CacheEventsShowEachKeyOnlyItsTenantsEvents) {
  EngineOptions eo;
  eo.cache_event_log = 1000;
  eo.kv.block_size = 4;
  HttpServerOptions ho;
  ho.kv_events_admin = "router";
  start(eo, ho, ApiKeys::parse("sk-alpha team-a\nsk-beta team-b\nsk-router router\n", "keys"));
  const httplib::Headers alpha = {{"Authorization", "Bearer sk-alpha"}};
  const httplib::Headers beta = {{"Authorization", "Bearer sk-beta"}};
  const httplib::Headers router = {{"Authorization", "Bearer sk-router"}};
  // One after another, so that team-b's events lie between team-a's.
  const std::string lily = "Once upon a time, there was a little girl named Lily";
  ASSERT_EQ(post("/v1/completions", completion(lily, 4), alpha).status, 200);
  ASSERT_EQ(post("/v1/completions", completion(lily, 4), beta).status, 200);
  ASSERT_EQ(post("/v1/completions", completion("The sun was hot and the sky was blue. Tom", 4), beta).status, 200);
  ASSERT_EQ(post("/v1/completions", completion("Ben liked to build towers with his blocks.", 4), alpha).status, 200);
  stats_when([](const EngineStats& s) { return s.requests_finished == 4; });  // every event logged

  auto events = [&](const httplib::Headers& who, uint64_t after, int limit) {
    const Reply r = get(fmt::format("/v1/kv/events?after={}&limit={}", after, limit), who);
    EXPECT_EQ(r.status, 200) << r.raw;
    return r.body;
  };
  std::map<std::string, std::vector<uint64_t>> seqs;  // tenant -> its events' seqs, as the router reads them
  const json all = events(router, 0, 1000);
  for (const json& e : all["data"]) seqs[e["tenant"].get<std::string>()].push_back(e["seq"].get<uint64_t>());
  ASSERT_EQ(seqs.size(), 2u);
  ASSERT_LT(seqs["team-b"].front(), seqs["team-a"].back());
  for (const auto& [who, tenant] : {std::pair(alpha, "team-a"), std::pair(beta, "team-b")}) {
    std::vector<uint64_t> whole, paged;
    const json at_once = events(who, 0, 1000);
    for (const json& e : at_once["data"]) {
      EXPECT_EQ(e["tenant"], tenant);
      whole.push_back(e["seq"].get<uint64_t>());
    }
    EXPECT_EQ(whole, seqs[tenant]);
    uint64_t after = 0;
    for (int polls = 0;; ++polls) {
      ASSERT_LT(polls, 200) << tenant;
      const json page = events(who, after, 1);
      for (const json& e : page["data"]) paged.push_back(e["seq"].get<uint64_t>());
      if (page["next"].get<uint64_t>() == after) break;  // nothing left to examine
      after = page["next"].get<uint64_t>();
    }
    EXPECT_EQ(paged, seqs[tenant]);
  }
  // Requests without a key are the default tenant, which has no events.
  EXPECT_TRUE(get("/v1/kv/events").body["data"].empty());
}

TEST_F(HttpServerTest, CacheEventsAdminIsATenantOfItsOwnKey) {
  HttpServerOptions ho;
  ho.kv_events_admin = "router";
  testing_files::expect_error_containing([&] { start({}, ho); }, "'router' is the tenant of no API key");
  testing_files::expect_error_containing([&] { start({}, ho, ApiKeys::parse("sk-a team-a\n", "keys")); },
                                         "'router' is the tenant of no API key");
  ho.kv_events_admin = std::string(kDefaultTenant);
  testing_files::expect_error_containing([&] { start({}, ho, ApiKeys::parse("sk-a default\n", "keys")); },
                                         "cannot be the 'default' tenant");
  ho.kv_events_admin = "router";  // a tenant of a key, but no events are logged
  testing_files::expect_error_containing([&] { start({}, ho, ApiKeys::parse("sk-r router\n", "keys")); },
                                         "'router' reads no events: --kv-events N is off");
}

TEST_F(HttpServerTest, CacheEventsRouteIsOffUnlessAsked) {
  start();
  const Reply r = get("/v1/kv/events");
  EXPECT_EQ(r.status, 404);
  EXPECT_NE(r.raw.find("--kv-events"), std::string::npos);
}

TEST_F(HttpServerTest, ClientMistakesGet400WithAnOpenAiErrorObject) {
  start();
  struct Case {
    std::string path, body, param, code;
  };
  const std::string p = "/v1/completions";
  const std::string m = R"("model": "stories260K", )";
  std::string long_prompt = "[1";
  for (int i = 1; i < 512; ++i) long_prompt += ",400";
  long_prompt += "]";
  const std::vector<Case> cases = {
      {p, "{bad", "", "invalid_json"},
      {p, "[1, 2]", "", "invalid_json"},
      {p, "{" + m + R"("prompt": "x", "temperature": "hot"})", "temperature", "invalid_type"},
      {p, "{" + m + R"("prompt": "x", "temperature": 3})", "temperature", "invalid_value"},
      {p, "{" + m + R"("prompt": "x", "max_tokens": 0})", "max_tokens", "invalid_value"},
      {p, "{" + m + R"("prompt": "x", "max_tokens": "many"})", "max_tokens", "invalid_type"},
      {p, "{" + m + R"("prompt": "x", "max_tokens": 100000})", "max_tokens", "context_length_exceeded"},
      {p, "{" + m + R"("prompt": )" + long_prompt + "}", "prompt", "context_length_exceeded"},
      {p, "{" + m + R"("prompt": [1, 99999]})", "prompt", "invalid_value"},
      {p, "{" + m + R"("prompt": "x", "kv": {"budget": 16}})", "kv.budget", "invalid_value"},
      {p, "{" + m + R"("prompt": "x", "kv": {"pin": "yes"}})", "kv.pin", "invalid_type"},
      {p, "{" + m + R"("prompt": 7})", "prompt", "invalid_type"},
      {p, "{" + m + R"("max_tokens": 4})", "prompt", "missing_required_parameter"},
      {p, R"({"model": "gpt-4", "prompt": "x"})", "model", "model_not_found"},
      {p, R"({"model": ["stories260K"], "prompt": "x"})", "model", "invalid_type"},
      {p, "{" + m + R"("prompt": "x", "n": 100})", "n", "invalid_value"},
      {p, "{" + m + R"("prompt": "x", "stop": 5})", "stop", "invalid_type"},
      {p, "{" + m + R"("prompt": "x", "stop": [""]})", "stop", "invalid_value"},
      {p, "{" + m + R"("prompt": "x", "stream_options": {"include_usage": true}})", "stream_options", "invalid_value"},
      {p, "{" + m + R"("prompt": "x", "logprobs": 25})", "logprobs", "invalid_value"},
      {p, "{" + m + R"("prompt": "x", "stop_token_ids": [99999]})", "stop_token_ids", "invalid_value"},
      {p, "{" + m + R"("prompt": "x", "logit_bias": {"99999": 5}})", "logit_bias", "invalid_value"},
      {p, "{" + m + R"("prompt": "x", "max_tokens": 4, "min_tokens": 10})", "min_tokens", "invalid_value"},
      {p, "{" + m + R"("prompt": "x", "kv": {"k": "int4"}})", "kv.k", "unsupported_kv_config"},
      {p, "{" + m + R"("prompt": "x", "kv": {"v": "int3"}})", "kv.v", "invalid_value"},
      {p, "{" + m + R"("prompt": "x", "kv": {"policy": "sinks", "budget": 256}})", "kv.policy", "unsupported_kv_config"},
      {p, "{" + m + R"("prompt": "x", "kv": {"colour": "red"}})", "kv.colour", "unknown_parameter"},
      {"/v1/chat/completions", R"({"model": "stories260K"})", "messages", "missing_required_parameter"},
      {"/v1/chat/completions", "{" + m + R"("messages": [{"role": "wizard", "content": "x"}]})", "messages[0].role",
       "invalid_value"},
      {"/v1/chat/completions", "{" + m + R"("messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
        "max_completion_tokens": 5})", "max_completion_tokens", "invalid_value"},
      // The field the client sent (it used to say max_tokens).
      {"/v1/chat/completions", "{" + m + R"("messages": [{"role": "user", "content": "x"}],
        "max_completion_tokens": 100000})", "max_completion_tokens", "context_length_exceeded"},
  };
  for (const Case& c : cases) {
    const Reply r = post_raw(c.path, c.body);
    EXPECT_EQ(r.status, 400) << c.body << " -> " << r.raw;
    ASSERT_TRUE(r.body.contains("error")) << r.raw;
    const json& e = r.body["error"];
    EXPECT_EQ(e["type"], "invalid_request_error") << c.body;
    EXPECT_FALSE(e["message"].get<std::string>().empty());
    if (c.param.empty()) {
      EXPECT_TRUE(e["param"].is_null()) << c.body;
    } else {
      EXPECT_EQ(e["param"], c.param) << c.body;
    }
    if (!c.code.empty()) {
      EXPECT_EQ(e["code"], c.code) << c.body;
    }
  }
  EXPECT_EQ(engine_->stats().requests_submitted, 0);
  // The server's own KV type is accepted.
  const Reply ok = post_raw(p, "{" + m + R"("prompt": "x", "max_tokens": 2, "kv": {"k": "fp32", "v": "fp32"}})");
  EXPECT_EQ(ok.status, 200) << ok.raw;
}

// A quantized cache in a byte budget pays for the FP16 staging of its
// residual window and of a prefill chunk out of the same pool: a request
// fits by Engine::max_sequence_tokens, not blocks * block size. Past it the
// client gets the usual context_length_exceeded on max_tokens (it used to
// pass here and be refused by the engine with "need 5 KV blocks; the cache
// has 22", code and param null).
TEST_F(HttpServerTest, ByteBudgetsCountStagingInTheRequestLimit) {
  EngineOptions eo;
  eo.kv.set_dtype(KvDType::Q4_0);
  eo.kv.budget_bytes = 64 << 10;
  start(eo);
  const int64_t most = engine_->max_sequence_tokens();
  const int64_t blocks = int64_t(engine_->cache().pool().num_blocks()) * engine_->cache().block_size();
  ASSERT_GT(most, 16);
  ASSERT_LT(most, blocks);  // staging takes part of the pool
  const int32_t n = int32_t(encode("Once upon a time").size());
  const Reply fits = post("/v1/completions", completion("Once upon a time", int32_t(most) - n));
  EXPECT_EQ(fits.status, 200) << fits.raw;
  const Reply over = post("/v1/completions", completion("Once upon a time", int32_t(most) - n + 1));
  EXPECT_EQ(over.status, 400) << over.raw;
  EXPECT_EQ(over.body["error"]["code"], "context_length_exceeded") << over.raw;
  EXPECT_EQ(over.body["error"]["param"], "max_tokens") << over.raw;
}

// The request limits follow the request's KV policy, as the engine does: a
// window holds its budget however long the completion, and sinks run past
// the context. Without a policy the same requests are refused.
TEST_F(HttpServerTest, RequestLimitsFollowTheRequestsKvPolicy) {
  EngineOptions eo;
  eo.kv.block_size = 16;
  eo.kv.num_blocks = 12;  // 192 tokens
  eo.scheduler.max_batch_prefill_tokens = 32;  // a window holds its budget + one chunk
  eo.kv.k.pre_rope = true;                     // sinks past the context re-rotate keys
  start(eo);
  ASSERT_EQ(engine_->max_sequence_tokens(), 192);
  auto ask = [&](int32_t max_tokens, const json& kv) {
    json b = completion("Once upon a time", max_tokens);
    b["ignore_eos"] = true;
    if (!kv.is_null()) b["kv"] = kv;
    return post("/v1/completions", b);
  };
  const Reply full = ask(300, nullptr);
  EXPECT_EQ(full.status, 400) << full.raw;
  EXPECT_EQ(full.body["error"]["code"], "context_length_exceeded") << full.raw;
  const Reply window = ask(300, {{"policy", "window"}, {"budget", 64}});
  ASSERT_EQ(window.status, 200) << window.raw;
  EXPECT_EQ(window.body["usage"]["completion_tokens"], 300);
  // Past the model's 512 positions: only sinks may go there.
  const Reply past = ask(600, {{"policy", "window"}, {"budget", 64}});
  EXPECT_EQ(past.status, 400) << past.raw;
  EXPECT_EQ(past.body["error"]["param"], "max_tokens") << past.raw;
  const Reply sinks = ask(600, {{"policy", "sinks"}, {"budget", 64}});
  ASSERT_EQ(sinks.status, 200) << sinks.raw;
  EXPECT_EQ(sinks.body["usage"]["completion_tokens"], 600);
  const EngineStats s = stats_when([](const EngineStats& s) { return s.requests_finished == 2; });
  EXPECT_EQ(s.kv.blocks_used, 0);
  // Positions within the cache reach the budget plus the chunk being written:
  // past the context this was accepted and failed mid-generation, with a 500
  // for every request in its batch.
  const Reply near = ask(600, {{"policy", "sinks"}, {"budget", 510}});
  EXPECT_EQ(near.status, 400) << near.raw;
  EXPECT_EQ(near.body["error"]["code"], "unsupported_kv_config") << near.raw;
  EXPECT_NE(near.raw.find("past the context length of 512"), std::string::npos) << near.raw;
}

// A request that names no policy and is refused by the server's default one
// was told to fix 'kv.policy', a field it never sent, and to lower a budget
// it did not know it could set.
TEST_F(HttpServerTest, ARefusalByTheServersDefaultPolicySaysWhatTheClientCanChange) {
  EngineOptions eo;
  eo.kv.block_size = 16;
  eo.kv.num_blocks = 40;
  eo.scheduler.max_batch_prefill_tokens = 32;
  eo.kv.k.pre_rope = true;
  eo.sparsity.policy = "sinks";
  eo.sparsity.budget = 510;
  start(eo);
  auto ask = [&](const json& kv) {
    json b = completion("Once upon a time", 600);
    b["ignore_eos"] = true;
    if (!kv.is_null()) b["kv"] = kv;
    return post("/v1/completions", b);
  };
  const Reply refused = ask(nullptr);
  EXPECT_EQ(refused.status, 400) << refused.raw;
  EXPECT_EQ(refused.body["error"]["code"], "unsupported_kv_config") << refused.raw;
  EXPECT_EQ(refused.body["error"]["param"], "prompt") << refused.raw;
  const std::string message = refused.body["error"]["message"].get<std::string>();
  EXPECT_NE(message.find("the server's default KV policy 'sinks'"), std::string::npos) << message;
  EXPECT_NE(message.find(R"("budget": N)"), std::string::npos) << message;
  const Reply lowered = ask({{"policy", "sinks"}, {"budget", 64}});  // what the message suggests
  ASSERT_EQ(lowered.status, 200) << lowered.raw;
  EXPECT_EQ(lowered.body["usage"]["completion_tokens"], 600);
}

// A request naming the server's own policy ran it with that policy's
// defaults, dropping the sinks, window and scope the server was started with.
TEST_F(HttpServerTest, ARequestNamingTheServersPolicyKeepsItsTuning) {
  EngineOptions eo;
  eo.sparsity.policy = "h2o";
  eo.sparsity.budget = 24;
  eo.sparsity.window = 1;
  eo.sparsity.scope = SparsityScope::Aggregate;
  eo.sparsity.score = H2oScore::Mean;
  start(eo);
  auto ask = [&](const json& kv) {
    json b = completion("Once upon a time, there was a little dog named Max. He liked to run", 80);
    b["ignore_eos"] = true;
    if (!kv.is_null()) b["kv"] = kv;
    const Reply r = post("/v1/completions", b);
    EXPECT_EQ(r.status, 200) << r.raw;
    return r.status == 200 ? r.body["choices"][0]["text"].get<std::string>() : r.raw;
  };
  const std::string served = ask(nullptr);
  EXPECT_EQ(ask({{"policy", "h2o"}}), served);
  EXPECT_EQ(ask({{"policy", "h2o"}, {"budget", 24}}), served);
}

// httplib (0.11) caps a body with a Content-Length but would buffer a
// chunked one whole (a helper's 100 MiB upload took 264 MiB of memory), and
// waited out its read timeout on a POST with no length at all.
TEST_F(HttpServerTest, BodiesPastTheCapGet413AndEmptyPostsAnAnswerAtOnce) {
  HttpServerOptions ho;
  ho.max_body_bytes = 4096;
  start({}, ho);
  auto chunked = [](size_t chunks, size_t size) {
    std::string req = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n";
    for (size_t i = 0; i < chunks; ++i) req += fmt::format("{:x}\r\n{}\r\n", size, std::string(size, 'a'));
    return req + "0\r\n\r\n";
  };
  const std::string health = "GET /health HTTP/1.1\r\nHost: x\r\n\r\n";
  {
    // 9 KB chunked: 413, then the connection serves the next request.
    RawConnection c(port_, 10);
    c.send(chunked(3, 3000));
    std::string out = c.response();
    EXPECT_EQ(out.rfind("HTTP/1.1 413", 0), 0u) << out.substr(0, 200);
    EXPECT_NE(out.find("payload_too_large"), std::string::npos);
    c.send(health);
    out = c.response();
    EXPECT_NE(out.find("{\"status\":\"ok\"}"), std::string::npos) << out;
  }
  {
    // Far past the cap: the connection is shut; nothing after the body is
    // parsed as a request (it used to answer 414 to the body's bytes).
    RawConnection c(port_, 10);
    c.send(chunked(40, 4000) + health);
    const std::string out = c.response() + c.response();
    EXPECT_EQ(out.find("414"), std::string::npos) << out.substr(0, 300);
    EXPECT_EQ(out.find("\"ok\""), std::string::npos) << out.substr(0, 300);
  }
  {
    // A declared length past the cap but within 4x is read and dropped, then
    // answered, and the connection serves the next request: a client that
    // sends its body whole reads the 413 (answered at once, Python's
    // http.client got broken pipes and timeouts while still writing).
    RawConnection c(port_, 10);
    c.send("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 9000\r\n\r\n" + std::string(9000, 'a'));
    std::string out = c.response();
    EXPECT_EQ(out.rfind("HTTP/1.1 413", 0), 0u) << out.substr(0, 200);
    c.send(health);
    out = c.response();
    EXPECT_NE(out.find("{\"status\":\"ok\"}"), std::string::npos) << out;
  }
  {
    // A declared length past 4x the cap is answered before any of the body is
    // read, and the connection closed (httplib read the whole declared
    // length first, 1 GiB in a helper's probe, and kept the connection).
    RawConnection c(port_, 10);
    c.send("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1073741824\r\n\r\n" + std::string(5000, 'a'));
    const std::string out = c.response();
    EXPECT_EQ(out.rfind("HTTP/1.1 413", 0), 0u) << out.substr(0, 200);
    EXPECT_NE(out.find("payload_too_large"), std::string::npos);
    EXPECT_NE(out.find("Connection: close"), std::string::npos);
    bool closed = false;
    EXPECT_EQ(c.until_close(&closed), "");
    EXPECT_TRUE(closed);
  }
  {
    // A client that waits for 100 Continue gets the 413 instead.
    RawConnection c(port_, 10);
    c.send("POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 5000\r\n\r\n");
    const std::string out = c.response();
    EXPECT_EQ(out.rfind("HTTP/1.1 413", 0), 0u) << out.substr(0, 200);
    bool closed = false;
    EXPECT_EQ(c.until_close(&closed), "");
    EXPECT_TRUE(closed);
  }
  {
    // No length and no chunks: an empty body, answered before the 2 s this
    // socket waits (httplib's read timeout is 5 s); the connection goes on.
    RawConnection c(port_, 2);
    c.send("POST /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n");
    std::string out = c.response();
    EXPECT_EQ(out.rfind("HTTP/1.1 400", 0), 0u) << out;
    EXPECT_NE(out.find("invalid_json"), std::string::npos) << out;
    c.send(health);
    out = c.response();
    EXPECT_NE(out.find("{\"status\":\"ok\"}"), std::string::npos) << out;
  }
  // The server still serves.
  const Reply ok = post("/v1/completions", completion("Once upon a time", 2));
  EXPECT_EQ(ok.status, 200) << ok.raw;
  EXPECT_EQ(engine_->stats().requests_submitted, 1);
}

// Request framing a proxy in front could read otherwise (RFC 9112 section
// 6): httplib took the first of two Content-Lengths, read -1 or a 20-digit
// length as a huge one and waited out its read timeout for a body of any
// Transfer-Encoding but chunked. Each is refused before its body is read,
// and the connection closed, so the request smuggled after it is never run.
TEST_F(HttpServerTest, AmbiguousBodyFramingIsRefusedAndTheConnectionClosed) {
  start();
  const std::string body = completion("Once upon a time", 2).dump();
  const std::string smuggled = "GET /health HTTP/1.1\r\nHost: x\r\n\r\n";
  struct Case {
    std::string headers;
    int status;
    std::string code;
  };
  const std::string n = std::to_string(body.size());
  const std::vector<Case> cases = {
      {"Content-Length: -1\r\n", 400, "invalid_http_framing"},
      {"Content-Length: 99999999999999999999\r\n", 400, "invalid_http_framing"},
      {"Content-Length: " + n + "\r\nContent-Length: 3\r\n", 400, "invalid_http_framing"},
      {"Content-Length: " + n + ", " + n + "\r\n", 400, "invalid_http_framing"},
      {"Transfer-Encoding: gzip\r\n", 400, "invalid_http_framing"},
      {"Transfer-Encoding: chunked, gzip\r\n", 400, "invalid_http_framing"},
      {"Transfer-Encoding: gzip, chunked\r\n", 501, "unsupported_transfer_encoding"},
      {"Transfer-Encoding: chunked\r\nContent-Length: " + n + "\r\n", 400, "invalid_http_framing"},
  };
  for (const Case& k : cases) {
    RawConnection c(port_, 10);
    c.send("POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + k.headers + "\r\n" + body + smuggled);
    const std::string out = c.response();
    EXPECT_EQ(out.rfind(fmt::format("HTTP/1.1 {}", k.status), 0), 0u) << k.headers << out;
    EXPECT_NE(out.find("\"code\":\"" + k.code + "\""), std::string::npos) << k.headers << out;
    bool closed = false;
    EXPECT_EQ(c.until_close(&closed), "") << k.headers;
    EXPECT_TRUE(closed) << k.headers;
  }
  {
    // A body on a GET, which httplib does not read, and a chunked HTTP/1.0 request.
    RawConnection c(port_, 10);
    c.send("GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: " + std::to_string(smuggled.size()) + "\r\n\r\n" +
           smuggled);
    EXPECT_EQ(c.response().rfind("HTTP/1.1 400", 0), 0u);
    bool closed = false;
    EXPECT_EQ(c.until_close(&closed), "");
    RawConnection c10(port_, 10);
    c10.send("POST /v1/completions HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n" +
             fmt::format("{:x}\r\n{}\r\n0\r\n\r\n", body.size(), body));
    EXPECT_EQ(c10.response().rfind("HTTP/1.1 400", 0), 0u);
  }
  EXPECT_EQ(engine_->stats().requests_submitted, 0);
  // Equal lengths twice are one length.
  RawConnection c(port_, 10);
  c.send("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " + n + "\r\nContent-Length: " + n +
         "\r\n\r\n" + body);
  EXPECT_EQ(c.response().rfind("HTTP/1.1 200", 0), 0u);
}

// What httplib refuses before routing gets an error object with a code too
// (it was {"code": null, "message": "HTTP 400"}).
TEST_F(HttpServerTest, UnparsableRequestsGetAnErrorCode) {
  start();
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"HELLO\r\n\r\n", "HTTP/1.1 400"},
      {"GET /health HTTP/1.1\r\nHost: x\r\nX: " + std::string(9000, 'a') + "\r\n\r\n", "HTTP/1.1 400"},
      {"GET /" + std::string(9000, 'a') + " HTTP/1.1\r\nHost: x\r\n\r\n", "HTTP/1.1 414"},
  };
  for (const auto& [request, status] : cases) {
    RawConnection c(port_, 10);
    c.send(request);
    const std::string out = c.response();
    EXPECT_EQ(out.rfind(status, 0), 0u) << out;
    const json e = json::parse(out.substr(out.find("\r\n\r\n") + 4))["error"];
    EXPECT_EQ(e["code"], status.ends_with("414") ? "uri_too_long" : "invalid_http_request") << out;
    EXPECT_EQ(e["type"], "invalid_request_error");
  }
}

// HTTP/1.0 has no chunked encoding: a stream's body ends with the connection
// (it was sent chunked), also when the client asked for keep-alive.
TEST_F(HttpServerTest, Http10StreamsEndWithTheConnection) {
  start();
  const std::string body = completion("Once upon a time", 8, true).dump();
  for (const std::string keep_alive : {"", "Connection: Keep-Alive\r\n"}) {
    RawConnection c(port_, 10);
    c.send("POST /v1/completions HTTP/1.0\r\n" + keep_alive + "Content-Length: " + std::to_string(body.size()) +
           "\r\n\r\n" + body);
    bool closed = false;
    const std::string out = c.until_close(&closed);
    EXPECT_TRUE(closed) << keep_alive;
    const size_t head = out.find("\r\n\r\n");
    ASSERT_NE(head, std::string::npos) << out;
    EXPECT_EQ(out.rfind("HTTP/1.1 200", 0), 0u) << out;
    EXPECT_EQ(out.find("Transfer-Encoding"), std::string::npos) << out.substr(0, head);
    Reply r;
    r.raw = out.substr(head + 4);
    parse_sse(r);
    EXPECT_TRUE(r.done) << r.raw;
    EXPECT_EQ(stream_text(r), greedy(encode("Once upon a time"), 8).first);
  }
}

TEST_F(HttpServerTest, RoutesMethodsModelsAndHealth) {
  start();
  Reply r = get("/nope");
  EXPECT_EQ(r.status, 404);
  EXPECT_EQ(r.body["error"]["code"], "unknown_route");
  r = get("/v1/completions");
  EXPECT_EQ(r.status, 405);
  EXPECT_EQ(r.body["error"]["code"], "method_not_allowed");
  r = get("/v1/models");
  ASSERT_EQ(r.status, 200);
  EXPECT_EQ(r.body["object"], "list");
  ASSERT_EQ(r.body["data"].size(), 1u);
  EXPECT_EQ(r.body["data"][0]["id"], "stories260K");
  EXPECT_EQ(r.body["data"][0]["max_model_len"], 512);
  EXPECT_EQ(r.body["data"][0]["vocab_size"], 512);
  EXPECT_EQ(get("/v1/models/stories260K").status, 200);
  EXPECT_EQ(get("/v1/models/other").status, 404);
  r = get("/health");
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.body["status"], "ok");
  // A second server on the same port is refused (httplib's SO_REUSEPORT let
  // it bind and take half the connections).
  HttpServerOptions same;
  same.port = port_;
  HttpServer second(*engine_, engine_options_, {}, same);
  testing_files::expect_error_containing([&] { second.start(); }, "address in use");
}

// vLLM's --served-model-name A B: requests may name any, or none (absent,
// null or ""); responses carry the first; /v1/models lists each.
TEST_F(HttpServerTest, ServedModelNamesAndRequestsWithoutOne) {
  HttpServerOptions ho;
  ho.served_model_name = "tiny";
  ho.served_model_aliases = {"default-model", "tiny"};  // a repeat is listed once
  start({}, ho);
  Reply r = get("/v1/models");
  ASSERT_EQ(r.status, 200);
  ASSERT_EQ(r.body["data"].size(), 2u);
  EXPECT_EQ(r.body["data"][0]["id"], "tiny");
  EXPECT_EQ(r.body["data"][1]["id"], "default-model");
  r = get("/v1/models/default-model");
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.body["id"], "default-model");
  r = get("/v1/models/stories260K");  // the file's name is no longer one
  EXPECT_EQ(r.status, 404);
  EXPECT_NE(r.body["error"]["message"].get<std::string>().find("'tiny', 'default-model'"), std::string::npos);

  const std::string expected = greedy(encode("Once upon a time"), 4).first;
  for (const char* model : {R"("model": "tiny", )", R"("model": "default-model", )", R"("model": null, )",
                            R"("model": "", )", ""}) {
    r = post_raw("/v1/completions",
                 std::string("{") + model + R"("prompt": "Once upon a time", "max_tokens": 4, "temperature": 0})");
    ASSERT_EQ(r.status, 200) << model << r.raw;
    EXPECT_EQ(r.body["model"], "tiny") << model;
    EXPECT_EQ(r.body["choices"][0]["text"], expected) << model;
  }
  r = post_raw("/v1/chat/completions", R"({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})");
  EXPECT_EQ(r.status, 200) << r.raw;
  EXPECT_EQ(r.body["model"], "tiny");
  r = post_raw("/v1/completions", R"({"model": "stories260K", "prompt": "x"})");
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(r.body["error"]["code"], "model_not_found");
  EXPECT_EQ(post_raw("/tokenize", R"({"model": "default-model", "prompt": "x"})").status, 200);
  EXPECT_EQ(post_raw("/tokenize", R"({"model": "other", "prompt": "x"})").status, 400);
  HttpServerOptions empty_alias;
  empty_alias.served_model_aliases = {""};
  testing_files::expect_error_containing([&] { HttpServer(*engine_, engine_options_, {}, empty_alias); },
                                         "a served model name is empty");
}

TEST_F(HttpServerTest, ApiKeysMapToTenantsAndRefuseUnknownKeys) {
  HttpServerOptions ho;
  ho.require_api_key = true;
  start({}, ho, ApiKeys::parse("sk-alpha team-a\nsk-beta team-b\n", "keys"));
  const json body = completion("A cat", 2);
  Reply r = post("/v1/completions", body);
  EXPECT_EQ(r.status, 401);
  EXPECT_EQ(r.body["error"]["code"], "invalid_api_key");
  r = post("/v1/completions", body, {{"Authorization", "Bearer sk-gamma"}});
  EXPECT_EQ(r.status, 401);
  r = post("/v1/completions", body, {{"Authorization", "Bearer sk-beta"}});
  EXPECT_EQ(r.status, 200) << r.raw;
  // The tokenizer routes want a key too.
  EXPECT_EQ(post("/tokenize", {{"prompt", "A cat"}}).status, 401);
  EXPECT_EQ(post("/detokenize", {{"tokens", {1}}}).status, 401);
  EXPECT_EQ(post("/tokenize", {{"prompt", "A cat"}}, {{"Authorization", "Bearer sk-alpha"}}).status, 200);
  EXPECT_EQ(stats_when([](const EngineStats& s) { return s.requests_finished == 1; }).requests_submitted, 1);
}

TEST_F(HttpServerTest, FullQueueGets429WithRetryAfterAndNoRequestIsLost) {
  EngineOptions eo;
  eo.max_waiting = 4;
  eo.scheduler.max_num_seqs = 2;
  start(eo, {}, {}, /*manual=*/true);
  // 2x the queue plus the running slots, all arriving while the engine is
  // paused: exactly max_waiting are queued, the rest are refused at once.
  constexpr int kRequests = 12;
  std::vector<std::future<Reply>> replies;
  for (int i = 0; i < kRequests; ++i)
    replies.push_back(std::async(std::launch::async, [this, i] {
      json b = completion(kPrompts[size_t(i) % kPrompts.size()], 20, /*stream=*/i % 2 == 1);
      return post("/v1/completions", b);
    }));
  // The refused ones answer without the engine running.
  auto ready = [&] {
    int n = 0;
    for (auto& f : replies) n += f.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
    return n;
  };
  for (int i = 0; i < 1000 && ready() < kRequests - 4; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  std::vector<Reply> done(kRequests);
  int rejected = 0;
  for (int i = 0; i < kRequests; ++i) {
    if (replies[size_t(i)].wait_for(std::chrono::seconds(0)) != std::future_status::ready) continue;
    done[size_t(i)] = replies[size_t(i)].get();
    EXPECT_EQ(done[size_t(i)].status, 429);
    ++rejected;
  }
  EXPECT_EQ(rejected, kRequests - 4);
  paused_ = false;
  int ok = 0;
  for (int i = 0; i < kRequests; ++i) {
    if (replies[size_t(i)].valid()) done[size_t(i)] = replies[size_t(i)].get();
    const Reply& r = done[size_t(i)];
    if (r.status == 429) {
      EXPECT_EQ(r.retry_after, "1");
      EXPECT_EQ(r.body["error"]["code"], "queue_full");
      continue;
    }
    ASSERT_EQ(r.status, 200) << r.raw;
    ++ok;
    const auto [want, n] = greedy(encode(kPrompts[size_t(i) % kPrompts.size()]), 20);
    EXPECT_EQ(i % 2 ? stream_text(r) : r.body["choices"][0]["text"].get<std::string>(), want);
    if (i % 2) {
      EXPECT_TRUE(r.done);
    }
  }
  EXPECT_EQ(ok, 4);
  const EngineStats s = stats_when([](const EngineStats& s) { return s.requests_finished == 4; });
  EXPECT_EQ(s.requests_rejected, kRequests - 4);
  EXPECT_EQ(s.requests_finished, 4);
  EXPECT_EQ(s.kv.blocks_used, 0);
}

TEST_F(HttpServerTest, BoundedOverloadGetsOnly200And429) {
  EngineOptions eo;
  eo.max_waiting = 4;
  eo.scheduler.max_num_seqs = 2;
  start(eo);
  constexpr int kRequests = 24;
  std::vector<std::future<Reply>> replies;
  for (int i = 0; i < kRequests; ++i)
    replies.push_back(std::async(std::launch::async, [this, i] {
      json b = completion(kPrompts[size_t(i) % kPrompts.size()], 64, /*stream=*/i % 2 == 1);
      b["ignore_eos"] = true;
      return post("/v1/completions", b);
    }));
  int ok = 0, rejected = 0;
  for (auto& f : replies) {
    const Reply r = f.get();
    if (r.status == 429) {
      ++rejected;
      continue;
    }
    ASSERT_EQ(r.status, 200) << r.raw;
    ++ok;
    if (r.chunks.empty()) {
      EXPECT_EQ(r.body["usage"]["completion_tokens"], 64);
    } else {
      EXPECT_TRUE(r.done);
      EXPECT_EQ(r.chunks.back()["choices"][0]["finish_reason"], "length");
    }
  }
  EXPECT_EQ(ok + rejected, kRequests);
  const EngineStats s = stats_when([ok](const EngineStats& s) { return s.requests_finished == ok; });
  EXPECT_EQ(s.requests_finished, ok);
  EXPECT_EQ(s.finished_length, ok);
  EXPECT_EQ(s.requests_rejected, rejected);
  EXPECT_EQ(s.kv.blocks_used, 0);
}

TEST_F(HttpServerTest, MoreKeepAliveClientsThanThreadsAreAllServed) {
  HttpServerOptions ho;
  ho.http_threads = 2;
  ho.keep_alive_timeout_seconds = 60;  // an idle client would hold its thread this long
  start({}, ho);
  // Six clients keep their connections open until all are served: with two
  // threads, the server must stop keeping connections alive once no thread is
  // free, or the last clients wait for the keep-alive timeout.
  const auto t0 = std::chrono::steady_clock::now();
  std::latch served(6);
  std::vector<std::future<int>> clients;
  for (int i = 0; i < 6; ++i)
    clients.push_back(std::async(std::launch::async, [this, i, &served] {
      httplib::Client c = client();
      c.set_keep_alive(true);
      int ok = 0;
      for (int k = 0; k < 3; ++k) {
        auto res = c.Post("/v1/completions", completion(kPrompts[size_t(i)], 8).dump(), "application/json");
        ok += res && res->status == 200;
      }
      served.arrive_and_wait();
      return ok;
    }));
  for (auto& f : clients) EXPECT_EQ(f.get(), 3);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));
}

TEST_F(HttpServerTest, ClosingAStreamCancelsTheSequenceAndFreesItsBlocks) {
  start({}, {}, {}, /*manual=*/true);
  json body = completion("Once upon a time", 400, /*stream=*/true);
  body["ignore_eos"] = true;
  std::atomic<bool> returned{false};
  // A compressed stream would arrive only at the end (httplib's compressor
  // does not flush per chunk), so a stream is never compressed.
  std::thread reader([&] {
    const Reply r = post("/v1/completions", body, {{"Accept-Encoding", "gzip, deflate, br"}}, /*stop_after_chunks=*/3);
    EXPECT_EQ(r.content_encoding, "");
    returned = true;
  });
  // Step until the client has its three chunks and hangs up.
  ASSERT_TRUE(step_until([&] { return returned.load(); }));
  reader.join();
  EXPECT_GT(engine_->stats().kv.blocks_used, 0);
  ASSERT_TRUE(step_until([&] { return engine_->stats().finished_cancelled == 1; }));
  const EngineStats s = engine_->stats();
  EXPECT_EQ(s.kv.blocks_used, 0);
  EXPECT_EQ(s.running + s.waiting, 0);
  EXPECT_LT(s.generated_tokens, 100);
  const std::string metrics = get("/metrics").raw;
  EXPECT_NE(metrics.find("kvserve_kv_blocks{codec=\"fp32\",state=\"used\"} 0\n"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("kvserve_requests_finished_total{reason=\"cancelled\"} 1\n"), std::string::npos);
  EXPECT_NE(metrics.find("kvserve_http_requests_in_flight 0\n"), std::string::npos);
}

TEST_F(HttpServerTest, AClientGivingUpOnAWholeResponseCancelsIt) {
  start({}, {}, {}, /*manual=*/true);
  // The engine does not run, so the client's 1 s read timeout expires first.
  const Reply r = post("/v1/completions", completion("Once upon a time", 100), {}, 0, /*read_timeout_s=*/1);
  EXPECT_EQ(r.status, 0);
  // The handler answers 499 once it has seen the client leave and cancelled.
  const std::string gone = "kvserve_http_responses_total{route=\"/v1/completions\",code=\"499\"} 1\n";
  for (int i = 0; i < 1000 && server_->metrics_text().find(gone) == std::string::npos; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_NE(server_->metrics_text().find(gone), std::string::npos);
  ASSERT_TRUE(step_until([&] { return engine_->stats().finished_cancelled == 1; }));
  EXPECT_EQ(engine_->stats().generated_tokens, 0);
  EXPECT_EQ(engine_->stats().kv.blocks_used, 0);
}

TEST_F(HttpServerTest, ShutdownDrainsRunningStreamsAndRefusesNewRequests) {
  start({}, {}, {}, /*manual=*/true);
  auto first = std::async(std::launch::async, [this] {
    return post("/v1/completions", completion("Once upon a time", 30, /*stream=*/true));
  });
  ASSERT_TRUE(step_until([&] { return engine_->stats().generated_tokens >= 3; }));
  std::thread closer([this] { server_->shutdown(30); });
  // Draining: health says so, new work is refused, the running stream goes on.
  Reply health;
  for (int i = 0; i < 200 && health.status != 503; ++i) {
    health = get("/health");
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(health.status, 503);
  EXPECT_EQ(health.body["status"], "draining");
  const Reply refused = post("/v1/completions", completion("A cat", 5));
  EXPECT_EQ(refused.status, 503);
  EXPECT_EQ(refused.body["error"]["code"], "server_shutting_down");
  paused_ = false;
  const Reply r = first.get();
  closer.join();
  ASSERT_EQ(r.status, 200);
  EXPECT_TRUE(r.done);
  EXPECT_EQ(stream_text(r), greedy(encode("Once upon a time"), 30).first);
  EXPECT_EQ(engine_->stats().finished_cancelled, 0);
}

// httplib's stop() reaches only a server already listening: start() waits
// for that, so a shutdown right after it returns (it hung before, when a
// test failed before its first request). Each round must end within seconds.
TEST_F(HttpServerTest, ShutdownRightAfterStartReturns) {
  for (int round = 0; round < 20; ++round) {
    start();
    auto done = std::async(std::launch::async, [this] { TearDown(); });
    if (done.wait_for(std::chrono::seconds(20)) != std::future_status::ready) {
      std::fprintf(stderr, "shutdown right after start hung (round %d)\n", round);
      std::abort();  // a clear failure rather than a test that never ends
    }
    server_.reset();
    engine_.reset();
  }
}

TEST_F(HttpServerTest, ShutdownCancelsWhatOutlivesTheDrainDeadline) {
  start({}, {}, {}, /*manual=*/true);
  json body = completion("Once upon a time", 400, /*stream=*/true);
  body["ignore_eos"] = true;
  auto stream = std::async(std::launch::async, [this, body] { return post("/v1/completions", body); });
  auto whole = std::async(std::launch::async, [this] { return post("/v1/completions", completion("A cat", 400)); });
  ASSERT_TRUE(step_until([&] { return engine_->stats().running == 2; }));
  std::thread closer([this] { server_->shutdown(0.2); });
  // Past the deadline the server cancels both; only then may the engine run
  // (else it could finish them first on a slow machine).
  stats_when([](const EngineStats& s) { return s.cancels_requested >= 2; });
  paused_ = false;
  const Reply s = stream.get();
  const Reply w = whole.get();
  closer.join();
  ASSERT_EQ(s.status, 200);
  EXPECT_TRUE(s.done);
  ASSERT_FALSE(s.chunks.empty());
  EXPECT_EQ(s.chunks.back()["error"]["code"], "server_shutting_down");
  EXPECT_EQ(w.status, 503);
  EXPECT_EQ(w.body["error"]["code"], "server_shutting_down");
  const EngineStats st = stats_when([](const EngineStats& s) { return s.finished_cancelled == 2; });
  EXPECT_EQ(st.kv.blocks_used, 0);
}

TEST_F(HttpServerTest, MetricsReportEngineAndHttpCounters) {
  start();
  for (int i = 0; i < 3; ++i) ASSERT_EQ(post("/v1/completions", completion(kPrompts[size_t(i)], 8)).status, 200);
  EXPECT_EQ(post("/v1/completions", json{{"model", "x"}}).status, 400);
  const std::vector<std::string> lines = {
      "kvserve_requests_submitted_total 3\n", "kvserve_requests_finished_total{reason=\"length\"} 3\n",
      "kvserve_generation_tokens_total 24\n", "kvserve_time_to_first_token_seconds_count 3\n",
      "kvserve_time_per_output_token_seconds_count 21\n", "kvserve_request_latency_seconds_count 3\n",
      "kvserve_http_responses_total{route=\"/v1/completions\",code=\"200\"} 3\n",
      "kvserve_http_responses_total{route=\"/v1/completions\",code=\"400\"} 1\n",
      "kvserve_kv_blocks_total{codec=\"fp32\"} 512\n", "kvserve_prefix_cache_hit_rate 0\n",
      "# TYPE kvserve_time_to_first_token_seconds histogram\n"};
  auto missing = [&](const std::string& m) {
    for (const std::string& line : lines)
      if (m.find(line) == std::string::npos) return line;
    return std::string();
  };
  // Engine stats and the HTTP log settle just after the responses.
  std::string m = get("/metrics").raw;
  for (int i = 0; i < 500 && !missing(m).empty(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    m = get("/metrics").raw;
  }
  EXPECT_EQ(missing(m), "") << m;
}

}  // namespace
}  // namespace kvserve
