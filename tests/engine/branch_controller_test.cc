#include "engine/branch_controller.h"

#include <limits>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace deft::engine {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using Trigger = BranchPolicyOptions::Trigger;
using Score = BranchPolicyOptions::Score;

constexpr int32_t kVocab = 100;
constexpr int32_t kMaxBranches = 64;

NodeProgress progress(int32_t tokens, TokenId last_token = 0, std::string_view text = "") {
  NodeProgress node;
  node.depth = 1;
  node.tokens = tokens;
  node.last_token = last_token;
  node.text = text;
  return node;
}

TEST(BranchControllerTest, EveryTokensFiresAtEachMultiple) {
  BranchPolicyOptions options;
  options.trigger = Trigger::kEveryTokens;
  options.every_tokens = 4;
  const auto controller = make_branch_controller(options);
  std::vector<int32_t> fired;
  for (int32_t tokens = 1; tokens <= 12; ++tokens) {
    if (controller->ends_segment(progress(tokens))) fired.push_back(tokens);
  }
  EXPECT_THAT(fired, ElementsAre(4, 8, 12));
  EXPECT_FALSE(controller->ends_segment(progress(0)));
}

TEST(BranchControllerTest, EveryTokenOfOneFiresEveryToken) {
  BranchPolicyOptions options;
  options.every_tokens = 1;
  const auto controller = make_branch_controller(options);
  for (int32_t tokens = 1; tokens <= 5; ++tokens) {
    EXPECT_TRUE(controller->ends_segment(progress(tokens))) << tokens;
  }
}

TEST(BranchControllerTest, DelimiterFiresWhenTextEndsWithIt) {
  BranchPolicyOptions options;
  options.trigger = Trigger::kDelimiter;
  options.delimiter = "\n\n";
  const auto controller = make_branch_controller(options);
  EXPECT_TRUE(controller->ends_segment(progress(3, 7, "Step 1: add.\n\n")));
  EXPECT_TRUE(controller->ends_segment(progress(1, 7, "\n\n")));
  EXPECT_FALSE(controller->ends_segment(progress(3, 7, "Step 1:\n\nadd")));
  EXPECT_FALSE(controller->ends_segment(progress(3, 7, "Step 1: add.\n")));
  EXPECT_FALSE(controller->ends_segment(progress(1, 7, "\n")));
  EXPECT_FALSE(controller->ends_segment(progress(1, 7, "")));
  // The token count plays no part.
  EXPECT_FALSE(controller->ends_segment(progress(16, 7, "sixteen tokens")));
}

TEST(BranchControllerTest, StepEndTokenFiresOnThatToken) {
  BranchPolicyOptions options;
  options.trigger = Trigger::kStepEndToken;
  options.step_end_token = 13;
  const auto controller = make_branch_controller(options);
  EXPECT_TRUE(controller->ends_segment(progress(5, 13)));
  EXPECT_TRUE(controller->ends_segment(progress(1, 13, "ends with \n\n but that is text")));
  EXPECT_FALSE(controller->ends_segment(progress(16, 12)));
  EXPECT_FALSE(controller->ends_segment(progress(16, 14)));
}

TEST(BranchControllerTest, CumulativeScoreIsPathLogprob) {
  BranchPolicyOptions options;
  options.score = Score::kCumulativeLogprob;
  const auto controller = make_branch_controller(options);
  NodeProgress node = progress(4);
  node.path_logprob = -6.0;
  node.path_tokens = 12;
  EXPECT_DOUBLE_EQ(controller->score(node), -6.0);
  node.path_tokens = 0;
  EXPECT_DOUBLE_EQ(controller->score(node), -6.0);
}

TEST(BranchControllerTest, MeanScoreIsLengthNormalised) {
  BranchPolicyOptions options;
  options.score = Score::kMeanLogprob;
  const auto controller = make_branch_controller(options);
  NodeProgress node = progress(4);
  node.path_logprob = -6.0;
  node.path_tokens = 12;
  EXPECT_DOUBLE_EQ(controller->score(node), -0.5);
  node.path_tokens = 1;
  EXPECT_DOUBLE_EQ(controller->score(node), -6.0);
  node.path_tokens = 0;  // max(1, 0): no division by zero
  EXPECT_DOUBLE_EQ(controller->score(node), -6.0);
  // A longer path with the same mean scores the same: the point of normalising.
  NodeProgress longer = node;
  longer.path_logprob = -12.0;
  longer.path_tokens = 24;
  node.path_tokens = 12;
  EXPECT_DOUBLE_EQ(controller->score(node), controller->score(longer));
}

TEST(BranchControllerTest, SelectOrdersBestFirstWithTiesToLowerIndex) {
  const auto controller = make_branch_controller(BranchPolicyOptions{});
  const std::vector<double> scores = {-3.0, -1.0, -2.0, -1.0, -5.0, -2.0};
  EXPECT_THAT(controller->select(scores), ElementsAre(1, 3, 2, 5, 0, 4));
  EXPECT_THAT(controller->select(std::vector<double>{}), ElementsAre());
  EXPECT_THAT(controller->select(std::vector<double>{0.0, 0.0, 0.0}), ElementsAre(0, 1, 2));
}

