#include "engine/attention_planner.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "kernels/check.h"

namespace deft::engine {
namespace {

using kernels::kMaskWordBits;

// Bits [lo, hi) of a mask word, 0 <= lo <= hi <= 64.
uint64_t bit_range(int32_t lo, int32_t hi) {
  if (hi <= lo) return 0;
  const uint64_t upper = hi >= kMaskWordBits ? ~uint64_t{0} : (uint64_t{1} << hi) - 1;
  const uint64_t lower = (uint64_t{1} << lo) - 1;
  return upper & ~lower;
}

// One tree's visible KV, flattened depth-first, as runs of consecutive tokens that the same
// queries see. Queries are numbered in depth-first order, which makes every token's viewers one
// interval [query_begin, query_end): the queries of its own node at or after it, then every
// query below its node. A node without queries of its own is one run; a node with queries is
// cut after each of them (prefill, extend, token trees).
struct ViewRun {
  int32_t flat_begin;
  int32_t flat_end;
  int32_t query_begin;
  int32_t query_end;
};

struct FlatTree {
  int32_t num_tokens = 0;
  std::vector<ViewRun> runs;
  std::vector<int32_t> node_token_begin;  // per flattened node: first flat token; plus the end
};

// The step's queries of one tree in depth-first order.
struct OrderedQueries {
  std::vector<int32_t> row;          // plan row of the i-th query in depth-first order
  std::vector<int32_t> rank;         // its node's depth-first rank (the node: dfs_nodes_[rank])
  std::vector<int32_t> token_index;  // its token within the node
};

// Pieces are split where at least this many consecutive tokens have the same viewers (a
// quarter of a KV tile of the GPU kernel). Such a run (a branch's private suffix, the end of a
// shared prompt) becomes a task without a mask, beside its neighbours instead of in their chain:
// a few-shot piece of 256 tokens holding five 50-token suffixes was one masked task of 20 rows
// over 4 tiles, the grid's longest chain; split, each suffix is a 1-tile task (H100, 2026-11-23:
// few-shot b20 at suffix 20-50 one layer 27 -> 19 us, decode step -155 us; 64 split only runs of
// a whole tile).
constexpr int32_t kMinUnmaskedSplit = 16;

// The GPU kernel's stage 1 as its work division cuts it (kernels/deft_schedule.h:
// kStage1TileTokens, kStage1PassRows, kStage1CtaOverheadTiles, build_stage1_ctas): KV tiles of 64
// tokens, passes of up to 64 rows (entries x group) per CTA; passes of at most 16 rows are short
// (see adaptive_chunk_tokens in the header); a CTA's fixed cost in tiles.
constexpr int32_t kWaveTileTokens = 64;
constexpr int32_t kWavePassRows = 64;
constexpr int32_t kWaveLightRows = 16;
constexpr int64_t kWaveCtaOverheadTiles = 2;
// The smallest B the wave estimate shrinks a fitting grid to (wave_chunk_tokens): 128 was slower
// than 192 on every tree of the H100 sweep (more CTAs and partials, each with its fixed costs).
constexpr int32_t kWaveMinChunk = 192;

}  // namespace

int32_t adaptive_chunk_tokens(int64_t num_queries, int64_t visible_tokens) {
  constexpr int32_t kMinChunk = 64;
  // Chunks x row passes (about the CTAs per KV head) below which the GPU is left idle.
  constexpr int64_t kMinWork = 24;
  // A tree of fewer than kFewChunks chunks of 512 takes 512 only from kMinWorkFewChunks (about
  // a wave of CTAs at Llama-3-8B shapes), else 256: smaller chunks only added partials there.
  constexpr int64_t kFewChunks = 8;
  constexpr int64_t kMinWorkFewChunks = 48;
  const auto chunks = [&](int32_t b) { return (visible_tokens + b - 1) / b; };
  const auto work = [&](int32_t b) { return chunks(b) * ((num_queries + 15) / 16); };
  if (chunks(512) < kFewChunks) return work(512) >= kMinWorkFewChunks ? 512 : 256;
  int32_t chunk = 512;
  while (chunk > kMinChunk && work(chunk) < kMinWork) chunk /= 2;
  return chunk;
}

std::string_view plan_kind_name(PlanKind kind) {
  switch (kind) {
    case PlanKind::kDeftFlatten: return "deft_flatten";
    case PlanKind::kDeftNode: return "deft_node";
    case PlanKind::kDeftNodeChunk: return "deft_node_chunk";
    case PlanKind::kSequence: return "sequence";
    case PlanKind::kDenseMask: return "dense_mask";
  }
  return "unknown";
}

absl::Status parse_plan_kind(std::string_view name, PlanKind* kind) {
  for (PlanKind k : {PlanKind::kDeftFlatten, PlanKind::kDeftNode, PlanKind::kDeftNodeChunk,
                     PlanKind::kSequence, PlanKind::kDenseMask}) {
    if (plan_kind_name(k) == name) {
      *kind = k;
      return absl::OkStatus();
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown plan kind '", std::string(name),
      "' (expected deft_flatten, deft_node, deft_node_chunk, sequence or dense_mask)"));
}

kernels::AttentionPlanView AttentionPlan::view() const {
  kernels::AttentionPlanView v;
  v.num_queries = num_queries;
  v.num_tasks = num_tasks();
  v.num_entries = num_entries();
  v.num_kv_indices = static_cast<int32_t>(kv_slots.size());
  v.num_mask_words = static_cast<int32_t>(mask_words.size());
  v.kv_slots = kv_slots.data();
  v.task_kv_begin = task_kv_begin.data();
  v.task_kv_end = task_kv_end.data();
  v.task_entry_begin = task_entry_begin.data();
  v.task_mask_begin = task_mask_begin.data();
  v.task_kv_ready = task_kv_ready.data();
  v.mask_words = mask_words.data();
  v.entry_query = entry_query.data();
  v.query_entry_begin = query_entry_begin.data();
  v.query_entries = query_entries.data();
  v.num_prefill_runs = static_cast<int32_t>(prefill_runs.size());
  v.prefill_runs = prefill_runs.data();
  return v;
}

void AttentionPlan::clear() {
  num_queries = 0;
  kv_slots.clear();
  task_kv_begin.clear();
  task_kv_end.clear();
  task_entry_begin.clear();
  task_mask_begin.clear();
  task_kv_ready.clear();
  mask_words.clear();
  entry_query.clear();
  query_entry_begin.clear();
  query_entries.clear();
  prefill_runs.clear();
  query_position.clear();
  query_slot.clear();
  io = PlanIo{};
}

// Builds plans; holds the per-tree scratch so that planning allocates nothing once warm.
class PlanBuilder {
 public:
  void start(const PlannerOptions& options, int32_t step_queries, AttentionPlan& plan) {
    options_ = options;
    step_queries_ = step_queries;
    plan_ = &plan;
    slots_end_ = 0;
  }

