// GPU tests of the DeFT attention kernels, KV write and RoPE against references on the CPU, on
// fresh random inputs (the seed is printed on failure). Each test skips itself when no CUDA
// device is visible, so ctest reports "Skipped" on machines without a GPU.
//
// Attention plans are built here from random trees by a small builder that follows the plan
// contract (kernels/attention_params.h) for the planner's kinds: Flatten (even chunks of the
// DFS-flattened tree), Node, Node-Chunk, sequence (each query reads its own path) and dense mask
// (one task over the whole tree). The reference is dense attention over exactly the tokens each
// query sees, in double, independent of the plan; outputs and scratch are poisoned with NaN
// before every run and the unused KV slots hold NaN, so a wrong gather or an unwritten output
// cannot pass.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/attention_params.h"
#include "kernels/cuda_check.h"
#include "kernels/deft_attention.h"
#include "kernels/device_buffer.h"
#include "kernels/kv_write.h"
#include "kernels/rope.h"
#include "tests/gpu/gpu_test_support.h"

namespace deft::kernels {
namespace {

// ---- trees and plans --------------------------------------------------------------------------

struct Node {
  int parent = -1;  // parents precede children
  int length = 0;
};

struct QueryToken {
  int node = 0;
  int token = 0;
};

struct Tree {
  std::vector<Node> nodes;
  std::vector<QueryToken> queries;
  // Derived by finish():
  std::vector<QueryToken> flat;                        // DFS order of every token
  std::vector<int> node_flat_begin;                    // first flat index of each node
  std::vector<int32_t> slot;                           // KV slot of each flat token
  std::vector<std::vector<bool>> is_ancestor_or_self;  // [a][b]: a is b or an ancestor of b
  int32_t num_slots = 0;

  bool sees(const QueryToken& q, const QueryToken& t) const {
    if (t.node == q.node) return t.token <= q.token;
    return is_ancestor_or_self[t.node][q.node];
  }

  // Flattens depth-first and places every node on its own random pages of 16 slots.
  void finish(std::mt19937& rng) {
    const int n = static_cast<int>(nodes.size());
    std::vector<std::vector<int>> children(n);
    for (int i = 1; i < n; ++i) children[nodes[i].parent].push_back(i);
    node_flat_begin.assign(n, 0);
    std::vector<int> stack = {0};
    while (!stack.empty()) {
      const int node = stack.back();
      stack.pop_back();
      node_flat_begin[node] = static_cast<int>(flat.size());
      for (int i = 0; i < nodes[node].length; ++i) flat.push_back({node, i});
      for (auto it = children[node].rbegin(); it != children[node].rend(); ++it) {
        stack.push_back(*it);
      }
    }
    is_ancestor_or_self.assign(n, std::vector<bool>(n, false));
    for (int b = 0; b < n; ++b) {
      for (int a = b; a >= 0; a = nodes[a].parent) is_ancestor_or_self[a][b] = true;
    }
    constexpr int kPageTokens = 16;
    std::vector<int> pages_needed(n);
    int total_pages = 0;
    for (int i = 0; i < n; ++i) {
      pages_needed[i] = (nodes[i].length + kPageTokens - 1) / kPageTokens;
      total_pages += pages_needed[i];
    }
    std::vector<int> pool(total_pages + total_pages / 2 + 1);
    std::iota(pool.begin(), pool.end(), 0);
    std::shuffle(pool.begin(), pool.end(), rng);
    num_slots = static_cast<int32_t>(pool.size()) * kPageTokens;
    std::vector<std::vector<int>> node_pages(n);
    int next = 0;
    for (int i = 0; i < n; ++i) {
      for (int p = 0; p < pages_needed[i]; ++p) node_pages[i].push_back(pool[next++]);
    }
    slot.resize(flat.size());
    for (size_t f = 0; f < flat.size(); ++f) {
      const QueryToken& t = flat[f];
      slot[f] = node_pages[t.node][t.token / kPageTokens] * kPageTokens + t.token % kPageTokens;
    }
  }
};

struct HostPlan {
  int32_t num_queries = 0;
  std::vector<int32_t> kv_slots, task_kv_begin, task_kv_end, task_entry_begin{0}, task_mask_begin,
      entry_query, query_entry_begin, query_entries;
  std::vector<uint64_t> mask_words;

