#include "model/tokenizer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <queue>

#include "model/gguf_reader.h"
#include "model/unicode_text.h"
#include "util/error.h"
#include "util/mapped_file.h"

namespace kvserve {
namespace {

// SentencePiece writes a space as U+2581 ("▁") inside pieces.
constexpr std::string_view kSpmSpace = "\xE2\x96\x81";

// llama2.c hard-codes these ids; its tokenizer export writes BOS and EOS as
// "\n<s>\n" and "\n</s>\n", which we rename as llama.cpp's converter does so a
// .bin and its GGUF conversion give identical vocabularies.
constexpr int32_t kLlama2cUnk = 0;
constexpr int32_t kLlama2cBos = 1;
constexpr int32_t kLlama2cEos = 2;

std::string replace_all(std::string_view text, std::string_view from, std::string_view to) {
  std::string out;
  out.reserve(text.size());
  for (size_t pos = 0;;) {
    size_t hit = text.find(from, pos);
    if (hit == std::string_view::npos) {
      out.append(text.substr(pos));
      return out;
    }
    out.append(text.substr(pos, hit - pos));
    out.append(to);
    pos = hit + from.size();
  }
}

// The byte a "<0xXX>" piece stands for, or -1 when the piece is not one.
int parse_byte_piece(std::string_view piece) {
  if (piece.size() != 6 || !piece.starts_with("<0x") || piece[5] != '>') return -1;
  auto hex = [](char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  int hi = hex(piece[3]);
  int lo = hex(piece[4]);
  return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

// Checks what encode and decode rely on; `source` names the vocabulary in messages.
void validate(const Vocab& v, std::string_view source) {
  const size_t n = v.tokens.size();
  if (n == 0) fail("{}: the vocabulary has no tokens", source);
  if (n > size_t(std::numeric_limits<int32_t>::max())) fail("{}: {} tokens is too many", source, n);
  if (v.scores.size() != n) fail("{}: {} scores for {} tokens", source, v.scores.size(), n);
  if (v.types.size() != n) fail("{}: {} token types for {} tokens", source, v.types.size(), n);
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(v.scores[i])) fail("{}: token {} has a non-finite score", source, i);
    if (uint8_t(v.types[i]) > uint8_t(TokenType::Byte))
      fail("{}: token {} has unknown type {}", source, i, uint8_t(v.types[i]));
  }
  auto check_id = [&](int32_t id, std::string_view what) {
    if (id < 0 || size_t(id) >= n) fail("{}: {} id {} is outside the vocabulary of {}", source, what, id, n);
  };
  check_id(v.bos_id, "BOS");
  check_id(v.eos_id, "EOS");
  if (v.unk_id != -1) check_id(v.unk_id, "unknown-token");
  for (int32_t id : v.end_of_turn_ids) check_id(id, "end-of-turn");
}

// Control tokens that end a turn in the chat templates of common models
// (Llama 3, ChatML/Qwen, Phi-3, Gemma, CodeLlama, DeepSeek, GPT-2 style).
constexpr std::string_view kEndOfTurnPieces[] = {
    "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
    "<|end_of_text|>", "<EOT>", "<\uff5cend\u2581of\u2581sentence\uff5c>",
};

// The end-of-turn ids: `named_ids` (those the GGUF's keys name, in range),
// then the control tokens spelled like one; EOS left out.
std::vector<int32_t> find_end_of_turn_ids(const Vocab& v, const std::vector<int32_t>& named_ids) {
  std::vector<int32_t> ids;
  auto add = [&](int32_t id) {
    if (id != v.eos_id && std::find(ids.begin(), ids.end(), id) == ids.end()) ids.push_back(id);
  };
  for (int32_t id : named_ids) add(id);
  for (size_t i = 0; i < v.tokens.size(); ++i) {
    if (v.types[i] != TokenType::Control && v.types[i] != TokenType::UserDefined) continue;
    for (std::string_view piece : kEndOfTurnPieces)
      if (v.tokens[i] == piece) add(int32_t(i));
  }
  return ids;
}

// One symbol of a BPE merge: bytes [begin, begin + len) of the text. Symbols
// form a doubly linked list (-1 ends it) so merging two neighbours is O(1);
// a symbol merged into its left neighbour keeps len = 0.
struct Symbol {
  int32_t prev;
  int32_t next;
  uint32_t begin;  // in bytes
  uint32_t len;    // in bytes
};

// A candidate merge of two neighbouring symbols.
struct Candidate {
  float priority;
  int32_t left;
  int32_t right;
  uint32_t len;  // left.len + right.len when pushed; a mismatch later means stale