  absl::Status add_tree(const TreeQueries& tree_queries, int32_t row_base) {
    const SequenceTree* tree = tree_queries.tree;
    if (tree == nullptr) return absl::InvalidArgumentError("planner: null tree");
    if (tree->kv() == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("planner: tree ", tree->tree_id(), " has no KV cache"));
    }
    if (absl::Status status = order_queries(*tree, tree_queries.queries, row_base); !status.ok()) {
      return status;
    }
    // Per node rank, its first token that a query of the step names (queries are sorted by
    // rank, then token): the step's KV write fills it and every later token of the node.
    fresh_from_.assign(dfs_nodes_.size(), std::numeric_limits<int32_t>::max());
    for (size_t i = queries_.rank.size(); i-- > 0;) {
      fresh_from_[queries_.rank[i]] = queries_.token_index[i];
    }
    // Positions and write slots in input order, from the depth-first caches (no lookups by id).
    const size_t base = plan_->query_position.size();
    plan_->query_position.resize(base + order_.size());
    plan_->query_slot.resize(base + order_.size());
    const int32_t page_tokens = tree->kv()->page_tokens();
    for (const auto& [rank, token_index, input] : order_) {
      plan_->query_position[base + input] =
          static_cast<int32_t>(dfs_node_ptrs_[rank]->depth_begin + token_index);
      const std::span<const int32_t> pages = dfs_pages_[rank];
      const int32_t page = token_index / page_tokens;
      plan_->query_slot[base + input] =
          page < static_cast<int32_t>(pages.size())
              ? pages[page] * page_tokens + token_index % page_tokens
              : tree->kv()->slot(tree->kv_key(dfs_nodes_[rank]), token_index);  // aborts
    }
    if (options_.min_prefill_run > 0 && !options_.deterministic) take_prefill_runs(*tree);
    if (queries_.row.empty()) return absl::OkStatus();
    if (options_.deterministic) {
      add_deterministic_tasks(*tree);
      return absl::OkStatus();
    }
    if (options_.kind == PlanKind::kSequence) {
      add_sequence_tasks(*tree);
      return absl::OkStatus();
    }
    flatten(*tree);
    add_piece_tasks();
    return absl::OkStatus();
  }

  // The per-query reduction map, once every task is in.
  void finish(int32_t num_queries) {
    plan_->kv_slots.resize(slots_end_);
    plan_->num_queries = num_queries;
    plan_->task_entry_begin.push_back(static_cast<int32_t>(plan_->entry_query.size()));
    plan_->query_entry_begin.assign(num_queries + 1, 0);
    for (int32_t query : plan_->entry_query) ++plan_->query_entry_begin[query + 1];
    for (int32_t q = 0; q < num_queries; ++q) {
      plan_->query_entry_begin[q + 1] += plan_->query_entry_begin[q];
    }
    plan_->query_entries.resize(plan_->entry_query.size());
    fill_cursor_.assign(plan_->query_entry_begin.begin(), plan_->query_entry_begin.end() - 1);
    for (int32_t entry = 0; entry < static_cast<int32_t>(plan_->entry_query.size()); ++entry) {
      plan_->query_entries[fill_cursor_[plan_->entry_query[entry]]++] = entry;
    }
    PlanIo& io = plan_->io;
    io.tasks = plan_->num_tasks();
    io.query_chunk_pairs = plan_->num_entries();
    io.mask_words = static_cast<int64_t>(plan_->mask_words.size());
    io.kv_tokens_read = 0;
    for (int32_t t = 0; t < plan_->num_tasks(); ++t) {
      io.kv_tokens_read += plan_->task_kv_end[t] - plan_->task_kv_begin[t];
    }
    for (const kernels::PrefillRun& run : plan_->prefill_runs) {
      io.kv_tokens_read += run.prefix_tokens + run.num_rows;
    }
  }

 private:
  // Moves every run of >= min_prefill_run queries that are consecutive tokens of one node on
  // consecutive rows out of queries_ into a PrefillRun; the other queries stay for the tasks.
  void take_prefill_runs(const SequenceTree& tree) {
    const int32_t n = static_cast<int32_t>(queries_.row.size());
    int32_t kept = 0;
    for (int32_t i = 0; i < n;) {
      int32_t j = i + 1;
      while (j < n && queries_.rank[j] == queries_.rank[i] &&
             queries_.token_index[j] == queries_.token_index[j - 1] + 1 &&
             queries_.row[j] == queries_.row[j - 1] + 1) {
        ++j;
      }
      if (j - i >= options_.min_prefill_run) {
        add_prefill_run(tree, dfs_nodes_[queries_.rank[i]], queries_.token_index[i], j - i,
                        queries_.row[i]);
      } else {
        for (int32_t k = i; k < j; ++k, ++kept) {
          queries_.row[kept] = queries_.row[k];
          queries_.rank[kept] = queries_.rank[k];
          queries_.token_index[kept] = queries_.token_index[k];
        }
      }
      i = j;
    }
    queries_.row.resize(kept);
    queries_.rank.resize(kept);
    queries_.token_index.resize(kept);
  }

