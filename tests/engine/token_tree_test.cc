// Speculation trees: static rank trees (parsing, order, the shipped default), the TokenTree's
// growth under each policy and its acceptance walk, and prompt-lookup drafting.
#include "engine/speculation/token_tree.h"

#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "engine/speculation/ngram.h"
#include "engine/speculation/static_tree.h"

namespace deft::engine {
namespace {

std::vector<TokenLogprob> top(std::initializer_list<std::pair<TokenId, float>> entries) {
  std::vector<TokenLogprob> out;
  for (const auto& [token, logprob] : entries) out.push_back({token, logprob});
  return out;
}

TEST(StaticTree, KeepsTheGivenOrderButPutsParentsFirst) {
  absl::StatusOr<StaticTree> tree = StaticTree::from_paths({{0, 1}, {0}, {1}, {0, 0}, {0, 1, 0}});
  ASSERT_TRUE(tree.ok()) << tree.status();
  EXPECT_EQ(tree->paths(),
            (std::vector<std::vector<int32_t>>{{0}, {0, 1}, {1}, {0, 0}, {0, 1, 0}}));
  EXPECT_EQ(tree->depth(), 3);
  EXPECT_EQ(tree->top_k(), 2);
  // Children in rank order.
  EXPECT_EQ(std::vector<int32_t>(tree->children(0).begin(), tree->children(0).end()),
            (std::vector<int32_t>{3, 1}));
}

TEST(StaticTree, BadPathsAreRefusedByName) {
  EXPECT_EQ(StaticTree::from_paths({}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(StaticTree::from_paths({{0}, {}}).status().message().find("path 1 is empty"),
            std::string::npos);
  EXPECT_NE(StaticTree::from_paths({{0}, {1, 0}}).status().message().find("prefix [1]"),
            std::string::npos);
  EXPECT_NE(StaticTree::from_paths({{0}, {0}}).status().message().find("twice"), std::string::npos);
  EXPECT_NE(StaticTree::from_paths({{20}}).status().message().find("ranks must be"),
            std::string::npos);
  EXPECT_FALSE(StaticTree::from_json("{").ok());
  EXPECT_FALSE(StaticTree::from_json("[[0], [\"x\"]]").ok());
  EXPECT_FALSE(StaticTree::from_json("{\"paths\": []}").ok());
  EXPECT_TRUE(StaticTree::from_json("{\"Tree_Structure\": [[0], [1], [0, 0]]}").ok());
}

TEST(StaticTree, TheShippedDefaultIsTheGeneratedOne) {
  const StaticTree tree = default_static_tree(63, 6);
  EXPECT_EQ(tree.size(), 63);
  EXPECT_LE(tree.depth(), 6);
  EXPECT_EQ(tree.paths()[0], std::vector<int32_t>{0});
  std::ifstream file(DEFT_SOURCE_DIR "/configs/speculative_tree.json");
  std::stringstream text;
  text << file.rdbuf();
  absl::StatusOr<StaticTree> shipped = StaticTree::from_json(text.str());
  ASSERT_TRUE(shipped.ok()) << shipped.status();
  EXPECT_EQ(shipped->paths(), tree.paths())
      << "configs/speculative_tree.json should hold: " << nlohmann::json(tree.paths()).dump();
}

TEST(TokenTree, StaticPolicyRealisesRanksLevelByLevel) {
  auto paths = std::make_shared<const StaticTree>(
      *StaticTree::from_paths({{0}, {1}, {0, 0}, {0, 1}, {1, 0}}));
  const SpeculativeOptions options{
      .policy = TreePolicy::kStatic, .tree_tokens = 5, .depth = 4, .tree = paths};
  TokenTree tree(&options);
  tree.reset(4);
  std::vector<int32_t> expand;
  tree.expansions(0, &expand);
  EXPECT_EQ(expand, std::vector<int32_t>{-1});
  tree.expand(-1, top({{10, -0.1f}, {11, -2.0f}, {12, -3.0f}}));
  EXPECT_EQ(std::vector<TokenId>(tree.tokens().begin(), tree.tokens().end()),
            (std::vector<TokenId>{10, 11}));
  tree.expansions(1, &expand);
  EXPECT_EQ(expand, (std::vector<int32_t>{0, 1}));
  tree.expand(0, top({{20, -0.5f}, {21, -1.0f}}));
  tree.expand(1, top({{30, -0.5f}}));
  tree.expansions(2, &expand);
  EXPECT_TRUE(expand.empty());
  tree.finish();
  EXPECT_EQ(std::vector<TokenId>(tree.tokens().begin(), tree.tokens().end()),
            (std::vector<TokenId>{10, 11, 20, 21, 30}));
  EXPECT_EQ(std::vector<int32_t>(tree.parents().begin(), tree.parents().end()),
            (std::vector<int32_t>{-1, -1, 0, 0, 1}));
  // The walk: draws 10 at the anchor, 21 after it, then 99 (no such child): 2 accepted.
  std::vector<int32_t> rows;
  tree.walk(std::vector<TokenId>{10, 21, 30, 0, 99, 0}, &rows);
  EXPECT_EQ(rows, (std::vector<int32_t>{0, 1, 4}));
  rows.clear();
  tree.walk(std::vector<TokenId>{5, 0, 0, 0, 0, 0}, &rows);
  EXPECT_EQ(rows, std::vector<int32_t>{0});
}

TEST(TokenTree, DynamicPolicyKeepsTheMostProbablePaths) {
  const SpeculativeOptions options{
      .policy = TreePolicy::kDynamic, .tree_tokens = 3, .depth = 3, .top_k = 2};
  TokenTree tree(&options);
  tree.reset(3);
  tree.expand(-1, top({{1, -0.1f}, {2, -1.5f}, {3, -4.0f}}));
  std::vector<int32_t> expand;
  tree.expansions(1, &expand);
  EXPECT_EQ(expand, (std::vector<int32_t>{0, 1}));  // top_k 2 of the level
  tree.expand(0, top({{4, -0.2f}, {5, -3.0f}}));    // paths -0.3, -3.1
  tree.expand(1, top({{6, -0.1f}, {7, -0.2f}}));    // paths -1.6, -1.7
  tree.expansions(2, &expand);
  EXPECT_EQ(expand, (std::vector<int32_t>{2, 4}));  // -0.3 and -1.6
  tree.finish();
  // The three most probable: 1 (-0.1), 1-4 (-0.3), 2 (-1.5).
  EXPECT_EQ(std::vector<TokenId>(tree.tokens().begin(), tree.tokens().end()),
            (std::vector<TokenId>{1, 2, 4}));
  EXPECT_EQ(std::vector<int32_t>(tree.parents().begin(), tree.parents().end()),
            (std::vector<int32_t>{-1, -1, 0}));
}

TEST(TokenTree, DepthLimitAndNgramPaths) {
  const SpeculativeOptions options{.policy = TreePolicy::kNgram, .tree_tokens = 4, .depth = 5};
  TokenTree tree(&options);
  tree.reset(2);  // e.g. two tokens left to the length limit
  tree.add_path(std::vector<TokenId>{1, 2, 3});
  tree.add_path(std::vector<TokenId>{1, 5});
  tree.add_path(std::vector<TokenId>{6, 7});
  tree.add_path(std::vector<TokenId>{8});  // over tree_tokens
  EXPECT_EQ(std::vector<TokenId>(tree.tokens().begin(), tree.tokens().end()),
            (std::vector<TokenId>{1, 2, 5, 6}));
  EXPECT_EQ(std::vector<int32_t>(tree.parents().begin(), tree.parents().end()),
            (std::vector<int32_t>{-1, 0, 0, -1}));
  tree.reset(0);
  tree.add_path(std::vector<TokenId>{1});
  EXPECT_EQ(tree.size(), 0);
}

TEST(Ngram, LongestRecentMatchesFirst) {
  // ... 1 2 3 4 | 9 9 | 1 2 3 5 | 7 | 2 3 -> suffix "2 3" (n = 2; "1 2 3" has no earlier
  // occurrence followed by anything? it has: "1 2 3 4" and "1 2 3 5"), so n = 3 is tried first:
  // the context ends with "7 2 3", which appears nowhere else; n = 2: "2 3" followed by 5, then
  // by 4.
  const std::vector<TokenId> context = {1, 2, 3, 4, 9, 9, 1, 2, 3, 5, 7, 2, 3};
  std::vector<std::vector<TokenId>> out;
  ngram_continuations(context, 3, 2, &out);
  ASSERT_GE(out.size(), 2u);
  EXPECT_EQ(out[0], (std::vector<TokenId>{5, 7}));
  EXPECT_EQ(out[1], (std::vector<TokenId>{4, 9}));
  ngram_continuations(std::vector<TokenId>{1}, 3, 2, &out);
  EXPECT_TRUE(out.empty());
  ngram_continuations(std::vector<TokenId>{4, 4, 4}, 3, 4, &out);
  ASSERT_FALSE(out.empty());
  EXPECT_EQ(out[0], (std::vector<TokenId>{4}));
}

}  // namespace
}  // namespace deft::engine
