#include "server/key_limits.h"

#include "absl/strings/str_cat.h"

namespace deft::server {

KeyLimits::Hold& KeyLimits::Hold::operator=(Hold&& other) noexcept {
  if (this != &other) {
    release();
    limits_ = std::exchange(other.limits_, nullptr);
    key_id_ = std::move(other.key_id_);
    queued_job_ = other.queued_job_;
  }
  return *this;
}

void KeyLimits::Hold::release() {
  if (limits_ != nullptr) std::exchange(limits_, nullptr)->give_back(key_id_, queued_job_);
}

absl::Status KeyLimits::take(const std::string& key_id, bool queued_job, Hold* hold) {
  const int32_t limit = queued_job ? options_.max_queued_jobs : options_.max_concurrent;
  if (limit <= 0) return absl::OkStatus();
  {
    std::lock_guard lock(mutex_);
    Usage& usage = usage_[key_id];
    int32_t& count = queued_job ? usage.queued_jobs : usage.streams;
    if (count >= limit) {
      return absl::ResourceExhaustedError(
          queued_job
              ? absl::StrCat("API key '", key_id, "' has ", count,
                             " jobs waiting to start; the limit is ", limit,
                             " (max_queued_jobs_per_key)")
              : absl::StrCat("API key '", key_id, "' has ", count,
                             " Generate, RunTree and TreeSession streams open; the limit is ",
                             limit, " (max_concurrent_per_key)"));
    }
    ++count;
  }
  hold->release();
  hold->limits_ = this;
  hold->key_id_ = key_id;
  hold->queued_job_ = queued_job;
  return absl::OkStatus();
}

void KeyLimits::give_back(const std::string& key_id, bool queued_job) {
  std::lock_guard lock(mutex_);
  auto it = usage_.find(key_id);
  if (it == usage_.end()) return;
  Usage& usage = it->second;
  --(queued_job ? usage.queued_jobs : usage.streams);
  if (usage.streams == 0 && usage.queued_jobs == 0 && usage.tokens_by_second.empty()) {
    usage_.erase(it);
  }
}

absl::Status KeyLimits::open_stream(const std::string& key_id, Hold* hold) {
  return take(key_id, /*queued_job=*/false, hold);
}

absl::Status KeyLimits::queue_job(const std::string& key_id, Hold* hold) {
  return take(key_id, /*queued_job=*/true, hold);
}

int64_t KeyLimits::now_second() const {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::steady_clock::now() - start_)
      .count();
}

void KeyLimits::expire_tokens(Usage& usage, int64_t now) {
  while (!usage.tokens_by_second.empty() && usage.tokens_by_second.front().first <= now - 60) {
    usage.tokens_last_minute -= usage.tokens_by_second.front().second;
    usage.tokens_by_second.pop_front();
  }
}

absl::Status KeyLimits::check_tokens(const std::string& key_id) {
  if (options_.max_tokens_per_minute <= 0) return absl::OkStatus();
  std::lock_guard lock(mutex_);
  auto it = usage_.find(key_id);
  if (it == usage_.end()) return absl::OkStatus();
  expire_tokens(it->second, now_second());
  if (it->second.tokens_last_minute >= options_.max_tokens_per_minute) {
    return absl::ResourceExhaustedError(
        absl::StrCat("API key '", key_id, "' generated ", it->second.tokens_last_minute,
                     " tokens in the last minute; the limit is ", options_.max_tokens_per_minute,
                     " (max_tokens_per_minute_per_key)"));
  }
  return absl::OkStatus();
}

void KeyLimits::add_tokens(const std::string& key_id, int64_t tokens) {
  if (options_.max_tokens_per_minute <= 0 || tokens <= 0) return;
  const int64_t now = now_second();
  std::lock_guard lock(mutex_);
  Usage& usage = usage_[key_id];
  expire_tokens(usage, now);
  if (usage.tokens_by_second.empty() || usage.tokens_by_second.back().first != now) {
    usage.tokens_by_second.emplace_back(now, 0);
  }
  usage.tokens_by_second.back().second += tokens;
  usage.tokens_last_minute += tokens;
}

}  // namespace deft::server
