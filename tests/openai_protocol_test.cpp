// Request bodies parse into exactly the fields and defaults OpenAI documents;
// every wrong type, bad range and unimplemented feature is a 400 naming the
// field; responses, chunks and errors have OpenAI's exact shape.
#include "server/openai_protocol.h"

#include <gtest/gtest.h>

#include <functional>
#include <random>

namespace kvserve {
namespace {

using json = nlohmann::json;

CompletionRequest parse_ok(const std::string& body, Endpoint e = Endpoint::Completions) {
  auto r = parse_completion_request(body, e);
  if (const ApiError* err = std::get_if<ApiError>(&r)) ADD_FAILURE() << body << ": " << err->message;
  return std::holds_alternative<CompletionRequest>(r) ? std::get<CompletionRequest>(r) : CompletionRequest{};
}

ApiError parse_error(const std::string& body, Endpoint e = Endpoint::Completions) {
  auto r = parse_completion_request(body, e);
  EXPECT_TRUE(std::holds_alternative<ApiError>(r)) << body << " parsed";
  return std::holds_alternative<ApiError>(r) ? std::get<ApiError>(r) : ApiError{};
}

TEST(OpenAiProtocol, CompletionDefaultsAndFields) {
  CompletionRequest r = parse_ok(R"({"model": "m", "prompt": "hi"})");
  EXPECT_EQ(r.model, "m");
  // model is optional, as in vLLM: absent or null is "not given" (the served model).
  EXPECT_EQ(parse_ok(R"({"prompt": "hi"})").model, "");
  EXPECT_EQ(parse_ok(R"({"model": null, "prompt": "hi"})").model, "");
  ASSERT_EQ(r.prompts.size(), 1u);
  EXPECT_EQ(r.prompts[0].text, "hi");
  EXPECT_FALSE(r.prompts[0].is_tokens);
  EXPECT_EQ(r.max_tokens, 0);
  EXPECT_EQ(r.sampling.temperature, 1.0f);
  EXPECT_EQ(r.sampling.top_p, 1.0f);
  EXPECT_EQ(r.sampling.top_k, 0);
  EXPECT_FALSE(r.seed_given);
  EXPECT_FALSE(r.stream);
  EXPECT_FALSE(r.ignore_eos);

  r = parse_ok(R"({"model": "m", "prompt": [1, 2, 3], "max_tokens": 7.0, "temperature": 0, "top_p": 0.5,
                   "top_k": 40, "seed": 18446744073709551615, "stop": "\n", "stream": true,
                   "stream_options": {"include_usage": true}, "ignore_eos": true, "user": "u", "n": 1,
                   "logprobs": null, "presence_penalty": 0, "some_future_field": {"x": 1},
                   "kv": {"k": "int4", "v": "int8", "policy": "sinks", "budget": 256}})");
  ASSERT_EQ(r.prompts.size(), 1u);
  EXPECT_TRUE(r.prompts[0].is_tokens);
  EXPECT_EQ(r.prompts[0].tokens, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(r.max_tokens, 7);
  EXPECT_EQ(r.sampling.temperature, 0.0f);
  EXPECT_EQ(r.sampling.top_p, 0.5f);
  EXPECT_EQ(r.sampling.top_k, 40);
  EXPECT_EQ(r.sampling.seed, 18446744073709551615ull);
  EXPECT_TRUE(r.seed_given);
  EXPECT_EQ(r.stop, (std::vector<std::string>{"\n"}));
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.include_usage);
  EXPECT_TRUE(r.ignore_eos);
  EXPECT_EQ(r.kv.k, "int4");
  EXPECT_EQ(r.kv.v, "int8");
  EXPECT_EQ(r.kv.policy, "sinks");
  EXPECT_EQ(r.kv.budget, 256);
  EXPECT_TRUE(r.kv.sparsity_requested());

