// The cost of a speculative decoding step with a draft model, against a plain decode step, in one
// run on one GPU: target = random-weight Llama-3-8B shape, draft = random-weight Llama-3.2-1B shape
// (bench/llama3_2_1b_config.h), each a models/llama_cuda.h runner with its own KV pool and its
// own trees (one SequenceTree per sequence, a 1000-token prompt prefilled into both models).
// Per batch (1 and 16 sequences):
//   plain_decode      one target step, one query row per sequence;
// and per token tree of t = 16, 32, 64, 128 tokens (the Medusa rank-path trees of the APPS
// workload files, ../shared/workloads/speculative_decoding/apps_tree_size{32,64,128}.json; t = 16:
// the first 15 entries of the 32-token tree) and batch:
//   draft_steps       d draft steps (d = the tree's depth): step j feeds the tree's tokens at
//                     depth j - 1 of every sequence to the draft (the rows a static tree asks of
//                     it; step 1 feeds the root candidate alone) and samples greedily with the
//                     top 10 logprobs of every row (a rank-path tree reaches rank 9);
//   verify            one target step over every sequence's t tree tokens (greedy per row);
//   speculative_step  the two, back to back, as a serving engine would run them: its cost
//                     against plain_decode, and tokens/s at the APPS records' acceptance (mean
//                     Accept_length of every record of the tree's file = tokens per step) against
//                     plain decoding's (t = 16 has no record: only the acceptance a 3x speedup
//                     needs).
// Every step is a host-driven forward_sampled() (tree bookkeeping, planning, the forward pass with
// CUDA graph replay where the runner takes one, <= 256 rows; reading the tokens back); a row's
// median_us is the step's wall time, extra.gpu_us its GPU time from the runner's CUDA events
// (StepTiming::kTotal). After each step the accepted tokens (the record's, cycled) join a tail node
// under the prompt that is cut back every 64 tokens, so the context stays 1000-1070 tokens.
// Floor per forward = max((weights read + the trees' KV) / 3.0 TB/s, FLOPs / 700 TFLOP/s);
// weights read exclude an untied embedding table (a step gathers a few rows of it); each row also
// gives the floor at the device's measured read bandwidth (bench/device_read_bandwidth.h).
//
//   spec_step_bench [--workloads DIR] [--out DIR] [--steps N] [--batches 1,16]
//                   [--trees 16,32,64,128] [--prompt-tokens N]
// Writes <out>/spec_step-<gpu>-<date>.json (../shared/BENCH_RESULTS.md).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
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
#include "bench/llama3_2_1b_config.h"
#include "bench/llama3_8b_config.h"
#include "bench/workload_trace.h"
#include "engine/attention_planner.h"
#include "engine/kv_cache_manager.h"
#include "engine/model_runner.h"
#include "engine/sequence_tree.h"
#include "kernels/cuda_check.h"
#include "models/llama_cuda.h"
#include "models/model_config.h"

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
using Clock = std::chrono::steady_clock;

constexpr int kWarmupSteps = 3;
constexpr int32_t kPageTokens = 16;
// Each drafted token is a one-token node owning a page: 16 sequences x (128 tree pages + ~70
// prompt and tail pages) fit with room to spare.
constexpr int32_t kNumPages = 4096;
constexpr int32_t kMaxRows = 2048;   // 16 sequences x 128 tree tokens; prefill chunks too
constexpr int32_t kTailTokens = 64;  // committed tokens kept before the tail is cut back
constexpr int32_t kDraftTopLogprobs = 10;

void must(const absl::Status& status, const char* what) {
  if (!status.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, status.ToString().c_str());
    std::exit(1);
  }
}

double us_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
}

// A token tree in parent form (parent[0] = -1: the root candidate, the target's last token) and
// the depth of every token.
struct TreeShape {
  std::string name;
  std::vector<int32_t> parent;
  std::vector<int32_t> depth;
  int32_t max_depth = 0;
  double apps_accept_mean = 0;  // tokens per step of the APPS records; 0: none recorded
  std::vector<int32_t> accept;  // every record's Accept_length, concatenated (the commit cycle)

  int32_t size() const { return static_cast<int32_t>(parent.size()); }
};

