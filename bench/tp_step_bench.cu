// Tensor-parallel decode steps (LlamaCudaRunner::create_random_tensor_parallel over NCCL) with
// random bf16 weights, against their floor:
//   llama3_70b  (hidden 8192, 64/8 heads, head_dim 128, intermediate 28672, vocab 128256;
//               --layers-70b of its 80 layers, all by default) at TP 2;
//   llama3_8b   at TP 1 and TP 2 (the speedup of TP 2 per step);
// each on two decode steps from the paper's workloads:
//   fewshot_p4000_b20: a 4000-token prompt prefilled, 20 branches decoding one token a step;
//   specdec_p6000_t64: a 6000-token prefix, steps verifying the 64-token Medusa tree
//               (SpecDecReplay, accept lengths of the trace's first record).
// One step = planning + forward_sampled() (greedy on rank 0's GPU) + reading the tokens; its time
// is the host's wall time (all ranks finished) and rank 0's GPU time (StepTiming::kTotal events:
// rank 0 waits on every collective, so it spans the step). The first kWarmupSteps are excluded.
// A second, shorter run of each case with StepTiming::kPhases gives rank 0's split (attention,
// GEMMs, other kernels, copies and collectives, sampling; eager launches, so a little slower).
// Floor per step = per-GPU bytes / 3.0e12 B/s + the step's collectives as measured alone
// (2 all-reduces per layer and one for the embedding of the step's rows x hidden fp32, each the
// faster of NCCL's and kernels/peer_all_reduce.h's, and the logits' all-gather of rows x
// vocab / ranks fp32; each timed here over the same GPUs in CUDA graphs of 50 back to back, so
// without launch gaps), where per-GPU bytes = the rank's
// weights less its embedding rows (a step gathers a few) + the tree's KV bytes on the rank.
//
//   tp_step_bench [--workloads DIR] [--out DIR] [--layers-70b N] [--fewshot-steps N]
//                 [--spec-steps N] [--devices 0,1] [--only 8b|70b]
// Writes <out>/tp_step-<gpu>-<date>.json (../shared/BENCH_RESULTS.md).
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "bench/bench_result.h"
#include "bench/device_read_bandwidth.h"
#include "bench/llama3_8b_config.h"
#include "bench/workload_trace.h"
#include "engine/attention_planner.h"
#include "engine/kv_cache_manager.h"
#include "engine/model_runner.h"
#include "engine/sequence_tree.h"
#include "kernels/cuda_check.h"
#include "kernels/device_buffer.h"
#include "kernels/device_scope.h"
#include "kernels/peer_all_reduce.h"
#include "models/llama_cuda.h"
#include "models/model_config.h"
#include "models/tensor_parallel.h"
#include "models/tensor_parallel_runner.h"

