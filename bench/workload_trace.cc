#include "bench/workload_trace.h"

#include <fstream>
#include <map>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace deft::bench {

using engine::TokenId;
namespace {

absl::StatusOr<nlohmann::json> read_json(const std::string& path) {
  std::ifstream file(path);
  if (!file) return absl::NotFoundError(absl::StrCat("cannot open workload file ", path));
  nlohmann::json json = nlohmann::json::parse(file, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded()) return absl::InvalidArgumentError(absl::StrCat(path, ": not valid JSON"));
  return json;
}

}  // namespace

absl::StatusOr<std::vector<ReasoningTrace>> load_reasoning_traces(const std::string& path) {
  absl::StatusOr<nlohmann::json> json = read_json(path);
  if (!json.ok()) return json.status();
  if (!json->is_array()) return absl::InvalidArgumentError(absl::StrCat(path, ": expected a list"));
  std::vector<ReasoningTrace> traces;
  for (const nlohmann::json& record : *json) {
    if (record.value("incompleted", true) || !record.contains("data") || record["data"].empty()) {
      continue;
    }
    ReasoningTrace trace;
    const nlohmann::json& data = record["data"];
    trace.nodes.resize(data.size());
    for (const auto& [key, node] : data.items()) {
      const int32_t id = node.at("id").get<int32_t>();
      if (id < 0 || id >= static_cast<int32_t>(trace.nodes.size())) {
        return absl::InvalidArgumentError(absl::StrCat(path, ": node id ", id, " out of range"));
      }
      ReasoningTrace::Node& n = trace.nodes[id];
      n.length = node.at("value").get<int32_t>();
      n.start = node.at("start").get<int32_t>();
      n.end = node.at("end").get<int32_t>();
      n.children = node.at("children").get<std::vector<int32_t>>();
      trace.last_iteration = std::max(trace.last_iteration, n.end);
    }
    for (size_t id = 0; id < trace.nodes.size(); ++id) {
      for (int32_t child : trace.nodes[id].children) {
        if (child <= 0 || child >= static_cast<int32_t>(trace.nodes.size())) {
          return absl::InvalidArgumentError(absl::StrCat(path, ": bad child id ", child));
        }
        trace.nodes[child].parent = static_cast<int32_t>(id);
      }
    }
    traces.push_back(std::move(trace));
  }
  return traces;
}

absl::StatusOr<SpecDecTrace> load_specdec_trace(const std::string& path) {
  absl::StatusOr<nlohmann::json> json = read_json(path);
  if (!json.ok()) return json.status();
  SpecDecTrace trace;
  // Medusa notation: each entry is the path of child ranks from the root candidate.
  const auto structure = json->at("Tree_Structure").get<std::vector<std::vector<int32_t>>>();
  std::map<std::vector<int32_t>, int32_t> index = {{{}, 0}};
  trace.parent.push_back(-1);
  for (const std::vector<int32_t>& entry : structure) {
    std::vector<int32_t> parent_path(entry.begin(), entry.end() - 1);
    auto it = index.find(parent_path);
    if (entry.empty() || it == index.end()) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": tree entry without a parent"));
    }
    index[entry] = static_cast<int32_t>(trace.parent.size());
    trace.parent.push_back(it->second);
  }
  for (const nlohmann::json& record : json->at("Records")) {
    trace.accept_lengths.push_back(record.at("Accept_length").get<std::vector<int32_t>>());
  }
  return trace;
}

ReasoningReplay::ReasoningReplay(const ReasoningTrace& trace, SequenceTree& tree)
    : trace_(trace), tree_(tree), node_of_(trace.nodes.size(), -1) {
  node_of_[0] = tree.root();
  status_ = tree.append(tree.root(), std::vector<TokenId>(trace.nodes[0].length, 1));
}

bool ReasoningReplay::step(std::vector<QueryToken>& queries) {
  queries.clear();
  if (!status_.ok() || iteration_ >= trace_.last_iteration) return false;
  // Childless nodes that ended last iteration (before the trace's end) are pruned now.
  for (size_t id = 1; id < trace_.nodes.size(); ++id) {
    const ReasoningTrace::Node& n = trace_.nodes[id];
    if (node_of_[id] >= 0 && n.children.empty() && n.end == iteration_) {
      status_ = tree_.prune(node_of_[id]);
      node_of_[id] = -1;
      if (!status_.ok()) return false;
    }
  }
  ++iteration_;
  for (size_t id = 1; id < trace_.nodes.size(); ++id) {
    const ReasoningTrace::Node& n = trace_.nodes[id];
    if (n.start == iteration_) {
      absl::StatusOr<NodeId> child = tree_.add_child(node_of_[n.parent], {});
      if (!child.ok()) {
        status_ = child.status();
        return false;
      }
      node_of_[id] = *child;
    }
  }
  for (size_t id = 1; id < trace_.nodes.size(); ++id) {
    const ReasoningTrace::Node& n = trace_.nodes[id];
    if (n.start <= iteration_ && iteration_ <= n.end) {
      const TokenId token = 2;
      status_ = tree_.append(node_of_[id], std::span<const TokenId>(&token, 1));
      if (!status_.ok()) return false;
      queries.push_back(
          {node_of_[id], static_cast<int32_t>(tree_.node(node_of_[id]).tokens.size()) - 1});
    }
  }
  return true;
}

SpecDecReplay::SpecDecReplay(const SpecDecTrace& trace, SequenceTree& tree, int32_t prefix_tokens)
    : trace_(trace), tree_(tree) {
  status_ = tree.append(tree.root(), std::vector<TokenId>(prefix_tokens, 1));
  if (!status_.ok()) return;
  absl::StatusOr<NodeId> child = tree.add_child(tree.root(), {});
  if (!child.ok()) {
    status_ = child.status();
    return;
  }
  prefix_ = *child;  // committed tokens grow here
}

void SpecDecReplay::build_token_tree(std::vector<QueryToken>& queries) {
  queries.clear();
  if (!status_.ok()) return;
  std::vector<NodeId>& node = token_nodes_;
  node.assign(trace_.tree_size(), -1);
  for (int32_t i = 0; i < trace_.tree_size(); ++i) {
    const NodeId parent = i == 0 ? prefix_ : node[trace_.parent[i]];
    const TokenId token = 3;
    absl::StatusOr<NodeId> child = tree_.add_child(parent, std::span<const TokenId>(&token, 1));
    if (!child.ok()) {
      status_ = child.status();
      return;
    }
    node[i] = *child;
    queries.push_back({node[i], 0});
  }
  token_tree_root_ = node[0];
}

void SpecDecReplay::commit(int32_t accepted) {
  if (!status_.ok() || token_tree_root_ < 0) return;
  status_ = tree_.prune(token_tree_root_);
  token_tree_root_ = -1;
  if (status_.ok()) status_ = tree_.append(prefix_, std::vector<TokenId>(accepted, 3));
}

}  // namespace deft::bench
