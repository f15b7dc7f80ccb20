#include "server/http_framing.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <string>
#include <vector>

namespace kvserve {
namespace {

ApiError framing(int status, std::string message, std::string code) {
  ApiError e = invalid_request(std::move(message), {}, std::move(code));
  e.status = status;
  return e;
}

ApiError bad_framing(std::string message) { return framing(400, std::move(message), "invalid_http_framing"); }

// The transfer codings of every Transfer-Encoding header, in order, lower case.
std::vector<std::string> transfer_codings(const httplib::Request& req) {
  std::vector<std::string> codings;
  for (size_t h = 0, n = req.get_header_value_count("Transfer-Encoding"); h < n; ++h) {
    const std::string value = req.get_header_value("Transfer-Encoding", h);
    size_t pos = 0;
    do {
      const size_t end = std::min(value.find(',', pos), value.size());
      std::string coding = value.substr(pos, end - pos);
      coding.erase(0, coding.find_first_not_of(" \t"));
      coding.erase(coding.find_last_not_of(" \t") + 1);
      std::transform(coding.begin(), coding.end(), coding.begin(), [](unsigned char ch) { return std::tolower(ch); });
      codings.push_back(std::move(coding));
      pos = end + 1;
    } while (pos <= value.size());
  }
  return codings;
}

}  // namespace

std::optional<ApiError> framing_error(const httplib::Request& req, size_t max_body_bytes, size_t refuse_past) {
  if (refuse_past == 0) refuse_past = max_body_bytes;
  const size_t n_lengths = req.get_header_value_count("Content-Length");
  if (req.has_header("Transfer-Encoding")) {
    const std::vector<std::string> codings = transfer_codings(req);
    const std::string list = req.get_header_value("Transfer-Encoding");
    if (codings.back() != "chunked")
      return bad_framing(fmt::format("Transfer-Encoding '{}' does not end in chunked, so the request body has no "
                                     "length; send it chunked or with a Content-Length",
                                     list));
    if (codings.size() > 1)
      return framing(501, fmt::format("Transfer-Encoding '{}' is not supported: send the body chunked only, or with "
                                      "a Content-Length",
                                      list),
                     "unsupported_transfer_encoding");
    if (n_lengths > 0) return bad_framing("the request has both Content-Length and Transfer-Encoding");
    if (req.version == "HTTP/1.0") return bad_framing("an HTTP/1.0 request cannot have a Transfer-Encoding");
  }
  uint64_t length = 0;
  for (size_t h = 0; h < n_lengths; ++h) {
    const std::string value = req.get_header_value("Content-Length", h);
    uint64_t v = 0;
    const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
    // from_chars takes no sign, space or empty text: digits only, as RFC 9110 asks.
    if (ec != std::errc() || end != value.data() + value.size())
      return bad_framing(fmt::format("Content-Length '{}' is not a byte count (a decimal number of at most 64 bits)",
                                     value));
    if (h > 0 && v != length)
      return bad_framing(fmt::format("the request has two different Content-Length headers ({} and {})", length, v));
    length = v;
  }
  // httplib reads a body only for these methods; another one's would be read as the next request.
  static const char* const kBodyMethods[] = {"POST", "PUT", "PATCH", "DELETE", "PRI"};
  const bool reads_body =
      std::any_of(std::begin(kBodyMethods), std::end(kBodyMethods), [&](const char* m) { return req.method == m; });
  if (!reads_body && (length > 0 || req.has_header("Transfer-Encoding")))
    return bad_framing(fmt::format("{} {} request has no body here", req.method.find_first_of("AEIOU") == 0 ? "an" : "a", req.method));
  if (length > refuse_past)
    return framing(413, fmt::format("the request body is too large (limit {} bytes; Content-Length {})",
                                    max_body_bytes, length),
                   "payload_too_large");
  return std::nullopt;
}

}  // namespace kvserve