  r = parse_ok(R"({"model": "m", "prompt": "x", "presence_penalty": -0.5, "frequency_penalty": 1.5,
                   "repetition_penalty": 1.2, "min_p": 0.05, "min_tokens": 4, "stop_token_ids": [13, 2],
                   "logit_bias": {"7": -100, "12": 3.5}})");
  EXPECT_EQ(r.sampling.presence_penalty, -0.5f);
  EXPECT_EQ(r.sampling.frequency_penalty, 1.5f);
  EXPECT_EQ(r.sampling.repetition_penalty, 1.2f);
  EXPECT_EQ(r.sampling.min_p, 0.05f);
  EXPECT_EQ(r.min_tokens, 4);
  EXPECT_EQ(r.stop_token_ids, (std::vector<int32_t>{13, 2}));
  EXPECT_EQ(r.sampling.logit_bias, (std::vector<std::pair<int32_t, float>>{{12, 3.5f}, {7, -100.0f}}));

  EXPECT_FALSE(r.include_stop_str);
  EXPECT_TRUE(r.allowed_token_ids.empty());
  EXPECT_TRUE(r.bad_words.empty());
  EXPECT_EQ(r.truncate_prompt_tokens, 0);
  r = parse_ok(R"({"model": "m", "prompt": "x", "include_stop_str_in_output": true, "allowed_token_ids": [3, 9],
                   "bad_words": ["dog", " big cat"], "truncate_prompt_tokens": 12})");
  EXPECT_TRUE(r.include_stop_str);
  EXPECT_EQ(r.allowed_token_ids, (std::vector<int32_t>{3, 9}));
  EXPECT_EQ(r.bad_words, (std::vector<std::string>{"dog", " big cat"}));
  EXPECT_EQ(r.truncate_prompt_tokens, 12);
  EXPECT_EQ(r.prompt_logprobs, -1);
  EXPECT_EQ(parse_ok(R"({"model": "m", "prompt": "x", "prompt_logprobs": 5})").prompt_logprobs, 5);
  EXPECT_EQ(parse_ok(R"({"model": "m", "prompt": "x", "truncate_prompt_tokens": -1})").truncate_prompt_tokens, -1);

  EXPECT_EQ(r.logprobs, -1);
  EXPECT_EQ(r.n, 1);
  EXPECT_EQ(parse_ok(R"({"model": "m", "prompt": "x", "n": 4, "best_of": 4})").n, 4);
  EXPECT_EQ(parse_ok(R"({"model": "m", "prompt": "x", "logprobs": 3})").logprobs, 3);
  EXPECT_EQ(parse_ok(R"({"model": "m", "prompt": "x", "logprobs": false})").logprobs, -1);
  EXPECT_EQ(parse_ok(R"({"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": true})",
                     Endpoint::ChatCompletions).logprobs, 0);
  EXPECT_EQ(parse_ok(R"({"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": true,
                         "top_logprobs": 5})", Endpoint::ChatCompletions).logprobs, 5);

  r = parse_ok(R"({"model": "m", "prompt": "x", "echo": true, "max_tokens": 0, "logprobs": 1})");
  EXPECT_TRUE(r.echo);
  EXPECT_TRUE(r.prompt_only);
  EXPECT_FALSE(parse_ok(R"({"model": "m", "prompt": "x", "echo": true})").prompt_only);
  EXPECT_EQ(parse_error(R"({"model": "m", "prompt": "x", "max_tokens": 0})").param, "max_tokens");

  EXPECT_EQ(parse_ok(R"({"model": "m", "prompt": ["one"]})").prompts[0].text, "one");
  EXPECT_EQ(parse_ok(R"({"model": "m", "prompt": [[5, 6]]})").prompts[0].tokens, (std::vector<int32_t>{5, 6}));
  // A batch: strings and token arrays, each its own prompt.
  r = parse_ok(R"({"model": "m", "prompt": ["one", [7, 8], "three"]})");
  ASSERT_EQ(r.prompts.size(), 3u);
  EXPECT_EQ(r.prompts[1].tokens, (std::vector<int32_t>{7, 8}));
  EXPECT_EQ(r.prompts[2].text, "three");
  EXPECT_EQ(parse_ok(R"({"model": "m", "prompt": "x", "top_k": -1})").sampling.top_k, 0);
  EXPECT_EQ(parse_ok(R"({"model": "m", "prompt": "x", "seed": -1})").sampling.seed, ~uint64_t(0));
}

