// workload_replay: the DeFT paper's workloads (../shared/workloads/README.md, its Table 3)
// replayed whole through the engine (engine::Scheduler + models::LlamaCudaRunner, the code the
// server runs) on a random-weight Llama-3-8B-shaped model (bf16, CUDA graphs), every method in
// the same run. How each family is driven: bench/workload_replay/workload_replay_driver.h.
//
// Cases (names as ../shared/BENCH_RESULTS.md asks: the workload files without .json):
//   fewshot_b20, fewshot_b30, fewshot_b50  a 4000-token prompt, b branches, 400 iterations
//   fewshot_b64  the same with 64 branches, only when named: not a paper workload, the engine
//     side of serve_bench's 64-row comparison (bench/README.md)
//   sorting128ToT, docmergeToT, keywordToT, set128ToT  the first complete tree, every iteration
//   apps_tree_size{32,64,128,256}  the first record's APPS prompt (1016 Llama 3 tokens), its
//     Accept_length sequence step by step (cycled) until prompt + committed = 6000 tokens
//     (1151 steps)
//   apps_tree_size{32,64,128,256}_p{1000,6000}  the prompt cut to 1000 / padded to 6000 tokens
//     (the paper's prompt-length ablation), the record's Accept_length sequence once (401
//     steps, 1738 tokens: 7738 positions at most, inside Llama 3's 8192)
// Methods: deft_flatten, sequence, deft_node, deft_node_chunk, dense_mask (planner kinds), and
// no_attention (DeFT-Flatten's steps with no attention launched,
// LlamaCudaRunner::set_attention_skipped: the paper's upper bound).
//
// Per case and method: decoding latency (the replay's engine steps after the prompt: wall time
// of Scheduler::prepare + step, summed), prefill time (the prompt's steps), attention time (the
// scheduler times attention on every 16th step with per-launch events, as the server does;
// scaled to all iterations), and the floor summed over the iterations: per step
// max((weights read + the tree's KV) bytes / 3.0 TB/s, FLOPs / 700 TFLOP/s), weights without
// the embedding table, FLOPs 2 per weight per row plus 4 * q_size per (query, visible token) per
// layer (../shared/BENCH_RESULTS.md; the bytes-only floor is in extra too).
// Sampling (--stride): reasoning and speculative cases run every stride-th iteration through
// the engine and fast-forward the others' tree edits; each run step stands for `stride`
// iterations. Few-shot always runs every iteration (a Generate job cannot skip). Defaults fit
// one run in ~5-6 minutes on an H100 (bench/README.md).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "bench/bench_result.h"
#include "bench/device_read_bandwidth.h"
#include "bench/llama3_8b_config.h"
#include "bench/workload_replay/workload_replay_driver.h"
#include "bench/workload_trace.h"
#include "engine/attention_planner.h"
#include "engine/tokenizer/tokenizer.h"
#include "kernels/cuda_check.h"
#include "models/llama_cuda.h"

namespace deft::bench {
namespace {

using engine::PlanKind;
using Clock = std::chrono::steady_clock;

constexpr char kUsage[] = R"(workload_replay: the DeFT paper's workloads through the engine on a
random-weight Llama-3-8B-shaped model (CUDA), every method in one run.

  workload_replay [--workloads DIR] [--out DIR] [--case NAMES] [--method NAMES]
                  [--max-steps N] [--stride LIST] [--tokenizer DIR] [--deadline-s S]
                  [--model-config FILE]

  --workloads DIR  the traces (default: ../shared/workloads beside the source tree)
  --out DIR        where workload_replay-<gpu>-<date>.json goes (default: bench/results/)
  --case NAMES     comma-separated cases (default: all but fewshot_b64): fewshot_b20,
                   fewshot_b30, fewshot_b50, sorting128ToT, docmergeToT, keywordToT, set128ToT,
                   apps_tree_size{32,64,128,256}, apps_tree_size{32,64,128,256}_p{1000,6000},
                   fewshot_b64 (64 branches: the engine side of serve_bench's 64-row step)
  --method NAMES   comma-separated methods (default: all): deft_flatten, sequence, deft_node,
                   deft_node_chunk, dense_mask, no_attention
  --max-steps N    replay at most N iterations of each workload (0, the default: all)
  --stride LIST    reasoning and speculative cases run one iteration in K through the engine
                   and fast-forward the others' tree edits: "method=K,...,K" (a bare K sets
                   the methods not named; default "deft_flatten=1,sequence=4,8"; "1": every
                   iteration of every method, ~15 minutes on an H100)
  --tokenizer DIR  Llama 3's tokenizer.json folder for the APPS prompt (default:
                   .cache/tokenizers/llama3 in the source tree; without one the prompt is
                   1016 random ids, the length Llama 3 gives it)
  --deadline-s S   start no case/method after S seconds of the run (default 450; 0: none);
                   the ones left are listed, not run
  --model-config FILE  a Hugging Face config.json whose shape the random model takes instead of
                   Llama-3-8B's (e.g. the one bench/make_random_checkpoint.py wrote for the
                   server serve_bench drove, to compare the same steps)
)";

