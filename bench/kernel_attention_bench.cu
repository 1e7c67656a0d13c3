// One attention layer (Llama-3-8B shapes: 32 query heads, 8 KV heads, head_dim 128, bf16) on the
// DeFT paper's snapshots, for every plan kind of engine/attention_planner.h and a sweep of the
// Flatten chunk size B. Kernel time = both stages, CUDA events around replays of a CUDA graph of 20
// launches, median after warm-up, KV and Q rotated over copies larger than L2. Each method's output
// is checked against a float64 dense reference on sampled queries; a row that fails the check is
// not written. Each snapshot also gets a `kv_read_reference` row: not attention, one launch that
// only reads the tree's K and V bytes, the time a kernel needs just to stream the floor's bytes.
//
//   kernel_attention_bench [--workloads DIR] [--out DIR] [--reps N] [--case NAME] [--method NAME]
// Writes <out>/kernel_attention-<gpu>-<date>.json (../shared/BENCH_RESULTS.md).
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "bench/bench_result.h"
#include "bench/device_read_bandwidth.h"
#include "bench/graph_timing.h"
#include "bench/workload_trace.h"
#include "engine/attention_planner.h"
#include "engine/kv_cache_manager.h"
#include "engine/sequence_tree.h"
#include "kernels/cuda_check.h"
#include "kernels/deft_attention.h"
#include "kernels/deft_schedule.h"
#include "kernels/device_buffer.h"

namespace deft::bench {
namespace {

using engine::AttentionPlan;
using engine::AttentionPlanner;
using engine::KvCacheManager;
using engine::NodeId;
using engine::PlanKind;
using engine::QueryToken;
using engine::SequenceTree;
using engine::TokenId;
using kernels::DeviceBuffer;

constexpr int kNumQHeads = 32;
constexpr int kNumKvHeads = 8;
constexpr int kHeadDim = 128;
constexpr int kElemBytes = 2;                // bf16
constexpr size_t kRotateBytes = 200u << 20;  // > 4x the H100's 50 MB L2

struct Snapshot {
  std::string name;
  std::unique_ptr<KvCacheManager> kv;
  std::unique_ptr<SequenceTree> tree;
  std::vector<QueryToken> queries;
};

Snapshot new_snapshot(std::string name, int64_t tokens) {
  Snapshot s;
  s.name = std::move(name);
  s.kv = std::make_unique<KvCacheManager>(
      // Slack for the pages of one-token nodes (a node owns whole pages).
      engine::KvCacheConfig{.num_pages = static_cast<int32_t>(tokens / 16 + 600)});
  s.tree = std::make_unique<SequenceTree>(0, s.kv.get());
  return s;
}

void must(const absl::Status& status) {
  if (!status.ok()) {
    std::fprintf(stderr, "%s\n", status.ToString().c_str());
    std::exit(1);
  }
}

Snapshot fewshot(int prompt, int branches, int suffix) {
  Snapshot s = new_snapshot("fewshot_p" + std::to_string(prompt) + "_b" + std::to_string(branches) +
                                "_s" + std::to_string(suffix),
                            prompt + int64_t{branches} * suffix);
  must(s.tree->append(0, std::vector<TokenId>(prompt, 1)));
  const std::vector<NodeId> leaves = s.tree->branch(0, branches).value();
  for (NodeId leaf : leaves) {
    must(s.tree->append(leaf, std::vector<TokenId>(suffix, 2)));
    s.queries.push_back({leaf, suffix - 1});
  }
  return s;
}

Snapshot specdec(int prefix, const SpecDecTrace& trace) {
  Snapshot s =
      new_snapshot("specdec_p" + std::to_string(prefix) + "_t" + std::to_string(trace.tree_size()),
                   prefix + trace.tree_size());
  SpecDecReplay replay(trace, *s.tree, prefix);
  replay.build_token_tree(s.queries);
  must(replay.status());
  return s;
}

// 1000-token root, 10 children of 300 tokens, each with 10 children of 100; one query per leaf.
Snapshot reasoning() {
  Snapshot s = new_snapshot("reasoning_p1000_10x300_100x100", 1000 + 3000 + 10000);
  must(s.tree->append(0, std::vector<TokenId>(1000, 1)));
  const std::vector<NodeId> children = s.tree->branch(0, 10).value();
  for (NodeId child : children) {
    must(s.tree->append(child, std::vector<TokenId>(300, 2)));
    const std::vector<NodeId> leaves = s.tree->branch(child, 10).value();
    for (NodeId leaf : leaves) {
      must(s.tree->append(leaf, std::vector<TokenId>(100, 3)));
      s.queries.push_back({leaf, 99});
    }
  }
  return s;
}

// KV slots query `q` sees: every token of its proper ancestors, its node up to itself.
std::vector<int32_t> visible_slots(const Snapshot& s, const QueryToken& q) {
  std::vector<int32_t> slots;
  const std::vector<NodeId> path = s.tree->path(q.node).value();
  for (NodeId node : path) {
    const int64_t count =
        node == q.node ? q.token_index + 1 : static_cast<int64_t>(s.tree->node(node).tokens.size());
    for (int64_t i = 0; i < count; ++i) slots.push_back(s.kv->slot(s.tree->kv_key(node), i));
  }
  return slots;
}

float bf16_value(uint16_t bits) {
  const uint32_t word = uint32_t{bits} << 16;
  float x;
  std::memcpy(&x, &word, 4);
  return x;
}

std::vector<uint16_t> random_bf16(size_t count, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint16_t> bits(count);
  for (uint16_t& b : bits) b = __nv_bfloat16_raw(__float2bfloat16_rn(normal(rng))).x;
  return bits;
}

struct Args {
  std::string workloads = DEFT_WORKLOADS_DIR;
  std::string out;
  int reps = 50;            // graph replays of kLaunchesPerGraph launches each
  std::string only_case;    // run only these cases (comma-separated; for profiling)
  std::string only_method;  // run only these methods (comma-separated)
};

}  // namespace
}  // namespace deft::bench

