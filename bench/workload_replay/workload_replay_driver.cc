#include "bench/workload_replay/workload_replay_driver.h"

#include <algorithm>
#include <chrono>
#include <fstream>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/scheduler.h"
#include "engine/works/generate_work.h"
#include "engine/works/work.h"
#include "nlohmann/json.hpp"

namespace deft::bench {
namespace {

using engine::Forest;
using engine::NodeId;
using engine::SampledToken;
using engine::SamplingParams;
using engine::StepContext;
using engine::TokenId;
using engine::TreeNode;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

int64_t pages_for(int64_t tokens, int32_t page_tokens) {
  return (tokens + page_tokens - 1) / page_tokens;
}

std::vector<TokenId> random_tokens(int64_t count, int32_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<TokenId> token(0, vocab - 1);
  std::vector<TokenId> tokens(static_cast<size_t>(count));
  for (TokenId& t : tokens) t = token(rng);
  return tokens;
}

// What a replay work tells the driver (the scheduler owns the work and destroys it when done).
struct Progress {
  // This step (reset by the driver before each step).
  bool decoded = false;  // the step carried decode rows of `iteration`
  int64_t iteration = 0;
  int32_t weight = 0;
  int64_t tree_tokens = 0;
  int64_t path_tokens = 0;
  double fast_forward_seconds = 0;
  // The whole replay.
  std::vector<IterationShape> shape;
  int64_t generated = 0;
  absl::Status status;  // set by abort()
};

// Sampling: iteration 1 + k * stride runs; it stands for the iterations up to the next one.
bool runs(int64_t iteration, int32_t stride) { return (iteration - 1) % stride == 0; }
int32_t weight_of(int64_t iteration, int32_t stride, int64_t iterations) {
  return static_cast<int32_t>(std::min<int64_t>(stride, iterations - iteration + 1));
}

// The prompt of a replay work: placed at start(), prefilled in chunks under the step budget;
// its last row is sampled (greedy, on the device where the runner can).
class PromptPrefill {
 public:
  explicit PromptPrefill(std::vector<TokenId> prompt) : prompt_(std::move(prompt)) {}
  int64_t size() const { return static_cast<int64_t>(prompt_.size()); }
  NodeId node() const { return node_; }
  bool done() const { return next_ >= size(); }

  void place(Forest& forest) {
    const engine::PromptPlacement placement = forest.place_prompt(prompt_);
    node_ = placement.node;
    next_ = placement.shared;
  }
  // Adds the next chunk; true when it ended the prompt (its last row then samples).
  absl::StatusOr<bool> add_chunk(StepContext& step, const SamplingParams& greedy) {
    bool ended = false;
    if (absl::Status status = step.add_chunk(node_, prompt_, &next_, &ended); !status.ok()) {
      return status;
    }
    if (ended) step.sample_last_row(greedy, static_cast<uint64_t>(size()));
    return ended;
  }
  void release(Forest& forest) {
    if (node_ >= 0) forest.release(node_);
    node_ = -1;
  }

 private:
  std::vector<TokenId> prompt_;
  NodeId node_ = -1;
  int64_t next_ = 0;
};

// The tokens a row sees: its depth + 1 (the row's token is its node's last).
int64_t path_tokens_of_last(const engine::SequenceTree& tree, NodeId node) {
  const TreeNode& n = tree.node(node);
  return n.depth_begin + static_cast<int64_t>(n.tokens.size());
}

// Reasoning: see the header. Node ids of the trace index node_of_ (-1: not made or released).
class ReasoningReplayWork final : public engine::Work {
 public:
  ReasoningReplayWork(const ReasoningTrace& trace, std::vector<TokenId> prompt, int64_t iterations,
                      int32_t stride, int32_t page_tokens, int32_t vocab,
                      std::shared_ptr<Progress> progress)
      : trace_(trace),
        prompt_(std::move(prompt)),
        iterations_(iterations),
        stride_(stride),
        vocab_(vocab),
        progress_(std::move(progress)),
        node_of_(trace.nodes.size(), -1),
        next_token_(trace.nodes.size(), 0),
        rank_(trace.nodes.size(), 0) {
    greedy_.temperature = 0.0f;
    for (const ReasoningTrace::Node& node : trace_.nodes) {
      for (size_t r = 0; r < node.children.size(); ++r) {
        rank_[static_cast<size_t>(node.children[r])] = static_cast<int32_t>(r);
      }
    }
    // Admission's worst case: the most pages the trace's live nodes hold at one iteration.
    const int64_t prompt_pages = pages_for(prompt_.size(), page_tokens);
    peak_pages_ = prompt_pages;
    for (int64_t it = 1; it <= iterations_; ++it) {
      int64_t pages = prompt_pages, rows = 0;
      for (size_t id = 1; id < trace_.nodes.size(); ++id) {
        const ReasoningTrace::Node& n = trace_.nodes[id];
        if (n.start > it || pruned_before(n, it)) continue;
        pages += pages_for(std::min<int64_t>(n.length, it - n.start + 1), page_tokens);
        rows += n.end >= it ? 1 : 0;
      }
      peak_pages_ = std::max(peak_pages_, pages);
      max_rows_ = std::max(max_rows_, rows);
    }
  }