TreeShape make_shape(std::string name, std::vector<int32_t> parent) {
  TreeShape shape{.name = std::move(name), .parent = std::move(parent)};
  for (int32_t i = 0; i < shape.size(); ++i) {
    shape.depth.push_back(i == 0 ? 0 : shape.depth[shape.parent[i]] + 1);
    shape.max_depth = std::max(shape.max_depth, shape.depth.back());
  }
  return shape;
}

// What one forward pass took, and its floor.
struct ForwardRecord {
  double wall_us = 0;  // bookkeeping + planning + forward_sampled + reading the tokens
  double gpu_us = 0;   // the runner's events (StepTiming::kTotal)
  int32_t rows = 0;
  double floor_bytes = 0, flops = 0;
  bool finite = true;
  models::StepTimes times;  // the runner's split of the step (phases under StepTiming::kPhases)
};

// One model: a runner, its KV pool, and one tree per sequence (prompt at the root, a tail node of
// committed tokens under it, the step's token tree under the tail).
class Model {
 public:
  Model(models::LlamaCudaRunner& runner, const models::ModelConfig& config)
      : runner_(runner),
        config_(config),
        kv_({.page_tokens = kPageTokens, .num_pages = kNumPages}),
        planner_({.kind = PlanKind::kDeftFlatten, .wave = runner.attention_wave()}) {
    const size_t embed_bytes =
        config.tie_word_embeddings ? 0 : size_t{2} * config.vocab_size * config.hidden_size;
    weight_read_bytes_ = runner.weight_bytes() - embed_bytes;
    kv_token_bytes_ = int64_t{2} * config.num_hidden_layers * config.kv_size() * 2;
  }
  size_t weight_read_bytes() const { return weight_read_bytes_; }

  // New sequences with `prompt` random tokens each, prefilled (untimed).
  void start(int32_t batch, int32_t prompt) {
    seqs_.clear();
    std::mt19937 rng(7);
    std::uniform_int_distribution<TokenId> token(0, config_.vocab_size - 1);
    for (int32_t b = 0; b < batch; ++b) {
      Sequence seq;
      seq.tree = std::make_unique<SequenceTree>(static_cast<uint32_t>(b), &kv_);
      std::vector<TokenId> tokens(prompt);
      for (TokenId& t : tokens) t = token(rng);
      must(seq.tree->append(0, tokens), "prompt");
      std::vector<QueryToken> queries;
      for (int32_t i = 0; i < prompt; ++i) queries.push_back({0, i});
      must(planner_.plan(std::vector<engine::TreeQueries>{{seq.tree.get(), queries}}, plan_),
           "prefill plan");
      must(runner_.forward({.plan = &plan_, .tokens = tokens, .logit_rows = {}}, {}), "prefill");
      new_tail(seq);
      seqs_.push_back(std::move(seq));
    }
  }

  // Hangs `shape` under every sequence's tail (one one-token node per tree token).
  void hang(const TreeShape& shape) {
    for (Sequence& seq : seqs_) {
      seq.token_nodes.assign(shape.size(), -1);
      for (int32_t i = 0; i < shape.size(); ++i) {
        const NodeId parent = i == 0 ? seq.tail : seq.token_nodes[shape.parent[i]];
        const TokenId token = 3;
        absl::StatusOr<NodeId> child =
            seq.tree->add_child(parent, std::span<const TokenId>(&token, 1));
        must(child.status(), "token tree");
        seq.token_nodes[i] = *child;
      }
    }
  }

