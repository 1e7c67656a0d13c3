// The works behind a tree session's commands that need forward passes: create and extend
// (prefill a run onto a node), decode (generate in place on leaves), score (the log-probability
// of a continuation, kept nowhere) and verify (engine/works/verify_work.h). Each ends by telling
// its session the command is done.
#pragma once

#include <cstdint>
#include <memory>
#include <span>

#include "engine/works/session.h"
#include "engine/works/work.h"

namespace deft::engine {

// The work of a command that Session::next_command returned (create, extend, decode, score or
// verify). Any other command is a bug and aborts: branch, prune and close run in the session.
std::unique_ptr<Work> make_session_work(std::shared_ptr<Session> session, SessionCommand command);

// Base of the session works: cancellation follows the session, an abort answers the command
// with an error and frees what the work held.
class SessionWork : public Work {
 public:
  SessionWork(std::shared_ptr<Session> session, uint64_t request_id)
      : session_(std::move(session)), request_id_(request_id) {}
  bool is_session_command() const override { return true; }
  bool finished() const override { return finished_; }
  bool cancelled() const override { return session_->closing(); }
  void abort(const absl::Status& status, Forest& forest) override;

 protected:
  // Frees the work's own holds (temporary nodes).
  virtual void release_held(Forest& forest) { (void)forest; }
  // Answers the command with `status`: an error event unless the command has its own reply.
  virtual void answer_error(const absl::Status& status) { session_->error(request_id_, status); }
  void done() {
    finished_ = true;
    session_->command_done();
  }

  std::shared_ptr<Session> session_;
  uint64_t request_id_;
  bool finished_ = false;
};

// Raw log-softmax of `token` in a logits row.
float raw_logprob(std::span<const float> logits, TokenId token);

}  // namespace deft::engine
