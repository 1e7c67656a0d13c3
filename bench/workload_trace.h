// The DeFT paper's workload traces (../shared/workloads/, see its README) and their replay on a
// SequenceTree: the tree topologies the planner sees step by step, without a model. Support code
// of the benchmarks and the workload replay test; the engine does not use it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/attention_planner.h"
#include "engine/sequence_tree.h"

namespace deft::bench {

using engine::NodeId;
using engine::QueryToken;
using engine::SequenceTree;

// One tree-of-thought record: node 0 is the prompt (prefilled before iteration 1); every other
// node decodes one token per iteration during [start, end]; a childless node that ends before
// the last iteration is pruned at its end.
struct ReasoningTrace {
  struct Node {
    int32_t parent = -1;
    int32_t length = 0;
    int32_t start = 0;
    int32_t end = 0;
    std::vector<int32_t> children;
  };
  std::vector<Node> nodes;  // indexed by the trace's node id
  int32_t last_iteration = 0;
};

// The complete records of a reasoning trace file, in file order.
absl::StatusOr<std::vector<ReasoningTrace>> load_reasoning_traces(const std::string& path);

// A Medusa token tree and the recorded acceptance lengths of its records.
struct SpecDecTrace {
  std::vector<int32_t> parent;  // per tree token, 0 = the root candidate; parent[0] = -1
  std::vector<std::vector<int32_t>> accept_lengths;  // per record, per step
  int32_t tree_size() const { return static_cast<int32_t>(parent.size()); }
};

absl::StatusOr<SpecDecTrace> load_specdec_trace(const std::string& path);

// Drives a tree through a reasoning trace: each step() is one decoding iteration.
class ReasoningReplay {
 public:
  // Prefills the prompt into `tree`'s root (which must be empty).
  ReasoningReplay(const ReasoningTrace& trace, SequenceTree& tree);
  const absl::Status& status() const { return status_; }

  // Runs the next iteration's topology changes (nodes created, one token appended per live
  // node) and returns its queries; false after the last iteration. The previous iteration's
  // finished childless nodes are pruned first.
  bool step(std::vector<QueryToken>& queries);
  int32_t iteration() const { return iteration_; }

 private:
  const ReasoningTrace& trace_;
  SequenceTree& tree_;
  std::vector<NodeId> node_of_;  // trace node id -> tree node id (-1: not created / pruned)
  int32_t iteration_ = 0;
  absl::Status status_;
};

// Drives a tree through speculative decoding steps: a prefix, then per step the whole token
// tree as queries; commit() keeps `accepted` tokens along the top-ranked path (appended to the
// prefix, as a real verifier copies the accepted KV) and drops the rest of the token tree.
class SpecDecReplay {
 public:
  SpecDecReplay(const SpecDecTrace& trace, SequenceTree& tree, int32_t prefix_tokens);
  const absl::Status& status() const { return status_; }
  // Hangs the token tree under the prefix and returns its queries (one per tree token).
  void build_token_tree(std::vector<QueryToken>& queries);
  // Commits `accepted` tokens (>= 1) and removes the token tree.
  void commit(int32_t accepted);
  NodeId prefix_node() const { return prefix_; }

 private:
  const SpecDecTrace& trace_;
  SequenceTree& tree_;
  NodeId prefix_;
  NodeId token_tree_root_ = -1;
  std::vector<NodeId> token_nodes_;  // build_token_tree's scratch: tree node of each tree token
  absl::Status status_;
};

}  // namespace deft::bench
