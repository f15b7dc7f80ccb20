#include "server/openai_protocol.h"

#include <fmt/format.h>

#include <charconv>
#include <cmath>
#include <limits>

#include "server/utf8_stream.h"

namespace kvserve {
namespace {

using json = nlohmann::json;

// Thrown inside the parser only; parse_completion_request turns it into a value.
struct Rejected {
  ApiError error;
};

[[noreturn]] void reject(std::string message, std::string param, std::string code = "invalid_value") {
  throw Rejected{invalid_request(std::move(message), std::move(param), std::move(code))};
}

[[noreturn]] void unsupported(const std::string& param, const std::string& what) {
  reject(what + " is not supported by kvserve", param, "unsupported_parameter");
}

std::string_view type_name(const json& j) {
  switch (j.type()) {
    case json::value_t::null: return "null";
    case json::value_t::boolean: return "a boolean";
    case json::value_t::string: return "a string";
    case json::value_t::array: return "an array";
    case json::value_t::object: return "an object";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned: return "an integer";
    case json::value_t::number_float: return "a number";
    default: return "an unknown type";
  }
}

[[noreturn]] void wrong_type(const std::string& param, std::string_view expected, const json& got) {
  reject(fmt::format("'{}' must be {} (got {})", param, expected, type_name(got)), param, "invalid_type");
}

// The field, or nullptr when it is absent or null (OpenAI treats both as "not given").
const json* field(const json& obj, const char* name) {
  const auto it = obj.find(name);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

// param: the field's full name in errors ("kv.pin"); name by default.
bool read_bool(const json& obj, const char* name, bool fallback, const char* param = nullptr) {
  const json* f = field(obj, name);
  if (!f) return fallback;
  if (!f->is_boolean()) wrong_type(param ? param : name, "a boolean", *f);
  return f->get<bool>();
}

std::string read_string(const json& obj, const char* name, const std::string& param) {
  const json* f = field(obj, name);
  if (!f) return {};
  if (!f->is_string()) wrong_type(param, "a string", *f);
  return f->get<std::string>();
}

double read_number(const json& obj, const char* name, double fallback) {
  const json* f = field(obj, name);
  if (!f) return fallback;
  if (!f->is_number()) wrong_type(name, "a number", *f);
  return f->get<double>();
}

// An integer; an integral float (16.0) is accepted, 16.5 is not.
int64_t as_integer(const json& v, const std::string& param) {
  // Unsigned first: is_number_integer() is true for unsigned values too, and
  // one past INT64_MAX would wrap to a negative number.
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > uint64_t(std::numeric_limits<int64_t>::max())) reject(fmt::format("'{}' is too large", param), param);
    return int64_t(u);
  }
  if (v.is_number_integer()) return v.get<int64_t>();
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9e15) return int64_t(d);
  }
  wrong_type(param, "an integer", v);
}

// A bounded int32 field; `fallback` when absent.
int32_t read_int(const json& obj, const char* name, int64_t lo, int64_t hi, int32_t fallback) {
  const json* f = field(obj, name);
  if (!f) return fallback;
  const int64_t v = as_integer(*f, name);
  if (v < lo || v > hi) reject(fmt::format("'{}' must be between {} and {} (got {})", name, lo, hi, v), name);
  return int32_t(v);
}

int32_t token_id(const json& v, const std::string& param) {
  const int64_t t = as_integer(v, param);
  if (t < 0 || t > std::numeric_limits<int32_t>::max()) reject(fmt::format("token id {} is out of range", t), param);
  return int32_t(t);
}

// One prompt: a string, or a non-empty array of token ids.
CompletionRequest::Prompt parse_one_prompt(const json& p, const std::string& param) {
  CompletionRequest::Prompt out;
  if (p.is_string()) {
    out.text = p.get<std::string>();
    return out;
  }
  if (!p.is_array()) wrong_type(param, "a string or an array of token ids", p);
  if (p.empty()) reject(fmt::format("'{}' must not be empty", param), param);
  out.is_tokens = true;
  out.tokens.reserve(p.size());
  for (const json& t : p) out.tokens.push_back(token_id(t, param));
  return out;
}