  // Tokens [first, first + count) of `node` on rows [row, row + count): keys are the node's
  // proper ancestors in full, then the node's tokens [0, first + count).
  void add_prefill_run(const SequenceTree& tree, NodeId node, int32_t first, int32_t count,
                       int32_t row) {
    const KvCacheManager& kv = *tree.kv();
    const int32_t kv_begin = slots_end_;
    ancestors_.clear();
    for (NodeId id = tree.node(node).parent; id != -1; id = tree.node(id).parent) {
      ancestors_.push_back(id);
    }
    for (auto it = ancestors_.rbegin(); it != ancestors_.rend(); ++it) {
      append_slots(kv, tree.kv_key(*it), static_cast<int32_t>(tree.node(*it).tokens.size()));
    }
    append_slots(kv, tree.kv_key(node), first + count);
    const int32_t keys = slots_end_ - kv_begin;
    plan_->prefill_runs.push_back(
        {.row_begin = row, .num_rows = count, .kv_begin = kv_begin, .prefix_tokens = keys - count});
  }

  // Validates the queries and numbers them depth-first (node rank, then token index).
  absl::Status order_queries(const SequenceTree& tree, std::span<const QueryToken> queries,
                             int32_t row_base) {
    // The nodes some query sees: the queried nodes and their ancestors. Only those are ranked:
    // the rest of the tree (other trees' finished branches, the prefix cache's unreferenced
    // nodes, thousands under load) holds no KV this step reads.
    on_path_.erase(on_path_.begin(), on_path_.end());
    on_path_.insert(tree.root());
    for (size_t i = 0; i < queries.size(); ++i) {
      // A run of rows on one node (a prefill chunk) marks its path once.
      if (i > 0 && queries[i].node == queries[i - 1].node) continue;
      if (!tree.contains(queries[i].node)) {
        return absl::InvalidArgumentError(
            absl::StrCat("planner: query ", i, " names node ", queries[i].node,
                         ", not a live node of tree ", tree.tree_id()));
      }
      NodeId id = queries[i].node;
      while (on_path_.insert(id).second) id = tree.node(id).parent;  // stops at the root at worst
    }
    // Depth-first ranks of those nodes (each hangs below the root), and each rank's parent rank.
    // Range erase keeps the table's storage; clear() frees it above 127 slots, so a tree of more
    // live nodes (a 256-token speculative tree) would rehash and allocate every plan.
    rank_.erase(rank_.begin(), rank_.end());
    dfs_nodes_.clear();
    dfs_node_ptrs_.clear();
    dfs_pages_.clear();
    parent_rank_.clear();
    stack_.assign(1, {tree.root(), -1});
    while (!stack_.empty()) {
      const auto [id, parent_rank] = stack_.back();
      stack_.pop_back();
      const auto rank = static_cast<int32_t>(dfs_nodes_.size());
      rank_.insert_or_assign(id, rank);
      dfs_nodes_.push_back(id);
      const TreeNode& node = tree.node(id);
      dfs_node_ptrs_.push_back(&node);
      dfs_pages_.push_back(tree.kv()->pages(tree.kv_key(id)));
      parent_rank_.push_back(parent_rank);
      const NodeChildren& children = node.children;
      for (auto child = children.rbegin(); child != children.rend(); ++child) {
        if (on_path_.contains(*child)) stack_.push_back({*child, rank});
      }
    }
    order_.clear();
    for (size_t i = 0; i < queries.size(); ++i) {
      const QueryToken& q = queries[i];
      const auto ranked = rank_.find(q.node);
      if (ranked == rank_.end()) {
        return absl::InvalidArgumentError(absl::StrCat("planner: query ", i, " names node ",
                                                       q.node, ", not a live node of tree ",
                                                       tree.tree_id()));
      }
      const int64_t size = static_cast<int64_t>(dfs_node_ptrs_[ranked->second]->tokens.size());
      if (q.token_index < 0 || q.token_index >= size) {
        return absl::InvalidArgumentError(
            absl::StrCat("planner: query ", i, " names token ", q.token_index, " of node ",
                         q.node, ", which holds ", size, " tokens"));
      }
      order_.push_back({ranked->second, q.token_index, static_cast<int32_t>(i)});
    }
    std::sort(order_.begin(), order_.end());
    queries_.row.clear();
    queries_.rank.clear();
    queries_.token_index.clear();
    for (size_t i = 0; i < order_.size(); ++i) {
      const auto& [rank, token_index, input] = order_[i];
      if (i > 0 && order_[i - 1][0] == rank && order_[i - 1][1] == token_index) {
        return absl::InvalidArgumentError(
            absl::StrCat("planner: token ", token_index, " of node ", dfs_nodes_[rank],
                         " is queried twice (queries ", order_[i - 1][2], " and ", input, ")"));
      }
      queries_.row.push_back(row_base + input);
      queries_.rank.push_back(rank);
      queries_.token_index.push_back(token_index);
    }
    return absl::OkStatus();
  }

