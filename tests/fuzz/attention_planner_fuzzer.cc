// libFuzzer harness: the attention planner (engine/attention_planner.h) on trees and queries
// built from the fuzz input (tests/fuzz/fuzz_input.h reads it): planner options of every plan
// kind, a page size, 1..3 trees grown by appends, branches, single-token children and prunes over
// one KV pool, and per tree the queries of a decode step, an extend run, a token tree, or
// arbitrary (node, token) pairs that may name dead nodes, tokens past a node's end or one token
// twice.
// Contracts checked:
//   - plan() succeeds exactly when every query names a live token once (INVALID_ARGUMENT, and
//     an empty plan, otherwise);
//   - the plan's arrays are in bounds (every index a kernel follows);
//   - coverage: expanding the plan gives every query row exactly the KV slots of its context
//     (its node's proper ancestors, and its own node up to itself), each once; each row's
//     position is its depth and its slot that of its own token;
//   - every entry of a masked task sees at least one token of the task's run; masked tasks hold
//     at most kMaskWordBits entries;
//   - each task's ready prefix holds no slot the step writes;
//   - the IO counts are those of the arrays.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/attention_planner.h"
#include "engine/kv_cache_manager.h"
#include "engine/sequence_tree.h"
#include "kernels/attention_params.h"
#include "tests/fuzz/fuzz_input.h"
#include "tests/testing/naive_tree_attention.h"

