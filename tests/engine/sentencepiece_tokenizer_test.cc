// SentencePieceTokenizer on a tiny BPE model trained by Debian's spm_train in a temp folder.
#include "engine/tokenizer/sentencepiece_tokenizer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "engine/tokenizer/sentencepiece_backend.h"
#include "engine/tokenizer/utf8.h"
#include "tests/engine/tokenizer_test_util.h"

namespace deft::engine {
namespace {

using ::testing::HasSubstr;

class SentencePieceTokenizerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    model_dir_ = new std::filesystem::path(testing::train_tiny_sentencepiece_model("suite"));
  }
  static void TearDownTestSuite() {
    if (!model_dir_->empty()) std::filesystem::remove_all(*model_dir_);
    delete model_dir_;
  }
  void SetUp() override {
    if (model_dir_->empty()) GTEST_SKIP() << "spm_train (Debian package sentencepiece) is missing";
    auto loaded = SentencePieceTokenizer::load((*model_dir_ / "tokenizer.model").string());
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    tokenizer_ = std::move(*loaded);
    std::string error;
    backend_ = SentencePieceBackend::load((*model_dir_ / "tokenizer.model").string(), &error);
    ASSERT_NE(backend_, nullptr) << error;
  }
  std::vector<TokenId> encode_ok(std::string_view text, bool add_bos = false,
                                 bool parse_special = true) {
    auto ids = tokenizer_->encode(text, add_bos, parse_special);
    EXPECT_TRUE(ids.ok()) << ids.status();
    return ids.ok() ? *ids : std::vector<TokenId>();
  }

  static std::filesystem::path* model_dir_;
  std::unique_ptr<SentencePieceTokenizer> tokenizer_;
  std::unique_ptr<SentencePieceBackend> backend_;
};
std::filesystem::path* SentencePieceTokenizerTest::model_dir_ = nullptr;

const std::vector<std::string> kTexts = {
    "hello world",
    "the quick brown fox jumps over the lazy dog",
    "naïve café 日本語",
    "hello 😀 world",
    "emoji only 👨‍👩‍👧 🦙",
    "unseen letters: Ωμέγα Привет",
    "tree attention decoding 123 456",
};

TEST_F(SentencePieceTokenizerTest, EncodeAndDecodeMatchTheLibrary) {
  for (const std::string& text : kTexts) {
    const std::vector<TokenId> ids = encode_ok(text, false, /*parse_special=*/false);
    EXPECT_EQ(ids, backend_->encode(text)) << text;
    EXPECT_EQ(tokenizer_->decode(ids, /*skip_special=*/true), backend_->decode(ids)) << text;
    EXPECT_EQ(tokenizer_->decode(ids), text);
    // With BOS first, the library skips it and so do we when skipping specials.
    std::vector<TokenId> with_bos = {1};
    with_bos.insert(with_bos.end(), ids.begin(), ids.end());
    EXPECT_EQ(tokenizer_->decode(with_bos, /*skip_special=*/true), backend_->decode(with_bos));
  }
}

TEST_F(SentencePieceTokenizerTest, UnseenCharactersFallBackToBytes) {
  const std::vector<TokenId> ids = encode_ok("\xF0\x9F\x98\x80");  // 😀, not in the corpus
  std::string bytes;
  int byte_tokens = 0;
  for (TokenId id : ids) {
    bytes += tokenizer_->token_bytes(id);
    byte_tokens += tokenizer_->token_to_piece(id).starts_with("<0x");
  }
  EXPECT_EQ(byte_tokens, 4);
  EXPECT_EQ(bytes, " \xF0\x9F\x98\x80");  // the dummy-prefix space, then the emoji's bytes
  EXPECT_TRUE(tokenizer_->decode_strips_leading_space());
  EXPECT_EQ(tokenizer_->decode(ids), "\xF0\x9F\x98\x80");
}

TEST_F(SentencePieceTokenizerTest, SpecialTokensAndBosEos) {
  EXPECT_EQ(tokenizer_->bos_id(), 1);
  EXPECT_EQ(tokenizer_->eos_ids(), std::vector<TokenId>({2}));
  EXPECT_TRUE(tokenizer_->is_eos(2));
  EXPECT_EQ(tokenizer_->token_id("<s>"), 1);
  EXPECT_EQ(tokenizer_->token_id("</s>"), 2);
  EXPECT_EQ(tokenizer_->token_id("<unk>"), 0);
  EXPECT_EQ(tokenizer_->token_id("no such piece"), std::nullopt);
  EXPECT_TRUE(tokenizer_->is_special(1));
  EXPECT_FALSE(tokenizer_->is_special(100));
  EXPECT_EQ(tokenizer_->vocab_size(), backend_->piece_size());

  const std::vector<TokenId> plain = encode_ok("hello world");
  std::vector<TokenId> expected = {1};
  expected.insert(expected.end(), plain.begin(), plain.end());
  EXPECT_EQ(encode_ok("hello world", /*add_bos=*/true), expected);

  // "<s>hello</s>": parsed into control ids, or kept as text.
  const std::vector<TokenId> parsed = encode_ok("<s>hello</s>");
  ASSERT_GE(parsed.size(), 3u);
  EXPECT_EQ(parsed.front(), 1);
  EXPECT_EQ(parsed.back(), 2);
  EXPECT_EQ(tokenizer_->decode(parsed, /*skip_special=*/true), "hello");
  EXPECT_EQ(tokenizer_->decode(parsed), "<s> hello</s>");
  const std::vector<TokenId> literal = encode_ok("<s>hello</s>", false, /*parse_special=*/false);
  EXPECT_EQ(std::count(literal.begin(), literal.end(), 1), 0);
  EXPECT_EQ(tokenizer_->decode(literal), "<s>hello</s>");
}

TEST_F(SentencePieceTokenizerTest, RejectsInvalidUtf8) {
  EXPECT_EQ(tokenizer_->encode("a\xC3", false).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(SentencePieceTokenizerLoadTest, BadFileNamesThePath) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("deft_spm_bad_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  testing::write_file(dir / "tokenizer.model", "not a model proto");
  auto loaded = SentencePieceTokenizer::load((dir / "tokenizer.model").string());
  ASSERT_FALSE(loaded.ok());
  EXPECT_THAT(loaded.status().message(), HasSubstr((dir / "tokenizer.model").string()));
  auto missing = SentencePieceTokenizer::load((dir / "missing.model").string());
  EXPECT_FALSE(missing.ok());
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace deft::engine