  int64_t pending_pages(const Forest& forest) const override {
    if (finished_) return 0;
    int64_t held = prompt_.node() >= 0 ? forest.node_pages(prompt_.node()) : 0;
    for (size_t id = 1; id < node_of_.size(); ++id) {
      if (node_of_[id] >= 0) held += forest.node_pages(node_of_[id]);
    }
    return std::max<int64_t>(peak_pages_ - held, 0);
  }
  int64_t max_step_rows() const override { return std::max<int64_t>(max_rows_, 1); }
  void start(Forest& forest) override {
    prompt_.place(forest);
    node_of_[0] = prompt_.node();
  }

  absl::Status add_rows(StepContext& step) override {
    rows_.clear();
    prefill_row_ = false;
    if (finished_) return absl::OkStatus();
    if (!prompt_.done()) {
      absl::StatusOr<bool> ended = prompt_.add_chunk(step, greedy_);
      if (!ended.ok()) return ended.status();
      prefill_row_ = *ended;
      return absl::OkStatus();
    }
    const Clock::time_point skip_start = Clock::now();
    while (iteration_ < iterations_ && !runs(iteration_ + 1, stride_)) {
      if (absl::Status status = advance(step.forest, nullptr); !status.ok()) return status;
    }
    progress_->fast_forward_seconds += seconds_since(skip_start);
    if (iteration_ >= iterations_) return absl::OkStatus();
    return advance(step.forest, &step);
  }

  absl::Status take_logits(StepContext& step) override {
    if (prefill_row_) {
      absl::StatusOr<SampledToken> sampled = step.next_sampled();
      if (!sampled.ok()) return sampled.status();
      next_token_[0] = sampled->token;
      if (iterations_ == 0) finish(step.forest);
      return absl::OkStatus();
    }
    if (rows_.empty()) return absl::OkStatus();
    for (int32_t id : rows_) {
      absl::StatusOr<SampledToken> sampled = step.next_sampled();
      if (!sampled.ok()) return sampled.status();
      next_token_[static_cast<size_t>(id)] = sampled->token;
      ++progress_->generated;
    }
    end_iteration(step.forest);
    return absl::OkStatus();
  }

  bool finished() const override { return finished_; }
  bool cancelled() const override { return false; }
  void abort(const absl::Status& status, Forest& forest) override {
    progress_->status = status;
    finish(forest);
  }

 private:
  // README: a childless node that ends before the trace's last iteration is pruned at its end.
  static bool pruned_before(const ReasoningTrace::Node& n, int64_t it) {
    return n.children.empty() && n.end < it;
  }

