// The OpenAI wire format: completion and chat-completion request bodies parsed
// and validated into CompletionRequest, and the JSON kvserve sends back
// (responses, streamed chunks, usage, model lists, error objects).
//
// Parsing checks only what the body alone decides (JSON syntax, field types,
// ranges, features kvserve does not implement); what depends on the served
// model (its name, context length, KV configuration, vocabulary) is checked by
// the server. Unknown fields are ignored, as OpenAI-compatible servers do, but
// known fields asking for unimplemented behaviour (n > 1, logprobs, penalties,
// tools, echo...) are refused rather than silently ignored.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/request.h"
#include "engine/sampler.h"
#include "server/chat_template.h"

namespace kvserve {

// An error as the client sees it: the HTTP status and OpenAI's error object
// {"error": {"message", "type", "param", "code"}}.
struct ApiError {
  int status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;  // the offending field; empty = null
  std::string code;   // machine-readable reason; empty = null
};
[[nodiscard]] ApiError invalid_request(std::string message, std::string param = {}, std::string code = {});
[[nodiscard]] nlohmann::json error_json(const ApiError& e);

enum class Endpoint : uint8_t { Completions, ChatCompletions };

// The kvserve extension "kv": {...}: per-request KV options, checked by the
// server against what it allows (kv_request.h).
struct KvRequest {
  std::string k;        // key storage type asked for ("int4"); empty = the server's
  std::string v;        // value storage type; empty = the server's
  std::string policy;   // sparsity policy name; empty = none
  int32_t budget = 0;   // tokens the policy keeps; 0 = not given
  bool pin = false;     // pin the prompt's blocks in the prefix cache (a hot system prompt)

