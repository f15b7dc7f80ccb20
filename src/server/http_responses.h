// How the HTTP server's routes answer: JSON bodies and OpenAI error objects
// on an httplib response. Shared by http_server.cpp (completions, models,
// health, metrics) and http_side_routes.cpp (tokenize, detokenize, KV events).
#pragma once

#include <string>
#include <variant>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "server/openai_protocol.h"

namespace kvserve {

// Sets res's status and its body to body, serialized (dump_json).
void send_json(httplib::Response& res, int status, const nlohmann::json& body);
// e as an OpenAI error object with e's status.
void send_error(httplib::Response& res, const ApiError& e);
[[nodiscard]] ApiError error_of(int status, std::string message, std::string type, std::string code,
                                std::string param = {});

// The parsed request, or nullptr after sending its 400.
template <typename T>
const T* parsed_or_sent(const std::variant<T, ApiError>& parsed, httplib::Response& res) {
  if (const ApiError* e = std::get_if<ApiError>(&parsed)) {
    send_error(res, *e);
    return nullptr;
  }
  return &std::get<T>(parsed);
}

}  // namespace kvserve
