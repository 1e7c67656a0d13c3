#include "engine/works/tree_search_work.h"

#include <algorithm>
#include <limits>

#include "engine/works/child_sampling.h"

namespace deft::engine {
namespace {

int64_t pages_for(int64_t tokens, int32_t page_tokens) {
  return (tokens + page_tokens - 1) / page_tokens;
}

// The bounds saturate at INT64_MAX: a policy's worst case passes int64 (64 children a level
// over 16 levels is 2^96 nodes), and a saturated bound is over every limit, so it is refused.
int64_t saturating_mul(int64_t a, int64_t b) {
  int64_t product = 0;
  return __builtin_mul_overflow(a, b, &product) ? std::numeric_limits<int64_t>::max() : product;
}
int64_t saturating_add(int64_t a, int64_t b) {
  int64_t sum = 0;
  return __builtin_add_overflow(a, b, &sum) ? std::numeric_limits<int64_t>::max() : sum;
}

}  // namespace

struct TreeSearchWork::Live {
  NodeId node = -1;  // in the forest; held while the node decodes or waits to branch
  State state = State::kDecoding;
  SampledToken pending;  // sampled, not yet run through the model
  uint64_t seed = 0;
  std::unique_ptr<TokenStream> stream;
  double path_logprob = 0.0;
  int64_t path_tokens = 0;
  std::vector<float> logits;  // kReady: the next-token logits its children start from
};

TreeSearchBounds tree_search_bounds(const TreeSearchJob& job, int32_t page_tokens) {
  const BranchPolicyOptions& policy = job.policy;
  const auto prompt = static_cast<int64_t>(job.prompt.size());
  TreeSearchBounds bounds{.pages = pages_for(prompt, page_tokens), .tokens = prompt};
  int64_t nodes = policy.max_depth > 0 ? policy.branch_factor : 1;
  for (int32_t depth = 1; depth <= std::max(policy.max_depth, 1); ++depth) {
    // Inner nodes stop at their trigger (every_tokens bounds them); others run to max_tokens.
    int64_t segment = job.max_tokens;
    if (depth < policy.max_depth && policy.trigger == BranchPolicyOptions::Trigger::kEveryTokens) {
      segment = std::min<int64_t>(segment, policy.every_tokens);
    }
    bounds.pages =
        saturating_add(bounds.pages, saturating_mul(nodes, pages_for(segment, page_tokens)));
    bounds.tokens = saturating_add(bounds.tokens, saturating_mul(nodes, segment));
    const int64_t kept = policy.keep_best > 0 ? std::min<int64_t>(nodes, policy.keep_best) : nodes;
    nodes = saturating_mul(kept, policy.branch_factor);
  }
  return bounds;
}

TreeSearchWork::TreeSearchWork(TreeSearchJob job, std::shared_ptr<TreeSearchEvents> events,
                               const Tokenizer& tokenizer, int32_t page_tokens)
    : job_(std::move(job)),
      events_(std::move(events)),
      tokenizer_(tokenizer),
      page_tokens_(page_tokens),
      controller_(make_branch_controller(job_.policy)),
      bounds_(tree_search_bounds(job_, page_tokens)) {
  requester = job_.requester;
  nodes_.push_back({.id = 0, .parent = -1, .depth = 0, .tokens = job_.prompt});
  live_.push_back(std::make_unique<Live>());
  live_[0]->state = State::kReadying;
  live_[0]->seed = job_.sampling.seed;
}

TreeSearchWork::~TreeSearchWork() = default;

int64_t TreeSearchWork::pending_pages(const Forest& forest) const {
  if (finished_) return 0;
  int64_t held = 0;
  for (const auto& live : live_) {
    if (live != nullptr && live->node >= 0 && forest.tree().contains(live->node)) {
      held += forest.node_pages(live->node);
    }
  }
  return std::max<int64_t>(bounds_.pages - held, 0);
}

int64_t TreeSearchWork::max_step_rows() const {
  // The widest depth decodes all its nodes in one step.
  const BranchPolicyOptions& policy = job_.policy;
  int64_t nodes = policy.max_depth > 0 ? policy.branch_factor : 1;
  int64_t widest = nodes;
  for (int32_t depth = 2; depth <= policy.max_depth; ++depth) {
    const int64_t kept = policy.keep_best > 0 ? std::min<int64_t>(nodes, policy.keep_best) : nodes;
    nodes = kept * policy.branch_factor;
    widest = std::max(widest, nodes);
  }
  return widest;
}

NodeProgress TreeSearchWork::progress(int32_t id) const {
  const TreeSearchNode& node = nodes_[id];
  const Live& live = *live_[id];
  return {.depth = node.depth,
          .tokens = static_cast<int32_t>(node.tokens.size()),
          .last_token = node.tokens.empty() ? -1 : node.tokens.back(),
          .text = node.text,
          .path_logprob = live.path_logprob,
          .path_tokens = live.path_tokens};
}

int64_t TreeSearchWork::step_pages(const Forest& forest, const StepContext& step) const {
  if (finished_) return 0;
  const auto prompt_size = static_cast<int64_t>(job_.prompt.size());
  if (prefilled_ < prompt_size) {
    return forest.append_pages(live_[0]->node, step.chunk_rows(prompt_size - prefilled_));
  }
  // What add_rows() runs: one token on every decoding or readying node.
  int64_t pages = 0;
  for (const auto& live : live_) {
    if (live != nullptr && (live->state == State::kDecoding || live->state == State::kReadying)) {
      pages += forest.append_pages(live->node, 1);
    }
  }
  return pages;
}

void TreeSearchWork::start(Forest& forest) {
  const PromptPlacement placement = forest.place_prompt(job_.prompt);
  live_[0]->node = placement.node;
  prefilled_ = placement.shared;
}

absl::Status TreeSearchWork::add_rows(StepContext& step) {
  in_step_ = false;
  if (events_->backlogged()) return absl::OkStatus();  // paused: the client reads slowly
  const auto prompt_size = static_cast<int64_t>(job_.prompt.size());
  if (prefilled_ < prompt_size) {
    return step.add_chunk(live_[0]->node, job_.prompt, &prefilled_, &in_step_);
  }
  int64_t rows = 0;
  for (const auto& live : live_) {
    if (live != nullptr && (live->state == State::kDecoding || live->state == State::kReadying)) {
      ++rows;
    }
  }
  if (rows == 0 || step.budget < rows) return absl::OkStatus();
  for (const auto& live : live_) {
    if (live == nullptr || !(live->state == State::kDecoding || live->state == State::kReadying)) {
      continue;
    }
    if (absl::Status status = step.add_run(live->node, std::span(&live->pending.token, 1));
        !status.ok()) {
      return status;
    }
    if (live->state == State::kDecoding) {
      // A decode row only needs its next token (a readying row keeps its logits for branching).
      const TreeNode& node = step.forest.tree().node(live->node);
      SamplingParams params = job_.sampling;
      params.seed = live->seed;
      step.sample_last_row(params, static_cast<uint64_t>(node.depth_begin + node.tokens.size()));
    }
  }
  in_step_ = true;
  return absl::OkStatus();
}

absl::Status TreeSearchWork::take_logits(StepContext& step) {
  if (!in_step_) return absl::OkStatus();
  in_step_ = false;
  Forest& forest = step.forest;
  if (live_[0]->state == State::kReadying) {
    // The prompt's last row.
    const std::span<const float> logits = step.next_logits();
    live_[0]->logits.assign(logits.begin(), logits.end());
    live_[0]->state = State::kReady;
  } else {
    for (size_t id = 0; id < live_.size(); ++id) {
      Live* live = live_[id].get();
      if (live == nullptr ||
          !(live->state == State::kDecoding || live->state == State::kReadying)) {
        continue;
      }
      if (live->state == State::kReadying) {
        const std::span<const float> logits = step.next_logits();
        live->logits.assign(logits.begin(), logits.end());
        live->state = State::kReady;
        continue;
      }
      absl::StatusOr<SampledToken> sampled = step.next_sampled();
      if (!sampled.ok()) return sampled.status();
      if (absl::Status status = add_token(static_cast<int32_t>(id), *sampled, forest);
          !status.ok()) {
        return status;
      }
      ++step.generated;
    }
  }
  // Once no node of the current depth is still running, the depth is decided.
  for (;;) {
    bool running = false;
    for (size_t id = 0; id < live_.size(); ++id) {
      const Live* live = live_[id].get();
      if (live != nullptr && nodes_[id].depth == depth_ &&
          (live->state == State::kDecoding || live->state == State::kReadying)) {
        running = true;
      }
    }
    if (running) break;
    const int32_t decided = depth_;
    if (absl::Status status = expand(decided, step); !status.ok()) return status;
    if (finished_ || depth_ == decided) break;
  }
  return absl::OkStatus();
}

absl::Status TreeSearchWork::add_token(int32_t id, const SampledToken& sampled, Forest& forest) {
  Live& live = *live_[id];
  TreeSearchNode& node = nodes_[id];
  TokenDelta delta = live.stream->add(sampled, live.path_tokens + 1 >= job_.max_tokens);
  node.tokens.push_back(sampled.token);
  node.logprobs.push_back(sampled.logprob);
  node.text = live.stream->text();
  live.path_logprob += sampled.logprob;
  ++live.path_tokens;
  const FinishReason finish = delta.finish;
  events_->push({.kind = TreeSearchEvent::Kind::kTokens, .node = id, .delta = std::move(delta)});
  if (finish != FinishReason::kNone) {
    node.finish = finish;
    node.score = controller_->score(progress(id));
    live.state = State::kLeaf;
    forest.release(live.node);  // a leaf's KV is of no further use
    live.node = -1;
    return absl::OkStatus();
  }
  live.pending = sampled;
  if (node.depth < controller_->max_depth() && controller_->ends_segment(progress(id))) {
    live.state = State::kReadying;  // its last token still runs, for its children's logits
  } else {
    live.state = State::kDecoding;
  }
  return absl::OkStatus();
}

absl::Status TreeSearchWork::expand(int32_t depth, StepContext& step) {
  Forest& forest = step.forest;
  std::vector<int32_t> ready;
  std::vector<double> scores;
  for (size_t id = 0; id < live_.size(); ++id) {
    if (live_[id] != nullptr && nodes_[id].depth == depth && live_[id]->state == State::kReady) {
      ready.push_back(static_cast<int32_t>(id));
      scores.push_back(depth == 0 ? 0.0 : controller_->score(progress(static_cast<int32_t>(id))));
    }
  }
  if (ready.empty()) {
    finish_job();
    return absl::OkStatus();
  }
  std::vector<int32_t> keep = controller_->select(scores);
  std::vector<bool> kept(ready.size(), false);
  for (int32_t index : keep) kept[static_cast<size_t>(index)] = true;
  for (size_t i = 0; i < ready.size(); ++i) {
    if (kept[i]) continue;
    const int32_t id = ready[i];
    nodes_[id].finish = FinishReason::kPruned;
    nodes_[id].score = scores[i];
    live_[id]->state = State::kPruned;
    forest.discard(live_[id]->node);  // a pruned branch's KV is freed, not cached
    live_[id]->node = -1;
    live_[id]->logits = {};
    events_->push({.kind = TreeSearchEvent::Kind::kPruned, .node = id});
  }
  const int32_t k = depth == 0 && controller_->max_depth() == 0 ? 1 : controller_->branch_factor();
  depth_ = depth + 1;
  for (int32_t index : keep) {
    const int32_t parent_id = ready[static_cast<size_t>(index)];
    Live& parent = *live_[parent_id];
    nodes_[parent_id].score = scores[static_cast<size_t>(index)];
    absl::StatusOr<std::vector<NodeId>> children = forest.branch(parent.node, k);
    if (!children.ok()) return children.status();
    const TreeNode& parent_node = forest.tree().node(parent.node);
    const auto position =
        static_cast<uint64_t>(parent_node.depth_begin + parent_node.tokens.size());
    SamplingParams params = job_.sampling;
    params.seed = parent.seed;
    absl::StatusOr<std::vector<SampledToken>> first =
        sample_children(step.sampler, parent.logits, params, position, k);
    if (!first.ok()) return first.status();
    forest.release(parent.node);  // the children hold the path from now on
    parent.node = -1;
    parent.logits = {};
    parent.state = State::kInner;
    for (int32_t i = 0; i < k; ++i) {
      const auto id = static_cast<int32_t>(nodes_.size());
      nodes_.push_back({.id = id, .parent = parent_id, .depth = depth + 1});
      auto live = std::make_unique<Live>();
      live->node = (*children)[i];
      live->seed = branch_seed(parent.seed, static_cast<uint64_t>(i));
      live->stream = std::make_unique<TokenStream>(tokenizer_, &job_.limits);
      live->path_logprob = parent.path_logprob;
      live->path_tokens = parent.path_tokens;
      live_.push_back(std::move(live));
      events_->push({.kind = TreeSearchEvent::Kind::kNodeCreated,
                     .node = id,
                     .parent = parent_id,
                     .depth = depth + 1});
      // A child's stream continues its parent's text (stop strings see its own text only).
      if (absl::Status status = add_token(id, (*first)[i], forest); !status.ok()) return status;
    }
  }
  return absl::OkStatus();
}

void TreeSearchWork::finish_job() {
  finished_ = true;
  TreeSearchEvent event{.kind = TreeSearchEvent::Kind::kFinished};
  int32_t best = -1;
  for (const TreeSearchNode& node : nodes_) {
    const bool leaf = node.finish == FinishReason::kEos || node.finish == FinishReason::kStop ||
                      node.finish == FinishReason::kLength;
    if (leaf && (best < 0 || node.score > nodes_[best].score)) best = node.id;
  }
  if (best >= 0) {
    for (int32_t id = best; id != -1; id = nodes_[id].parent) event.best_path.push_back(id);
    std::reverse(event.best_path.begin(), event.best_path.end());
    for (int32_t id : event.best_path) event.best_text += nodes_[id].text;
  }
  event.nodes = nodes_;
  events_->push(std::move(event));
  events_->finish(absl::OkStatus());
}

void TreeSearchWork::abort(const absl::Status& status, Forest& forest) {
  for (size_t id = 0; id < live_.size(); ++id) {
    Live* live = live_[id].get();
    if (live == nullptr) continue;
    if (live->node >= 0) forest.release(live->node);
    live->node = -1;
    if (live->state == State::kDecoding || live->state == State::kReadying ||
        live->state == State::kReady) {
      nodes_[id].finish = FinishReason::kCancelled;
    }
  }
  finished_ = true;
  events_->finish(status);
}

}  // namespace deft::engine