struct Method {
  std::string name;
  PlanKind kind;
  bool skip_attention;
};
const std::vector<Method> kMethods = {{"deft_flatten", PlanKind::kDeftFlatten, false},
                                      {"sequence", PlanKind::kSequence, false},
                                      {"deft_node", PlanKind::kDeftNode, false},
                                      {"deft_node_chunk", PlanKind::kDeftNodeChunk, false},
                                      {"dense_mask", PlanKind::kDenseMask, false},
                                      {"no_attention", PlanKind::kDeftFlatten, true}};

struct Case {
  std::string name;
  std::string family;  // fewshot | reasoning | specdec
  Workload workload;
  // The paper's A100 decoding latency (s): DeFT-Flatten and Radix Attention; 0: none.
  double paper_flatten_s = 0, paper_radix_s = 0;
};

constexpr int32_t kPageTokens = 16;
constexpr int32_t kKvPages = 4096;        // 65536 slots: 8.6 GB of KV, more than any case holds
constexpr int32_t kMaxStepTokens = 2048;  // prompt rows per prefill step

void must(const absl::Status& status, const char* what) {
  if (!status.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, status.ToString().c_str());
    std::exit(1);
  }
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// "%.3f" of x, or "-" when there is no figure (x <= 0).
std::string figure(double x) {
  if (!(x > 0)) return "-";
  char text[32];
  std::snprintf(text, sizeof(text), "%.3f", x);
  return text;
}

// "deft_flatten=1,sequence=4,8" -> per method; false with a message on a bad list.
bool parse_strides(const std::string& list, std::map<std::string, int32_t>& strides,
                   std::string& error) {
  int32_t rest = 1;
  std::map<std::string, int32_t> named;
  const std::vector<std::string> items = absl::StrSplit(list, ',', absl::SkipEmpty());
  for (const std::string& item : items) {
    const std::vector<std::string> parts = absl::StrSplit(item, '=');
    int32_t k = 0;
    if (parts.size() > 2 || !absl::SimpleAtoi(parts.back(), &k) || k < 1) {
      error = "--stride: '" + item + "' is not K or method=K with K >= 1";
      return false;
    }
    if (parts.size() == 1) {
      rest = k;
      continue;
    }
    if (std::none_of(kMethods.begin(), kMethods.end(),
                     [&](const Method& m) { return m.name == parts[0]; })) {
      error = "--stride: unknown method '" + parts[0] + "'";
      return false;
    }
    named[parts[0]] = k;
  }
  for (const Method& m : kMethods) strides[m.name] = named.count(m.name) ? named[m.name] : rest;
  return true;
}

// The phase split of the steps whose attention the scheduler timed (eager, events per launch).
struct PhaseSums {
  int64_t steps = 0;
  double total_ms = 0, attention_ms = 0, gemm_ms = 0, other_ms = 0, copy_ms = 0;
};

struct RowFigures {
  double decode_s = 0, prefill_s = 0, attention_s = -1, floor_s = 0, floor_bytes_only_s = 0;
  double floor_measured_s = 0;
  double attention_kv_bytes = 0;  // what the plans read for attention, all layers (estimated)
  int64_t steps_run = 0, iterations = 0, prefill_steps = 0, attention_timed_steps = 0;
  Samples step_us;
  double host_plan_s = 0;
};