TEST(OpenAiProtocol, ChatMessages) {
  const CompletionRequest r = parse_ok(R"({"model": "m", "max_completion_tokens": 9, "messages": [
      {"role": "developer", "content": "Be brief."},
      {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]},
      {"role": "assistant", "content": null},
      {"role": "user", "content": "again", "name": "bob"}]})",
                                       Endpoint::ChatCompletions);
  ASSERT_EQ(r.messages.size(), 4u);
  EXPECT_EQ(r.messages[0].role, "system");
  EXPECT_EQ(r.messages[0].content, "Be brief.");
  EXPECT_EQ(r.messages[1].content, "Hello \nthere");  // parts are lines, as vLLM joins them
  EXPECT_EQ(r.messages[2].role, "assistant");
  EXPECT_EQ(r.messages[2].content, "");
  EXPECT_EQ(r.messages[3].content, "again");
  EXPECT_EQ(r.max_tokens, 9);
  // Limits on it name the field the client sent.
  EXPECT_EQ(r.max_tokens_param, "max_completion_tokens");
  EXPECT_EQ(parse_ok(R"({"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "x"}]})",
                     Endpoint::ChatCompletions)
                .max_tokens_param,
            "max_tokens");
}

TEST(OpenAiProtocol, MistakesNameTheField) {
  struct Case {
    const char* body;
    const char* param;
    const char* code;
    Endpoint endpoint = Endpoint::Completions;
  };
  const Endpoint chat = Endpoint::ChatCompletions;
  const Case cases[] = {
      {"", "", "invalid_json"},
      {"{\"model\": \"m\", \"prompt\": \"\xFF\"}", "", "invalid_json"},  // not UTF-8
      {"42", "", "invalid_json"},
      {R"({"model": "m", "prompt": "x", "temperature": 1e309})", "", "invalid_json"},  // past a double: was a 500
      {R"({"model": ["m"], "prompt": "x"})", "model", "invalid_type"},
      {R"({"model": 3, "prompt": "x"})", "model", "invalid_type"},
      {R"({"model": "m"})", "prompt", "missing_required_parameter"},
      {R"({"model": "m", "prompt": []})", "prompt", "invalid_value"},
      {R"({"model": "m", "prompt": ["a", 5]})", "prompt", "invalid_type"},
      {R"({"model": "m", "prompt": ["a", []]})", "prompt", "invalid_value"},
      {R"({"model": "m", "prompt": ["a", "b", "c", "d", "e"], "n": 64})", "prompt", "invalid_value"},
      {R"({"model": "m", "prompt": [1, -2]})", "prompt", "invalid_value"},
      {R"({"model": "m", "prompt": [1, 2.5]})", "prompt", "invalid_type"},
      {R"({"model": "m", "prompt": [1, "a"]})", "prompt", "invalid_type"},
      {R"({"model": "m", "prompt": "x", "max_tokens": -1})", "max_tokens", "invalid_value"},
      {R"({"model": "m", "prompt": "x", "max_tokens": 1e12})", "max_tokens", "invalid_value"},
      {R"({"model": "m", "prompt": "x", "temperature": 2.5})", "temperature", "invalid_value"},
      {R"({"model": "m", "prompt": "x", "temperature": true})", "temperature", "invalid_type"},
      {R"({"model": "m", "prompt": "x", "top_p": 0})", "top_p", "invalid_value"},
      {R"({"model": "m", "prompt": "x", "top_k": -2})", "top_k", "invalid_value"},
      {R"({"model": "m", "prompt": "x", "seed": "7"})", "seed", "invalid_type"},
      {R"({"model": "m", "prompt": "x", "stop": ["a", 1]})", "stop", "invalid_type"},
      {R"({"model": "m", "prompt": "x", "stop": ["a","b","c","d","e","f","g","h","i","j","k","l","m","n","o","p","q"]})",
       "stop", "invalid_value"},
      {R"({"model": "m", "prompt": "x", "stream": "yes"})", "stream", "invalid_type"},
      {R"({"model": "m", "prompt": "x", "stream": true, "stream_options": []})", "stream_options", "invalid_type"},
      {R"({"model": "m", "prompt": "x", "user": 5})", "user", "invalid_type"},
      {R"({"model": "m", "prompt": "x", "n": 0})", "n", "invalid_value"},
      {R"({"model": "m", "prompt": "x", "n": 65})", "n", "invalid_value"},
      {R"({"model": "m", "prompt": "x", "n": 2, "best_of": 3})", "best_of", "unsupported_parameter"},
      {R"({"model": "m", "prompt": "x", "best_of": 2})", "best_of", "unsupported_parameter"},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}], "echo": true})", "echo",
       "unsupported_parameter", chat},
      {R"({"model": "m", "prompt": "x", "suffix": "end"})", "suffix", "unsupported_parameter"},
      {R"({"model": "m", "prompt": "x", "logit_bias": {"5": 101}})", "logit_bias", "invalid_value"},
      {R"({"model": "m", "prompt": "x", "logit_bias": {"five": 1}})", "logit_bias", "invalid_value"},
      {R"({"model": "m", "prompt": "x", "logit_bias": {"5": "1"}})", "logit_bias", "invalid_type"},
      {R"({"model": "m", "prompt": "x", "logit_bias": [5]})", "logit_bias", "invalid_type"},
      {R"({"model": "m", "prompt": "x", "presence_penalty": 9})", "presence_penalty", "invalid_value"},
      {R"({"model": "m", "prompt": "x", "frequency_penalty": -2.5})", "frequency_penalty", "invalid_value"},
      {R"({"model": "m", "prompt": "x", "repetition_penalty": 0})", "repetition_penalty", "invalid_value"},
      {R"({"model": "m", "prompt": "x", "min_p": 1.1})", "min_p", "invalid_value"},
      {R"({"model": "m", "prompt": "x", "min_tokens": -1})", "min_tokens", "invalid_value"},
      {R"({"model": "m", "prompt": "x", "stop_token_ids": 13})", "stop_token_ids", "invalid_type"},
      {R"({"model": "m", "prompt": "x", "stop_token_ids": [13, -1]})", "stop_token_ids", "invalid_value"},
      {R"({"model": "m", "prompt": "x", "allowed_token_ids": []})", "allowed_token_ids", "invalid_value"},
      {R"({"model": "m", "prompt": "x", "allowed_token_ids": [3, -1]})", "allowed_token_ids", "invalid_value"},
      {R"({"model": "m", "prompt": "x", "allowed_token_ids": 3})", "allowed_token_ids", "invalid_type"},
      {R"({"model": "m", "prompt": "x", "bad_words": "dog"})", "bad_words", "invalid_type"},
      {R"({"model": "m", "prompt": "x", "bad_words": ["dog", 3]})", "bad_words", "invalid_type"},
      {R"({"model": "m", "prompt": "x", "bad_words": [" "]})", "bad_words", "invalid_value"},
      {R"({"model": "m", "prompt": "x", "truncate_prompt_tokens": 0})", "truncate_prompt_tokens", "invalid_value"},
      {R"({"model": "m", "prompt": "x", "truncate_prompt_tokens": -2})", "truncate_prompt_tokens", "invalid_value"},
      {R"({"model": "m", "prompt": "x", "include_stop_str_in_output": 1})", "include_stop_str_in_output",
       "invalid_type"},
      {R"({"model": "m", "prompt": "x", "prompt_logprobs": 21})", "prompt_logprobs", "invalid_value"},
      {R"({"model": "m", "prompt": "x", "prompt_logprobs": 1, "stream": true})", "prompt_logprobs",
       "unsupported_parameter"},
      {R"({"model": "m", "prompt": "x", "use_beam_search": true})", "use_beam_search", "unsupported_parameter"},
      {R"({"model": "m", "prompt": "x", "guided_json": {}})", "guided_json", "unsupported_parameter"},
      {R"({"model": "m", "prompt": "x", "skip_special_tokens": false})", "skip_special_tokens",
       "unsupported_parameter"},
      // Past INT64_MAX: refused, not wrapped to a negative number.
      {R"({"model": "m", "prompt": "x", "top_k": 18446744073709551615})", "top_k", "invalid_value"},
      {R"({"model": "m", "prompt": "x", "max_tokens": 9223372036854775808})", "max_tokens", "invalid_value"},
      {R"({"model": "m", "prompt": "x", "kv": "int4"})", "kv", "invalid_type"},
      {R"({"model": "m", "prompt": "x", "kv": {"budget": 0}})", "kv.budget", "invalid_value"},
      {R"({"model": "m", "prompt": "x", "kv": {"k": 4}})", "kv.k", "invalid_type"},
      {R"({"model": "m", "prompt": "x", "kv": {"pin": 1}})", "kv.pin", "invalid_type"},
      {R"({"model": "m", "prompt": "x", "stream": true, "stream_options": {"include_usage": "yes"}})",
       "stream_options.include_usage", "invalid_type"},
      {R"({"model": "m", "messages": []})", "messages", "invalid_value", chat},
      {R"({"model": "m", "messages": {"role": "user"}})", "messages", "invalid_type", chat},
      {R"({"model": "m", "messages": [{"content": "x"}]})", "messages[0].role", "missing_required_parameter", chat},
      {R"({"model": "m", "messages": [{"role": "user"}]})", "messages[0].content", "missing_required_parameter", chat},
      {R"({"model": "m", "messages": [{"role": "tool", "content": "x"}]})", "messages[0].role", "unsupported_parameter",
       chat},
      {R"({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]})", "messages[0].content",
       "unsupported_parameter", chat},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]})", "tools",
       "unsupported_parameter", chat},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})", "top_logprobs",
       "invalid_value", chat},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 21})",
       "top_logprobs", "invalid_value", chat},
      {R"({"model": "m", "prompt": "x", "logprobs": 21})", "logprobs", "invalid_value"},
      {R"({"model": "m", "prompt": "x", "logprobs": true})", "logprobs", "invalid_type"},
      {R"({"model": "m", "prompt": "x", "top_logprobs": 2})", "top_logprobs", "unsupported_parameter"},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}})",
       "response_format", "unsupported_parameter", chat},
  };
  for (const Case& c : cases) {
    const ApiError e = parse_error(c.body, c.endpoint);
    EXPECT_EQ(e.status, 400) << c.body;
    EXPECT_EQ(e.type, "invalid_request_error") << c.body;
    EXPECT_EQ(e.param, c.param) << c.body << ": " << e.message;
    EXPECT_EQ(e.code, c.code) << c.body << ": " << e.message;
    EXPECT_FALSE(e.message.empty());
  }
  EXPECT_EQ(parse_error(R"({"model": "m", "prompt": "x", "temperature": "hot"})").message,
            "'temperature' must be a number (got a string)");
  // A budget past int32 is positive: the message says it is too large.
  EXPECT_EQ(parse_error(R"({"model": "m", "prompt": "x", "kv": {"budget": 1e12}})").message,
            "'kv.budget' of 1000000000000 tokens is too large (at most 2147483647)");
  // A batch's mistakes name their prompt, as the server's later checks do.
  EXPECT_EQ(parse_error(R"({"model": "m", "prompt": [[1], []]})").message, "prompt 1: 'prompt' must not be empty");
  EXPECT_EQ(parse_error(R"({"model": "m", "prompt": ["a", "b", 3]})").message,
            "prompt 2: 'prompt' must be an array of strings or of token-id arrays (got an integer)");
}