namespace deft::bench {
namespace {

using engine::AttentionPlanner;
using engine::KvCacheManager;
using engine::NodeId;
using engine::PlanKind;
using engine::QueryToken;
using engine::SequenceTree;
using engine::TokenId;
using Clock = std::chrono::steady_clock;

constexpr int kWarmupSteps = 3;
constexpr int32_t kPageTokens = 16;
constexpr int32_t kNumPages = 1024;  // 16384 KV slots
constexpr int32_t kPrefillChunk = 2048;

void must(const absl::Status& status, const char* what) {
  if (!status.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, status.ToString().c_str());
    std::exit(1);
  }
}

#define BENCH_NCCL(call)                                               \
  do {                                                                 \
    const ncclResult_t r_ = (call);                                    \
    if (r_ != ncclSuccess) {                                           \
      std::fprintf(stderr, "%s: %s\n", #call, ncclGetErrorString(r_)); \
      std::exit(1);                                                    \
    }                                                                  \
  } while (0)

double us_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
}

models::ModelConfig llama3_70b_config(int32_t layers) {
  models::ModelConfig c = llama3_8b_config();
  c.hidden_size = 8192;
  c.intermediate_size = 28672;
  c.num_hidden_layers = layers;
  c.num_attention_heads = 64;
  c.num_key_value_heads = 8;
  return c;
}

// Median µs of one collective over `devices` (fp32 elements per rank): all-reduce (sum, in
// place) of `count`, or all-gather of `count` per rank. Each rank on its own thread captures 50
// back to back into a CUDA graph (as the runner's graph steps hold them), replays it 3 times
// untimed and 10 times between events.
enum class Collective { kNcclAllReduce, kNcclAllGather, kPeerAllReduce };

double collective_us(const std::vector<int>& devices, size_t count, Collective kind) {
  const bool all_gather = kind == Collective::kNcclAllGather;
  const int32_t ranks = static_cast<int32_t>(devices.size());
  std::vector<ncclComm_t> comms(devices.size());
  BENCH_NCCL(ncclCommInitAll(comms.data(), ranks, devices.data()));
  // The peer kernel's buffers (peer access is on: the TP runner enabled it).
  std::vector<kernels::DeviceBuffer> peer_buffers(devices.size());
  kernels::PeerAllReduceTable table;
  table.ranks = ranks;
  table.capacity = static_cast<int64_t>(count);
  if (kind == Collective::kPeerAllReduce) {
    for (int32_t r = 0; r < ranks; ++r) {
      const kernels::DeviceScope on_device(devices[r]);
      peer_buffers[r].reset(kernels::peer_all_reduce_buffer_bytes(ranks, table.capacity));
      DEFT_CUDA_CHECK(cudaMemset(peer_buffers[r].data(), 0, peer_buffers[r].bytes()));
      table.buffers[r] = peer_buffers[r].data();
    }
  }
  constexpr int kPerGraph = 50, kReplays = 10;
  std::vector<double> us(devices.size());
  models::TensorParallelRunner::run_parallel(ranks, [&](int32_t r) {
    const kernels::DeviceScope on_device(devices[r]);
    cudaStream_t stream;
    DEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    kernels::DeviceBuffer send(count * sizeof(float)),
        receive(count * sizeof(float) * (all_gather ? ranks : 1));
    DEFT_CUDA_CHECK(cudaMemsetAsync(send.data(), 0, send.bytes(), stream));
    const auto launch = [&] {
      if (kind == Collective::kPeerAllReduce) {
        kernels::launch_peer_all_reduce(table, r, send.as<float>(), static_cast<int64_t>(count),
                                        stream);
      } else if (all_gather) {
        BENCH_NCCL(
            ncclAllGather(send.data(), receive.data(), count, ncclFloat32, comms[r], stream));
      } else {
        BENCH_NCCL(
            ncclAllReduce(send.data(), send.data(), count, ncclFloat32, ncclSum, comms[r], stream));
      }
    };
    for (int i = 0; i < 5; ++i) launch();  // NCCL's own warm-up (buffers, channels)
    DEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    DEFT_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < kPerGraph; ++i) launch();
    DEFT_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    DEFT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int i = 0; i < 3; ++i) DEFT_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    cudaEvent_t start, stop;
    DEFT_CUDA_CHECK(cudaEventCreate(&start));
    DEFT_CUDA_CHECK(cudaEventCreate(&stop));
    DEFT_CUDA_CHECK(cudaEventRecord(start, stream));
    for (int i = 0; i < kReplays; ++i) DEFT_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    DEFT_CUDA_CHECK(cudaEventRecord(stop, stream));
    DEFT_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    DEFT_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    us[r] = ms * 1e3 / (kPerGraph * kReplays);
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(stream);
  });
  for (ncclComm_t comm : comms) ncclCommDestroy(comm);
  for (int32_t r = 0; r < ranks; ++r) {
    const kernels::DeviceScope on_device(devices[r]);
    peer_buffers[r] = kernels::DeviceBuffer();
  }
  return *std::max_element(us.begin(), us.end());
}

struct StepRecord {
  double wall_us = 0, gpu_us = 0;
  models::StepTimes phases;  // rank 0's, in a StepTiming::kPhases run
  int64_t tree_tokens = 0;
  int32_t rows = 0;
};

