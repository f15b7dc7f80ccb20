#include "model/tokenizer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <optional>
#include <sstream>
#include <variant>

#include "model/gguf_reader.h"
#include "model/unicode_text.h"
#include "util/error.h"
#include "test_support.h"

namespace kvserve {
namespace {

using namespace testing_files;

const std::string kVocabDir = KVSERVE_SHARED_DIR "/vocab/";
constexpr int32_t kTok512Size = 512;

std::string temp_path(const std::string& name) { return testing::TempDir() + "kvserve_tok_" + name; }

Tokenizer gguf_tokenizer(const std::string& path) { return Tokenizer(load_gguf_vocab(GgufFile(path))); }

std::string join(const std::vector<int32_t>& ids) {
  std::string s;
  for (int32_t id : ids) s += std::to_string(id) + " ";
  return s;
}

// llama.cpp's vocab test format: NAME.inp holds the strings, each followed by
// a line "__ggml_vocab_test__"; NAME.out one line of ids per string.
void expect_vectors_pass(const std::string& name) {
  const Tokenizer tok = gguf_tokenizer(kVocabDir + name);
  const std::string inp = read_all(kVocabDir + name + ".inp");
  const std::string sep = "\n__ggml_vocab_test__\n";
  std::vector<std::string> inputs;
  for (size_t pos = 0; pos < inp.size();) {
    size_t end = inp.find(sep, pos);
    ASSERT_NE(end, std::string::npos) << name << ".inp does not end with a separator";
    inputs.push_back(inp.substr(pos, end - pos));
    pos = end + sep.size();
  }
  std::vector<std::vector<int32_t>> expected;
  std::istringstream out(read_all(kVocabDir + name + ".out"));
  for (std::string line; std::getline(out, line);) {
    std::istringstream ids(line);
    expected.emplace_back();
    for (int32_t id; ids >> id;) expected.back().push_back(id);
  }
  ASSERT_FALSE(inputs.empty());
  ASSERT_EQ(inputs.size(), expected.size()) << name;

  size_t passed = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const std::vector<int32_t> got = tok.encode(inputs[i], /*add_bos=*/false);
    if (got == expected[i]) {
      ++passed;
    } else {
      ADD_FAILURE() << name << " vector " << i << " '" << inputs[i] << "'\n  expected: "
                    << join(expected[i]) << "\n  got:      " << join(got);
    }
  }
  EXPECT_EQ(passed, inputs.size()) << name;
}

TEST(TokenizerVectors, LlamaSpm) { expect_vectors_pass("ggml-vocab-llama-spm.gguf"); }

TEST(TokenizerVectors, Gpt2) { expect_vectors_pass("ggml-vocab-gpt-2.gguf"); }

// GPT-2's vocabulary and merges with Llama 3's pre-tokenizer ("llama-bpe").
// The expected ids come from js-tiktoken 1.x: GPT-2's ranks with cl100k_base's
// split pattern, which is Llama 3's (new Tiktoken({...gpt2, pat_str:
// cl100k.pat_str}).encode(text)); ranks and merges give the same BPE for
// GPT-2. Texts with U+0085 or U+FEFF are left out, as JavaScript's \s and
// Unicode's White_Space disagree on them.
TEST(TokenizerVectors, Gpt2WithLlama3PreTokenizer) {
  Vocab v = load_gguf_vocab(GgufFile(kVocabDir + "ggml-vocab-gpt-2.gguf"));
  ASSERT_EQ(v.pre, PreTokenizer::Gpt2);
  v.pre = PreTokenizer::Llama3;
  const Tokenizer tok(std::move(v));
  const std::pair<std::string, std::vector<int32_t>> cases[] = {
      {"I'M here 1234567\n\n  ok", {40, 6, 44, 994, 220, 10163, 29228, 22, 628, 220, 12876}},
      {"it's they're we've I'm you'll he'd don't", {270, 338, 484, 821, 356, 1053, 314, 1101, 345, 1183, 339, 1549, 836, 470}},
      {"IT'S THEY'RE WE'VE I'M YOU'LL HE'D DON'T", {2043, 6, 50, 33302, 6, 2200, 12887, 6, 6089, 314, 6, 44, 7013, 6, 3069, 11179, 6, 35, 23917, 6, 51}},
      {"It'S tHEY'rE We'Ve", {1026, 6, 50, 256, 13909, 56, 6, 81, 36, 775, 6, 26979}},
      {"'sup 'Sup ''s", {338, 929, 705, 40784, 10148, 82}},
      {"1 12 123 1234 12345 123456 1234567", {16, 220, 1065, 220, 10163, 220, 10163, 19, 220, 10163, 2231, 220, 10163, 29228, 220, 10163, 29228, 22}},
      {"a1b22c333d4444", {64, 16, 65, 1828, 66, 20370, 67, 30272, 19}},
      {"3.14159, -42 and 1,000,000", {18, 13, 23756, 3270, 11, 532, 3682, 290, 220, 16, 11, 830, 11, 830}},
      {"Hello, world!!! How are you???\n\nFine...\n", {15496, 11, 995, 10185, 1374, 389, 345, 28358, 628, 34389, 986, 198}},
      {"end.\r\n\r\nnext", {437, 13, 201, 198, 201, 198, 19545}},
      {"x = (a + b) * c; // comment\n\tif (x) {\n\t\treturn;\n\t}", {87, 796, 357, 64, 1343, 275, 8, 1635, 269, 26, 3373, 2912, 198, 197, 361, 357, 87, 8, 1391, 198, 197, 197, 7783, 26, 198, 197, 92}},
      {"    four spaces\n        eight", {220, 220, 220, 1440, 9029, 198, 220, 220, 220, 220, 220, 220, 220, 3624}},
      {"word  two   three    four", {4775, 220, 734, 220, 220, 1115, 220, 220, 220, 1440}},
      {"trailing spaces   ", {9535, 4386, 9029, 220, 220, 220}},
      {" leading space", {3756, 2272}},
      {"\ttab\tseparated\twords", {197, 8658, 197, 25512, 515, 197, 10879}},
      {"line1\nline2\n\n\nline3", {1370, 16, 198, 1370, 17, 628, 198, 1370, 18}},
      {"  \n  indented\n", {220, 220, 198, 220, 773, 4714, 198}},
      {"\r\n", {201, 198}},
      {"!!!abc ???def (ghi) [jkl]", {10185, 39305, 34913, 4299, 357, 456, 72, 8, 685, 73, 41582, 60}},
      {"\"quoted\" 'single' `back`", {1, 421, 5191, 1, 705, 29762, 6, 4600, 1891, 63}},
      {"你好，世界！这是一个测试。", {19526, 254, 25001, 121, 171, 120, 234, 10310, 244, 45911, 234, 171, 120, 223, 32573, 247, 42468, 31660, 10310, 103, 38184, 233, 46237, 243, 16764}},
      {"日本語のテキスト 123", {33768, 98, 17312, 105, 45739, 252, 5641, 24336, 25084, 43302, 220, 10163}},
      {"emoji 😀😃 🎉🎉🎉 done", {368, 31370, 30325, 222, 47249, 225, 12520, 236, 231, 8582, 236, 231, 8582, 236, 231, 1760}},
      {"👍🏽 thumbs", {41840, 235, 8582, 237, 121, 32766}},
      {"café naïve résumé Ünïcödé", {66, 1878, 2634, 41492, 40560, 16345, 2634, 49363, 77, 26884, 66, 9101, 67, 2634}},
      {"Ελληνικά και русский текст", {138, 243, 39377, 39377, 138, 115, 26180, 29945, 43000, 138, 105, 7377, 118, 17394, 29945, 220, 21169, 35072, 21727, 21727, 31583, 18849, 140, 117, 220, 20375, 16843, 31583, 21727, 20375}},
      {"mixed: abc123def 4567ghi", {76, 2966, 25, 450, 66, 10163, 4299, 220, 29228, 22, 456, 72}},
      {"email@example.com https://example.org/path?q=1", {12888, 31, 20688, 13, 785, 3740, 1378, 20688, 13, 2398, 14, 6978, 30, 80, 28, 16}},
      {"a\u00A0b non-breaking", {64, 1849, 65, 1729, 12, 13395}},
      {"   ", {220, 220, 220}},
      {"\n", {198}},
      {"$100 #tag @user %20 ^_^ ~~", {3, 3064, 1303, 12985, 2488, 7220, 4064, 1238, 10563, 62, 61, 220, 4907}},
      {"snake_case_name camelCaseName", {16184, 539, 62, 7442, 62, 3672, 41021, 20448, 5376}},
      {"  hello\n\n  world  ", {220, 23748, 628, 220, 995, 220, 220}},
      {"x;\n\n\ty", {87, 26, 628, 197, 88}},
      {"99 bottles\u3000of beer", {2079, 14096, 5099, 222, 1659, 6099}},
      {"(word) {word} <tag>", {7, 4775, 8, 1391, 4775, 92, 1279, 12985, 29}},
  };
  for (const auto& [text, expected] : cases)
    EXPECT_EQ(tok.encode(text, /*add_bos=*/false), expected) << "'" << text << "'";
}

// Llama 3 takes a word that is a token whole, where GPT-2 merges it: "abc"
// is a token here, but the only merge makes "ab" + "c".
TEST(Tokenizer, Llama3TakesWordTokensWhole) {
  Vocab v;
  v.kind = TokenizerKind::Gpt2Bpe;
  v.tokens = {"a", "b", "c", "ab", "abc"};
  v.scores.assign(v.tokens.size(), 0.0f);
  v.types.assign(v.tokens.size(), TokenType::Normal);
  v.merges = {"a b"};
  v.bos_id = v.eos_id = 0;
  v.unk_id = -1;
  EXPECT_EQ(Tokenizer(v).encode("abc", false), (std::vector<int32_t>{3, 2}));
  v.pre = PreTokenizer::Llama3;
  EXPECT_EQ(Tokenizer(v).encode("abc", false), (std::vector<int32_t>{4}));
  EXPECT_EQ(Tokenizer(v).encode("abcab", false), (std::vector<int32_t>{3, 2, 3}));
}

TEST(Llama2cVocab, MatchesItsGgufConversion) {
  const Vocab bin = load_llama2c_vocab(kTok512, kTok512Size);
  const Vocab gguf = load_gguf_vocab(GgufFile(kStoriesGguf));
  EXPECT_EQ(bin.kind, TokenizerKind::SentencePiece);
  EXPECT_EQ(bin.tokens, gguf.tokens);
  EXPECT_EQ(bin.scores, gguf.scores);
  EXPECT_EQ(bin.types, gguf.types);
  EXPECT_EQ(bin.bos_id, gguf.bos_id);
  EXPECT_EQ(bin.eos_id, gguf.eos_id);
  EXPECT_EQ(bin.unk_id, gguf.unk_id);
  EXPECT_EQ(bin.add_bos, gguf.add_bos);
  EXPECT_EQ(bin.add_space_prefix, gguf.add_space_prefix);

  const Tokenizer a(bin);
  const Tokenizer b(gguf);
  const std::string prompt = "Once upon a time";
  const std::vector<int32_t> ids = a.encode(prompt, /*add_bos=*/true);
  ASSERT_GE(ids.size(), 2u);
  EXPECT_EQ(ids[0], 1);
  EXPECT_EQ(ids, b.encode(prompt, true));
  // llama2.c's run prints " Once" after BOS without its space.
  EXPECT_EQ(a.vocab().tokens[size_t(ids[1])].substr(0, 3), "\xE2\x96\x81");
  EXPECT_EQ(a.decode_piece(1, ids[1]), a.decode_piece(0, ids[1]).substr(1));
  EXPECT_EQ(a.decode(ids), prompt);
}

TEST(Llama2cVocab, Normalisation) {
  const Vocab v = load_llama2c_vocab(kTok512, kTok512Size);
  ASSERT_EQ(v.tokens.size(), size_t(kTok512Size));
  EXPECT_EQ(v.tokens[0], "<unk>");
  EXPECT_EQ(v.types[0], TokenType::Unknown);
  EXPECT_EQ(v.tokens[1], "<s>");  // stored as "\n<s>\n" in the .bin
  EXPECT_EQ(v.types[1], TokenType::Control);
  EXPECT_EQ(v.tokens[2], "</s>");
  EXPECT_EQ(v.types[2], TokenType::Control);
  EXPECT_EQ(v.tokens[3 + 0x0A], "<0x0A>");
  EXPECT_EQ(v.types[3 + 0x0A], TokenType::Byte);
  for (const std::string& t : v.tokens) EXPECT_EQ(t.find(' '), std::string::npos) << t;
}

TEST(Tokenizer, DecodePiece) {
  const Tokenizer tok(load_llama2c_vocab(kTok512, kTok512Size));
  const int32_t once = tok.encode("Once", false).at(0);
  ASSERT_EQ(tok.vocab().tokens[size_t(once)], "\xE2\x96\x81Once");
  EXPECT_EQ(tok.decode_piece(tok.bos_id(), once), "Once");
  EXPECT_EQ(tok.decode_piece(once, once), " Once");
  EXPECT_EQ(tok.decode_piece(once, tok.bos_id()), "");
  EXPECT_EQ(tok.decode_piece(once, tok.eos_id()), "");
  EXPECT_EQ(tok.decode_piece(once, 3 + 0x0A), "\n");
  EXPECT_EQ(tok.decode_piece(once, 0), "<unk>");
  EXPECT_THROW((void)tok.decode_piece(once, kTok512Size), Error);
  EXPECT_THROW((void)tok.decode_piece(once, -1), Error);
}

TEST(Tokenizer, RoundTrip) {
  const std::vector<std::string> texts = {
      "Once upon a time, there was a little girl named Lily.",
      "  two leading spaces\nand\ttabs\n\n",
      "Ünïcödé 日本語 🦙 ½ — done",
      "ill-formed \xFF\xFE bytes \xC3 and \xE2\x82",
      "'s 'll don't WON'T 12345 x+y=z",
  };
  const Tokenizer tok512(load_llama2c_vocab(kTok512, kTok512Size));
  const Tokenizer spm = gguf_tokenizer(kVocabDir + "ggml-vocab-llama-spm.gguf");
  const Tokenizer gpt2 = gguf_tokenizer(kVocabDir + "ggml-vocab-gpt-2.gguf");
  for (const std::string& text : texts) {
    EXPECT_EQ(tok512.decode(tok512.encode(text, true)), text);
    EXPECT_EQ(tok512.decode(tok512.encode(text, false)), text);
    EXPECT_EQ(spm.decode(spm.encode(text, true)), text);
    EXPECT_EQ(gpt2.decode(gpt2.encode(text, false)), text);
  }
  EXPECT_TRUE(tok512.encode("", false).empty());
  EXPECT_EQ(tok512.encode("", true), std::vector<int32_t>{1});
}

TEST(Tokenizer, ByteFallback) {
  const Tokenizer tok(load_llama2c_vocab(kTok512, kTok512Size));
  // tok512 has "▁" but no llama emoji: its four bytes become <0xXX> tokens.
  const int32_t space = tok.encode(" ", false).at(0);
  ASSERT_EQ(tok.vocab().tokens[size_t(space)], "\xE2\x96\x81");
  EXPECT_EQ(tok.encode("\xF0\x9F\xA6\x99", false),
            (std::vector<int32_t>{space, 3 + 0xF0, 3 + 0x9F, 3 + 0xA6, 3 + 0x99}));
  // A lone invalid byte is its own symbol.
  EXPECT_EQ(tok.encode("\xFF", false), (std::vector<int32_t>{space, 3 + 0xFF}));

  // Without byte tokens an unknown character becomes unk, once per byte.
  Vocab v;
  v.tokens = {"<unk>", "<s>", "</s>", "\xE2\x96\x81", "a"};
  v.scores.assign(v.tokens.size(), 0.0f);
  v.types = {TokenType::Unknown, TokenType::Control, TokenType::Control, TokenType::Normal,
             TokenType::Normal};
  const Tokenizer tiny(v);
  EXPECT_EQ(tiny.encode("a\xC3\xA9", false), (std::vector<int32_t>{3, 4, 0, 0}));
}

TEST(Tokenizer, SpmMergesHighestScoreLeftmostFirst) {
  // "abc": "ab" and "bc" are both tokens; the higher score wins, and with equal
  // scores the leftmost pair does.
  Vocab v;
  v.tokens = {"<unk>", "<s>", "</s>", "a", "b", "c", "ab", "bc"};
  v.types = {TokenType::Unknown, TokenType::Control, TokenType::Control, TokenType::Normal,
             TokenType::Normal, TokenType::Normal, TokenType::Normal, TokenType::Normal};
  v.add_space_prefix = false;
  v.scores = {0, 0, 0, 0, 0, 0, -2, -1};
  EXPECT_EQ(Tokenizer(v).encode("abc", false), (std::vector<int32_t>{3, 7}));
  v.scores = {0, 0, 0, 0, 0, 0, -1, -1};
  EXPECT_EQ(Tokenizer(v).encode("abc", false), (std::vector<int32_t>{6, 5}));
}

TEST(Tokenizer, LongTextIsFast) {
  // perplexity tokenizes its whole 1 MB evaluation text at once; a quadratic
  // merge would take minutes here.
  std::string text;
  while (text.size() < (1u << 20)) text += "The quick brown fox jumps over the lazy dog, then naps. ";
  const Tokenizer spm = gguf_tokenizer(kVocabDir + "ggml-vocab-llama-spm.gguf");
  const Tokenizer gpt2 = gguf_tokenizer(kVocabDir + "ggml-vocab-gpt-2.gguf");
  const std::vector<int32_t> ids = spm.encode(text, false);
  EXPECT_LT(ids.size(), text.size() / 3);
  EXPECT_EQ(spm.decode(ids), text);
  EXPECT_EQ(gpt2.decode(gpt2.encode(text, false)), text);
}

// A shared vocabulary with token `id` turned into the user-defined `piece`.
Tokenizer with_user_defined(const std::string& name, std::vector<std::pair<int32_t, std::string>> added) {
  Vocab v = load_gguf_vocab(GgufFile(kVocabDir + name));
  for (auto& [id, piece] : added) {
    v.tokens[size_t(id)] = std::move(piece);
    v.types[size_t(id)] = TokenType::UserDefined;
  }
  return Tokenizer(std::move(v));
}

// User-defined tokens are matched whole before BPE, as llama.cpp does even
// when it does not parse special tokens; control tokens stay plain text.
// Expected ids as llama.cpp gives them for these vocabularies (the bug
// report's relabelled GGUFs): after a user-defined token SentencePiece adds
// its space prefix again, so "world" is "▁world" (3186).
TEST(Tokenizer, UserDefinedTokensAreMatchedWhole) {
  const Tokenizer spm = with_user_defined("ggml-vocab-llama-spm.gguf", {{31999, "<|im_start|>"}});
  EXPECT_EQ(spm.encode("Hello<|im_start|>world", false), (std::vector<int32_t>{15043, 31999, 3186}));
  EXPECT_EQ(spm.encode("<|im_start|>Hello<|im_start|>", true), (std::vector<int32_t>{1, 31999, 15043, 31999}));
  EXPECT_EQ(spm.encode("Hello world", false), (std::vector<int32_t>{15043, 3186}));
  EXPECT_EQ(spm.decode(spm.encode("Hello<|im_start|>world", false)), "Hello<|im_start|> world");

  const Tokenizer gpt2 = with_user_defined("ggml-vocab-gpt-2.gguf", {{50255, "<|im_start|>"}});
  EXPECT_EQ(gpt2.encode("Hello<|im_start|>world", false), (std::vector<int32_t>{15496, 50255, 6894}));
  EXPECT_EQ(gpt2.decode(gpt2.encode("Hello<|im_start|>world", false)), "Hello<|im_start|>world");
  // <|endoftext|> is a control token: plain text.
  const std::vector<int32_t> eot = gpt2.encode("<|endoftext|>", false);
  EXPECT_GT(eot.size(), 1u);
  EXPECT_EQ(std::count(eot.begin(), eot.end(), 50256), 0);
}

// Where user-defined tokens overlap the longer one wins: at the same place,
// and, as llama.cpp cuts the longest out first, also against a shorter one
// that starts further left.
TEST(Tokenizer, UserDefinedTokensLongestFirst) {
  const Tokenizer tok = with_user_defined(
      "ggml-vocab-gpt-2.gguf", {{50253, "<a>"}, {50254, "<a><b>"}, {50255, "><bb"}});
  auto ids = [&](std::initializer_list<std::variant<std::string, int32_t>> parts) {
    std::vector<int32_t> out;
    for (const auto& part : parts) {
      if (const auto* id = std::get_if<int32_t>(&part)) {
        out.push_back(*id);
      } else {
        for (int32_t t : tok.encode(std::get<std::string>(part), false)) out.push_back(t);
      }
    }
    return out;
  };
  EXPECT_EQ(tok.encode("x<a><b>y<a>", false), ids({"x", 50254, "y", 50253}));
  // "<a>" and "><bb" share the '>': the longer is cut first, "<a" stays text.
  EXPECT_EQ(tok.encode("<a><bb", false), ids({"<a", 50255}));
  EXPECT_EQ(tok.encode("<a>", false), ids({50253}));
}

TEST(UnicodeText, Gpt2Pretokenize) {
  // Before a non-space, a run of spaces keeps its last one back to prefix
  // the next word ('\s+(?!\S)'); at the end of the text it is one word.
  EXPECT_EQ(gpt2_pretokenize("Hello world's  x\n\n y"),
            (std::vector<std::string_view>{"Hello", " world", "'s", " ", " x", "\n\n", " y"}));
  EXPECT_EQ(gpt2_pretokenize("a  42!? \xC3\xA9t\xC3\xA9   "),
            (std::vector<std::string_view>{"a", " ", " 42", "!?", " \xC3\xA9t\xC3\xA9", "   "}));
  EXPECT_EQ(gpt2_pretokenize("x\t\ny"), (std::vector<std::string_view>{"x", "\t", "\n", "y"}));
  EXPECT_TRUE(gpt2_pretokenize("").empty());
}

TEST(UnicodeText, Llama3Pretokenize) {
  // Contractions in either case; numbers in threes; one non-letter joins the
  // letters after it; line breaks end a whitespace run or follow punctuation.
  EXPECT_EQ(llama3_pretokenize("I'M here 1234567\n\n  ok"),
            (std::vector<std::string_view>{"I", "'M", " here", " ", "123", "456", "7", "\n\n", " ", " ok"}));
  EXPECT_EQ(llama3_pretokenize("\tx (y) z!!\r\n\r\n  w   "),
            (std::vector<std::string_view>{"\tx", " (", "y", ")", " z", "!!\r\n\r\n", " ", " w", "   "}));
  EXPECT_EQ(llama3_pretokenize("a \n  b\n"), (std::vector<std::string_view>{"a", " \n", " ", " b", "\n"}));
  EXPECT_EQ(llama3_pretokenize("\xC3\xA9t\xC3\xA9 12\xD9\xA3"),
            (std::vector<std::string_view>{"\xC3\xA9t\xC3\xA9", " ", "12\xD9\xA3"}));  // U+0663 is a digit
  EXPECT_TRUE(llama3_pretokenize("").empty());
}

TEST(UnicodeText, Gpt2ByteMap) {
  EXPECT_EQ(gpt2_bytes_to_unicode(" "), "\xC4\xA0");  // "Ġ"
  EXPECT_EQ(gpt2_bytes_to_unicode("\n"), "\xC4\x8A");  // "Ċ"
  EXPECT_EQ(gpt2_bytes_to_unicode("a"), "a");
  std::string all;
  for (int b = 0; b < 256; ++b) all += char(b);
  const std::string mapped = gpt2_bytes_to_unicode(all);
  EXPECT_EQ(gpt2_unicode_to_bytes(mapped), all);
  // Outside the map, text passes through.
  EXPECT_EQ(gpt2_unicode_to_bytes("\xE2\x96\x81"), "\xE2\x96\x81");
}

TEST(UnicodeText, DecodeUtf8) {
  size_t len;
  EXPECT_EQ(decode_utf8("\xC3\xA9", 0, &len), U'\u00E9');
  EXPECT_EQ(len, 2u);
  EXPECT_EQ(decode_utf8("\xF0\x9F\xA6\x99", 0, &len), U'\U0001F999');
  EXPECT_EQ(len, 4u);
  EXPECT_EQ(decode_utf8("\xC0\xAF", 0, &len), U'\uFFFD');  // overlong
  EXPECT_EQ(len, 1u);
  EXPECT_EQ(decode_utf8("\xED\xA0\x80", 0, &len), U'\uFFFD');  // surrogate
  EXPECT_EQ(len, 1u);
  EXPECT_EQ(decode_utf8("\xE2\x82", 0, &len), U'\uFFFD');  // truncated
  EXPECT_EQ(len, 1u);
}

// A llama2.c tokenizer file: max_token_length, then {score, len, bytes} per token.
struct Llama2cRecord {
  float score;
  int32_t len;
  std::string text;
};

std::string llama2c_file(int32_t max_token_length, const std::vector<Llama2cRecord>& records) {
  std::string out;
  auto put = [&](const void* p, size_t n) { out.append(static_cast<const char*>(p), n); };
  put(&max_token_length, 4);
  for (const Llama2cRecord& r : records) {
    put(&r.score, 4);
    put(&r.len, 4);
    out += r.text;
  }
  return out;
}

const std::vector<Llama2cRecord> kTinyRecords = {
    {0, 5, "<unk>"}, {0, 5, "\n<s>\n"}, {0, 6, "\n</s>\n"}, {-1, 2, " a"}};

TEST(Llama2cVocab, ReadsAWellFormedFile) {
  const std::string path = temp_path("ok.bin");
  write_all(path, llama2c_file(6, kTinyRecords));
  const Vocab v = load_llama2c_vocab(path, 4);
  EXPECT_EQ(v.tokens, (std::vector<std::string>{"<unk>", "<s>", "</s>", "\xE2\x96\x81" "a"}));
  EXPECT_EQ(v.scores, (std::vector<float>{0, 0, 0, -1}));
}

TEST(Llama2cVocab, RejectsMalformedFiles) {
  const std::string good = llama2c_file(6, kTinyRecords);
  auto expect_rejected = [&](const std::string& name, const std::string& bytes, int32_t vocab_size) {
    const std::string path = temp_path(name);
    write_all(path, bytes);
    EXPECT_THROW((void)load_llama2c_vocab(path, vocab_size), Error) << name;
  };
  expect_rejected("empty.bin", "", 4);
  expect_rejected("header_only.bin", good.substr(0, 4), 4);
  for (size_t cut : {size_t(6), size_t(10), good.size() - 1})
    expect_rejected("cut" + std::to_string(cut) + ".bin", good.substr(0, cut), 4);
  expect_rejected("too_few_tokens.bin", good, 5);
  expect_rejected("trailing.bin", good + "x", 4);
  expect_rejected("zero_max.bin", llama2c_file(0, kTinyRecords), 4);
  expect_rejected("longer_than_max.bin", llama2c_file(5, kTinyRecords), 4);
  auto with_last = [&](Llama2cRecord r) {
    std::vector<Llama2cRecord> records = kTinyRecords;
    records.back() = r;
    return llama2c_file(6, records);
  };
  expect_rejected("negative_len.bin", with_last({-1, -2, ""}), 4);
  expect_rejected("huge_len.bin", with_last({-1, 0x7FFFFFFF, "ab"}), 4);
  expect_rejected("nan_score.bin", with_last({std::nanf(""), 2, " a"}), 4);
  expect_rejected("small_vocab.bin", good, 2);
  EXPECT_THROW((void)load_llama2c_vocab(temp_path("does_not_exist.bin"), 4), Error);
}

// A metadata-only GGUF v3 file, for testing vocabulary validation.
class GgufWriter {
 public:
  void str(const std::string& key, const std::string& value) {
    kv(key, GgufType::STRING);
    put_str(value);
  }
  void u32(const std::string& key, uint32_t value) {
    kv(key, GgufType::U32);
    put(value);
  }
  void strings(const std::string& key, const std::vector<std::string>& values) {
    array(key, GgufType::STRING, values.size());
    for (const std::string& s : values) put_str(s);
  }
  void floats(const std::string& key, const std::vector<float>& values) {
    array(key, GgufType::F32, values.size());
    for (float f : values) put(f);
  }
  void ints(const std::string& key, const std::vector<int32_t>& values) {
    array(key, GgufType::I32, values.size());
    for (int32_t i : values) put(i);
  }
  std::string bytes() const {
    std::string head;
    auto put_head = [&](auto v) { head.append(reinterpret_cast<const char*>(&v), sizeof(v)); };
    put_head(uint32_t(0x46554747));
    put_head(uint32_t(3));
    put_head(uint64_t(0));  // tensors
    put_head(uint64_t(count_));
    return head + body_;
  }

