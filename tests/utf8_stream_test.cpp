// Streamed pieces stay valid UTF-8: a character split over tokens is held back
// until complete, ill-formed bytes become U+FFFD, and the pieces concatenate to
// the sanitized whole.
#include "server/utf8_stream.h"

#include <gtest/gtest.h>

namespace kvserve {
namespace {

const std::string kReplacement = "\xEF\xBF\xBD";

TEST(Utf8Stream, HoldsBackACharacterSplitOverPieces) {
  Utf8Stream s;
  EXPECT_EQ(s.push("a\xE2"), "a");       // first byte of an em dash (E2 80 94)
  EXPECT_EQ(s.push("\x80"), "");
  EXPECT_EQ(s.push("\x94" "b"), "\xE2\x80\x94" "b");
  EXPECT_EQ(s.push("\xF0\x9F"), "");     // half of a 4-byte emoji
  EXPECT_EQ(s.push("\x98\x80!"), "\xF0\x9F\x98\x80!");
  EXPECT_EQ(s.finish(), "");
}

TEST(Utf8Stream, ReplacesIllFormedBytes) {
  Utf8Stream s;
  EXPECT_EQ(s.push("x\xFFy"), "x" + kReplacement + "y");
  EXPECT_EQ(s.push("\x80"), kReplacement);             // a continuation byte with no lead
  EXPECT_EQ(s.push("\xE2\x80" "z"), kReplacement + kReplacement + "z");  // a lead cut short by ASCII
  EXPECT_EQ(s.push("\xC3"), "");
  EXPECT_EQ(s.finish(), kReplacement);                 // the stream ended mid-character
  EXPECT_EQ(s.finish(), "");
}

TEST(Utf8Stream, PiecesConcatenateToTheSanitizedWhole) {
  const std::string text = "caf\xC3\xA9 \xE2\x80\x94 \xFF\xF0\x9F\x98\x80 end\xE2\x80";
  for (size_t step = 1; step <= 4; ++step) {
    Utf8Stream s;
    std::string out;
    for (size_t i = 0; i < text.size(); i += step) out += s.push(text.substr(i, step));
    out += s.finish();
    EXPECT_EQ(out, sanitize_utf8(text)) << "pieces of " << step;
  }
  EXPECT_EQ(sanitize_utf8(text), "caf\xC3\xA9 \xE2\x80\x94 " + kReplacement + "\xF0\x9F\x98\x80 end" + kReplacement +
                                     kReplacement);
}

}  // namespace
}  // namespace kvserve