TEST(OpenAiProtocol, ResponsesAndChunksHaveOpenAisShape) {
  const ResponseMeta meta{"cmpl-1", 1700000000, "m"};
  const RequestUsage usage{5, 3, 2};
  EXPECT_EQ(completion_response(Endpoint::Completions, meta, "abc", "length", usage),
            json::parse(R"({"id": "cmpl-1", "object": "text_completion", "created": 1700000000, "model": "m",
              "choices": [{"index": 0, "text": "abc", "logprobs": null, "finish_reason": "length"}],
              "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                        "prompt_tokens_details": {"cached_tokens": 2}}})"));
  EXPECT_EQ(completion_response(Endpoint::ChatCompletions, meta, "hi", "stop", usage)["choices"][0],
            json::parse(R"({"index": 0, "message": {"role": "assistant", "content": "hi"}, "logprobs": null,
                            "finish_reason": "stop"})"));
  EXPECT_EQ(completion_chunk(Endpoint::ChatCompletions, meta, "", {}, true, false),
            json::parse(R"({"id": "cmpl-1", "object": "chat.completion.chunk", "created": 1700000000, "model": "m",
              "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null,
                           "finish_reason": null}]})"));
  EXPECT_EQ(completion_chunk(Endpoint::ChatCompletions, meta, "", "stop", false, true)["choices"][0]["delta"],
            json::object());
  EXPECT_TRUE(completion_chunk(Endpoint::Completions, meta, "x", {}, false, true)["usage"].is_null());
  EXPECT_FALSE(completion_chunk(Endpoint::Completions, meta, "x", {}, false, false).contains("usage"));

  // Log-probabilities: completions' parallel lists (offsets from the one
  // given; the sampled token joins its alternatives, a duplicate text keeps
  // the first), chat's content entries with bytes.
  const std::vector<LogprobEntry> entries = {{" a", -0.5f, {{" a", -0.5f}, {" b", -1.5f}, {" a", -3.0f}}},
                                             {"!", -2.0f, {{"?", -0.25f}}}};
  EXPECT_EQ(logprobs_json(Endpoint::Completions, entries, 3),
            json::parse(R"({"tokens": [" a", "!"], "token_logprobs": [-0.5, -2.0],
                            "top_logprobs": [{" a": -0.5, " b": -1.5}, {"?": -0.25, "!": -2.0}],
                            "text_offset": [3, 5]})"));
  EXPECT_EQ(logprobs_json(Endpoint::ChatCompletions, {entries[1]}, 0),
            json::parse(R"({"content": [{"token": "!", "logprob": -2.0, "bytes": [33],
                            "top_logprobs": [{"token": "?", "logprob": -0.25, "bytes": [63]}]}]})"));
  // Offsets count characters: "é" is one, and a character split over two
  // byte tokens counts at its first.
  const std::vector<LogprobEntry> utf8 = {{"caf", -1.0f, {}}, {"\xC3\xA9", -1.0f, {}}, {" a", -1.0f, {}},
                                          {"\xC3", -1.0f, {}}, {"\xA9", -1.0f, {}}, {"!", -1.0f, {}}};
  EXPECT_EQ(logprobs_json(Endpoint::Completions, utf8, 0)["text_offset"], json::parse("[0, 3, 4, 6, 7, 7]"));
  // A token that is not whole UTF-8 is spelled bytes:\xNN, as OpenAI does,
  // not a lossy U+FFFD; chat's bytes stay exact.
  const json split = logprobs_json(Endpoint::Completions, utf8, 0);
  EXPECT_EQ(split["tokens"][3], "bytes:\\xc3");
  EXPECT_EQ(split["tokens"][4], "bytes:\\xa9");
  EXPECT_EQ(split["tokens"][1], "\xC3\xA9");
  EXPECT_TRUE(split["top_logprobs"][3].contains("bytes:\\xc3"));
  const json chat_split = logprobs_json(Endpoint::ChatCompletions, {utf8[3]}, 0)["content"][0];
  EXPECT_EQ(chat_split["token"], "bytes:\\xc3");
  EXPECT_EQ(chat_split["bytes"], json::parse("[195]"));
  EXPECT_EQ(completion_response(Endpoint::Completions, meta, "abc", "length", usage, json{{"x", 1}})["choices"][0]
                ["logprobs"], json({{"x", 1}}));
  const json u = usage_chunk(Endpoint::Completions, meta, usage);
  EXPECT_TRUE(u["choices"].empty());
  EXPECT_EQ(u["usage"]["total_tokens"], 8);
  EXPECT_EQ(client_finish_reason(FinishReason::Length), "length");
  EXPECT_EQ(client_finish_reason(FinishReason::Stop), "stop");
  EXPECT_EQ(model_json("m", 1, 512, 32000),
            json::parse(R"({"id": "m", "object": "model", "created": 1, "owned_by": "kvserve",
                            "max_model_len": 512, "vocab_size": 32000})"));
}

