// deft-tree: one server-side tree job (RunTree's policy) run to completion in-process on the
// engine's Scheduler, the same loop deft-server runs, then printed as a tree. It does not talk
// to a running server: it loads the model itself, on the CPU or CUDA backend. The prompt
// branches --branch ways, every node generates --every tokens and branches again, --depth
// levels deep (keeping the --keep-best best nodes of each depth when set), each path running
// to --max-tokens or EOS; all live branches decode together, one DeFT attention plan per step.
//
//   deft-tree [--model DIR] [--backend cpu|cuda] [--prompt TEXT] [--branch 4 --every 8] ...
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "engine/attention_planner.h"
#include "engine/branch_controller.h"
#include "engine/sampler.h"
#include "engine/scheduler.h"
#include "engine/tokenizer/tokenizer.h"
#include "engine/works/tree_search_work.h"
#include "models/default_model.h"
#include "models/llama_cpu.h"
#include "models/model_config.h"
#ifdef DEFT_HAVE_CUDA
#include "models/llama_cuda.h"
#endif
#include "spdlog/spdlog.h"

namespace {

using deft::engine::TokenId;
using deft::engine::TreeSearchEvent;
using deft::engine::TreeSearchJob;
using deft::engine::TreeSearchNode;

// Children per branch point at most, as the server's default max_branches.
constexpr int32_t kMaxBranches = 64;

struct Flags {
  std::string model;
  std::string backend = "cpu";
  bool random_weights = false;  // cuda: the config's shape with seeded random weights
  std::string prompt = "Once upon a time there was a tree";
  std::string prompt_ids;  // comma-separated token ids instead of text
  TreeSearchJob job{.policy = {.branch_factor = 4, .every_tokens = 8, .max_depth = 3},
                    .sampling = {.temperature = 0.0f},
                    .max_tokens = 32};
  std::string plan = "deft_flatten";
  int32_t chunk_tokens = 128;
  int32_t page_tokens = 16;
  int32_t kv_pages = 0;  // 0: as many as the job can need
  bool show_ids = false;
  bool verbose = false;
};

void print_usage(FILE* out) {
  std::fprintf(
      out,
      "usage: deft-tree [flags]\n"
      "Runs one tree job in-process (the engine's scheduler on the CPU or CUDA backend) and\n"
      "prints the tree. It does not connect to deft-server; use deft-cli for that.\n\n"
      "  --model DIR          Hugging Face checkpoint dir (default: the embedded model,\n"
      "                       %s)\n"
      "  --backend B          cpu | cuda (default cpu; cuda needs a CUDA build and a GPU)\n"
      "  --random-weights     cuda: the model's config with seeded random bf16 weights\n"
      "  --prompt TEXT        prompt text (default: \"Once upon a time there was a tree\")\n"
      "  --prompt-ids IDS     prompt as comma-separated token ids instead of text\n"
      "  --branch K           children per branch point (default 4, at most %d)\n"
      "  --every N            tokens per node before it branches (default 8)\n"
      "  --depth D            levels of branching (default 3; 0: one plain branch)\n"
      "  --keep-best W        nodes of each depth that branch, by path logprob (default 0: all)\n"
      "  --max-tokens N       tokens per root-to-leaf path, prompt excluded (default 32)\n"
      "  --temperature T      0 = greedy; branch points then take the K most likely tokens\n"
      "                       (default 0)\n"
      "  --top-k K, --top-p P sampling filters (default off)\n"
      "  --seed S             root seed; children get their own seeds from it (default 0)\n"
      "  --plan KIND          deft_flatten | deft_node | deft_node_chunk | sequence | dense_mask\n"
      "  --chunk-tokens B     planner chunk size (default 128)\n"
      "  --page-tokens P      KV page size (default 16)\n"
      "  --kv-pages N         KV pool size in pages (default: what the job can need)\n"
      "  --ids                print token ids next to the text\n"
      "  --verbose            log each step\n"
      "  --help               this text\n"
      "In the printed tree, * marks the best path.\n",
      deft::models::default_model_dir().c_str(), kMaxBranches);
}

bool parse_int(const std::string& text, int32_t* value) { return absl::SimpleAtoi(text, value); }

// Returns an empty string on success, else the message.
std::string parse_flags(int argc, char** argv, Flags& flags, bool* help) {
  deft::engine::BranchPolicyOptions& policy = flags.job.policy;
  deft::engine::SamplingParams& sampling = flags.job.sampling;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      *help = true;
      return "";
    }
    if (arg == "--ids") {
      flags.show_ids = true;
      continue;
    }
    if (arg == "--verbose") {
      flags.verbose = true;
      continue;
    }
    if (arg == "--random-weights") {
      flags.random_weights = true;
      continue;
    }
    if (i + 1 >= argc) return absl::StrCat(arg, " needs a value");
    const std::string value = argv[++i];
    bool ok = true;
    if (arg == "--model") {
      flags.model = value;
    } else if (arg == "--backend") {
      flags.backend = value;
      ok = value == "cpu" || value == "cuda";
    } else if (arg == "--prompt") {
      flags.prompt = value;
    } else if (arg == "--prompt-ids") {
      flags.prompt_ids = value;
    } else if (arg == "--branch") {
      ok = parse_int(value, &policy.branch_factor);
    } else if (arg == "--every") {
      ok = parse_int(value, &policy.every_tokens);
    } else if (arg == "--depth") {
      ok = parse_int(value, &policy.max_depth);
    } else if (arg == "--keep-best") {
      ok = parse_int(value, &policy.keep_best);
    } else if (arg == "--max-tokens") {
      ok = parse_int(value, &flags.job.max_tokens);
    } else if (arg == "--temperature") {
      ok = absl::SimpleAtof(value, &sampling.temperature);
    } else if (arg == "--top-k") {
      ok = parse_int(value, &sampling.top_k);
    } else if (arg == "--top-p") {
      ok = absl::SimpleAtof(value, &sampling.top_p);
    } else if (arg == "--seed") {
      ok = absl::SimpleAtoi(value, &sampling.seed);
    } else if (arg == "--plan") {
      flags.plan = value;
    } else if (arg == "--chunk-tokens") {
      ok = parse_int(value, &flags.chunk_tokens);
    } else if (arg == "--page-tokens") {
      ok = parse_int(value, &flags.page_tokens) && flags.page_tokens > 0;
    } else if (arg == "--kv-pages") {
      ok = parse_int(value, &flags.kv_pages) && flags.kv_pages >= 0;
    } else {
      return absl::StrCat("unknown flag ", arg, " (see --help)");
    }
    if (!ok) return absl::StrCat("bad value for ", arg, ": '", value, "'");
  }
  return "";
}