  // Depth-first flattening of the KV that at least one query sees: slots go straight into the
  // plan, viewers into runs.
  void flatten(const SequenceTree& tree) {
    const int32_t num_nodes = static_cast<int32_t>(dfs_nodes_.size());
    const int32_t num_queries = static_cast<int32_t>(queries_.row.size());
    // own_begin_[r]: first depth-first query at or after node rank r.
    own_begin_.assign(num_nodes + 1, num_queries);
    for (int32_t q = num_queries - 1; q >= 0; --q) own_begin_[queries_.rank[q]] = q;
    for (int32_t r = num_nodes - 1; r >= 0; --r) {
      own_begin_[r] = std::min(own_begin_[r], own_begin_[r + 1]);
    }
    subtree_size_.assign(num_nodes, 1);
    for (int32_t r = num_nodes - 1; r > 0; --r) {
      subtree_size_[parent_rank_[r]] += subtree_size_[r];
    }
    const KvCacheManager& kv = *tree.kv();
    flat_base_ = slots_end_;
    flat_.runs.clear();
    flat_.node_token_begin.clear();
    fresh_.clear();
    int32_t flat = 0;
    for (int32_t r = 0; r < num_nodes; ++r) {
      const int32_t subtree_end = own_begin_[r + subtree_size_[r]];
      const int32_t own_begin = own_begin_[r];
      if (own_begin >= subtree_end) continue;  // nobody below sees this node
      const TreeNode& node = *dfs_node_ptrs_[r];
      // Own queries are [own_begin, own_end), sorted by token index.
      int32_t own_end = own_begin;
      while (own_end < subtree_end && queries_.rank[own_end] == r) ++own_end;
      const int32_t visible = own_end < subtree_end
                                  ? static_cast<int32_t>(node.tokens.size())
                                  : queries_.token_index[own_end - 1] + 1;
      flat_.node_token_begin.push_back(flat);
      append_slots(kv, dfs_pages_[r], visible);
      if (fresh_from_[r] < visible) {
        fresh_.push_back({flat_base_ + flat + fresh_from_[r], flat_base_ + flat + visible});
      }
      // Tokens up to and including own query k are seen by own queries k.. and the subtree.
      int32_t token = 0;
      for (int32_t q = own_begin; q < own_end && token < visible; ++q) {
        const int32_t last = queries_.token_index[q] + 1;
        if (last > token) {
          flat_.runs.push_back({flat + token, flat + last, q, subtree_end});
          token = last;
        }
      }
      if (token < visible)
        flat_.runs.push_back({flat + token, flat + visible, own_end, subtree_end});
      flat += visible;
    }
    flat_.node_token_begin.push_back(flat);
    flat_.num_tokens = flat;
  }

  // Appends the slots of tokens [0, count) of an owner, a page at a time.
  void append_slots(const KvCacheManager& kv, KvCacheManager::OwnerKey owner, int32_t count) {
    append_slots(kv, kv.pages(owner), count);
  }
  void append_slots(const KvCacheManager& kv, std::span<const int32_t> pages, int32_t count) {
    const int32_t page_tokens = kv.page_tokens();
    int32_t* out = take_slots(count);
    for (int32_t j = 0; j < count; j += page_tokens) {
      const int32_t first = pages[j / page_tokens] * page_tokens;
      const int32_t n = std::min(page_tokens, count - j);
      fill_consecutive(out + j, n, first);
    }
  }

  // Room for `count` more slots at slots_end_. The plan's slots keep their length from the last
  // plan until finish() (see AttentionPlanner::plan), so only growth beyond it is zero-filled.
  int32_t* take_slots(int32_t count) {
    std::vector<int32_t>& slots = plan_->kv_slots;
    const size_t end = static_cast<size_t>(slots_end_) + count;
    if (slots.size() < end) slots.resize(end);
    int32_t* out = slots.data() + slots_end_;
    slots_end_ = static_cast<int32_t>(end);
    return out;
  }

  // out[i] = first + i for i < n. Blocks of 8 (a 16-token page is two): a loop of known trip
  // count that -O2 vectorises. The per-token loop ran scalar, and filling a long prefix's slots
  // was the largest part of a warm speculative step's plan (perf, the step of planner_bench
  // step_cold without the sweep).
  static void fill_consecutive(int32_t* out, int32_t n, int32_t first) {
    constexpr int32_t kBlock = 8;
    int32_t i = 0;
    for (; i + kBlock <= n; i += kBlock) {
      for (int32_t k = 0; k < kBlock; ++k) out[i + k] = first + i + k;
    }
    for (; i < n; ++i) out[i] = first + i;
  }

  // Cuts the flattened tree into pieces by plan kind and turns each piece into tasks.
  void add_piece_tasks() {
    const int32_t total = flat_.num_tokens;
    const int32_t chunk = options_.chunk_tokens > 0 ? options_.chunk_tokens : wave_chunk_tokens();
    if (options_.kind == PlanKind::kDeftFlatten || options_.kind == PlanKind::kDeftNodeChunk ||
        options_.kind == PlanKind::kDenseMask) {
      plan_->io.max_chunk_tokens = std::max(plan_->io.max_chunk_tokens, chunk);
    }
    run_cursor_ = 0;
    switch (options_.kind) {
      case PlanKind::kDeftFlatten:
      case PlanKind::kDenseMask:
        for (int32_t a = 0; a < total; a += chunk) add_piece(a, std::min(total, a + chunk));
        break;
      case PlanKind::kDeftNode:
      case PlanKind::kDeftNodeChunk: {
        const bool cut = options_.kind == PlanKind::kDeftNodeChunk;
        for (size_t n = 0; n + 1 < flat_.node_token_begin.size(); ++n) {
          const int32_t begin = flat_.node_token_begin[n];
          const int32_t end = flat_.node_token_begin[n + 1];
          const int32_t step = cut ? chunk : end - begin;
          for (int32_t a = begin; a < end; a += step) add_piece(a, std::min(end, a + step));
        }
        break;
      }
      case PlanKind::kSequence:
        break;  // handled by add_sequence_tasks
    }
  }