// "prompt": a string, token ids, or a batch: an array of strings or of
// token-id arrays.
void parse_prompt(const json& body, CompletionRequest& r) {
  const json* p = field(body, "prompt");
  if (!p) reject("'prompt' is required", "prompt", "missing_required_parameter");
  if (p->is_array() && !p->empty() && ((*p)[0].is_string() || (*p)[0].is_array())) {
    // An error names its prompt, as the server's later checks of each do.
    for (size_t i = 0; i < p->size(); ++i) {
      const json& x = (*p)[i];
      try {
        if (!x.is_string() && !x.is_array()) wrong_type("prompt", "an array of strings or of token-id arrays", x);
        r.prompts.push_back(parse_one_prompt(x, "prompt"));
      } catch (Rejected& e) {
        e.error.message = fmt::format("prompt {}: {}", i, e.error.message);
        throw;
      }
    }
    return;
  }
  r.prompts.push_back(parse_one_prompt(*p, "prompt"));
}

std::string message_content(const json& m, const std::string& role, size_t index) {
  const std::string param = fmt::format("messages[{}].content", index);
  const json* c = field(m, "content");
  if (!c) {
    if (role == "assistant") return {};
    reject(fmt::format("'{}' is required", param), param, "missing_required_parameter");
  }
  if (c->is_string()) return c->get<std::string>();
  if (!c->is_array()) wrong_type(param, "a string or an array of content parts", *c);
  // Parts are joined with newlines, as vLLM joins them for text templates:
  // "Hello" and "world" are two lines, not "Helloworld".
  std::string text;
  for (const json& part : *c) {
    if (!part.is_object()) wrong_type(param, "an array of content parts", part);
    const std::string type = read_string(part, "type", param + ".type");
    if (type != "text") unsupported(param, fmt::format("content of type '{}'", type));
    const json* t = field(part, "text");
    if (!t || !t->is_string()) reject(fmt::format("a text part of '{}' needs a string 'text'", param), param);
    if (&part != &c->front()) text += '\n';
    text += t->get<std::string>();
  }
  return text;
}

void parse_messages(const json& body, CompletionRequest& r) {
  const json* ms = field(body, "messages");
  if (!ms) reject("'messages' is required", "messages", "missing_required_parameter");
  if (!ms->is_array()) wrong_type("messages", "an array", *ms);
  if (ms->empty()) reject("'messages' must not be empty", "messages");
  for (size_t i = 0; i < ms->size(); ++i) {
    const json& m = (*ms)[i];
    const std::string param = fmt::format("messages[{}]", i);
    if (!m.is_object()) wrong_type(param, "an object", m);
    std::string role = read_string(m, "role", param + ".role");
    if (role.empty()) reject(fmt::format("'{}.role' is required", param), param + ".role", "missing_required_parameter");
    if (role == "developer") role = "system";
    if (role == "tool" || role == "function") unsupported(param + ".role", "the '" + role + "' role");
    if (role != "system" && role != "user" && role != "assistant")
      reject(fmt::format("'{}.role' must be system, user or assistant (got '{}')", param, role), param + ".role");
    if (field(m, "tool_calls")) unsupported(param + ".tool_calls", "tool calling");
    r.messages.push_back({role, message_content(m, role, i)});
  }
}

void parse_stop(const json& body, CompletionRequest& r) {
  const json* s = field(body, "stop");
  if (!s) return;
  if (s->is_string()) {
    r.stop.push_back(s->get<std::string>());
  } else if (s->is_array()) {
    if (s->size() > kMaxStopStrings) reject(fmt::format("'stop' holds at most {} strings", kMaxStopStrings), "stop");
    for (const json& x : *s) {
      if (!x.is_string()) wrong_type("stop", "a string or an array of strings", x);
      r.stop.push_back(x.get<std::string>());
    }
  } else {
    wrong_type("stop", "a string or an array of strings", *s);
  }
  for (const std::string& x : r.stop)
    if (x.empty()) reject("stop strings must not be empty", "stop");
}

void parse_stop_token_ids(const json& body, CompletionRequest& r) {
  if (const json* ids = field(body, "stop_token_ids")) {
    if (!ids->is_array()) wrong_type("stop_token_ids", "an array of token ids", *ids);
    if (ids->size() > kMaxStopTokenIds)
      reject(fmt::format("'stop_token_ids' holds at most {} ids", kMaxStopTokenIds), "stop_token_ids");
    for (const json& x : *ids) r.stop_token_ids.push_back(token_id(x, "stop_token_ids"));
  }
}

