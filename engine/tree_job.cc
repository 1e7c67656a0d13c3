#include "engine/tree_job.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "engine/works/child_sampling.h"
#include "spdlog/spdlog.h"

namespace deft::engine {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

int64_t pages_for(int64_t tokens, int32_t page_tokens) {
  return (tokens + page_tokens - 1) / page_tokens;
}

// Children at the branch points of `level` (the prompt is level 0).
int32_t children_per_branch(const TreeJobOptions& options) {
  return options.max_depth == 0 ? 1 : options.branch_factor;
}

// A live branch: its leaf node and the sampled token not yet run through the model.
struct Leaf {
  NodeId node = -1;
  TokenId pending = -1;
  uint64_t seed = 0;
  int32_t generated = 0;  // tokens generated on the path, `pending` included
};

class TreeJob {
 public:
  TreeJob(ModelRunner& runner, KvCacheManager& kv, const TreeJobOptions& options)
      : runner_(runner),
        kv_(kv),
        options_(options),
        tree_(options.tree_id, &kv),
        planner_(options.planner) {}

  absl::StatusOr<TreeJobResult> run(
      const std::function<void(int64_t, const std::vector<TreeJobNode>&)>& on_step) {
    const Clock::time_point start = Clock::now();
    result_.nodes.push_back({.id = tree_.root(), .parent = -1, .level = 0,
                             .tokens = options_.prompt});
    result_.stats.prompt_tokens = static_cast<int64_t>(options_.prompt.size());
    if (absl::Status status = prefill(); !status.ok()) return status;
    if (on_step) on_step(result_.stats.steps - 1, result_.nodes);
    while (!leaves_.empty()) {
      if (absl::Status status = decode_step(); !status.ok()) return status;
      if (on_step) on_step(result_.stats.steps - 1, result_.nodes);
    }
    for (const TreeJobNode& node : result_.nodes) {
      if (node.children.empty() && node.level > 0) ++result_.stats.leaves;
    }
    result_.stats.seconds = seconds_since(start);
    return std::move(result_);
  }

 private:
  absl::Status prefill() {
    const int64_t prompt_tokens = static_cast<int64_t>(options_.prompt.size());
    if (absl::Status status = check_capacity(kv_.pages_needed(tree_.kv_key(tree_.root()),
                                                               prompt_tokens),
                                             1);
        !status.ok()) {
      return status;
    }
    if (absl::Status status = tree_.append(tree_.root(), options_.prompt); !status.ok()) {
      return status;
    }
    queries_.clear();
    for (int32_t i = 0; i < static_cast<int32_t>(prompt_tokens); ++i) {
      queries_.push_back({tree_.root(), i});
    }
    logit_rows_.assign(1, static_cast<int32_t>(prompt_tokens - 1));
    if (absl::Status status = forward(options_.prompt); !status.ok()) return status;
    Leaf root{.node = tree_.root(), .pending = -1, .seed = options_.sampling.seed, .generated = 0};
    return advance(root, logits_);
  }

  absl::Status decode_step() {
    int64_t pages_needed = 0;
    for (const Leaf& leaf : leaves_) {
      const NodeId node = leaf.node;
      pages_needed += kv_.pages_needed(tree_.kv_key(node),
                                       static_cast<int64_t>(tree_.node(node).tokens.size()) + 1);
    }
    if (absl::Status status = check_capacity(pages_needed, static_cast<int64_t>(leaves_.size()));
        !status.ok()) {
      return status;
    }
    queries_.clear();
    step_tokens_.clear();
    logit_rows_.clear();
    for (const Leaf& leaf : leaves_) {
      if (absl::Status status = tree_.append(leaf.node, std::span(&leaf.pending, 1));
          !status.ok()) {
        return status;
      }
      queries_.push_back(
          {leaf.node, static_cast<int32_t>(tree_.node(leaf.node).tokens.size()) - 1});
      logit_rows_.push_back(static_cast<int32_t>(step_tokens_.size()));
      step_tokens_.push_back(leaf.pending);
    }
    if (absl::Status status = forward(step_tokens_); !status.ok()) return status;
    std::vector<Leaf> stepped;
    stepped.swap(leaves_);
    const size_t vocab = static_cast<size_t>(runner_.vocab_size());
    for (size_t row = 0; row < stepped.size(); ++row) {
      const std::span<const float> row_logits(logits_.data() + row * vocab, vocab);
      if (absl::Status status = advance(stepped[row], row_logits); !status.ok()) return status;
    }
    return absl::OkStatus();
  }

