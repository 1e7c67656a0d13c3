// A request's `speculative` option (GenerateRequest, and the HTTP API's "deft" extension) as the
// engine's SpeculativeOptions: defaults filled in, checked against what the server has (a draft
// model, its static tree, max_speculative_tokens).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "deft/v1/deft.pb.h"
#include "engine/speculation/speculative_options.h"

namespace deft::server {

// What the server offers speculative requests (fixed at start).
struct SpeculationOffer {
  bool draft_model = false;                        // --draft-model loaded
  std::shared_ptr<const engine::StaticTree> tree;  // the static policy's rank tree
  int32_t max_tree_tokens = 128;                   // max_speculative_tokens
};

// Null for POLICY_OFF. INVALID_ARGUMENT naming `field` for an unknown policy or sizes out of
// range (tree_tokens in [1, max_speculative_tokens], depth in [1, 32], top_k in [1, 20]);
// FAILED_PRECONDITION for a draft-model policy on a server without one.
absl::StatusOr<std::shared_ptr<const engine::SpeculativeOptions>> speculative_options(
    const v1::SpeculativeOptions& request, const SpeculationOffer& offer, const std::string& field);

// The speculative options' policy by its HTTP name: "static", "dynamic", "ngram", "off".
// INVALID_ARGUMENT for another name.
absl::StatusOr<v1::SpeculativeOptions::Policy> policy_by_name(const std::string& name);

}  // namespace deft::server
