// io/text.h: bytes made safe for a terminal and a log, streamed text, long values cut.
#include <gtest/gtest.h>

#include <string>

#include "io/text.h"

namespace fp8moe {
namespace {

TEST(Text, PrintableUtf8KeepsValidTextAndEscapesTheRest) {
  EXPECT_EQ(printable_utf8("plain\ttext\n"), "plain\ttext\n");
  EXPECT_EQ(printable_utf8("caf\xC3\xA9 \xE2\x82\xAC \xF0\x9F\x98\x80"), "caf\xC3\xA9 \xE2\x82\xAC \xF0\x9F\x98\x80");
  EXPECT_EQ(printable_utf8("a\xFF" "b"), "a\\xFF" "b");            // not UTF-8 at all
  EXPECT_EQ(printable_utf8("\xC3"), "\\xC3");                      // truncated sequence
  EXPECT_EQ(printable_utf8("\xC0\xAF"), "\\xC0\\xAF");            // overlong '/'
  EXPECT_EQ(printable_utf8("\xED\xA0\x80"), "\\xED\\xA0\\x80");  // a surrogate
  EXPECT_EQ(printable_utf8("\x1B[2J\r"), "\\x1B[2J\\x0D");          // terminal control bytes
}

TEST(Text, Utf8CompletePrefixHoldsBackOnlyAnUnfinishedSequence) {
  EXPECT_EQ(utf8_complete_prefix(""), 0u);
  EXPECT_EQ(utf8_complete_prefix("abc"), 3u);
  EXPECT_EQ(utf8_complete_prefix("caf\xC3"), 3u);              // 2-byte sequence begun
  EXPECT_EQ(utf8_complete_prefix("caf\xC3\xA9"), 5u);
  EXPECT_EQ(utf8_complete_prefix("x\xE2\x82"), 1u);           // 3-byte sequence, 2 of 3 bytes
  EXPECT_EQ(utf8_complete_prefix("x\xE2\x82\xAC"), 4u);
  EXPECT_EQ(utf8_complete_prefix("x\xF0\x9F\x98"), 1u);       // 4-byte sequence, 3 of 4 bytes
  EXPECT_EQ(utf8_complete_prefix("x\xF0\x9F\x98\x80"), 5u);
  EXPECT_EQ(utf8_complete_prefix("x\xFF"), 2u);                // not a lead byte: nothing to wait for
  // Streaming byte by byte, printing each complete prefix, gives what printing the whole does.
  const std::string text = "a\xC3\xA9\xE2\x82\xAC\xFF\xE2z\xF0\x9F\x98\x80\xC3";
  std::string streamed, pending;
  for (char c : text) {
    pending += c;
    const size_t n = utf8_complete_prefix(pending);
    streamed += printable_utf8(pending.substr(0, n));
    pending.erase(0, n);
  }
  streamed += printable_utf8(pending);
  EXPECT_EQ(streamed, printable_utf8(text));
}

TEST(Text, ShownCutsLongValuesAtACharacterAndSaysTheLength) {
  EXPECT_EQ(shown("short"), "short");
  EXPECT_EQ(shown(std::string(1 << 20, 'x'), 8), "xxxxxxxx... (1048576 bytes)");
  EXPECT_EQ(shown("abcdefg\xE2\x82\xAC", 8), "abcdefg... (10 bytes)");  // not half a euro sign
  EXPECT_EQ(shown("a\x01" "b"), "a\\x01b");                            // control bytes escaped
}

}  // namespace
}  // namespace fp8moe