  // Max-heap order: highest priority first, then the leftmost pair.
  bool operator<(const Candidate& o) const {
    return priority < o.priority || (priority == o.priority && left > o.left);
  }
};

// Greedy BPE over the UTF-8 characters of `text` (REQUIRES: text not empty;
// each ill-formed byte is a character of its own, as in llama2.c):
// repeatedly merges the adjacent pair with the highest priority(left, right),
// the leftmost among equals, until no pair may merge (priority returns
// nullopt). This is the order llama.cpp merges in. A heap of candidates keeps
// it O(n log n) on long texts; candidates made stale by a neighbour's merge are
// recognised by their length and skipped. Returns all symbols; the live ones
// are the list starting at index 0.
template <class Priority>
std::vector<Symbol> merge_symbols(std::string_view text, Priority&& priority) {
  std::vector<Symbol> syms;
  for (size_t pos = 0; pos < text.size();) {
    size_t len;
    decode_utf8(text, pos, &len);
    int32_t i = int32_t(syms.size());
    syms.push_back({i - 1, pos + len < text.size() ? i + 1 : -1, uint32_t(pos), uint32_t(len)});
    pos += len;
  }

  auto candidate = [&](int32_t left, int32_t right) -> std::optional<Candidate> {
    if (left < 0 || right < 0) return std::nullopt;
    const Symbol& l = syms[size_t(left)];
    const Symbol& r = syms[size_t(right)];
    std::optional<float> p = priority(text.substr(l.begin, l.len), text.substr(r.begin, r.len));
    if (!p) return std::nullopt;
    return Candidate{*p, left, right, l.len + r.len};
  };
  // Heapify the initial pairs in O(n) rather than pushing them one by one.
  std::vector<Candidate> initial;
  for (size_t i = 1; i < syms.size(); ++i) {
    if (auto c = candidate(int32_t(i - 1), int32_t(i))) initial.push_back(*c);
  }
  std::priority_queue<Candidate> heap(std::less<Candidate>(), std::move(initial));
  auto try_pair = [&](int32_t left, int32_t right) {
    if (auto c = candidate(left, right)) heap.push(*c);
  };

  while (!heap.empty()) {
    Candidate c = heap.top();
    heap.pop();
    Symbol& l = syms[size_t(c.left)];
    Symbol& r = syms[size_t(c.right)];
    if (l.len == 0 || r.len == 0 || l.len + r.len != c.len) continue;
    l.len += r.len;
    r.len = 0;
    l.next = r.next;
    if (r.next >= 0) syms[size_t(r.next)].prev = c.left;
    try_pair(l.prev, c.left);
    try_pair(c.left, l.next);
  }
  return syms;
}

// A stretch of the text to encode, or a user-defined token cut out of it.
struct Fragment {
  std::string_view text;  // empty for a token
  int32_t token;          // -1 for text
};

// Cuts the user-defined tokens `ids` (longest first) out of text as llama.cpp
// does: one token after the other, each at every place it occurs in the text
// the tokens before it left, leftmost first. So where two overlap the longer
// wins, even when the shorter starts further left. No fragment is empty.
std::vector<Fragment> cut_user_defined(std::string_view text, const Vocab& v, std::span<const int32_t> ids) {
  std::vector<Fragment> fragments{{text, -1}};
  std::vector<Fragment> next;
  for (int32_t id : ids) {
    const std::string& piece = v.tokens[size_t(id)];
    next.clear();
    for (const Fragment& f : fragments) {
      if (f.token >= 0) {
        next.push_back(f);
        continue;
      }
      std::string_view rest = f.text;
      for (size_t hit; (hit = rest.find(piece)) != std::string_view::npos;) {
        if (hit > 0) next.push_back({rest.substr(0, hit), -1});
        next.push_back({{}, id});
        rest.remove_prefix(hit + piece.size());
      }
      if (!rest.empty()) next.push_back({rest, -1});
    }
    fragments.swap(next);
  }
  return fragments;
}

// The pre-tokenizer a "gpt2" vocabulary names. "default" and a missing key
// (GGUFs older than the key) keep GPT-2's split, as kvserve did before it read
// the key; llama.cpp splits those with a regex chain of its own, a known
// difference. Any other name is refused: BPE over the wrong words gives the
// model token sequences it was never trained on.
PreTokenizer parse_pre_tokenizer(const std::string& name, std::string_view source) {
  if (name.empty() || name == "default" || name == "gpt-2" || name == "gpt2") return PreTokenizer::Gpt2;
  if (name == "llama-bpe" || name == "llama3" || name == "llama-v3") return PreTokenizer::Llama3;
  fail("{}: pre-tokenizer '{}' (tokenizer.ggml.pre) is not supported; kvserve implements 'gpt-2' and "
       "'llama-bpe' (Llama 3)",
       source, name);
}

}  // namespace

Vocab load_llama2c_vocab(const std::string& path, int32_t vocab_size) {
  if (vocab_size <= kLlama2cEos)
    fail("{}: vocab_size {} is too small (llama2.c reserves ids 0-2 for <unk>, <s>, </s>)", path, vocab_size);
  MappedFile file(path);
  const uint8_t* data = file.data();
  const size_t size = file.size();
  size_t pos = 0;
  // `token` is the record being read, -1 for the header.
  auto need = [&](size_t bytes, std::string_view what, int32_t token) {
    if (bytes <= size - pos) return;
    if (token < 0) fail("{}: truncated tokenizer file: no {} (file is {} bytes)", path, what, size);
    fail("{}: truncated tokenizer file: token {} of {} has no {} (file is {} bytes)", path, token,
         vocab_size, what, size);
  };
  auto read_i32 = [&](std::string_view what, int32_t token) {
    need(4, what, token);
    int32_t v;
    std::memcpy(&v, data + pos, 4);
    pos += 4;
    return v;
  };
  auto read_f32 = [&](std::string_view what, int32_t token) {
    need(4, what, token);
    float v;
    std::memcpy(&v, data + pos, 4);
    pos += 4;
    return v;
  };

  const int32_t max_token_length = read_i32("max_token_length", -1);
  if (max_token_length <= 0) fail("{}: max_token_length {} must be positive", path, max_token_length);

  Vocab v;
  v.kind = TokenizerKind::SentencePiece;
  v.bos_id = kLlama2cBos;
  v.eos_id = kLlama2cEos;
  v.unk_id = kLlama2cUnk;
  v.add_bos = true;
  v.add_space_prefix = true;
  v.tokens.reserve(size_t(vocab_size));
  v.scores.reserve(size_t(vocab_size));
  v.types.reserve(size_t(vocab_size));
  for (int32_t id = 0; id < vocab_size; ++id) {
    const float score = read_f32("score", id);
    if (!std::isfinite(score)) fail("{}: token {} has a non-finite score", path, id);
    const int32_t len = read_i32("length", id);
    if (len < 0 || len > max_token_length)
      fail("{}: token {} has length {}, outside 0..max_token_length ({})", path, id, len, max_token_length);
    need(size_t(len), "text", id);
    std::string_view piece(reinterpret_cast<const char*>(data + pos), size_t(len));
    pos += size_t(len);

    TokenType type = TokenType::Normal;
    if (id == kLlama2cUnk) {
      piece = "<unk>", type = TokenType::Unknown;
    } else if (id == kLlama2cBos) {
      piece = "<s>", type = TokenType::Control;
    } else if (id == kLlama2cEos) {
      piece = "</s>", type = TokenType::Control;
    } else if (piece.empty()) {
      type = TokenType::Control;  // as llama.cpp's converter types it
    } else if (parse_byte_piece(piece) >= 0) {
      type = TokenType::Byte;
    }
    v.tokens.push_back(replace_all(piece, " ", kSpmSpace));
    v.scores.push_back(score);
    v.types.push_back(type);
  }
  if (pos != size)
    fail("{}: {} bytes follow the {} tokens (is this the tokenizer of a model with another vocab_size?)",
         path, size - pos, vocab_size);
  validate(v, path);
  return v;
}

Vocab load_gguf_vocab(const GgufFile& file) {
  const std::string& path = file.path();
  const std::string model = file.get_string("tokenizer.ggml.model");
  Vocab v;
  if (model == "llama") {
    v.kind = TokenizerKind::SentencePiece;
  } else if (model == "gpt2") {
    v.kind = TokenizerKind::Gpt2Bpe;
  } else {
    fail("{}: tokenizer model '{}' is not supported (kvserve reads 'llama' and 'gpt2')", path, model);
  }
  const bool spm = v.kind == TokenizerKind::SentencePiece;

  v.tokens = file.get_string_array("tokenizer.ggml.tokens");
  const size_t n = v.tokens.size();
  if (file.has("tokenizer.ggml.scores")) {
    const auto& scores = file.get_float_array("tokenizer.ggml.scores");
    if (scores.size() != n) fail("{}: {} scores for {} tokens", path, scores.size(), n);
    v.scores.assign(scores.begin(), scores.end());
  } else {
    v.scores.assign(n, 0.0f);
  }
  if (file.has("tokenizer.ggml.token_type")) {
    const auto& types = file.get_int_array("tokenizer.ggml.token_type");
    if (types.size() != n) fail("{}: {} token types for {} tokens", path, types.size(), n);
    v.types.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      if (types[i] < 0 || types[i] > int64_t(TokenType::Byte))
        fail("{}: token {} has unknown type {}", path, i, types[i]);
      v.types.push_back(TokenType(types[i]));
    }
  } else {
    v.types.assign(n, TokenType::Normal);
  }
  if (!spm) {
    v.merges = file.get_string_array("tokenizer.ggml.merges");
    // SentencePiece vocabularies have no pre-tokenizer; llama.cpp ignores the key for them.
    v.pre = parse_pre_tokenizer(file.get_string_or("tokenizer.ggml.pre", ""), path);
  }

