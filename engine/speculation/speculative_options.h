// What a request asks of server-side speculative decoding (the Generate `speculative` option):
// how each step drafts a token tree for every branch, which the target model then verifies in
// the step's one forward pass (engine/works/generate_work.h).
#pragma once

#include <cstdint>
#include <memory>

#include "engine/speculation/static_tree.h"

namespace deft::engine {

enum class TreePolicy : uint8_t {
  kStatic,   // a fixed tree of draft ranks (StaticTree), grown from the draft model's top lists
  kDynamic,  // EAGLE-2 style: expand the draft's most probable nodes, keep the best tree_tokens
  kNgram,    // prompt lookup: continuations of the context's last n-gram found earlier in it
};

struct SpeculativeOptions {
  TreePolicy policy = TreePolicy::kStatic;
  int32_t tree_tokens = 63;  // drafted entries verified per step (the tree's size)
  int32_t depth = 6;         // most drafted tokens on one path
  // kDynamic: children per expanded node and nodes expanded per level; kNgram: continuations.
  int32_t top_k = 8;
  // kStatic: the rank tree (shared by every request that uses it). Null: default_static_tree().
  std::shared_ptr<const StaticTree> tree;
};

}  // namespace deft::engine