  // The next iteration's tree edits and one token per live node: rows of `step`, or appended
  // without rows (fast-forward).
  absl::Status advance(Forest& forest, StepContext* step) {
    const int64_t it = ++iteration_;
    engine::SequenceTree& tree = forest.tree();
    for (size_t id = 1; id < trace_.nodes.size(); ++id) {
      const ReasoningTrace::Node& n = trace_.nodes[id];
      if (n.start != it) continue;
      absl::StatusOr<NodeId> child = forest.add_child(node_of_[static_cast<size_t>(n.parent)]);
      if (!child.ok()) return child.status();
      node_of_[id] = *child;
      // A thought starts from its parent's next token (siblings made distinct by rank).
      next_token_[id] = (next_token_[static_cast<size_t>(n.parent)] + rank_[id]) % vocab_;
    }
    int32_t queries = 0;
    int64_t path_tokens = 0;
    for (size_t id = 1; id < trace_.nodes.size(); ++id) {
      const ReasoningTrace::Node& n = trace_.nodes[id];
      if (n.start > it || n.end < it) continue;
      const NodeId node = node_of_[id];
      const TokenId token = next_token_[id];
      ++queries;
      if (step == nullptr) {
        // The token the skipped row stands for: produced as a run row's is (take_logits).
        if (absl::Status status = tree.append(node, std::span(&token, 1)); !status.ok()) {
          return status;
        }
        ++progress_->generated;
        continue;
      }
      if (absl::Status status = step->add_run(node, std::span(&token, 1)); !status.ok()) {
        return status;
      }
      const int64_t depth = path_tokens_of_last(tree, node);
      step->sample_last_row(greedy_, static_cast<uint64_t>(depth));
      path_tokens += depth;
      rows_.push_back(static_cast<int32_t>(id));
    }
    progress_->shape.push_back({.queries = queries, .tree_tokens = tree.total_tokens()});
    if (step == nullptr) {
      end_iteration(forest);
    } else {
      progress_->decoded = true;
      progress_->iteration = it;
      progress_->weight = weight_of(it, stride_, iterations_);
      progress_->tree_tokens = tree.total_tokens();
      progress_->path_tokens = path_tokens;
    }
    return absl::OkStatus();
  }

  // After the iteration's tokens ran: childless nodes that ended are released (their KV
  // freed); after the last iteration everything is.
  void end_iteration(Forest& forest) {
    if (iteration_ >= iterations_) {
      finish(forest);
      return;
    }
    for (size_t id = 1; id < trace_.nodes.size(); ++id) {
      const ReasoningTrace::Node& n = trace_.nodes[id];
      if (node_of_[id] >= 0 && n.children.empty() && n.end == iteration_) {
        forest.release(node_of_[id]);
        node_of_[id] = -1;
      }
    }
  }

  void finish(Forest& forest) {
    if (finished_) return;
    for (size_t id = node_of_.size(); id-- > 1;) {
      if (node_of_[id] >= 0) forest.release(node_of_[id]);
      node_of_[id] = -1;
    }
    prompt_.release(forest);
    node_of_[0] = -1;
    finished_ = true;
  }

  const ReasoningTrace& trace_;
  PromptPrefill prompt_;
  int64_t iterations_;
  int32_t stride_;
  int32_t vocab_;
  std::shared_ptr<Progress> progress_;
  SamplingParams greedy_;
  std::vector<NodeId> node_of_;
  std::vector<TokenId> next_token_;  // per trace node: the token its next row runs
  std::vector<int32_t> rank_;        // per trace node: its index among its parent's children
  int64_t peak_pages_ = 0;
  int64_t max_rows_ = 0;
  int64_t iteration_ = 0;      // iterations done (run or fast-forwarded)
  std::vector<int32_t> rows_;  // this step's rows: trace node ids, in row order
  bool prefill_row_ = false;   // this step ended the prompt
  bool finished_ = false;
};

// Speculative decoding: see the header.
class SpecDecReplayWork final : public engine::Work {
 public:
  SpecDecReplayWork(const SpecDecWorkload& workload, int64_t steps, int32_t stride,
                    int32_t page_tokens, int32_t vocab, uint64_t seed,
                    std::shared_ptr<Progress> progress)
      : workload_(workload),
        prompt_(workload.prompt),
        steps_(steps),
        stride_(stride),
        page_tokens_(page_tokens),
        vocab_(vocab),
        progress_(std::move(progress)),
        rng_(seed),
        entries_(workload.parents.size()),
        children_(entries_, 0),
        node_of_(entries_, -1),
        drafted_(entries_, 0) {
    greedy_.temperature = 0.0f;
    for (size_t i = 1; i < entries_; ++i) ++children_[static_cast<size_t>(workload.parents[i])];
    // The top-ranked path: the root, then each entry's first child.
    top_path_.push_back(0);
    for (bool extended = true; extended;) {
      extended = false;
      for (size_t i = 1; i < entries_; ++i) {
        if (workload.parents[i] == top_path_.back()) {
          top_path_.push_back(static_cast<int32_t>(i));
          extended = true;
          break;
        }
      }
    }
  }