int fail(const absl::Status& status, int exit_code) {
  std::fprintf(stderr, "deft-tree: %s\n", std::string(status.message()).c_str());
  return exit_code;
}

// Token text for printing: the tokenizer's bytes of each token (special tokens skipped), as a
// C-escaped string so control characters and partial UTF-8 at node boundaries stay visible.
class TokenPrinter {
 public:
  explicit TokenPrinter(const deft::engine::Tokenizer* tokenizer) : tokenizer_(tokenizer) {}
  std::string text(std::span<const TokenId> ids) const {
    std::string bytes;
    for (TokenId id : ids) bytes += tokenizer_->token_bytes(id, /*skip_special=*/true);
    return absl::StrCat("\"", absl::Utf8SafeCEscape(bytes), "\"");
  }

 private:
  const deft::engine::Tokenizer* tokenizer_;
};

std::string end_label(deft::engine::FinishReason finish) {
  switch (finish) {
    case deft::engine::FinishReason::kEos:
      return " <eos>";
    case deft::engine::FinishReason::kLength:
      return " <max>";
    case deft::engine::FinishReason::kStop:
      return " <stop>";
    case deft::engine::FinishReason::kPruned:
      return " <pruned>";
    case deft::engine::FinishReason::kCancelled:
      return " <cancelled>";
    case deft::engine::FinishReason::kNone:
      break;
  }
  return "";
}

void print_node(const std::vector<TreeSearchNode>& nodes,
                const std::vector<std::vector<int32_t>>& children,
                const std::vector<int32_t>& best_path, int32_t id, const TokenPrinter& printer,
                bool show_ids, const std::string& indent) {
  const TreeSearchNode& node = nodes[id];
  const bool best = std::find(best_path.begin(), best_path.end(), id) != best_path.end();
  std::string line = absl::StrCat(indent, best ? "*" : "", "#", node.id, " ");
  if (node.depth == 0) {
    absl::StrAppend(&line, "prompt (", node.tokens.size(), " tokens): ");
  } else {
    absl::StrAppend(&line, "(", node.tokens.size(), " tok, score ",
                    absl::StrFormat("%.2f", node.score), "): ");
  }
  absl::StrAppend(&line, printer.text(node.tokens), end_label(node.finish));
  if (show_ids) absl::StrAppend(&line, "  ids=", absl::StrJoin(node.tokens, ","));
  std::printf("%s\n", line.c_str());
  for (int32_t child : children[id]) {
    print_node(nodes, children, best_path, child, printer, show_ids, indent + "  ");
  }
}

