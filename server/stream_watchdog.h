// Cuts a stream whose client has stopped reading. A handler's Write blocks while the client's
// HTTP/2 flow-control window is full; its engine work pauses meanwhile (engine/works/
// event_queue.h) and keeps its KV. When one Write has waited `stall` (stream_stall_seconds),
// the watchdog cancels the call (ServerContext::TryCancel, thread-safe): the Write returns
// false, the handler cancels its work, and the KV is freed. A live but idle client (keepalive
// pings answered, nothing read) is not a dead connection, so keepalive alone would never end it.
// One thread for the whole server; a Write costs it one mutex round trip.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <list>
#include <mutex>
#include <thread>

namespace deft::server {

class StreamWatchdog {
  struct Entry;

 public:
  // `stall` of 0: never cut (no thread runs).
  explicit StreamWatchdog(std::chrono::milliseconds stall);
  ~StreamWatchdog();
  StreamWatchdog(const StreamWatchdog&) = delete;
  StreamWatchdog& operator=(const StreamWatchdog&) = delete;

  // Marks one Write on `context` in progress for its lifetime (`rpc` names the call in the log;
  // a literal). The context must outlive the guard.
  class Write {
   public:
    Write(StreamWatchdog& watchdog, grpc::ServerContext* context, const char* rpc);
    ~Write();
    Write(const Write&) = delete;
    Write& operator=(const Write&) = delete;
    // The watchdog cut the call while this Write waited.
    bool cut() const;

   private:
    StreamWatchdog& watchdog_;
    std::list<Entry>::iterator entry_;
  };

  std::chrono::milliseconds stall() const { return stall_; }
  // Calls cut so far.
  int64_t cuts() const { return cuts_.load(); }

 private:
  struct Entry {
    grpc::ServerContext* context;
    const char* rpc;
    std::chrono::steady_clock::time_point since;
    bool cut = false;
  };
  void run();

  const std::chrono::milliseconds stall_;
  mutable std::mutex mutex_;
  std::condition_variable stop_;
  bool stopping_ = false;
  std::list<Entry> writes_;  // guarded by mutex_
  std::atomic<int64_t> cuts_{0};
  std::thread thread_;
};

}  // namespace deft::server