// logit_bias: {"token id": bias in [-100, 100]}, as OpenAI.
void parse_logit_bias(const json& body, SamplerOptions& sampling) {
  const json* b = field(body, "logit_bias");
  if (!b) return;
  if (!b->is_object()) wrong_type("logit_bias", "an object", *b);
  if (b->size() > kMaxLogitBias)
    reject(fmt::format("'logit_bias' holds at most {} tokens", kMaxLogitBias), "logit_bias");
  for (const auto& [key, value] : b->items()) {
    int64_t id = -1;
    const auto [end, ec] = std::from_chars(key.data(), key.data() + key.size(), id);
    if (ec != std::errc() || end != key.data() + key.size() || id < 0 || id > std::numeric_limits<int32_t>::max())
      reject(fmt::format("'logit_bias' keys must be token ids (got '{}')", key), "logit_bias");
    if (!value.is_number()) wrong_type("logit_bias", "an object of numbers", value);
    const double bias = value.get<double>();
    if (!(bias >= -100 && bias <= 100))
      reject(fmt::format("'logit_bias' values must be between -100 and 100 (got {} for token {})", bias, id),
             "logit_bias");
    sampling.logit_bias.emplace_back(int32_t(id), float(bias));
  }
}

// Completions: "logprobs": N (0..20; false or null: none). Chat:
// "logprobs": true, with "top_logprobs": N (0..20) alternatives.
void parse_logprobs(const json& body, CompletionRequest& r) {
  const int64_t most = kMaxTopLogprobs;
  const json* l = field(body, "logprobs");
  if (r.endpoint == Endpoint::Completions) {
    if (field(body, "top_logprobs")) unsupported("top_logprobs", "top_logprobs on completions (use 'logprobs': N)");
    if (!l || (l->is_boolean() && !l->get<bool>())) return;
    if (l->is_boolean()) wrong_type("logprobs", fmt::format("an integer from 0 to {} for completions", most), *l);
    const int64_t n = as_integer(*l, "logprobs");
    if (n < 0 || n > most) reject(fmt::format("'logprobs' must be between 0 and {} (got {})", most, n), "logprobs");
    r.logprobs = int32_t(n);
    return;
  }
  const bool on = read_bool(body, "logprobs", false);
  const json* t = field(body, "top_logprobs");
  if (t && !on) reject("'top_logprobs' needs 'logprobs': true", "top_logprobs");
  if (!on) return;
  r.logprobs = read_int(body, "top_logprobs", 0, most, 0);
}

// OpenAI's presence and frequency penalties, vLLM's repetition_penalty,
// min_p and min_tokens.
void parse_penalties(const json& body, CompletionRequest& r) {
  for (auto [penalty, out] : {std::pair{"presence_penalty", &r.sampling.presence_penalty},
                              std::pair{"frequency_penalty", &r.sampling.frequency_penalty}}) {
    const double p = read_number(body, penalty, 0);
    if (!(p >= -2 && p <= 2)) reject(fmt::format("'{}' must be between -2 and 2", penalty), penalty);
    *out = float(p);
  }
  const double rp = read_number(body, "repetition_penalty", 1);
  if (!(rp > 0 && rp <= 100)) reject("'repetition_penalty' must be in (0, 100]", "repetition_penalty");
  r.sampling.repetition_penalty = float(rp);
  const double min_p = read_number(body, "min_p", 0);
  if (!(min_p >= 0 && min_p <= 1)) reject("'min_p' must be in [0, 1]", "min_p");
  r.sampling.min_p = float(min_p);
  r.min_tokens = read_int(body, "min_tokens", 0, std::numeric_limits<int32_t>::max(), 0);
  parse_logit_bias(body, r.sampling);
}

