// A tree session (the TreeSession RPC): the client's own search drives a tree in the shared
// forest. The session holds its nodes (Forest::hold) and, for each, the next-token logits at
// its end, so a decode, a branch's children, a score or a verify can start from any node
// without recomputing it. Commands run in order, one at a time: branch, prune and close at
// once on the engine thread; create, extend, decode, score and verify as Works under the
// scheduler. A bad command is answered with an error (a verify's through its reply) and changes
// nothing.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "engine/draft_acceptance.h"
#include "engine/forest.h"
#include "engine/speculation/speculator.h"
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

struct VerifyOutcome {
  std::vector<TokenId> accepted;
  std::vector<int32_t> accepted_entries;
  TokenId bonus_token = -1;
  NodeId node = -1;
};
using VerifyReply = EventQueue<VerifyOutcome>;

struct SessionEvent {
  enum class Kind : uint8_t {
    kCreated,
    kExtended,
    kDecoded,
    kBranched,
    kPruned,
    kScored,
    kClosed,
    kError,
    kVerified
  };
  uint64_t request_id = 0;
  Kind kind = Kind::kError;
  NodeId node = -1;
  int64_t length = 0;              // kExtended: tokens on the path to the node's end
  TokenDelta delta;                // kDecoded
  SpeculationStats speculation;    // kDecoded: a speculative node's, on its last event
  std::vector<NodeId> children;    // kBranched
  double logprob = 0.0;            // kScored
  std::vector<float> token_logprobs;
  absl::Status error;              // kError
  VerifyOutcome verified;          // kVerified
};
using SessionEvents = EventQueue<SessionEvent>;

// The commands of a session, one struct per kind. Token ids, sampling parameters and a verify's
// draft tree are the caller's to check before queueing (a malformed request carries its error
// in SessionCommand::invalid); nodes and limits are checked in the session's turn
// (Session::next_command).
struct CreateCommand {
  std::vector<TokenId> prompt;
};
struct ExtendCommand {
  NodeId node = -1;  // a leaf of the session
  std::vector<TokenId> tokens;
};
struct DecodeCommand {
  std::vector<NodeId> nodes;  // distinct leaves of the session, decoded together
  SamplingParams sampling;
  int32_t max_tokens = 0;
  StreamLimits limits;
  // Server-side speculative decoding of every node (engine/speculation/speculator.h); null: off.
  std::shared_ptr<const SpeculativeOptions> speculative;
};
struct BranchCommand {
  NodeId node = -1;
  int32_t k = 0;
};
struct PruneCommand {
  NodeId node = -1;
};
struct ScoreCommand {
  NodeId node = -1;
  std::vector<TokenId> continuation;
};
struct CloseCommand {};
// A drafted token tree under `node` (engine/draft_acceptance.h's DraftTree), answered through
// `reply` (the Verify RPC) or, when `reply` is null, through the session's events like the other
// commands (kVerified or kError; the TreeSession stream's verify).
struct VerifyCommand {
  NodeId node = -1;
  std::vector<TokenId> tokens;
  std::vector<int32_t> parents;
  std::vector<float> draft_probs;
  std::vector<DraftDistribution> draft_distributions;
  DraftSampling draft_sampling = DraftSampling::kUnspecified;
  SamplingParams sampling;
  std::shared_ptr<VerifyReply> reply;
};

struct SessionCommand {
  uint64_t request_id = 0;
  // Counted in the session's inflow (EventQueue::inflow_added by the stream's handler): the
  // session gives it back when it takes or drops the command.
  bool counted = false;
  // Not OK: the request was malformed; the session answers this error in its turn.
  absl::Status invalid;
  std::variant<CreateCommand, ExtendCommand, DecodeCommand, BranchCommand, PruneCommand,
               ScoreCommand, CloseCommand, VerifyCommand>
      op;

  // A verify's own reply; null for the other commands and a stream verify (they answer through
  // the session's events).
  std::shared_ptr<VerifyReply> verify_reply() const {
    const auto* verify = std::get_if<VerifyCommand>(&op);
    return verify != nullptr ? verify->reply : nullptr;
  }
};

class Session {
 public:
  Session(uint64_t id, std::shared_ptr<SessionEvents> events, const SessionLimits& limits,
          const Tokenizer& tokenizer, int32_t page_tokens);

  uint64_t id() const { return id_; }
  void enqueue(SessionCommand command) { commands_.push_back(std::move(command)); }
  // Runs queued commands until one needs forward passes: branch, prune and close run here, a
  // malformed or refused command is answered with its error. Returns that command (create,
  // extend, decode, score or verify), checked against the session's nodes and limits, and marks
  // the session busy until its work calls command_done(); nullopt when none is left or the
  // session is busy or closing. engine/works/session_work.h makes its work.
  std::optional<SessionCommand> next_command(Forest& forest);
  bool busy() const { return busy_; }
  bool has_commands() const { return !commands_.empty(); }
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
  // The next-token logits at the node's end; null after a decode of it failed part way
  // (next_command refuses commands that read them until an extend computes them again).
  const Logits& node_logits(NodeId node) const { return nodes_.at(node); }
  // Adds a node the session now holds (the caller hands over one Forest hold).
  void adopt(NodeId node, Logits logits) { nodes_[node] = std::move(logits); }
  void set_logits(NodeId node, Logits logits) { nodes_[node] = std::move(logits); }
  void command_done() { busy_ = false; }
  // NOT_FOUND naming the session and node unless the session holds `node`.
  absl::Status check_node(NodeId node, const char* field) const;
  void error(uint64_t request_id, const absl::Status& status);

 private:
  // OK when a command of forward passes may start: its nodes are the session's, a grown node
  // is a leaf, the session has room for new nodes and no path passes the model's context.
  absl::Status check(const CreateCommand& create) const;
  absl::Status check(const ExtendCommand& extend, const SequenceTree& tree) const;
  absl::Status check(const DecodeCommand& decode, const SequenceTree& tree) const;
  absl::Status check(const ScoreCommand& score, const SequenceTree& tree) const;
  absl::Status check(const VerifyCommand& verify, const SequenceTree& tree) const;
  absl::Status check_leaf(NodeId node, const char* field, const SequenceTree& tree) const;
  // FAILED_PRECONDITION when `node` (the session's) has no kept logits.
  absl::Status check_logits(NodeId node, const char* field) const;
  absl::Status check_context(int64_t tokens, const char* what) const;
  absl::Status check_room(int64_t new_nodes) const;
  void branch(uint64_t request_id, const BranchCommand& command, Forest& forest);
  void prune(uint64_t request_id, const PruneCommand& command, Forest& forest);
  // Answers a command with an error: a verify through its reply, the others as an event.
  void fail(const SessionCommand& command, const absl::Status& status);

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
