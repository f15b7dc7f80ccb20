#include "model/unicode_text.h"

#include <unicode/uchar.h>

#include <array>
#include <cassert>

namespace kvserve {
namespace {

constexpr char32_t kReplacement = 0xFFFD;

// GPT-2's bytes_to_unicode table and its inverse. The printable Latin-1 bytes
// ('!'..'~', U+00A1..U+00AC, U+00AE..U+00FF) map to themselves; the 68 others
// (controls, space, DEL, U+0080..U+00A0, soft hyphen) map to U+0100.. in
// byte order, which is why a space shows as "Ġ" (U+0120) in GPT-2 pieces.
struct Gpt2ByteMap {
  static constexpr size_t kCodePoints = 256 + 68;  // every code point the map produces
  std::array<char32_t, 256> to_code_point{};
  std::array<int16_t, kCodePoints> to_byte{};      // -1: not produced by the map

  constexpr Gpt2ByteMap() {
    to_byte.fill(-1);
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      char32_t cp = printable ? char32_t(b) : next++;
      to_code_point[size_t(b)] = cp;
      to_byte[cp] = int16_t(b);
    }
  }
};

constexpr Gpt2ByteMap kGpt2ByteMap;

enum class CharClass : uint8_t { Letter, Number, Space, Other };

CharClass classify(char32_t cp) {
  if (u_isUWhiteSpace(UChar32(cp))) return CharClass::Space;
  uint32_t mask = U_GET_GC_MASK(UChar32(cp));
  if (mask & U_GC_L_MASK) return CharClass::Letter;
  if (mask & U_GC_N_MASK) return CharClass::Number;
  return CharClass::Other;
}

}  // namespace

char32_t decode_utf8(std::string_view text, size_t pos, size_t* len) {
  assert(pos < text.size());
  *len = 1;
  const auto lead = uint8_t(text[pos]);
  if (lead < 0x80) return lead;
  size_t n;
  char32_t cp;
  char32_t min;  // smallest code point of this length: smaller ones are overlong
  if (lead >= 0xC2 && lead <= 0xDF) {
    n = 2, cp = lead & 0x1F, min = 0x80;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    n = 3, cp = lead & 0x0F, min = 0x800;
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    n = 4, cp = lead & 0x07, min = 0x10000;
  } else {
    return kReplacement;
  }
  if (n > text.size() - pos) return kReplacement;
  for (size_t i = 1; i < n; ++i) {
    const auto b = uint8_t(text[pos + i]);
    if ((b & 0xC0) != 0x80) return kReplacement;
    cp = (cp << 6) | (b & 0x3F);
  }
  if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return kReplacement;
  *len = n;
  return cp;
}

void append_utf8(std::string& out, char32_t cp) {
  assert(cp <= 0x10FFFF);
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xC0 | (cp >> 6));
    out += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += char(0xE0 | (cp >> 12));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  } else {
    out += char(0xF0 | (cp >> 18));
    out += char(0x80 | ((cp >> 12) & 0x3F));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  }
}

std::string gpt2_bytes_to_unicode(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size() * 2);
  for (char b : bytes) append_utf8(out, kGpt2ByteMap.to_code_point[uint8_t(b)]);
  return out;
}

std::string gpt2_unicode_to_bytes(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (size_t pos = 0; pos < text.size();) {
    size_t len;
    char32_t cp = decode_utf8(text, pos, &len);
    int byte = cp < Gpt2ByteMap::kCodePoints ? kGpt2ByteMap.to_byte[cp] : -1;
    if (byte >= 0) {
      out += char(byte);
    } else {
      out.append(text.substr(pos, len));
    }
    pos += len;
  }
  return out;
}

std::vector<std::string_view> gpt2_pretokenize(std::string_view text) {
  // Code points with their byte offsets (offsets[n] == text.size()), so words
  // are cut in bytes and ill-formed bytes stay inside some word.
  std::vector<char32_t> cps;          // (n)
  std::vector<CharClass> classes;     // (n)
  std::vector<size_t> offsets;        // (n + 1), in bytes
  for (size_t pos = 0; pos < text.size();) {
    size_t len;
    char32_t cp = decode_utf8(text, pos, &len);
    cps.push_back(cp);
    classes.push_back(classify(cp));
    offsets.push_back(pos);
    pos += len;
  }
  const size_t n = cps.size();
  offsets.push_back(text.size());

  std::vector<std::string_view> words;
  size_t start = 0;  // first code point of the word being matched
  auto emit = [&](size_t end) {
    words.push_back(text.substr(offsets[start], offsets[end] - offsets[start]));
    start = end;
  };
  auto is = [&](size_t i, CharClass c) { return i < n && classes[i] == c; };

  while (start < n) {
    const size_t pos = start;
    const char32_t cp = cps[pos];
    // 's|'t|'re|'ve|'m|'ll|'d (case-sensitive, as in GPT-2).
    if (cp == '\'' && pos + 1 < n) {
      const char32_t c1 = cps[pos + 1];
      if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') {
        emit(pos + 2);
        continue;
      }
      if (pos + 2 < n) {
        const char32_t c2 = cps[pos + 2];
        if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) {
          emit(pos + 3);
          continue;
        }
      }
    }
    // ' ?\p{L}+', ' ?\p{N}+', ' ?[^\s\p{L}\p{N}]+': one optional leading space
    // joins the run of one class that follows it.
    const size_t run = cp == ' ' ? pos + 1 : pos;
    if (run < n && classes[run] != CharClass::Space) {
      const CharClass c = classes[run];
      size_t end = run;
      while (is(end, c)) ++end;
      emit(end);
      continue;
    }
    // Whitespace. '\s+(?!\S)' stops one short of a following non-space, which
    // leaves that last space to prefix the next word; at the end of the text,
    // or for a single space, '\s+' takes the whole run.
    size_t end = pos;
    while (is(end, CharClass::Space)) ++end;
    assert(end > pos);  // every other class was matched above
    if (end - pos > 1 && end < n) --end;
    emit(end);
  }
  return words;
}

}  // namespace kvserve