  // The adaptive B of the current tree (see adaptive_chunk_tokens in the header): the base rule's,
  // or, when the GPU's wave is known, for a Flatten grid that takes more than one wave at that B
  // the B in [base, 2 base] with the fewest waves x the longest chain, and for one whose every
  // CTA fits in the wave the smallest B (down to kWaveMinChunk) at which they all still do. The
  // grid is counted as kernels/deft_schedule.h cuts it (row slices, CTA work in tiles) and the
  // wave is its deft_attention_resident_ctas.
  int32_t wave_chunk_tokens() {
    const int64_t num_queries = static_cast<int64_t>(queries_.row.size());
    const int32_t base = adaptive_chunk_tokens(num_queries, flat_.num_tokens);
    const AttentionWave& wave = options_.wave;
    if (options_.kind != PlanKind::kDeftFlatten || wave.ctas <= 0 || wave.kv_heads <= 0 ||
        wave.group_size <= 0 || step_queries_ <= 0) {
      return base;
    }
    // This tree's share of the wave (by queries) when the step has several trees.
    const int64_t ctas = std::max<int64_t>(1, int64_t{wave.ctas} * num_queries / step_queries_);
    // The grid at B = chunk, as the wave estimate counts it.
    const auto count_at = [&](int32_t chunk) {
      WaveCount count;
      counting_ = &count;
      run_cursor_ = 0;
      for (int32_t a = 0; a < flat_.num_tokens; a += chunk) {
        add_piece(a, std::min(flat_.num_tokens, a + chunk));
      }
      counting_ = nullptr;
      return count;
    };
    const auto cost = [&](const WaveCount& count, bool* one_wave) {
      const int64_t waves = std::max<int64_t>(1, (count.heavy_ctas + ctas - 1) / ctas);
      *one_wave = waves == 1;
      return waves * (count.max_tiles + kWaveCtaOverheadTiles);
    };
    const WaveCount base_count = count_at(base);
    bool one_wave = false;
    int64_t best_cost = cost(base_count, &one_wave);
    if (one_wave) {
      // When every CTA is resident at once (light passes included), a smaller B shortens the
      // longest chain as long as the grid still fits (H100, kernel_attention_bench: specdec p6000
      // t32 512 -> 320, 20.9 -> 17.6 us; few-shot b20 512 -> 448, 21.3 -> 19.7).
      if (base_count.ctas > ctas) return base;
      int32_t smallest = base;
      while (smallest - kWaveTileTokens >= kWaveMinChunk &&
             count_at(smallest - kWaveTileTokens).ctas <= ctas) {
        smallest -= kWaveTileTokens;
      }
      return smallest;
    }
    int32_t best = base;
    // Upwards; among B of one wave the smallest costs least (its longest chain is shortest).
    for (int32_t chunk = base + kWaveTileTokens; chunk <= 2 * base && !one_wave;
         chunk += kWaveTileTokens) {
      const int64_t c = cost(count_at(chunk), &one_wave);
      if (c < best_cost) {
        best_cost = c;
        best = chunk;
      }
    }
    return best;
  }

  // A task as the wave estimate counts it (counting_ set): its longest chain, its CTAs of more
  // than kWaveLightRows rows and all its CTAs (a pass each, per KV head).
  struct WaveCount {
    int64_t heavy_ctas = 0;
    int64_t ctas = 0;
    int64_t max_tiles = 0;
  };
  void count_task(int32_t tokens, int32_t entries) {
    const int64_t rows = int64_t{entries} * options_.wave.group_size;
    const int64_t heavy_passes = rows / kWavePassRows + (rows % kWavePassRows > kWaveLightRows);
    counting_->heavy_ctas += heavy_passes * options_.wave.kv_heads;
    counting_->ctas +=
        std::max<int64_t>(1, (rows + kWavePassRows - 1) / kWavePassRows) * options_.wave.kv_heads;
    counting_->max_tiles =
        std::max<int64_t>(counting_->max_tiles, (tokens + kWaveTileTokens - 1) / kWaveTileTokens);
  }

  // Flat tokens [a, b) of the current tree become one or more tasks. Pieces come in increasing
  // order, so the runs they overlap are found by a forward-moving cursor.
  void add_piece(int32_t a, int32_t b) {
    while (flat_.runs[run_cursor_].flat_end <= a) ++run_cursor_;
    int32_t run_end = run_cursor_;
    while (run_end < static_cast<int32_t>(flat_.runs.size()) &&
           flat_.runs[run_end].flat_begin < b) {
      ++run_end;
    }
    const std::span<const ViewRun> runs(flat_.runs.data() + run_cursor_, run_end - run_cursor_);
    if (options_.kind == PlanKind::kDenseMask) {
      // Medusa-style: groups of queries in fixed order read the whole piece under a dense mask.
      const int32_t num_queries = static_cast<int32_t>(queries_.row.size());
      for (int32_t g = 0; g < num_queries; g += kMaskWordBits) {
        add_masked_group(runs, a, b, g, std::min(num_queries, g + kMaskWordBits), /*trim=*/false);
      }
      return;
    }
    const int32_t query_lo = runs.front().query_begin;  // non-decreasing along the flattening
    int32_t query_hi = 0;
    bool uniform = true;
    for (const ViewRun& run : runs) {
      query_hi = std::max(query_hi, run.query_end);
      uniform = uniform && run.query_begin == query_lo && run.query_end == runs.front().query_end;
    }
    if (!uniform) {
      // Consecutive runs with the same viewers that hold at least kMinUnmaskedSplit tokens of
      // the piece (the end of a shared prompt, a branch) become a piece of their own: it needs
      // no mask, and it runs beside the rest instead of lengthening a masked task's chain.
      for (size_t first = 0; first < runs.size();) {
        size_t end = first + 1;
        while (end < runs.size() && runs[end].query_begin == runs[first].query_begin &&
               runs[end].query_end == runs[first].query_end) {
          ++end;
        }
        const int32_t group_begin = std::max(a, runs[first].flat_begin);
        const int32_t group_end = std::min(b, runs[end - 1].flat_end);
        if (group_end - group_begin >= kMinUnmaskedSplit) {
          if (a < group_begin) add_piece(a, group_begin);
          add_piece(group_begin, group_end);
          if (group_end < b) add_piece(group_end, b);
          return;
        }
        first = end;
      }
    }
    if (uniform) {
      for (int32_t g = query_lo; g < query_hi; g += options_.max_unmasked_queries) {
        add_task(flat_base_ + a, flat_base_ + b, g,
                 std::min(query_hi, g + options_.max_unmasked_queries), /*mask_begin=*/-1);
      }
      return;
    }
    for (int32_t g = query_lo; g < query_hi; g += kMaskWordBits) {
      add_masked_group(runs, a, b, g, std::min(query_hi, g + kMaskWordBits), /*trim=*/true);
    }
  }