// The steps of one model on one runner (any rank count).
class Bench {
 public:
  Bench(engine::ModelRunner& runner, models::LlamaCudaRunner& rank0,
        const models::ModelConfig& config)
      : runner_(runner), rank0_(rank0), config_(config) {
    greedy_.temperature = 0.0f;
  }

  void prefill(const SequenceTree& tree, NodeId node, int32_t count) {
    AttentionPlanner planner({.kind = PlanKind::kDeftFlatten});
    std::mt19937 rng(7);
    std::uniform_int_distribution<TokenId> token(0, config_.vocab_size - 1);
    for (int32_t begin = 0; begin < count; begin += kPrefillChunk) {
      const int32_t end = std::min(count, begin + kPrefillChunk);
      std::vector<QueryToken> queries;
      std::vector<TokenId> tokens;
      for (int32_t i = begin; i < end; ++i) {
        queries.push_back({node, i});
        tokens.push_back(token(rng));
      }
      must(planner.plan(std::vector<engine::TreeQueries>{{&tree, queries}}, plan_), "prefill plan");
      must(runner_.forward({.plan = &plan_, .tokens = tokens, .logit_rows = {}}, {}), "prefill");
    }
  }

  StepRecord step(const SequenceTree& tree, const std::vector<QueryToken>& queries,
                  const std::vector<TokenId>& tokens, AttentionPlanner& planner,
                  std::vector<TokenId>& argmax) {
    StepRecord rec;
    const Clock::time_point t0 = Clock::now();
    must(planner.plan(std::vector<engine::TreeQueries>{{&tree, queries}}, plan_), "plan");
    const int32_t rows = static_cast<int32_t>(queries.size());
    logit_rows_.resize(rows);
    for (int32_t r = 0; r < rows; ++r) logit_rows_[r] = r;
    sampling_rows_.assign(rows, {.params = &greedy_, .step = 0});
    sampled_.resize(rows);
    must(runner_.forward_sampled({.plan = &plan_, .tokens = tokens, .logit_rows = logit_rows_},
                                 sampling_rows_, sampled_),
         "forward_sampled");
    argmax.resize(rows);
    for (int32_t r = 0; r < rows; ++r) argmax[r] = sampled_[r].token;
    rec.wall_us = us_since(t0);
    rec.gpu_us = rank0_.last_step_times().total_ms * 1e3;
    rec.phases = rank0_.last_step_times();
    rec.tree_tokens = tree.total_tokens();
    rec.rows = rows;
    return rec;
  }

  std::vector<StepRecord> fewshot(int prompt, int branches, int steps) {
    KvCacheManager kv({.page_tokens = kPageTokens, .num_pages = kNumPages});
    SequenceTree tree(0, &kv);
    AttentionPlanner planner(options());
    must(tree.append(0, std::vector<TokenId>(prompt, 1)), "prompt");
    prefill(tree, 0, prompt);
    absl::StatusOr<std::vector<NodeId>> leaves = tree.branch(0, branches);
    must(leaves.status(), "branch");
    std::mt19937 rng(11);
    std::uniform_int_distribution<TokenId> token(0, config_.vocab_size - 1);
    std::vector<TokenId> pending(branches);
    for (TokenId& t : pending) t = token(rng);
    std::vector<QueryToken> queries(branches);
    std::vector<StepRecord> records;
    for (int s = 0; s < kWarmupSteps + steps; ++s) {
      for (int b = 0; b < branches; ++b) {
        const NodeId leaf = (*leaves)[b];
        must(tree.append(leaf, std::span<const TokenId>(&pending[b], 1)), "append");
        queries[b] = {leaf, static_cast<int32_t>(tree.node(leaf).tokens.size()) - 1};
      }
      std::vector<TokenId> next;
      const StepRecord rec = step(tree, queries, pending, planner, next);
      pending = next;
      if (s >= kWarmupSteps) records.push_back(rec);
    }
    return records;
  }

