// A drafted token tree's rows in a step (speculative decoding: the server's own trees and the
// Verify RPC's): one query row per entry, under a leaf. A chain of entries (each the only child
// of the one before) shares one node, so a Medusa-style tree of t entries takes far fewer than t
// nodes and pages; an entry where the tree branches starts a node of its own.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "engine/works/work.h"

namespace deft::engine {

struct TreeRows {
  std::vector<NodeId> created;    // nodes made, each held once, parents before children
  std::vector<NodeId> node_of;    // per entry: the node holding it
  std::vector<int32_t> index_of;  // per entry: its token index in that node

  // Drops every node made (children first, so each frees its pages at once). Rejected drafts
  // are discarded, not cached: one token and one page each, they would push useful prefixes
  // out of the prefix cache.
  void discard(Forest& forest);
};

// Adds the rows of the tree (tokens[i] with parent entry parents[i], -1: under `under`; parents
// come first) to `step`, asking for the logits `logits` says of each (kLast: its own row), and
// calls after_row(i) right after entry i's row is added (to mark it for sampling). On a failure
// (KV short) the rows added so far stay in the step and `rows` says which nodes were made.
absl::Status add_tree_rows(StepContext& step, NodeId under, std::span<const TokenId> tokens,
                           std::span<const int32_t> parents, StepContext::Logits logits,
                           TreeRows* rows, const std::function<void(size_t)>& after_row = {});

}  // namespace deft::engine