absl::StatusOr<std::unique_ptr<deft::engine::ModelRunner>> load_runner(
    const Flags& flags, const std::filesystem::path& model_dir,
    const deft::models::ModelConfig& config, int64_t num_kv_slots) {
  if (flags.backend == "cpu") {
    if (flags.random_weights) {
      return absl::InvalidArgumentError("--random-weights needs --backend cuda");
    }
    absl::StatusOr<std::unique_ptr<deft::models::LlamaCpuRunner>> runner =
        deft::models::LlamaCpuRunner::load(model_dir, num_kv_slots);
    if (!runner.ok()) return runner.status();
    return std::unique_ptr<deft::engine::ModelRunner>(std::move(*runner));
  }
#ifdef DEFT_HAVE_CUDA
  const deft::models::LlamaCudaOptions options{.num_kv_slots = num_kv_slots,
                                               .page_tokens = flags.page_tokens};
  const uint64_t seed = static_cast<uint64_t>(flags.job.sampling.seed);
  absl::StatusOr<std::unique_ptr<deft::models::LlamaCudaRunner>> runner =
      flags.random_weights ? deft::models::LlamaCudaRunner::create_random(config, options, seed)
                           : deft::models::LlamaCudaRunner::load(model_dir, options);
  if (!runner.ok()) return runner.status();
  return std::unique_ptr<deft::engine::ModelRunner>(std::move(*runner));
#else
  (void)config;
  return absl::UnimplementedError("--backend cuda: this build has no CUDA");
#endif
}

// What the run did, for the summary line.
struct RunStats {
  int64_t steps = 0;
  int64_t rows = 0;  // query rows over all steps, the prefill included
  int64_t kv_tokens_read = 0;
  int64_t peak_kv_pages = 0;
  double seconds = 0.0;
  double forward_seconds = 0.0;
};

// Drives the engine's Scheduler (the loop the server runs) until the job's stream ends.
absl::StatusOr<TreeSearchEvent> run_job(deft::engine::Scheduler& scheduler,
                                        std::unique_ptr<deft::engine::Work> work,
                                        deft::engine::TreeSearchEvents& events, RunStats& stats) {
  const auto start = std::chrono::steady_clock::now();
  if (absl::Status status = scheduler.submit(std::move(work)); !status.ok()) return status;
  std::optional<TreeSearchEvent> finished;
  std::vector<TreeSearchEvent> batch;
  while (!events.finished()) {
    scheduler.prepare();
    const std::optional<deft::engine::StepStats> step = scheduler.step();
    if (!step.has_value()) {
      if (!scheduler.has_live() && scheduler.queued() == 0) break;
      continue;
    }
    ++stats.steps;
    stats.rows += step->rows;
    stats.kv_tokens_read += step->kv_tokens_read;
    stats.forward_seconds += step->forward_seconds;
    // The job's own KV: its finished leaves' pages stay cached (engine/forest.h), not in use.
    const int64_t in_use = scheduler.forest().referenced_pages();
    stats.peak_kv_pages = std::max<int64_t>(stats.peak_kv_pages, in_use);
    spdlog::debug("step {}: {} rows, {} sampled, {} KV pages in use", stats.steps, step->rows,
                  step->generated, in_use);
  }
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  while (events.next(batch, std::chrono::milliseconds(0))) {
    for (TreeSearchEvent& event : batch) {
      if (event.kind == TreeSearchEvent::Kind::kFinished) finished = std::move(event);
    }
    batch.clear();
  }
  if (!events.final_status().ok()) return events.final_status();
  if (!finished.has_value()) return absl::InternalError("the job ended without its tree");
  return std::move(*finished);
}

}  // namespace