 private:
  template <class T>
  void put(T v) { body_.append(reinterpret_cast<const char*>(&v), sizeof(v)); }
  void put_str(const std::string& s) {
    put(uint64_t(s.size()));
    body_ += s;
  }
  void kv(const std::string& key, GgufType type) {
    put_str(key);
    put(uint32_t(type));
    ++count_;
  }
  void array(const std::string& key, GgufType element, size_t n) {
    kv(key, GgufType::ARRAY);
    put(uint32_t(element));
    put(uint64_t(n));
  }
  std::string body_;
  uint64_t count_ = 0;
};

// Writes a small "llama" vocabulary, lets `edit` change it, and loads it.
template <class Edit, class Extra = void (*)(GgufWriter&)>
Vocab load_edited_gguf(const std::string& name, Edit edit, Extra extra = [](GgufWriter&) {}) {
  std::vector<std::string> tokens = {"<unk>", "<s>", "</s>", "a"};
  std::vector<float> scores = {0, 0, 0, -1};
  std::vector<int32_t> types = {2, 3, 3, 1};
  std::string model = "llama";
  uint32_t bos = 1;
  edit(model, tokens, scores, types, bos);
  GgufWriter w;
  w.str("tokenizer.ggml.model", model);
  w.strings("tokenizer.ggml.tokens", tokens);
  w.floats("tokenizer.ggml.scores", scores);
  w.ints("tokenizer.ggml.token_type", types);
  w.u32("tokenizer.ggml.bos_token_id", bos);
  extra(w);
  const std::string path = temp_path(name);
  write_all(path, w.bytes());
  return load_gguf_vocab(GgufFile(path));
}

TEST(GgufVocab, ValidatesMetadata) {
  auto no_edit = [](auto&...) {};
  const Vocab v = load_edited_gguf("ok.gguf", no_edit);
  EXPECT_EQ(v.tokens.size(), 4u);
  EXPECT_EQ(v.eos_id, 2);
  EXPECT_TRUE(v.add_bos);
  EXPECT_TRUE(v.add_space_prefix);

  EXPECT_THROW(load_edited_gguf("model.gguf", [](auto& model, auto&...) { model = "bert"; }), Error);
  EXPECT_THROW(load_edited_gguf("scores.gguf", [](auto&, auto&, auto& scores, auto&...) {
                 scores.pop_back();
               }), Error);
  EXPECT_THROW(load_edited_gguf("types.gguf", [](auto&, auto&, auto&, auto& types, auto&) {
                 types.push_back(1);
               }), Error);
  EXPECT_THROW(load_edited_gguf("type_value.gguf", [](auto&, auto&, auto&, auto& types, auto&) {
                 types[3] = 9;
               }), Error);
  EXPECT_THROW(load_edited_gguf("bos.gguf", [](auto&, auto&, auto&, auto&, auto& bos) { bos = 4; }),
               Error);
  // A gpt2 vocabulary needs merges and explicit special ids.
  EXPECT_THROW(load_edited_gguf("gpt2.gguf", [](auto& model, auto&...) { model = "gpt2"; }), Error);
}

// Chat models end a turn with a control token that is often not the GGUF's
// EOS; generation must stop there too.
TEST(GgufVocab, FindsEndOfTurnTokens) {
  const Vocab plain = load_edited_gguf("plain.gguf", [](auto&...) {});
  EXPECT_TRUE(plain.end_of_turn_ids.empty());
  EXPECT_EQ(Tokenizer(plain).end_of_generation_ids(), std::vector<int32_t>{2});
  const Vocab chat = load_edited_gguf("chat.gguf", [](auto&, auto& tokens, auto& scores, auto& types, auto&) {
    // Control tokens 4 and 5 end a turn; token 6 is spelled like one but is
    // a normal token (text a user may type).
    const std::pair<const char*, int32_t> added[] = {{"<|im_end|>", 3}, {"<|eot_id|>", 3}, {"<|end|>", 1}};
    for (const auto& [piece, type] : added) {
      tokens.push_back(piece);
      scores.push_back(0);
      types.push_back(type);
    }
  });
  EXPECT_EQ(chat.end_of_turn_ids, (std::vector<int32_t>{4, 5}));
  EXPECT_EQ(Tokenizer(chat).end_of_generation_ids(), (std::vector<int32_t>{2, 4, 5}));
  // A GGUF may name its end of turn; 0xFFFFFFFF names none.
  const Vocab named = load_edited_gguf("named.gguf", [](auto&...) {}, [](GgufWriter& w) {
    w.u32("tokenizer.ggml.eot_token_id", 3);
    w.u32("tokenizer.ggml.eom_token_id", 0xFFFFFFFFu);
  });
  EXPECT_EQ(named.end_of_turn_ids, std::vector<int32_t>{3});
}

// A named end of turn outside the vocabulary is an error, as a BOS or EOS
// one is: ignored, generation would run past every turn's end.
TEST(GgufVocab, EndOfTurnIdOutsideVocabularyIsAnError) {
  for (const char* key : {"tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"}) {
    SCOPED_TRACE(key);
    for (uint32_t id : {4u, 99u}) {
      expect_error_containing([&] {
        (void)load_edited_gguf("eot_range.gguf", [](auto&...) {}, [&](GgufWriter& w) { w.u32(key, id); });
      }, std::string(key) + " = " + std::to_string(id) + " is outside the vocabulary of 4");
    }
  }
}

// tokenizer.ggml.pre picks a "gpt2" vocabulary's split; an unknown one is an
// error rather than text split by the wrong rules.
TEST(GgufVocab, ReadsPreTokenizer) {
  auto gpt2_with_pre = [](const std::string& name, std::optional<std::string> pre) {
    return load_edited_gguf(name, [](auto& model, auto&...) { model = "gpt2"; }, [&](GgufWriter& w) {
      w.strings("tokenizer.ggml.merges", {"a a"});
      w.u32("tokenizer.ggml.eos_token_id", 2);
      if (pre) w.str("tokenizer.ggml.pre", *pre);
    });
  };
  EXPECT_EQ(gpt2_with_pre("pre_none.gguf", std::nullopt).pre, PreTokenizer::Gpt2);
  for (const char* name : {"gpt-2", "gpt2", "default"})
    EXPECT_EQ(gpt2_with_pre("pre_gpt2.gguf", name).pre, PreTokenizer::Gpt2) << name;
  for (const char* name : {"llama-bpe", "llama3", "llama-v3"})
    EXPECT_EQ(gpt2_with_pre("pre_llama3.gguf", name).pre, PreTokenizer::Llama3) << name;
  expect_error_containing([&] { (void)gpt2_with_pre("pre_qwen2.gguf", "qwen2"); },
                          "pre-tokenizer 'qwen2' (tokenizer.ggml.pre) is not supported");
  // SentencePiece vocabularies have no pre-tokenizer, whatever the key says.
  const Vocab spm = load_edited_gguf("pre_spm.gguf", [](auto&...) {}, [](GgufWriter& w) {
    w.str("tokenizer.ggml.pre", "qwen2");
  });
  EXPECT_EQ(spm.kind, TokenizerKind::SentencePiece);
}

TEST(Tokenizer, RejectsInconsistentVocab) {
  Vocab v;
  v.tokens = {"<unk>", "<s>", "</s>"};
  v.scores = {0, 0};
  v.types.assign(3, TokenType::Normal);
  EXPECT_THROW(Tokenizer{v}, Error);
  v.scores.push_back(0);
  v.eos_id = 3;
  EXPECT_THROW(Tokenizer{v}, Error);
  v.eos_id = 2;
  v.kind = TokenizerKind::Gpt2Bpe;
  v.merges = {"ab"};
  EXPECT_THROW(Tokenizer{v}, Error);
}

}  // namespace
}  // namespace kvserve
