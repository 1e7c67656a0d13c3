// The shapes of serve_bench's tree jobs, taken from the paper's traces (../shared/workloads/,
// read by bench/workload_trace.h): each complete tree-of-thought record as a level-by-level plan
// (TreeSession jobs) and as a RunTree branch policy, and each Medusa token tree with one record's
// acceptance lengths (speculative sessions). Token contents are not in the traces; jobs draw them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace deft::bench::serve {

struct ServeOptions;

// One reasoning record. The trace's thoughts decode in parallel per depth; a thought with
// children is the one the search expands, a childless one before the last depth is pruned at
// its end.
struct TotShape {
  std::string name;  // "keywordToT#0": the file and the index of the complete record
  int32_t prompt_tokens = 0;
  struct Thought {
    int32_t parent = -1;  // index in the previous level; -1: the prompt
    int32_t tokens = 0;
    bool expanded = false;  // has children in the next level
  };
  std::vector<std::vector<Thought>> levels;  // levels[0]: the prompt's children

  // RunTree of the same shape: branch `branch_factor` ways (the widest fan-out) every
  // `every_tokens` (the median thought), `depth` levels, keep the best 1 per depth. With EOS
  // ignored it generates branch_factor * depth * every_tokens tokens, and every root-to-leaf
  // path depth * every_tokens (the request's max_tokens).
  int32_t branch_factor = 0;
  int32_t every_tokens = 0;
  int32_t depth() const { return static_cast<int32_t>(levels.size()); }
};

// One speculative-decoding record: a Medusa token tree and its recorded acceptance per step.
struct SpecShape {
  std::string name;              // "apps_tree_size64#3"
  std::vector<int32_t> parents;  // per entry, -1 for entry 0 (the root: the last bonus token)
  // The top-ranked path from the root: entry 0, its first-listed child, ... (Medusa lists a
  // node's children in rank order, so the first is the rank-0 candidate).
  std::vector<int32_t> top_path;
  std::vector<int32_t> accept_lengths;  // per step, the root included
  int32_t depth = 0;                    // entries on the tree's longest root-to-leaf path
};

struct WorkloadShapes {
  std::vector<TotShape> tot;    // every complete record of every --tot-traces file, in order
  std::vector<SpecShape> spec;  // every record of every --spec-trees file, in order
};

// NOT_FOUND / INVALID_ARGUMENT naming the file when a trace cannot be read.
absl::StatusOr<WorkloadShapes> load_workload_shapes(const ServeOptions& options);

}  // namespace deft::bench::serve