  absl::Status check_capacity(int64_t pages_needed, int64_t new_rows) const {
    if (pages_needed <= kv_.free_pages()) return absl::OkStatus();
    return absl::ResourceExhaustedError(absl::StrCat(
        "tree job: KV cache too small at step ", result_.stats.steps, ": ", new_rows,
        " new tokens (", leaves_.size(), " live branches) need ", pages_needed, " more pages of ",
        kv_.page_tokens(), " tokens but ", kv_.free_pages(), " of ", kv_.num_pages(),
        " are free; give the KV pool at least ",
        tree_job_max_pages(options_, kv_.page_tokens()), " pages or shrink the tree"));
  }

  // Plans queries_ and runs the model on `tokens`; logits of logit_rows_ land in logits_.
  absl::Status forward(std::span<const TokenId> tokens) {
    const TreeQueries trees[] = {{&tree_, queries_}};
    if (absl::Status status = planner_.plan(trees, plan_); !status.ok()) return status;
    logits_.resize(logit_rows_.size() * static_cast<size_t>(runner_.vocab_size()));
    const StepBatch batch{.plan = &plan_, .tokens = tokens, .logit_rows = logit_rows_};
    const Clock::time_point start = Clock::now();
    if (absl::Status status = runner_.forward(batch, logits_); !status.ok()) return status;
    result_.stats.forward_seconds += seconds_since(start);
    ++result_.stats.steps;
    result_.stats.forwarded_tokens += static_cast<int64_t>(tokens.size());
    result_.stats.kv_tokens_read += plan_.io.kv_tokens_read;
    result_.stats.peak_kv_pages = std::max(result_.stats.peak_kv_pages, kv_.used_pages());
    return absl::OkStatus();
  }

  // Given the next-token logits of `leaf` (its pending token now in the tree), either branches
  // its node or extends it by one sampled token.
  absl::Status advance(const Leaf& leaf, std::span<const float> logits) {
    const TreeJobNode& record = result_.nodes[leaf.node];
    const bool is_prompt = leaf.node == tree_.root();
    const bool branches =
        is_prompt || (record.level < options_.max_depth &&
                      static_cast<int32_t>(record.tokens.size()) >= options_.branch_every);
    const uint64_t step = static_cast<uint64_t>(tree_.depth(
        leaf.node, static_cast<int64_t>(tree_.node(leaf.node).tokens.size())));
    if (!branches) {
      absl::StatusOr<SampledToken> sampled = sampler_.sample(logits, params(leaf.seed), step);
      if (!sampled.ok()) return sampled.status();
      add_token(Leaf(leaf), sampled->token, sampled->logprob);
      return absl::OkStatus();
    }
    const int32_t k = children_per_branch(options_);
    absl::StatusOr<std::vector<NodeId>> children = tree_.branch(leaf.node, k);
    if (!children.ok()) return children.status();
    absl::StatusOr<std::vector<SampledToken>> choices =
        sample_children(sampler_, logits, params(leaf.seed), step, k);
    if (!choices.ok()) return choices.status();
    for (int32_t i = 0; i < k; ++i) {
      const NodeId child = (*children)[i];
      const uint64_t seed = branch_seed(leaf.seed, static_cast<uint64_t>(i));
      result_.nodes.resize(std::max<size_t>(result_.nodes.size(), child + 1));
      result_.nodes[child] = {.id = child, .parent = leaf.node,
                              .level = result_.nodes[leaf.node].level + 1};
      result_.nodes[leaf.node].children.push_back(child);
      const SampledToken& choice = (*choices)[i];
      add_token(Leaf{.node = child, .pending = -1, .seed = seed, .generated = leaf.generated},
                choice.token, choice.logprob);
    }
    return absl::OkStatus();
  }

