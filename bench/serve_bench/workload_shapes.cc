#include "bench/serve_bench/workload_shapes.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "bench/serve_bench/serve_options.h"
#include "bench/workload_trace.h"

namespace deft::bench::serve {
namespace {

int32_t scaled(int32_t tokens, double scale) {
  return std::max<int32_t>(1, static_cast<int32_t>(std::lround(tokens * scale)));
}

// The trace's tree by depth, following the children lists from the prompt (node 0).
TotShape tot_shape(const ReasoningTrace& trace, std::string name, double scale) {
  TotShape shape;
  shape.name = std::move(name);
  shape.prompt_tokens = scaled(trace.nodes[0].length, scale);
  std::vector<int32_t> previous = {0};  // trace ids of the previous level
  std::vector<int32_t> lengths;
  while (true) {
    std::vector<TotShape::Thought> level;
    std::vector<int32_t> ids;
    for (size_t parent = 0; parent < previous.size(); ++parent) {
      for (int32_t child : trace.nodes[previous[parent]].children) {
        const ReasoningTrace::Node& node = trace.nodes[child];
        level.push_back({.parent = shape.levels.empty() ? -1 : static_cast<int32_t>(parent),
                         .tokens = scaled(node.length, scale),
                         .expanded = !node.children.empty()});
        ids.push_back(child);
        lengths.push_back(level.back().tokens);
      }
      shape.branch_factor = std::max<int32_t>(
          shape.branch_factor, static_cast<int32_t>(trace.nodes[previous[parent]].children.size()));
    }
    if (level.empty()) break;
    shape.levels.push_back(std::move(level));
    previous = std::move(ids);
  }
  if (!lengths.empty()) {
    std::nth_element(lengths.begin(), lengths.begin() + lengths.size() / 2, lengths.end());
    shape.every_tokens = lengths[lengths.size() / 2];
  }
  return shape;
}

SpecShape spec_shape(const SpecDecTrace& trace, std::string name,
                     std::vector<int32_t> accept_lengths) {
  SpecShape shape;
  shape.name = std::move(name);
  shape.parents = trace.parent;
  shape.accept_lengths = std::move(accept_lengths);
  std::vector<int32_t> depth(trace.parent.size(), 1);
  for (size_t entry = 1; entry < depth.size(); ++entry) {
    depth[entry] = depth[trace.parent[entry]] + 1;  // parents precede their children
  }
  shape.depth = *std::max_element(depth.begin(), depth.end());
  shape.top_path = {0};
  for (bool extended = true; extended;) {
    extended = false;
    for (int32_t entry = 1; entry < trace.tree_size(); ++entry) {
      if (trace.parent[entry] == shape.top_path.back()) {
        shape.top_path.push_back(entry);
        extended = true;
        break;
      }
    }
  }
  return shape;
}

}  // namespace

absl::StatusOr<WorkloadShapes> load_workload_shapes(const ServeOptions& options) {
  WorkloadShapes shapes;
  for (const std::string& file : options.tot_traces) {
    const std::string path = absl::StrCat(options.workloads_dir, "/reasoning/", file, ".json");
    absl::StatusOr<std::vector<ReasoningTrace>> traces = load_reasoning_traces(path);
    if (!traces.ok()) return traces.status();
    const size_t before = shapes.tot.size();
    for (size_t record = 0; record < traces->size(); ++record) {
      TotShape shape =
          tot_shape((*traces)[record], absl::StrCat(file, "#", record), options.tot_scale);
      if (shape.levels.empty()) continue;  // a prompt without thoughts: nothing to decode
      shapes.tot.push_back(std::move(shape));
    }
    if (shapes.tot.size() == before) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": no complete record"));
    }
  }
  for (const int32_t tree_size : options.spec_trees) {
    const std::string path = absl::StrCat(
        options.workloads_dir, "/speculative_decoding/apps_tree_size", tree_size, ".json");
    absl::StatusOr<SpecDecTrace> trace = load_specdec_trace(path);
    if (!trace.ok()) return trace.status();
    const size_t before = shapes.spec.size();
    for (size_t record = 0; record < trace->accept_lengths.size(); ++record) {
      if (trace->accept_lengths[record].empty()) continue;
      shapes.spec.push_back(spec_shape(*trace,
                                       absl::StrCat("apps_tree_size", tree_size, "#", record),
                                       trace->accept_lengths[record]));
    }
    if (shapes.spec.size() == before)
      return absl::InvalidArgumentError(absl::StrCat(path, ": no record"));
  }
  return shapes;
}

}  // namespace deft::bench::serve
