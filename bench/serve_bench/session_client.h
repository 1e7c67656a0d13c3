// One job's TreeSession stream. Commands are written as soon as the job knows them and the
// server answers them in order, so a job may pipeline: send() several commands (prunes, the
// branches of a level), then await() the one whose answer it needs; answers to earlier commands
// read on the way are checked and dropped. A refused command or a broken stream fails the job's
// record with its code.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>

#include "bench/serve_bench/job.h"

namespace deft::bench::serve {

class SessionClient {
 public:
  SessionClient(v1::Deft::Stub& stub, const JobEnv& env, JobRecord* record);
  ~SessionClient();  // cancels a stream that was not closed

  // Writes `request` with the next request id and returns that id; 0 when the stream is broken.
  uint64_t send(v1::SessionRequest request);
  // Reads until the command `request_id` is answered: one response, or for a decode one
  // `decoded` message per step until each of its nodes has its finish reason (each goes to
  // `on_decoded`). Returns the answer (a decode's last message); nullopt when the command was
  // refused or the stream ended (the record then says why).
  std::optional<v1::SessionResponse> await(
      uint64_t request_id, const std::function<void(const v1::NodeTokens&)>& on_decoded = nullptr);
  // Half-closes, reads every outstanding answer and the final status.
  void close();

 private:
  // Reads one response; false when the stream ended.
  bool read(v1::SessionResponse* response);

  JobRecord* record_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::SessionRequest, v1::SessionResponse>> stream_;
  uint64_t next_request_id_ = 1;
  std::map<uint64_t, std::set<int64_t>> open_;  // unanswered commands -> decode nodes still going
  bool broken_ = false;
  bool closed_ = false;
};

}  // namespace deft::bench::serve