  AttentionPlanView view() const {
    AttentionPlanView v;
    v.num_queries = num_queries;
    v.num_tasks = static_cast<int32_t>(task_kv_begin.size());
    v.num_entries = static_cast<int32_t>(entry_query.size());
    v.num_kv_indices = static_cast<int32_t>(kv_slots.size());
    v.num_mask_words = static_cast<int32_t>(mask_words.size());
    v.kv_slots = kv_slots.data();
    v.task_kv_begin = task_kv_begin.data();
    v.task_kv_end = task_kv_end.data();
    v.task_entry_begin = task_entry_begin.data();
    v.task_mask_begin = task_mask_begin.data();
    v.mask_words = mask_words.data();
    v.entry_query = entry_query.data();
    v.query_entry_begin = query_entry_begin.data();
    v.query_entries = query_entries.data();
    return v;
  }
};

enum class Kind { kFlatten, kNode, kNodeChunk, kSequence, kDenseMask };

// Adds the tasks of one KV run for the candidate queries: queries that see every token share
// unmasked tasks (up to `unmasked_cap` entries, the planner's default 256), the others masked
// tasks of up to 64 entries.
void add_run(const Tree& tree, const std::vector<int>& run, const std::vector<int>& candidates,
             HostPlan& plan, std::vector<std::vector<int32_t>>& entries_of_query,
             size_t unmasked_cap = 256) {
  std::vector<int> full, partial;
  for (int q : candidates) {
    int seen = 0;
    for (int f : run) seen += tree.sees(tree.queries[q], tree.flat[f]);
    if (seen == static_cast<int>(run.size())) {
      full.push_back(q);
    } else if (seen > 0) {
      partial.push_back(q);
    }
  }
  const auto emit = [&](const std::vector<int>& group, bool masked) {
    plan.task_kv_begin.push_back(static_cast<int32_t>(plan.kv_slots.size()));
    for (int f : run) plan.kv_slots.push_back(tree.slot[f]);
    plan.task_kv_end.push_back(static_cast<int32_t>(plan.kv_slots.size()));
    plan.task_mask_begin.push_back(masked ? static_cast<int32_t>(plan.mask_words.size()) : -1);
    if (masked) {
      for (int f : run) {
        uint64_t word = 0;
        for (size_t j = 0; j < group.size(); ++j) {
          if (tree.sees(tree.queries[group[j]], tree.flat[f])) word |= uint64_t{1} << j;
        }
        plan.mask_words.push_back(word);
      }
    }
    for (int q : group) {
      entries_of_query[q].push_back(static_cast<int32_t>(plan.entry_query.size()));
      plan.entry_query.push_back(q);
    }
    plan.task_entry_begin.push_back(static_cast<int32_t>(plan.entry_query.size()));
  };
  const auto split = [&](const std::vector<int>& queries, size_t cap, bool masked) {
    for (size_t i = 0; i < queries.size(); i += cap) {
      emit(std::vector<int>(queries.begin() + i,
                            queries.begin() + std::min(queries.size(), i + cap)),
           masked);
    }
  };
  split(full, unmasked_cap, false);
  split(partial, kMaskWordBits, true);
}

HostPlan build_plan(const Tree& tree, Kind kind, int chunk_tokens, size_t unmasked_cap = 256) {
  HostPlan plan;
  const int num_queries = static_cast<int>(tree.queries.size());
  plan.num_queries = num_queries;
  std::vector<std::vector<int32_t>> entries_of_query(num_queries);
  std::vector<int> all(num_queries);
  std::iota(all.begin(), all.end(), 0);
  const auto range = [](int begin, int end) {
    std::vector<int> r(end - begin);
    std::iota(r.begin(), r.end(), begin);
    return r;
  };
  const int flat_tokens = static_cast<int>(tree.flat.size());
  switch (kind) {
    case Kind::kFlatten:
    case Kind::kDenseMask: {
      const int chunk = kind == Kind::kDenseMask ? flat_tokens : chunk_tokens;
      for (int begin = 0; begin < flat_tokens; begin += chunk) {
        add_run(tree, range(begin, std::min(flat_tokens, begin + chunk)), all, plan,
                entries_of_query);
      }
      break;
    }
    case Kind::kNode:
    case Kind::kNodeChunk:
      for (size_t node = 0; node < tree.nodes.size(); ++node) {
        const int begin = tree.node_flat_begin[node];
        const int end = begin + tree.nodes[node].length;
        const int chunk = kind == Kind::kNode ? end - begin : chunk_tokens;
        for (int b = begin; b < end; b += chunk) {
          add_run(tree, range(b, std::min(end, b + chunk)), all, plan, entries_of_query,
                  unmasked_cap);
        }
      }
      break;
    case Kind::kSequence:
      for (int q = 0; q < num_queries; ++q) {
        std::vector<int> path;
        for (int f = 0; f < flat_tokens; ++f) {
          if (tree.sees(tree.queries[q], tree.flat[f])) path.push_back(f);
        }
        for (size_t b = 0; b < path.size(); b += chunk_tokens) {
          add_run(tree,
                  std::vector<int>(path.begin() + b,
                                   path.begin() + std::min(path.size(), b + chunk_tokens)),
                  {q}, plan, entries_of_query);
        }
      }
      break;
  }
  plan.query_entry_begin.push_back(0);
  for (int q = 0; q < num_queries; ++q) {
    for (int32_t e : entries_of_query[q]) plan.query_entries.push_back(e);
    plan.query_entry_begin.push_back(static_cast<int32_t>(plan.query_entries.size()));
  }
  return plan;
}

// ---- trees of the test scenarios --------------------------------------------------------------

// A prompt node with `branches` children of `suffix` tokens; the queries are the last tokens.
Tree few_shot_tree(int prompt, int branches, int suffix) {
  Tree tree;
  tree.nodes.push_back({-1, prompt});
  for (int b = 0; b < branches; ++b) {
    tree.nodes.push_back({0, suffix});
    tree.queries.push_back({b + 1, suffix - 1});
  }
  return tree;
}

// A prefix node and a random token tree of `tree_tokens` one-token nodes hung under it; every
// token-tree token is a query (speculative verification).
Tree token_tree(int prefix, int tree_tokens, std::mt19937& rng) {
  Tree tree;
  tree.nodes.push_back({-1, prefix});
  for (int i = 0; i < tree_tokens; ++i) {
    const int parent = i == 0 ? 0 : 1 + static_cast<int>(rng() % i);
    tree.nodes.push_back({parent, 1});
    tree.queries.push_back({i + 1, 0});
  }
  return tree;
}

// A random tree of one-token nodes under a short root; the queries are the leaves.
Tree one_token_nodes(int root, int count, std::mt19937& rng) {
  Tree tree;
  tree.nodes.push_back({-1, root});
  std::vector<bool> has_child(count + 1, false);
  for (int i = 1; i <= count; ++i) {
    // Bias towards recent nodes so the tree is deep as well as wide.
    const int lo = std::max(0, i - 8);
    const int parent = lo + static_cast<int>(rng() % (i - lo));
    tree.nodes.push_back({parent, 1});
    has_child[parent] = true;
  }
  for (int i = 1; i <= count; ++i) {
    if (!has_child[i]) tree.queries.push_back({i, 0});
  }
  return tree;
}

// Reasoning: root, children, grandchildren; queries are the last tokens of the leaves.
Tree reasoning_tree(int root, int children, int child_len, int grandchildren, int leaf_len) {
  Tree tree;
  tree.nodes.push_back({-1, root});
  for (int c = 0; c < children; ++c) {
    const int child = static_cast<int>(tree.nodes.size());
    tree.nodes.push_back({0, child_len});
    for (int g = 0; g < grandchildren; ++g) {
      tree.queries.push_back({static_cast<int>(tree.nodes.size()), leaf_len - 1});
      tree.nodes.push_back({child, leaf_len});
    }
  }
  return tree;
}

// Prefill / extend: a root and one child of `length` tokens that are all queries (causal).
Tree prefill_tree(int root, int length) {
  Tree tree;
  tree.nodes.push_back({-1, root});
  tree.nodes.push_back({0, length});
  for (int i = 0; i < length; ++i) tree.queries.push_back({1, i});
  return tree;
}

// ---- the attention check ----------------------------------------------------------------------

struct Config {
  DType dtype;
  int head_dim;
  int group_size;
};

std::string config_name(const testing::TestParamInfo<Config>& info) {
  return std::string(dtype_name(info.param.dtype)) + "_d" + std::to_string(info.param.head_dim) +
         "_g" + std::to_string(info.param.group_size);
}

constexpr int kNumKvHeads = 2;

AttentionDims dims_of(const Config& config) {
  AttentionDims dims;
  dims.num_kv_heads = kNumKvHeads;
  dims.num_q_heads = kNumKvHeads * config.group_size;
  dims.head_dim = config.head_dim;
  dims.softmax_scale = 1.0f / std::sqrt(static_cast<float>(config.head_dim));
  return dims;
}

// Dense reference: per query and head, softmax over exactly the tokens the query sees.
std::vector<double> reference_attention(const Tree& tree, const AttentionDims& dims,
                                        const std::vector<float>& q, const std::vector<float>& k,
                                        const std::vector<float>& v) {
  const int num_queries = static_cast<int>(tree.queries.size());
  const int d = dims.head_dim;
  std::vector<double> out(static_cast<size_t>(num_queries) * dims.num_q_heads * d, 0.0);
  std::vector<int> visible;
  std::vector<double> scores;
  for (int qi = 0; qi < num_queries; ++qi) {
    visible.clear();
    for (size_t f = 0; f < tree.flat.size(); ++f) {
      if (tree.sees(tree.queries[qi], tree.flat[f])) visible.push_back(tree.slot[f]);
    }
    for (int h = 0; h < dims.num_q_heads; ++h) {
      const int kv_head = h / dims.group_size();
      const float* qrow = &q[(static_cast<size_t>(qi) * dims.num_q_heads + h) * d];
      scores.assign(visible.size(), 0.0);
      double max_score = -1e300;
      for (size_t j = 0; j < visible.size(); ++j) {
        const float* krow = &k[(static_cast<size_t>(visible[j]) * dims.num_kv_heads + kv_head) * d];
        double dot = 0.0;
        for (int x = 0; x < d; ++x) dot += static_cast<double>(qrow[x]) * krow[x];
        scores[j] = dot * dims.softmax_scale;
        max_score = std::max(max_score, scores[j]);
      }
      double denom = 0.0;
      for (double& s : scores) {
        s = std::exp(s - max_score);
        denom += s;
      }
      double* orow = &out[(static_cast<size_t>(qi) * dims.num_q_heads + h) * d];
      for (size_t j = 0; j < visible.size(); ++j) {
        const float* vrow = &v[(static_cast<size_t>(visible[j]) * dims.num_kv_heads + kv_head) * d];
        const double w = scores[j] / denom;
        for (int x = 0; x < d; ++x) orow[x] += w * vrow[x];
      }
    }
  }
  return out;
}

// Random Q and KV cache for `tree` (unused slots hold NaN), the GPU run of `plan`, and the
// comparison with the dense reference. `use_graph` captures the launches in a CUDA graph.
// `key_growth` > 0 scales the key of the token at flat position f by 1 + f * key_growth, so that
// a query's maximum score keeps climbing along the tree.
// `prefetch`: stage 2's extra CTAs pull those weights into L2 (they must change nothing else).
Comparison run_and_compare(const Tree& tree, const HostPlan& plan, const Config& config,
                           std::mt19937& rng, bool use_graph = false, float key_growth = 0.0f,
                           int32_t stage2_batch = 0, const WeightPrefetch& prefetch = {}) {
  const AttentionDims dims = dims_of(config);
  const DType dtype = config.dtype;
  const size_t q_count = tree.queries.size() * dims.num_q_heads * dims.head_dim;
  const size_t kv_row = static_cast<size_t>(dims.num_kv_heads) * dims.head_dim;
  const size_t kv_count = static_cast<size_t>(tree.num_slots) * kv_row;
  const Tensor16 q = random_tensor(q_count, dtype, rng);
  Tensor16 k = random_tensor(kv_count, dtype, rng);
  Tensor16 v = random_tensor(kv_count, dtype, rng);
  for (size_t f = 0; key_growth > 0.0f && f < tree.flat.size(); ++f) {
    const float factor = 1.0f + static_cast<float>(f) * key_growth;
    for (size_t i = tree.slot[f] * kv_row; i < (tree.slot[f] + 1) * kv_row; ++i) {
      k.bits[i] = to_bits(k.values[i] * factor, dtype);
      k.values[i] = from_bits(k.bits[i], dtype);
    }
  }
  std::vector<bool> used(tree.num_slots, false);
  for (int32_t s : tree.slot) used[s] = true;
  for (int32_t s = 0; s < tree.num_slots; ++s) {
    if (used[s]) continue;
    std::fill_n(k.bits.begin() + s * kv_row, kv_row, nan_bits(dtype));
    std::fill_n(v.bits.begin() + s * kv_row, kv_row, nan_bits(dtype));
  }

  const DeviceBuffer q_dev = to_device(q.bits);
  const DeviceBuffer k_dev = to_device(k.bits);
  const DeviceBuffer v_dev = to_device(v.bits);
  DeviceBuffer out_dev(q_count * 2);
  DeftAttentionBuffers buffers;
  buffers.reserve(static_cast<int32_t>(plan.entry_query.size()), dims);
  // Poison: 0xff bytes are NaN in fp32, bf16 and fp16.
  DEFT_CUDA_CHECK(cudaMemset(out_dev.data(), 0xff, q_count * 2));
  DEFT_CUDA_CHECK(cudaMemset(buffers.partial_out(), 0xff, buffers.partial_out_bytes()));
  DEFT_CUDA_CHECK(cudaMemset(buffers.partial_lse(), 0xff, buffers.partial_lse_bytes()));

  cudaStream_t stream;
  DEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  DevicePlan device_plan;
  // The plan rides behind other step inputs (DevicePlan::upload's extra), of an odd size here:
  // the kernels must see the same plan, and the extra bytes arrive unchanged.
  std::vector<unsigned char> extra(1 + rng() % 300);
  for (unsigned char& byte : extra) byte = static_cast<unsigned char>(rng());
  device_plan.upload(plan.view(), dims, stream, extra);
  if (use_graph) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    DEFT_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    launch_deft_attention(device_plan.view(), device_plan.shape(), dims, dtype, q_dev.data(),
                          k_dev.data(), v_dev.data(), buffers.partial_out(), buffers.partial_lse(),
                          out_dev.data(), stream, DeftStage2::kIfMerging, stage2_batch, prefetch);
    DEFT_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    DEFT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    // Output poisoned before each replay: the second one must write every row again.
    for (int replay = 0; replay < 2; ++replay) {
      DEFT_CUDA_CHECK(cudaMemsetAsync(out_dev.data(), 0xff, q_count * 2, stream));
      DEFT_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    }
    DEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    DEFT_CUDA_CHECK(cudaGraphExecDestroy(exec));
    DEFT_CUDA_CHECK(cudaGraphDestroy(graph));
  } else {
    launch_deft_attention(device_plan.view(), device_plan.shape(), dims, dtype, q_dev.data(),
                          k_dev.data(), v_dev.data(), buffers.partial_out(), buffers.partial_lse(),
                          out_dev.data(), stream, DeftStage2::kIfMerging, stage2_batch, prefetch);
  }
  DEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
  DEFT_CUDA_CHECK(cudaGetLastError());
  DEFT_CUDA_CHECK(cudaStreamDestroy(stream));
  std::vector<unsigned char> extra_back(extra.size());
  DEFT_CUDA_CHECK(
      cudaMemcpy(extra_back.data(), device_plan.extra(), extra.size(), cudaMemcpyDeviceToHost));
  EXPECT_EQ(extra_back, extra) << "the plan's extra bytes";

