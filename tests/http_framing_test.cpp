// framing_error: every body framing RFC 9112 leaves ambiguous, unsupported
// or past the cap is refused with its status and code; sound ones pass.
#include "server/http_framing.h"

#include <gtest/gtest.h>

namespace kvserve {
namespace {

httplib::Request request(std::string method, std::initializer_list<std::pair<std::string, std::string>> headers,
                         std::string version = "HTTP/1.1") {
  httplib::Request r;
  r.method = std::move(method);
  r.version = std::move(version);
  for (const auto& [k, v] : headers) r.headers.emplace(k, v);
  return r;
}

// The status and code of the refusal, or {0, ""} when the framing passes.
std::pair<int, std::string> refusal(const httplib::Request& r, size_t cap = 100) {
  const std::optional<ApiError> e = framing_error(r, cap);
  return e ? std::pair(e->status, e->code) : std::pair(0, std::string());
}

const std::pair<int, std::string> kPass{0, ""};
const std::pair<int, std::string> kBad{400, "invalid_http_framing"};

TEST(HttpFramingTest, SoundFramingPasses) {
  EXPECT_EQ(refusal(request("POST", {})), kPass);
  EXPECT_EQ(refusal(request("POST", {{"Content-Length", "0"}})), kPass);
  EXPECT_EQ(refusal(request("POST", {{"Content-Length", "100"}})), kPass);
  EXPECT_EQ(refusal(request("POST", {{"Content-Length", "7"}, {"Content-Length", "7"}})), kPass);
  EXPECT_EQ(refusal(request("POST", {{"Transfer-Encoding", "chunked"}})), kPass);
  EXPECT_EQ(refusal(request("POST", {{"Transfer-Encoding", "Chunked"}})), kPass);
  EXPECT_EQ(refusal(request("GET", {{"Content-Length", "0"}})), kPass);
  EXPECT_EQ(refusal(request("PUT", {{"Content-Length", "5"}})), kPass);
}

TEST(HttpFramingTest, ContentLengthsMustBeOneDecimalNumberOf64Bits) {
  for (const char* v : {"-1", "+5", "", " ", "abc", "5 5", "5, 5", "0x10", "99999999999999999999", "18446744073709551616"})
    EXPECT_EQ(refusal(request("POST", {{"Content-Length", v}})), kBad) << v;
  EXPECT_EQ(refusal(request("POST", {{"Content-Length", "7"}, {"Content-Length", "3"}})), kBad);
  // 2^64 - 1 is a number, and past the cap.
  EXPECT_EQ(refusal(request("POST", {{"Content-Length", "18446744073709551615"}})),
            std::pair(413, std::string("payload_too_large")));
  EXPECT_EQ(refusal(request("POST", {{"Content-Length", "101"}})), std::pair(413, std::string("payload_too_large")));
  // With a later refusal point (the server's pre-routing check: 4x the cap),
  // lengths up to it pass, and the message still names the cap.
  EXPECT_FALSE(framing_error(request("POST", {{"Content-Length", "400"}}), 100, 400));
  const std::optional<ApiError> e = framing_error(request("POST", {{"Content-Length", "401"}}), 100, 400);
  ASSERT_TRUE(e);
  EXPECT_NE(e->message.find("limit 100 bytes"), std::string::npos) << e->message;
  EXPECT_NE(framing_error(request("OPTIONS", {{"Content-Length", "4"}}), 100)->message.find("an OPTIONS request"),
            std::string::npos);
}

TEST(HttpFramingTest, TransferEncodingsOtherThanChunkedAreRefused) {
  EXPECT_EQ(refusal(request("POST", {{"Transfer-Encoding", "gzip"}})), kBad);
  EXPECT_EQ(refusal(request("POST", {{"Transfer-Encoding", "chunked, gzip"}})), kBad);
  EXPECT_EQ(refusal(request("POST", {{"Transfer-Encoding", "gzip, chunked"}})),
            std::pair(501, std::string("unsupported_transfer_encoding")));
  EXPECT_EQ(refusal(request("POST", {{"Transfer-Encoding", "gzip"}, {"Transfer-Encoding", "chunked"}})),
            std::pair(501, std::string("unsupported_transfer_encoding")));
  EXPECT_EQ(refusal(request("POST", {{"Transfer-Encoding", "chunked"}, {"Transfer-Encoding", "chunked"}})),
            std::pair(501, std::string("unsupported_transfer_encoding")));
  EXPECT_EQ(refusal(request("POST", {{"Transfer-Encoding", "chunked"}, {"Content-Length", "5"}})), kBad);
  EXPECT_EQ(refusal(request("POST", {{"Transfer-Encoding", "chunked"}}, "HTTP/1.0")), kBad);
}

TEST(HttpFramingTest, BodiesOnMethodsHttplibDoesNotReadAreRefused) {
  EXPECT_EQ(refusal(request("GET", {{"Content-Length", "5"}})), kBad);
  EXPECT_EQ(refusal(request("HEAD", {{"Transfer-Encoding", "chunked"}})), kBad);
  EXPECT_EQ(refusal(request("OPTIONS", {{"Content-Length", "1"}})), kBad);
}

}  // namespace
}  // namespace kvserve
