// Request body framing (RFC 9112 section 6) that cpp-httplib 0.11 does not
// check. httplib takes the first Content-Length header, reads a negative or
// 64-bit-overflowing one as a huge length, treats any Transfer-Encoding but
// "chunked" as "read until the client closes", and lets a chunked encoding
// override a Content-Length. Behind a proxy that frames the same bytes
// otherwise, the rest of such a body would be read as the next request
// (request smuggling), so these requests are refused before any of their
// body is read, and their connection is closed after the answer.
#pragma once

#include <httplib.h>

#include <cstddef>
#include <optional>

#include "server/openai_protocol.h"

namespace kvserve {

// The error for a request whose body framing is ambiguous, unsupported or
// past max_body_bytes (in bytes), or nullopt when it is sound:
//   400 invalid_http_framing: Content-Length not one decimal number of at most
//       64 bits, or several different ones; Transfer-Encoding whose last
//       coding is not chunked, with a Content-Length as well, or in an
//       HTTP/1.0 request; a body on a method httplib reads none for (GET ...);
//   501 unsupported_transfer_encoding: a coding before chunked (gzip, chunked);
//   413 payload_too_large: a Content-Length past `refuse_past` bytes (by
//       default max_body_bytes, the limit the message names).
// A request with neither header passes (its body, if any, is empty).
[[nodiscard]] std::optional<ApiError> framing_error(const httplib::Request& req, size_t max_body_bytes,
                                                    size_t refuse_past = 0);

}  // namespace kvserve