  const std::vector<uint16_t> out_bits = to_host<uint16_t>(out_dev, q_count);
  std::vector<float> out(q_count);
  for (size_t i = 0; i < q_count; ++i) out[i] = from_bits(out_bits[i], dtype);
  return compare(out, reference_attention(tree, dims, q.values, k.values, v.values));
}

class DeftAttentionGpuTest : public testing::TestWithParam<Config> {
 protected:
  void SetUp() override {
    DEFT_SKIP_WITHOUT_GPU();
    seed_ = fresh_seed();
    rng_.seed(seed_);
  }

  void check(const Tree& tree, Kind kind, int chunk_tokens, const char* what,
             bool use_graph = false, size_t unmasked_cap = 256, float key_growth = 0.0f,
             int32_t stage2_batch = 0, const WeightPrefetch& prefetch = {}) {
    SCOPED_TRACE(testing::Message() << what << " seed=" << seed_);
    const HostPlan plan = build_plan(tree, kind, chunk_tokens, unmasked_cap);
    const Comparison c = run_and_compare(tree, plan, GetParam(), rng_, use_graph, key_growth,
                                         stage2_batch, prefetch);
    EXPECT_EQ(c.nan_count, 0);
    EXPECT_LE(c.relative_error, tolerance(GetParam().dtype));
    std::printf("  %-34s tasks %5zu entries %5zu  rel err %.2e\n", what, plan.task_kv_begin.size(),
                plan.entry_query.size(), c.relative_error);
  }