int main(int argc, char** argv) {
  Flags flags;
  bool help = false;
  if (const std::string error = parse_flags(argc, argv, flags, &help); !error.empty()) {
    std::fprintf(stderr, "deft-tree: %s\n", error.c_str());
    return 2;
  }
  if (help) {
    print_usage(stdout);
    return 0;
  }
  spdlog::set_level(flags.verbose ? spdlog::level::debug : spdlog::level::warn);
  deft::engine::PlannerOptions planner{.chunk_tokens = flags.chunk_tokens};
  if (absl::Status status = deft::engine::parse_plan_kind(flags.plan, &planner.kind);
      !status.ok()) {
    return fail(status, 2);
  }
  const std::filesystem::path model_dir =
      flags.model.empty() ? deft::models::default_model_dir() : std::filesystem::path(flags.model);

  absl::StatusOr<deft::models::ModelConfig> config = deft::models::load_model_config(model_dir);
  if (!config.ok()) return fail(config.status(), 1);
  absl::StatusOr<std::unique_ptr<deft::engine::Tokenizer>> tokenizer =
      deft::engine::load_tokenizer(model_dir.string());
  if (!tokenizer.ok()) return fail(tokenizer.status(), 1);

  TreeSearchJob& job = flags.job;
  if (!flags.prompt_ids.empty()) {
    for (absl::string_view piece : absl::StrSplit(flags.prompt_ids, ',')) {
      int32_t id = 0;
      if (!absl::SimpleAtoi(piece, &id) || id < 0 || id >= config->vocab_size) {
        std::fprintf(stderr, "deft-tree: bad token id '%s' in --prompt-ids (vocabulary [0, %d))\n",
                     std::string(piece).c_str(), config->vocab_size);
        return 2;
      }
      job.prompt.push_back(id);
    }
  } else {
    absl::StatusOr<std::vector<TokenId>> ids =
        (*tokenizer)->encode(flags.prompt, /*add_bos=*/true, /*parse_special=*/false);
    if (!ids.ok()) return fail(ids.status(), 2);
    job.prompt = std::move(*ids);
  }
  if (job.prompt.empty()) return fail(absl::InvalidArgumentError("the prompt is empty"), 2);
  if (absl::Status status =
          deft::engine::validate_branch_policy(job.policy, config->vocab_size, kMaxBranches);
      !status.ok()) {
    return fail(status, 2);
  }
  if (absl::Status status =
          deft::engine::validate_sampling_params(job.sampling, config->vocab_size);
      !status.ok()) {
    return fail(status, 2);
  }
  if (job.max_tokens < 1) {
    return fail(
        absl::InvalidArgumentError(absl::StrCat("--max-tokens must be >= 1, got ", job.max_tokens)),
        2);
  }
  const int64_t context = static_cast<int64_t>(job.prompt.size()) + job.max_tokens;
  if (context > config->max_position_embeddings) {
    return fail(absl::InvalidArgumentError(absl::StrCat(
                    "prompt (", job.prompt.size(), " tokens) + --max-tokens (", job.max_tokens,
                    ") exceeds the model's context of ", config->max_position_embeddings)),
                2);
  }

  const deft::engine::TreeSearchBounds bounds =
      deft::engine::tree_search_bounds(job, flags.page_tokens);
  const int64_t pages = flags.kv_pages > 0 ? flags.kv_pages : bounds.pages;
  if (pages > std::numeric_limits<int32_t>::max()) {
    return fail(absl::InvalidArgumentError(absl::StrCat("the tree may need ", pages,
                                                        " KV pages; narrow --branch / --depth")),
                2);
  }
  absl::StatusOr<std::unique_ptr<deft::engine::ModelRunner>> runner =
      load_runner(flags, model_dir, *config, pages * flags.page_tokens);
  if (!runner.ok()) return fail(runner.status(), 1);

  const deft::engine::SchedulerOptions options{.page_tokens = flags.page_tokens,
                                               .kv_pages = static_cast<int32_t>(pages),
                                               .planner = planner};
  deft::engine::Scheduler scheduler(options, **runner, **tokenizer);
  auto events = std::make_shared<deft::engine::TreeSearchEvents>();
  const int64_t prompt_tokens = static_cast<int64_t>(job.prompt.size());
  auto work = std::make_unique<deft::engine::TreeSearchWork>(std::move(job), events, **tokenizer,
                                                             flags.page_tokens);
  RunStats stats;
  absl::StatusOr<TreeSearchEvent> result = run_job(scheduler, std::move(work), *events, stats);
  if (!result.ok()) return fail(result.status(), 1);

  const std::vector<TreeSearchNode>& nodes = result->nodes;
  std::vector<std::vector<int32_t>> children(nodes.size());
  int64_t generated = 0;
  int32_t leaves = 0, pruned = 0;
  for (const TreeSearchNode& node : nodes) {
    if (node.parent >= 0) children[node.parent].push_back(node.id);
    if (node.id != 0) generated += static_cast<int64_t>(node.tokens.size());
  }
  for (size_t id = 1; id < nodes.size(); ++id) {
    if (nodes[id].finish == deft::engine::FinishReason::kPruned) {
      ++pruned;
    } else {
      leaves += children[id].empty();
    }
  }
  const TokenPrinter printer(tokenizer->get());
  print_node(nodes, children, result->best_path, 0, printer, flags.show_ids, "");
  std::printf(
      "summary: model %s, backend %s, plan %s, %zu nodes, %d leaves, %d pruned, %lld prompt + "
      "%lld generated tokens in %lld steps, %.3f s (%.0f tokens/s, forward %.3f s), KV peak "
      "%lld pages of %d tokens\n",
      model_dir.c_str(), flags.backend.c_str(), flags.plan.c_str(), nodes.size(), leaves, pruned,
      static_cast<long long>(prompt_tokens), static_cast<long long>(generated),
      static_cast<long long>(stats.steps), stats.seconds,
      stats.seconds > 0 ? static_cast<double>(generated) / stats.seconds : 0.0,
      stats.forward_seconds, static_cast<long long>(stats.peak_kv_pages), flags.page_tokens);
  return 0;
}