  // One step over the tree tokens of every sequence whose depth is `only_depth` (-1: all), greedy,
  // with `top_logprobs` per row.
  ForwardRecord step(const TreeShape& shape, int32_t only_depth, int32_t top_logprobs,
                     std::mt19937& rng) {
    const Clock::time_point t0 = Clock::now();
    queries_.resize(seqs_.size());
    std::vector<engine::TreeQueries> input;
    int64_t visible = 0, tree_tokens = 0;
    for (size_t b = 0; b < seqs_.size(); ++b) {
      queries_[b].clear();
      for (int32_t i = 0; i < shape.size(); ++i) {
        if (only_depth >= 0 && shape.depth[i] != only_depth) continue;
        queries_[b].push_back({seqs_[b].token_nodes[i], 0});
        visible += seqs_[b].tree->depth(seqs_[b].token_nodes[i], 0) + 1;
      }
      tree_tokens += seqs_[b].tree->total_tokens();
      input.push_back({seqs_[b].tree.get(), queries_[b]});
    }
    must(planner_.plan(input, plan_), "plan");
    const int32_t rows = plan_.num_queries;
    std::uniform_int_distribution<TokenId> token(0, config_.vocab_size - 1);
    tokens_.resize(rows);
    for (TokenId& t : tokens_) t = token(rng);  // the drafted ids
    logit_rows_.resize(rows);
    for (int32_t r = 0; r < rows; ++r) logit_rows_[r] = r;
    sampling_params_.temperature = 0.0f;
    sampling_params_.top_logprobs = top_logprobs;
    sampling_rows_.assign(rows, {.params = &sampling_params_, .step = 0});
    sampled_.resize(rows);
    ForwardRecord rec;
    const absl::Status sampled = runner_.forward_sampled(
        {.plan = &plan_, .tokens = tokens_, .logit_rows = logit_rows_}, sampling_rows_, sampled_);
    // INTERNAL: a NaN / inf logit (the row is reported, not sampled); anything else is fatal.
    if (sampled.code() == absl::StatusCode::kInternal) {
      rec.finite = false;
    } else {
      must(sampled, "forward_sampled");
      for (const engine::SampledToken& s : sampled_) {
        rec.finite &= s.token >= 0 && s.token < config_.vocab_size &&
                      static_cast<int32_t>(s.top_logprobs.size()) == top_logprobs;
      }
    }
    rec.wall_us = us_since(t0);
    rec.times = runner_.last_step_times();
    rec.gpu_us = rec.times.total_ms * 1e3;
    rec.rows = rows;
    rec.floor_bytes = double(weight_read_bytes_) + double(tree_tokens) * double(kv_token_bytes_);
    // 2 FLOPs per weight element per row (the LM head on every row too), attention 4 * q_size
    // per (query, visible token) per layer.
    rec.flops = 2.0 * (double(weight_read_bytes_) / 2.0) * rows +
                4.0 * config_.q_size() * double(visible) * config_.num_hidden_layers;
    return rec;
  }

  // Drops every token tree and appends `accepted` tokens to the tails (cut back past kTailTokens).
  void commit(int32_t accepted) {
    for (Sequence& seq : seqs_) {
      must(seq.tree->prune(seq.token_nodes[0]), "prune token tree");
      if (static_cast<int32_t>(seq.tree->node(seq.tail).tokens.size()) + accepted > kTailTokens) {
        must(seq.tree->prune(seq.tail), "prune tail");
        new_tail(seq);
      }
      must(seq.tree->append(seq.tail, std::vector<TokenId>(accepted, 3)), "commit");
    }
  }

  void set_timing(models::StepTiming timing) { runner_.set_step_timing(timing); }
  const models::CudaGraphStats& graph_stats() const { return runner_.cuda_graph_stats(); }

 private:
  struct Sequence {
    std::unique_ptr<SequenceTree> tree;
    NodeId tail = -1;
    std::vector<NodeId> token_nodes;
  };
  void new_tail(Sequence& seq) {
    absl::StatusOr<NodeId> tail = seq.tree->add_child(0, {});
    must(tail.status(), "tail");
    seq.tail = *tail;
  }

  models::LlamaCudaRunner& runner_;
  models::ModelConfig config_;
  KvCacheManager kv_;
  AttentionPlanner planner_;
  AttentionPlan plan_;
  std::vector<Sequence> seqs_;
  std::vector<std::vector<QueryToken>> queries_;
  std::vector<TokenId> tokens_;
  std::vector<int32_t> logit_rows_;
  engine::SamplingParams sampling_params_;
  std::vector<engine::RowSampling> sampling_rows_;
  std::vector<engine::SampledToken> sampled_;
  size_t weight_read_bytes_ = 0;
  int64_t kv_token_bytes_ = 0;
};