  Tree finished(Tree tree) {
    tree.finish(rng_);
    return tree;
  }

  uint32_t seed_ = 0;
  std::mt19937 rng_;
};

TEST_P(DeftAttentionGpuTest, OneTokenNodes) {
  const Tree tree = finished(one_token_nodes(40, 160, rng_));
  check(tree, Kind::kFlatten, 32, "flatten B=32");
  check(tree, Kind::kNode, 0, "node");
}

TEST_P(DeftAttentionGpuTest, SingleQuery) {
  Tree chain;
  chain.nodes.push_back({-1, 700});
  chain.queries.push_back({0, 699});
  const Tree tree = finished(chain);
  check(tree, Kind::kFlatten, 128, "flatten B=128");
  check(tree, Kind::kNode, 0, "node (one 700-token run)");
}

TEST_P(DeftAttentionGpuTest, TokenTree256) {
  const Tree tree = finished(token_tree(300, 256, rng_));
  check(tree, Kind::kFlatten, 64, "flatten B=64");
  check(tree, Kind::kDenseMask, 0, "dense mask (skipped tiles)");
}

TEST_P(DeftAttentionGpuTest, FewShotLongRuns) {
  const Tree tree = finished(few_shot_tree(600, 40, 30));
  check(tree, Kind::kNode, 0, "node (600-token run, 40 queries)");
  check(tree, Kind::kFlatten, 100, "flatten B=100");
}

// One task over a shared 200-token prefix (a tail tile included) for every class of pass: 64-row
// passes on warpgroup MMAs with 1 to 4 warps holding rows, and short last passes on mma.sync.
TEST_P(DeftAttentionGpuTest, EveryPassRowCount) {
  const int group = GetParam().group_size;
  for (int rows : {16, 40, 56, 64, 80, 136, 200, 264}) {
    const int queries = std::max(1, rows / group);
    const Tree tree = finished(few_shot_tree(200, queries, 5));
    const std::string what = "node, " + std::to_string(queries * group) + " rows";
    check(tree, Kind::kNode, 0, what.c_str());
  }
}

// Masked tasks whose first tokens every row of a pass sees (a shared prefix, then each query's
// own suffix): those steps skip the per-element mask tests, the rest keep them. The prefix ends
// inside an 8-token block, at a block edge, mid-tile and at a tile edge, for every class of pass.
TEST_P(DeftAttentionGpuTest, MaskedTasksWithASharedLead) {
  const int group = GetParam().group_size;
  for (int prefix : {1, 203, 96, 128}) {
    for (int rows : {16, 40, 64, 136, 256}) {
      const int queries = std::max(1, rows / group);
      const Tree tree = finished(few_shot_tree(prefix, queries, 37));
      const std::string what = "dense mask, prefix " + std::to_string(prefix) + ", " +
                               std::to_string(queries) + " queries";
      check(tree, Kind::kDenseMask, 0, what.c_str());
    }
  }
}

// One task wider than the launch's row slices (an unmasked cap above the planner's default):
// each CTA runs several passes one after another in the same shared memory.
TEST_P(DeftAttentionGpuTest, MorePassesThanRowSlices) {
  const int queries = 2320 / GetParam().group_size;  // 37 passes: 36 of 64 rows, one of 16
  const Tree tree = finished(few_shot_tree(200, queries, 5));
  check(tree, Kind::kNode, 0, "node, 2320 rows in one task", /*use_graph=*/false,
        /*unmasked_cap=*/static_cast<size_t>(queries));
}

// Keys grow along the tree (x(1 + f / 32) at flat position f), so a row's maximum score climbs
// by more than the lazy rescale's slack (2^8) again and again within a task: the O rescale runs
// mid-task on 64-row wgmma passes, mma.sync passes and the few-row passes that split tiles.
TEST_P(DeftAttentionGpuTest, GrowingScores) {
  constexpr float kGrowth = 1.0f / 32;
  const Tree shared = finished(few_shot_tree(600, 40, 30));
  check(shared, Kind::kNode, 0, "node, growing keys", false, 256, kGrowth);
  check(shared, Kind::kFlatten, 100, "flatten B=100, growing keys", false, 256, kGrowth);
  Tree chain;
  chain.nodes.push_back({-1, 630});
  chain.queries.push_back({0, 629});
  const Tree single = finished(chain);
  check(single, Kind::kFlatten, 256, "one query, growing keys", false, 256, kGrowth);
}

// Stage 2 merges a query's partials 32 at a time, their O rows in batches of 32, 16 or 8 (each
// forced here): exactly 32, 33 and 70 partials (one query down a chain), and 63-64 for each of
// 6 queries over a shared prompt.
TEST_P(DeftAttentionGpuTest, ManyPartials) {
  for (int32_t batch : {32, 16, 8}) {
    for (int tokens : {1024, 1056, 2240}) {
      Tree chain;
      chain.nodes.push_back({-1, tokens});
      chain.queries.push_back({0, tokens - 1});
      const std::string what = "flatten B=32, one query over " + std::to_string(tokens) +
                               " tokens, stage-2 batch " + std::to_string(batch);
      check(finished(chain), Kind::kFlatten, 32, what.c_str(), false, 256, 0.0f, batch);
    }
    const Tree shared = finished(few_shot_tree(2000, 6, 40));
    const std::string what =
        "flatten B=32, 6 queries over a 2000-token prompt, stage-2 batch " + std::to_string(batch);
    check(shared, Kind::kFlatten, 32, what.c_str(), false, 256, 0.0f, batch);
  }
}

// Stage 2 with a weight prefetch (the O projection's, in a decode step): its extra CTAs wait for
// stage 1 and only touch L2, so every output row is still written and right, eagerly and in a
// graph, for prefetches of one line a row up to more lines than the grid has threads.
TEST_P(DeftAttentionGpuTest, Stage2WeightPrefetch) {
  constexpr int64_t kRows = 1000, kRowBytes = 4096;
  DeviceBuffer weights(kRows * kRowBytes);
  const Tree shared = finished(few_shot_tree(1000, 6, 40));
  for (int32_t bytes_per_row : {128, 1000, 4096}) {
    const WeightPrefetch prefetch{.base = weights.data(),
                                  .rows = kRows,
                                  .row_bytes = kRowBytes,
                                  .bytes_per_row = bytes_per_row};
    const std::string what = "flatten B=64, prefetch " + std::to_string(bytes_per_row) + " B a row";
    check(shared, Kind::kFlatten, 64, what.c_str(), false, 256, 0.0f, 0, prefetch);
    check(shared, Kind::kFlatten, 64, (what + ", graph").c_str(), true, 256, 0.0f, 0, prefetch);
  }
}

TEST_P(DeftAttentionGpuTest, PrefillCausal) {
  const Tree tree = finished(prefill_tree(50, 200));
  check(tree, Kind::kFlatten, 128, "flatten B=128");
}

TEST_P(DeftAttentionGpuTest, ReasoningTree) {
  const Tree tree = finished(reasoning_tree(120, 5, 40, 3, 20));
  check(tree, Kind::kNodeChunk, 32, "node-chunk B=32");
  check(tree, Kind::kSequence, 96, "sequence B=96");
}

// Stage 1 on warpgroup MMAs only (deft_attention_wgmma_passes), with tasks of 63 entries whose
// last passes hold 63, 62, 60 and 56 rows at groups 1, 2, 4 and 8, as in speculative decoding,
// where the tree's root query sees only itself (63 queries on tokens 576-638 of a 640-token
// chain; the last token, seen by none, keeps every query of the last piece in its masked task);
// also with lazily rescaled, growing scores and in a graph. (Passes of 4-48 rows on that kernel:
// EveryPassRowCount, FewShotLongRuns.)
TEST_P(DeftAttentionGpuTest, WgmmaPassesKernel) {
  Tree chain;
  chain.nodes.push_back({-1, 640});
  for (int t = 576; t < 639; ++t) chain.queries.push_back({0, t});
  const Tree tree = finished(chain);
  const HostPlan plan = build_plan(tree, Kind::kFlatten, 128);
  ASSERT_TRUE(deft_attention_wgmma_passes(plan_shape(plan.view()), dims_of(GetParam())));
  check(tree, Kind::kFlatten, 128, "flatten B=128, wgmma passes");
  check(tree, Kind::kFlatten, 128, "flatten B=128, wgmma passes, growing keys", false, 256,
        1.0f / 32);
  check(tree, Kind::kFlatten, 128, "flatten B=128, wgmma passes, graph", /*use_graph=*/true);
}

TEST_P(DeftAttentionGpuTest, CudaGraphReplay) {
  const Tree tree = finished(token_tree(100, 64, rng_));
  check(tree, Kind::kFlatten, 64, "flatten B=64, graph", /*use_graph=*/true);
}

INSTANTIATE_TEST_SUITE_P(Configs, DeftAttentionGpuTest,
                         testing::Values(Config{DType::kBf16, 128, 1}, Config{DType::kBf16, 128, 2},
                                         Config{DType::kBf16, 128, 4}, Config{DType::kBf16, 128, 8},
                                         Config{DType::kBf16, 64, 1}, Config{DType::kBf16, 64, 4},
                                         Config{DType::kBf16, 64, 8}, Config{DType::kFp16, 128, 1},
                                         Config{DType::kFp16, 128, 4}, Config{DType::kFp16, 128, 8},
                                         Config{DType::kFp16, 64, 2}, Config{DType::kFp16, 64, 4},
                                         Config{DType::kFp16, 64, 8}),
                         config_name);

// ---- KV write and RoPE ------------------------------------------------------------------------

class SmallKernelsGpuTest : public testing::TestWithParam<DType> {
 protected:
  void SetUp() override {
    DEFT_SKIP_WITHOUT_GPU();
    seed_ = fresh_seed();
    rng_.seed(seed_);
  }
  uint32_t seed_ = 0;
  std::mt19937 rng_;
};

TEST_P(SmallKernelsGpuTest, KvWriteMatchesCpu) {
  SCOPED_TRACE(testing::Message() << "seed=" << seed_);
  const DType dtype = GetParam();
  KvWriteDims dims;
  dims.num_tokens = 77;
  dims.num_kv_heads = 8;
  dims.head_dim = 128;
  const int q_heads = 32;
  // K and V as slices of a fused QKV row: stride (q + 2 kv heads) * head_dim.
  dims.new_token_stride = int64_t{q_heads + 2 * dims.num_kv_heads} * dims.head_dim;
  const int32_t num_slots = 300;
  const size_t row = static_cast<size_t>(dims.num_kv_heads) * dims.head_dim;
  const Tensor16 qkv = random_tensor(dims.num_tokens * dims.new_token_stride, dtype, rng_);
  Tensor16 k_cache = random_tensor(num_slots * row, dtype, rng_);
  Tensor16 v_cache = random_tensor(num_slots * row, dtype, rng_);
  std::vector<int32_t> slots(num_slots);
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), rng_);
  slots.resize(dims.num_tokens);
  slots[5] = -1;  // a padding token

  const DeviceBuffer qkv_dev = to_device(qkv.bits);
  const DeviceBuffer k_dev = to_device(k_cache.bits);
  const DeviceBuffer v_dev = to_device(v_cache.bits);
  const DeviceBuffer slots_dev = to_device(slots);
  const size_t k_offset = static_cast<size_t>(q_heads) * dims.head_dim;
  const size_t v_offset = k_offset + row;
  launch_kv_write(dims, dtype, slots_dev.as<int32_t>(), qkv_dev.as<uint16_t>() + k_offset,
                  qkv_dev.as<uint16_t>() + v_offset, k_dev.data(), v_dev.data(), nullptr);
  DEFT_CUDA_CHECK(cudaDeviceSynchronize());

  kv_write_cpu(dims, slots.data(), qkv.values.data() + k_offset, qkv.values.data() + v_offset,
               k_cache.values.data(), v_cache.values.data());
  const std::vector<uint16_t> k_out = to_host<uint16_t>(k_dev, num_slots * row);
  const std::vector<uint16_t> v_out = to_host<uint16_t>(v_dev, num_slots * row);
  int64_t mismatches = 0;
  for (size_t i = 0; i < k_out.size(); ++i) {
    mismatches += from_bits(k_out[i], dtype) != k_cache.values[i];
    mismatches += from_bits(v_out[i], dtype) != v_cache.values[i];
  }
  EXPECT_EQ(mismatches, 0);
}

