// A one-way event stream from the engine thread to one client handler (DESIGN.md §2): the
// engine pushes events and finally a status; the handler takes them in order and may ask the
// engine to cancel. Thread-safe; no gRPC here.
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
  }
  bool finished() const {
    std::lock_guard lock(mutex_);
    return finished_;
  }

 private:
  mutable std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<Event> events_;
  bool finished_ = false;
  absl::Status status_;
  std::atomic<bool> cancelled_{false};
};

}  // namespace deft::engine