  // The tokens step `step` (1-based) commits after `committed` were: the trace's accept length,
  // within the top path and what is left to generate.
  static int64_t accepted(const SpecDecWorkload& workload, int64_t path_length, int64_t step,
                          int64_t committed) {
    const auto& lengths = workload.accept_lengths;
    const int64_t recorded =
        lengths.empty() ? 1 : lengths[static_cast<size_t>((step - 1) % std::ssize(lengths))];
    return std::min(
        {std::clamp<int64_t>(recorded, 1, path_length), workload.generate_tokens - committed});
  }

  int64_t pending_pages(const Forest& forest) const override {
    if (finished_) return 0;
    // The committed context, and at worst a page per drafted entry.
    const int64_t total = pages_for(prompt_.size() + workload_.generate_tokens + 1, page_tokens_) +
                          static_cast<int64_t>(entries_);
    int64_t held = prompt_.node() >= 0 ? forest.node_pages(prompt_.node()) : 0;
    for (NodeId node : created_) held += forest.node_pages(node);
    return std::max<int64_t>(total - held, 0);
  }
  int64_t max_step_rows() const override { return static_cast<int64_t>(entries_); }
  void start(Forest& forest) override { prompt_.place(forest); }

  absl::Status add_rows(StepContext& step) override {
    in_step_ = false;
    prefill_row_ = false;
    if (finished_) return absl::OkStatus();
    if (!prompt_.done()) {
      absl::StatusOr<bool> ended = prompt_.add_chunk(step, greedy_);
      if (!ended.ok()) return ended.status();
      prefill_row_ = *ended;
      return absl::OkStatus();
    }
    const Clock::time_point skip_start = Clock::now();
    while (step_ < steps_ && !runs(step_ + 1, stride_)) {
      if (absl::Status status = commit_unrun(step.forest); !status.ok()) return status;
    }
    progress_->fast_forward_seconds += seconds_since(skip_start);
    if (step_ >= steps_) return absl::OkStatus();
    return add_tree(step);
  }

  absl::Status take_logits(StepContext& step) override {
    if (prefill_row_) {
      absl::StatusOr<SampledToken> sampled = step.next_sampled();
      if (!sampled.ok()) return sampled.status();
      pending_ = sampled->token;
      if (steps_ == 0) finish(step.forest);
      return absl::OkStatus();
    }
    if (!in_step_) return absl::OkStatus();
    in_step_ = false;
    std::vector<TokenId>& argmax = argmax_;
    argmax.resize(entries_);
    for (size_t i = 0; i < entries_; ++i) {
      absl::StatusOr<SampledToken> sampled = step.next_sampled();
      if (!sampled.ok()) return sampled.status();
      argmax[i] = sampled->token;
    }
    const int64_t accept = accepted(workload_, std::ssize(top_path_), step_, committed_);
    // The drafted nodes go; the accepted entries after the root join the session node (the
    // verifier's KV copy, not run), and the bonus is the argmax after the last accepted one.
    for (auto it = created_.rbegin(); it != created_.rend(); ++it) step.forest.release(*it);
    created_.clear();
    accepted_tokens_.clear();
    for (int64_t d = 1; d < accept; ++d) {
      accepted_tokens_.push_back(drafted_[static_cast<size_t>(top_path_[d])]);
    }
    if (absl::Status status = step.forest.tree().append(prompt_.node(), accepted_tokens_);
        !status.ok()) {
      return status;
    }
    pending_ = argmax[static_cast<size_t>(top_path_[static_cast<size_t>(accept - 1)])];
    committed_ += accept;
    progress_->generated += accept;
    if (step_ >= steps_) finish(step.forest);
    return absl::OkStatus();
  }

  bool finished() const override { return finished_; }
  bool cancelled() const override { return false; }
  void abort(const absl::Status& status, Forest& forest) override {
    progress_->status = status;
    for (auto it = created_.rbegin(); it != created_.rend(); ++it) forest.release(*it);
    created_.clear();
    finish(forest);
  }

