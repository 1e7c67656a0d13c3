#include "server/stream_watchdog.h"

#include <algorithm>

#include "spdlog/spdlog.h"

namespace deft::server {

StreamWatchdog::StreamWatchdog(std::chrono::milliseconds stall) : stall_(stall) {
  if (stall_.count() > 0) thread_ = std::thread([this] { run(); });
}

StreamWatchdog::~StreamWatchdog() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  stop_.notify_all();
  if (thread_.joinable()) thread_.join();
}

StreamWatchdog::Write::Write(StreamWatchdog& watchdog, grpc::ServerContext* context,
                             const char* rpc)
    : watchdog_(watchdog) {
  std::lock_guard lock(watchdog_.mutex_);
  entry_ = watchdog_.writes_.insert(
      watchdog_.writes_.end(),
      Entry{.context = context, .rpc = rpc, .since = std::chrono::steady_clock::now()});
}

StreamWatchdog::Write::~Write() {
  std::lock_guard lock(watchdog_.mutex_);
  watchdog_.writes_.erase(entry_);
}

bool StreamWatchdog::Write::cut() const {
  std::lock_guard lock(watchdog_.mutex_);
  return entry_->cut;
}

void StreamWatchdog::run() {
  // Checked a few times per stall period: a call is cut between `stall` and 1.25 x `stall`.
  const auto period = std::clamp<std::chrono::milliseconds>(
      stall_ / 4, std::chrono::milliseconds(10), std::chrono::milliseconds(1000));
  std::unique_lock lock(mutex_);
  while (!stop_.wait_for(lock, period, [&] { return stopping_; })) {
    const auto now = std::chrono::steady_clock::now();
    for (Entry& entry : writes_) {
      if (entry.cut || now - entry.since < stall_) continue;
      // The guard's owner is inside Write until it takes mutex_ to erase the entry, so the
      // context is alive here.
      entry.cut = true;
      cuts_.fetch_add(1);
      spdlog::warn(
          "{}: cut a stream from {}: its client read no response for {:.0f} s "
          "(stream_stall_seconds); its work is cancelled and its KV freed",
          entry.rpc, entry.context->peer(), stall_.count() / 1000.0);
      entry.context->TryCancel();
    }
  }
}

}  // namespace deft::server
