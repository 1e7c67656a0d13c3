#include "bench/serve_bench/session_client.h"

#include "absl/strings/str_cat.h"

namespace deft::bench::serve {

SessionClient::SessionClient(v1::Deft::Stub& stub, const JobEnv& env, JobRecord* record)
    : record_(record) {
  set_job_deadline(env, &context_);
  stream_ = stub.TreeSession(&context_);
}

SessionClient::~SessionClient() {
  if (closed_) return;
  context_.TryCancel();
  v1::SessionResponse ignored;
  while (stream_->Read(&ignored)) {
  }
  stream_->Finish().IgnoreError();
}

uint64_t SessionClient::send(v1::SessionRequest request) {
  if (broken_ || closed_) return 0;
  const uint64_t id = next_request_id_++;
  request.set_request_id(id);
  std::set<int64_t> decoding;
  if (request.has_decode()) {
    decoding.insert(request.decode().nodes().begin(), request.decode().nodes().end());
  }
  if (!stream_->Write(request)) {  // the stream is gone; the final status says why
    broken_ = true;
    return 0;
  }
  open_[id] = std::move(decoding);
  return id;
}

bool SessionClient::read(v1::SessionResponse* response) {
  if (closed_) return false;
  if (stream_->Read(response)) return true;
  closed_ = true;
  const grpc::Status status = stream_->Finish();
  if (!status.ok()) {
    record_->fail(status);
  } else if (!open_.empty()) {
    record_->fail(kProtocol, absl::StrCat("the session stream ended with ", open_.size(),
                                          " commands unanswered"));
  }
  return false;
}

std::optional<v1::SessionResponse> SessionClient::await(
    uint64_t request_id, const std::function<void(const v1::NodeTokens&)>& on_decoded) {
  v1::SessionResponse response;
  while (request_id != 0 && open_.count(request_id) > 0 && read(&response)) {
    const auto command = open_.find(response.request_id());
    // Request id 0: the session's announcement, or the confirmation of a half-close.
    if (command == open_.end()) continue;
    if (response.has_error()) {
      record_->fail(grpc::Status(static_cast<grpc::StatusCode>(response.error().code()),
                                 response.error().message()));
      open_.erase(command);
      continue;
    }
    if (response.has_decoded()) {
      if (on_decoded) on_decoded(response.decoded());
      if (response.decoded().finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
        command->second.erase(response.decoded().node());
      }
      if (!command->second.empty()) continue;
    }
    open_.erase(command);
    if (response.request_id() == request_id) return response;
  }
  if (request_id == 0) {  // send() found the stream broken: read its final status
    while (read(&response)) {
    }
  }
  return std::nullopt;
}

void SessionClient::close() {
  if (closed_) return;
  if (!broken_) stream_->WritesDone();
  broken_ = true;
  // Answers still outstanding are read and checked, then the final status.
  while (!open_.empty() && await(open_.rbegin()->first)) {
  }
  v1::SessionResponse response;
  while (read(&response)) {
    if (open_.count(response.request_id()) > 0 && response.has_error()) {
      record_->fail(grpc::Status(static_cast<grpc::StatusCode>(response.error().code()),
                                 response.error().message()));
    }
  }
}

}  // namespace deft::bench::serve