  std::vector<StepRecord> specdec(const SpecDecTrace& trace, int prefix, int steps) {
    KvCacheManager kv({.page_tokens = kPageTokens, .num_pages = kNumPages});
    SequenceTree tree(0, &kv);
    AttentionPlanner planner(options());
    SpecDecReplay replay(trace, tree, prefix);
    must(replay.status(), "specdec replay");
    prefill(tree, 0, prefix);
    const std::vector<int32_t>& accept = trace.accept_lengths.at(0);
    std::mt19937 rng(13);
    std::uniform_int_distribution<TokenId> token(0, config_.vocab_size - 1);
    std::vector<QueryToken> queries;
    std::vector<TokenId> tokens(trace.tree_size()), argmax;
    std::vector<StepRecord> records;
    for (int s = 0; s < kWarmupSteps + steps; ++s) {
      for (TokenId& t : tokens) t = token(rng);
      replay.build_token_tree(queries);
      must(replay.status(), "token tree");
      const StepRecord rec = step(tree, queries, tokens, planner, argmax);
      replay.commit(std::max(1, accept[s % accept.size()]));
      must(replay.status(), "commit");
      if (s >= kWarmupSteps) records.push_back(rec);
    }
    return records;
  }

 private:
  engine::PlannerOptions options() const {
    return {.kind = PlanKind::kDeftFlatten, .chunk_tokens = 0, .wave = runner_.attention_wave()};
  }

  engine::ModelRunner& runner_;
  models::LlamaCudaRunner& rank0_;
  models::ModelConfig config_;
  engine::AttentionPlan plan_;
  std::vector<int32_t> logit_rows_;
  engine::SamplingParams greedy_;
  std::vector<engine::RowSampling> sampling_rows_;
  std::vector<engine::SampledToken> sampled_;
};

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values.empty() ? 0.0 : values[values.size() / 2];
}

}  // namespace
}  // namespace deft::bench

