// Streamed text must reach a client as valid UTF-8, but the engine emits the
// bytes of each token: a byte-fallback tokenizer can split one character over
// several tokens ("<0xE2>" "<0x80>" "<0x94>"), and a JSON string cannot hold a
// partial character. Utf8Stream holds back an incomplete trailing sequence
// until its last byte arrives and replaces ill-formed bytes with U+FFFD, so
// every piece it returns is valid UTF-8 and the pieces concatenate to the text
// the non-streaming response carries.
//
// Thread safety: none; one per request.
#pragma once

#include <string>
#include <string_view>

namespace kvserve {

class Utf8Stream {
 public:
  // Appends bytes; returns the text that is complete now (possibly empty).
  [[nodiscard]] std::string push(std::string_view bytes);
  // Ends the stream: a held-back incomplete sequence becomes U+FFFD.
  [[nodiscard]] std::string finish();

 private:
  std::string pending_;  // an incomplete sequence at the end of the bytes so far (at most 3 bytes)
};

// Bytes as valid UTF-8: each ill-formed or truncated sequence becomes U+FFFD.
[[nodiscard]] std::string sanitize_utf8(std::string_view bytes);

}  // namespace kvserve