// vLLM's allowed_token_ids, bad_words, truncate_prompt_tokens and
// include_stop_str_in_output.
void parse_vllm_extensions(const json& body, CompletionRequest& r) {
  if (const json* ids = field(body, "allowed_token_ids")) {
    if (!ids->is_array()) wrong_type("allowed_token_ids", "an array of token ids", *ids);
    if (ids->empty()) reject("'allowed_token_ids' must not be empty", "allowed_token_ids");
    for (const json& x : *ids) r.allowed_token_ids.push_back(token_id(x, "allowed_token_ids"));
  }
  if (const json* words = field(body, "bad_words")) {
    if (!words->is_array()) wrong_type("bad_words", "an array of strings", *words);
    if (words->size() > kMaxBadWords)
      reject(fmt::format("'bad_words' holds at most {} words", kMaxBadWords), "bad_words");
    for (const json& w : *words) {
      if (!w.is_string()) wrong_type("bad_words", "an array of strings", w);
      const std::string word = w.get<std::string>();
      if (word.find_first_not_of(" \t\n") == std::string::npos) reject("bad words must not be blank", "bad_words");
      r.bad_words.push_back(word);
    }
  }
  if (const json* t = field(body, "truncate_prompt_tokens")) {
    const int64_t n = as_integer(*t, "truncate_prompt_tokens");
    if (n == 0 || n < -1 || n > std::numeric_limits<int32_t>::max())
      reject(fmt::format("'truncate_prompt_tokens' must be a positive number of tokens, or -1 for the context length "
                         "(got {})", n),
             "truncate_prompt_tokens");
    r.truncate_prompt_tokens = int32_t(n);
  }
  r.include_stop_str = read_bool(body, "include_stop_str_in_output", false);
  r.prompt_logprobs = read_int(body, "prompt_logprobs", 0, kMaxTopLogprobs, -1);
}

void parse_kv(const json& body, KvRequest& kv) {
  const json* k = field(body, "kv");
  if (!k) return;
  if (!k->is_object()) wrong_type("kv", "an object", *k);
  for (const auto& [key, value] : k->items())
    if (key != "k" && key != "v" && key != "policy" && key != "budget" && key != "pin")
      reject(fmt::format("unknown field 'kv.{}' (known: k, v, policy, budget, pin)", key), "kv." + key,
             "unknown_parameter");
  kv.k = read_string(*k, "k", "kv.k");
  kv.v = read_string(*k, "v", "kv.v");
  kv.policy = read_string(*k, "policy", "kv.policy");
  kv.pin = read_bool(*k, "pin", false, "kv.pin");
  if (const json* b = field(*k, "budget")) {
    const int64_t v = as_integer(*b, "kv.budget");
    if (v < 1) reject(fmt::format("'kv.budget' must be a positive number of tokens (got {})", v), "kv.budget");
    if (v > std::numeric_limits<int32_t>::max())
      reject(fmt::format("'kv.budget' of {} tokens is too large (at most {})", v, std::numeric_limits<int32_t>::max()),
             "kv.budget");
    kv.budget = int32_t(v);
  }
}

// Known OpenAI fields whose non-default values ask for behaviour kvserve lacks.
void refuse_unsupported(const json& body) {
  const int32_t n = read_int(body, "n", 1, kMaxChoices, 1);
  const int32_t best_of = read_int(body, "best_of", 1, std::numeric_limits<int32_t>::max(), n);
  if (best_of != n) unsupported("best_of", "best_of other than n");
  if (!read_string(body, "suffix", "suffix").empty()) unsupported("suffix", "suffix");
  // vLLM's extensions beyond those kvserve implements: refused rather than
  // dropped when they ask for something.
  if (read_bool(body, "use_beam_search", false)) unsupported("use_beam_search", "beam search");
  if (read_number(body, "length_penalty", 1) != 1) unsupported("length_penalty", "length_penalty");
  if (!read_bool(body, "skip_special_tokens", true))
    unsupported("skip_special_tokens", "printing special tokens (skip_special_tokens false)");
  for (const char* guided :
       {"guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend"})
    if (field(body, guided)) unsupported(guided, guided);
  for (const char* tools : {"tools", "functions"})
    if (const json* t = field(body, tools); t && !(t->is_array() && t->empty())) unsupported(tools, "tool calling");
  for (const char* choice : {"tool_choice", "function_call"})
    if (const json* t = field(body, choice); t && !(t->is_string() && t->get<std::string>() == "none"))
      unsupported(choice, "tool calling");
  if (const json* f = field(body, "response_format")) {
    if (!f->is_object()) wrong_type("response_format", "an object", *f);
    if (read_string(*f, "type", "response_format.type") != "text")
      unsupported("response_format", "a response format other than text");
  }
}

json parse_object(std::string_view text) {
  json body;
  try {
    body = json::parse(text);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for numbers past a double (1e309)
    reject(fmt::format("the request body is not valid JSON: {}", e.what()), {}, "invalid_json");
  }
  if (!body.is_object()) reject(fmt::format("the request body must be a JSON object (got {})", type_name(body)), {},
                                "invalid_json");
  return body;
}

