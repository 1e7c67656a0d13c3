#include "engine/attention_planner.h"

#include <gtest/gtest.h>

namespace deft::engine {
namespace {

// A prompt of `prompt` tokens with `leaves` children of `suffix` tokens each; the queries are
// the last token of every leaf (one decoding step).
struct FewShot {
  KvCacheManager kv{{.page_tokens = 16, .num_pages = 4096}};
  SequenceTree tree{0, &kv};
  std::vector<QueryToken> queries;

  FewShot(int prompt, int leaves, int suffix) {
    std::vector<TokenId> ids(prompt, 5);
    EXPECT_TRUE(tree.append(tree.root(), ids).ok());
    const std::vector<NodeId> leaf_ids = tree.branch(tree.root(), leaves).value();
    for (NodeId leaf : leaf_ids) {
      EXPECT_TRUE(tree.append(leaf, std::vector<TokenId>(suffix, 7)).ok());
      queries.push_back({leaf, suffix - 1});
    }
  }
  std::vector<TreeQueries> input() const { return {{&tree, queries}}; }
};

TEST(AttentionPlanner, FlattenReadsEveryTreeTokenOnce) {
  FewShot job(266, 3, 10);
  AttentionPlanner planner({.kind = PlanKind::kDeftFlatten, .chunk_tokens = 128});
  AttentionPlan plan;
  ASSERT_TRUE(planner.plan(job.input(), plan).ok());
  EXPECT_EQ(plan.num_queries, 3);
  EXPECT_EQ(plan.io.kv_tokens_read, 296);
  // Chunks: [0,128) [128,256) unmasked, [256,296) spans the prompt's tail (10 tokens, too short
  // to be split off) and the leaves: masked.
  ASSERT_EQ(plan.num_tasks(), 3);
  EXPECT_EQ(plan.task_mask_begin[0], -1);
  EXPECT_EQ(plan.task_mask_begin[1], -1);
  EXPECT_GE(plan.task_mask_begin[2], 0);
  EXPECT_EQ(plan.io.mask_words, 40);
  EXPECT_EQ(plan.io.query_chunk_pairs, 9);
  // The prompt's tokens are visible to all three queries, a leaf's only to its own.
  const uint64_t prompt_word = plan.mask_words[plan.task_mask_begin[2]];
  const uint64_t leaf_word = plan.mask_words[plan.task_mask_begin[2] + 10];
  EXPECT_EQ(prompt_word, 0b111u);
  EXPECT_EQ(leaf_word, 0b001u);
  for (int q = 0; q < 3; ++q) {
    EXPECT_EQ(plan.query_entry_begin[q + 1] - plan.query_entry_begin[q], 3);
    EXPECT_EQ(plan.query_position[q], 275);
  }
}

TEST(AttentionPlanner, TasksSayHowMuchOfTheirKvPredatesTheStep) {
  // Decoding: only each leaf's last token is written this step.
  FewShot job(256, 2, 80);
  AttentionPlanner planner({.kind = PlanKind::kDeftFlatten, .chunk_tokens = 128});
  AttentionPlan plan;
  ASSERT_TRUE(planner.plan(job.input(), plan).ok());
  // Tasks: the prompt's two chunks, leaf 0 [256, 336), leaf 1 cut at the chunk boundary 384.
  ASSERT_EQ(plan.num_tasks(), 5);
  EXPECT_EQ(plan.task_kv_ready[0], 128);
  EXPECT_EQ(plan.task_kv_ready[1], 128);
  EXPECT_EQ(plan.task_kv_ready[2], 79);
  EXPECT_EQ(plan.task_kv_ready[3], 48);
  EXPECT_EQ(plan.task_kv_ready[4], 31);
  // Speculative verification: a chain of 3 draft tokens under a leaf, all new.
  const NodeId leaf = job.queries[0].node;
  const NodeId draft = job.tree.branch(leaf, 1).value()[0];
  ASSERT_TRUE(job.tree.append(draft, std::vector<TokenId>(3, 9)).ok());
  const std::vector<QueryToken> verify = {{draft, 0}, {draft, 1}, {draft, 2}};
  ASSERT_TRUE(planner.plan(std::vector<TreeQueries>{{&job.tree, verify}}, plan).ok());
  // Tasks: the prompt's chunks, leaf 0 with the first draft (all three queries see both),
  // then the other two drafts under a mask.
  ASSERT_EQ(plan.num_tasks(), 4);
  EXPECT_EQ(plan.task_kv_ready[0], 128);
  EXPECT_EQ(plan.task_kv_ready[1], 128);
  EXPECT_EQ(plan.task_kv_end[2] - plan.task_kv_begin[2], 81);
  EXPECT_EQ(plan.task_kv_ready[2], 80);
  EXPECT_EQ(plan.task_kv_ready[3], 0);
  // The sequence baseline: a path's chunks are ready up to the path's first new token.
  AttentionPlanner sequence({.kind = PlanKind::kSequence, .chunk_tokens = 128});
  ASSERT_TRUE(sequence.plan(std::vector<TreeQueries>{{&job.tree, verify}}, plan).ok());
  ASSERT_EQ(plan.num_tasks(), 9);  // paths of 337, 338, 339 tokens: 3 chunks each
  EXPECT_EQ(plan.task_kv_ready[0], 128);
  EXPECT_EQ(plan.task_kv_ready[1], 128);
  EXPECT_EQ(plan.task_kv_ready[2], 80);  // [256, 337): 80 old tokens, then the first draft
  EXPECT_EQ(plan.task_kv_ready[8], 80);
}

TEST(AttentionPlanner, FlattenRunsPrivateSuffixesBesideEachOther) {
  // Prompt [0, 256), leaves of 50 tokens [256, 306), ... [456, 506); pieces of 256 tokens. Each
  // leaf holds at least kMinUnmaskedSplit tokens of one viewer: a task of its own without a mask
  // (not one masked 4-tile task of five leaves).
  FewShot job(256, 5, 50);
  AttentionPlanner planner({.kind = PlanKind::kDeftFlatten, .chunk_tokens = 256});
  AttentionPlan plan;
  ASSERT_TRUE(planner.plan(job.input(), plan).ok());
  EXPECT_EQ(plan.io.kv_tokens_read, 506);
  ASSERT_EQ(plan.num_tasks(), 1 + 5);
  for (int t = 0; t < plan.num_tasks(); ++t) EXPECT_EQ(plan.task_mask_begin[t], -1);
  EXPECT_EQ(plan.task_entry_begin[1 + 5] - plan.task_entry_begin[1], 5);  // a query each
  for (int t = 1; t <= 5; ++t) {
    EXPECT_EQ(plan.task_kv_end[t] - plan.task_kv_begin[t], 50);
  }
  // Leaves shorter than that stay together under a mask.
  FewShot short_leaves(256, 5, 15);
  ASSERT_TRUE(planner.plan(short_leaves.input(), plan).ok());
  ASSERT_EQ(plan.num_tasks(), 2);
  EXPECT_GE(plan.task_mask_begin[1], 0);
}

TEST(AttentionPlanner, FlattenSplitsPiecesAroundLongRunsOfOneViewerSet) {
  // Prompt [0, 300), leaves [300, 400), [400, 500), [500, 600); pieces of 256 tokens.
  FewShot job(300, 3, 100);
  AttentionPlanner planner({.kind = PlanKind::kDeftFlatten, .chunk_tokens = 256});
  AttentionPlan plan;
  ASSERT_TRUE(planner.plan(job.input(), plan).ok());
  EXPECT_EQ(plan.io.kv_tokens_read, 600);
  // [0, 256) is the prompt; [256, 512) splits into the prompt's tail [256, 300) (all three
  // queries), leaf 0 [300, 400) and leaf 1 [400, 500) (one query each) and leaf 2's first 12
  // tokens [500, 512); [512, 600) is the rest of leaf 2. Nothing needs a mask.
  const std::vector<std::pair<int32_t, int32_t>> expected = {
      {0, 256}, {256, 300}, {300, 400}, {400, 500}, {500, 512}, {512, 600}};
  ASSERT_EQ(plan.num_tasks(), static_cast<int32_t>(expected.size()));
  for (int32_t t = 0; t < plan.num_tasks(); ++t) {
    SCOPED_TRACE(t);
    EXPECT_EQ(plan.task_kv_begin[t], expected[t].first);
    EXPECT_EQ(plan.task_kv_end[t], expected[t].second);
    EXPECT_EQ(plan.task_mask_begin[t], -1);
  }
  EXPECT_EQ(plan.io.mask_words, 0);
}

TEST(AttentionPlanner, SequenceReadsEveryPathWhole) {
  FewShot job(300, 3, 10);
  AttentionPlanner planner({.kind = PlanKind::kSequence, .chunk_tokens = 128});
  AttentionPlan plan;
  ASSERT_TRUE(planner.plan(job.input(), plan).ok());
  EXPECT_EQ(plan.io.kv_tokens_read, 3 * 310);
  EXPECT_EQ(plan.io.mask_words, 0);
  EXPECT_EQ(plan.num_tasks(), 3 * 3);
}

TEST(AttentionPlanner, NodeKindsCutAtNodeBoundaries) {
  FewShot job(300, 3, 10);
  AttentionPlan plan;
  ASSERT_TRUE(AttentionPlanner({.kind = PlanKind::kDeftNode}).plan(job.input(), plan).ok());
  EXPECT_EQ(plan.num_tasks(), 4);
  EXPECT_EQ(plan.io.mask_words, 0);
  EXPECT_EQ(plan.io.kv_tokens_read, 330);
  ASSERT_TRUE(AttentionPlanner({.kind = PlanKind::kDeftNodeChunk, .chunk_tokens = 128})
                  .plan(job.input(), plan)
                  .ok());
  EXPECT_EQ(plan.num_tasks(), 3 + 3);
  EXPECT_EQ(plan.io.kv_tokens_read, 330);
}

TEST(AttentionPlanner, DenseMaskMasksEveryChunk) {
  FewShot job(300, 3, 10);
  AttentionPlan plan;
  ASSERT_TRUE(AttentionPlanner({.kind = PlanKind::kDenseMask, .chunk_tokens = 128})
                  .plan(job.input(), plan)
                  .ok());
  EXPECT_EQ(plan.num_tasks(), 3);
  EXPECT_EQ(plan.io.mask_words, 330);
}

TEST(AttentionPlanner, PrefillRunIsCausalAmongItsTokens) {
  KvCacheManager kv({.page_tokens = 16, .num_pages = 64});
  SequenceTree tree(0, &kv);
  // A root shorter than kMinUnmaskedSplit, so that root and child share one masked task.
  ASSERT_TRUE(tree.append(tree.root(), std::vector<TokenId>(12, 1)).ok());
  const NodeId child = tree.branch(tree.root(), 1).value()[0];
  ASSERT_TRUE(tree.append(child, std::vector<TokenId>(4, 2)).ok());
  std::vector<QueryToken> queries = {{child, 0}, {child, 1}, {child, 2}, {child, 3}};
  std::vector<TreeQueries> input = {{&tree, queries}};
  AttentionPlan plan;
  ASSERT_TRUE(AttentionPlanner({.chunk_tokens = 128}).plan(input, plan).ok());
  ASSERT_EQ(plan.num_tasks(), 1);
  ASSERT_GE(plan.task_mask_begin[0], 0);
  const uint64_t* words = &plan.mask_words[plan.task_mask_begin[0]];
  EXPECT_EQ(words[0], 0b1111u);   // root tokens: everyone
  EXPECT_EQ(words[12], 0b1111u);  // first new token: all four queries
  EXPECT_EQ(words[15], 0b1000u);  // last new token: only itself
}

TEST(AttentionPlanner, BadQueriesAreRejectedAndLeaveThePlanEmpty) {
  FewShot job(30, 2, 3);
  AttentionPlanner planner;
  AttentionPlan plan;
  std::vector<QueryToken> unknown = {{99, 0}};
  std::vector<TreeQueries> input = {{&job.tree, unknown}};
  EXPECT_EQ(planner.plan(input, plan).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(plan.num_tasks(), 0);
  std::vector<QueryToken> outside = {{1, 3}};
  input = {{&job.tree, outside}};
  EXPECT_EQ(planner.plan(input, plan).code(), absl::StatusCode::kInvalidArgument);
  std::vector<QueryToken> twice = {{1, 2}, {1, 2}};
  input = {{&job.tree, twice}};
  EXPECT_EQ(planner.plan(input, plan).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(AttentionPlanner({.chunk_tokens = -1}).plan(job.input(), plan).code(),
            absl::StatusCode::kInvalidArgument);
  PlanKind kind;
  EXPECT_FALSE(parse_plan_kind("radix", &kind).ok());
  ASSERT_TRUE(parse_plan_kind("deft_node_chunk", &kind).ok());
  EXPECT_EQ(kind, PlanKind::kDeftNodeChunk);
}

TEST(AttentionPlanner, AdaptiveChunkFollowsQueriesAndTreeSize) {
  EXPECT_EQ(adaptive_chunk_tokens(20, 8000), 512);   // few-shot b = 20
  EXPECT_EQ(adaptive_chunk_tokens(50, 14000), 512);  // few-shot b = 50
  EXPECT_EQ(adaptive_chunk_tokens(256, 6256), 512);  // 6000 prefix + 256-token tree
  EXPECT_EQ(adaptive_chunk_tokens(32, 1032), 256);   // 1000 prefix + 32-token tree
  EXPECT_EQ(adaptive_chunk_tokens(64, 1064), 256);   // 1000 prefix + 64-token tree
  EXPECT_EQ(adaptive_chunk_tokens(128, 1128), 256);  // 1000 prefix + 128-token tree
  EXPECT_EQ(adaptive_chunk_tokens(256, 1256), 512);  // 1000 prefix + 256-token tree: 48 passes
  EXPECT_EQ(adaptive_chunk_tokens(100, 14000), 512);  // reasoning: 1000 + 10 x 300 + 100 x 100
  EXPECT_EQ(adaptive_chunk_tokens(20, 5000), 256);   // e2e few-shot: 20 branches of ~50
  EXPECT_EQ(adaptive_chunk_tokens(32, 6032), 512);   // 6000 prefix + 32-token tree: 12 chunks
  EXPECT_EQ(adaptive_chunk_tokens(1, 10), 256);  // one chunk: no partials to merge
  EXPECT_EQ(adaptive_chunk_tokens(1, 4100), 128);  // 9 chunks of 512, one query: 33 of 128
  FewShot job(4000, 20, 200);
  AttentionPlan plan;
  ASSERT_TRUE(AttentionPlanner().plan(job.input(), plan).ok());
  EXPECT_EQ(plan.task_kv_end[0] - plan.task_kv_begin[0], 512);
  EXPECT_EQ(plan.io.kv_tokens_read, 8000);
}

// A prefix of `prefix` tokens and `leaves` one-token children queried each (a star-shaped token
// tree, as speculative verification hangs under the prompt).
struct TokenStar {
  KvCacheManager kv{{.page_tokens = 16, .num_pages = 4096}};
  SequenceTree tree{0, &kv};
  std::vector<QueryToken> queries;

  TokenStar(int prefix, int leaves) {
    EXPECT_TRUE(tree.append(tree.root(), std::vector<TokenId>(prefix, 5)).ok());
    const std::vector<NodeId> leaf_ids = tree.branch(tree.root(), leaves).value();
    for (NodeId leaf : leaf_ids) {
      EXPECT_TRUE(tree.append(leaf, std::vector<TokenId>{7}).ok());
      queries.push_back({leaf, 0});
    }
  }
  std::vector<TreeQueries> input() const { return {{&tree, queries}}; }
};

// H100, Llama-3-8B shapes: 132 SMs x 3 stage-1 CTAs, 8 KV heads, groups of 4.
constexpr AttentionWave kH100Wave = {.ctas = 396, .kv_heads = 8, .group_size = 4};

TEST(AttentionPlanner, WaveGrowsTheAdaptiveChunkWhenTheGridSpillsOverOneWave) {
  // 6000 + 64: at B = 512, 12 prefix pieces and the star's masked piece, each 4 passes of 64 rows
  // x 8 KV heads = 416 CTAs against 396 resident; at 576, 11 + 1 pieces = 384: one wave.
  TokenStar star(6000, 64);
  AttentionPlan plan;
  ASSERT_TRUE(AttentionPlanner().plan(star.input(), plan).ok());
  EXPECT_EQ(plan.io.max_chunk_tokens, 512);
  EXPECT_EQ(plan.io.tasks, 13);
  ASSERT_TRUE(AttentionPlanner({.wave = kH100Wave}).plan(star.input(), plan).ok());
  EXPECT_EQ(plan.io.max_chunk_tokens, 576);
  EXPECT_EQ(plan.io.tasks, 12);
  EXPECT_EQ(plan.io.kv_tokens_read, 6064);
  // 6000 + 256: never one wave up to 2 x 512; 768 has the fewest waves x tiles (3 x 14).
  TokenStar big(6000, 256);
  ASSERT_TRUE(AttentionPlanner({.wave = kH100Wave}).plan(big.input(), plan).ok());
  EXPECT_EQ(plan.io.max_chunk_tokens, 768);
}

TEST(AttentionPlanner, WaveShrinksTheAdaptiveChunkWhileEveryCtaFits) {
  // Few-shot b = 20 (80 rows on the prompt: two passes): at 512, 8 prompt pieces x 2 passes + 20
  // one-query branches, x 8 KV heads = 352 CTAs; 448 gives 376, 384 would give 416 > 396.
  FewShot job(4000, 20, 200);
  AttentionPlan plan;
  ASSERT_TRUE(AttentionPlanner({.wave = kH100Wave}).plan(job.input(), plan).ok());
  EXPECT_EQ(plan.io.max_chunk_tokens, 448);
  // 6000 + 32 (128 rows: two passes): 13 pieces at 512 (208 CTAs), 20 at 320 (320), 25 at 256
  // (400 > 396).
  ASSERT_TRUE(AttentionPlanner({.wave = kH100Wave}).plan(TokenStar(6000, 32).input(), plan).ok());
  EXPECT_EQ(plan.io.max_chunk_tokens, 320);
  // 1000 + 32: every B down to 64 would fit; the estimate stops at 192 (kWaveMinChunk).
  ASSERT_TRUE(AttentionPlanner({.wave = kH100Wave}).plan(TokenStar(1000, 32).input(), plan).ok());
  EXPECT_EQ(plan.io.max_chunk_tokens, 192);
  // A fixed B is kept whatever the wave; other plan kinds ignore it.
  ASSERT_TRUE(AttentionPlanner({.chunk_tokens = 512, .wave = kH100Wave})
                  .plan(TokenStar(6000, 64).input(), plan)
                  .ok());
  EXPECT_EQ(plan.io.max_chunk_tokens, 512);
  ASSERT_TRUE(AttentionPlanner({.kind = PlanKind::kDeftNodeChunk, .wave = kH100Wave})
                  .plan(TokenStar(6000, 64).input(), plan)
                  .ok());
  EXPECT_EQ(plan.io.max_chunk_tokens, 512);
  EXPECT_EQ(AttentionPlanner({.wave = {.ctas = -1}}).plan(job.input(), plan).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(AttentionPlanner, SeveralTreesInOneStepNumberRowsInOrder) {
  FewShot a(40, 2, 3), b(50, 3, 2);
  std::vector<TreeQueries> input = {{&a.tree, a.queries}, {&b.tree, b.queries}};
  AttentionPlan plan;
  ASSERT_TRUE(AttentionPlanner({.chunk_tokens = 16}).plan(input, plan).ok());
  EXPECT_EQ(plan.num_queries, 5);
  EXPECT_EQ(plan.io.kv_tokens_read, 46 + 56);
  for (int32_t t = 0; t < plan.num_tasks(); ++t) {
    // No task mixes rows of the two trees.
    bool first = false, second = false;
    for (int32_t e = plan.task_entry_begin[t]; e < plan.task_entry_begin[t + 1]; ++e) {
      (plan.entry_query[e] < 2 ? first : second) = true;
    }
    EXPECT_FALSE(first && second) << "task " << t;
  }
}

// A 300-token prompt with three leaves of 10; one step extends leaf 0 by 80 tokens (listed in
// order) and decodes one token of leaf 1 and 5 tokens of leaf 2: the extension becomes a prefill
// run over the prompt, leaf 0's first 10 tokens and itself; the short runs stay in tasks.
TEST(AttentionPlanner, LongRunsBecomePrefillRuns) {
  FewShot job(300, 3, 10);
  const NodeChildren leaves = job.tree.node(job.tree.root()).children;
  job.queries.clear();
  ASSERT_TRUE(job.tree.append(leaves[1], std::vector<TokenId>(1, 3)).ok());
  job.queries.push_back({leaves[1], 10});
  ASSERT_TRUE(job.tree.append(leaves[0], std::vector<TokenId>(80, 3)).ok());
  for (int32_t i = 0; i < 80; ++i) job.queries.push_back({leaves[0], 10 + i});
  ASSERT_TRUE(job.tree.append(leaves[2], std::vector<TokenId>(5, 3)).ok());
  for (int32_t i = 0; i < 5; ++i) job.queries.push_back({leaves[2], 10 + i});
  AttentionPlan plan;
  ASSERT_TRUE(AttentionPlanner({.chunk_tokens = 64, .min_prefill_run = 64})
                  .plan(job.input(), plan)
                  .ok());
  EXPECT_EQ(plan.num_queries, 86);
  ASSERT_EQ(plan.prefill_runs.size(), 1u);
  const kernels::PrefillRun& run = plan.prefill_runs[0];
  EXPECT_EQ(run.row_begin, 1);
  EXPECT_EQ(run.num_rows, 80);
  EXPECT_EQ(run.prefix_tokens, 310);
  // Its keys: the prompt's slots, then leaf 0's tokens [0, 90).
  const KvCacheManager& kv = job.kv;
  for (int32_t k = 0; k < 300; ++k) {
    ASSERT_EQ(plan.kv_slots[run.kv_begin + k], kv.slot(job.tree.kv_key(job.tree.root()), k));
  }
  for (int32_t k = 0; k < 90; ++k) {
    ASSERT_EQ(plan.kv_slots[run.kv_begin + 300 + k], kv.slot(job.tree.kv_key(leaves[0]), k));
  }
  // Its rows have no entries; every other row has some.
  for (int32_t q = 0; q < plan.num_queries; ++q) {
    const int32_t entries = plan.query_entry_begin[q + 1] - plan.query_entry_begin[q];
    if (q >= 1 && q < 81) {
      EXPECT_EQ(entries, 0) << "row " << q;
    } else {
      EXPECT_GT(entries, 0) << "row " << q;
    }
  }
  // The tasks read the prompt and leaves 1 and 2, not leaf 0.
  EXPECT_EQ(plan.io.kv_tokens_read - (run.prefix_tokens + run.num_rows), 300 + 11 + 15);
  EXPECT_EQ(AttentionPlanner({.min_prefill_run = -1}).plan(job.input(), plan).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace deft::engine
