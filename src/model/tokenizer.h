// Tokenizers: SentencePiece-style BPE (llama2.c tokenizer .bin and GGUF
// `llama` vocabularies) and GPT-2 byte-level BPE (GGUF `gpt2` vocabularies),
// the latter with GPT-2's or Llama 3's ("llama-bpe") pre-tokenizer. In both,
// user-defined tokens (GGUF token type 4) are matched as whole tokens in the
// text before BPE.
//
// Both reproduce llama.cpp's tokenizers exactly (see tests/tokenizer_test.cpp,
// which runs every vector in ../shared/vocab/).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace kvserve {

class GgufFile;

enum class TokenizerKind { SentencePiece, Gpt2Bpe };

// GGUF token types (tokenizer.ggml.token_type).
enum class TokenType : uint8_t {
  Undefined = 0, Normal = 1, Unknown = 2, Control = 3, UserDefined = 4, Unused = 5, Byte = 6,
};

// How a GPT-2-style vocabulary splits text into words before BPE
// (tokenizer.ggml.pre); see unicode_text.h.
enum class PreTokenizer : uint8_t {
  Gpt2,    // "gpt-2", "gpt2", "default" or no key
  Llama3,  // "llama-bpe", "llama3", "llama-v3"; a word that is a token is not merged
};

// Everything a tokenizer needs, independent of the file it came from.
struct Vocab {
  TokenizerKind kind = TokenizerKind::SentencePiece;
  // Pieces as GGUF stores them: SentencePiece pieces use U+2581 ("▁") for a
  // space; GPT-2 pieces use the byte-to-unicode mapping ("Ġ" for a space).
  std::vector<std::string> tokens;
  std::vector<float> scores;          // SentencePiece merge priority, one per token
  std::vector<TokenType> types;       // one per token
  std::vector<std::string> merges;    // GPT-2: "left right", highest priority first
  PreTokenizer pre = PreTokenizer::Gpt2;  // GPT-2 kind only
  int32_t bos_id = 1;
  int32_t eos_id = 2;
  int32_t unk_id = 0;
  bool add_bos = true;                // whether encode(text) prepends BOS by default
  bool add_space_prefix = true;       // SentencePiece: prepend "▁" to the text
  // Tokens besides EOS that end a generation: a chat model's end of turn
  // (tokenizer.ggml.eot_token_id / eom_token_id, and control tokens spelled
  // as the common templates spell it: <|eot_id|>, <|im_end|>, <|end|>...).
  // Many GGUFs name only the end of the document as EOS.
  std::vector<int32_t> end_of_turn_ids;
};

// Reads a llama2.c tokenizer .bin (max_token_length, then per token: float
// score, int32 length, bytes) holding vocab_size tokens. Pieces are normalised
// to the GGUF form (space -> "▁", byte tokens typed Byte).
// Throws kvserve::Error on a truncated or malformed file.
Vocab load_llama2c_vocab(const std::string& path, int32_t vocab_size);

// Reads tokenizer.ggml.* metadata (model "llama" or "gpt2"). Throws
// kvserve::Error on a model or a "gpt2" pre-tokenizer kvserve does not
// implement, rather than tokenize with the wrong rules.
Vocab load_gguf_vocab(const GgufFile& file);

class Tokenizer {
 public:
  explicit Tokenizer(Vocab vocab);

  // Token ids of text; BOS first when add_bos. User-defined tokens in the text
  // become their own ids, longer ones first (as llama.cpp does, and Hugging
  // Face with added tokens that are not special); the text between them is
  // encoded stretch by stretch, each SentencePiece stretch with its own space
  // prefix. Control-token syntax ("<s>", "<|eot_id|>") is plain text.
  std::vector<int32_t> encode(std::string_view text, bool add_bos) const;

  // The bytes token `token` stands for when it follows `prev`; as llama2.c and
  // SentencePiece do, a leading space is dropped right after BOS. Byte tokens
  // ("<0x0A>") decode to their byte; control tokens decode to "".
  std::string decode_piece(int32_t prev, int32_t token) const;

  // The text of a whole token sequence (leading BOS allowed).
  std::string decode(std::span<const int32_t> tokens) const;

  int32_t vocab_size() const { return int32_t(vocab_.tokens.size()); }
  int32_t bos_id() const { return vocab_.bos_id; }
  int32_t eos_id() const { return vocab_.eos_id; }
  // EOS and the end-of-turn tokens: sampling one ends a generation.
  std::vector<int32_t> end_of_generation_ids() const;
  bool add_bos_default() const { return vocab_.add_bos; }
  const Vocab& vocab() const { return vocab_; }

 private:
  std::vector<int32_t> encode_spm(std::string_view text) const;
  std::vector<int32_t> encode_gpt2(std::string_view text) const;

  Vocab vocab_;
  std::unordered_map<std::string, int32_t> token_to_id_;
  std::unordered_map<std::string, int32_t> merge_rank_;  // GPT-2: "left right" -> rank
  std::vector<int32_t> user_defined_;  // UserDefined ids with non-empty text, longest first
};

}  // namespace kvserve