  // Records `token` as the next token of `leaf`'s node; keeps the leaf live unless it ended.
  void add_token(Leaf leaf, TokenId token, float logprob) {
    TreeJobNode& record = result_.nodes[leaf.node];
    record.tokens.push_back(token);
    record.logprob += logprob;
    ++result_.stats.generated_tokens;
    leaf.pending = token;
    ++leaf.generated;
    if (std::find(options_.eos_ids.begin(), options_.eos_ids.end(), token) !=
        options_.eos_ids.end()) {
      record.end = BranchEnd::kEos;
    } else if (leaf.generated >= options_.max_new_tokens) {
      record.end = BranchEnd::kMaxTokens;
    } else {
      leaves_.push_back(leaf);
    }
  }

  SamplingParams params(uint64_t seed) const {
    SamplingParams params = options_.sampling;
    params.seed = seed;
    params.top_logprobs = 0;
    params.stop_token_ids.clear();
    return params;
  }

  ModelRunner& runner_;
  KvCacheManager& kv_;
  const TreeJobOptions& options_;
  SequenceTree tree_;
  AttentionPlanner planner_;
  Sampler sampler_;
  AttentionPlan plan_;
  std::vector<Leaf> leaves_;
  std::vector<QueryToken> queries_;
  std::vector<TokenId> step_tokens_;
  std::vector<int32_t> logit_rows_;
  std::vector<float> logits_;
  TreeJobResult result_;
};

}  // namespace

int64_t tree_job_max_pages(const TreeJobOptions& options, int32_t page_tokens) {
  int64_t pages = pages_for(static_cast<int64_t>(options.prompt.size()), page_tokens);
  const int32_t levels = std::max(options.max_depth, 1);
  int64_t nodes = 1;
  int64_t remaining = options.max_new_tokens;
  for (int32_t level = 1; level <= levels && remaining > 0; ++level) {
    nodes *= children_per_branch(options);
    const int64_t tokens =
        level == levels ? remaining : std::min<int64_t>(remaining, options.branch_every);
    pages += nodes * pages_for(tokens, page_tokens);
    remaining -= tokens;
  }
  return pages;
}

absl::Status validate_tree_job(const TreeJobOptions& options, int32_t vocab_size) {
  if (options.prompt.empty()) return absl::InvalidArgumentError("tree job: empty prompt");
  for (size_t i = 0; i < options.prompt.size(); ++i) {
    if (options.prompt[i] < 0 || options.prompt[i] >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("tree job: prompt token ", i, " is ",
                                                     options.prompt[i], ", outside [0, ",
                                                     vocab_size, ")"));
    }
  }
  if (options.branch_factor < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("tree job: branch_factor must be >= 1, got ", options.branch_factor));
  }
  if (options.branch_every < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("tree job: branch_every must be >= 1, got ", options.branch_every));
  }
  if (options.max_depth < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("tree job: max_depth must be >= 0, got ", options.max_depth));
  }
  if (options.max_new_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("tree job: max_new_tokens must be >= 1, got ", options.max_new_tokens));
  }
  // A tree of more than 2^20 leaves is a typo, not a job.
  double leaves = std::pow(static_cast<double>(options.branch_factor), options.max_depth);
  if (leaves > double{1 << 20}) {
    return absl::InvalidArgumentError(absl::StrCat("tree job: ", options.branch_factor, "^",
                                                   options.max_depth, " leaves is too many"));
  }
  for (TokenId eos : options.eos_ids) {
    if (eos < 0 || eos >= vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("tree job: EOS token ", eos, " outside [0, ", vocab_size, ")"));
    }
  }
  return validate_sampling_params(options.sampling, vocab_size);
}

absl::StatusOr<TreeJobResult> run_tree_job(
    ModelRunner& runner, KvCacheManager& kv, const TreeJobOptions& options,
    const std::function<void(int64_t, const std::vector<TreeJobNode>&)>& on_step) {
  if (absl::Status status = validate_tree_job(options, runner.vocab_size()); !status.ok()) {
    return status;
  }
  if (kv.num_slots() > runner.info().num_kv_slots) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tree job: the KV manager has ", kv.num_slots(), " slots but the runner holds only ",
        runner.info().num_kv_slots));
  }
  TreeJob job(runner, kv, options);
  absl::StatusOr<TreeJobResult> result = job.run(on_step);
  if (result.ok()) {
    spdlog::debug("tree job: {} steps, {} tokens generated, {} leaves, {:.3f} s",
                  result->stats.steps, result->stats.generated_tokens, result->stats.leaves,
                  result->stats.seconds);
  }
  return result;
}

}  // namespace deft::engine
