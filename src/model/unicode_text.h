// Unicode helpers the tokenizers share: UTF-8 splitting and decoding, GPT-2's
// byte <-> code point mapping, and the pre-tokenizers of byte-level BPE
// vocabularies (GPT-2's and Llama 3's).
//
// All functions take arbitrary bytes: ill-formed UTF-8 never throws, so a
// tokenizer can encode any input and keep every byte.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace kvserve {

// Decodes the code point starting at text[pos] (REQUIRES: pos < text.size())
// and stores its length in bytes in *len. An ill-formed or truncated sequence
// decodes as U+FFFD with *len = 1, so every byte belongs to exactly one
// decoded code point.
char32_t decode_utf8(std::string_view text, size_t pos, size_t* len);

// Appends the UTF-8 encoding of cp (REQUIRES: cp <= U+10FFFF).
void append_utf8(std::string& out, char32_t cp);

// GPT-2's reversible byte mapping: every byte becomes one printable code point
// (printable Latin-1 bytes stand for themselves, the other 68 take U+0100
// onwards), so byte-level BPE pieces are valid text. Each byte of `bytes` maps
// to one code point; the result is UTF-8.
std::string gpt2_bytes_to_unicode(std::string_view bytes);

// The inverse of gpt2_bytes_to_unicode. Code points outside the mapping are
// kept as their own UTF-8 bytes.
std::string gpt2_unicode_to_bytes(std::string_view text);

// Splits text into the words GPT-2 merges independently, as the regex
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// does, with letters and numbers from ICU's general categories and whitespace
// the Unicode White_Space property (llama.cpp's definition). The words are
// views into text and concatenate back to it.
std::vector<std::string_view> gpt2_pretokenize(std::string_view text);

// Splits text as Llama 3's pre-tokenizer ("llama-bpe") does, with the regex
//   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|
//   \s*[\r\n]+|\s+(?!\S)|\s+
// (one regex; `(?i:` folds ASCII letters only). Unlike GPT-2 it splits numbers
// into groups of up to three digits, joins any one non-letter (not a line
// break) to the letters after it, and keeps line breaks with the punctuation
// or spaces before them. Classes and views as in gpt2_pretokenize.
std::vector<std::string_view> llama3_pretokenize(std::string_view text);

}  // namespace kvserve
