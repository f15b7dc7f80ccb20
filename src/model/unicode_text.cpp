#include "model/unicode_text.h"

#include <unicode/uchar.h>

#include <algorithm>
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

// The code points of a text with their classes and byte offsets, so words
// are cut in bytes and ill-formed bytes stay inside some word.
struct CodePoints {
  std::vector<char32_t> cps;       // (n)
  std::vector<CharClass> classes;  // (n)
  std::vector<size_t> offsets;     // (n + 1), in bytes; offsets[n] == text.size()

  explicit CodePoints(std::string_view text) {
    for (size_t pos = 0; pos < text.size();) {
      size_t len;
      char32_t cp = decode_utf8(text, pos, &len);
      cps.push_back(cp);
      classes.push_back(classify(cp));
      offsets.push_back(pos);
      pos += len;
    }
    offsets.push_back(text.size());
  }
  size_t size() const { return cps.size(); }
  bool is(size_t i, CharClass c) const { return i < size() && classes[i] == c; }
  // The end of the run of class c starting at i (i itself when cps[i] is not c).
  size_t run_end(size_t i, CharClass c) const {
    while (is(i, c)) ++i;
    return i;
  }
};

// Collects consecutive words, each from where the last one ended; positions
// are code point indices.
class WordCutter {
 public:
  WordCutter(std::string_view text, const CodePoints& cp) : text_(text), cp_(cp) {}
  bool done() const { return start_ == cp_.size(); }
  size_t start() const { return start_; }
  void emit(size_t end) {
    assert(end > start_ && end <= cp_.size());
    words_.push_back(text_.substr(cp_.offsets[start_], cp_.offsets[end] - cp_.offsets[start_]));
    start_ = end;
  }
  std::vector<std::string_view> words() { return std::move(words_); }

 private:
  std::string_view text_;
  const CodePoints& cp_;
  size_t start_ = 0;  // first code point of the next word
  std::vector<std::string_view> words_;
};

// The end of the English contraction ('s 't 're 've 'm 'll 'd) at pos, or pos
// when there is none. GPT-2 matches lower case only; Llama 3 either case.
size_t contraction_end(const CodePoints& cp, size_t pos, bool any_case) {
  auto letter = [&](size_t i, char lower) {
    if (i >= cp.size()) return false;
    return cp.cps[i] == char32_t(lower) || (any_case && cp.cps[i] == char32_t(lower - 'a' + 'A'));
  };
  if (cp.cps[pos] != '\'') return pos;
  for (char c : {'s', 't', 'm', 'd'})
    if (letter(pos + 1, c)) return pos + 2;
  for (const char* pair : {"re", "ve", "ll"})
    if (letter(pos + 1, pair[0]) && letter(pos + 2, pair[1])) return pos + 3;
  return pos;
}

// '\s+(?!\S)|\s+' at the whitespace run starting at pos: before a non-space
// the run stops one short, which leaves its last space to prefix the next
// word; at the end of the text, or for a single space, it takes the whole run.
size_t trailing_space_end(const CodePoints& cp, size_t pos) {
  size_t end = cp.run_end(pos, CharClass::Space);
  assert(end > pos);
  if (end - pos > 1 && end < cp.size()) --end;
  return end;
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
  const CodePoints cp(text);
  WordCutter cut(text, cp);
  while (!cut.done()) {
    const size_t pos = cut.start();
    // 's|'t|'re|'ve|'m|'ll|'d (case-sensitive, as in GPT-2).
    if (size_t end = contraction_end(cp, pos, /*any_case=*/false); end > pos) {
      cut.emit(end);
      continue;
    }
    // ' ?\p{L}+', ' ?\p{N}+', ' ?[^\s\p{L}\p{N}]+': one optional leading space
    // joins the run of one class that follows it.
    const size_t run = cp.cps[pos] == ' ' ? pos + 1 : pos;
    if (run < cp.size() && cp.classes[run] != CharClass::Space) {
      cut.emit(cp.run_end(run, cp.classes[run]));
      continue;
    }
    cut.emit(trailing_space_end(cp, pos));
  }
  return cut.words();
}

std::vector<std::string_view> llama3_pretokenize(std::string_view text) {
  const CodePoints cp(text);
  WordCutter cut(text, cp);
  auto is_line_break = [&](size_t i) { return i < cp.size() && (cp.cps[i] == '\r' || cp.cps[i] == '\n'); };
  while (!cut.done()) {
    const size_t pos = cut.start();
    const CharClass c = cp.classes[pos];
    // (?i:'s|'t|'re|'ve|'m|'ll|'d): ASCII letters of either case.
    if (size_t end = contraction_end(cp, pos, /*any_case=*/true); end > pos) {
      cut.emit(end);
      continue;
    }
    // '[^\r\n\p{L}\p{N}]?\p{L}+': a letter run takes one character before it
    // that is neither a letter, a number nor a line break (a space, a tab,
    // punctuation), so "\tword" and "(word" stay one word each.
    const bool may_prefix = c != CharClass::Letter && c != CharClass::Number && !is_line_break(pos);
    const size_t letters = may_prefix && cp.is(pos + 1, CharClass::Letter) ? pos + 1 : pos;
    if (cp.is(letters, CharClass::Letter)) {
      cut.emit(cp.run_end(letters, CharClass::Letter));
      continue;
    }
    // '\p{N}{1,3}': numbers in groups of at most three, from the left.
    if (c == CharClass::Number) {
      cut.emit(std::min(cp.run_end(pos, CharClass::Number), pos + 3));
      continue;
    }
    // ' ?[^\s\p{L}\p{N}]+[\r\n]*': punctuation keeps the line breaks after it.
    const size_t other = cp.cps[pos] == ' ' ? pos + 1 : pos;
    if (cp.is(other, CharClass::Other)) {
      size_t end = cp.run_end(other, CharClass::Other);
      while (is_line_break(end)) ++end;
      cut.emit(end);
      continue;
    }
    // '\s*[\r\n]+': a whitespace run holding line breaks ends at its last one
    // (the spaces after it indent the next line's first word).
    assert(c == CharClass::Space);  // every other class was matched above
    size_t end = cp.run_end(pos, CharClass::Space);
    while (end > pos && !is_line_break(end - 1)) --end;
    cut.emit(end > pos ? end : trailing_space_end(cp, pos));
  }
  return cut.words();
}

}  // namespace kvserve