TEST(BranchControllerTest, SelectKeepsBestW) {
  BranchPolicyOptions options;
  options.keep_best = 2;
  const auto controller = make_branch_controller(options);
  EXPECT_THAT(controller->select(std::vector<double>{-3.0, -1.0, -2.0, -1.0}), ElementsAre(1, 3));
  // A tie at the cut keeps the lower index.
  EXPECT_THAT(controller->select(std::vector<double>{-2.0, -1.0, -2.0, -2.0}), ElementsAre(1, 0));
  // Fewer candidates than w: all, best first.
  EXPECT_THAT(controller->select(std::vector<double>{-4.0}), ElementsAre(0));
  EXPECT_THAT(controller->select(std::vector<double>{-4.0, 2.0}), ElementsAre(1, 0));
}

TEST(BranchControllerTest, SelectRanksNanLastAndInfinitiesByValue) {
  BranchPolicyOptions options;
  const auto controller = make_branch_controller(options);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  EXPECT_THAT(controller->select(std::vector<double>{nan, -inf, -1.0, nan, inf}),
              ElementsAre(4, 2, 1, 0, 3));
}

TEST(BranchControllerTest, ReportsBranchFactorAndMaxDepth) {
  BranchPolicyOptions options;
  options.branch_factor = 5;
  options.max_depth = 0;
  const auto controller = make_branch_controller(options);
  EXPECT_EQ(controller->branch_factor(), 5);
  EXPECT_EQ(controller->max_depth(), 0);
}

TEST(BranchControllerTest, DefaultsAreValid) {
  EXPECT_TRUE(validate_branch_policy(BranchPolicyOptions{}, kVocab, kMaxBranches).ok());
}

// The message of validating `options`, which must fail with INVALID_ARGUMENT.
std::string invalid_message(const BranchPolicyOptions& options) {
  const absl::Status status = validate_branch_policy(options, kVocab, kMaxBranches);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  return std::string(status.message());
}

TEST(BranchControllerTest, ValidationNamesTheField) {
  BranchPolicyOptions options;
  options.branch_factor = 0;
  EXPECT_EQ(invalid_message(options), "policy.branch_factor must be in [1, 64], got 0");
  options.branch_factor = 65;
  EXPECT_EQ(invalid_message(options), "policy.branch_factor must be in [1, 64], got 65");
  options.branch_factor = 64;
  EXPECT_TRUE(validate_branch_policy(options, kVocab, kMaxBranches).ok());

  options = {};
  options.every_tokens = 0;
  EXPECT_EQ(invalid_message(options), "policy.every_tokens must be in [1, 4096], got 0");
  options.every_tokens = 4097;
  EXPECT_EQ(invalid_message(options), "policy.every_tokens must be in [1, 4096], got 4097");
  options.every_tokens = 4096;
  EXPECT_TRUE(validate_branch_policy(options, kVocab, kMaxBranches).ok());

  options = {};
  options.trigger = Trigger::kDelimiter;
  EXPECT_EQ(invalid_message(options), "policy.delimiter must be non-empty");
  options.delimiter = "\n";
  options.every_tokens = 0;  // not the chosen trigger: not checked
  EXPECT_TRUE(validate_branch_policy(options, kVocab, kMaxBranches).ok());

  options = {};
  options.trigger = Trigger::kStepEndToken;
  EXPECT_THAT(invalid_message(options), HasSubstr("policy.step_end_token must be in [0, 100)"));
  EXPECT_THAT(invalid_message(options), HasSubstr("got -1"));
  options.step_end_token = kVocab;
  EXPECT_THAT(invalid_message(options), HasSubstr("got 100"));
  options.step_end_token = kVocab - 1;
  EXPECT_TRUE(validate_branch_policy(options, kVocab, kMaxBranches).ok());

  options = {};
  options.max_depth = -1;
  EXPECT_EQ(invalid_message(options), "policy.max_depth must be in [0, 16], got -1");
  options.max_depth = 17;
  EXPECT_EQ(invalid_message(options), "policy.max_depth must be in [0, 16], got 17");
  options.max_depth = 0;
  EXPECT_TRUE(validate_branch_policy(options, kVocab, kMaxBranches).ok());

  options = {};
  options.keep_best = -1;
  EXPECT_EQ(invalid_message(options), "policy.keep_best must be >= 0 (0 = all), got -1");

  options = {};
  options.trigger = static_cast<Trigger>(7);
  EXPECT_THAT(invalid_message(options), HasSubstr("policy.trigger"));
  options = {};
  options.score = static_cast<Score>(9);
  EXPECT_THAT(invalid_message(options), HasSubstr("policy.score"));
}

TEST(BranchControllerTest, ValidationUsesTheServerBranchLimit) {
  BranchPolicyOptions options;
  options.branch_factor = 8;
  EXPECT_TRUE(validate_branch_policy(options, kVocab, 8).ok());
  const absl::Status status = validate_branch_policy(options, kVocab, 4);
  EXPECT_EQ(status.message(), "policy.branch_factor must be in [1, 4], got 8");
}

TEST(BranchControllerDeathTest, UnvalidatedPolicyAborts) {
  BranchPolicyOptions options;
  options.every_tokens = 0;
  EXPECT_DEATH(make_branch_controller(options), "policy not validated");
}

}  // namespace
}  // namespace deft::engine
