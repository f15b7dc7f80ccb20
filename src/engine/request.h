// What a client asks of the engine and what the engine tells it back: a
// Request goes in through Engine::submit; RequestEvents come out, one per
// generated token and a final one, on the engine's thread.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "attention/sparsity_policy.h"
#include "engine/sampler.h"
#include "engine/token_logprobs.h"

namespace kvserve {

using RequestId = uint64_t;

enum class FinishReason : uint8_t {
  None,       // still running
  Stop,       // end-of-sequence token or a stop string
  Length,     // max_tokens generated, or the model's context is full
  Cancelled,  // the client went away or asked to stop
  Error,      // the request could not be served (message in the event)
};
std::string_view finish_reason_name(FinishReason r);  // "stop", "length", "cancelled", "error"

// Token counts in OpenAI's terms.
struct RequestUsage {
  int32_t prompt_tokens = 0;
  int32_t completion_tokens = 0;
  int32_t cached_tokens = 0;      // prompt tokens whose KV came from the prefix cache
};

// One thing the engine reports about a request, on the engine's thread.
struct RequestEvent {
  RequestId id = 0;
  int32_t token = -1;             // the new token, or -1 in a final event without one
  std::string text;               // its text (held back while it may start a stop string)
  FinishReason finish = FinishReason::None;  // != None: the last event of this request
  std::string error;              // with FinishReason::Error
  bool request_error = false;     // with FinishReason::Error: the request's own options made it fail (a 400, not a 500)
  RequestUsage usage;             // up to date at every event
  double ttft_seconds = 0;        // arrival to first token (0 until known)
  // With Request::logprobs >= 0, for `token` (events without a token have none).
  std::optional<TokenLogprobs> logprobs;
  // With Request::prompt_logprobs, on the request's first event: the
  // prompt's tokens after the first, in order.
  std::vector<TokenLogprobs> prompt_logprobs;
};

// Receives a request's events in order. Runs on the engine thread: keep it
// short (hand the event to another thread); it must not call back into the
// engine except Engine::cancel.
using RequestCallback = std::function<void(const RequestEvent&)>;

struct Request {
  std::vector<int32_t> prompt;    // token ids, BOS included when wanted
  int32_t max_tokens = 16;        // tokens to generate, >= 1
  SamplerOptions sampling;
  bool stop_at_eos = true;        // stop at the tokenizer's EOS and end-of-turn tokens (and BOS, as llama2.c)
  std::vector<std::string> stop;  // stop strings: generation ends before the first match
  bool include_stop_str = false;  // ... or after it: the matched stop string stays in the text
  std::vector<int32_t> stop_token_ids;  // also end the generation (even with stop_at_eos false)
  // Before this many tokens are generated, the end tokens above cannot be
  // sampled and stop strings are not looked for (vLLM's min_tokens).
  int32_t min_tokens = 0;
  // >= 0: each generated token's log-probability and this many most likely
  // alternatives (0..kMaxTopLogprobs) ride on its event; -1: none.
  int32_t logprobs = -1;
  // Also the log-probabilities of the prompt's tokens after the first, with
  // `logprobs` alternatives (OpenAI's echo; needs logprobs >= 0). Every
  // position's logits are needed, so the prompt is computed, never taken
  // from the prefix cache. max_tokens may then be 0: score the prompt only.
  bool prompt_logprobs = false;
  std::string tenant;             // authenticated tenant (set by the server, not the client);
                                  // empty = the default tenant
  std::string session;            // non-empty: prefix caching in this session's own scope
  // KV sparsity for this request (policy "full" = every token kept and read;
  // empty = the engine's default, EngineOptions::sparsity). Sequences under
  // an evicting policy neither use nor feed the prefix cache: after an
  // eviction a slot no longer holds the token its block key names.
  SparsityOptions sparsity = {.policy = ""};
  // Pin the prompt's blocks in the prefix cache once computed (a hot system
  // prompt that must survive bursts of one-off requests); pins never exceed
  // PrefixCacheOptions::max_pinned_fraction of the cache.
  bool pin_prefix = false;
  RequestCallback on_event;
};

}  // namespace kvserve