// One timed speculative step: the draft's d level steps, then the target's verify.
struct SpecRecord {
  std::vector<ForwardRecord> draft;  // one per level
  ForwardRecord verify;
  double wall_us = 0;  // the whole step, commits included
  bool finite() const {
    return verify.finite &&
           std::all_of(draft.begin(), draft.end(), [](const ForwardRecord& r) { return r.finite; });
  }
};

template <typename T, typename F>
Samples stat(const std::vector<T>& records, F f) {
  std::vector<double> v;
  for (const T& r : records) v.push_back(f(r));
  return summarize(v);
}

std::vector<int> parse_list(const std::string& text, const char* flag) {
  std::vector<int> out;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    int value = 0;
    if (!absl::SimpleAtoi(part, &value) || value <= 0) {
      std::fprintf(stderr, "%s: '%s' is not a list of positive integers\n", flag, text.c_str());
      std::exit(1);
    }
    out.push_back(value);
  }
  return out;
}

}  // namespace
}  // namespace deft::bench

int main(int argc, char** argv) {
  using namespace deft;
  using namespace deft::bench;
  std::string workloads = DEFT_WORKLOADS_DIR, out, batches_arg = "1,16", trees_arg = "16,32,64,128";
  int steps = 30, prompt_tokens = 1000;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--workloads")
      workloads = argv[i + 1];
    else if (flag == "--out")
      out = argv[i + 1];
    else if (flag == "--steps")
      steps = std::atoi(argv[i + 1]);
    else if (flag == "--batches")
      batches_arg = argv[i + 1];
    else if (flag == "--trees")
      trees_arg = argv[i + 1];
    else if (flag == "--prompt-tokens")
      prompt_tokens = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 1;
    }
  }
  const std::vector<int> batches = parse_list(batches_arg, "--batches");
  const std::vector<int> tree_sizes = parse_list(trees_arg, "--trees");
  if (steps < 1 || prompt_tokens < 1 || prompt_tokens > kMaxRows) {
    std::fprintf(stderr, "--steps must be >= 1 and --prompt-tokens in [1, %d]\n", kMaxRows);
    return 1;
  }

  // The trees: the APPS files' rank-path trees; 16 = the first 15 entries of the 32-token one
  // (Medusa lists a tree's entries most probable first, every parent before its children).
  std::vector<TreeShape> shapes;
  for (const int t : tree_sizes) {
    const int file_t = t == 16 ? 32 : t;
    const std::string path =
        workloads + "/speculative_decoding/apps_tree_size" + std::to_string(file_t) + ".json";
    absl::StatusOr<SpecDecTrace> trace = load_specdec_trace(path);
    must(trace.status(), "trace");
    if (trace->tree_size() < t || (t != 16 && trace->tree_size() != t)) {
      std::fprintf(stderr, "%s: %d tokens, not %d\n", path.c_str(), trace->tree_size(), t);
      return 1;
    }
    TreeShape shape =
        make_shape("t" + std::to_string(t),
                   std::vector<int32_t>(trace->parent.begin(), trace->parent.begin() + t));
    int64_t sum = 0;
    for (const auto& record : trace->accept_lengths) {
      for (const int32_t a : record) {
        shape.accept.push_back(std::clamp(a, 1, shape.max_depth + 1));
        sum += a;
      }
    }
    if (t != 16 && !shape.accept.empty())
      shape.apps_accept_mean = double(sum) / shape.accept.size();
    if (shape.accept.empty()) shape.accept = {1};
    shapes.push_back(std::move(shape));
  }
  const TreeShape one_token = make_shape("t1", {-1});

  const double read_bytes_per_s = measure_and_print_device_read_bandwidth();
  const models::ModelConfig target_config = llama3_8b_config();
  const models::ModelConfig draft_config = llama3_2_1b_config();
  const models::LlamaCudaOptions options = {.num_kv_slots = int64_t{kNumPages} * kPageTokens,
                                            .page_tokens = kPageTokens,
                                            .max_batch_rows = kMaxRows};
  Clock::time_point t_load = Clock::now();
  absl::StatusOr<std::unique_ptr<models::LlamaCudaRunner>> target_runner =
      models::LlamaCudaRunner::create_random(target_config, options, 1, "llama3-8b-random");
  must(target_runner.status(), "target runner");
  absl::StatusOr<std::unique_ptr<models::LlamaCudaRunner>> draft_runner =
      models::LlamaCudaRunner::create_random(draft_config, options, 2, "llama3.2-1b-random");
  must(draft_runner.status(), "draft runner");
  std::printf(
      "target (Llama-3-8B shape) %.2f GB and draft (Llama-3.2-1B shape) %.2f GB of "
      "random weights ready in %.1f s\n",
      (*target_runner)->weight_bytes() / 1e9, (*draft_runner)->weight_bytes() / 1e9,
      us_since(t_load) / 1e6);
  Model target(**target_runner, target_config);
  Model draft(**draft_runner, draft_config);

  cudaDeviceProp prop;
  DEFT_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const std::string gpu = prop.name;
  const std::string tag = BenchResult::gpu_tag(gpu);
  BenchResult result("spec_step", gpu, tag, argc, argv);
  std::mt19937 rng(11);

  const auto floor_of = [&](const ForwardRecord& r, double bytes_per_s) {
    return BenchResult::floor_us(r.floor_bytes, r.flops, bytes_per_s);
  };
  const auto forward_extra = [&](const std::vector<ForwardRecord>& recs) {
    const Samples gpu_us = stat(recs, [](const ForwardRecord& r) { return r.gpu_us; });
    const Samples measured =
        stat(recs, [&](const ForwardRecord& r) { return floor_of(r, read_bytes_per_s); });
    return nlohmann::json{{"gpu_us", gpu_us.median},
                          {"gpu_p10_p90_us", {gpu_us.p10, gpu_us.p90}},
                          {"rows", recs.front().rows},
                          {"floor_us_at_device_read", measured.median},
                          {"device_read_bytes_per_s", read_bytes_per_s}};
  };

  std::printf("%-16s %-17s %6s %10s %10s %10s %8s %8s %9s %9s %8s\n", "case", "method", "rows",
              "wall_us", "gpu_us", "floor_us", "x_plain", "x_floor", "tok/s", "plain/s", "speedup");
  for (const int batch : batches) {
    target.start(batch, prompt_tokens);
    draft.start(batch, prompt_tokens);
    const std::string batch_case =
        "b" + std::to_string(batch) + "_ctx" + std::to_string(prompt_tokens);
    // Plain decoding on the target: one row per sequence.
    std::vector<ForwardRecord> plain;
    target.set_timing(models::StepTiming::kTotal);
    const models::CudaGraphStats plain_before = target.graph_stats();
    for (int s = 0; s < kWarmupSteps + steps; ++s) {
      target.hang(one_token);
      ForwardRecord rec = target.step(one_token, -1, 0, rng);
      target.commit(1);
      if (s >= kWarmupSteps) plain.push_back(rec);
    }
    const int64_t plain_graph_steps = target.graph_stats().graph_steps - plain_before.graph_steps;
    const Samples plain_wall = stat(plain, [](const ForwardRecord& r) { return r.wall_us; });
    const Samples plain_floor = stat(
        plain, [&](const ForwardRecord& r) { return floor_of(r, BenchResult::kHbmBytesPerS); });
    const bool plain_finite =
        std::all_of(plain.begin(), plain.end(), [](const ForwardRecord& r) { return r.finite; });
    const double plain_tokens_per_s = batch / (plain_wall.median * 1e-6);
    std::printf("%-16s %-17s %6d %10.0f %10.0f %10.0f %8s %8.2f %9.0f\n", batch_case.c_str(),
                "plain_decode", plain.front().rows, plain_wall.median,
                stat(plain, [](const ForwardRecord& r) { return r.gpu_us; }).median,
                plain_floor.median, "", plain_wall.median / plain_floor.median, plain_tokens_per_s);
    if (plain_finite) {
      ResultRow row{.case_name = batch_case, .method = "plain_decode"};
      row.set_times(plain_wall);
      row.repetitions = steps;
      row.floor_us = plain_floor.median;
      row.extra = forward_extra(plain);
      row.extra["tokens_per_s"] = plain_tokens_per_s;
      row.extra["graph_steps"] = plain_graph_steps;
      row.extra["floor_bytes_weights"] = target.weight_read_bytes();
      result.add(row);
    } else {
      std::printf("  plain decode: non-finite logits or bad tokens, rows not written\n");
    }

    // Where a one-row-per-sequence step of each model spends its GPU time (events after every
    // launch, so eager and a little slower than the rows above), and the draft's step without
    // the top logprobs a tree needs.
    const auto one_row_steps = [&](Model& model, models::StepTiming timing, int32_t top) {
      std::vector<ForwardRecord> recs;
      model.set_timing(timing);
      for (int s = 0; s < kWarmupSteps + steps; ++s) {
        model.hang(one_token);
        ForwardRecord rec = model.step(one_token, -1, top, rng);
        model.commit(1);
        if (s >= kWarmupSteps) recs.push_back(rec);
      }
      model.set_timing(models::StepTiming::kTotal);
      return recs;
    };
    const auto phase_split = [&](const std::vector<ForwardRecord>& recs) {
      const auto ms = [&](auto f) { return stat(recs, f).median * 1e3; };
      return nlohmann::json{
          {"note", "eager, an event after every launch (StepTiming::kPhases); medians in us"},
          {"gpu_total", ms([](const ForwardRecord& r) { return r.times.total_ms; })},
          {"attention", ms([](const ForwardRecord& r) { return r.times.attention_ms; })},
          {"gemm", ms([](const ForwardRecord& r) { return r.times.gemm_ms; })},
          {"other_kernels", ms([](const ForwardRecord& r) { return r.times.other_ms; })},
          {"gpu_sampling", ms([](const ForwardRecord& r) { return r.times.sampling_ms; })},
          {"copies", ms([](const ForwardRecord& r) { return r.times.copy_ms; })}};
    };
    struct Diagnostic {
      const char* method;
      Model* model;
      models::StepTiming timing;
      int32_t top_logprobs;
    };
    for (const Diagnostic& d :
         {Diagnostic{"plain_decode_phases", &target, models::StepTiming::kPhases, 0},
          Diagnostic{"draft_step_phases", &draft, models::StepTiming::kPhases, kDraftTopLogprobs},
          Diagnostic{"draft_step_greedy_only", &draft, models::StepTiming::kTotal, 0}}) {
      const std::vector<ForwardRecord> recs = one_row_steps(*d.model, d.timing, d.top_logprobs);
      if (!std::all_of(recs.begin(), recs.end(), [](const ForwardRecord& r) { return r.finite; })) {
        std::printf("%-16s %s: non-finite logits or bad tokens, row not written\n",
                    batch_case.c_str(), d.method);
        continue;
      }
      const Samples wall = stat(recs, [](const ForwardRecord& r) { return r.wall_us; });
      ResultRow row{.case_name = batch_case, .method = d.method};
      row.set_times(wall);
      row.repetitions = steps;
      row.floor_us = stat(recs, [&](const ForwardRecord& r) {
                       return floor_of(r, BenchResult::kHbmBytesPerS);
                     }).median;
      row.extra = forward_extra(recs);
      row.extra["top_logprobs_per_row"] = d.top_logprobs;
      if (d.timing == models::StepTiming::kPhases) row.extra["gpu_phases_us"] = phase_split(recs);
      std::printf("%-16s %-22s %1d %10.0f %10.0f %10.0f   %s\n", batch_case.c_str(), d.method,
                  recs.front().rows, wall.median, row.extra["gpu_us"].get<double>(), row.floor_us,
                  d.timing == models::StepTiming::kPhases ? phase_split(recs).dump().c_str() : "");
      result.add(row);
    }

    for (const TreeShape& shape : shapes) {
      std::vector<SpecRecord> spec;
      draft.set_timing(models::StepTiming::kTotal);
      const int64_t target_graphs_before = target.graph_stats().graph_steps;
      const int64_t draft_graphs_before = draft.graph_stats().graph_steps;
      for (int s = 0; s < kWarmupSteps + steps; ++s) {
        SpecRecord rec;
        const Clock::time_point t0 = Clock::now();
        draft.hang(shape);
        for (int32_t level = 0; level < shape.max_depth; ++level) {
          rec.draft.push_back(draft.step(shape, level, kDraftTopLogprobs, rng));
        }
        target.hang(shape);
        rec.verify = target.step(shape, -1, 0, rng);
        const int32_t accepted = shape.accept[s % shape.accept.size()];
        target.commit(accepted);
        draft.commit(accepted);
        rec.wall_us = us_since(t0);
        if (s >= kWarmupSteps) spec.push_back(std::move(rec));
      }
      const std::string tree_case = batch_case + "_" + shape.name;
      const bool finite =
          std::all_of(spec.begin(), spec.end(), [](const SpecRecord& r) { return r.finite(); });
      if (!finite || !plain_finite) {
        std::printf("%-16s non-finite logits or bad tokens: rows not written\n", tree_case.c_str());
        continue;
      }
      // Draft steps, summed over the levels.
      std::vector<ForwardRecord> drafts, verifies;
      for (const SpecRecord& r : spec) {
        ForwardRecord sum;
        for (const ForwardRecord& level : r.draft) {
          sum.wall_us += level.wall_us;
          sum.gpu_us += level.gpu_us;
          sum.rows += level.rows;
          sum.floor_bytes += level.floor_bytes;
          sum.flops += level.flops;
        }
        drafts.push_back(sum);
        verifies.push_back(r.verify);
      }
      // A sum of floors: each forward reads its own weights.
      const auto sum_floor = [&](const SpecRecord& r, double bytes_per_s) {
        double us = floor_of(r.verify, bytes_per_s);
        for (const ForwardRecord& level : r.draft) us += floor_of(level, bytes_per_s);
        return us;
      };
      const auto draft_floor = [&](const SpecRecord& r, double bytes_per_s) {
        double us = 0;
        for (const ForwardRecord& level : r.draft) us += floor_of(level, bytes_per_s);
        return us;
      };
      const Samples draft_wall = stat(drafts, [](const ForwardRecord& r) { return r.wall_us; });
      const Samples draft_floor_us = stat(
          spec, [&](const SpecRecord& r) { return draft_floor(r, BenchResult::kHbmBytesPerS); });
      const Samples verify_wall = stat(verifies, [](const ForwardRecord& r) { return r.wall_us; });
      const Samples verify_floor = stat(verifies, [&](const ForwardRecord& r) {
        return floor_of(r, BenchResult::kHbmBytesPerS);
      });
      const Samples spec_wall = stat(spec, [](const SpecRecord& r) { return r.wall_us; });
      const Samples spec_gpu = stat(spec, [](const SpecRecord& r) {
        double us = r.verify.gpu_us;
        for (const ForwardRecord& level : r.draft) us += level.gpu_us;
        return us;
      });
      const Samples spec_floor =
          stat(spec, [&](const SpecRecord& r) { return sum_floor(r, BenchResult::kHbmBytesPerS); });
      const Samples spec_measured_floor =
          stat(spec, [&](const SpecRecord& r) { return sum_floor(r, read_bytes_per_s); });

      nlohmann::json levels = nlohmann::json::array();
      for (int32_t level = 0; level < shape.max_depth; ++level) {
        std::vector<ForwardRecord> at;
        for (const SpecRecord& r : spec) at.push_back(r.draft[level]);
        nlohmann::json entry = forward_extra(at);
        entry["level"] = level;
        entry["wall_us"] = stat(at, [](const ForwardRecord& r) { return r.wall_us; }).median;
        entry["floor_us"] = stat(at, [&](const ForwardRecord& r) {
                              return floor_of(r, BenchResult::kHbmBytesPerS);
                            }).median;
        levels.push_back(entry);
      }
      const nlohmann::json tree_json = {
          {"tree_tokens", shape.size()},
          {"depth", shape.max_depth},
          {"tree", shape.name == "t16" ? "first 15 entries of apps_tree_size32"
                                       : "apps_tree_size" + std::to_string(shape.size())}};

      ResultRow draft_row{.case_name = tree_case, .method = "draft_steps"};
      draft_row.set_times(draft_wall);
      draft_row.repetitions = steps;
      draft_row.floor_us = draft_floor_us.median;
      draft_row.extra = forward_extra(drafts);
      draft_row.extra["levels"] = levels;
      draft_row.extra["draft_steps"] = shape.max_depth;
      draft_row.extra["ratio_to_plain_decode"] = draft_wall.median / plain_wall.median;
      draft_row.extra["tree"] = tree_json;
      draft_row.extra["top_logprobs_per_row"] = kDraftTopLogprobs;
      draft_row.extra["floor_bytes_weights"] = draft.weight_read_bytes();
      result.add(draft_row);

      ResultRow verify_row{.case_name = tree_case, .method = "verify"};
      verify_row.set_times(verify_wall);
      verify_row.repetitions = steps;
      verify_row.floor_us = verify_floor.median;
      verify_row.extra = forward_extra(verifies);
      verify_row.extra["ratio_to_plain_decode"] = verify_wall.median / plain_wall.median;
      verify_row.extra["gpu_ratio_to_plain_decode"] =
          stat(verifies, [](const ForwardRecord& r) { return r.gpu_us; }).median /
          stat(plain, [](const ForwardRecord& r) { return r.gpu_us; }).median;
      verify_row.extra["tree"] = tree_json;
      result.add(verify_row);

      const double ratio = spec_wall.median / plain_wall.median;
      ResultRow spec_row{.case_name = tree_case, .method = "speculative_step"};
      spec_row.set_times(spec_wall);
      spec_row.repetitions = steps;
      spec_row.floor_us = spec_floor.median;
      spec_row.extra = {
          {"gpu_us", spec_gpu.median},
          {"floor_us_at_device_read", spec_measured_floor.median},
          {"ratio_to_plain_decode", ratio},
          {"plain_decode_us", plain_wall.median},
          {"draft_steps_us", draft_wall.median},
          {"verify_us", verify_wall.median},
          {"tree", tree_json},
          {"tokens_per_step_for_3x_plain", 3.0 * ratio},
          {"graph_steps",
           {{"target", target.graph_stats().graph_steps - target_graphs_before},
            {"draft", draft.graph_stats().graph_steps - draft_graphs_before},
            {"of_forwards", int64_t{kWarmupSteps + steps} * (shape.max_depth + 1)}}},
      };
      double tokens_per_s = 0, speedup = 0;
      if (shape.apps_accept_mean > 0) {
        tokens_per_s = batch * shape.apps_accept_mean / (spec_wall.median * 1e-6);
        speedup = tokens_per_s / plain_tokens_per_s;
        spec_row.extra["apps_accept_length_mean"] = shape.apps_accept_mean;
        spec_row.extra["tokens_per_s_at_apps_acceptance"] = tokens_per_s;
        spec_row.extra["plain_tokens_per_s"] = plain_tokens_per_s;
        spec_row.extra["speedup_over_plain"] = speedup;
        // The same acceptance with drafts that cost nothing (Medusa heads run inside the verify):
        // the bound the verify alone sets.
        spec_row.extra["speedup_if_drafting_were_free"] =
            shape.apps_accept_mean * plain_wall.median / verify_wall.median;
      }
      result.add(spec_row);

      std::printf("%-16s %-17s %6d %10.0f %10.0f %10.0f %8.2f %8.2f\n", tree_case.c_str(),
                  "draft_steps", drafts.front().rows, draft_wall.median,
                  stat(drafts, [](const ForwardRecord& r) { return r.gpu_us; }).median,
                  draft_floor_us.median, draft_wall.median / plain_wall.median,
                  draft_wall.median / draft_floor_us.median);
      std::printf("%-16s %-17s %6d %10.0f %10.0f %10.0f %8.2f %8.2f\n", tree_case.c_str(), "verify",
                  verifies.front().rows, verify_wall.median,
                  stat(verifies, [](const ForwardRecord& r) { return r.gpu_us; }).median,
                  verify_floor.median, verify_wall.median / plain_wall.median,
                  verify_wall.median / verify_floor.median);
      std::printf("%-16s %-17s %6s %10.0f %10.0f %10.0f %8.2f %8.2f %9.0f %9.0f %8.2f\n",
                  tree_case.c_str(), "speculative_step", "", spec_wall.median, spec_gpu.median,
                  spec_floor.median, ratio, spec_wall.median / spec_floor.median, tokens_per_s,
                  plain_tokens_per_s, speedup);
    }
    target.set_timing(models::StepTiming::kOff);
    draft.set_timing(models::StepTiming::kOff);
  }
  std::printf("wrote %s\n", result.write(out).c_str());
  return 0;
}