  // Ids are stored as u32, with 0xFFFFFFFF (or -1) for "none", which only unk
  // and the end-of-turn ids may be. A GPT-2 vocabulary has no conventional
  // BOS/EOS ids, so it must name them; SentencePiece ones default to llama's
  // 1, 2 and 0.
  auto read_id = [&](const std::string& key, std::optional<int64_t> fallback) {
    int64_t id = fallback ? file.get_int_or(key, *fallback) : file.get_int(key);
    if (id == -1 || id == 0xFFFFFFFF) return int32_t(-1);
    if (id < 0 || id >= int64_t(n)) fail("{}: {} = {} is outside the vocabulary of {}", path, key, id, n);
    return int32_t(id);
  };
  v.bos_id = read_id("tokenizer.ggml.bos_token_id", spm ? std::optional<int64_t>(1) : std::nullopt);
  v.eos_id = read_id("tokenizer.ggml.eos_token_id", spm ? std::optional<int64_t>(2) : std::nullopt);
  v.unk_id = read_id("tokenizer.ggml.unknown_token_id", spm ? 0 : -1);
  v.add_bos = file.get_bool_or("tokenizer.ggml.add_bos_token", spm);
  v.add_space_prefix = file.get_bool_or("tokenizer.ggml.add_space_prefix", spm);
  // An end-of-turn id outside the vocabulary is an error like a BOS or EOS
  // one: ignored, generation ran past the turn's end to the context length.
  std::vector<int32_t> named_end_of_turn_ids;
  for (const char* key : {"tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"})
    if (int32_t id = read_id(key, -1); id != -1) named_end_of_turn_ids.push_back(id);
  v.end_of_turn_ids = find_end_of_turn_ids(v, named_end_of_turn_ids);
  validate(v, path);
  return v;
}