TEST_P(SmallKernelsGpuTest, RopeMatchesCpu) {
  SCOPED_TRACE(testing::Message() << "seed=" << seed_);
  const DType dtype = GetParam();
  for (const int head_dim : {64, 128}) {
    RopeDims dims;
    dims.num_tokens = 53;
    dims.num_q_heads = 8;
    dims.num_kv_heads = 2;
    dims.head_dim = head_dim;
    // q and k as slices of a fused QKV row.
    const int64_t stride = int64_t{dims.num_q_heads + 2 * dims.num_kv_heads} * head_dim;
    dims.q_token_stride = stride;
    dims.k_token_stride = stride;
    Tensor16 qkv = random_tensor(dims.num_tokens * stride, dtype, rng_);
    std::vector<int32_t> positions(dims.num_tokens);
    std::uniform_int_distribution<int32_t> position(0, 131071);
    for (int32_t& p : positions) p = position(rng_);
    positions[0] = 0;
    std::vector<float> inv_freq(head_dim / 2);
    for (int i = 0; i < head_dim / 2; ++i) {
      inv_freq[i] = 1.0f / std::pow(500000.0f, 2.0f * i / head_dim);
    }
    const DeviceBuffer qkv_dev = to_device(qkv.bits);
    const DeviceBuffer positions_dev = to_device(positions);
    const DeviceBuffer inv_freq_dev = to_device(inv_freq);
    const size_t k_offset = static_cast<size_t>(dims.num_q_heads) * head_dim;
    launch_rope(dims, dtype, positions_dev.as<int32_t>(), inv_freq_dev.as<float>(), qkv_dev.data(),
                qkv_dev.as<uint16_t>() + k_offset, nullptr);
    DEFT_CUDA_CHECK(cudaDeviceSynchronize());
    rope_cpu(dims, positions.data(), inv_freq.data(), qkv.values.data(),
             qkv.values.data() + k_offset);

    const std::vector<uint16_t> out_bits = to_host<uint16_t>(qkv_dev, qkv.bits.size());
    std::vector<float> out(out_bits.size());
    for (size_t i = 0; i < out.size(); ++i) out[i] = from_bits(out_bits[i], dtype);
    const Comparison c = compare(out, std::vector<double>(qkv.values.begin(), qkv.values.end()));
    EXPECT_EQ(c.nan_count, 0);
    // One rounding of fp32 results: far under the attention tolerances.
    EXPECT_LE(c.relative_error, dtype == DType::kBf16 ? 5e-3 : 1e-3) << "head_dim " << head_dim;
    std::printf("  rope %s d%d rel err %.2e\n", std::string(dtype_name(dtype)).c_str(), head_dim,
                c.relative_error);
  }
}

