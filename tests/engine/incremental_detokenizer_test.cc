// IncrementalDetokenizer: never emits half a character, applies the sentencepiece
// leading-space rule once, and streams exactly what decode() gives.
#include "engine/tokenizer/incremental_detokenizer.h"

#include <gtest/gtest.h>

#include <fstream>

#include "engine/tokenizer/hf_tokenizer.h"
#include "engine/tokenizer/utf8.h"
#include "tests/engine/tokenizer_test_util.h"

namespace deft::engine {
namespace {

using json = nlohmann::json;

std::unique_ptr<HfTokenizer> tiny_sentencepiece() {
  auto tokenizer = HfTokenizer::from_json(testing::tiny_sentencepiece_json().dump(), "t.json");
  EXPECT_TRUE(tokenizer.ok()) << tokenizer.status();
  return std::move(*tokenizer);
}

constexpr TokenId kByte0 = 3;  // <0x00> in the tiny tokenizer
constexpr TokenId kSpace = 259, kHi = 263, kBos = 1, kEos = 2;

TEST(IncrementalDetokenizerTest, EmojiSplitAcrossByteFallbackTokens) {
  auto tokenizer = tiny_sentencepiece();
  IncrementalDetokenizer detokenizer(*tokenizer, /*starts_text=*/true);
  EXPECT_EQ(detokenizer.feed(kBos), "");
  EXPECT_EQ(detokenizer.feed(kHi), "Hi");  // the text's leading space is dropped
  EXPECT_EQ(detokenizer.feed(kSpace), " ");
  // 😀 = F0 9F 98 80 as four byte tokens: nothing until the last one.
  EXPECT_EQ(detokenizer.feed(kByte0 + 0xF0), "");
  EXPECT_EQ(detokenizer.feed(kByte0 + 0x9F), "");
  EXPECT_EQ(detokenizer.feed(kByte0 + 0x98), "");
  EXPECT_EQ(detokenizer.pending_bytes(), 3u);
  EXPECT_EQ(detokenizer.feed(kByte0 + 0x80), "\xF0\x9F\x98\x80");
  EXPECT_EQ(detokenizer.feed(kHi), " Hi");  // later spaces are kept
  EXPECT_EQ(detokenizer.feed(kEos), "");
  EXPECT_EQ(detokenizer.finish(), "");
  EXPECT_EQ(detokenizer.text(), "Hi \xF0\x9F\x98\x80 Hi");
}

TEST(IncrementalDetokenizerTest, ContinuationKeepsTheLeadingSpace) {
  auto tokenizer = tiny_sentencepiece();
  IncrementalDetokenizer continuation(*tokenizer, /*starts_text=*/false);
  EXPECT_EQ(continuation.feed(kHi), " Hi");
  IncrementalDetokenizer start(*tokenizer, /*starts_text=*/true);
  EXPECT_EQ(start.feed(kHi), "Hi");
}

TEST(IncrementalDetokenizerTest, SpecialTokensShownWhenAsked) {
  auto tokenizer = tiny_sentencepiece();
  IncrementalDetokenizer detokenizer(*tokenizer, /*starts_text=*/true, /*skip_special=*/false);
  EXPECT_EQ(detokenizer.feed(kBos), "<s>");
  EXPECT_EQ(detokenizer.feed(kHi), " Hi");  // as decode(): "<s> Hi"
  EXPECT_EQ(detokenizer.text(), tokenizer->decode(std::vector<TokenId>{kBos, kHi}));
}

TEST(IncrementalDetokenizerTest, IllFormedBytesBecomeReplacementCharacters) {
  auto tokenizer = tiny_sentencepiece();
  IncrementalDetokenizer detokenizer(*tokenizer);
  // A lone continuation byte can never become a character: replaced at once.
  EXPECT_EQ(detokenizer.feed(kByte0 + 0x80), "\xEF\xBF\xBD");
  // A lead byte followed by ASCII: replaced when the ASCII arrives.
  EXPECT_EQ(detokenizer.feed(kByte0 + 0xE2), "");
  EXPECT_EQ(detokenizer.feed(kByte0 + 'A'),
            "\xEF\xBF\xBD"
            "A");
  // An unfinished character at the end.
  EXPECT_EQ(detokenizer.feed(kByte0 + 0xF0), "");
  EXPECT_EQ(detokenizer.finish(), "\xEF\xBF\xBD");
}

// Streams each golden string token by token through the real tokenizer: every piece is
// valid UTF-8 and the pieces add up to decode(ids).
void check_streaming(const std::string& model) {
  const auto dir = testing::real_tokenizer_dir(model);
  if (dir.empty()) GTEST_SKIP() << testing::kFetchHint;
  auto tokenizer = load_tokenizer(dir.string());
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  std::ifstream file(testing::golden_file());
  std::string line;
  int strings = 0, split_characters = 0;
  while (std::getline(file, line)) {
    const json row = json::parse(line);
    if (!row.contains("text")) continue;
    ++strings;
    const std::vector<TokenId> ids = row[model].get<std::vector<TokenId>>();
    IncrementalDetokenizer detokenizer(**tokenizer, /*starts_text=*/true);
    std::string streamed;
    for (TokenId id : ids) {
      const std::string piece = detokenizer.feed(id);
      ASSERT_TRUE(utf8::is_valid(piece)) << json(row["text"]).dump();
      split_characters += piece.empty() && !(*tokenizer)->token_bytes(id, true).empty();
      streamed += piece;
    }
    streamed += detokenizer.finish();
    ASSERT_EQ(streamed, (*tokenizer)->decode(ids, /*skip_special=*/true))
        << json(row["text"]).dump();
  }
  EXPECT_GT(strings, 1000);
  EXPECT_GT(split_characters, 0);  // the golden strings do split characters across tokens
}

TEST(IncrementalDetokenizerTest, Llama3StreamsLikeDecode) { check_streaming("llama3"); }
TEST(IncrementalDetokenizerTest, Llama2StreamsLikeDecode) { check_streaming("llama2"); }

}  // namespace
}  // namespace deft::engine
