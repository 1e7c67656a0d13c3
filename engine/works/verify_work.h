// The work behind Verify: speculative decoding over the network. The drafted token tree runs
// under a session node in one step (one tree-attention pass: each entry sees the node's path and
// its own drafted ancestors); engine/draft_acceptance.h picks the accepted path from the target
// logits. The accepted path's KV stays as a chain under the node, its last node becomes a node
// of the session (with the logits after it), and every other drafted entry is freed.
#pragma once

#include <cstdint>
#include <memory>

#include "engine/works/session.h"
#include "engine/works/work.h"

namespace deft::engine {

// `command` was checked by Session::next_command (its node is the session's, the session has
// room for one more node, the deepest drafted path fits the context) and its draft tree by
// engine/draft_acceptance.h's validate_draft_tree. The outcome (accepted tokens and entries,
// bonus token, the node the accepted path ends at) is pushed to command.reply, which then
// finishes OK (a null reply: a kVerified session event); an abort (cancel, shutdown) answers
// the error the same way and frees every drafted node. Takes one step of command.tokens.size()
// query rows.
std::unique_ptr<Work> make_verify_work(std::shared_ptr<Session> session, uint64_t request_id,
                                       VerifyCommand command);

}  // namespace deft::engine