INSTANTIATE_TEST_SUITE_P(DTypes, SmallKernelsGpuTest, testing::Values(DType::kBf16, DType::kFp16),
                         [](const testing::TestParamInfo<DType>& info) {
                           return std::string(dtype_name(info.param));
                         });

// Host code only (runs without a GPU): a plan's shape, and a hand-built prefill-only view that
// leaves the entry arrays null (DevicePlan::upload computed its shape from them and crashed).
TEST(PlanShape, LargestTaskAndQueryAndNullEntryArrays) {
  const int32_t task_entry_begin[] = {0, 3, 4, 9};
  const int32_t query_entry_begin[] = {0, 1, 1, 6, 9};
  AttentionPlanView plan;
  plan.num_tasks = 3;
  plan.num_queries = 4;
  plan.task_entry_begin = task_entry_begin;
  plan.query_entry_begin = query_entry_begin;
  PlanShape shape = plan_shape(plan);
  EXPECT_EQ(shape.max_task_entries, 5);
  EXPECT_EQ(shape.max_query_entries, 5);
  AttentionPlanView prefill_only;
  prefill_only.num_queries = 113;
  shape = plan_shape(prefill_only);
  EXPECT_EQ(shape.max_task_entries, 0);
  EXPECT_EQ(shape.max_query_entries, 0);
}

