// load_tokenizer(): picking the file, BOS/EOS from tokenizer_config.json and
// generation_config.json, and error messages that name the file and the field.
#include "engine/tokenizer/tokenizer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "engine/tokenizer/hf_tokenizer.h"
#include "tests/engine/tokenizer_test_util.h"

namespace deft::engine {
namespace {

using ::testing::HasSubstr;
namespace fs = std::filesystem;

class LoadTokenizerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("deft_load_tokenizer_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

TEST_F(LoadTokenizerTest, PicksTokenizerJsonWithDefaults) {
  testing::write_file(dir_ / "tokenizer.json", testing::tiny_sentencepiece_json().dump());
  auto tokenizer = load_tokenizer(dir_.string());
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  EXPECT_NE(dynamic_cast<HfTokenizer*>(tokenizer->get()), nullptr);
  EXPECT_EQ((*tokenizer)->bos_id(), 1);
  EXPECT_EQ((*tokenizer)->eos_ids(), std::vector<TokenId>({2}));
}

TEST_F(LoadTokenizerTest, ConfigFilesOverrideBosAndEos) {
  testing::write_file(dir_ / "tokenizer.json", testing::tiny_byte_level_json().dump());
  // AddedToken object form, as older tokenizer_config.json files write it.
  testing::write_file(dir_ / "tokenizer_config.json",
                      R"({"bos_token": {"content": "<|begin_of_text|>", "lstrip": false},
                          "eos_token": "<|eot|>"})");
  auto tokenizer = load_tokenizer(dir_.string());
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  EXPECT_EQ((*tokenizer)->bos_id(), 302);
  EXPECT_EQ((*tokenizer)->eos_ids(), std::vector<TokenId>({300}));

  // generation_config.json wins, and may list several EOS ids (Llama 3 Instruct).
  testing::write_file(dir_ / "generation_config.json",
                      R"({"bos_token_id": 302, "eos_token_id": [300, 301]})");
  tokenizer = load_tokenizer(dir_.string());
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  EXPECT_EQ((*tokenizer)->eos_ids(), std::vector<TokenId>({300, 301}));
  EXPECT_TRUE((*tokenizer)->is_eos(301));
  EXPECT_FALSE((*tokenizer)->is_eos(302));
}

TEST_F(LoadTokenizerTest, ErrorsNameFileAndField) {
  auto missing = load_tokenizer(dir_.string());
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr(dir_.string()));

  testing::write_file(dir_ / "tokenizer.json", testing::tiny_byte_level_json().dump());
  testing::write_file(dir_ / "tokenizer_config.json", R"({"bos_token": "<nope>"})");
  auto bad_bos = load_tokenizer(dir_.string());
  ASSERT_FALSE(bad_bos.ok());
  EXPECT_THAT(bad_bos.status().message(), HasSubstr("tokenizer_config.json"));
  EXPECT_THAT(bad_bos.status().message(), HasSubstr("bos_token"));
  EXPECT_THAT(bad_bos.status().message(), HasSubstr("<nope>"));

  testing::write_file(dir_ / "tokenizer_config.json", "{}");
  testing::write_file(dir_ / "generation_config.json", R"({"eos_token_id": [300, 999999]})");
  auto bad_eos = load_tokenizer(dir_.string());
  ASSERT_FALSE(bad_eos.ok());
  EXPECT_THAT(bad_eos.status().message(), HasSubstr("generation_config.json"));
  EXPECT_THAT(bad_eos.status().message(), HasSubstr("eos_token_id[1]"));

  testing::write_file(dir_ / "generation_config.json", "[1, 2");
  auto bad_json = load_tokenizer(dir_.string());
  ASSERT_FALSE(bad_json.ok());
  EXPECT_THAT(bad_json.status().message(), HasSubstr("generation_config.json"));
}

TEST_F(LoadTokenizerTest, FallsBackToSentencePieceModel) {
  const fs::path trained = testing::train_tiny_sentencepiece_model("load");
  if (trained.empty()) GTEST_SKIP() << "spm_train (Debian package sentencepiece) is missing";
  fs::copy_file(trained / "tokenizer.model", dir_ / "tokenizer.model");
  fs::remove_all(trained);
  testing::write_file(dir_ / "generation_config.json", R"({"eos_token_id": 2})");
  auto tokenizer = load_tokenizer(dir_.string());
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  EXPECT_EQ(dynamic_cast<HfTokenizer*>(tokenizer->get()), nullptr);
  EXPECT_EQ((*tokenizer)->bos_id(), 1);
  EXPECT_EQ((*tokenizer)->eos_ids(), std::vector<TokenId>({2}));
  auto ids = (*tokenizer)->encode("hello world", /*add_bos=*/true);
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ((*tokenizer)->decode(*ids, /*skip_special=*/true), "hello world");
}

TEST(Llama3ChatTest, NeedsTheChatTokens) {
  auto tokenizer = HfTokenizer::from_json(testing::tiny_sentencepiece_json().dump(), "t.json");
  ASSERT_TRUE(tokenizer.ok());
  const std::vector<ChatMessage> messages = {{"user", "hi"}};
  auto ids = encode_llama3_chat(**tokenizer, messages);
  EXPECT_EQ(ids.status().code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace deft::engine
