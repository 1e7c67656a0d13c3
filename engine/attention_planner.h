// QKV preparation (the DeFT paper's first phase): turns the step's queries over one or more
// trees into an AttentionPlan, the flat arrays that kernels/ execute (see
// kernels/attention_params.h). Pure host code. One plan serves every layer of a step.
//
// A query is one token of the tree: it sees every token of its node's proper ancestors and the
// tokens of its own node up to and including itself. That one rule covers decoding (the new
// token of each live leaf), prefill / extend (a run of new tokens of one node, causal among
// themselves) and speculative verification (a token tree hung under a node, one node per
// token or per chain).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "engine/sequence_tree.h"
#include "kernels/attention_params.h"

namespace deft::engine {

enum class PlanKind {
  kDeftFlatten,    // DFS-flattened tree KV cut into even chunks; KV-guided query groups
  kDeftNode,       // one task per node (paper ablation)
  kDeftNodeChunk,  // nodes cut into chunks of at most chunk_tokens (paper ablation)
  kSequence,       // baseline: each query reads its whole path (Flash-Decoding / radix attention)
  kDenseMask,      // baseline: every query of a tree against every tree token, dense mask (Medusa)
};
std::string_view plan_kind_name(PlanKind kind);
// Parses the names plan_kind_name() prints; INVALID_ARGUMENT names the bad value.
absl::Status parse_plan_kind(std::string_view name, PlanKind* kind);

// The GPU launch the plan will run on (the DeFT kernels' stage 1, kernels/deft_attention.h):
// how many of its CTAs the GPU holds at once, the KV heads and the GQA group. Zero `ctas`: not
// known (a CPU runner), and the adaptive B ignores it.
struct AttentionWave {
  int32_t ctas = 0;
  int32_t kv_heads = 0;
  int32_t group_size = 0;
};

struct PlannerOptions {
  PlanKind kind = PlanKind::kDeftFlatten;
  // B: tokens per chunk (Flatten, Node-Chunk, and the split-KV chunks of the sequence baseline).
  // 0 (the default) picks B per tree with adaptive_chunk_tokens(); the paper uses 128.
  int32_t chunk_tokens = 0;
  // Cap on the queries of a task that needs no mask (masked tasks hold <= kMaskWordBits).
  int32_t max_unmasked_queries = 256;
  // Prefill runs: at least this many queries that are consecutive tokens of one node on
  // consecutive query rows (a prompt, an extension) become one PrefillRun of the plan, run by the
  // tiled prefill kernel (kernels/prefill_attention.h) instead of DeFT tasks with bit masks. 0
  // (the default) keeps every query in the tasks. Every executor of a plan (deft_attention_cpu,
  // the DeFT + prefill kernels of the CUDA runner, the generic GPU kernel) runs both parts; 64 is
  // where a run's masked 64-query groups start to cost more than a causal tile
  // (bench/results/prefill-h100-*.json).
  int32_t min_prefill_run = 0;
  // With ctas > 0, a Flatten tree's adaptive B may grow so that its stage-1 grid takes fewer
  // waves (see wave_chunk_tokens in attention_planner.cc). Set from ModelRunner::attention_wave().
  AttentionWave wave = {};
  // Deterministic plans (the server's --deterministic): a query's partial results and their merge
  // order depend only on its own root-to-token path, never on the other queries of the step.
  // Its KV is cut at the fixed depths 0, B, 2B, ... (B = chunk_tokens, or
  // kDeterministicChunkTokens when that is 0) and each piece is one task whose KV run starts at
  // the piece's first token and holds the path's tokens in depth order; the query sees a prefix
  // of that run (all of it, or up to itself in its last piece). Queries whose pieces are the
  // same tokens share the task (a shared prompt is still read once per step), others read their
  // own copy. Stage 2 merges a query's pieces in depth order. No prefill runs (min_prefill_run
  // and `kind` are ignored): every row goes through the same tasks, so a prompt token computes
  // the same whether it is prefilled in one step, in chunks beside other requests, or decoded.
  // An executor whose row arithmetic depends only on the row's task runs and visible prefixes
  // (the CPU twin; the CUDA kernels with wgmma passes, kernels::PlanShape::batch_invariant)
  // then gives each row the same bits in any batch.
  bool deterministic = false;
};

// B of deterministic plans when PlannerOptions::chunk_tokens is 0: the adaptive rule's usual pick
// for decode trees, and large enough that a long prompt's rows write few partials each (a
// 4000-token prompt prefilled at once: ~8 partials a row).
inline constexpr int32_t kDeterministicChunkTokens = 256;

// The chunk size B used when PlannerOptions::chunk_tokens is 0, for a tree whose step has
// `num_queries` queries over `visible_tokens` KV tokens. Stage 1 writes one fp32 partial per
// query and chunk (16 KB at Llama-3-8B shapes) against 4 KB of KV per token, so larger chunks
// cut partial traffic: 512; then B halves (down to 64) while chunks x ceil(queries / 16) (about
// the CTAs per KV head) stays under 24, so that trees still fill the SMs. A tree of fewer than 8
// chunks of 512 gets 512 when that gives at least 48, else 256. Fitted to the fixed-B sweep of
// the H100 kernel bench (the `deft_flatten_b<B>` rows of bench/results/kernel_attention-h100-*.json)
// and the end-to-end few-shot tree (a 4000-token prompt and 20 short branches: 256): it picks the
// best measured B on every paper snapshot of that sweep.
int32_t adaptive_chunk_tokens(int64_t num_queries, int64_t visible_tokens);
//
// With PlannerOptions::wave known, a Flatten tree whose chunks at that B need more than one wave
// of stage-1 CTAs takes instead the B in [B, 2B] (multiples of 64 tokens) that minimises
// waves x (tiles of the longest task + 2): the CTAs of 64-row passes beyond one wave start only
// when others end, each chain a task's whole chunk. Only passes of more than 16 rows count (a
// single query's 4-row passes are short; they fill in beside the others). E.g. a 6000-token
// prefix with a 64-token tree, 416 CTAs of 8 tiles at B = 512 against 396 resident on an H100,
// takes B = 576 (384 CTAs of 9 tiles), 30.4 -> 26.1 us. A step of several trees gives each tree
// the share of the wave its queries are of the step's. A grid that fits in one wave with every
// CTA counted (the short passes too) takes instead the smallest B, down to 192, at which it still
// does: more, shorter chains on the idle CTA slots (H100: specdec p6000 t32 512 -> 320, 20.9 ->
// 17.6 us; few-shot b20 512 -> 448, 21.3 -> 19.7). Measurements: "The chunk size B" in
// bench/results/kernel_attention-h100-notes.md; the CTA grid itself: kernels/deft_schedule.h.

// One query: token `token_index` of `node`.
struct QueryToken {
  NodeId node = -1;
  int32_t token_index = 0;
};

// The queries of one tree in one step. Query rows of the plan follow the order of the trees
// and, within a tree, the order of `queries`.
struct TreeQueries {
  const SequenceTree* tree = nullptr;
  std::span<const QueryToken> queries;
};

// The paper's IO quantities for one plan.
struct PlanIo {
  int64_t kv_tokens_read = 0;     // sum over tasks of their KV run, plus each prefill run's
                                  // keys (per KV head, per layer)
  int64_t query_chunk_pairs = 0;  // entries: partial results written by stage 1
  int64_t mask_words = 0;         // 64-bit mask words read
  int64_t tasks = 0;
  int32_t max_chunk_tokens = 0;   // the largest B of the step's trees (Flatten, Node-Chunk)
};

// Owning, host-side plan; view() gives the flat arrays the kernels take.
struct AttentionPlan {
  PlanKind kind = PlanKind::kDeftFlatten;
  int32_t num_queries = 0;
  std::vector<int32_t> kv_slots;
  std::vector<int32_t> task_kv_begin;
  std::vector<int32_t> task_kv_end;
  std::vector<int32_t> task_entry_begin;  // num_tasks + 1
  std::vector<int32_t> task_mask_begin;
  std::vector<int32_t> task_kv_ready;  // see AttentionPlanView::task_kv_ready
  std::vector<uint64_t> mask_words;
  std::vector<int32_t> entry_query;
  std::vector<int32_t> query_entry_begin;  // num_queries + 1
  std::vector<int32_t> query_entries;
  // Runs of new tokens executed by the prefill kernel (PlannerOptions::min_prefill_run); their
  // keys are ranges of kv_slots and their rows have no entries.
  std::vector<kernels::PrefillRun> prefill_runs;
  // Per query row: its RoPE position (depth) and KV slot of its own token.
  std::vector<int32_t> query_position;
  std::vector<int32_t> query_slot;
  PlanIo io;

  int32_t num_tasks() const { return static_cast<int32_t>(task_kv_begin.size()); }
  int32_t num_entries() const { return static_cast<int32_t>(entry_query.size()); }
  kernels::AttentionPlanView view() const;
  void clear();  // keeps capacity, so a planner reusing the plan allocates nothing per step
};

class PlanBuilder;  // the machinery, in attention_planner.cc

class AttentionPlanner {
 public:
  explicit AttentionPlanner(PlannerOptions options = {});
  ~AttentionPlanner();
  AttentionPlanner(AttentionPlanner&&) noexcept;
  AttentionPlanner& operator=(AttentionPlanner&&) noexcept;
  const PlannerOptions& options() const { return options_; }

  // Builds the plan for the given trees' queries into `plan` (its buffers are reused).
  // INVALID_ARGUMENT for an unknown node, a token index outside its node, a tree without KV,
  // a repeated query, or options out of range; `plan` is then left empty.
  absl::Status plan(std::span<const TreeQueries> trees, AttentionPlan& plan);

 private:
  PlannerOptions options_;
  std::unique_ptr<PlanBuilder> builder_;  // scratch reused across steps
};

}  // namespace deft::engine