 private:
  // The next step's token tree as rows: the root (the pending token) appended to the session
  // node, every other entry in a child node (a chain of only children shares one node).
  absl::Status add_tree(StepContext& step) {
    ++step_;
    engine::SequenceTree& tree = step.forest.tree();
    std::uniform_int_distribution<TokenId> token(0, vocab_ - 1);
    int64_t path_tokens = 0;
    for (size_t i = 0; i < entries_; ++i) {
      const int32_t parent = workload_.parents[i];
      NodeId node = prompt_.node();
      drafted_[i] = i == 0 ? pending_ : token(rng_);
      if (i > 0) {
        if (parent > 0 && children_[static_cast<size_t>(parent)] == 1) {
          node = node_of_[static_cast<size_t>(parent)];  // continues the parent's chain
        } else {
          absl::StatusOr<NodeId> child = step.forest.add_child(
              parent == 0 ? prompt_.node() : node_of_[static_cast<size_t>(parent)]);
          if (!child.ok()) return child.status();
          node = *child;
          created_.push_back(node);
        }
      }
      node_of_[i] = node;
      if (absl::Status status = step.add_run(node, std::span(&drafted_[i], 1)); !status.ok()) {
        return status;
      }
      const int64_t depth = path_tokens_of_last(tree, node);
      step.sample_last_row(greedy_, static_cast<uint64_t>(depth));
      path_tokens += depth;
    }
    in_step_ = true;
    progress_->shape.push_back(
        {.queries = static_cast<int32_t>(entries_), .tree_tokens = tree.total_tokens()});
    progress_->decoded = true;
    progress_->iteration = step_;
    progress_->weight = weight_of(step_, stride_, steps_);
    progress_->tree_tokens = tree.total_tokens();
    progress_->path_tokens = path_tokens;
    return absl::OkStatus();
  }

  // A fast-forwarded step: its accepted tokens (the root and the entries after it) join the
  // session node without a forward pass.
  absl::Status commit_unrun(Forest& forest) {
    ++step_;
    engine::SequenceTree& tree = forest.tree();
    progress_->shape.push_back(
        {.queries = static_cast<int32_t>(entries_),
         .tree_tokens = tree.total_tokens() + static_cast<int64_t>(entries_)});
    const int64_t accept = accepted(workload_, std::ssize(top_path_), step_, committed_);
    accepted_tokens_.assign(static_cast<size_t>(accept), pending_);
    if (absl::Status status = tree.append(prompt_.node(), accepted_tokens_); !status.ok()) {
      return status;
    }
    committed_ += accept;
    progress_->generated += accept;
    if (step_ >= steps_) finish(forest);
    return absl::OkStatus();
  }

  void finish(Forest& forest) {
    if (finished_) return;
    prompt_.release(forest);
    finished_ = true;
  }

