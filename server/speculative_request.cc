#include "server/speculative_request.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "engine/sampler.h"

namespace deft::server {
namespace {

// Deeper trees than this accept next to nothing more and cost a draft pass per level.
constexpr int32_t kMaxDepth = 32;

absl::Status in_range(const std::string& field, const char* name, int32_t value, int32_t low,
                      int32_t high, const char* note = "") {
  if (value >= low && value <= high) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, ".", name, " = ", value, " must be in [", low, ", ", high, "]", note));
}

}  // namespace

absl::StatusOr<std::shared_ptr<const engine::SpeculativeOptions>> speculative_options(
    const v1::SpeculativeOptions& request, const SpeculationOffer& offer,
    const std::string& field) {
  engine::SpeculativeOptions options;
  int32_t default_tokens = 0;
  int32_t default_top_k = 0;
  switch (request.policy()) {
    case v1::SpeculativeOptions::POLICY_OFF:
      return std::shared_ptr<const engine::SpeculativeOptions>();
    case v1::SpeculativeOptions::POLICY_STATIC_TREE:
      options.policy = engine::TreePolicy::kStatic;
      options.tree = offer.tree;
      default_tokens = offer.tree != nullptr ? offer.tree->size() : 63;
      default_top_k = 8;
      break;
    case v1::SpeculativeOptions::POLICY_DYNAMIC_TREE:
      options.policy = engine::TreePolicy::kDynamic;
      default_tokens = 32;
      default_top_k = 8;
      break;
    case v1::SpeculativeOptions::POLICY_NGRAM:
      options.policy = engine::TreePolicy::kNgram;
      default_tokens = 16;
      default_top_k = 4;
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".policy = ", static_cast<int>(request.policy()),
          " is not a policy (POLICY_OFF, POLICY_STATIC_TREE, POLICY_DYNAMIC_TREE, POLICY_NGRAM)"));
  }
  if (options.policy != engine::TreePolicy::kNgram && !offer.draft_model) {
    return absl::FailedPreconditionError(absl::StrCat(
        field, ": the ", options.policy == engine::TreePolicy::kStatic ? "static" : "dynamic",
        " tree policy drafts with a draft model and this server has none (start it with "
        "--draft-model DIR); POLICY_NGRAM needs none"));
  }
  options.tree_tokens = request.tree_tokens() == 0 ? std::min(default_tokens, offer.max_tree_tokens)
                                                   : request.tree_tokens();
  options.depth = request.depth() == 0 ? 6 : request.depth();
  options.top_k = request.top_k() == 0 ? default_top_k : request.top_k();
  if (absl::Status status = in_range(field, "tree_tokens", options.tree_tokens, 1,
                                     offer.max_tree_tokens, " (max_speculative_tokens)");
      !status.ok()) {
    return status;
  }
  if (absl::Status status = in_range(field, "depth", options.depth, 1, kMaxDepth); !status.ok()) {
    return status;
  }
  if (absl::Status status = in_range(field, "top_k", options.top_k, 1, engine::kMaxTopLogprobs);
      !status.ok()) {
    return status;
  }
  return std::make_shared<const engine::SpeculativeOptions>(std::move(options));
}

absl::StatusOr<v1::SpeculativeOptions::Policy> policy_by_name(const std::string& name) {
  if (name == "static") return v1::SpeculativeOptions::POLICY_STATIC_TREE;
  if (name == "dynamic") return v1::SpeculativeOptions::POLICY_DYNAMIC_TREE;
  if (name == "ngram") return v1::SpeculativeOptions::POLICY_NGRAM;
  if (name == "off") return v1::SpeculativeOptions::POLICY_OFF;
  return absl::InvalidArgumentError(
      absl::StrCat("speculative policy \"", name, "\" is not static, dynamic, ngram or off"));
}

}  // namespace deft::server