// Whether `name` is one of the comma-separated names of `list` (an empty list holds every name).
bool listed(const std::string& list, const std::string& name) {
  if (list.empty()) return true;
  for (absl::string_view item : absl::StrSplit(list, ',')) {
    if (item == name) return true;
  }
  return false;
}

int main(int argc, char** argv) {
  using namespace deft;
  using namespace deft::bench;
  Args args;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--workloads")
      args.workloads = argv[i + 1];
    else if (flag == "--out")
      args.out = argv[i + 1];
    else if (flag == "--reps")
      args.reps = std::atoi(argv[i + 1]);
    else if (flag == "--case")
      args.only_case = argv[i + 1];
    else if (flag == "--method")
      args.only_method = argv[i + 1];
  }

  std::vector<Snapshot> snapshots;
  for (int b : {20, 30, 50}) snapshots.push_back(fewshot(4000, b, 200));
  // The few-shot decode step of bench/e2e_step_bench halfway through its 100 steps.
  snapshots.push_back(fewshot(4000, 20, 50));
  for (int t : {32, 64, 128, 256}) {
    const std::string path =
        args.workloads + "/speculative_decoding/apps_tree_size" + std::to_string(t) + ".json";
    absl::StatusOr<SpecDecTrace> trace = load_specdec_trace(path);
    if (!trace.ok()) {
      std::fprintf(stderr, "skipping t=%d: %s\n", t, trace.status().ToString().c_str());
      continue;
    }
    for (int prefix : {1000, 6000}) snapshots.push_back(specdec(prefix, *trace));
  }
  snapshots.push_back(reasoning());

  cudaDeviceProp prop;
  DEFT_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const std::string gpu = prop.name;
  const std::string tag = BenchResult::gpu_tag(gpu);
  BenchResult result("kernel_attention", gpu, tag, argc, argv);

  kernels::AttentionDims dims;
  dims.num_q_heads = kNumQHeads;
  dims.num_kv_heads = kNumKvHeads;
  dims.head_dim = kHeadDim;
  dims.softmax_scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
  // The adaptive B's view of this GPU (PlannerOptions::wave), as the CUDA runner reports it.
  const engine::AttentionWave wave = {
      .ctas = kernels::deft_attention_resident_ctas(dims, kernels::DType::kBf16),
      .kv_heads = kNumKvHeads,
      .group_size = dims.group_size()};
  std::printf("stage-1 CTAs resident at once: %d\n", wave.ctas);
  const size_t kv_row = size_t{kNumKvHeads} * kHeadDim;
  const size_t q_row = size_t{kNumQHeads} * kHeadDim;

  struct Method {
    PlanKind kind;
    int chunk_tokens;
    std::string name;
  };
  const std::vector<Method> methods = {
      // Headline row: the planner's default, B picked per tree by adaptive_chunk_tokens().
      {PlanKind::kDeftFlatten, 0, "deft_flatten"},
      {PlanKind::kDeftFlatten, 64, "deft_flatten_b64"},
      {PlanKind::kDeftFlatten, 128, "deft_flatten_b128"},
      {PlanKind::kDeftFlatten, 192, "deft_flatten_b192"},
      {PlanKind::kDeftFlatten, 256, "deft_flatten_b256"},
      {PlanKind::kDeftFlatten, 320, "deft_flatten_b320"},
      {PlanKind::kDeftFlatten, 384, "deft_flatten_b384"},
      {PlanKind::kDeftFlatten, 448, "deft_flatten_b448"},
      {PlanKind::kDeftFlatten, 512, "deft_flatten_b512"},
      {PlanKind::kDeftFlatten, 576, "deft_flatten_b576"},
      {PlanKind::kDeftFlatten, 640, "deft_flatten_b640"},
      {PlanKind::kDeftFlatten, 768, "deft_flatten_b768"},
      {PlanKind::kDeftNode, 128, "deft_node"},
      {PlanKind::kDeftNodeChunk, 128, "deft_node_chunk"},
      {PlanKind::kSequence, 512, "sequence"},
      {PlanKind::kDenseMask, 128, "dense_tree"},
  };

  std::mt19937 rng(20261123);
  cudaStream_t stream;
  DEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  // What this device reads (the floors keep 3.0 TB/s; rows add their ratio to this one's floor).
  const double read_bytes_per_s = measure_and_print_device_read_bandwidth();
  std::printf("%-32s %-18s %9s %9s %7s %9s %8s\n", "case", "method", "median_us", "floor_us",
              "ratio", "GB/s", "rel_err");
  for (const Snapshot& s : snapshots) {
    if (!listed(args.only_case, s.name)) continue;
    const int32_t num_slots = static_cast<int32_t>(s.kv->num_slots());
    const int32_t num_queries = static_cast<int32_t>(s.queries.size());
    const size_t kv_elems = size_t(num_slots) * kv_row;
    const size_t q_elems = size_t(num_queries) * q_row;
    const std::vector<uint16_t> k_host = random_bf16(kv_elems, rng);
    const std::vector<uint16_t> v_host = random_bf16(kv_elems, rng);
    const std::vector<uint16_t> q_host = random_bf16(q_elems, rng);
    const size_t copy_bytes = (2 * kv_elems + q_elems) * kElemBytes;
    const int copies =
        static_cast<int>(std::max<size_t>(2, (kRotateBytes + copy_bytes - 1) / copy_bytes));
    DeviceBuffer k_dev(kv_elems * kElemBytes * copies), v_dev(kv_elems * kElemBytes * copies);
    DeviceBuffer q_dev(q_elems * kElemBytes * copies), out_dev(q_elems * kElemBytes);
    for (int c = 0; c < copies; ++c) {
      DEFT_CUDA_CHECK(cudaMemcpy(k_dev.as<uint16_t>() + c * kv_elems, k_host.data(),
                                 kv_elems * kElemBytes, cudaMemcpyHostToDevice));
      DEFT_CUDA_CHECK(cudaMemcpy(v_dev.as<uint16_t>() + c * kv_elems, v_host.data(),
                                 kv_elems * kElemBytes, cudaMemcpyHostToDevice));
      DEFT_CUDA_CHECK(cudaMemcpy(q_dev.as<uint16_t>() + c * q_elems, q_host.data(),
                                 q_elems * kElemBytes, cudaMemcpyHostToDevice));
    }

    // Floor: tree KV read once, and 4 * head_dim * q_heads FLOPs per (query, visible token).
    const int64_t tree_tokens = s.tree->total_tokens();
    int64_t visible_pairs = 0;
    for (const QueryToken& q : s.queries) visible_pairs += s.tree->depth(q.node, q.token_index) + 1;
    const double tree_kv_bytes = double(tree_tokens) * kv_row * kElemBytes * 2;
    const double flops = 4.0 * kHeadDim * kNumQHeads * double(visible_pairs);
    const double floor_us = BenchResult::floor_us(tree_kv_bytes, flops);
    const double measured_floor_us = BenchResult::floor_us(tree_kv_bytes, flops, read_bytes_per_s);
    // A result row of this snapshot (extra left to the caller).
    const auto timed_row = [&](const std::string& method, const Samples& stats, int64_t bytes) {
      ResultRow row;
      row.case_name = s.name;
      row.method = method;
      row.set_times(stats);
      row.repetitions = args.reps;
      row.kv_bytes = bytes;
      row.floor_us = floor_us;
      return row;
    };

    // Float64 dense reference on up to 12 sampled queries (copy 0's values).
    std::vector<int32_t> sampled;
    for (int i = 0; i < std::min(num_queries, 12); ++i) {
      sampled.push_back(
          static_cast<int32_t>((int64_t(i) * num_queries) / std::min(num_queries, 12)));
    }
    std::vector<double> reference(sampled.size() * q_row, 0.0);
    for (size_t i = 0; i < sampled.size(); ++i) {
      const std::vector<int32_t> slots = visible_slots(s, s.queries[sampled[i]]);
      std::vector<double> scores(slots.size());
      for (int h = 0; h < kNumQHeads; ++h) {
        const int kvh = h / (kNumQHeads / kNumKvHeads);
        const uint16_t* qv = &q_host[size_t(sampled[i]) * q_row + size_t(h) * kHeadDim];
        double mx = -1e300;
        for (size_t j = 0; j < slots.size(); ++j) {
          const uint16_t* kvec = &k_host[size_t(slots[j]) * kv_row + size_t(kvh) * kHeadDim];
          double dot = 0;
          for (int d = 0; d < kHeadDim; ++d) dot += double(bf16_value(qv[d])) * bf16_value(kvec[d]);
          scores[j] = dot * dims.softmax_scale;
          mx = std::max(mx, scores[j]);
        }
        double denom = 0;
        for (double& x : scores) denom += (x = std::exp(x - mx));
        double* o = &reference[i * q_row + size_t(h) * kHeadDim];
        for (size_t j = 0; j < slots.size(); ++j) {
          const uint16_t* vvec = &v_host[size_t(slots[j]) * kv_row + size_t(kvh) * kHeadDim];
          for (int d = 0; d < kHeadDim; ++d) o[d] += scores[j] / denom * bf16_value(vvec[d]);
        }
      }
    }

    for (const Method& m : methods) {
      if (!listed(args.only_method, m.name)) continue;
      AttentionPlanner planner({.kind = m.kind, .chunk_tokens = m.chunk_tokens, .wave = wave});
      AttentionPlan plan;
      const std::vector<engine::TreeQueries> input = {{s.tree.get(), s.queries}};
      must(planner.plan(input, plan));
      kernels::DevicePlan device_plan;
      device_plan.upload(plan.view(), dims, stream);
      kernels::DeftAttentionBuffers buffers;
      buffers.reserve(plan.num_entries(), dims);
      const auto launch = [&](int copy) {
        kernels::launch_deft_attention(
            device_plan, dims, kernels::DType::kBf16, q_dev.as<uint16_t>() + copy * q_elems,
            k_dev.as<uint16_t>() + copy * kv_elems, v_dev.as<uint16_t>() + copy * kv_elems, buffers,
            out_dev.data(), stream);
      };

      // Correctness on copy 0 (output poisoned first).
      DEFT_CUDA_CHECK(cudaMemsetAsync(out_dev.data(), 0xff, q_elems * kElemBytes, stream));
      launch(0);
      DEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
      std::vector<uint16_t> out_host(q_elems);
      DEFT_CUDA_CHECK(cudaMemcpy(out_host.data(), out_dev.data(), q_elems * kElemBytes,
                                 cudaMemcpyDeviceToHost));
      double diff = 0, norm = 0;
      bool nan = false;
      for (size_t i = 0; i < sampled.size(); ++i) {
        for (size_t x = 0; x < q_row; ++x) {
          const float got = bf16_value(out_host[size_t(sampled[i]) * q_row + x]);
          nan |= std::isnan(got);
          const double ref = reference[i * q_row + x];
          diff += (got - ref) * (got - ref);
          norm += ref * ref;
        }
      }
      const double rel_err = std::sqrt(diff / norm);
      const bool correct = !nan && rel_err <= 1e-2;

      // A CUDA graph of kLaunchesPerGraph launches (rotating copies) keeps the GPU busy, so
      // neither host launch gaps nor idle clocks enter the numbers; one sample = one replay's
      // time / kLaunchesPerGraph.
      constexpr int kLaunchesPerGraph = 20;
      const std::vector<double> samples_us = time_graph_replays(
          stream, kLaunchesPerGraph, /*warmup=*/5, args.reps, [&](int i) { launch(i % copies); });
      const Samples stats = summarize(samples_us);
      const int64_t kv_bytes = plan.io.kv_tokens_read * int64_t(kv_row) * kElemBytes * 2;
      std::printf("%-32s %-18s %9.1f %9.1f %7.2f %9.0f %8.1e%s\n", s.name.c_str(), m.name.c_str(),
                  stats.median, floor_us, stats.median / floor_us, kv_bytes / stats.median / 1e3,
                  rel_err, correct ? "" : "  FAILED CHECK (row not written)");
      if (!correct) continue;
      ResultRow row = timed_row(m.name, stats, kv_bytes);
      row.extra = {{"tree_kv_tokens", tree_tokens},
                   {"queries", num_queries},
                   // The B the plan used: the adaptive rule's pick (with this GPU's stage-1
                   // wave) where m.chunk_tokens = 0.
                   {"chunk_tokens", plan.io.max_chunk_tokens},
                   {"chunk_policy", std::string(m.chunk_tokens > 0 ? "fixed" : "adaptive")},
                   {"plan_kind", std::string(engine::plan_kind_name(m.kind))},
                   {"tasks", plan.io.tasks},
                   {"entries", plan.io.query_chunk_pairs},
                   {"kv_tokens_read", plan.io.kv_tokens_read},
                   {"achieved_gb_per_s", kv_bytes / stats.median / 1e3},
                   {"attention_gflop", flops / 1e9},
                   {"rel_err_sampled", rel_err},
                   {"device_read_bytes_per_s", read_bytes_per_s},
                   {"floor_us_at_device_read", measured_floor_us},
                   {"ratio_to_measured_floor", stats.median / measured_floor_us}};
      result.add(row);
    }

    // Reference, not attention: one launch reading as many bytes of K and of V as the tree
    // holds (contiguous, the same rotation), i.e. what this GPU takes to stream the floor's bytes
    // in one kernel that does nothing else. Its ratio to the floor is the part of an attention
    // method's ratio that no kernel of one launch avoids.
    if (listed(args.only_method, "kv_read_reference")) {
      const size_t bytes_each = size_t(tree_tokens) * kv_row * kElemBytes;
      DeviceBuffer sink(4);
      constexpr int kLaunchesPerGraph = 20;
      const Samples stats = summarize(
          time_graph_replays(stream, kLaunchesPerGraph, /*warmup=*/5, args.reps, [&](int i) {
            const int copy = i % copies;
            launch_device_read_pair(k_dev.as<uint16_t>() + copy * kv_elems,
                                    v_dev.as<uint16_t>() + copy * kv_elems, bytes_each,
                                    static_cast<uint32_t*>(sink.data()), stream);
          }));
      const int64_t read_bytes = 2 * static_cast<int64_t>(bytes_each);
      const double memory_floor_us = BenchResult::floor_us(tree_kv_bytes, 0.0);
      std::printf("%-32s %-18s %9.1f %9.1f %7.2f %9.0f\n", s.name.c_str(), "kv_read_reference",
                  stats.median, floor_us, stats.median / floor_us, read_bytes / stats.median / 1e3);
      ResultRow row = timed_row("kv_read_reference", stats, read_bytes);
      row.extra = {{"what", std::string("not attention: one launch reading the tree's K and V "
                                        "bytes (contiguous), nothing else")},
                   {"tree_kv_tokens", tree_tokens},
                   {"achieved_gb_per_s", read_bytes / stats.median / 1e3},
                   {"ratio_to_memory_floor", stats.median / memory_floor_us},
                   {"device_read_bytes_per_s", read_bytes_per_s},
                   {"floor_us_at_device_read", measured_floor_us},
                   {"ratio_to_measured_floor", stats.median / measured_floor_us}};
      result.add(row);
    }
  }
  std::printf("wrote %s\n", result.write(args.out).c_str());
  return 0;
}
