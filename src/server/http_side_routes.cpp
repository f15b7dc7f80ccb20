// HttpServer's routes beside the completions: vLLM's POST /tokenize and
// POST /detokenize, and GET /v1/kv/events, the prefix cache's event feed for
// a KV-aware router. Declared in http_server.h; split from http_server.cpp,
// which keeps the completion routes, the body framing and the shutdown.
#include <httplib.h>

#include <algorithm>

#include "server/http_responses.h"
#include "server/http_server.h"
#include "server/utf8_stream.h"
#include "util/error.h"

namespace kvserve {

using json = nlohmann::json;

void HttpServer::handle_tokenize(const httplib::Request& req, const std::string& body, httplib::Response& res) {
  if (!authenticate(req, res)) return;
  const auto parsed = parse_tokenize_request(body);
  const TokenizeRequest* request = parsed_or_sent(parsed, res);
  if (!request || !check_model(request->model, res)) return;
  const TokenizeRequest& t = *request;
  if (!tokenizer_) {
    send_error(res, invalid_request("this model has no vocabulary, so it cannot tokenize text", t.chat ? "messages" : "prompt",
                                    "invalid_value"));
    return;
  }
  std::vector<int32_t> tokens;
  if (t.chat) {
    try {
      tokens = chat_template_->render(t.messages);
    } catch (const Error& e) {
      send_error(res, invalid_request(e.what(), "messages", "invalid_value"));
      return;
    }
  } else {
    tokens = tokenizer_->encode(t.prompt, t.add_special_tokens && tokenizer_->add_bos_default());
  }
  json out = {{"count", tokens.size()}, {"max_model_len", context_length_}, {"tokens", tokens}};
  if (t.return_token_strs) {
    json strs = json::array();
    for (int32_t id : tokens) strs.push_back(tokenizer_->vocab().tokens[size_t(id)]);
    out["token_strs"] = std::move(strs);
  }
  send_json(res, 200, out);
}

void HttpServer::handle_detokenize(const httplib::Request& req, const std::string& body, httplib::Response& res) {
  if (!authenticate(req, res)) return;
  const auto parsed = parse_detokenize_request(body);
  const DetokenizeRequest* request = parsed_or_sent(parsed, res);
  if (!request || !check_model(request->model, res)) return;
  const DetokenizeRequest& d = *request;
  if (!tokenizer_) {
    send_error(res, invalid_request("this model has no vocabulary, so it cannot detokenize", "tokens", "invalid_value"));
    return;
  }
  if (auto e = check_token_ids(d.tokens, "", "tokens")) {
    send_error(res, *e);
    return;
  }
  // The same text a completion of these tokens carries (valid UTF-8).
  send_json(res, 200, {{"prompt", sanitize_utf8(tokenizer_->decode(d.tokens))}});
}

void HttpServer::handle_cache_events(const httplib::Request& req, httplib::Response& res) {
  const std::optional<AuthResult> auth = authenticate(req, res);
  if (!auth) return;
  if (!cache_events_) {
    send_error(res, error_of(404, "prefix-cache events are off: start the server with --kv-events N",
                             "invalid_request_error", "not_found"));
    return;
  }
  // after and limit: non-negative integers.
  auto number = [&](const char* name, uint64_t fallback, uint64_t* out) {
    if (!req.has_param(name)) return *out = fallback, true;
    const std::string v = req.get_param_value(name);
    if (v.empty() || v.size() > 19 || v.find_first_not_of("0123456789") != std::string::npos) {
      send_error(res, error_of(400, fmt::format("'{}' must be a non-negative integer (got '{}')", name, v),
                               "invalid_request_error", "invalid_value", name));
      return false;
    }
    *out = std::stoull(v);
    return true;
  };
  uint64_t after = 0, limit = 0;
  if (!number("after", 0, &after) || !number("limit", 1000, &limit)) return;
  CacheEventQuery query{.after = after, .max = size_t(std::clamp<uint64_t>(limit, 1, 10000))};
  // Without keys every request is the default tenant, so this filters nothing out.
  if (auth->tenant != options_.kv_events_admin) query.tenant = auth->tenant;
  const CacheEventPage page = engine_.cache_events(query);
  json events = json::array();
  for (const CacheEventRecord& r : page.events) {
    const CacheEvent& e = r.event;
    json j = {{"seq", r.seq},
              {"type", cache_event_kind_name(e.kind)},
              {"block_key", e.key.hex(key_hash_)},
              {"depth", e.depth},
              {"tenant", r.tenant}};
    j["parent_key"] = e.depth == 0 ? json(nullptr) : json(e.parent.hex(key_hash_));
    if (e.kind == CacheEventKind::Removed) j["reason"] = cache_remove_reason_name(e.reason);
    events.push_back(std::move(j));
  }
  send_json(res, 200, {{"object", "list"}, {"data", events}, {"next", page.next}, {"first_kept", page.first_kept}});
}

}  // namespace kvserve