namespace {

using deft::engine::AttentionPlan;
using deft::engine::NodeId;
using deft::engine::PlanKind;
using deft::engine::PlannerOptions;
using deft::engine::QueryToken;
using deft::engine::SequenceTree;
using deft::engine::TokenId;
using deft::fuzz::FuzzInput;

// Bounds that keep one case to a few milliseconds under ASan.
constexpr int32_t kMaxTrees = 3;
constexpr int32_t kMaxOpsPerTree = 48;
constexpr int64_t kMaxTreeTokens = 1024;
constexpr int64_t kMaxAppendTokens = 160;
constexpr int32_t kMaxBranch = 8;
constexpr int32_t kMaxTokenTree = 64;
constexpr int32_t kMaxArbitraryQueries = 96;

PlannerOptions take_options(FuzzInput& input) {
  PlannerOptions options;
  options.kind = static_cast<PlanKind>(input.take_index(5));
  // 0: the adaptive B; small values stress chunk edges, large ones whole-node chunks.
  options.chunk_tokens = static_cast<int32_t>(input.take_bool() ? 0 : input.take_int(1, 700));
  options.max_unmasked_queries = static_cast<int32_t>(input.take_int(1, 300));
  options.min_prefill_run = static_cast<int32_t>(input.take_bool() ? 0 : input.take_int(1, 80));
  if (input.take_bool()) {
    options.wave = {.ctas = static_cast<int32_t>(input.take_int(0, 1024)),
                    .kv_heads = static_cast<int32_t>(input.take_int(0, 8)),
                    .group_size = static_cast<int32_t>(input.take_int(0, 8))};
  }
  return options;
}

std::vector<TokenId> tokens(int64_t count) { return std::vector<TokenId>(count, 7); }

NodeId pick_node(FuzzInput& input, const SequenceTree& tree) {
  const std::vector<NodeId> nodes = tree.dfs_order();
  return nodes[input.take_index(nodes.size())];
}

void grow_tree(FuzzInput& input, SequenceTree& tree) {
  const auto ops = static_cast<int32_t>(input.take_int(0, kMaxOpsPerTree));
  for (int32_t op = 0; op < ops && !input.empty(); ++op) {
    const NodeId node = pick_node(input, tree);
    const int64_t room = kMaxTreeTokens - tree.total_tokens();
    // Errors (an append to an inner node, a full KV pool) are the tree's to refuse; the planner
    // only ever sees what the tree accepted.
    switch (input.take_index(4)) {
      case 0:
        (void)tree.append(node, tokens(std::min(room, input.take_int(0, kMaxAppendTokens))));
        break;
      case 1:
        (void)tree.branch(node, static_cast<int32_t>(input.take_int(1, kMaxBranch)));
        break;
      case 2:
        (void)tree.add_child(node, tokens(std::min(room, input.take_int(0, 16))));
        break;
      case 3:
        (void)tree.prune(node);
        break;
    }
    FUZZ_CHECK(tree.check_invariants(), absl::StrCat("tree ", tree.tree_id(), " after op ", op));
  }
}

// The queries of one tree; returns whether plan() must accept them.
bool make_queries(FuzzInput& input, SequenceTree& tree, std::vector<QueryToken>& queries) {
  switch (input.take_index(4)) {
    case 0:  // decode: one new token per live leaf
      for (NodeId leaf : tree.live_leaves()) {
        if (tree.append(leaf, tokens(1)).ok()) {
          queries.push_back({leaf, static_cast<int32_t>(tree.node(leaf).tokens.size()) - 1});
        }
      }
      return true;
    case 1: {  // extend: a run of new tokens of one leaf
      const std::vector<NodeId> leaves = tree.live_leaves();
      const NodeId leaf = leaves[input.take_index(leaves.size())];
      const auto old_size = static_cast<int32_t>(tree.node(leaf).tokens.size());
      const int64_t run = input.take_int(1, kMaxAppendTokens);
      if (!tree.append(leaf, tokens(run)).ok()) return true;
      for (int32_t i = 0; i < run; ++i) queries.push_back({leaf, old_size + i});
      return true;
    }
    case 2: {  // token tree: single-token children under an anchor or earlier tokens
      std::vector<NodeId> hung = {pick_node(input, tree)};
      const int64_t count = input.take_int(1, kMaxTokenTree);
      for (int64_t i = 0; i < count; ++i) {
        const absl::StatusOr<NodeId> child =
            tree.add_child(hung[input.take_index(hung.size())], tokens(1));
        if (!child.ok()) break;
        hung.push_back(*child);
        queries.push_back({*child, 0});
      }
      return true;
    }
    default: {  // arbitrary pairs: valid or not, as the input says
      const std::vector<NodeId> nodes = tree.dfs_order();
      const auto count = static_cast<int32_t>(input.take_int(0, kMaxArbitraryQueries));
      bool valid = true;
      std::set<std::pair<NodeId, int32_t>> seen;
      for (int32_t i = 0; i < count; ++i) {
        QueryToken query;
        query.node = input.take_int(0, 15) == 0 ? static_cast<NodeId>(input.take_int(-2, 1 << 20))
                                                : nodes[input.take_index(nodes.size())];
        query.token_index = static_cast<int32_t>(input.take_int(-1, 40));
        valid = valid && tree.contains(query.node) && query.token_index >= 0 &&
                query.token_index < static_cast<int64_t>(tree.node(query.node).tokens.size()) &&
                seen.insert({query.node, query.token_index}).second;
        queries.push_back(query);
      }
      return valid;
    }
  }
}

bool in(int64_t value, int64_t begin, int64_t end) { return value >= begin && value < end; }

void check_bounds(const deft::kernels::AttentionPlanView& view) {
  FUZZ_CHECK(view.task_entry_begin[0] == 0, "task_entry_begin[0]");
  FUZZ_CHECK(view.task_entry_begin[view.num_tasks] == view.num_entries, "task_entry_begin end");
  FUZZ_CHECK(view.query_entry_begin[0] == 0 &&
                 view.query_entry_begin[view.num_queries] == view.num_entries,
             "query_entry_begin ends");
  for (int32_t task = 0; task < view.num_tasks; ++task) {
    FUZZ_CHECK(view.task_kv_begin[task] >= 0 && view.task_kv_begin[task] < view.task_kv_end[task] &&
                   view.task_kv_end[task] <= view.num_kv_indices,
               absl::StrCat("task ", task, " run [", view.task_kv_begin[task], ", ",
                            view.task_kv_end[task], ") of ", view.num_kv_indices));
    const int32_t entries = view.task_entry_begin[task + 1] - view.task_entry_begin[task];
    FUZZ_CHECK(entries >= 1, absl::StrCat("task ", task, " has ", entries, " entries"));
    if (view.task_mask_begin[task] != -1) {
      FUZZ_CHECK(entries <= deft::kernels::kMaskWordBits,
                 absl::StrCat("masked task ", task, " has ", entries, " entries"));
      const int32_t words = view.task_kv_end[task] - view.task_kv_begin[task];
      FUZZ_CHECK(view.task_mask_begin[task] >= 0 &&
                     view.task_mask_begin[task] + words <= view.num_mask_words,
                 absl::StrCat("task ", task, " mask words out of range"));
    }
  }
  for (int32_t entry = 0; entry < view.num_entries; ++entry) {
    FUZZ_CHECK(in(view.entry_query[entry], 0, view.num_queries), absl::StrCat("entry ", entry));
    FUZZ_CHECK(in(view.query_entries[entry], 0, view.num_entries),
               absl::StrCat("query_entries[", entry, "]"));
  }
  for (int32_t query = 0; query < view.num_queries; ++query) {
    FUZZ_CHECK(view.query_entry_begin[query] <= view.query_entry_begin[query + 1],
               absl::StrCat("query_entry_begin of row ", query));
    for (int32_t i = view.query_entry_begin[query]; i < view.query_entry_begin[query + 1]; ++i) {
      FUZZ_CHECK(view.entry_query[view.query_entries[i]] == query,
                 absl::StrCat("row ", query, " merges an entry of row ",
                              view.entry_query[view.query_entries[i]]));
    }
  }
  for (int32_t run = 0; run < view.num_prefill_runs; ++run) {
    const deft::kernels::PrefillRun& r = view.prefill_runs[run];
    FUZZ_CHECK(r.num_rows >= 1 && r.row_begin >= 0 &&
                   r.row_begin + r.num_rows <= view.num_queries && r.kv_begin >= 0 &&
                   r.prefix_tokens >= 0 &&
                   r.kv_begin + r.prefix_tokens + r.num_rows <= view.num_kv_indices,
               absl::StrCat("prefill run ", run, " out of range"));
  }
}

struct Step {
  std::unique_ptr<deft::engine::KvCacheManager> kv;
  std::vector<std::unique_ptr<SequenceTree>> trees;  // destroyed before kv
  std::vector<std::vector<QueryToken>> queries;
};

// Per query row, the sorted slots of its context.
std::vector<std::vector<int32_t>> contexts(const Step& step) {
  std::vector<std::vector<int32_t>> result;
  for (size_t t = 0; t < step.trees.size(); ++t) {
    const SequenceTree& tree = *step.trees[t];
    for (const QueryToken& query : step.queries[t]) {
      std::vector<int32_t>& slots = result.emplace_back();
      const std::vector<NodeId> path = tree.path(query.node).value();
      for (NodeId node : path) {
        const int64_t visible = node == query.node
                                    ? int64_t{query.token_index} + 1
                                    : static_cast<int64_t>(tree.node(node).tokens.size());
        for (int64_t i = 0; i < visible; ++i) {
          slots.push_back(step.kv->slot(tree.kv_key(node), i));
        }
      }
      std::sort(slots.begin(), slots.end());
    }
  }
  return result;
}

void check_plan(const Step& step, const AttentionPlan& plan) {
  const deft::kernels::AttentionPlanView view = plan.view();
  check_bounds(view);
  const std::vector<std::vector<int32_t>> expected = contexts(step);
  FUZZ_CHECK(plan.num_queries == static_cast<int32_t>(expected.size()),
             absl::StrCat(plan.num_queries, " rows for ", expected.size(), " queries"));
  std::vector<std::vector<int32_t>> covered = deft::test::plan_visible_slots(view);
  for (size_t row = 0; row < expected.size(); ++row) {
    std::sort(covered[row].begin(), covered[row].end());
    FUZZ_CHECK(covered[row] == expected[row],
               absl::StrCat("row ", row, ": the plan gives ", covered[row].size(),
                            " slots, its context has ", expected[row].size()));
  }
  int32_t row = 0;
  for (size_t t = 0; t < step.trees.size(); ++t) {
    const SequenceTree& tree = *step.trees[t];
    for (const QueryToken& query : step.queries[t]) {
      FUZZ_CHECK(plan.query_position[row] == tree.depth(query.node, query.token_index),
                 absl::StrCat("row ", row, " position"));
      FUZZ_CHECK(plan.query_slot[row] == step.kv->slot(tree.kv_key(query.node), query.token_index),
                 absl::StrCat("row ", row, " slot"));
      ++row;
    }
  }
  std::set<int32_t> written(plan.query_slot.begin(), plan.query_slot.end());
  int64_t kv_tokens_read = 0;
  for (int32_t task = 0; task < view.num_tasks; ++task) {
    const int32_t begin = view.task_kv_begin[task];
    const int32_t run = view.task_kv_end[task] - begin;
    kv_tokens_read += run;
    const int32_t ready = view.task_kv_ready[task];
    FUZZ_CHECK(ready >= 0 && ready <= run, absl::StrCat("task ", task, " ready ", ready));
    for (int32_t i = 0; i < ready; ++i) {
      FUZZ_CHECK(!written.contains(view.kv_slots[begin + i]),
                 absl::StrCat("task ", task, " counts a slot written this step as ready"));
    }
    if (view.task_mask_begin[task] == -1) continue;
    uint64_t seen = 0;
    for (int32_t i = 0; i < run; ++i) seen |= view.mask_words[view.task_mask_begin[task] + i];
    const int32_t entries = view.task_entry_begin[task + 1] - view.task_entry_begin[task];
    const uint64_t all = entries == 64 ? ~uint64_t{0} : (uint64_t{1} << entries) - 1;
    FUZZ_CHECK((seen & all) == all, absl::StrCat("task ", task, " has an entry that sees nothing"));
  }
  for (const deft::kernels::PrefillRun& run : plan.prefill_runs) {
    kv_tokens_read += run.prefix_tokens + run.num_rows;
  }
  FUZZ_CHECK(plan.io.kv_tokens_read == kv_tokens_read,
             absl::StrCat("io.kv_tokens_read ", plan.io.kv_tokens_read, ", runs ", kv_tokens_read));
  FUZZ_CHECK(plan.io.tasks == view.num_tasks && plan.io.query_chunk_pairs == view.num_entries &&
                 plan.io.mask_words == view.num_mask_words,
             "io counts");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzInput input(data, size);
  const PlannerOptions options = take_options(input);
  const auto page_tokens = static_cast<int32_t>(input.take_int(1, 32));
  const auto num_trees = static_cast<int32_t>(input.take_int(1, kMaxTrees));
  // Enough pages for every tree's tokens, a partial page per node, and the query tokens.
  const int64_t pages_per_tree = (kMaxTreeTokens + kMaxAppendTokens + kMaxTokenTree) / page_tokens +
                                 int64_t{kMaxOpsPerTree} * (kMaxBranch + 1) + kMaxTokenTree + 64;
  Step step;
  step.kv = std::make_unique<deft::engine::KvCacheManager>(deft::engine::KvCacheConfig{
      .page_tokens = page_tokens, .num_pages = static_cast<int32_t>(pages_per_tree * num_trees)});
  bool valid = true;
  for (int32_t t = 0; t < num_trees; ++t) {
    // Odd trees number their nodes past 2^32, as a long-running server's do.
    const NodeId first_node_id = t % 2 == 0 ? 1 : (NodeId{1} << 32) + 5;
    step.trees.push_back(std::make_unique<SequenceTree>(static_cast<uint32_t>(t + 1), step.kv.get(),
                                                        std::numeric_limits<NodeId>::max(),
                                                        first_node_id));
    grow_tree(input, *step.trees.back());
    valid = make_queries(input, *step.trees.back(), step.queries.emplace_back()) && valid;
    if (input.take_bool()) std::reverse(step.queries.back().begin(), step.queries.back().end());
  }
  std::vector<deft::engine::TreeQueries> trees;
  for (size_t t = 0; t < step.trees.size(); ++t) {
    trees.push_back({step.trees[t].get(), step.queries[t]});
  }
  deft::engine::AttentionPlanner planner(options);
  AttentionPlan plan;
  const absl::Status status = planner.plan(trees, plan);
  FUZZ_CHECK(status.ok() == valid, absl::StrCat("queries ", valid ? "valid" : "invalid",
                                                ", plan(): ", status.ToString()));
  if (!status.ok()) {
    FUZZ_CHECK(status.code() == absl::StatusCode::kInvalidArgument, status.ToString());
    FUZZ_CHECK(plan.num_queries == 0 && plan.num_tasks() == 0, "a refused plan is not empty");
    return 0;
  }
  check_plan(step, plan);
  return 0;
}