Tokenizer::Tokenizer(Vocab vocab) : vocab_(std::move(vocab)) {
  validate(vocab_, "tokenizer");
  token_to_id_.reserve(vocab_.tokens.size());
  // A later duplicate piece wins, as in llama.cpp.
  for (size_t i = 0; i < vocab_.tokens.size(); ++i) token_to_id_[vocab_.tokens[i]] = int32_t(i);
  for (size_t i = 0; i < vocab_.tokens.size(); ++i) {
    if (vocab_.types[i] == TokenType::UserDefined && !vocab_.tokens[i].empty())
      user_defined_.push_back(int32_t(i));
  }
  // Longest first, so a token that contains another wins; equal lengths in id order.
  std::stable_sort(user_defined_.begin(), user_defined_.end(), [&](int32_t a, int32_t b) {
    return vocab_.tokens[size_t(a)].size() > vocab_.tokens[size_t(b)].size();
  });
  if (vocab_.kind == TokenizerKind::Gpt2Bpe) {
    // Ranks become float merge priorities, exact below 2^24.
    if (vocab_.merges.size() > (size_t(1) << 24))
      fail("tokenizer: {} merges is too many (limit 2^24)", vocab_.merges.size());
    merge_rank_.reserve(vocab_.merges.size());
    for (size_t i = 0; i < vocab_.merges.size(); ++i) {
      const std::string& m = vocab_.merges[i];
      // A piece never holds a raw space (the byte map turns it into "Ġ"), so
      // the first space after the first character separates the two halves.
      size_t space = m.find(' ', 1);
      if (space == std::string::npos || space + 1 == m.size())
        fail("tokenizer: merge {} ('{}') is not of the form 'left right'", i, m);
      merge_rank_.emplace(m, int32_t(i));  // a repeated merge keeps its first rank
    }
  }
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_bos) const {
  std::vector<int32_t> ids;
  if (add_bos) ids.push_back(vocab_.bos_id);
  // An empty text gets no space prefix either, as in llama.cpp and llama2.c.
  if (text.empty()) return ids;
  // Symbols index the text, grown up to 3x by "▁" escapes, with int32.
  if (text.size() > size_t(std::numeric_limits<int32_t>::max()) / 4)
    fail("cannot tokenize a text of {} bytes (limit 512 MiB)", text.size());
  for (const Fragment& f : cut_user_defined(text, vocab_, user_defined_)) {
    if (f.token >= 0) {
      ids.push_back(f.token);
      continue;
    }
    std::vector<int32_t> body =
        vocab_.kind == TokenizerKind::SentencePiece ? encode_spm(f.text) : encode_gpt2(f.text);
    ids.insert(ids.end(), body.begin(), body.end());
  }
  return ids;
}