  bool sparsity_requested() const { return !policy.empty() || budget != 0; }
};

struct CompletionRequest {
  Endpoint endpoint = Endpoint::Completions;
  std::string model;  // empty: not given (the served model)
  // Completions: one prompt or a batch of them (each a text, or token ids
  // when is_tokens); each gets n choices.
  struct Prompt {
    std::string text;
    std::vector<int32_t> tokens;
    bool is_tokens = false;
  };
  std::vector<Prompt> prompts;
  std::vector<ChatMessage> messages;      // chat; "developer" is read as system, text parts joined
  int32_t max_tokens = 0;                 // 0 = not given: the endpoint's default applies
  std::string max_tokens_param = "max_tokens";  // the field it came from (chat: or max_completion_tokens)
  SamplerOptions sampling;                // OpenAI's defaults: temperature 1, top_p 1; top_k 0 (all)
  bool seed_given = false;                // sampling.seed came from the client
  std::vector<std::string> stop;          // stop strings, each non-empty
  std::vector<int32_t> stop_token_ids;    // extension (vLLM): token ids that also end the text
  int32_t min_tokens = 0;                 // extension (vLLM): no end token or stop string before this many
  bool include_stop_str = false;          // extension (vLLM's include_stop_str_in_output): keep the matched stop string
  std::vector<int32_t> allowed_token_ids; // extension (vLLM): only these may be sampled; empty = all
  std::vector<std::string> bad_words;     // extension (vLLM): words whose tokens may not be generated in a row
  // extension (vLLM): keep only the prompt's last N tokens; 0 = off, -1 = the context length
  int32_t truncate_prompt_tokens = 0;
  // Log-probabilities: the alternatives wanted per generated token
  // (completions' "logprobs": N; chat's "top_logprobs" with "logprobs":
  // true), -1 = none.
  int32_t logprobs = -1;
  // vLLM's prompt_logprobs: each prompt token's log-probability, rank and
  // this many alternatives (0..20), on each choice; -1 = none. Not streamed.
  int32_t prompt_logprobs = -1;
  // Completions' echo: the prompt's text (and, with logprobs, its tokens'
  // log-probabilities) before the completion. prompt_only: echo with
  // max_tokens 0, the prompt scored and nothing generated.
  bool echo = false;
  bool prompt_only = false;
  int32_t n = 1;                          // choices: one engine request each, sharing the prompt's KV
  bool stream = false;
  bool include_usage = false;             // stream_options.include_usage
  bool ignore_eos = false;                // extension (vLLM's name): keep generating past EOS
  KvRequest kv;
};

inline constexpr size_t kMaxStopStrings = 16;
inline constexpr int32_t kMaxChoices = 64;
inline constexpr size_t kMaxChoicesPerRequest = 256;  // prompts x n
inline constexpr size_t kMaxStopTokenIds = 64;
inline constexpr size_t kMaxLogitBias = 300;  // OpenAI's limit
inline constexpr size_t kMaxBadWords = 256;

// Parses a request body for `endpoint`. Returns the request or the 400 to send.
[[nodiscard]] std::variant<CompletionRequest, ApiError> parse_completion_request(std::string_view body,
                                                                               Endpoint endpoint);

// POST /tokenize (vLLM's): a text prompt, or chat messages rendered as the
// chat endpoint renders them (the assistant's turn opened).
struct TokenizeRequest {
  std::string model;                  // empty: not given
  bool chat = false;                  // messages rather than prompt
  std::string prompt;
  bool add_special_tokens = true;     // prompt: BOS as the model adds it (messages: the template decides)
  std::vector<ChatMessage> messages;
  bool return_token_strs = false;     // also the vocabulary's piece of each token
};
[[nodiscard]] std::variant<TokenizeRequest, ApiError> parse_tokenize_request(std::string_view body);

// POST /detokenize (vLLM's): token ids back to text.
struct DetokenizeRequest {
  std::string model;                  // empty: not given
  std::vector<int32_t> tokens;        // may be empty
};
[[nodiscard]] std::variant<DetokenizeRequest, ApiError> parse_detokenize_request(std::string_view body);

// What every response object of one request shares.
struct ResponseMeta {
  std::string id;        // "cmpl-…" or "chatcmpl-…"
  int64_t created = 0;   // Unix seconds
  std::string model;     // the served model name
};

// The finish_reason a client sees: "stop" or "length" (others never reach a
// successful response).
[[nodiscard]] std::string_view client_finish_reason(FinishReason r);

// {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details": {"cached_tokens"}}
[[nodiscard]] nlohmann::json usage_json(const RequestUsage& u);
// One generated token's log-probabilities, in text form for the client.
struct LogprobEntry {
  std::string token;                               // the token's text
  float logprob = 0;
  std::vector<std::pair<std::string, float>> top;  // the most likely alternatives, first first
  bool scored = true;  // false: an echoed prompt's first token, which nothing predicts (nulls)
};
// Characters of UTF-8 text, as a client's string counts them (completions'
// text_offset): bytes that do not continue a character.
[[nodiscard]] size_t text_characters(std::string_view text);
// A choice's "logprobs" for `entries`. Completions: {"tokens",
// "token_logprobs", "top_logprobs" (each a {text: logprob} object of the
// alternatives and the sampled token), "text_offset" (from text_offset)};
// chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}.
[[nodiscard]] nlohmann::json logprobs_json(Endpoint endpoint, const std::vector<LogprobEntry>& entries,
                                           size_t text_offset);
// vLLM's prompt_logprobs: one entry per prompt token after the first.
struct PromptLogprob {
  int32_t token = -1;
  float logprob = 0;
  int32_t rank = 0;      // 1 = the most likely token there
  std::string text;      // the token's text after the one before it
  struct Alternative {
    int32_t token;
    float logprob;
    std::string text;
  };
  std::vector<Alternative> top;  // most likely first (rank = index + 1)
};
// [null, {"<id>": {"logprob", "rank", "decoded_token"}, ...}, ...]: null for
// the first prompt token, which nothing predicts; each object holds the
// prompt token and its alternatives.
[[nodiscard]] nlohmann::json prompt_logprobs_json(const std::vector<PromptLogprob>& entries);
// A whole non-streamed response ("text_completion" or "chat.completion").
// logprobs: the choice's "logprobs" (null when not asked for).
[[nodiscard]] nlohmann::json completion_response(Endpoint endpoint, const ResponseMeta& meta, const std::string& text,
                                                 std::string_view finish_reason, const RequestUsage& usage,
                                                 const nlohmann::json& logprobs = nullptr);
// One choice of a whole response; completion_response with several (n).
[[nodiscard]] nlohmann::json choice_json(Endpoint endpoint, int index, const std::string& text,
                                         std::string_view finish_reason, const nlohmann::json& logprobs = nullptr);
[[nodiscard]] nlohmann::json completion_response(Endpoint endpoint, const ResponseMeta& meta, nlohmann::json choices,
                                                 const RequestUsage& usage);
// One streamed chunk. finish_reason empty = null. with_role: chat's first chunk
// names the assistant role. usage_null: with stream_options.include_usage every
// chunk but the last carries "usage": null, as OpenAI's do. index: the choice.
[[nodiscard]] nlohmann::json completion_chunk(Endpoint endpoint, const ResponseMeta& meta, const std::string& text,
                                              std::string_view finish_reason, bool with_role, bool usage_null,
                                              const nlohmann::json& logprobs = nullptr, int index = 0);
// The last chunk with stream_options.include_usage: no choices, the usage.
[[nodiscard]] nlohmann::json usage_chunk(Endpoint endpoint, const ResponseMeta& meta, const RequestUsage& usage);

// One model in GET /v1/models, with vLLM's "max_model_len" and kvserve's
// "vocab_size" (load generators need both).
[[nodiscard]] nlohmann::json model_json(const std::string& name, int64_t created, int32_t max_model_len,
                                        int32_t vocab_size);

// Serializes JSON; invalid UTF-8 in strings becomes U+FFFD instead of throwing.
[[nodiscard]] std::string dump_json(const nlohmann::json& j);
// One server-sent event carrying j: "data: {...}\n\n".
[[nodiscard]] std::string sse_event(const nlohmann::json& j);
inline constexpr std::string_view kSseDone = "data: [DONE]\n\n";

}  // namespace kvserve
