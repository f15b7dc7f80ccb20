#include "server/utf8_stream.h"

#include "model/unicode_text.h"

namespace kvserve {
namespace {

// Length of the sequence a lead byte announces; 0 for bytes that cannot lead.
size_t sequence_length(unsigned char lead) {
  if (lead < 0x80) return 1;
  if (lead >= 0xC2 && lead <= 0xDF) return 2;
  if (lead >= 0xE0 && lead <= 0xEF) return 3;
  if (lead >= 0xF0 && lead <= 0xF4) return 4;
  return 0;
}

// Whether text[pos..] is the start of a multi-byte sequence whose remaining
// bytes have not arrived yet (every byte present is a continuation byte).
bool incomplete_tail(std::string_view text, size_t pos) {
  const size_t need = sequence_length(static_cast<unsigned char>(text[pos]));
  if (need < 2 || pos + need <= text.size()) return false;
  for (size_t i = pos + 1; i < text.size(); ++i)
    if ((static_cast<unsigned char>(text[i]) & 0xC0) != 0x80) return false;
  return true;
}

// Appends the well-formed part of text[0, end), replacing ill-formed bytes.
void append_sanitized(std::string& out, std::string_view text, size_t end) {
  for (size_t pos = 0; pos < end;) {
    size_t len = 1;
    // A non-ASCII byte that decodes alone is ill-formed (decode_utf8 gives U+FFFD, length 1).
    if (decode_utf8(text, pos, &len) == 0xFFFD && len == 1 && static_cast<unsigned char>(text[pos]) >= 0x80) {
      append_utf8(out, 0xFFFD);
    } else {
      out.append(text.substr(pos, len));
    }
    pos += len;
  }
}

}  // namespace

std::string Utf8Stream::push(std::string_view bytes) {
  pending_.append(bytes);
  const std::string_view text = pending_;
  // An incomplete sequence can only start within the last 3 bytes.
  size_t end = text.size();
  for (size_t back = 1; back <= 3 && back <= text.size(); ++back) {
    if (incomplete_tail(text, text.size() - back)) {
      end = text.size() - back;
      break;
    }
  }
  std::string out;
  append_sanitized(out, text, end);
  pending_.erase(0, end);
  return out;
}

std::string Utf8Stream::finish() {
  std::string out;
  append_sanitized(out, pending_, pending_.size());
  pending_.clear();
  return out;
}

std::string sanitize_utf8(std::string_view bytes) {
  std::string out;
  append_sanitized(out, bytes, bytes.size());
  return out;
}

}  // namespace kvserve
