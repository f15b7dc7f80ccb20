// Chat templates: the families kvserve renders are recognized from their
// Jinja text (and anything beyond their plain form is not), each renders the
// exact token sequence llama.cpp would (special tokens by id, the text between
// them tokenized on its own), and the plain default is what README documents.
#include "server/chat_template.h"

#include <gtest/gtest.h>

#include "model/model.h"
#include "model/tokenizer.h"
#include "test_support.h"

namespace kvserve {
namespace {

using testing_files::expect_error_containing;

// stories260K's vocabulary plus the special tokens of ChatML and Llama 3.
class ChatTemplateTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model = Model::load(testing_files::kStoriesGguf);
    Vocab v = model->require_tokenizer().vocab();
    for (const char* s : {"<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"}) {
      v.tokens.push_back(s);
      v.scores.push_back(0);
      v.types.push_back(TokenType::Control);
    }
    tok = std::make_unique<Tokenizer>(v);
  }
  int32_t id(const std::string& piece) const {
    const auto& t = tok->vocab().tokens;
    return int32_t(std::find(t.begin(), t.end(), piece) - t.begin());
  }
  std::vector<int32_t> text(const std::string& s) const { return tok->encode(s, false); }

  std::unique_ptr<Model> model;
  std::unique_ptr<Tokenizer> tok;
};

std::vector<int32_t> cat(std::initializer_list<std::vector<int32_t>> parts) {
  std::vector<int32_t> out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

const std::vector<ChatMessage> kChat = {{"system", "Be kind."}, {"user", " Hi there "}, {"assistant", "Hello!"},
                                        {"user", "A story?"}};

TEST_F(ChatTemplateTest, RecognizesPlainFamiliesOnly) {
  const std::string chatml =
      "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
      "'\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
  const std::string llama3 =
      "{% for message in messages %}{% set content = '<|start_header_id|>' + message['role'] + "
      "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content "
      "= bos_token + content %}{% endif %}{{ content }}{% endfor %}";
  const std::string llama2 =
      "{% if messages[0]['role'] == 'system' %}{% set system_message = '<<SYS>>\\n' + messages[0]['content'] + "
      "'\\n<</SYS>>\\n\\n' %}{% endif %}{% for message in messages %}{% if message['role'] == 'user' %}{{ bos_token + "
      "'[INST] ' + content.strip() + ' [/INST]' }}{% endif %}{% endfor %}";
  EXPECT_EQ(ChatTemplate::detect(chatml), ChatFormat::ChatML);
  EXPECT_EQ(ChatTemplate::detect(llama3), ChatFormat::Llama3);
  EXPECT_EQ(ChatTemplate::detect(llama2), ChatFormat::Llama2);
  std::string why;
  EXPECT_EQ(ChatTemplate::detect("", &why), ChatFormat::Plain);
  EXPECT_EQ(why, "the model has no chat template");
  // A built-in system prompt (Qwen), a knowledge date (Llama 3.1), tools: not the plain form.
  EXPECT_EQ(ChatTemplate::detect(chatml + "{{'<|im_start|>system\\nYou are a helpful assistant.'}}", &why),
            ChatFormat::Plain);
  EXPECT_NE(why.find("'You are'"), std::string::npos);
  EXPECT_EQ(ChatTemplate::detect(llama3 + "Cutting Knowledge Date: December 2023"), ChatFormat::Plain);
  EXPECT_EQ(ChatTemplate::detect(chatml + "{% if tools %}{% endif %}"), ChatFormat::Plain);
  EXPECT_EQ(ChatTemplate::detect("{{ messages }}", &why), ChatFormat::Plain);
  EXPECT_NE(why.find("not one kvserve recognizes"), std::string::npos);
}

TEST_F(ChatTemplateTest, PlainIsTheDocumentedTranscript) {
  const Tokenizer& stories = model->require_tokenizer();
  const ChatTemplate t(ChatFormat::Plain, stories);
  const std::string whole = "Be kind.\n\nUser:  Hi there \nAssistant: Hello!\nUser: A story?\nAssistant:";
  const std::vector<ChatSegment> segs = t.segments(kChat);
  ASSERT_EQ(segs.size(), 1u);
  EXPECT_EQ(segs[0].text, whole);
  EXPECT_EQ(t.render(kChat), stories.encode(whole, true));
  // A reply sent back as generated, with its leading space, renders the same.
  std::vector<ChatMessage> returned = kChat;
  for (ChatMessage& m : returned)
    if (m.role == "assistant") m.content = " " + m.content;
  EXPECT_EQ(t.segments(returned)[0].text, whole);
  // stories260K has no template: the model falls back to plain and says why.
  const ChatTemplate from_model = ChatTemplate::for_model(*model);
  EXPECT_EQ(from_model.format(), ChatFormat::Plain);
  EXPECT_EQ(from_model.note(), "chat template: plain (built-in default: the model has no chat template)");
  EXPECT_EQ(ChatTemplate::for_model(*model, "llama2").format(), ChatFormat::Llama2);
  expect_error_containing([&] { (void)ChatTemplate::for_model(*model, "jinja"); }, "unknown chat template 'jinja'");
  expect_error_containing([&] { (void)t.render({}); }, "at least one message");
}

TEST_F(ChatTemplateTest, ChatMlPlacesSpecialTokensById) {
  const ChatTemplate t(ChatFormat::ChatML, *tok);
  const int32_t s = id("<|im_start|>"), e = id("<|im_end|>");
  const std::vector<int32_t> nl = text("\n");
  EXPECT_EQ(t.render(kChat), cat({{tok->bos_id(), s}, text("system\nBe kind."), {e}, nl, {s},
                                  text("user\n Hi there "), {e}, nl, {s}, text("assistant\nHello!"), {e}, nl, {s},
                                  text("user\nA story?"), {e}, nl, {s}, text("assistant\n")}));
  // The stories vocabulary has no ChatML tokens.
  expect_error_containing([&] { ChatTemplate(ChatFormat::ChatML, model->require_tokenizer()); },
                          "needs the special token <|im_start|>");
}

TEST_F(ChatTemplateTest, Llama3TrimsContentAndOpensTheAssistantTurn) {
  const ChatTemplate t(ChatFormat::Llama3, *tok);
  const int32_t hs = id("<|start_header_id|>"), he = id("<|end_header_id|>"), eot = id("<|eot_id|>");
  EXPECT_EQ(t.render({{"system", "Be kind."}, {"user", " Hi there "}}),
            cat({{tok->bos_id(), hs}, text("system"), {he}, text("\n\nBe kind."), {eot, hs}, text("user"), {he},
                 text("\n\nHi there"), {eot, hs}, text("assistant"), {he}, text("\n\n")}));
}

TEST_F(ChatTemplateTest, Llama2FoldsTheSystemMessageAndNeedsAlternation) {
  const ChatTemplate t(ChatFormat::Llama2, *tok);
  const int32_t bos = tok->bos_id(), eos = tok->eos_id();
  EXPECT_EQ(t.render(kChat),
            cat({{bos}, text("[INST] <<SYS>>\nBe kind.\n<</SYS>>\n\n Hi there [/INST] Hello! "), {eos, bos},
                 text("[INST] A story? [/INST]")}));
  expect_error_containing([&] { (void)t.render({{"user", "a"}, {"user", "b"}}); }, "alternating user/assistant");
  expect_error_containing([&] { (void)t.render({{"user", "a"}, {"assistant", "b"}}); }, "last message");
  expect_error_containing([&] { (void)t.render({{"system", "a"}}); }, "needs a user message");
}

}  // namespace
}  // namespace kvserve