  const SpecDecWorkload& workload_;
  PromptPrefill prompt_;
  int64_t steps_;
  int32_t stride_;
  int32_t page_tokens_;
  int32_t vocab_;
  std::shared_ptr<Progress> progress_;
  std::mt19937_64 rng_;
  SamplingParams greedy_;
  size_t entries_;
  std::vector<int32_t> children_;  // per entry
  std::vector<int32_t> top_path_;  // entries of the top-ranked path, root first
  std::vector<NodeId> node_of_;    // this step: the node holding each entry
  std::vector<TokenId> drafted_;   // this step: each entry's token
  std::vector<NodeId> created_;    // this step's child nodes (held once each)
  std::vector<TokenId> argmax_;
  std::vector<TokenId> accepted_tokens_;
  TokenId pending_ = 0;  // the bonus token: the next step's root
  int64_t step_ = 0;     // steps done (run or fast-forwarded)
  int64_t committed_ = 0;
  bool in_step_ = false;
  bool prefill_row_ = false;
  bool finished_ = false;
};

int64_t specdec_steps(const SpecDecWorkload& workload) {
  int64_t path = 1;  // the top path's length, as SpecDecReplayWork finds it
  for (int32_t at = 0; workload.parents.size() > 1;) {
    const auto child = std::find(workload.parents.begin() + 1, workload.parents.end(), at);
    if (child == workload.parents.end()) break;
    at = static_cast<int32_t>(child - workload.parents.begin());
    ++path;
  }
  int64_t steps = 0;
  for (int64_t committed = 0; committed < workload.generate_tokens;) {
    committed += SpecDecReplayWork::accepted(workload, path, ++steps, committed);
  }
  return steps;
}

}  // namespace

int64_t workload_iterations(const Workload& workload) {
  if (const auto* fewshot = std::get_if<FewShotWorkload>(&workload)) return fewshot->iterations;
  if (const auto* reasoning = std::get_if<ReasoningWorkload>(&workload)) {
    return reasoning->trace.last_iteration;
  }
  return specdec_steps(std::get<SpecDecWorkload>(workload));
}

absl::StatusOr<std::string> load_specdec_prompt(const std::string& path, int32_t record) {
  std::ifstream file(path);
  if (!file) return absl::NotFoundError(absl::StrCat("cannot open workload file ", path));
  const nlohmann::json json = nlohmann::json::parse(file, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded() || !json.contains("Records") || !json["Records"].is_array() ||
      record < 0 || record >= static_cast<int32_t>(json["Records"].size()) ||
      !json["Records"][record].contains("prompt") ||
      !json["Records"][record]["prompt"].is_string()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": no Records[", record, "].prompt string"));
  }
  return json["Records"][record]["prompt"].get<std::string>();
}

bool is_llama3_tokenizer(const engine::Tokenizer& tokenizer) {
  return tokenizer.vocab_size() == 128256 && tokenizer.token_id("<|begin_of_text|>").has_value();
}

std::vector<TokenId> specdec_prompt_tokens(const std::string& text,
                                           const engine::Tokenizer& tokenizer, int32_t vocab,
                                           uint64_t seed) {
  if (is_llama3_tokenizer(tokenizer)) {
    absl::StatusOr<std::vector<TokenId>> ids =
        tokenizer.encode(text, /*add_bos=*/true, /*parse_special=*/false);
    if (ids.ok()) return *ids;
  }
  return random_tokens(kAppsPromptLlama3Tokens, vocab, seed);
}

