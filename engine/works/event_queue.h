// A one-way event stream from the engine thread to one client handler (DESIGN.md §2): the
// engine pushes events and finally a status; the handler takes them in order and may ask the
// engine to cancel. Thread-safe; no gRPC here.
//
// Backpressure: the queue is bounded by its producer, not by push(). A work whose queue holds
// kBacklogLimit events or more adds no rows to the step (it pauses, keeping its KV) until the
// handler has taken them, so a client that stops reading cannot grow server memory: the handler
// blocks in its gRPC write once the transport's flow-control window is full, stops taking
// events, and the work waits. A step adds at most one event per live branch, so a queue never
// holds more than kBacklogLimit + max_branches events (+ the final ones of an abort). Paused
// rather than cancelled: a slow client (a long link, a busy reader) still gets its whole answer,
// and its paused work costs no steps; one that reads nothing for stream_stall_seconds is cut by
// the server (server/stream_watchdog.h), which frees the KV.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <utility>
#include <vector>

#include "absl/status/status.h"

namespace deft::engine {

template <typename Event>
class EventQueue {
 public:
  // Events waiting for the handler before the producer pauses: a few hundred steps of one
  // branch, or several steps of a wide tree. A fast reader never reaches it (the handler takes
  // everything waiting at each wake-up); the events are small (a token or two each).
  static constexpr size_t kBacklogLimit = 256;

  // Handler side. Moves the events that arrived into `out` (waiting up to `timeout` for the
  // first); returns false once the stream has ended and every event has been taken.
  bool next(std::vector<Event>& out, std::chrono::milliseconds timeout) {
    std::unique_lock lock(mutex_);
    ready_.wait_for(lock, timeout, [&] { return finished_ || !events_.empty(); });
    while (!events_.empty()) {
      out.push_back(std::move(events_.front()));
      events_.pop_front();
    }
    return !(finished_ && out.empty());
  }
  // The stream's end: OK, or why it failed (valid once next() returned false).
  absl::Status final_status() const {
    std::lock_guard lock(mutex_);
    return status_;
  }
  // Asks the engine to drop the work (client cancelled or went away); its KV is freed before
  // the next step.
  void cancel() { cancelled_.store(true, std::memory_order_relaxed); }

  // Engine side.
  bool cancelled() const { return cancelled_.load(std::memory_order_relaxed); }
  // The handler has fallen kBacklogLimit events behind: the producing work pauses.
  bool backlogged() const {
    std::lock_guard lock(mutex_);
    return events_.size() >= kBacklogLimit;
  }
  void push(Event event) {
    {
      std::lock_guard lock(mutex_);
      events_.push_back(std::move(event));
    }
    ready_.notify_all();
  }
  // Ends the stream; the first outcome (e.g. a failure) stands.
  void finish(absl::Status status) {
    {
      std::lock_guard lock(mutex_);
      if (finished_) return;
      finished_ = true;
      status_ = std::move(status);
    }
    ready_.notify_all();
    room_.notify_all();
  }
  bool finished() const {
    std::lock_guard lock(mutex_);
    return finished_;
  }

  // Inflow, the other direction (a tree session's commands, which its handler reads from the
  // client and the engine takes in turn): at most kInflowLimit may wait, so a client that
  // pipelines commands faster than they run (each up to the request size limit, megabytes)
  // cannot grow server memory. The handler stops reading once the limit is reached, and gRPC's
  // flow control then holds the client back.
  static constexpr int32_t kInflowLimit = 64;
  // Handler: waits up to `timeout` for room; true when there is (or the stream ended). Then
  // inflow_added() for the input it passes on.
  bool wait_inflow_room(std::chrono::milliseconds timeout) {
    std::unique_lock lock(mutex_);
    return room_.wait_for(lock, timeout, [&] { return finished_ || inflow_ < kInflowLimit; });
  }
  void inflow_added() {
    std::lock_guard lock(mutex_);
    ++inflow_;
  }
  // Engine: `count` inputs taken (started, answered, refused or dropped).
  void inflow_taken(int32_t count = 1) {
    {
      std::lock_guard lock(mutex_);
      inflow_ -= count;
    }
    room_.notify_all();
  }
  int32_t inflow() const {
    std::lock_guard lock(mutex_);
    return inflow_;
  }

 private:
  mutable std::mutex mutex_;
  std::condition_variable ready_;
  std::condition_variable room_;  // inflow below its limit
  int32_t inflow_ = 0;
  std::deque<Event> events_;
  bool finished_ = false;
  absl::Status status_;
  std::atomic<bool> cancelled_{false};
};

}  // namespace deft::engine
