#include "tests/integration/tree_clients.h"

#include <gtest/gtest.h>

namespace deft::testing {

namespace v1 = deft::v1;

void StreamedTokens::add(const v1::Tokens& delta, v1::FinishReason reason) {
  if (finish != v1::FINISH_REASON_UNSPECIFIED) ++messages_after_finish;
  ++messages;
  ids.insert(ids.end(), delta.ids().begin(), delta.ids().end());
  text += delta.text();
  logprobs.insert(logprobs.end(), delta.logprobs().begin(), delta.logprobs().end());
  if (reason != v1::FINISH_REASON_UNSPECIFIED) finish = reason;
}

GenerateRun run_generate(v1::Deft::Stub& stub, const v1::GenerateRequest& request) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  auto reader = stub.Generate(&context, request);
  GenerateRun run;
  v1::GenerateResponse response;
  while (reader->Read(&response)) {
    run.branches[response.branch()].add(response.delta(), response.finish_reason());
  }
  run.status = reader->Finish();
  return run;
}

v1::GenerateRequest greedy_request(const std::vector<int32_t>& prompt, int max_tokens) {
  v1::GenerateRequest request;
  request.mutable_prompt()->mutable_tokens()->mutable_ids()->Add(prompt.begin(), prompt.end());
  request.set_n(1);
  request.mutable_sampling()->set_max_tokens(max_tokens);
  request.mutable_sampling()->set_ignore_eos(true);
  return request;
}

TreeRun run_tree(v1::Deft::Stub& stub, const v1::RunTreeRequest& request) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  auto reader = stub.RunTree(&context, request);
  TreeRun run;
  v1::TreeEvent event;
  while (reader->Read(&event)) {
    run.events.push_back(event);
    if (event.has_tokens()) {
      run.streamed[event.tokens().node()].add(event.tokens().delta(),
                                              event.tokens().finish_reason());
    }
    if (event.has_finished()) {
      ++run.finished_events;
      run.result = event.finished();
    }
  }
  run.status = reader->Finish();
  return run;
}

TestSession::TestSession(v1::Deft::Stub& stub, std::chrono::seconds deadline) {
  context_.set_deadline(std::chrono::system_clock::now() + deadline);
  stream_ = stub.TreeSession(&context_);
}

TestSession::~TestSession() {
  if (!finished_) {
    context_.TryCancel();
    v1::SessionResponse ignored;
    while (stream_->Read(&ignored)) {
    }
    stream_->Finish();
  }
}

std::vector<v1::SessionResponse> TestSession::call(v1::SessionRequest request, bool expect_end) {
  std::vector<v1::SessionResponse> responses;
  request.set_request_id(next_request_id_++);
  if (ended_ || writes_done_ || !stream_->Write(request)) {
    ended_ = true;
    ADD_FAILURE() << "the session stream is closed; request not sent: " << request.DebugString();
    return responses;
  }
  std::set<int64_t> decoding;
  if (request.has_decode()) {
    decoding.insert(request.decode().nodes().begin(), request.decode().nodes().end());
  }
  v1::SessionResponse response;
  while (stream_->Read(&response)) {
    // The first response of the stream carries the session id; later ones carry it or 0.
    if (session_id_ == 0) {
      EXPECT_NE(response.session_id(), 0u) << "the first response has no session id";
      session_id_ = response.session_id();
    } else if (response.session_id() != 0) {
      EXPECT_EQ(response.session_id(), session_id_) << response.DebugString();
    }
    // A greeting before any answer (request id 0, no result) only announces the session.
    if (response.request_id() == 0 &&
        response.result_case() == v1::SessionResponse::RESULT_NOT_SET) {
      continue;
    }
    EXPECT_EQ(response.request_id(), request.request_id()) << response.DebugString();
    responses.push_back(response);
    if (!response.has_decoded()) return responses;
    if (response.decoded().finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
      decoding.erase(response.decoded().node());
      if (decoding.empty()) return responses;
    }
  }
  ended_ = true;
  if (!expect_end) {
    ADD_FAILURE() << "the session stream ended before answering " << request.DebugString();
  }
  return responses;
}

namespace {

v1::SessionResponse last_or_empty(const std::vector<v1::SessionResponse>& responses) {
  return responses.empty() ? v1::SessionResponse() : responses.back();
}

v1::Prompt token_prompt(const std::vector<int32_t>& tokens) {
  v1::Prompt prompt;
  prompt.mutable_tokens()->mutable_ids()->Add(tokens.begin(), tokens.end());
  return prompt;
}

v1::Prompt text_prompt(const std::string& text) {
  v1::Prompt prompt;
  prompt.set_text(text);
  return prompt;
}

}  // namespace