TEST(OpenAiProtocol, ErrorObjectsAndEvents) {
  EXPECT_EQ(error_json(invalid_request("bad", "temperature", "invalid_value")),
            json::parse(R"({"error": {"message": "bad", "type": "invalid_request_error", "param": "temperature",
                                      "code": "invalid_value"}})"));
  EXPECT_EQ(error_json(invalid_request("bad")),
            json::parse(R"({"error": {"message": "bad", "type": "invalid_request_error", "param": null,
                                      "code": null}})"));
  EXPECT_EQ(sse_event(json{{"a", 1}}), "data: {\"a\":1}\n\n");
  // Invalid UTF-8 never makes serialization throw.
  EXPECT_EQ(dump_json(json("a\xFF")), "\"a\xEF\xBF\xBD\"");
}


// Structure-aware fuzzing (fuzz/request_fuzz.cpp is the libFuzzer target):
// valid bodies with values swapped for values of other types and ranges,
// keys dropped, and known keys added. Every parser must return a request or
// a 400 with a message, never throw, and a parsed request must hold what
// the parser promises.
TEST(OpenAiProtocol, RandomlyMutatedBodiesParseOrGet400) {
  const std::vector<json> seeds = {
      json::parse(R"({"model":"m","prompt":"Once upon a time","max_tokens":16,"temperature":0.7,"top_p":0.9,
        "top_k":40,"stop":["\n","The end"],"seed":7,"n":2,"logprobs":3,"echo":true,"stream":true,
        "stream_options":{"include_usage":true},"presence_penalty":0.5,"frequency_penalty":-0.5,
        "logit_bias":{"13":-100},"min_p":0.05,"repetition_penalty":1.1,"min_tokens":2,"stop_token_ids":[2]})"),
      json::parse(R"({"model":"m","prompt":[[1,403,407],[1,261]],"max_tokens":4,"ignore_eos":true,
        "kv":{"k":"int4","v":"int8","policy":"sinks","budget":64,"pin":true}})"),
      json::parse(R"({"model":"m","messages":[{"role":"system","content":"You tell stories."},
        {"role":"user","content":[{"type":"text","text":"A cat."}]}],"max_completion_tokens":30,
        "logprobs":true,"top_logprobs":2,"response_format":{"type":"text"},"tools":[],"tool_choice":"none"})"),
      json::parse(R"({"prompt":"Once upon","add_special_tokens":false,"return_token_strs":true})"),
      json::parse(R"({"messages":[{"role":"user","content":"hi"}],"add_generation_prompt":true,"tokens":[1,2]})"),
  };
  const std::vector<json> values = {
      nullptr, true, false, 0, -1, 1, 2, 65, 257, 2147483647, 2147483648LL, -2147483649LL,
      json(uint64_t(9223372036854775807ULL)), json(uint64_t(18446744073709551615ULL)), 0.5, -0.0, 1e308, -1e308,
      16.0, 1e-45, "", "x", "user", "int4", "sinks", std::string(300, 'a'), "\xC3\xA9", json::array(),
      json::array({1}), json::array({json::array()}), json::array({"a", ""}), json::array({-5, 1 << 30}),
      json::object(), json({{"a", 1}}), json({{"type", "text"}}), json({{"role", "user"}, {"content", 3}})};
  const std::vector<std::string> keys = {
      "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "stop",
      "seed", "n", "logprobs", "top_logprobs", "echo", "stream", "stream_options", "presence_penalty",
      "frequency_penalty", "logit_bias", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids", "ignore_eos",
      "kv", "user", "tools", "tool_choice", "response_format", "best_of", "suffix", "add_special_tokens",
      "return_token_strs", "add_generation_prompt", "tokens", "role", "content", "type", "text", "include_usage",
      "allowed_token_ids", "bad_words", "truncate_prompt_tokens", "include_stop_str_in_output", "prompt_logprobs",
      "k", "v", "policy", "budget", "pin"};
  std::mt19937_64 rng(20261205);
  auto pick = [&](size_t n) { return size_t(rng() % n); };
  // Replaces, drops or adds one value somewhere in `j`.
  std::function<void(json&)> mutate = [&](json& j) {
    if (j.is_object() && !j.empty() && pick(3) != 0) {
      auto it = std::next(j.begin(), std::ptrdiff_t(pick(j.size())));
      if (pick(4) == 0) return void(j.erase(it));
      if (pick(2) == 0) return mutate(it.value());
      it.value() = values[pick(values.size())];
      return;
    }
    if (j.is_object()) return void(j[keys[pick(keys.size())]] = values[pick(values.size())]);
    if (j.is_array() && !j.empty() && pick(2) == 0) return mutate(j[pick(j.size())]);
    if (j.is_array() && pick(2) == 0) return j.push_back(values[pick(values.size())]);
    j = values[pick(values.size())];
  };
  auto check_error = [](const ApiError& e, const std::string& body) {
    EXPECT_EQ(e.status, 400) << body;
    EXPECT_FALSE(e.message.empty()) << body;
    EXPECT_NO_THROW((void)dump_json(error_json(e))) << body;
  };
  int parsed = 0;
  for (int i = 0; i < 4000; ++i) {
    json j = seeds[pick(seeds.size())];
    for (size_t m = 1 + pick(3); m > 0; --m) mutate(j);
    const std::string body = j.dump();
    for (Endpoint e : {Endpoint::Completions, Endpoint::ChatCompletions}) {
      std::variant<CompletionRequest, ApiError> r;
      ASSERT_NO_THROW(r = parse_completion_request(body, e)) << body;
      if (const ApiError* err = std::get_if<ApiError>(&r)) {
        check_error(*err, body);
        continue;
      }
      ++parsed;
      const CompletionRequest& c = std::get<CompletionRequest>(r);
      EXPECT_TRUE(c.n >= 1 && c.n <= kMaxChoices) << body;
      EXPECT_LE(c.stop.size(), kMaxStopStrings) << body;
      EXPECT_LE(c.prompts.size() * size_t(c.n), kMaxChoicesPerRequest) << body;
      EXPECT_TRUE(e == Endpoint::Completions ? !c.prompts.empty() : !c.messages.empty()) << body;
      EXPECT_TRUE(c.sampling.temperature >= 0 && c.sampling.temperature <= 2) << body;
      EXPECT_GE(c.max_tokens, 0) << body;
    }
    std::variant<TokenizeRequest, ApiError> t;
    ASSERT_NO_THROW(t = parse_tokenize_request(body)) << body;
    if (const ApiError* err = std::get_if<ApiError>(&t)) check_error(*err, body);
    std::variant<DetokenizeRequest, ApiError> d;
    ASSERT_NO_THROW(d = parse_detokenize_request(body)) << body;
    if (const ApiError* err = std::get_if<ApiError>(&d)) check_error(*err, body);
  }
  EXPECT_GT(parsed, 400);  // the mutations leave many bodies valid: the checks above ran on parsed requests
}

}  // namespace
}  // namespace kvserve
