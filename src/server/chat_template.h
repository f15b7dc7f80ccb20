// How chat messages become prompt tokens.
//
// A GGUF may carry its chat format as a Jinja template (metadata
// `tokenizer.chat_template`). kvserve has no Jinja interpreter, so it
// recognizes the few template families it can render exactly and renders them
// in C++ (as llama.cpp's built-in templates do):
//   chatml  <|im_start|>{role}\n{content}<|im_end|>\n … <|im_start|>assistant\n
//   llama2  <s>[INST] <<SYS>>\n{system}\n<</SYS>>\n\n{user} [/INST] {assistant} </s>…
//   llama3  <|begin_of_text|><|start_header_id|>{role}<|end_header_id|>\n\n{content}<|eot_id|>…
// A template is recognized only when its marker is present, nothing in it
// suggests more than that family's plain form (a built-in default system
// prompt, tool definitions, a knowledge-date header), and the vocabulary has
// the family's special tokens. Anything else falls back to the built-in
// `plain` transcript, documented in README.md:
//   [BOS]{system}\n\nUser: {user}\nAssistant: {assistant}\n…Assistant:
// Special tokens are placed by id; text between them is tokenized on its own,
// which is what llama.cpp does when it parses special tokens in a template.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace kvserve {

class Model;
class Tokenizer;

struct ChatMessage {
  std::string role;     // system | user | assistant
  std::string content;
};

enum class ChatFormat : uint8_t { Plain, ChatML, Llama2, Llama3 };

std::string_view chat_format_name(ChatFormat f);  // "plain", "chatml", "llama2", "llama3"
// Throws kvserve::Error for other names.
ChatFormat parse_chat_format(std::string_view name);

// One piece of a rendered prompt: a special token by id, or text to tokenize.
struct ChatSegment {
  int32_t token = -1;   // >= 0: this special token
  std::string text;     // with token < 0
};

class ChatTemplate {
 public:
  // `format` rendered with `tokenizer`'s special tokens. Throws kvserve::Error
  // when the vocabulary lacks a token the format needs.
  ChatTemplate(ChatFormat format, const Tokenizer& tokenizer);

  // The format for a model: `format_name` when non-empty, else its GGUF
  // template when recognized, else plain. note() says which and why.
  // REQUIRES: model.tokenizer() != nullptr.
  static ChatTemplate for_model(const Model& model, const std::string& format_name = {});
  // The format a Jinja template text is recognized as, or plain (with the
  // reason in *why when given).
  static ChatFormat detect(std::string_view jinja, std::string* why = nullptr);

  ChatFormat format() const { return format_; }
  const std::string& note() const { return note_; }

  // The conversation followed by the opening of the assistant's turn.
  // Throws kvserve::Error (a message for the client) for conversations the
  // format cannot express: no messages; llama2: roles that do not alternate
  // user/assistant after an optional first system message, or a last message
  // not from the user.
  [[nodiscard]] std::vector<ChatSegment> segments(const std::vector<ChatMessage>& messages) const;
  // segments() as token ids, BOS first when the format or the vocabulary asks for it.
  [[nodiscard]] std::vector<int32_t> render(const std::vector<ChatMessage>& messages) const;

 private:
  int32_t special(std::string_view piece) const;  // throws when missing

  ChatFormat format_;
  const Tokenizer* tokenizer_;
  std::string note_;
  // Special tokens of the format (-1 where unused).
  int32_t im_start_ = -1, im_end_ = -1;                    // chatml
  int32_t header_start_ = -1, header_end_ = -1, eot_ = -1; // llama3
};

}  // namespace kvserve
