// A tree session (the TreeSession RPC): the client's own search drives a tree in the shared
// forest. The session holds its nodes (Forest::hold) and, for each, the next-token logits at
// its end, so a decode, a branch's children, a score or a verify can start from any node
// without recomputing it. Commands run in order, one at a time: branch, prune and close at
// once on the engine thread; create, extend, decode, score and verify as Works under the
// scheduler. A bad command answers an error event and changes nothing.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "engine/forest.h"
#include "engine/works/event_queue.h"
#include "engine/works/work.h"

namespace deft::engine {

struct SessionLimits {
  int32_t max_sessions = 64;
  int32_t max_nodes = 1024;          // nodes one session may hold (each keeps a logits row)
  int32_t max_branches = 64;         // k of a branch
  int32_t max_verify_entries = 256;  // drafted tokens of one Verify
  int64_t max_context = 0;           // tokens on a path (the model's); 0: no limit
};

struct SessionEvent {
  enum class Kind : uint8_t { kCreated, kExtended, kDecoded, kBranched, kPruned, kScored, kClosed,
                              kError };
  uint64_t request_id = 0;
  Kind kind = Kind::kError;
  NodeId node = -1;
  int64_t length = 0;              // kExtended: tokens on the path to the node's end
  TokenDelta delta;                // kDecoded
  std::vector<NodeId> children;    // kBranched
  double logprob = 0.0;            // kScored
  std::vector<float> token_logprobs;
  absl::Status error;              // kError
};
using SessionEvents = EventQueue<SessionEvent>;

struct VerifyOutcome {
  std::vector<TokenId> accepted;
  std::vector<int32_t> accepted_entries;
  TokenId bonus_token = -1;
  NodeId node = -1;
};
using VerifyReply = EventQueue<VerifyOutcome>;

struct SessionCommand {
  enum class Kind : uint8_t { kCreate, kExtend, kDecode, kBranch, kPrune, kScore, kClose, kVerify };
  Kind kind = Kind::kClose;
  uint64_t request_id = 0;
  NodeId node = -1;
  std::vector<NodeId> nodes;         // decode
  std::vector<TokenId> tokens;       // create: prompt; extend: content; score: continuation;
                                     // verify: drafted tokens (validated ids)
  int32_t k = 0;                     // branch
  SamplingParams sampling;           // decode, verify
  int32_t max_tokens = 0;            // decode
  StreamLimits limits;               // decode
  std::vector<int32_t> parents;      // verify
  std::vector<float> draft_probs;    // verify
  std::shared_ptr<VerifyReply> reply;  // verify
  // Not OK: the request was malformed; the session answers this error in its turn.
  absl::Status invalid;
};

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(uint64_t id, std::shared_ptr<SessionEvents> events, const SessionLimits& limits,
          const Tokenizer& tokenizer, int32_t page_tokens);

  uint64_t id() const { return id_; }
  void enqueue(SessionCommand command) { commands_.push_back(std::move(command)); }
  // Runs queued commands until one needs forward passes, which is returned as a work (the
  // session is busy until that work ends); null when none is left.
  std::unique_ptr<Work> next_work(Forest& forest);
  bool busy() const { return busy_; }
  bool closing() const { return closing_; }
  // The client went away: stop after the running command (which the scheduler cancels).
  void begin_close() { closing_ = true; }
  // Releases every node and ends the event stream with `status` (idempotent).
  void close(Forest& forest, const absl::Status& status);
  int32_t num_nodes() const { return static_cast<int32_t>(nodes_.size()); }

  // For the session's works.
  using Logits = std::shared_ptr<const std::vector<float>>;
  SessionEvents& events() { return *events_; }
  const SessionLimits& limits() const { return limits_; }
  const Tokenizer& tokenizer() const { return tokenizer_; }
  int32_t page_tokens() const { return page_tokens_; }
  bool has_node(NodeId node) const { return nodes_.count(node) != 0; }
  const Logits& node_logits(NodeId node) const { return nodes_.at(node); }
  // Adds a node the session now holds (the caller hands over one Forest hold).
  void adopt(NodeId node, Logits logits) { nodes_[node] = std::move(logits); }
  void set_logits(NodeId node, Logits logits) { nodes_[node] = std::move(logits); }
  void command_done() { busy_ = false; }
  // NOT_FOUND naming the session and node unless the session holds `node`.
  absl::Status check_node(NodeId node, const char* field) const;
  void error(uint64_t request_id, const absl::Status& status);

 private:
  void branch(const SessionCommand& command, Forest& forest);
  void prune(const SessionCommand& command, Forest& forest);

  uint64_t id_;
  std::shared_ptr<SessionEvents> events_;
  SessionLimits limits_;
  const Tokenizer& tokenizer_;
  int32_t page_tokens_;
  std::deque<SessionCommand> commands_;
  std::unordered_map<NodeId, Logits> nodes_;
  bool busy_ = false;
  bool closing_ = false;
  bool closed_ = false;
};

}  // namespace deft::engine
