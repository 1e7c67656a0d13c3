// deft-tree: the main job until the gRPC server lands. Runs one server-side tree job end to end
// on the CPU or CUDA backend: the prompt branches --branch ways, every branch generates --every
// tokens and branches again, --depth levels deep, each path running to --max-tokens or EOS; all
// live branches decode together, one DeFT attention plan per step. Prints the tree and a summary.
//
//   deft-tree [--model DIR] [--backend cpu|cuda] [--prompt TEXT] [--branch 4 --every 8] ...
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <memory>
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
#include "engine/kv_cache_manager.h"
#include "engine/tokenizer/tokenizer.h"
#include "engine/tree_job.h"
#include "models/llama_cpu.h"
#ifdef DEFT_HAVE_CUDA
#include "models/llama_cuda.h"
#endif
#include "spdlog/spdlog.h"

#ifndef DEFT_DEFAULT_MODEL_DIR
#define DEFT_DEFAULT_MODEL_DIR "models/default"
#endif

namespace {

using deft::engine::TokenId;

struct Flags {
  std::string model;
  std::string backend = "cpu";
  bool random_weights = false;  // cuda: the config's shape with seeded random weights
  std::string prompt = "Once upon a time there was a tree";
  std::string prompt_ids;  // comma-separated token ids instead of text
  deft::engine::TreeJobOptions job;
  std::string plan = "deft_flatten";
  int32_t chunk_tokens = 128;
  int32_t page_tokens = 16;
  int32_t kv_pages = 0;  // 0: as many as the job can need
  bool show_ids = false;
  bool verbose = false;
};

void print_usage(FILE* out) {
  std::fprintf(out,
      "usage: deft-tree [flags]\n"
      "Runs a tree job on the CPU or CUDA backend and prints the tree.\n\n"
      "  --model DIR          Hugging Face checkpoint dir (default: the embedded model,\n"
      "                       %s)\n"
      "  --backend B          cpu | cuda (default cpu; cuda needs a CUDA build and a GPU)\n"
      "  --random-weights     cuda: the model's config with seeded random bf16 weights\n"
      "  --prompt TEXT        prompt text (default: \"Once upon a time there was a tree\")\n"
      "  --prompt-ids IDS     prompt as comma-separated token ids instead of text\n"
      "  --branch K           children per branch point (default 4)\n"
      "  --every N            tokens per node before it branches (default 8)\n"
      "  --depth D            levels of branching (default 3; 0: one plain branch)\n"
      "  --max-tokens N       tokens per root-to-leaf path, prompt excluded (default 32)\n"
      "  --temperature T      0 = greedy; branch points then take the K most likely tokens\n"
      "                       (default 0)\n"
      "  --top-k K, --top-p P sampling filters (default off)\n"
      "  --seed S             root seed; children get branch_seed(parent, i) (default 0)\n"
      "  --plan KIND          deft_flatten | deft_node | deft_node_chunk | sequence | dense_mask\n"
      "  --chunk-tokens B     planner chunk size (default 128)\n"
      "  --page-tokens P      KV page size (default 16)\n"
      "  --kv-pages N         KV pool size in pages (default: what the job can need)\n"
      "  --ids                print token ids next to the text\n"
      "  --verbose            log each step\n"
      "  --help               this text\n",
      DEFT_DEFAULT_MODEL_DIR);
}

bool parse_int(const std::string& text, int32_t* value) { return absl::SimpleAtoi(text, value); }

// Returns an empty string on success, else the message.
std::string parse_flags(int argc, char** argv, Flags& flags, bool* help) {
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
      flags.model = std::string(value);
    } else if (arg == "--backend") {
      flags.backend = value;
      ok = value == "cpu" || value == "cuda";
    } else if (arg == "--prompt") {
      flags.prompt = std::string(value);
    } else if (arg == "--prompt-ids") {
      flags.prompt_ids = std::string(value);
    } else if (arg == "--branch") {
      ok = parse_int(value, &flags.job.branch_factor);
    } else if (arg == "--every") {
      ok = parse_int(value, &flags.job.branch_every);
    } else if (arg == "--depth") {
      ok = parse_int(value, &flags.job.max_depth);
    } else if (arg == "--max-tokens") {
      ok = parse_int(value, &flags.job.max_new_tokens);
    } else if (arg == "--temperature") {
      ok = absl::SimpleAtof(value, &flags.job.sampling.temperature);
    } else if (arg == "--top-k") {
      ok = parse_int(value, &flags.job.sampling.top_k);
    } else if (arg == "--top-p") {
      ok = absl::SimpleAtof(value, &flags.job.sampling.top_p);
    } else if (arg == "--seed") {
      ok = absl::SimpleAtoi(value, &flags.job.sampling.seed);
    } else if (arg == "--plan") {
      flags.plan = std::string(value);
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

std::filesystem::path default_model_dir() {
  for (const std::filesystem::path& candidate :
       {std::filesystem::path(DEFT_DEFAULT_MODEL_DIR), std::filesystem::path("models/default")}) {
    if (std::filesystem::exists(candidate / "config.json")) return candidate;
  }
  return DEFT_DEFAULT_MODEL_DIR;
}

// Token text for printing: the tokenizer's bytes of each token (special tokens skipped), as a
// C-escaped string so control characters and partial UTF-8 at node boundaries stay visible;
// token ids when the model has no tokenizer.
class TokenPrinter {
 public:
  explicit TokenPrinter(const deft::engine::Tokenizer* tokenizer) : tokenizer_(tokenizer) {}
  std::string text(std::span<const TokenId> ids) const {
    if (tokenizer_ == nullptr) return absl::StrCat("[", absl::StrJoin(ids, " "), "]");
    std::string bytes;
    for (TokenId id : ids) bytes += tokenizer_->token_bytes(id, /*skip_special=*/true);
    return absl::StrCat("\"", absl::Utf8SafeCEscape(bytes), "\"");
  }

 private:
  const deft::engine::Tokenizer* tokenizer_;
};

std::string end_label(deft::engine::BranchEnd end) {
  switch (end) {
    case deft::engine::BranchEnd::kEos: return " <eos>";
    case deft::engine::BranchEnd::kMaxTokens: return " <max>";
    case deft::engine::BranchEnd::kNone: break;
  }
  return "";
}

void print_node(const std::vector<deft::engine::TreeJobNode>& nodes, deft::engine::NodeId id,
                const TokenPrinter& printer, bool show_ids, const std::string& indent) {
  const deft::engine::TreeJobNode& node = nodes[id];
  std::string line = absl::StrCat(indent, "#", node.id, " ");
  if (node.level == 0) {
    absl::StrAppend(&line, "prompt (", node.tokens.size(), " tokens): ");
  } else {
    absl::StrAppend(&line, "(", node.tokens.size(), " tok, logprob ",
                    absl::StrFormat("%.2f", node.logprob), "): ");
  }
  absl::StrAppend(&line, printer.text(node.tokens), end_label(node.end));
  if (show_ids) absl::StrAppend(&line, "  ids=", absl::StrJoin(node.tokens, ","));
  std::printf("%s\n", line.c_str());
  for (deft::engine::NodeId child : node.children) {
    print_node(nodes, child, printer, show_ids, indent + "  ");
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
  if (absl::Status status = deft::engine::parse_plan_kind(flags.plan, &flags.job.planner.kind);
      !status.ok()) {
    std::fprintf(stderr, "deft-tree: %s\n", std::string(status.message()).c_str());
    return 2;
  }
  flags.job.planner.chunk_tokens = flags.chunk_tokens;
  const std::filesystem::path model_dir =
      flags.model.empty() ? default_model_dir() : std::filesystem::path(flags.model);

  absl::StatusOr<deft::models::ModelConfig> config = deft::models::load_model_config(model_dir);
  if (!config.ok()) {
    std::fprintf(stderr, "deft-tree: %s\n", std::string(config.status().message()).c_str());
    return 1;
  }
  std::unique_ptr<deft::engine::Tokenizer> tokenizer;
  if (absl::StatusOr<std::unique_ptr<deft::engine::Tokenizer>> loaded =
          deft::engine::load_tokenizer(model_dir.string());
      loaded.ok()) {
    tokenizer = std::move(*loaded);
  } else if (flags.prompt_ids.empty()) {
    std::fprintf(stderr, "deft-tree: no tokenizer (%s); pass --prompt-ids\n",
                 std::string(loaded.status().message()).c_str());
    return 1;
  }
  const TokenPrinter printer(tokenizer.get());
  if (!flags.prompt_ids.empty()) {
    for (absl::string_view piece : absl::StrSplit(flags.prompt_ids, ',')) {
      int32_t id = 0;
      if (!absl::SimpleAtoi(piece, &id)) {
        std::fprintf(stderr, "deft-tree: bad token id '%s' in --prompt-ids\n",
                     std::string(piece).c_str());
        return 2;
      }
      flags.job.prompt.push_back(id);
    }
  } else {
    absl::StatusOr<std::vector<TokenId>> ids =
        tokenizer->encode(flags.prompt, /*add_bos=*/true, /*parse_special=*/false);
    if (!ids.ok()) {
      std::fprintf(stderr, "deft-tree: %s\n", std::string(ids.status().message()).c_str());
      return 2;
    }
    flags.job.prompt = std::move(*ids);
  }
  flags.job.eos_ids = tokenizer != nullptr && !tokenizer->eos_ids().empty()
                          ? tokenizer->eos_ids()
                          : config->eos_token_ids;
  if (absl::Status status = deft::engine::validate_tree_job(flags.job, config->vocab_size);
      !status.ok()) {
    std::fprintf(stderr, "deft-tree: %s\n", std::string(status.message()).c_str());
    return 2;
  }

  const int64_t pages = flags.kv_pages > 0
                            ? flags.kv_pages
                            : deft::engine::tree_job_max_pages(flags.job, flags.page_tokens);
  deft::engine::KvCacheManager kv(
      {.page_tokens = flags.page_tokens, .num_pages = static_cast<int32_t>(pages)});
  absl::StatusOr<std::unique_ptr<deft::engine::ModelRunner>> runner =
      load_runner(flags, model_dir, *config, kv.num_slots());
  if (!runner.ok()) {
    std::fprintf(stderr, "deft-tree: %s\n", std::string(runner.status().message()).c_str());
    return 1;
  }
  absl::StatusOr<deft::engine::TreeJobResult> result =
      deft::engine::run_tree_job(**runner, kv, flags.job);
  if (!result.ok()) {
    std::fprintf(stderr, "deft-tree: %s\n", std::string(result.status().message()).c_str());
    return 1;
  }
  print_node(result->nodes, 0, printer, flags.show_ids, "");
  const deft::engine::TreeJobStats& stats = result->stats;
  std::printf(
      "summary: model %s, backend %s, plan %s, %zu nodes, %d leaves, %lld prompt + %lld generated "
      "tokens in %lld steps, %.3f s (%.0f tokens/s, forward %.3f s), KV peak %d pages of %d "
      "tokens\n",
      model_dir.c_str(), flags.backend.c_str(), flags.plan.c_str(), result->nodes.size(),
      stats.leaves,
      static_cast<long long>(stats.prompt_tokens), static_cast<long long>(stats.generated_tokens),
      static_cast<long long>(stats.steps), stats.seconds,
      stats.seconds > 0 ? stats.generated_tokens / stats.seconds : 0.0, stats.forward_seconds,
      stats.peak_kv_pages, flags.page_tokens);
  return 0;
}