ReplayResult replay_workload(engine::ModelRunner& runner, const engine::Tokenizer& tokenizer,
                             const Workload& workload, const ReplayOptions& options,
                             const StepObserver& on_step) {
  ReplayResult result;
  const int32_t vocab = runner.vocab_size();
  int64_t iterations = workload_iterations(workload);
  if (options.max_iterations > 0) iterations = std::min(iterations, options.max_iterations);
  const int32_t stride = std::max(options.stride, 1);

  // No prefix cache: a replay measures one workload's decoding, and its fast-forwarded
  // iterations append tokens whose KV is never computed, which a cache must never offer. One
  // workload at a time: its prompt may take the whole step budget (no decodes to protect).
  engine::SchedulerOptions scheduler_options{.page_tokens = options.page_tokens,
                                             .kv_pages = options.kv_pages,
                                             .max_step_tokens = options.max_step_tokens,
                                             .max_prefill_tokens = options.max_step_tokens,
                                             .prefix_cache_pages = 0,
                                             .planner = options.planner};
  engine::Scheduler scheduler(scheduler_options, runner, tokenizer);
  auto progress = std::make_shared<Progress>();
  std::shared_ptr<engine::GenerateEvents> events;  // few-shot
  std::unique_ptr<engine::Work> work;
  if (const auto* fewshot = std::get_if<FewShotWorkload>(&workload)) {
    engine::GenerateJob job{.prompt = random_tokens(fewshot->prompt_tokens, vocab, options.seed),
                            .n = fewshot->branches,
                            .max_tokens = static_cast<int32_t>(iterations) + 1,
                            .sampling = {.temperature = 0.0f},
                            .limits = {.ignore_eos = true}};
    result.prompt_tokens = fewshot->prompt_tokens;
    events = std::make_shared<engine::GenerateEvents>();
    work = std::make_unique<engine::GenerateWork>(std::move(job), events, tokenizer,
                                                  options.page_tokens);
  } else if (const auto* reasoning = std::get_if<ReasoningWorkload>(&workload)) {
    const int32_t prompt_tokens =
        reasoning->prompt_tokens > 0 ? reasoning->prompt_tokens : reasoning->trace.nodes[0].length;
    result.prompt_tokens = prompt_tokens;
    work = std::make_unique<ReasoningReplayWork>(
        reasoning->trace, random_tokens(prompt_tokens, vocab, options.seed), iterations, stride,
        options.page_tokens, vocab, progress);
  } else {
    const auto& spec = std::get<SpecDecWorkload>(workload);
    result.prompt_tokens = std::ssize(spec.prompt);
    work = std::make_unique<SpecDecReplayWork>(spec, iterations, stride, options.page_tokens, vocab,
                                               options.seed + 1, progress);
  }
  if (absl::Status status = scheduler.submit(std::move(work)); !status.ok()) {
    result.status = status;
    return result;
  }

  bool fewshot_decoding = false;  // the few-shot prompt has been prefilled
  int64_t fewshot_iteration = 0;
  std::vector<engine::GenerateEvent> delivered;
  int32_t idle_steps = 0;
  while (scheduler.has_live() || scheduler.queued() > 0) {
    // Few-shot: the tree the step's branches see, read before the step appends to it.
    int64_t tree_before = 0, fewshot_paths = 0;
    if (events != nullptr && fewshot_decoding) {
      const engine::SequenceTree& tree = scheduler.forest().tree();
      tree_before = tree.total_tokens();
      for (NodeId leaf : tree.live_leaves()) fewshot_paths += path_tokens_of_last(tree, leaf) + 1;
    }
    progress->decoded = false;
    progress->fast_forward_seconds = 0;
    const Clock::time_point start = Clock::now();
    scheduler.prepare();
    const std::optional<engine::StepStats> stats = scheduler.step();
    const double wall = seconds_since(start) - progress->fast_forward_seconds;
    if (!stats.has_value()) {
      // A work that only fast-forwarded to its end adds no rows; a work never admitted is stuck.
      if (++idle_steps > 2) {
        result.status = absl::ResourceExhaustedError(
            absl::StrCat("the replay made no progress: its work was not admitted (",
                         options.kv_pages, " KV pages of ", options.page_tokens, " tokens)"));
        break;
      }
      continue;
    }
    idle_steps = 0;
    StepRecord record{.rows = stats->rows,
                      .wall_seconds = wall,
                      .plan_seconds = stats->plan_seconds,
                      .forward_seconds = stats->forward_seconds,
                      .attention_seconds = stats->attention_seconds,
                      .kv_tokens_read = stats->kv_tokens_read};
    if (events != nullptr) {
      delivered.clear();
      (void)events->next(delivered, std::chrono::milliseconds(0));
      for (const engine::GenerateEvent& event : delivered) {
        result.generated_tokens += std::ssize(event.delta.ids);
      }
      if (fewshot_decoding) {
        record.iteration = ++fewshot_iteration;
        record.weight = 1;
        record.tree_kv_tokens = tree_before + stats->rows;
        record.query_path_tokens = fewshot_paths;
        result.iterations.push_back(
            {.queries = static_cast<int32_t>(stats->rows), .tree_tokens = record.tree_kv_tokens});
      }
      // The step that sampled the branches' first tokens ended the prompt.
      fewshot_decoding = fewshot_decoding || !delivered.empty();
    } else if (progress->decoded) {
      record.iteration = progress->iteration;
      record.weight = progress->weight;
      record.tree_kv_tokens = progress->tree_tokens;
      record.query_path_tokens = progress->path_tokens;
    }
    result.steps.push_back(record);
    if (on_step) on_step(record);
  }
  result.kv_pages_left = scheduler.kv().used_pages();
  if (events != nullptr) {
    delivered.clear();
    (void)events->next(delivered, std::chrono::milliseconds(0));
    for (const engine::GenerateEvent& event : delivered) {
      result.generated_tokens += std::ssize(event.delta.ids);
    }
    if (result.status.ok() && events->finished()) result.status = events->final_status();
  } else {
    result.iterations = std::move(progress->shape);
    result.generated_tokens = progress->generated;
    if (result.status.ok()) result.status = progress->status;
  }
  return result;
}

}  // namespace deft::bench