CompletionRequest parse(std::string_view text, Endpoint endpoint) {
  const json body = parse_object(text);
  CompletionRequest r;
  r.endpoint = endpoint;
  // Optional, as in vLLM (and llama.cpp's server): absent, null or "" is the
  // served model, for deployments of one model whose clients should not
  // need its name.
  r.model = read_string(body, "model", "model");
  if (endpoint == Endpoint::Completions) {
    parse_prompt(body, r);
  } else {
    parse_messages(body, r);
  }

  const int32_t kMax = std::numeric_limits<int32_t>::max();
  if (endpoint == Endpoint::Completions) {
    r.echo = read_bool(body, "echo", false);
  } else if (read_bool(body, "echo", false)) {
    unsupported("echo", "echo on chat completions");
  }
  // 0 only with echo: score the prompt, generate nothing (0 = not given below).
  r.max_tokens = read_int(body, "max_tokens", r.echo ? 0 : 1, kMax, 0);
  r.prompt_only = r.echo && field(body, "max_tokens") && r.max_tokens == 0;
  if (endpoint == Endpoint::ChatCompletions) {
    const int32_t mct = read_int(body, "max_completion_tokens", 1, kMax, 0);
    if (mct != 0 && r.max_tokens != 0 && mct != r.max_tokens)
      reject("'max_tokens' and 'max_completion_tokens' disagree; send one of them", "max_completion_tokens");
    if (mct != 0 && r.max_tokens == 0) r.max_tokens_param = "max_completion_tokens";
    if (mct != 0) r.max_tokens = mct;
  }

  r.sampling.temperature = float(read_number(body, "temperature", 1.0));
  if (!(r.sampling.temperature >= 0 && r.sampling.temperature <= 2))
    reject("'temperature' must be between 0 and 2", "temperature");
  r.sampling.top_p = float(read_number(body, "top_p", 1.0));
  if (!(r.sampling.top_p > 0 && r.sampling.top_p <= 1)) reject("'top_p' must be in (0, 1]", "top_p");
  // top_k: -1 (vLLM's "off") and 0 both keep every token.
  r.sampling.top_k = std::max(0, read_int(body, "top_k", -1, kMax, 0));
  if (const json* s = field(body, "seed")) {
    if (s->is_number_unsigned()) {
      r.sampling.seed = s->get<uint64_t>();
    } else {
      r.sampling.seed = uint64_t(as_integer(*s, "seed"));
    }
    r.seed_given = true;
  }
  parse_stop(body, r);
  parse_stop_token_ids(body, r);
  parse_penalties(body, r);
  parse_logprobs(body, r);
  parse_vllm_extensions(body, r);
  r.n = read_int(body, "n", 1, kMaxChoices, 1);
  if (r.prompts.size() * size_t(r.n) > kMaxChoicesPerRequest)
    reject(fmt::format("{} prompts x n = {} is more than {} choices per request", r.prompts.size(),
                       r.prompts.size() * size_t(r.n), kMaxChoicesPerRequest),
           "prompt");

  r.stream = read_bool(body, "stream", false);
  if (const json* so = field(body, "stream_options")) {
    if (!so->is_object()) wrong_type("stream_options", "an object", *so);
    if (!r.stream) reject("'stream_options' is only allowed when 'stream' is true", "stream_options");
    r.include_usage = read_bool(*so, "include_usage", false, "stream_options.include_usage");
  }
  if (r.stream && r.prompt_logprobs >= 0)
    unsupported("prompt_logprobs", "prompt_logprobs with stream (as in vLLM)");
  r.ignore_eos = read_bool(body, "ignore_eos", false);
  if (const json* u = field(body, "user"); u && !u->is_string()) wrong_type("user", "a string", *u);
  parse_kv(body, r.kv);
  refuse_unsupported(body);
  return r;
}

json choice_base(std::string_view finish_reason, int index) {
  json c = {{"index", index}, {"logprobs", nullptr}};
  c["finish_reason"] = finish_reason.empty() ? json(nullptr) : json(std::string(finish_reason));
  return c;
}

}  // namespace

ApiError invalid_request(std::string message, std::string param, std::string code) {
  ApiError e;
  e.message = std::move(message);
  e.param = std::move(param);
  e.code = std::move(code);
  return e;
}

json error_json(const ApiError& e) {
  return {{"error",
           {{"message", e.message},
            {"type", e.type},
            {"param", e.param.empty() ? json(nullptr) : json(e.param)},
            {"code", e.code.empty() ? json(nullptr) : json(e.code)}}}};
}

