#include "server/chat_template.h"

#include <memory>

#include "model/gguf_reader.h"
#include "model/model.h"
#include "model/tokenizer.h"
#include "util/error.h"

namespace kvserve {
namespace {

bool contains(std::string_view text, std::string_view needle) {
  return text.find(needle) != std::string_view::npos;
}

// Leading and trailing whitespace removed, as Jinja's trim / Python's strip.
std::string strip(std::string_view s) {
  const char* ws = " \t\n\r\f\v";
  const size_t b = s.find_first_not_of(ws);
  if (b == std::string_view::npos) return {};
  const size_t e = s.find_last_not_of(ws);
  return std::string(s.substr(b, e - b + 1));
}

void add_text(std::vector<ChatSegment>& out, std::string text) {
  // Adjacent text is one fragment (llama.cpp tokenizes the text between two
  // special tokens at once).
  if (!out.empty() && out.back().token < 0) {
    out.back().text += text;
  } else {
    out.push_back({-1, std::move(text)});
  }
}

void add_token(std::vector<ChatSegment>& out, int32_t token) { out.push_back({token, {}}); }

}  // namespace

std::string_view chat_format_name(ChatFormat f) {
  switch (f) {
    case ChatFormat::Plain: return "plain";
    case ChatFormat::ChatML: return "chatml";
    case ChatFormat::Llama2: return "llama2";
    case ChatFormat::Llama3: return "llama3";
  }
  return "plain";
}

ChatFormat parse_chat_format(std::string_view name) {
  for (ChatFormat f : {ChatFormat::Plain, ChatFormat::ChatML, ChatFormat::Llama2, ChatFormat::Llama3})
    if (name == chat_format_name(f)) return f;
  fail("unknown chat template '{}' (known: plain, chatml, llama2, llama3)", name);
}

ChatFormat ChatTemplate::detect(std::string_view jinja, std::string* why) {
  auto plain = [&](std::string reason) {
    if (why) *why = std::move(reason);
    return ChatFormat::Plain;
  };
  if (jinja.empty()) return plain("the model has no chat template");
  // Content beyond a family's plain form that kvserve cannot reproduce.
  for (std::string_view extra : {"You are", "Cutting Knowledge", "Today Date", "ipython", "tools"})
    if (contains(jinja, extra))
      return plain(fmt::format("the chat template has content kvserve cannot render exactly ('{}')", extra));
  if (contains(jinja, "<|im_start|>")) return ChatFormat::ChatML;
  if (contains(jinja, "<|start_header_id|>")) return ChatFormat::Llama3;
  if (contains(jinja, "[INST]") && contains(jinja, "<<SYS>>")) return ChatFormat::Llama2;
  return plain("the chat template is not one kvserve recognizes (chatml, llama2, llama3)");
}

ChatTemplate::ChatTemplate(ChatFormat format, const Tokenizer& tokenizer) : format_(format), tokenizer_(&tokenizer) {
  switch (format) {
    case ChatFormat::ChatML:
      im_start_ = special("<|im_start|>");
      im_end_ = special("<|im_end|>");
      break;
    case ChatFormat::Llama3:
      header_start_ = special("<|start_header_id|>");
      header_end_ = special("<|end_header_id|>");
      eot_ = special("<|eot_id|>");
      break;
    case ChatFormat::Plain:
    case ChatFormat::Llama2:
      break;
  }
  note_ = fmt::format("chat template: {}", chat_format_name(format));
}

int32_t ChatTemplate::special(std::string_view piece) const {
  const Vocab& v = tokenizer_->vocab();
  for (size_t i = 0; i < v.tokens.size(); ++i) {
    const bool is_special = v.types.empty() || v.types[i] == TokenType::Control || v.types[i] == TokenType::UserDefined;
    if (is_special && v.tokens[i] == piece) return int32_t(i);
  }
  fail("the {} chat template needs the special token {}, which the vocabulary lacks", chat_format_name(format_),
       piece);
}

ChatTemplate ChatTemplate::for_model(const Model& model, const std::string& format_name) {
  const Tokenizer& tok = model.require_tokenizer();
  if (!format_name.empty()) {
    ChatTemplate t(parse_chat_format(format_name), tok);
    t.note_ += " (--chat-template)";
    return t;
  }
  std::string jinja;
  if (model.format() == CheckpointFormat::Gguf) {
    const GgufFile file(model.path());
    jinja = file.get_string_or("tokenizer.chat_template", "");
  }
  std::string why;
  const ChatFormat f = detect(jinja, &why);
  if (f != ChatFormat::Plain) {
    try {
      ChatTemplate t(f, tok);
      t.note_ += " (from the GGUF's tokenizer.chat_template)";
      return t;
    } catch (const Error& e) {
      why = e.what();
    }
  }
  ChatTemplate t(ChatFormat::Plain, tok);
  t.note_ += " (built-in default: " + why + ")";
  return t;
}

std::vector<ChatSegment> ChatTemplate::segments(const std::vector<ChatMessage>& messages) const {
  if (messages.empty()) fail("a chat needs at least one message");
  std::vector<ChatSegment> out;
  switch (format_) {
    case ChatFormat::Plain:
      for (const ChatMessage& m : messages) {
        if (m.role == "system") {
          add_text(out, m.content + "\n\n");
        } else if (m.role == "user") {
          add_text(out, "User: " + m.content + "\n");
        } else {
          // The generation prompt ends at "Assistant:", so a reply sent back
          // as generated begins with the space the model wrote after it:
          // another space would tokenize the turn unlike the tokens the model
          // generated, and a returning conversation would miss the prefix
          // cache from its first reply on.
          const bool spaced = !m.content.empty() && m.content[0] == ' ';
          add_text(out, (spaced ? "Assistant:" : "Assistant: ") + m.content + "\n");
        }
      }
      add_text(out, "Assistant:");
      break;
    case ChatFormat::ChatML:
      for (const ChatMessage& m : messages) {
        add_token(out, im_start_);
        add_text(out, m.role + "\n" + m.content);
        add_token(out, im_end_);
        add_text(out, "\n");
      }
      add_token(out, im_start_);
      add_text(out, "assistant\n");
      break;
    case ChatFormat::Llama3:
      add_token(out, tokenizer_->bos_id());
      for (const ChatMessage& m : messages) {
        add_token(out, header_start_);
        add_text(out, m.role);
        add_token(out, header_end_);
        add_text(out, "\n\n" + strip(m.content));
        add_token(out, eot_);
      }
      add_token(out, header_start_);
      add_text(out, "assistant");
      add_token(out, header_end_);
      add_text(out, "\n\n");
      break;
    case ChatFormat::Llama2: {
      size_t first = 0;
      std::string system;
      if (messages[0].role == "system") {
        system = messages[0].content;
        first = 1;
      }
      if (first == messages.size()) fail("the llama2 chat template needs a user message after the system message");
      for (size_t i = first; i < messages.size(); ++i) {
        const ChatMessage& m = messages[i];
        const bool user_turn = (i - first) % 2 == 0;
        if ((m.role == "user") != user_turn || (m.role != "user" && m.role != "assistant"))
          fail("the llama2 chat template needs roles alternating user/assistant/... after an optional system "
               "message (message {} is '{}')", i, m.role);
        if (m.role == "user") {
          std::string content = m.content;
          if (i == first && first == 1) content = "<<SYS>>\n" + system + "\n<</SYS>>\n\n" + content;
          add_token(out, tokenizer_->bos_id());
          add_text(out, "[INST] " + strip(content) + " [/INST]");
        } else {
          add_text(out, " " + strip(m.content) + " ");
          add_token(out, tokenizer_->eos_id());
        }
      }
      if (messages.back().role != "user") fail("the llama2 chat template needs the last message to be from the user");
      break;
    }
  }
  return out;
}

std::vector<int32_t> ChatTemplate::render(const std::vector<ChatMessage>& messages) const {
  const std::vector<ChatSegment> segs = segments(messages);
  std::vector<int32_t> tokens;
  // Llama 2 and 3 place BOS themselves; the others follow the vocabulary.
  const bool own_bos = format_ == ChatFormat::Llama2 || format_ == ChatFormat::Llama3;
  if (!own_bos && tokenizer_->add_bos_default()) tokens.push_back(tokenizer_->bos_id());
  for (const ChatSegment& s : segs) {
    if (s.token >= 0) {
      tokens.push_back(s.token);
    } else {
      const std::vector<int32_t> t = tokenizer_->encode(s.text, false);
      tokens.insert(tokens.end(), t.begin(), t.end());
    }
  }
  return tokens;
}

}  // namespace kvserve
