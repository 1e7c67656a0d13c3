// A RunTree job as engine work: a server-side tree search under a BranchController policy
// (engine/branch_controller.h). The prompt is prefilled and branches k ways; every node
// generates until its segment ends (the policy's trigger), a leaf ends (EOS, stop, the path's
// max_tokens), or it is pruned. Once every node of a depth has ended its segment, the policy
// scores them and keeps the best w; the rest are pruned (their KV freed at once) and each kept
// node branches k ways (child_sampling.h: the k most likely first tokens when greedy). Nodes of
// the last depth run to a leaf end. The job ends with the best leaf's path and the whole tree.
// Node ids are the job's own: 0 is the prompt, then in creation order.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/branch_controller.h"
#include "engine/works/event_queue.h"
#include "engine/works/work.h"

namespace deft::engine {

struct TreeSearchJob {
  std::vector<TokenId> prompt;  // validated
  BranchPolicyOptions policy;   // validated
  SamplingParams sampling;
  int32_t max_tokens = 64;      // new tokens per root-to-leaf path
  StreamLimits limits;          // stop strings and EOS end a leaf
  Requester requester;          // admission order (engine/scheduler.h)
};

struct TreeSearchNode {
  int32_t id = 0;
  int32_t parent = -1;  // -1 for the prompt
  int32_t depth = 0;    // 0 = the prompt
  std::vector<TokenId> tokens;  // the prompt, or what the node generated
  std::vector<float> logprobs;
  std::string text;             // generated text (empty for the prompt)
  double score = 0.0;           // the policy's score of the path ending here
  FinishReason finish = FinishReason::kNone;  // leaves; kPruned for dropped nodes
};

struct TreeSearchEvent {
  enum class Kind : uint8_t { kNodeCreated, kTokens, kPruned, kFinished };
  Kind kind = Kind::kNodeCreated;
  int32_t node = 0;
  int32_t parent = -1;
  int32_t depth = 0;
  TokenDelta delta;                    // kTokens
  std::vector<int32_t> best_path;      // kFinished: node ids, the prompt first
  std::string best_text;               // kFinished
  std::vector<TreeSearchNode> nodes;   // kFinished: the whole tree, kept and pruned
};
using TreeSearchEvents = EventQueue<TreeSearchEvent>;

// Upper bounds for a job: KV pages held at its peak, and tokens in its tree; INT64_MAX when they
// pass int64 (a wide and deep policy).
struct TreeSearchBounds {
  int64_t pages = 0;
  int64_t tokens = 0;
};
TreeSearchBounds tree_search_bounds(const TreeSearchJob& job, int32_t page_tokens);

class TreeSearchWork final : public Work {
 public:
  TreeSearchWork(TreeSearchJob job, std::shared_ptr<TreeSearchEvents> events,
                 const Tokenizer& tokenizer, int32_t page_tokens);
  ~TreeSearchWork() override;

  int64_t pending_pages(const Forest& forest) const override;
  int64_t max_step_rows() const override;
  int64_t step_pages(const Forest& forest, const StepContext& step) const override;
  void start(Forest& forest) override;
  absl::Status add_rows(StepContext& step) override;
  absl::Status take_logits(StepContext& step) override;
  bool finished() const override { return finished_; }
  bool cancelled() const override { return events_->cancelled(); }
  void abort(const absl::Status& status, Forest& forest) override;

 private:
  enum class State : uint8_t { kDecoding, kReadying, kReady, kInner, kLeaf, kPruned };
  struct Live;  // per-node decoding state

  absl::Status add_token(int32_t id, const SampledToken& sampled, Forest& forest);
  absl::Status expand(int32_t depth, StepContext& step);
  void finish_job();
  NodeProgress progress(int32_t id) const;

  TreeSearchJob job_;
  std::shared_ptr<TreeSearchEvents> events_;
  const Tokenizer& tokenizer_;
  int32_t page_tokens_;
  std::unique_ptr<BranchController> controller_;
  TreeSearchBounds bounds_;
  std::vector<TreeSearchNode> nodes_;
  std::vector<std::unique_ptr<Live>> live_;  // by node id
  int64_t prefilled_ = -1;
  int32_t depth_ = 0;  // the depth being decoded
  bool in_step_ = false;
  bool finished_ = false;
};

}  // namespace deft::engine
