// The works behind a tree session's commands that need forward passes: create and extend
// (prefill a run onto a node), decode (generate in place on leaves), score (the log-probability
// of a continuation, kept nowhere) and verify (engine/verify_work.h). Each ends by telling its
// session the command is done.
#pragma once

#include <memory>

#include "engine/works/session.h"
#include "engine/works/work.h"

namespace deft::engine {

// Base of the session works: cancellation follows the session, an abort answers the command
// with an error (a verify through its reply) and frees what the work held.
class SessionWork : public Work {
 public:
  SessionWork(std::shared_ptr<Session> session, SessionCommand command)
      : session_(std::move(session)), command_(std::move(command)) {}
  bool finished() const override { return finished_; }
  bool cancelled() const override { return session_->closing(); }
  void abort(const absl::Status& status, Forest& forest) override;

 protected:
  // Frees the work's own holds (temporary nodes).
  virtual void release_held(Forest& forest) { (void)forest; }
  void done() {
    finished_ = true;
    session_->command_done();
  }
  Session& session() { return *session_; }
  const SessionCommand& command() const { return command_; }

  std::shared_ptr<Session> session_;
  SessionCommand command_;
  bool finished_ = false;
};

std::unique_ptr<Work> make_prefill_work(std::shared_ptr<Session> session, SessionCommand command);
std::unique_ptr<Work> make_decode_work(std::shared_ptr<Session> session, SessionCommand command);
std::unique_ptr<Work> make_score_work(std::shared_ptr<Session> session, SessionCommand command);
std::unique_ptr<Work> make_verify_work(std::shared_ptr<Session> session, SessionCommand command);

// Raw log-softmax of `token` in a logits row.
float raw_logprob(std::span<const float> logits, TokenId token);

}  // namespace deft::engine