// Host code only: stage 1 runs every pass on warpgroup MMAs unless the plan's largest task holds
// at most 16 rows (entries x group).
TEST(PlanShape, WgmmaPassesUnlessEveryTaskHoldsAtMost16Rows) {
  AttentionDims dims;
  dims.head_dim = 128;
  dims.num_kv_heads = 8;
  const auto wgmma = [&](int32_t max_task_entries, int group) {
    dims.num_q_heads = dims.num_kv_heads * group;
    return deft_attention_wgmma_passes(PlanShape{.max_task_entries = max_task_entries}, dims);
  };
  EXPECT_FALSE(wgmma(0, 4));
  EXPECT_FALSE(wgmma(1, 4));  // the sequence baseline: a query a task
  EXPECT_FALSE(wgmma(4, 4));  // 16 rows
  EXPECT_TRUE(wgmma(5, 4));   // 20 rows
  EXPECT_FALSE(wgmma(16, 1));
  EXPECT_TRUE(wgmma(17, 1));
  EXPECT_TRUE(wgmma(3, 8));   // 24 rows
  EXPECT_TRUE(wgmma(20, 4));  // few-shot's shared prompt
}

// The stage-2 batch a graph step keys on (deft_attention_stage2_batch): the smallest batch that
// takes the plan's largest query in one trip among those whose grid fits on the GPU at once,
// else the largest that fits; the same for both dtypes and head sizes. 16 queries (128 CTAs) fit
// with every batch; with more queries the 32 batch (more registers) may not, so there only the
// order is checked.
TEST(DeftAttentionStage2Batch, SmallestBatchHoldingTheLargestQuery) {
  DEFT_SKIP_WITHOUT_GPU();
  AttentionDims dims;
  dims.num_q_heads = 32;
  dims.num_kv_heads = 8;
  for (const int head_dim : {64, 128}) {
    dims.head_dim = head_dim;
    dims.softmax_scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
    for (const DType dtype : {DType::kBf16, DType::kFp16}) {
      SCOPED_TRACE(::testing::Message()
                   << "head_dim " << head_dim << " dtype " << static_cast<int>(dtype));
      const auto batch = [&](int32_t max_query_entries, int32_t queries) {
        return deft_attention_stage2_batch(PlanShape{.max_query_entries = max_query_entries},
                                           queries, dims, dtype);
      };
      EXPECT_EQ(batch(1, 16), 8);
      EXPECT_EQ(batch(8, 16), 8);
      EXPECT_EQ(batch(9, 16), 16);
      EXPECT_EQ(batch(16, 16), 16);
      EXPECT_EQ(batch(17, 16), 32);
      EXPECT_EQ(batch(300, 16), 32);
      for (const int32_t queries : {64, 256, 4096}) {
        int32_t last = 0;
        for (const int32_t partials : {1, 8, 9, 16, 17, 300}) {
          const int32_t b = batch(partials, queries);
          EXPECT_TRUE(b == 8 || b == 16 || b == 32) << b;
          EXPECT_GE(b, last) << partials << " partials, " << queries << " queries";
          last = b;
        }
      }
    }
  }
}

}  // namespace
}  // namespace deft::kernels