  // Queries [g0, g1) (depth-first numbers, at most 64) against flat tokens [a, b) covered by
  // `runs`. With `trim`, the range shrinks to the tokens the group sees and a fully visible
  // range drops its mask. Queries that see nothing of the range get no entry.
  void add_masked_group(std::span<const ViewRun> runs, int32_t a, int32_t b, int32_t g0,
                        int32_t g1, bool trim) {
    auto word_of = [&](const ViewRun& run) {
      return bit_range(std::max(run.query_begin, g0) - g0, std::min(run.query_end, g1) - g0);
    };
    size_t first = 0, last = runs.size();
    if (trim) {
      while (first < last && word_of(runs[first]) == 0) ++first;
      while (last > first && word_of(runs[last - 1]) == 0) --last;
      if (first == last) return;
      a = std::max(a, runs[first].flat_begin);
      b = std::min(b, runs[last - 1].flat_end);
    }
    const uint64_t group_bits = bit_range(0, g1 - g0);
    uint64_t any = 0;
    bool full = true;
    for (size_t r = first; r < last; ++r) {
      const uint64_t word = word_of(runs[r]);
      any |= word;
      full = full && word == group_bits;
    }
    if (any == 0) return;
    if (trim && full) {
      add_task(flat_base_ + a, flat_base_ + b, g0, g1, /*mask_begin=*/-1);
      return;
    }
    if (counting_ != nullptr) {
      count_task(b - a, std::popcount(any));
      return;
    }
    // One word per token, the same for every token of a run; bits compacted onto the queries
    // that get an entry.
    const int32_t mask_begin = static_cast<int32_t>(plan_->mask_words.size());
    for (size_t r = first; r < last; ++r) {
      const uint64_t word = compact_bits(word_of(runs[r]), any);
      const int32_t count = std::min(b, runs[r].flat_end) - std::max(a, runs[r].flat_begin);
      plan_->mask_words.insert(plan_->mask_words.end(), count, word);
    }
    plan_->task_kv_begin.push_back(flat_base_ + a);
    plan_->task_kv_end.push_back(flat_base_ + b);
    plan_->task_entry_begin.push_back(static_cast<int32_t>(plan_->entry_query.size()));
    plan_->task_mask_begin.push_back(mask_begin);
    plan_->task_kv_ready.push_back(ready_tokens(flat_base_ + a, flat_base_ + b));
    for (int32_t j = 0; j < g1 - g0; ++j) {
      if ((any >> j) & 1) plan_->entry_query.push_back(queries_.row[g0 + j]);
    }
  }

  // Keeps the bits of `word` at the positions set in `keep`, packed to the low end.
  static uint64_t compact_bits(uint64_t word, uint64_t keep) {
    if (keep == ~uint64_t{0} || keep == bit_range(0, 64 - std::countl_zero(keep))) {
      return word;  // `keep` is a low-end block: nothing to move
    }
    uint64_t packed = 0;
    int32_t out_bit = 0;
    for (int32_t j = 0; j < kMaskWordBits; ++j) {
      if (!((keep >> j) & 1)) continue;
      packed |= ((word >> j) & 1) << out_bit;
      ++out_bit;
    }
    return packed;
  }

  void add_task(int32_t kv_begin, int32_t kv_end, int32_t g0, int32_t g1, int32_t mask_begin) {
    if (counting_ != nullptr) {
      count_task(kv_end - kv_begin, g1 - g0);
      return;
    }
    plan_->task_kv_begin.push_back(kv_begin);
    plan_->task_kv_end.push_back(kv_end);
    plan_->task_entry_begin.push_back(static_cast<int32_t>(plan_->entry_query.size()));
    plan_->task_mask_begin.push_back(mask_begin);
    plan_->task_kv_ready.push_back(ready_tokens(kv_begin, kv_end));
    plan_->entry_query.insert(plan_->entry_query.end(), queries_.row.begin() + g0,
                              queries_.row.begin() + g1);
  }

  // Leading tokens of kv_slots [kv_begin, kv_end) (a task of the current tree's flattening)
  // that the step's KV write does not touch: up to the first fresh interval it overlaps.
  int32_t ready_tokens(int32_t kv_begin, int32_t kv_end) const {
    const auto it = std::upper_bound(
        fresh_.begin(), fresh_.end(), kv_begin,
        [](int32_t token, const std::array<int32_t, 2>& fresh) { return token < fresh[1]; });
    if (it == fresh_.end() || (*it)[0] >= kv_end) return kv_end - kv_begin;
    return std::max(kv_begin, (*it)[0]) - kv_begin;
  }

  // Baseline: every query reads its own root-to-token path in split-KV chunks, no sharing.
  void add_sequence_tasks(const SequenceTree& tree) {
    const KvCacheManager& kv = *tree.kv();
    // Split-KV as Flash-Decoding: one query per chunk, so the smallest adaptive B.
    const int32_t sequence_chunk = options_.chunk_tokens > 0 ? options_.chunk_tokens : 128;
    for (size_t q = 0; q < queries_.row.size(); ++q) {
      const int32_t path_begin = slots_end_;
      // The path's node ranks, leaf first.
      path_.clear();
      for (int32_t r = queries_.rank[q]; r != -1; r = parent_rank_[r]) path_.push_back(r);
      int32_t path_fresh = -1;  // the path's first token that the step's KV write fills
      for (auto it = path_.rbegin(); it != path_.rend(); ++it) {
        const int32_t rank = *it;
        const NodeId id = dfs_nodes_[rank];
        const int32_t visible = rank == queries_.rank[q]
                                    ? queries_.token_index[q] + 1
                                    : static_cast<int32_t>(tree.node(id).tokens.size());
        if (path_fresh < 0 && fresh_from_[rank] < visible) {
          path_fresh = slots_end_ + fresh_from_[rank];
        }
        append_slots(kv, tree.kv_key(id), visible);
      }
      const int32_t path_end = slots_end_;
      if (path_fresh < 0) path_fresh = path_end;
      for (int32_t a = path_begin; a < path_end; a += sequence_chunk) {
        const int32_t end = std::min(path_end, a + sequence_chunk);
        plan_->task_kv_begin.push_back(a);
        plan_->task_kv_end.push_back(end);
        plan_->task_entry_begin.push_back(static_cast<int32_t>(plan_->entry_query.size()));
        plan_->task_mask_begin.push_back(-1);
        plan_->task_kv_ready.push_back(std::clamp(path_fresh - a, 0, end - a));
        plan_->entry_query.push_back(queries_.row[q]);
      }
    }
  }