v1::SessionResponse TestSession::create(const std::vector<int32_t>& prompt) {
  v1::SessionRequest request;
  *request.mutable_create()->mutable_prompt() = token_prompt(prompt);
  return last_or_empty(call(request));
}

v1::SessionResponse TestSession::create_text(const std::string& text) {
  v1::SessionRequest request;
  *request.mutable_create()->mutable_prompt() = text_prompt(text);
  return last_or_empty(call(request));
}

v1::SessionResponse TestSession::extend(int64_t node, const std::vector<int32_t>& tokens) {
  v1::SessionRequest request;
  request.mutable_extend()->set_node(node);
  *request.mutable_extend()->mutable_content() = token_prompt(tokens);
  return last_or_empty(call(request));
}

v1::SessionResponse TestSession::extend_text(int64_t node, const std::string& text) {
  v1::SessionRequest request;
  request.mutable_extend()->set_node(node);
  *request.mutable_extend()->mutable_content() = text_prompt(text);
  return last_or_empty(call(request));
}

v1::SessionResponse TestSession::verify(int64_t node, const std::vector<int32_t>& tokens,
                                        const std::vector<int32_t>& parents,
                                        const v1::SamplingParams& sampling) {
  v1::SessionRequest request;
  v1::VerifyCommand* verify = request.mutable_verify();
  verify->set_node(node);
  verify->mutable_tokens()->Add(tokens.begin(), tokens.end());
  verify->mutable_parents()->Add(parents.begin(), parents.end());
  *verify->mutable_sampling() = sampling;
  return last_or_empty(call(request));
}

v1::SessionResponse TestSession::branch(int64_t node, int32_t k) {
  v1::SessionRequest request;
  request.mutable_branch()->set_node(node);
  request.mutable_branch()->set_k(k);
  return last_or_empty(call(request));
}

v1::SessionResponse TestSession::prune(int64_t node) {
  v1::SessionRequest request;
  request.mutable_prune()->set_node(node);
  return last_or_empty(call(request));
}

v1::SessionResponse TestSession::score(int64_t node, const std::vector<int32_t>& tokens) {
  v1::SessionRequest request;
  request.mutable_score()->set_node(node);
  *request.mutable_score()->mutable_continuation() = token_prompt(tokens);
  return last_or_empty(call(request));
}

v1::SessionResponse TestSession::score_text(int64_t node, const std::string& text) {
  v1::SessionRequest request;
  request.mutable_score()->set_node(node);
  *request.mutable_score()->mutable_continuation() = text_prompt(text);
  return last_or_empty(call(request));
}

v1::SessionResponse TestSession::close() {
  v1::SessionRequest request;
  request.mutable_close();
  return last_or_empty(call(request));
}

TestSession::Decoded TestSession::decode(const std::vector<int64_t>& nodes,
                                         const v1::SamplingParams& sampling) {
  v1::SessionRequest request;
  request.mutable_decode()->mutable_nodes()->Add(nodes.begin(), nodes.end());
  *request.mutable_decode()->mutable_sampling() = sampling;
  Decoded decoded;
  for (const v1::SessionResponse& response : call(request)) {
    ++decoded.responses;
    if (response.has_error()) {
      decoded.error = response.error();
    } else if (response.has_decoded()) {
      decoded.nodes[response.decoded().node()].add(response.decoded().delta(),
                                                   response.decoded().finish_reason());
    } else {
      ADD_FAILURE() << "unexpected answer to a decode: " << response.DebugString();
    }
  }
  return decoded;
}

TestSession::Decoded TestSession::decode_greedy(const std::vector<int64_t>& nodes, int max_tokens) {
  v1::SamplingParams sampling;
  sampling.set_max_tokens(max_tokens);
  sampling.set_ignore_eos(true);
  return decode(nodes, sampling);
}

grpc::Status TestSession::finish() {
  if (!writes_done_) {
    stream_->WritesDone();
    writes_done_ = true;
  }
  v1::SessionResponse response;
  while (stream_->Read(&response)) {
    // A half-close closes the session: the server may confirm with `closed` (request id 0).
    const bool close_confirmation = response.request_id() == 0 && response.has_closed();
    if (!ended_ && !close_confirmation) {
      ADD_FAILURE() << "a response after the last command: " << response.DebugString();
    }
  }
  ended_ = true;
  finished_ = true;
  return stream_->Finish();
}

int error_code(const v1::SessionResponse& response) {
  return response.has_error() ? response.error().code() : -1;
}

}  // namespace deft::testing