std::vector<int32_t> Tokenizer::encode_spm(std::string_view raw) const {
  // Each stretch starts the text or follows a user-defined token, and
  // llama.cpp prefixes both: "a<tok>b" encodes "▁b" after the token.
  std::string text;
  if (vocab_.add_space_prefix) text = kSpmSpace;
  text += replace_all(raw, " ", kSpmSpace);

  std::string key;  // reused so lookups do not allocate
  auto score = [&](std::string_view left, std::string_view right) -> std::optional<float> {
    // Neighbouring symbols are adjacent in text, so their concatenation is
    // the span starting at left.
    key.assign(left.data(), left.size() + right.size());
    auto it = token_to_id_.find(key);
    if (it == token_to_id_.end()) return std::nullopt;
    return vocab_.scores[size_t(it->second)];
  };
  std::vector<Symbol> syms = merge_symbols(text, score);

  std::vector<int32_t> ids;
  for (int32_t i = 0; i != -1; i = syms[size_t(i)].next) {
    const Symbol& s = syms[size_t(i)];
    key.assign(text, s.begin, s.len);
    if (auto it = token_to_id_.find(key); it != token_to_id_.end()) {
      ids.push_back(it->second);
      continue;
    }
    // Every merge makes a token, so only a single character the vocabulary
    // lacks gets here (which is why llama.cpp's re-split of such symbols along
    // their merge history never fires): one "<0xXX>" token per byte, else
    // unk, else nothing.
    for (char b : key) {
      auto byte_token = token_to_id_.find(fmt::format("<0x{:02X}>", uint8_t(b)));
      if (byte_token != token_to_id_.end()) {
        ids.push_back(byte_token->second);
      } else if (vocab_.unk_id >= 0) {
        ids.push_back(vocab_.unk_id);
      }
    }
  }
  return ids;
}