int main(int argc, char** argv) {
  using namespace deft;
  using namespace deft::bench;
  std::string workloads = DEFT_WORKLOADS_DIR, out, only;
  int layers_70b = 80, fewshot_steps = 40, spec_steps = 30;
  std::vector<int> devices = {0, 1};
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--workloads")
      workloads = argv[i + 1];
    else if (flag == "--out")
      out = argv[i + 1];
    else if (flag == "--layers-70b")
      layers_70b = std::atoi(argv[i + 1]);
    else if (flag == "--fewshot-steps")
      fewshot_steps = std::atoi(argv[i + 1]);
    else if (flag == "--spec-steps")
      spec_steps = std::atoi(argv[i + 1]);
    else if (flag == "--only")
      only = argv[i + 1];
    else if (flag == "--devices") {
      devices.clear();
      for (absl::string_view part : absl::StrSplit(argv[i + 1], ',')) {
        int device = 0;
        if (!absl::SimpleAtoi(part, &device)) {
          std::fprintf(stderr, "--devices: '%s' is not a list of device numbers\n", argv[i + 1]);
          return 2;
        }
        devices.push_back(device);
      }
    } else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  absl::StatusOr<SpecDecTrace> trace =
      load_specdec_trace(workloads + "/speculative_decoding/apps_tree_size64.json");
  must(trace.status(), "trace");
  const double read_bytes_per_s = measure_and_print_device_read_bandwidth();
  cudaDeviceProp prop;
  DEFT_CUDA_CHECK(cudaGetDeviceProperties(&prop, devices[0]));
  const std::string gpu = prop.name;
  const std::string tag = BenchResult::gpu_tag(gpu, static_cast<int>(devices.size()));
  BenchResult result("tp_step", gpu + " x" + std::to_string(devices.size()), tag, argc, argv);

  struct Model {
    std::string name;
    models::ModelConfig config;
    int32_t ranks;
  };
  std::vector<Model> model_runs;
  if (only != "70b") {
    model_runs.push_back({"llama3_8b", llama3_8b_config(), 1});
    model_runs.push_back({"llama3_8b", llama3_8b_config(), static_cast<int32_t>(devices.size())});
  }
  if (only != "8b") {
    model_runs.push_back(
        {"llama3_70b", llama3_70b_config(layers_70b), static_cast<int32_t>(devices.size())});
  }
  struct Case {
    std::string name;
    bool spec;
    int32_t rows;
  };
  const std::vector<Case> cases = {{"fewshot_p4000_b20", false, 20},
                                   {"specdec_p6000_t64", true, trace->tree_size()}};
  double median_8b[2][2] = {{0, 0}, {0, 0}};  // [case][tp1, tp2]

  for (const Model& model : model_runs) {
    const models::ModelConfig& c = model.config;
    models::LlamaCudaOptions options;
    options.num_kv_slots = int64_t{kNumPages} * kPageTokens;
    options.page_tokens = kPageTokens;
    options.max_batch_rows = kPrefillChunk;
    options.device = devices[0];
    const Clock::time_point t_load = Clock::now();
    std::unique_ptr<engine::ModelRunner> runner;
    models::LlamaCudaRunner* rank0 = nullptr;
    if (model.ranks == 1) {
      absl::StatusOr<std::unique_ptr<models::LlamaCudaRunner>> one =
          models::LlamaCudaRunner::create_random(c, options, 1, model.name);
      must(one.status(), "runner");
      rank0 = one->get();
      runner = std::move(*one);
    } else {
      absl::StatusOr<std::unique_ptr<engine::ModelRunner>> many =
          models::LlamaCudaRunner::create_random_tensor_parallel(
              c, options, std::span<const int>(devices.data(), model.ranks), 1);
      must(many.status(), "runner");
      runner = std::move(*many);
      rank0 = &dynamic_cast<models::LlamaCudaRunner&>(
          dynamic_cast<models::TensorParallelRunner&>(*runner).rank(0));
    }
    const models::ModelConfig shard = models::shard_config(c, model.ranks);
    const models::VocabShard vocab = models::vocab_shard(c.vocab_size, {0, model.ranks});
    const double embed_bytes =
        2.0 * (model.ranks == 1 ? vocab.rows : vocab.rows + 1) * c.hidden_size;
    const double weight_read_bytes = double(rank0->weight_bytes()) - embed_bytes;
    const double kv_token_bytes = 2.0 * c.num_hidden_layers * shard.kv_size() * 2;
    std::printf("%s (%d layers) at TP %d ready in %.1f s: %.2f GB weights per GPU\n",
                model.name.c_str(), c.num_hidden_layers, model.ranks, us_since(t_load) / 1e6,
                rank0->weight_bytes() / 1e9);
    rank0->set_step_timing(models::StepTiming::kTotal);
    Bench bench(*runner, *rank0, c);
    bench.fewshot(4000, 20, 3);  // warm-up (clocks, cuBLAS, NCCL)
    for (size_t k = 0; k < cases.size(); ++k) {
      const Case& cs = cases[k];
      const std::vector<StepRecord> steps = cs.spec ? bench.specdec(*trace, 6000, spec_steps)
                                                    : bench.fewshot(4000, 20, fewshot_steps);
      // The collectives of a step of these rows, measured alone.
      // The floor's all-reduce: the faster of NCCL's and the peer kernel's (what the runner
      // uses for these rows), each timed alone.
      double collectives_us = 0, all_reduce_us = 0, nccl_all_reduce_us = 0, peer_all_reduce_us = 0,
             all_gather_us = 0;
      if (model.ranks > 1) {
        const std::vector<int> used(devices.begin(), devices.begin() + model.ranks);
        const size_t residual = size_t(cs.rows) * c.hidden_size;
        nccl_all_reduce_us = collective_us(used, residual, Collective::kNcclAllReduce);
        peer_all_reduce_us = collective_us(used, residual, Collective::kPeerAllReduce);
        all_reduce_us = std::min(nccl_all_reduce_us, peer_all_reduce_us);
        all_gather_us =
            collective_us(used, size_t(cs.rows) * vocab.rows, Collective::kNcclAllGather);
        collectives_us = (2.0 * c.num_hidden_layers + 1) * all_reduce_us + all_gather_us;
      }
      // Where rank 0's time goes: a second run of the case with an event after every launch
      // (eager launches on rank 0; the collectives count as copies).
      rank0->set_step_timing(models::StepTiming::kPhases);
      const std::vector<StepRecord> phased =
          cs.spec ? bench.specdec(*trace, 6000, 10) : bench.fewshot(4000, 20, 10);
      rank0->set_step_timing(models::StepTiming::kTotal);
      const auto phase_us = [&](double models::StepTimes::*field) {
        std::vector<double> values;
        for (const StepRecord& s : phased) values.push_back(s.phases.*field * 1e3);
        return median(values);
      };
      std::vector<double> wall, gpu_us, floor_fixed, floor_measured;
      for (const StepRecord& s : steps) {
        const double bytes = weight_read_bytes + kv_token_bytes * double(s.tree_tokens);
        wall.push_back(s.wall_us);
        gpu_us.push_back(s.gpu_us);
        floor_fixed.push_back(bytes / BenchResult::kHbmBytesPerS * 1e6 + collectives_us);
        floor_measured.push_back(bytes / read_bytes_per_s * 1e6 + collectives_us);
      }
      ResultRow row;
      row.case_name = cs.name;
      row.method = model.name + "_tp" + std::to_string(model.ranks);
      row.set_times(summarize(wall));
      row.repetitions = static_cast<int64_t>(steps.size());
      row.floor_us = median(floor_fixed);
      row.kv_bytes = static_cast<int64_t>(kv_token_bytes * double(steps.back().tree_tokens));
      row.extra["layers"] = c.num_hidden_layers;
      row.extra["ranks"] = model.ranks;
      row.extra["gpu_us_median"] = median(gpu_us);
      row.extra["weight_bytes_per_gpu"] = weight_read_bytes;
      row.extra["collectives_us"] = collectives_us;
      row.extra["all_reduce_us"] = all_reduce_us;
      row.extra["nccl_all_reduce_us"] = nccl_all_reduce_us;
      row.extra["peer_all_reduce_us"] = peer_all_reduce_us;
      row.extra["all_gather_us"] = all_gather_us;
      row.extra["rows"] = cs.rows;
      row.extra["phases_us"] = {{"attention", phase_us(&models::StepTimes::attention_ms)},
                                {"gemm", phase_us(&models::StepTimes::gemm_ms)},
                                {"other", phase_us(&models::StepTimes::other_ms)},
                                {"copies_and_collectives", phase_us(&models::StepTimes::copy_ms)},
                                {"sampling", phase_us(&models::StepTimes::sampling_ms)},
                                {"total_eager", phase_us(&models::StepTimes::total_ms)}};
      row.extra["measured_read_bytes_per_s"] = read_bytes_per_s;
      row.extra["floor_measured_bw_us"] = median(floor_measured);
      row.extra["ratio_to_measured_floor"] = row.median_us / median(floor_measured);
      if (model.name == "llama3_8b") {
        median_8b[k][model.ranks == 1 ? 0 : 1] = row.median_us;
        if (model.ranks > 1 && median_8b[k][0] > 0) {
          row.extra["speedup_vs_tp1"] = median_8b[k][0] / row.median_us;
        }
      }
      std::printf(
          "%-18s %-16s step %8.1f us (GPU %8.1f us), floor %8.1f us (collectives %6.1f us: "
          "all-reduce %.1f us (NCCL %.1f, peer %.1f), all-gather %.1f us) -> %.2fx; at the "
          "measured bandwidth %.2fx%s\n",
          cs.name.c_str(), row.method.c_str(), row.median_us, median(gpu_us), row.floor_us,
          collectives_us, all_reduce_us, nccl_all_reduce_us, peer_all_reduce_us, all_gather_us,
          row.median_us / row.floor_us, row.median_us / median(floor_measured),
          row.extra.contains("speedup_vs_tp1")
              ? (", " + std::to_string(row.extra["speedup_vs_tp1"].get<double>()) +
                 "x faster than TP 1")
                    .c_str()
              : "");
      std::printf("%-18s %-16s rank 0 eager with events: %s\n", cs.name.c_str(), row.method.c_str(),
                  row.extra["phases_us"].dump().c_str());
      result.add(std::move(row));
    }
    runner.reset();
  }
  std::printf("wrote %s\n", result.write(out).c_str());
  return 0;
}