namespace {

// A parser's result, or the 400 it was rejected with.
template <typename Parse>
auto rejected_as_error(Parse parse) -> std::variant<decltype(parse()), ApiError> {
  try {
    return parse();
  } catch (const Rejected& r) {
    return r.error;
  }
}

}  // namespace

std::variant<CompletionRequest, ApiError> parse_completion_request(std::string_view body, Endpoint endpoint) {
  return rejected_as_error([&] { return parse(body, endpoint); });
}

std::variant<TokenizeRequest, ApiError> parse_tokenize_request(std::string_view text) {
  return rejected_as_error([&] {
    const json body = parse_object(text);
    TokenizeRequest r;
    r.model = read_string(body, "model", "model");
    r.return_token_strs = read_bool(body, "return_token_strs", false);
    const bool has_prompt = field(body, "prompt") != nullptr;
    if (has_prompt == (field(body, "messages") != nullptr))
      reject("send either 'prompt' (text) or 'messages' (a chat)", has_prompt ? "messages" : "prompt",
             "missing_required_parameter");
    if (has_prompt) {
      r.prompt = read_string(body, "prompt", "prompt");
      r.add_special_tokens = read_bool(body, "add_special_tokens", true);
      return r;
    }
    r.chat = true;
    CompletionRequest chat;
    parse_messages(body, chat);
    r.messages = std::move(chat.messages);
    // The chat endpoint always opens the assistant's turn; so does this.
    if (!read_bool(body, "add_generation_prompt", true))
      unsupported("add_generation_prompt", "a chat rendered without the assistant's turn (add_generation_prompt false)");
    if (read_bool(body, "continue_final_message", false))
      unsupported("continue_final_message", "continuing the final message");
    return r;
  });
}

std::variant<DetokenizeRequest, ApiError> parse_detokenize_request(std::string_view text) {
  return rejected_as_error([&] {
    const json body = parse_object(text);
    DetokenizeRequest r;
    r.model = read_string(body, "model", "model");
    const json* t = field(body, "tokens");
    if (!t) reject("'tokens' is required", "tokens", "missing_required_parameter");
    if (!t->is_array()) wrong_type("tokens", "an array of token ids", *t);
    r.tokens.reserve(t->size());
    for (const json& id : *t) r.tokens.push_back(token_id(id, "tokens"));
    return r;
  });
}

std::string_view client_finish_reason(FinishReason r) {
  return r == FinishReason::Length ? "length" : "stop";
}

json usage_json(const RequestUsage& u) {
  return {{"prompt_tokens", u.prompt_tokens},
          {"completion_tokens", u.completion_tokens},
          {"total_tokens", u.prompt_tokens + u.completion_tokens},
          {"prompt_tokens_details", {{"cached_tokens", u.cached_tokens}}}};
}

size_t text_characters(std::string_view text) {
  // Every byte but UTF-8 continuation bytes starts a character; a token that
  // ends mid-character (a byte token) leaves the rest to the next.
  size_t n = 0;
  for (unsigned char c : text) n += (c & 0xC0) != 0x80;
  return n;
}

// A token's text as the client sees it. A token that is not whole UTF-8 (a
// byte-fallback token, part of one character) is spelled as OpenAI spells
// it, bytes:\xe2\x80, instead of a lossy U+FFFD.
std::string token_label(const std::string& token) {
  if (sanitize_utf8(token) == token) return token;
  std::string label = "bytes:";
  for (unsigned char c : token) label += fmt::format("\\x{:02x}", c);
  return label;
}