RowFigures figures(const ReplayResult& result, const models::ModelConfig& config,
                   double weight_read_bytes, double read_bytes_per_s) {
  RowFigures f;
  const double kv_token_bytes = 2.0 * config.num_hidden_layers * config.kv_size() * 2;
  const double weight_params = weight_read_bytes / 2.0;
  double timed_weight = 0, timed_attention = 0;
  std::vector<double> step_us;
  for (const StepRecord& step : result.steps) {
    if (step.iteration < 0) {
      f.prefill_s += step.wall_seconds;
      ++f.prefill_steps;
      continue;
    }
    const double w = step.weight;
    f.decode_s += w * step.wall_seconds;
    f.host_plan_s += w * step.plan_seconds;
    f.iterations += step.weight;
    ++f.steps_run;
    step_us.push_back(step.wall_seconds * 1e6);
    const double bytes = weight_read_bytes + kv_token_bytes * double(step.tree_kv_tokens);
    const double flops =
        2.0 * weight_params * double(step.rows) +
        4.0 * config.q_size() * double(step.query_path_tokens) * config.num_hidden_layers;
    f.floor_s += w * BenchResult::floor_us(bytes, flops) * 1e-6;
    f.floor_measured_s += w * BenchResult::floor_us(bytes, flops, read_bytes_per_s) * 1e-6;
    f.floor_bytes_only_s += w * bytes / BenchResult::kHbmBytesPerS;
    f.attention_kv_bytes += w * kv_token_bytes * double(step.kv_tokens_read);
    if (step.attention_seconds >= 0) {
      timed_weight += w;
      timed_attention += w * step.attention_seconds;
      ++f.attention_timed_steps;
    }
  }
  if (timed_weight > 0) f.attention_s = timed_attention / timed_weight * double(f.iterations);
  f.step_us = summarize(step_us);
  return f;
}

// The tree every iteration should have, from the workload alone (bench/README.md's replay
// rules, as the CPU test computes them), and the tokens the replay should have produced: every
// iteration counts, the ones stride sampling fast-forwarded included.
struct ExpectedReplay {
  std::vector<IterationShape> shape;
  int64_t tokens = 0;
};

ExpectedReplay expected_replay(const Workload& workload, int64_t prompt, int64_t iterations) {
  ExpectedReplay want;
  if (const auto* fewshot = std::get_if<FewShotWorkload>(&workload)) {
    for (int64_t it = 1; it <= iterations; ++it) {
      want.shape.push_back(
          {.queries = fewshot->branches, .tree_tokens = prompt + fewshot->branches * it});
    }
    want.tokens = int64_t{fewshot->branches} * (iterations + 1);  // the first from the prompt
  } else if (const auto* reasoning = std::get_if<ReasoningWorkload>(&workload)) {
    // Live at `it`: start <= it <= end; a childless node is gone after its end.
    const ReasoningTrace& trace = reasoning->trace;
    for (int64_t it = 1; it <= iterations; ++it) {
      IterationShape s{.queries = 0, .tree_tokens = prompt};
      for (size_t id = 1; id < trace.nodes.size(); ++id) {
        const ReasoningTrace::Node& n = trace.nodes[id];
        if (n.start > it || (n.children.empty() && n.end < it)) continue;
        s.tree_tokens += std::min<int64_t>(n.length, it - n.start + 1);
        s.queries += n.end >= it ? 1 : 0;
      }
      want.shape.push_back(s);
      want.tokens += s.queries;
    }
  } else {
    // Step s: the whole token tree under the session node holding what was committed before.
    const auto& spec = std::get<SpecDecWorkload>(workload);
    const auto size = static_cast<int32_t>(spec.parents.size());
    for (int64_t s = 0; s < iterations; ++s) {
      want.shape.push_back({.queries = size, .tree_tokens = prompt + want.tokens + size});
      const int64_t recorded =
          spec.accept_lengths[static_cast<size_t>(s % std::ssize(spec.accept_lengths))];
      want.tokens += std::min<int64_t>(recorded, spec.generate_tokens - want.tokens);
    }
  }
  return want;
}