  // Deterministic plans (PlannerOptions::deterministic). For each piece k of depths
  // [k B, (k + 1) B), in increasing k so that every query's entries (its merge order) follow
  // depth: a query whose path covers the whole piece joins the task of that piece's last path
  // position (the same tokens for every such query); a query inside the piece (its last piece)
  // joins the chain of the query before it in depth-first order when that one's piece is a
  // prefix of its own (a prompt's consecutive tokens, a token chain), seeing the chain's run up
  // to itself through a mask; else it starts a chain. Grouping decides only which rows share a
  // CTA, never a row's arithmetic.
  void add_deterministic_tasks(const SequenceTree& tree) {
    const int32_t chunk =
        options_.chunk_tokens > 0 ? options_.chunk_tokens : kDeterministicChunkTokens;
    plan_->io.max_chunk_tokens = std::max(plan_->io.max_chunk_tokens, chunk);
    const int32_t num_queries = static_cast<int32_t>(queries_.row.size());
    det_depth_.resize(num_queries);
    int32_t max_depth = 0;
    for (int32_t q = 0; q < num_queries; ++q) {
      det_depth_[q] = static_cast<int32_t>(dfs_node_ptrs_[queries_.rank[q]]->depth_begin) +
                      queries_.token_index[q];
      max_depth = std::max(max_depth, det_depth_[q]);
    }
    const KvCacheManager& kv = *tree.kv();
    for (int32_t lo = 0; lo <= max_depth; lo += chunk) {
      const int32_t hi = lo + chunk;
      det_groups_used_ = 0;
      full_group_.erase(full_group_.begin(), full_group_.end());
      int32_t chain = -1;  // the open chain's group
      int64_t chain_end = -1;
      for (int32_t q = 0; q < num_queries; ++q) {
        const int32_t depth = det_depth_[q];
        if (depth < lo) continue;
        if (depth >= hi - 1) {  // the whole piece: keyed by its last position
          const int64_t key = position_key(q, hi - 1);
          auto [it, added] = full_group_.try_emplace(key, 0);
          if (added || static_cast<int32_t>(det_groups_[it->second].members.size()) >=
                           options_.max_unmasked_queries) {
            it->second = new_group(q, chunk);
          }
          det_groups_[it->second].members.push_back({q, chunk});
          continue;
        }
        const int32_t length = depth - lo + 1;
        DetGroup* open = chain >= 0 ? &det_groups_[chain] : nullptr;
        if (open != nullptr && static_cast<int32_t>(open->members.size()) < kMaskWordBits &&
            depth >= lo + open->length - 1 && position_key(q, lo + open->length - 1) == chain_end) {
          open->anchor = q;
          open->length = length;
        } else {
          chain = new_group(q, length);
          open = &det_groups_[chain];
        }
        open->members.push_back({q, length});
        chain_end = position_key(q, depth);
      }
      for (size_t g = 0; g < det_groups_used_; ++g) add_deterministic_task(kv, det_groups_[g], lo);
    }
  }

  struct DetMember {
    int32_t query;   // depth-first number
    int32_t tokens;  // visible prefix of the group's run
  };
  struct DetGroup {
    int32_t anchor = 0;  // a query whose path holds the run (the deepest member)
    int32_t length = 0;  // tokens of the run
    std::vector<DetMember> members;
  };
  int32_t new_group(int32_t anchor, int32_t length) {
    if (det_groups_.size() == det_groups_used_) det_groups_.emplace_back();
    DetGroup& group = det_groups_[det_groups_used_];
    group.anchor = anchor;
    group.length = length;
    group.members.clear();
    return static_cast<int32_t>(det_groups_used_++);
  }

  // The node rank and token of query q's path at `depth` (<= its own), packed.
  int64_t position_key(int32_t q, int32_t depth) const {
    int32_t rank = queries_.rank[q];
    while (dfs_node_ptrs_[rank]->depth_begin > depth) rank = parent_rank_[rank];
    return (int64_t{rank} << 32) | static_cast<uint32_t>(depth - dfs_node_ptrs_[rank]->depth_begin);
  }

  // One task: the anchor's path at depths [lo, lo + length), its members' rows, and a mask when
  // some member sees only a prefix.
  void add_deterministic_task(const KvCacheManager& kv, const DetGroup& group, int32_t lo) {
    const int32_t kv_begin = slots_end_;
    const int32_t end_depth = lo + group.length;  // exclusive
    path_.clear();  // the anchor's node ranks overlapping the run, deepest first
    for (int32_t r = queries_.rank[group.anchor]; r != -1; r = parent_rank_[r]) {
      const int64_t begin = dfs_node_ptrs_[r]->depth_begin;
      if (begin >= end_depth) continue;
      path_.push_back(r);
      if (begin <= lo) break;
    }
    int32_t ready = -1;  // first token of the run that the step's KV write fills
    for (auto it = path_.rbegin(); it != path_.rend(); ++it) {
      const int32_t r = *it;
      const auto begin = static_cast<int32_t>(dfs_node_ptrs_[r]->depth_begin);
      const int32_t first = std::max(lo, begin) - begin;
      const int32_t last =
          std::min(end_depth, begin + static_cast<int32_t>(dfs_node_ptrs_[r]->tokens.size())) -
          begin;
      if (ready < 0 && fresh_from_[r] < last) {
        ready = slots_end_ - kv_begin + std::max(0, fresh_from_[r] - first);
      }
      append_slot_range(kv.page_tokens(), dfs_pages_[r], first, last - first);
    }
    DEFT_CHECK(slots_end_ - kv_begin == group.length,
               "planner: a deterministic task holds %d slots, not its run's %d",
               slots_end_ - kv_begin, group.length);
    bool full = true;
    for (const DetMember& member : group.members) full = full && member.tokens == group.length;
    plan_->task_kv_begin.push_back(kv_begin);
    plan_->task_kv_end.push_back(slots_end_);
    plan_->task_entry_begin.push_back(static_cast<int32_t>(plan_->entry_query.size()));
    plan_->task_mask_begin.push_back(full ? -1 : static_cast<int32_t>(plan_->mask_words.size()));
    plan_->task_kv_ready.push_back(ready < 0 ? group.length : ready);
    for (const DetMember& member : group.members) {
      plan_->entry_query.push_back(queries_.row[member.query]);
    }
    if (full) return;
    // Members are in increasing prefix order: token j is seen by the members from the first whose
    // prefix holds it.
    for (int32_t j = 0; j < group.length; ++j) {
      uint64_t word = 0;
      for (size_t m = 0; m < group.members.size(); ++m) {
        if (j < group.members[m].tokens) word |= uint64_t{1} << m;
      }
      plan_->mask_words.push_back(word);
    }
  }

