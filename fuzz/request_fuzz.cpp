// libFuzzer target for the HTTP API's request parsers
// (src/server/openai_protocol): every input is offered as a request body to
// parse_completion_request (completions and chat), parse_tokenize_request and
// parse_detokenize_request. Each must return a request or an ApiError (a 400
// with a message, a status and an error object that serializes); any
// exception, crash or sanitizer report is a bug. A parsed request must hold
// what the parser promises (n choices, bounded stop lists, at least one
// prompt). See fuzz/README.md.
//
// Built with -DKVSERVE_FUZZ_WRITE_SEEDS the same file writes the seed corpus:
// valid bodies using most fields.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string_view>

#include "server/openai_protocol.h"

namespace kvserve {
namespace {

[[noreturn]] void bug(const char* what) {
  std::fprintf(stderr, "request_fuzz: %s\n", what);
  std::abort();
}

void check_error(const ApiError& e) {
  if (e.status < 400 || e.status > 499) bug("a refused body got a status outside 4xx");
  if (e.message.empty()) bug("a refused body got no message");
  (void)dump_json(error_json(e));  // must not throw, whatever bytes the message quotes
}

void check_completion(std::string_view body, Endpoint endpoint) {
  auto parsed = parse_completion_request(body, endpoint);
  if (const ApiError* e = std::get_if<ApiError>(&parsed)) return check_error(*e);
  const CompletionRequest& r = std::get<CompletionRequest>(parsed);
  if (r.n < 1 || r.n > kMaxChoices) bug("n outside 1..kMaxChoices");
  if (r.stop.size() > kMaxStopStrings) bug("more stop strings than allowed");
  if (endpoint == Endpoint::Completions && r.prompts.empty()) bug("a completion without a prompt");
  if (endpoint == Endpoint::ChatCompletions && r.messages.empty()) bug("a chat without messages");
  if (r.prompts.size() * size_t(r.n) > kMaxChoicesPerRequest) bug("more choices than allowed");
  if (!(r.sampling.temperature >= 0 && r.sampling.temperature <= 2)) bug("temperature outside [0, 2]");
}

}  // namespace
}  // namespace kvserve

#ifndef KVSERVE_FUZZ_WRITE_SEEDS

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvserve;
  const std::string_view body(reinterpret_cast<const char*>(data), size);
  try {
    check_completion(body, Endpoint::Completions);
    check_completion(body, Endpoint::ChatCompletions);
    auto t = parse_tokenize_request(body);
    if (const ApiError* e = std::get_if<ApiError>(&t)) check_error(*e);
    auto d = parse_detokenize_request(body);
    if (const ApiError* e = std::get_if<ApiError>(&d)) check_error(*e);
  } catch (...) {
    bug("a parser threw instead of returning a 400");
  }
  return 0;
}

#else

// request_fuzz_seeds OUT_DIR: writes valid bodies as seeds.
int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT_DIR\n", argv[0]);
    return 2;
  }
  const std::filesystem::path out = argv[1];
  std::filesystem::create_directories(out);
  const char* seeds[] = {
      R"({"model":"m","prompt":"Once upon a time","max_tokens":16,"temperature":0.7,"top_p":0.9,"top_k":40,)"
      R"("stop":["\n","The end"],"seed":7,"n":2,"logprobs":3,"echo":true,"stream":true,)"
      R"("stream_options":{"include_usage":true},"presence_penalty":0.5,"frequency_penalty":-0.5,)"
      R"("logit_bias":{"13":-100},"min_p":0.05,"repetition_penalty":1.1,"min_tokens":2,"stop_token_ids":[2]})",
      R"({"model":"m","prompt":[[1,403,407],[1,261]],"max_tokens":4,"ignore_eos":true,)"
      R"("kv":{"k":"int4","v":"int8","policy":"sinks","budget":64,"pin":true}})",
      R"({"model":"m","messages":[{"role":"system","content":"You tell stories."},)"
      R"({"role":"user","content":[{"type":"text","text":"A cat."}]}],"max_completion_tokens":30,)"
      R"("logprobs":true,"top_logprobs":2,"response_format":{"type":"text"},"tools":[],"tool_choice":"none"})",
      R"({"prompt":"Once upon","add_special_tokens":false,"return_token_strs":true})",
      R"({"messages":[{"role":"user","content":"hi"}],"add_generation_prompt":true})",
      R"({"model":"m","tokens":[1,403,407,261]})",
  };
  int i = 0;
  for (const char* s : seeds) std::ofstream(out / ("body" + std::to_string(i++) + ".json")) << s;
  return 0;
}

#endif