std::vector<int32_t> Tokenizer::encode_gpt2(std::string_view text) const {
  std::string key;  // reused so lookups do not allocate
  auto rank = [&](std::string_view left, std::string_view right) -> std::optional<float> {
    key.assign(left);
    key += ' ';
    key += right;
    auto it = merge_rank_.find(key);
    if (it == merge_rank_.end()) return std::nullopt;
    // A lower rank merges first; ranks below 2^24 are exact in a float.
    return -float(it->second);
  };

  const bool llama3 = vocab_.pre == PreTokenizer::Llama3;
  std::vector<int32_t> ids;
  for (std::string_view word : llama3 ? llama3_pretokenize(text) : gpt2_pretokenize(text)) {
    const std::string mapped = gpt2_bytes_to_unicode(word);
    // Llama 3 takes a word that is a token as it is, even where the merges
    // would split it (Hugging Face's ignore_merges; llama.cpp does the same).
    if (llama3) {
      if (auto it = token_to_id_.find(mapped); it != token_to_id_.end()) {
        ids.push_back(it->second);
        continue;
      }
    }
    std::vector<Symbol> syms = merge_symbols(mapped, rank);
    for (int32_t i = 0; i != -1; i = syms[size_t(i)].next) {
      const Symbol& s = syms[size_t(i)];
      key.assign(mapped, s.begin, s.len);
      if (auto it = token_to_id_.find(key); it != token_to_id_.end()) {
        ids.push_back(it->second);
        continue;
      }
      // Only a vocabulary without some byte's character gets here (real
      // GPT-2 vocabularies hold all 256): emit the characters it has, unk for
      // the others, or drop them when there is no unk.
      const std::string symbol = key;
      for (size_t pos = 0; pos < symbol.size();) {
        size_t len;
        decode_utf8(symbol, pos, &len);
        auto it = token_to_id_.find(symbol.substr(pos, len));
        if (it != token_to_id_.end()) {
          ids.push_back(it->second);
        } else if (vocab_.unk_id >= 0) {
          ids.push_back(vocab_.unk_id);
        }
        pos += len;
      }
    }
  }
  return ids;
}

std::string Tokenizer::decode_piece(int32_t prev, int32_t token) const {
  if (token < 0 || token >= vocab_size())
    fail("token id {} is outside the vocabulary of {}", token, vocab_size());
  const std::string& piece = vocab_.tokens[size_t(token)];
  switch (vocab_.types[size_t(token)]) {
    case TokenType::Control:
    case TokenType::Unused:
      return {};
    case TokenType::Byte:
      if (int b = parse_byte_piece(piece); b >= 0) return std::string(1, char(b));
      break;
    // llama2.c prints "<unk>" as it is; user-defined pieces are literal text.
    case TokenType::Unknown:
    case TokenType::UserDefined:
      return piece;
    case TokenType::Normal:
    case TokenType::Undefined:
      break;
  }
  if (vocab_.kind == TokenizerKind::Gpt2Bpe) return gpt2_unicode_to_bytes(piece);
  std::string text = replace_all(piece, kSpmSpace, " ");
  // SentencePiece's decoder drops the dummy-prefix space of the first word.
  if (prev == vocab_.bos_id && !text.empty() && text[0] == ' ') text.erase(0, 1);
  return text;
}

std::vector<int32_t> Tokenizer::end_of_generation_ids() const {
  std::vector<int32_t> ids{vocab_.eos_id};
  ids.insert(ids.end(), vocab_.end_of_turn_ids.begin(), vocab_.end_of_turn_ids.end());
  return ids;
}

std::string Tokenizer::decode(std::span<const int32_t> tokens) const {
  std::string text;
  // The start of the sequence counts as following BOS, so the space prefix
  // encode added is dropped whether or not the sequence begins with BOS.
  int32_t prev = vocab_.add_space_prefix ? vocab_.bos_id : -1;
  for (int32_t token : tokens) {
    text += decode_piece(prev, token);
    prev = token;
  }
  return text;
}

}  // namespace kvserve