  // Appends the slots of tokens [first, first + count) of an owner with `pages`.
  void append_slot_range(int32_t page_tokens, std::span<const int32_t> pages, int32_t first,
                         int32_t count) {
    int32_t* out = take_slots(count);
    for (int32_t j = 0; j < count;) {
      const int32_t token = first + j;
      const int32_t offset = token % page_tokens;
      const int32_t n = std::min(page_tokens - offset, count - j);
      fill_consecutive(out + j, n, pages[token / page_tokens] * page_tokens + offset);
      j += n;
    }
  }

  PlannerOptions options_;
  AttentionPlan* plan_ = nullptr;
  OrderedQueries queries_;
  FlatTree flat_;
  std::vector<std::array<int32_t, 3>> order_;  // (node rank, token index, input index)
  // Depth-first rank of each live node of the current tree, by id. A map, not an array sized by
  // the largest id: a speculative session hands out 64 ids a step, so such an array would grow
  // without bound while the live nodes stay a few dozen.
  absl::flat_hash_set<NodeId> on_path_;  // the queried nodes and their ancestors
  absl::flat_hash_map<NodeId, int32_t> rank_;
  std::vector<NodeId> dfs_nodes_;
  // By rank: the live node and its KV pages (nothing changes the tree while it is planned).
  std::vector<const TreeNode*> dfs_node_ptrs_;
  std::vector<std::span<const int32_t>> dfs_pages_;
  std::vector<int32_t> parent_rank_;  // by rank; -1 for the root
  std::vector<std::pair<NodeId, int32_t>> stack_;  // (node, its parent's rank)
  std::vector<int32_t> path_;  // node ranks of a query's path (the sequence baseline)
  std::vector<NodeId> ancestors_;  // a prefill run's node's proper ancestors, nearest first
  std::vector<int32_t> own_begin_;
  std::vector<int32_t> subtree_size_;
  std::vector<int32_t> fill_cursor_;
  std::vector<int32_t> fresh_from_;              // per node rank (add_tree)
  std::vector<std::array<int32_t, 2>> fresh_;    // kv_slots intervals the KV write fills
  int32_t slots_end_ = 0;   // plan.kv_slots written so far (its size is larger until finish())
  int32_t flat_base_ = 0;   // index in plan.kv_slots of the current tree's first flat token
  int32_t run_cursor_ = 0;  // first run that the next piece can overlap
  // Deterministic plans: per depth-first query its depth; one piece's groups (the first
  // det_groups_used_ of det_groups_ are live; the rest keep their storage), the group of each
  // whole-piece position.
  std::vector<int32_t> det_depth_;
  std::vector<DetGroup> det_groups_;
  size_t det_groups_used_ = 0;
  absl::flat_hash_map<int64_t, int32_t> full_group_;
  int32_t step_queries_ = 0;       // every tree's queries of the step
  WaveCount* counting_ = nullptr;  // set: tasks are counted (wave_chunk_tokens), not added
};

AttentionPlanner::AttentionPlanner(PlannerOptions options)
    : options_(options), builder_(std::make_unique<PlanBuilder>()) {}
AttentionPlanner::~AttentionPlanner() = default;
AttentionPlanner::AttentionPlanner(AttentionPlanner&&) noexcept = default;
AttentionPlanner& AttentionPlanner::operator=(AttentionPlanner&&) noexcept = default;

absl::Status AttentionPlanner::plan(std::span<const TreeQueries> trees, AttentionPlan& plan) {
  // The slots keep their length (stale values) while the builder overwrites them: clearing and
  // regrowing the vector zero-filled every slot of the step (60 KB for a 15000-token prefix)
  // before the builder wrote it. finish() trims them to the slots written.
  std::vector<int32_t> kept_slots = std::move(plan.kv_slots);
  plan.clear();
  plan.kind = options_.kind;
  if (options_.chunk_tokens < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "planner: chunk_tokens must be >= 1 (or 0: adaptive), got ", options_.chunk_tokens));
  }
  if (options_.min_prefill_run < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "planner: min_prefill_run must be >= 0 (0: no prefill runs), got ",
        options_.min_prefill_run));
  }
  if (options_.max_unmasked_queries < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "planner: max_unmasked_queries must be >= 1, got ", options_.max_unmasked_queries));
  }
  if (options_.wave.ctas < 0 || options_.wave.kv_heads < 0 || options_.wave.group_size < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "planner: wave ctas, kv_heads and group_size must be >= 0, got ", options_.wave.ctas, ", ",
        options_.wave.kv_heads, ", ", options_.wave.group_size));
  }
  plan.kv_slots = std::move(kept_slots);
  PlanBuilder& builder = *builder_;
  int32_t step_queries = 0;
  for (const TreeQueries& tree : trees) step_queries += static_cast<int32_t>(tree.queries.size());
  builder.start(options_, step_queries, plan);
  int32_t rows = 0;
  for (const TreeQueries& tree : trees) {
    if (absl::Status status = builder.add_tree(tree, rows); !status.ok()) {
      plan.clear();
      return status;
    }
    rows += static_cast<int32_t>(tree.queries.size());
  }
  builder.finish(rows);
  return absl::OkStatus();
}

}  // namespace deft::engine