// The CPU test's checks, on the GPU: every iteration's tree (run or fast-forwarded), the steps'
// weights, the tokens produced, and the KV freed.
absl::Status check_shape(const Case& c, const ReplayResult& result, int64_t iterations) {
  int64_t weights = 0;
  for (const StepRecord& step : result.steps) weights += step.iteration > 0 ? step.weight : 0;
  if (weights != iterations || std::ssize(result.iterations) != iterations) {
    return absl::InternalError(absl::StrCat("replayed ", weights, " iterations (",
                                            result.iterations.size(), " shapes) of ", iterations));
  }
  const ExpectedReplay expected = expected_replay(c.workload, result.prompt_tokens, iterations);
  for (size_t i = 0; i < expected.shape.size(); ++i) {
    const IterationShape& got = result.iterations[i];
    const IterationShape& shape = expected.shape[i];
    if (got.queries != shape.queries || got.tree_tokens != shape.tree_tokens) {
      return absl::InternalError(
          absl::StrCat("iteration ", i + 1, ": ", got.queries, " queries over ", got.tree_tokens,
                       " tree tokens, expected ", shape.queries, " over ", shape.tree_tokens));
    }
  }
  const int64_t want = expected.tokens;
  if (result.generated_tokens != want) {
    return absl::InternalError(
        absl::StrCat("produced ", result.generated_tokens, " tokens, expected ", want));
  }
  if (result.kv_pages_left != 0) {
    return absl::InternalError(absl::StrCat(result.kv_pages_left, " KV pages left after the work"));
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace deft::bench

int main(int argc, char** argv) {
  using namespace deft;
  using namespace deft::bench;
  const Clock::time_point run_start = Clock::now();
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // progress lines through a pipe, as they come
  std::string workloads = DEFT_WORKLOADS_DIR, out, case_arg, method_arg, model_config_path;
  std::string stride_arg = "deft_flatten=1,sequence=4,8";
  std::string tokenizer_dir = std::string(DEFT_SOURCE_DIR) + "/.cache/tokenizers/llama3";
  int64_t max_steps = 0;
  double deadline_s = 450;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "%s needs a value\n%s", flag.c_str(), kUsage);
      return 1;
    }
    const std::string value = argv[++i];
    bool ok = true;
    if (flag == "--workloads")
      workloads = value;
    else if (flag == "--out")
      out = value;
    else if (flag == "--case")
      case_arg = value;
    else if (flag == "--method")
      method_arg = value;
    else if (flag == "--stride")
      stride_arg = value;
    else if (flag == "--tokenizer")
      tokenizer_dir = value;
    else if (flag == "--model-config")
      model_config_path = value;
    else if (flag == "--max-steps")
      ok = absl::SimpleAtoi(value, &max_steps) && max_steps >= 0;
    else if (flag == "--deadline-s")
      ok = absl::SimpleAtod(value, &deadline_s) && deadline_s >= 0;
    else {
      std::fprintf(stderr, "unknown flag %s\n%s", flag.c_str(), kUsage);
      return 1;
    }
    if (!ok) {
      std::fprintf(stderr, "%s: '%s' is not a number >= 0\n", flag.c_str(), value.c_str());
      return 1;
    }
  }
  std::map<std::string, int32_t> strides;
  std::string error;
  if (!parse_strides(stride_arg, strides, error)) {
    std::fprintf(stderr, "%s\n", error.c_str());
    return 1;
  }
  std::vector<Method> methods;
  const std::vector<std::string> method_names = absl::StrSplit(method_arg, ',', absl::SkipEmpty());
  for (const std::string& name : method_names) {
    const auto it = std::find_if(kMethods.begin(), kMethods.end(),
                                 [&](const Method& m) { return m.name == name; });
    if (it == kMethods.end()) {
      std::fprintf(stderr, "--method: unknown method '%s'\n%s", name.c_str(), kUsage);
      return 1;
    }
    methods.push_back(*it);
  }
  if (methods.empty()) methods = kMethods;

  // The cases, in run order (a deadline drops the last ones).
  const std::vector<std::string> reasoning_tasks = {"sorting128ToT", "docmergeToT", "keywordToT",
                                                    "set128ToT"};
  const std::vector<int32_t> tree_sizes = {32, 64, 128, 256};
  std::vector<std::string> all_cases = {"fewshot_b20", "fewshot_b30", "fewshot_b50"};
  for (const std::string& task : reasoning_tasks) all_cases.push_back(task);
  for (const std::string suffix : {"", "_p1000", "_p6000"}) {
    for (int32_t t : tree_sizes) all_cases.push_back(absl::StrCat("apps_tree_size", t, suffix));
  }
  const std::string opt_in_case = "fewshot_b64";  // runs only when named
  all_cases.push_back(opt_in_case);
  std::vector<std::string> wanted;
  const std::vector<std::string> case_names = absl::StrSplit(case_arg, ',', absl::SkipEmpty());
  for (const std::string& name : case_names) {
    if (std::find(all_cases.begin(), all_cases.end(), name) == all_cases.end()) {
      std::fprintf(stderr, "--case: unknown case '%s'\n%s", name.c_str(), kUsage);
      return 1;
    }
    wanted.push_back(name);
  }
  const auto selected = [&](const std::string& name) {
    if (wanted.empty()) return name != opt_in_case;
    return std::find(wanted.begin(), wanted.end(), name) != wanted.end();
  };

  // The tokenizer: Llama 3's encodes the APPS prompt (and streams the few-shot tokens, as the
  // server would); the default model's stands in without it.
  if (!std::filesystem::exists(tokenizer_dir + "/tokenizer.json")) {
    std::printf(
        "no tokenizer.json in %s: the default model's tokenizer streams tokens and the "
        "APPS prompt is %d random ids\n",
        tokenizer_dir.c_str(), kAppsPromptLlama3Tokens);
    tokenizer_dir = std::string(DEFT_SOURCE_DIR) + "/models/default";
  }
  absl::StatusOr<std::unique_ptr<engine::Tokenizer>> tokenizer =
      engine::load_tokenizer(tokenizer_dir);
  must(tokenizer.status(), "tokenizer");

  models::ModelConfig config = llama3_8b_config();
  std::string model_name = "llama3-8b-random";
  if (!model_config_path.empty()) {
    absl::StatusOr<models::ModelConfig> loaded = models::load_model_config(model_config_path);
    must(loaded.status(), "--model-config");
    config = *loaded;
    config.torch_dtype = models::DType::kBF16;  // the replay runs bf16 whatever the file says
    model_name =
        absl::StrCat(config.num_hidden_layers, "-layer random model of ", model_config_path);
  }
  std::vector<Case> cases;
  const std::map<std::string, std::pair<double, double>> paper = {
      {"fewshot_b20", {9.98, 12.37}},        {"fewshot_b30", {10.99, 14.08}},
      {"fewshot_b50", {12.48, 16.54}},       {"sorting128ToT", {94.67, 104.79}},
      {"docmergeToT", {66.95, 69.61}},       {"keywordToT", {10.90, 11.25}},
      {"set128ToT", {16.10, 17.03}},         {"apps_tree_size32", {42.23, 54.66}},
      {"apps_tree_size64", {46.60, 69.75}},  {"apps_tree_size128", {56.96, 108.56}},
      {"apps_tree_size256", {84.27, 188.66}}};
  const auto add_case = [&](const std::string& name, const std::string& family, Workload w) {
    Case c{.name = name, .family = family, .workload = std::move(w)};
    if (const auto it = paper.find(name); it != paper.end()) {
      c.paper_flatten_s = it->second.first;
      c.paper_radix_s = it->second.second;
    }
    cases.push_back(std::move(c));
  };
  for (int32_t b : {20, 30, 50, 64}) {
    const std::string name = absl::StrCat("fewshot_b", b);
    if (selected(name)) {
      add_case(name, "fewshot",
               FewShotWorkload{.prompt_tokens = 4000, .branches = b, .iterations = 400});
    }
  }
  for (const std::string& task : reasoning_tasks) {
    if (!selected(task)) continue;
    absl::StatusOr<std::vector<ReasoningTrace>> traces =
        load_reasoning_traces(workloads + "/reasoning/" + task + ".json");
    must(traces.status(), "reasoning trace");
    if (traces->empty()) {
      std::fprintf(stderr, "%s: no complete tree\n", task.c_str());
      return 1;
    }
    add_case(task, "reasoning", ReasoningWorkload{.trace = traces->front()});
  }
  std::optional<std::vector<engine::TokenId>> apps_prompt;
  for (const std::string suffix : {"", "_p1000", "_p6000"}) {
    for (int32_t t : tree_sizes) {
      const std::string name = absl::StrCat("apps_tree_size", t, suffix);
      if (!selected(name)) continue;
      const std::string path =
          absl::StrCat(workloads, "/speculative_decoding/apps_tree_size", t, ".json");
      absl::StatusOr<SpecDecTrace> trace = load_specdec_trace(path);
      must(trace.status(), "speculative trace");
      if (!apps_prompt.has_value()) {
        absl::StatusOr<std::string> text = load_specdec_prompt(path);
        must(text.status(), "APPS prompt");
        apps_prompt = specdec_prompt_tokens(*text, **tokenizer, config.vocab_size, 5);
        std::printf("APPS prompt: %zu tokens (%s)\n", apps_prompt->size(),
                    is_llama3_tokenizer(**tokenizer) ? "Llama 3's tokenizer"
                                                     : "random ids of Llama 3's length");
      }
      SpecDecWorkload spec{.parents = trace->parent,
                           .accept_lengths = trace->accept_lengths.front(),
                           .prompt = *apps_prompt};
      if (suffix.empty()) {
        // Until the context holds 6000 tokens, the accept lengths cycled.
        spec.generate_tokens = 6000 - std::ssize(spec.prompt);
      } else {
        // The recorded prompt is 1016 tokens: cut to 1000, padded with random ids to 6000.
        const size_t length = suffix == "_p1000" ? 1000 : 6000;
        std::mt19937_64 rng(17);
        std::uniform_int_distribution<engine::TokenId> token(0, config.vocab_size - 1);
        spec.prompt.resize(std::min(spec.prompt.size(), length));
        while (spec.prompt.size() < length) spec.prompt.push_back(token(rng));
        spec.generate_tokens = 0;  // the recorded steps, once
        for (int32_t a : spec.accept_lengths) spec.generate_tokens += a;
      }
      add_case(name, "specdec", std::move(spec));
    }
  }

  // Before the model and its KV pool take the memory.
  const double read_bytes_per_s = measure_and_print_device_read_bandwidth();
  const Clock::time_point t_load = Clock::now();
  absl::StatusOr<std::unique_ptr<models::LlamaCudaRunner>> runner =
      models::LlamaCudaRunner::create_random(config,
                                             {.num_kv_slots = int64_t{kKvPages} * kPageTokens,
                                              .page_tokens = kPageTokens,
                                              .max_batch_rows = kMaxStepTokens,
                                              .max_cuda_graphs = 128},
                                             1, model_name);
  must(runner.status(), "runner");
  models::LlamaCudaRunner& model = **runner;
  std::printf("%s ready in %.1f s, %.2f GB weights, %.1f GB KV pool\n", model_name.c_str(),
              seconds_since(t_load), model.weight_bytes() / 1e9, model.kv_cache_bytes() / 1e9);
  const double weight_read_bytes =
      double(model.weight_bytes()) - 2.0 * config.vocab_size * config.hidden_size;

  cudaDeviceProp prop;
  DEFT_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const std::string gpu = prop.name;
  const std::string tag = BenchResult::gpu_tag(gpu);
  BenchResult result("workload_replay", gpu, tag, argc, argv);

  const auto options_for = [&](const Case& c, const Method& m) {
    ReplayOptions options{.planner = {.kind = m.kind, .min_prefill_run = 64},
                          .page_tokens = kPageTokens,
                          .kv_pages = kKvPages,
                          .max_step_tokens = kMaxStepTokens,
                          .max_iterations = max_steps,
                          .stride = c.family == "fewshot" ? 1 : strides.at(m.name)};
    return options;
  };
  // Warm-up (kernels, cuBLAS, the first graphs): a few iterations of few-shot b20.
  {
    const Clock::time_point t0 = Clock::now();
    const Workload fewshot =
        FewShotWorkload{.prompt_tokens = 4000, .branches = 20, .iterations = 16};
    ReplayOptions options{.planner = {.kind = PlanKind::kDeftFlatten, .min_prefill_run = 64},
                          .page_tokens = kPageTokens,
                          .kv_pages = kKvPages,
                          .max_step_tokens = kMaxStepTokens};
    must(replay_workload(model, **tokenizer, fewshot, options).status, "warm-up");
    std::printf("warm-up in %.1f s\n", seconds_since(t0));
  }

  std::printf(
      "%d cases x %zu methods; strides %s (reasoning, speculative); max steps %lld; "
      "deadline %.0f s\n",
      static_cast<int>(cases.size()), methods.size(), stride_arg.c_str(),
      static_cast<long long>(max_steps), deadline_s);
  struct Done {
    std::string case_name, method;
    RowFigures f;
    bool ok;
  };
  std::vector<Done> done;
  std::vector<std::string> skipped;
  const char* header = "%-24s %-16s %6s %9s %8s %8s %6s %8s %6s %8s %8s\n";
  std::printf(header, "case", "method", "stride", "decode_s", "prefill_s", "attn_s", "attn%",
              "floor_s", "xfloor", "ms/iter", "vs_seq");
  for (const Case& c : cases) {
    const int64_t iterations = max_steps > 0 ? std::min(max_steps, workload_iterations(c.workload))
                                             : workload_iterations(c.workload);
    for (const Method& m : methods) {
      if (deadline_s > 0 && seconds_since(run_start) > deadline_s) {
        skipped.push_back(c.name + "/" + m.name);
        continue;
      }
      const ReplayOptions options = options_for(c, m);
      std::printf("[%5.0f s] %s %s: %lld iterations, stride %d\n", seconds_since(run_start),
                  c.name.c_str(), m.name.c_str(), static_cast<long long>(iterations),
                  options.stride);
      model.set_attention_skipped(m.skip_attention);
      const models::CudaGraphStats graphs_before = model.cuda_graph_stats();
      PhaseSums phases;
      Clock::time_point last_print = Clock::now();
      const auto on_step = [&](const StepRecord& step) {
        if (step.attention_seconds >= 0) {
          const models::StepTimes& t = model.last_step_times();
          if (t.valid) {
            ++phases.steps;
            phases.total_ms += t.total_ms;
            phases.attention_ms += t.attention_ms;
            phases.gemm_ms += t.gemm_ms;
            phases.other_ms += t.other_ms + t.sampling_ms;
            phases.copy_ms += t.copy_ms;
          }
        }
        if (seconds_since(last_print) > 20) {
          last_print = Clock::now();
          std::printf("[%5.0f s]   %s %s: iteration %lld of %lld\n", seconds_since(run_start),
                      c.name.c_str(), m.name.c_str(), static_cast<long long>(step.iteration),
                      static_cast<long long>(iterations));
        }
      };
      const Clock::time_point t0 = Clock::now();
      const ReplayResult replay = replay_workload(model, **tokenizer, c.workload, options, on_step);
      const double replay_s = seconds_since(t0);
      model.set_attention_skipped(false);
      const models::CudaGraphStats& graphs_now = model.cuda_graph_stats();
      absl::Status status = replay.status;
      status.Update(check_shape(c, replay, iterations));

      ResultRow row;
      row.case_name = c.name;
      row.method = m.name;
      row.repetitions = 1;
      if (!status.ok()) {
        // The paper's OOM entries: the row says why, with no figures.
        std::printf("%-24s %-16s failed: %s\n", c.name.c_str(), m.name.c_str(),
                    status.ToString().c_str());
        row.median_us = row.p10_us = row.p90_us = std::nan("");
        row.extra = {{"status", status.ToString()}, {"stride", options.stride}};
        result.add(row);
        done.push_back({c.name, m.name, {}, false});
        continue;
      }
      const RowFigures f = figures(replay, config, weight_read_bytes, read_bytes_per_s);
      double sequence_s = 0;
      for (const Done& d : done) {
        if (d.ok && d.case_name == c.name && d.method == "sequence") sequence_s = d.f.decode_s;
      }
      std::printf("%-24s %-16s %6d %9.3f %8.3f %8.3f %5.1f%% %8.3f %6.3f %8.3f %8s\n",
                  c.name.c_str(), m.name.c_str(), options.stride, f.decode_s, f.prefill_s,
                  f.attention_s, f.attention_s >= 0 ? 100 * f.attention_s / f.decode_s : -1.0,
                  f.floor_s, f.decode_s / f.floor_s, 1e3 * f.decode_s / f.iterations,
                  figure(sequence_s / f.decode_s).c_str());
      row.median_us = row.p10_us = row.p90_us = f.decode_s * 1e6;
      row.kv_bytes = static_cast<int64_t>(f.attention_kv_bytes);
      row.floor_us = f.floor_s * 1e6;
      row.extra = {
          {"status", "ok"},
          {"family", c.family},
          {"model", model_name},
          {"plan_kind", std::string(engine::plan_kind_name(m.kind))},
          {"attention",
           m.skip_attention ? "skipped (LlamaCudaRunner::set_attention_skipped)" : "run"},
          {"decoding_latency_s", f.decode_s},
          {"prefill_s", f.prefill_s},
          {"prefill_steps", f.prefill_steps},
          {"prompt_tokens", replay.prompt_tokens},
          {"attention_s", f.attention_s >= 0 ? nlohmann::json(f.attention_s) : nlohmann::json()},
          {"attention_share",
           f.attention_s >= 0 ? nlohmann::json(f.attention_s / f.decode_s) : nlohmann::json()},
          {"attention_timed_steps", f.attention_timed_steps},
          {"floor_s", f.floor_s},
          {"floor_bytes_only_s", f.floor_bytes_only_s},
          {"floor_s_at_device_read", f.floor_measured_s},
          {"ratio_to_measured_floor", f.decode_s / f.floor_measured_s},
          {"device_read_bytes_per_s", read_bytes_per_s},
          {"iterations", f.iterations},
          {"steps_run", f.steps_run},
          {"stride", options.stride},
          {"sampled", options.stride > 1},
          {"step_wall_us",
           {{"median", f.step_us.median}, {"p10", f.step_us.p10}, {"p90", f.step_us.p90}}},
          {"host_plan_s", f.host_plan_s},
          {"generated_tokens", replay.generated_tokens},
          {"tokens_per_s", double(replay.generated_tokens) / f.decode_s},
          {"replay_wall_s", replay_s},
          {"vs_sequence",
           sequence_s > 0 ? nlohmann::json(sequence_s / f.decode_s) : nlohmann::json()},
          {"gpu_phases_ms_of_timed_steps",
           {{"note", "steps whose attention the scheduler timed: eager, an event per launch"},
            {"steps", phases.steps},
            {"total", phases.total_ms},
            {"attention", phases.attention_ms},
            {"gemm", phases.gemm_ms},
            {"other_kernels_and_sampling", phases.other_ms},
            {"copies", phases.copy_ms}}},
          {"cuda_graphs",
           {{"graph_steps", graphs_now.graph_steps - graphs_before.graph_steps},
            {"captures", graphs_now.captures - graphs_before.captures},
            {"capture_s", (graphs_now.capture_us - graphs_before.capture_us) * 1e-6},
            {"eager_steps", graphs_now.eager_steps - graphs_before.eager_steps}}},
      };
      if (c.paper_flatten_s > 0 && model_config_path.empty()) {
        row.extra["paper_a100_s"] = {{"deft_flatten", c.paper_flatten_s},
                                     {"radix_attention", c.paper_radix_s}};
      }
      result.add(row);
      done.push_back({c.name, m.name, f, true});
    }
  }

  // Summary: DeFT-Flatten against the sequence baseline per case, beside the paper's A100 figures.
  std::printf("\n%-24s %10s %10s %8s %8s | %10s %10s %8s\n", "case", "flatten_s", "sequence_s",
              "speedup", "xfloor", "paper_dft", "paper_rdx", "paper_x");
  for (const Case& c : cases) {
    const Done* flatten = nullptr;
    const Done* sequence = nullptr;
    for (const Done& d : done) {
      if (!d.ok || d.case_name != c.name) continue;
      if (d.method == "deft_flatten") flatten = &d;
      if (d.method == "sequence") sequence = &d;
    }
    if (flatten == nullptr) continue;
    std::printf("%-24s %10.3f %10s %8s %8.3f | ", c.name.c_str(), flatten->f.decode_s,
                figure(sequence ? sequence->f.decode_s : 0).c_str(),
                figure(sequence ? sequence->f.decode_s / flatten->f.decode_s : 0).c_str(),
                flatten->f.decode_s / flatten->f.floor_s);
    if (c.paper_flatten_s > 0) {
      std::printf("%10.2f %10.2f %8.3f\n", c.paper_flatten_s, c.paper_radix_s,
                  c.paper_radix_s / c.paper_flatten_s);
    } else {
      std::printf("%10s %10s %8s\n", "-", "-", "-");
    }
  }
  if (!skipped.empty()) {
    std::printf("not run (--deadline-s %.0f): %s\n", deadline_s,
                absl::StrJoin(skipped, " ").c_str());
  }
  std::printf("wrote %s in %.0f s\n", result.write(out).c_str(), seconds_since(run_start));
  return 0;
}
