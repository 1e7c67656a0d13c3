// tokenizer.json parsing and use under random edits of the two small tokenizers of
// tokenizer_test_util.h (byte-level and sentencepiece-style BPE): any value in the document
// swapped for an extreme or ill-typed one, keys dropped, strings damaged (vocabulary pieces,
// merges, regex patterns, special tokens), and text-level damage. Each edit is refused with
// INVALID_ARGUMENT naming the file, or gives a tokenizer that encodes and decodes without
// crashing: encode answers OK or INVALID_ARGUMENT, every id it returns is inside the vocabulary,
// and decode takes any id of the vocabulary. Seeds are fixed (the failing one is printed).
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "engine/tokenizer/hf_tokenizer.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/engine/tokenizer_test_util.h"
#include "tests/testing/fuzz_outcomes.h"

namespace deft::engine {
namespace {

using json = nlohmann::json;

constexpr int kIterations = 3000;

json extreme_value(std::mt19937_64& rng) {
  static const std::vector<json> kValues = {
      0,          -1,   1,           255,   256,
      int64_t{1} << 31, std::numeric_limits<int64_t>::max(), -1e308, 0.5,  "",
      "a",        "\xE2\x96\x81", "(", "[", "\\",
      "(?i:a|b)", "a e", "<|eot|>", nullptr, true,
      json::array(), json::array({"a b"}), json::object(), json::object({{"type", "BPE"}}),
      json::object({{"type", "Split"}, {"pattern", {{"Regex", "(a"}}}, {"behavior", "Isolated"}}),
  };
  return kValues[rng() % kValues.size()];
}

void damage_string(std::string& s, std::mt19937_64& rng) {
  static constexpr char kChars[] = "ab \\()[]{}?*+|^$.\xC3\xA9\xE2\x96\x81<>|";
  if (s.empty() || rng() % 3 == 0) {
    s.insert(s.begin() + static_cast<std::ptrdiff_t>(s.empty() ? 0 : rng() % s.size()),
             kChars[rng() % (sizeof(kChars) - 1)]);
    return;
  }
  const size_t at = rng() % s.size();
  if (rng() % 2 == 0) {
    s.erase(at, 1);
  } else {
    s[at] = static_cast<char>(s[at] ^ static_cast<char>(1u << (rng() % 8)));
  }
}

// Edits one value at a random depth of the document.
void edit_json(json& node, std::mt19937_64& rng, int depth = 0) {
  const bool descend = (node.is_object() || node.is_array()) && !node.empty() && rng() % 4 != 0;
  if (descend) {
    const size_t pick = rng() % node.size();
    if (node.is_object()) {
      auto it = node.begin();
      std::advance(it, static_cast<std::ptrdiff_t>(pick));
      if (depth > 0 && rng() % 8 == 0) {
        node.erase(it);
        return;
      }
      edit_json(it.value(), rng, depth + 1);
    } else {
      if (rng() % 8 == 0) {
        node.erase(pick);
        return;
      }
      edit_json(node[pick], rng, depth + 1);
    }
    return;
  }
  if (node.is_string() && rng() % 2 == 0) {
    std::string s = node.get<std::string>();
    damage_string(s, rng);
    node = s;  // may hold invalid UTF-8: dump() below replaces it
    return;
  }
  node = extreme_value(rng);
}

// Exercises an accepted tokenizer; every id must be inside its vocabulary.
void check_accepted(const HfTokenizer& tokenizer, std::mt19937_64& rng) {
  const int32_t vocab = tokenizer.vocab_size();
  ASSERT_GT(vocab, 0);
  std::string random_bytes(1 + rng() % 40, '\0');
  for (char& c : random_bytes) c = static_cast<char>(rng() % 256);
  const std::string texts[] = {"the the", " Hi", "Hi there\n\n", "a<|eot_id|>b<s>", "\xC3\xA9",
                               std::string(300, 'a'), random_bytes};
  for (const std::string& text : texts) {
    for (const bool parse_special : {true, false}) {
      absl::StatusOr<std::vector<TokenId>> ids = tokenizer.encode(text, true, parse_special);
      if (!ids.ok()) {
        ASSERT_EQ(ids.status().code(), absl::StatusCode::kInvalidArgument) << ids.status();
        continue;
      }
      for (TokenId id : *ids) {
        ASSERT_GE(id, 0);
        ASSERT_LT(id, vocab);
      }
      (void)tokenizer.decode(*ids);
      (void)tokenizer.decode(*ids, /*skip_special=*/true);
    }
  }
  for (int i = 0; i < 64; ++i) {
    const auto id = static_cast<TokenId>(rng() % static_cast<uint64_t>(vocab));
    (void)tokenizer.token_to_piece(id);
    (void)tokenizer.token_bytes(id);
    (void)tokenizer.is_special(id);
  }
}

TEST(HfTokenizerFuzzTest, RandomEditsAreRefusedClearlyOrUsable) {
  const json seeds[] = {testing::tiny_byte_level_json(), testing::tiny_sentencepiece_json()};
  int accepted = 0;
  int refused = 0;
  for (int iteration = 0; iteration < kIterations; ++iteration) {
    const uint64_t seed = 0x70c0'0000ull + static_cast<uint64_t>(iteration);
    SCOPED_TRACE(::testing::Message() << "seed " << seed);
    std::mt19937_64 rng(seed);
    json document = seeds[rng() % std::size(seeds)];
    const int edits = rng() % 4 == 0 ? 2 : 1;
    for (int edit = 0; edit < edits; ++edit) edit_json(document, rng);
    std::string text = document.dump(-1, ' ', false, json::error_handler_t::replace);
    if (rng() % 10 == 0 && !text.empty()) text.resize(rng() % text.size());

    absl::StatusOr<std::unique_ptr<HfTokenizer>> tokenizer =
        HfTokenizer::from_json(text, "fuzz.json");
    if (tokenizer.ok()) {
      ++accepted;
      check_accepted(**tokenizer, rng);
      if (::testing::Test::HasFatalFailure()) return;
    } else {
      ++refused;
      ASSERT_EQ(tokenizer.status().code(), absl::StatusCode::kInvalidArgument)
          << tokenizer.status();
      ASSERT_NE(tokenizer.status().message().find("fuzz.json"), absl::string_view::npos)
          << tokenizer.status();
    }
  }
  deft::testing::expect_both_outcomes(accepted, refused, kIterations / 50, kIterations / 10);
}

}  // namespace
}  // namespace deft::engine
