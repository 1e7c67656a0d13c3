// HfTokenizer: small hand-made tokenizer.json files (always run), and the golden comparison
// with the Hugging Face reference on the real Llama 3 and Llama 2 tokenizer.json files (skipped
// when scripts/fetch_tokenizers.sh has not been run).
#include "engine/tokenizer/hf_tokenizer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <thread>

#include "engine/tokenizer/utf8.h"
#include "nlohmann/json.hpp"
#include "tests/engine/tokenizer_test_util.h"

namespace deft::engine {
namespace {

using json = nlohmann::json;
using ::testing::HasSubstr;
using testing::tiny_byte_level_json;
using testing::tiny_sentencepiece_json;

std::unique_ptr<HfTokenizer> from_json(const json& root) {
  auto tokenizer = HfTokenizer::from_json(root.dump(), "test.json");
  EXPECT_TRUE(tokenizer.ok()) << tokenizer.status();
  return tokenizer.ok() ? std::move(*tokenizer) : nullptr;
}

std::vector<TokenId> encode_ok(const Tokenizer& tokenizer, std::string_view text,
                               bool parse_special = true) {
  auto ids = tokenizer.encode(text, /*add_bos=*/false, parse_special);
  EXPECT_TRUE(ids.ok()) << ids.status();
  return ids.ok() ? *ids : std::vector<TokenId>();
}

TEST(HfTokenizerTest, ByteLevelMergesByRank) {
  auto tokenizer = from_json(tiny_byte_level_json());
  ASSERT_NE(tokenizer, nullptr);
  EXPECT_TRUE(tokenizer->is_byte_level());
  EXPECT_FALSE(tokenizer->decode_strips_leading_space());
  // " the": Ġ t h e -> (rank 0) Ġt h e -> (rank 1) Ġt he -> (rank 2) Ġthe.
  EXPECT_EQ(encode_ok(*tokenizer, " the"), std::vector<TokenId>({258}));
  // "the": no Ġ, so only "h e" applies.
  EXPECT_EQ(encode_ok(*tokenizer, "the"), std::vector<TokenId>({'t', 257}));
  // The regex splits "the the": "the", " the".
  EXPECT_EQ(encode_ok(*tokenizer, "the the"), std::vector<TokenId>({'t', 257, 258}));
  // Bytes map to their byte tokens: "é" is C3 A9.
  EXPECT_EQ(encode_ok(*tokenizer, "\xC3\xA9"), std::vector<TokenId>({0xC3, 0xA9}));
}

TEST(HfTokenizerTest, SpecialTokensSplitLeftmostLongest) {
  auto tokenizer = from_json(tiny_byte_level_json());
  ASSERT_NE(tokenizer, nullptr);
  EXPECT_EQ(encode_ok(*tokenizer, "a<|eot_id|>b"), std::vector<TokenId>({'a', 301, 'b'}));
  EXPECT_EQ(encode_ok(*tokenizer, "<|eot|><|eot|>"), std::vector<TokenId>({300, 300}));
  EXPECT_EQ(encode_ok(*tokenizer, "<|eot_i"),
            std::vector<TokenId>({'<', '|', 'e', 'o', 't', '_', 'i'}));
  // parse_special=false: the text stays text.
  const std::vector<TokenId> literal = encode_ok(*tokenizer, "<|eot|>", /*parse_special=*/false);
  EXPECT_EQ(literal.size(), 7u);
  EXPECT_EQ(tokenizer->decode(literal), "<|eot|>");
  EXPECT_TRUE(tokenizer->is_special(301));
  EXPECT_FALSE(tokenizer->is_special('a'));
  EXPECT_EQ(tokenizer->token_id("<|eot_id|>"), 301);
  EXPECT_EQ(tokenizer->token_id("nope"), std::nullopt);
  EXPECT_EQ(tokenizer->bos_id(), 302);
  EXPECT_EQ(tokenizer->decode(std::vector<TokenId>{302, 'h', 'i', 301}, /*skip_special=*/true),
            "hi");
  EXPECT_EQ(tokenizer->decode(std::vector<TokenId>{302, 'h', 'i'}), "<|begin_of_text|>hi");
}

TEST(HfTokenizerTest, ByteLevelRoundTripsAnyText) {
  auto tokenizer = from_json(tiny_byte_level_json());
  ASSERT_NE(tokenizer, nullptr);
  for (const std::string text : {"", " ", "Hello, world!\n\n", "日本語 😀👨‍👩‍👧",
                                 "a\tb\r\nc  d   ", "I'm  you'RE\u00a0x"}) {
    const std::vector<TokenId> ids = encode_ok(*tokenizer, text);
    EXPECT_EQ(tokenizer->decode(ids), text);
    std::string bytes;
    for (TokenId id : ids) bytes += tokenizer->token_bytes(id);
    EXPECT_EQ(bytes, text);
  }
}

TEST(HfTokenizerTest, RejectsInvalidUtf8) {
  auto tokenizer = from_json(tiny_byte_level_json());
  ASSERT_NE(tokenizer, nullptr);
  auto ids = tokenizer->encode("ab\xFF", false);
  ASSERT_FALSE(ids.ok());
  EXPECT_EQ(ids.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(HfTokenizerTest, SentencePieceStyleWithByteFallback) {
  auto tokenizer = from_json(tiny_sentencepiece_json());
  ASSERT_NE(tokenizer, nullptr);
  EXPECT_FALSE(tokenizer->is_byte_level());
  EXPECT_TRUE(tokenizer->decode_strips_leading_space());
  EXPECT_EQ(encode_ok(*tokenizer, "Hi"), std::vector<TokenId>({263}));
  // " Hi" -> "▁▁Hi" -> ▁ ▁Hi
  EXPECT_EQ(encode_ok(*tokenizer, " Hi"), std::vector<TokenId>({259, 263}));
  // 😀 = F0 9F 98 80 is not in the vocabulary: four byte tokens.
  const std::vector<TokenId> emoji = encode_ok(*tokenizer, "Hi \xF0\x9F\x98\x80");
  EXPECT_EQ(emoji, std::vector<TokenId>({263, 259, 3 + 0xF0, 3 + 0x9F, 3 + 0x98, 3 + 0x80}));
  EXPECT_EQ(tokenizer->decode(emoji), "Hi \xF0\x9F\x98\x80");
  EXPECT_EQ(tokenizer->decode(encode_ok(*tokenizer, " Hi")), " Hi");
  // Special tokens split the text; each piece gets its own ▁.
  EXPECT_EQ(encode_ok(*tokenizer, "<s>Hi</s>"), std::vector<TokenId>({1, 263, 2}));
  EXPECT_EQ(tokenizer->decode(std::vector<TokenId>{1, 263, 2}), "<s> Hi</s>");
  EXPECT_EQ(tokenizer->decode(std::vector<TokenId>{1, 263, 2}, /*skip_special=*/true), "Hi");
  // A lone continuation byte decodes to U+FFFD, per byte token.
  EXPECT_EQ(tokenizer->decode(std::vector<TokenId>{263, 3 + 0x80, 3 + 0x80}),
            "Hi\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(tokenizer->token_bytes(263), " Hi");
  EXPECT_EQ(tokenizer->token_bytes(3 + 0xF0), "\xF0");
  EXPECT_EQ(tokenizer->token_to_piece(262), "\xE2\x96\x81H");
  EXPECT_EQ(tokenizer->vocab_size(), 264);
  auto with_bos = tokenizer->encode("Hi", /*add_bos=*/true);
  ASSERT_TRUE(with_bos.ok());
  EXPECT_EQ(*with_bos, std::vector<TokenId>({1, 263}));
  EXPECT_EQ(tokenizer->eos_ids(), std::vector<TokenId>({2}));
}

TEST(HfTokenizerTest, ErrorsNameTheField) {
  json unigram = tiny_sentencepiece_json();
  unigram["model"]["type"] = "Unigram";
  auto status = HfTokenizer::from_json(unigram.dump(), "x/tokenizer.json").status();
  EXPECT_THAT(status.message(), HasSubstr("x/tokenizer.json"));
  EXPECT_THAT(status.message(), HasSubstr("model.type"));

  json bad_merge = tiny_sentencepiece_json();
  bad_merge["model"]["merges"] = json::array({"\xE2\x96\x81 Q"});
  status = HfTokenizer::from_json(bad_merge.dump(), "tokenizer.json").status();
  EXPECT_THAT(status.message(), HasSubstr("model.merges[0]"));

  json nfkc = tiny_sentencepiece_json();
  nfkc["normalizer"] = {{"type", "NFKC"}};
  status = HfTokenizer::from_json(nfkc.dump(), "tokenizer.json").status();
  EXPECT_THAT(status.message(), HasSubstr("normalizer.type"));

  json bad_regex = tiny_byte_level_json();
  bad_regex["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed";
  status = HfTokenizer::from_json(bad_regex.dump(), "tokenizer.json").status();
  EXPECT_THAT(status.message(), HasSubstr("pre_tokenizer.Split.pattern"));

  status = HfTokenizer::from_json("{not json", "tokenizer.json").status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  status = HfTokenizer::load("/nonexistent/tokenizer.json").status();
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(status.message(), HasSubstr("/nonexistent/tokenizer.json"));
}

// --- golden comparison with the reference on the real files --------------------------------

struct GoldenRow {
  std::string text;
  json row;
};

std::vector<json> read_golden() {
  std::ifstream file(testing::golden_file());
  std::vector<json> rows;
  std::string line;
  bool header = true;
  while (std::getline(file, line)) {
    if (line.empty()) continue;
    if (header) {
      header = false;
      continue;
    }
    rows.push_back(json::parse(line));
  }
  return rows;
}

std::string ids_text(const std::vector<TokenId>& ids) {
  std::string out = "[";
  for (size_t i = 0; i < ids.size(); ++i) out += (i ? "," : "") + std::to_string(ids[i]);
  return out + "]";
}

void check_golden(const std::string& model) {
  const std::filesystem::path dir = testing::real_tokenizer_dir(model);
  if (dir.empty()) GTEST_SKIP() << testing::kFetchHint;
  auto tokenizer = load_tokenizer(dir.string());
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  const std::vector<json> rows = read_golden();
  ASSERT_GE(rows.size(), 1000u);
  int strings = 0, mismatches = 0, decode_mismatches = 0;
  for (const json& row : rows) {
    if (!row.contains("text")) continue;
    ++strings;
    const std::string text = row["text"].get<std::string>();
    const std::vector<TokenId> expected = row[model].get<std::vector<TokenId>>();
    auto ids = (*tokenizer)->encode(text, /*add_bos=*/false);
    ASSERT_TRUE(ids.ok()) << ids.status();
    if (*ids != expected) {
      if (++mismatches <= 10) {
        ADD_FAILURE() << model << " mismatch for " << json(text).dump() << "\n  expected "
                      << ids_text(expected) << "\n  got      " << ids_text(*ids);
      }
    }
    std::string expected_text = text;
    if (model == "llama2" && row.contains("llama2_decoded")) {
      expected_text = row["llama2_decoded"].get<std::string>();
    }
    const std::string decoded = (*tokenizer)->decode(expected);
    if (decoded != expected_text && ++decode_mismatches <= 10) {
      ADD_FAILURE() << model << " decode mismatch for " << json(text).dump() << ": got "
                    << json(decoded).dump();
    }
  }
  std::cout << "[golden] " << model << ": " << strings << " strings, " << mismatches
            << " encode mismatches, " << decode_mismatches << " decode mismatches\n";
  EXPECT_EQ(mismatches, 0);
  EXPECT_EQ(decode_mismatches, 0);
}

TEST(HfTokenizerGoldenTest, Llama3MatchesReference) { check_golden("llama3"); }
TEST(HfTokenizerGoldenTest, Llama2MatchesReference) { check_golden("llama2"); }

TEST(HfTokenizerGoldenTest, Llama3ChatTemplateMatchesReference) {
  const std::filesystem::path dir = testing::real_tokenizer_dir("llama3");
  if (dir.empty()) GTEST_SKIP() << testing::kFetchHint;
  auto tokenizer = load_tokenizer(dir.string());
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  int chats = 0;
  for (const json& row : read_golden()) {
    if (!row.contains("chat")) continue;
    ++chats;
    std::vector<ChatMessage> messages;
    for (const json& message : row["chat"]) {
      messages.push_back(
          {message["role"].get<std::string>(), message["content"].get<std::string>()});
    }
    auto ids = encode_llama3_chat(**tokenizer, messages);
    ASSERT_TRUE(ids.ok()) << ids.status();
    EXPECT_EQ(ids_text(*ids), ids_text(row["llama3"].get<std::vector<TokenId>>()))
        << row["chat"].dump();
  }
  EXPECT_GE(chats, 4);
}

TEST(HfTokenizerGoldenTest, Llama3SpecialTokensAndConfig) {
  const std::filesystem::path dir = testing::real_tokenizer_dir("llama3");
  if (dir.empty()) GTEST_SKIP() << testing::kFetchHint;
  auto tokenizer = load_tokenizer(dir.string());
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  const Tokenizer& t = **tokenizer;
  EXPECT_EQ(t.bos_id(), 128000);  // tokenizer_config.json bos_token <|begin_of_text|>
  EXPECT_EQ(t.eos_ids(), std::vector<TokenId>({128001}));
  EXPECT_EQ(t.vocab_size(), 128256);
  EXPECT_EQ(t.token_id("<|eot_id|>"), 128009);
  EXPECT_TRUE(t.is_special(128009));
  auto ids = t.encode("Hello world", /*add_bos=*/true);
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(*ids, std::vector<TokenId>({128000, 9906, 1917}));
  EXPECT_EQ(t.token_to_piece(1917), "\xC4\xA0world");  // "Ġworld"
  EXPECT_EQ(t.decode(*ids, /*skip_special=*/true), "Hello world");
}

// The Llama 2 file rewritten to the Metaspace layout of newer sentencepiece-style files; keep in
// step with metaspaceVariant() in tokenizer_golden/make_metaspace_golden.mjs.
json metaspace_variant(json tokenizer_json, const std::string& scheme, bool split) {
  const json metaspace = {{"type", "Metaspace"},
                          {"replacement", "\xE2\x96\x81"},
                          {"prepend_scheme", scheme},
                          {"split", split}};
  tokenizer_json["normalizer"] = nullptr;
  tokenizer_json["pre_tokenizer"] = metaspace;
  tokenizer_json["decoder"] = {{"type", "Sequence"},
                               {"decoders", json::array({{{"type", "ByteFallback"}}, metaspace})}};
  return tokenizer_json;
}

TEST(HfTokenizerGoldenTest, MetaspaceVariantsMatchReference) {
  const std::filesystem::path dir = testing::real_tokenizer_dir("llama2");
  if (dir.empty()) GTEST_SKIP() << testing::kFetchHint;
  std::ifstream llama2_file(dir / "tokenizer.json");
  const json llama2 = json::parse(llama2_file);
  const std::vector<std::pair<std::string, json>> variants = {
      {"first", metaspace_variant(llama2, "first", false)},
      {"always", metaspace_variant(llama2, "always", true)}};
  std::ifstream golden(testing::golden_file().parent_path() / "golden_metaspace.jsonl");
  std::vector<json> rows;
  std::string line;
  while (std::getline(golden, line)) rows.push_back(json::parse(line));
  ASSERT_GT(rows.size(), 1u);
  rows.erase(rows.begin());  // header
  for (const auto& [name, variant_json] : variants) {
    auto tokenizer = HfTokenizer::from_json(variant_json.dump(), name);
    ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
    int mismatches = 0;
    for (const json& row : rows) {
      const std::string text = row["text"].get<std::string>();
      const std::vector<TokenId> expected = row[name].get<std::vector<TokenId>>();
      auto ids = (*tokenizer)->encode(text, false);
      ASSERT_TRUE(ids.ok()) << ids.status();
      const std::string expected_text = row.value(name + "_decoded", text);
      const std::string decoded = (*tokenizer)->decode(expected);
      if ((*ids != expected || decoded != expected_text) && ++mismatches <= 5) {
        ADD_FAILURE() << name << ": " << json(text).dump() << " expected " << ids_text(expected)
                      << " got " << ids_text(*ids) << "; decoded " << json(decoded).dump();
      }
    }
    std::cout << "[golden] metaspace " << name << ": " << rows.size() << " strings, " << mismatches
              << " mismatches\n";
    EXPECT_EQ(mismatches, 0);
  }
}

TEST(HfTokenizerGoldenTest, LongRunsRoundTrip) {
  for (const std::string model : {"llama3", "llama2"}) {
    const std::filesystem::path dir = testing::real_tokenizer_dir(model);
    if (dir.empty()) GTEST_SKIP() << testing::kFetchHint;
    auto tokenizer = load_tokenizer(dir.string());
    ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
    std::string emoji;
    for (int i = 0; i < 20000; ++i) emoji += "\xF0\x9F\x98\x80";
    for (const std::string& text :
         {"a" + std::string(200000, ' ') + "b", std::string(200000, 'a'), std::string(100000, '\n'),
          " \t" + std::string(50000, '\t') + "x", std::string(30000, '9'), emoji}) {
      auto ids = (*tokenizer)->encode(text, false);
      ASSERT_TRUE(ids.ok()) << ids.status();
      EXPECT_LE(ids->size(), text.size() + 1);
      EXPECT_EQ((*tokenizer)->decode(*ids), text) << model << " " << text.substr(0, 8);
    }
  }
}

// encode() from several threads at once (the BPE cache is shared) gives the golden ids.
TEST(HfTokenizerGoldenTest, ConcurrentEncodeMatchesReference) {
  const std::filesystem::path dir = testing::real_tokenizer_dir("llama3");
  if (dir.empty()) GTEST_SKIP() << testing::kFetchHint;
  auto tokenizer = load_tokenizer(dir.string());
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  std::vector<json> rows;
  for (json& row : read_golden()) {
    if (row.contains("text")) rows.push_back(std::move(row));
  }
  std::atomic<int> mismatches = 0;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      // Each thread walks the strings from a different start, so cache fills interleave.
      for (size_t i = 0; i < rows.size(); ++i) {
        const json& row = rows[(i + static_cast<size_t>(t) * rows.size() / 4) % rows.size()];
        auto ids = (*tokenizer)->encode(row["text"].get<std::string>(), false);
        if (!ids.ok() || *ids != row["llama3"].get<std::vector<TokenId>>()) ++mismatches;
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(mismatches.load(), 0);
}

TEST(HfTokenizerGoldenTest, EncodeThroughput) {
  const std::filesystem::path dir = testing::real_tokenizer_dir("llama3");
  if (dir.empty()) GTEST_SKIP() << testing::kFetchHint;
  for (const std::string model : {"llama3", "llama2"}) {
    auto tokenizer = load_tokenizer(testing::real_tokenizer_dir(model).string());
    ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
    std::string corpus;
    for (const json& row : read_golden()) {
      if (row.contains("text")) corpus += row["text"].get<std::string>() + "\n";
    }
    const auto start = std::chrono::steady_clock::now();
    size_t tokens = 0;
    for (int repeat = 0; repeat < 3; ++repeat) {
      auto ids = (*tokenizer)->encode(corpus, false);
      ASSERT_TRUE(ids.ok());
      tokens += ids->size();
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::cout << "[throughput] " << model << ": " << 3 * corpus.size() / seconds / 1e6 << " MB/s, "
              << tokens / seconds / 1e6 << " M tokens/s (" << corpus.size() << " bytes x3)\n";
  }
}

}  // namespace
}  // namespace deft::engine