json logprobs_json(Endpoint endpoint, const std::vector<LogprobEntry>& entries, size_t text_offset) {
  if (endpoint == Endpoint::ChatCompletions) {
    auto bytes = [](const std::string& s) {
      json b = json::array();
      for (unsigned char c : s) b.push_back(int(c));
      return b;
    };
    json content = json::array();
    for (const LogprobEntry& e : entries) {
      json top = json::array();
      for (const auto& [token, lp] : e.top)
        top.push_back({{"token", token_label(token)}, {"logprob", lp}, {"bytes", bytes(token)}});
      content.push_back(
          {{"token", token_label(e.token)}, {"logprob", e.logprob}, {"bytes", bytes(e.token)}, {"top_logprobs", top}});
    }
    return {{"content", content}};
  }
  json tokens = json::array(), token_logprobs = json::array(), top_logprobs = json::array(), offsets = json::array();
  for (const LogprobEntry& e : entries) {
    tokens.push_back(token_label(e.token));
    offsets.push_back(text_offset);
    text_offset += text_characters(e.token);
    if (!e.scored) {
      token_logprobs.push_back(nullptr);
      top_logprobs.push_back(nullptr);
      continue;
    }
    token_logprobs.push_back(e.logprob);
    // Alternatives and the sampled token, as {text: logprob}; tokens with
    // the same text keep the more likely (OpenAI returns up to N + 1).
    json top = json::object();
    for (const auto& [token, lp] : e.top)
      if (!top.contains(token_label(token))) top[token_label(token)] = lp;
    if (!top.contains(token_label(e.token))) top[token_label(e.token)] = e.logprob;
    top_logprobs.push_back(std::move(top));
  }
  return {{"tokens", tokens}, {"token_logprobs", token_logprobs}, {"top_logprobs", top_logprobs}, {"text_offset", offsets}};
}

json prompt_logprobs_json(const std::vector<PromptLogprob>& entries) {
  json out = json::array({nullptr});
  for (const PromptLogprob& e : entries) {
    json position = json::object();
    for (size_t k = 0; k < e.top.size(); ++k)
      position[std::to_string(e.top[k].token)] = {
          {"logprob", e.top[k].logprob}, {"rank", k + 1}, {"decoded_token", token_label(e.top[k].text)}};
    position[std::to_string(e.token)] = {{"logprob", e.logprob}, {"rank", e.rank}, {"decoded_token", token_label(e.text)}};
    out.push_back(std::move(position));
  }
  return out;
}

json choice_json(Endpoint endpoint, int index, const std::string& text, std::string_view finish_reason,
                 const json& logprobs) {
  json choice = choice_base(finish_reason, index);
  choice["logprobs"] = logprobs;
  if (endpoint == Endpoint::ChatCompletions) {
    choice["message"] = {{"role", "assistant"}, {"content", text}};
  } else {
    choice["text"] = text;
  }
  return choice;
}

json completion_response(Endpoint endpoint, const ResponseMeta& meta, json choices, const RequestUsage& usage) {
  const bool chat = endpoint == Endpoint::ChatCompletions;
  return {{"id", meta.id},
          {"object", chat ? "chat.completion" : "text_completion"},
          {"created", meta.created},
          {"model", meta.model},
          {"choices", std::move(choices)},
          {"usage", usage_json(usage)}};
}

json completion_response(Endpoint endpoint, const ResponseMeta& meta, const std::string& text,
                         std::string_view finish_reason, const RequestUsage& usage, const json& logprobs) {
  return completion_response(endpoint, meta, json::array({choice_json(endpoint, 0, text, finish_reason, logprobs)}),
                             usage);
}

json completion_chunk(Endpoint endpoint, const ResponseMeta& meta, const std::string& text,
                      std::string_view finish_reason, bool with_role, bool usage_null, const json& logprobs,
                      int index) {
  json choice = choice_base(finish_reason, index);
  choice["logprobs"] = logprobs;
  const bool chat = endpoint == Endpoint::ChatCompletions;
  if (chat) {
    json delta = json::object();
    if (with_role) delta["role"] = "assistant";
    if (with_role || !text.empty()) delta["content"] = text;
    choice["delta"] = delta;
  } else {
    choice["text"] = text;
  }
  json j = {{"id", meta.id},
            {"object", chat ? "chat.completion.chunk" : "text_completion"},
            {"created", meta.created},
            {"model", meta.model},
            {"choices", json::array({choice})}};
  if (usage_null) j["usage"] = nullptr;
  return j;
}

json usage_chunk(Endpoint endpoint, const ResponseMeta& meta, const RequestUsage& usage) {
  return {{"id", meta.id},
          {"object", endpoint == Endpoint::ChatCompletions ? "chat.completion.chunk" : "text_completion"},
          {"created", meta.created},
          {"model", meta.model},
          {"choices", json::array()},
          {"usage", usage_json(usage)}};
}

json model_json(const std::string& name, int64_t created, int32_t max_model_len, int32_t vocab_size) {
  return {{"id", name},           {"object", "model"},       {"created", created},
          {"owned_by", "kvserve"}, {"max_model_len", max_model_len}, {"vocab_size", vocab_size}};
}

std::string dump_json(const json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string sse_event(const json& j) {
  return "data: " + dump_json(j) + "\n\n";
}

}  // namespace kvserve
