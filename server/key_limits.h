// Per-API-key limits: how many streams a key holds open (Generate, RunTree, TreeSession), how
// many of its jobs wait (submitted, no answer yet), and how many tokens it generated in the
// last minute. A refusal is RESOURCE_EXHAUSTED naming the limit's option and value. A limit of 0
// is off. Thread-safe; every handler thread calls it.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <string>

#include "absl/status/status.h"

namespace deft::server {

struct KeyLimitOptions {
  int32_t max_concurrent = 0;         // max_concurrent_per_key
  int32_t max_queued_jobs = 0;        // max_queued_jobs_per_key
  int64_t max_tokens_per_minute = 0;  // max_tokens_per_minute_per_key
};

class KeyLimits {
 public:
  explicit KeyLimits(KeyLimitOptions options) : options_(options) {}

  // One unit of a key's usage (an open stream, a waiting job), given back on destruction or
  // release(). Movable; an empty Hold gives back nothing.
  class Hold {
   public:
    Hold() = default;
    Hold(Hold&& other) noexcept { *this = std::move(other); }
    Hold& operator=(Hold&& other) noexcept;
    ~Hold() { release(); }
    void release();

   private:
    friend class KeyLimits;
    KeyLimits* limits_ = nullptr;
    std::string key_id_;
    bool queued_job_ = false;  // a waiting-job place, else a stream
  };

  // Takes one of the key's concurrent streams; RESOURCE_EXHAUSTED when max_concurrent are held.
  absl::Status open_stream(const std::string& key_id, Hold* hold);
  // Takes one of the key's waiting-job places; RESOURCE_EXHAUSTED when max_queued_jobs wait.
  absl::Status queue_job(const std::string& key_id, Hold* hold);
  // RESOURCE_EXHAUSTED while the key generated max_tokens_per_minute tokens in the last 60 s.
  absl::Status check_tokens(const std::string& key_id);
  // Counts `tokens` generated for the key now.
  void add_tokens(const std::string& key_id, int64_t tokens);

 private:
  struct Usage {
    int32_t streams = 0;
    int32_t queued_jobs = 0;
    // Tokens per second of the last minute: (second since start, tokens), oldest first.
    std::deque<std::pair<int64_t, int64_t>> tokens_by_second;
    int64_t tokens_last_minute = 0;
  };
  absl::Status take(const std::string& key_id, bool queued_job, Hold* hold);
  void give_back(const std::string& key_id, bool queued_job);
  // Drops token counts older than a minute (mutex_ held).
  void expire_tokens(Usage& usage, int64_t now_second);
  int64_t now_second() const;

  const KeyLimitOptions options_;
  const std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  std::mutex mutex_;
  std::map<std::string, Usage> usage_;
};

}  // namespace deft::server
