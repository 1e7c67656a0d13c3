#include "engine/branch_controller.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "kernels/check.h"

namespace deft::engine {
namespace {

using Trigger = BranchPolicyOptions::Trigger;
using Score = BranchPolicyOptions::Score;

absl::Status out_of_range(const char* field, int64_t low, int64_t high_inclusive, int64_t value) {
  return absl::InvalidArgumentError(
      absl::StrCat("policy.", field, " must be in [", low, ", ", high_inclusive, "], got ", value));
}

class PolicyBranchController final : public BranchController {
 public:
  explicit PolicyBranchController(BranchPolicyOptions options) : options_(std::move(options)) {}

  bool ends_segment(const NodeProgress& node) const override {
    switch (options_.trigger) {
      case Trigger::kEveryTokens:
        return node.tokens > 0 && node.tokens % options_.every_tokens == 0;
      case Trigger::kDelimiter:
        return node.text.ends_with(options_.delimiter);
      case Trigger::kStepEndToken:
        return node.last_token == options_.step_end_token;
    }
    return false;
  }

  double score(const NodeProgress& node) const override {
    if (options_.score == Score::kMeanLogprob) {
      return node.path_logprob / static_cast<double>(std::max<int64_t>(1, node.path_tokens));
    }
    return node.path_logprob;
  }

  std::vector<int32_t> select(std::span<const double> scores) const override {
    std::vector<int32_t> order(scores.size());
    std::iota(order.begin(), order.end(), 0);
    // Best first; NaN below every number; stable, so ties keep the lower index first.
    std::stable_sort(order.begin(), order.end(), [&scores](int32_t a, int32_t b) {
      const double score_a = scores[a];
      const double score_b = scores[b];
      if (std::isnan(score_b)) return !std::isnan(score_a);
      if (std::isnan(score_a)) return false;
      return score_a > score_b;
    });
    if (options_.keep_best > 0 && order.size() > static_cast<size_t>(options_.keep_best)) {
      order.resize(static_cast<size_t>(options_.keep_best));
    }
    return order;
  }

  int32_t branch_factor() const override { return options_.branch_factor; }
  int32_t max_depth() const override { return options_.max_depth; }

 private:
  BranchPolicyOptions options_;
};

}  // namespace

absl::Status validate_branch_policy(const BranchPolicyOptions& p, int32_t vocab_size,
                                    int32_t max_branches) {
  if (p.branch_factor < 1 || p.branch_factor > max_branches) {
    return out_of_range("branch_factor", 1, max_branches, p.branch_factor);
  }
  switch (p.trigger) {
    case Trigger::kEveryTokens:
      if (p.every_tokens < 1 || p.every_tokens > kMaxEveryTokens) {
        return out_of_range("every_tokens", 1, kMaxEveryTokens, p.every_tokens);
      }
      break;
    case Trigger::kDelimiter:
      if (p.delimiter.empty()) {
        return absl::InvalidArgumentError("policy.delimiter must be non-empty");
      }
      break;
    case Trigger::kStepEndToken:
      if (p.step_end_token < 0 || p.step_end_token >= vocab_size) {
        return absl::InvalidArgumentError(absl::StrCat("policy.step_end_token must be in [0, ",
                                                       vocab_size, ") (the vocabulary), got ",
                                                       p.step_end_token));
      }
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("policy.trigger: unknown trigger ", static_cast<int>(p.trigger)));
  }
  if (p.max_depth < 0 || p.max_depth > kMaxBranchDepth) {
    return out_of_range("max_depth", 0, kMaxBranchDepth, p.max_depth);
  }
  if (p.score != Score::kCumulativeLogprob && p.score != Score::kMeanLogprob) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy.score: unknown score ", static_cast<int>(p.score)));
  }
  if (p.keep_best < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy.keep_best must be >= 0 (0 = all), got ", p.keep_best));
  }
  return absl::OkStatus();
}

std::unique_ptr<BranchController> make_branch_controller(const BranchPolicyOptions& options) {
  const bool trigger_ok = (options.trigger == Trigger::kEveryTokens && options.every_tokens >= 1) ||
                          (options.trigger == Trigger::kDelimiter && !options.delimiter.empty()) ||
                          options.trigger == Trigger::kStepEndToken;
  DEFT_CHECK(options.branch_factor >= 1 && options.max_depth >= 0 &&
                 options.max_depth <= kMaxBranchDepth && options.keep_best >= 0 && trigger_ok,
             "make_branch_controller: policy not validated (branch_factor %d, max_depth %d, "
             "keep_best %d, trigger %d, every_tokens %d, delimiter of %zu bytes)",
             options.branch_factor, options.max_depth, options.keep_best,
             static_cast<int>(options.trigger), options.every_tokens, options.delimiter.size());
  return std::make_unique<PolicyBranchController>(options);
}

}  // namespace deft::engine
