// Prometheus metrics of the server (prometheus-cpp), served on /metrics of metrics_listen.
// Rates (tokens/s, steps/s) are exported both as counters (use rate() in Prometheus) and as
// gauges over the last few seconds, for a quick look with curl.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <string>

namespace prometheus {
class Counter;
class Gauge;
class Histogram;
class Registry;
template <typename T>
class Family;
}  // namespace prometheus

namespace deft::server {

class MetricsHttpServer;

struct StepRecord {
  double step_seconds = 0;     // the whole step: planning, forward, sampling, streaming
  double plan_seconds = 0;     // attention planning (host)
  double forward_seconds = 0;  // ModelRunner::forward
  double attention_seconds = -1;  // of which attention, when the runner timed it
  int64_t prompt_tokens = 0;      // fed this step of tokens clients sent (StepStats::prompt_rows)
  int64_t generated_tokens = 0;
  int64_t kv_tokens_read = 0;  // the plan's KV IO (per layer and KV head)
  int64_t rows = 0;            // query rows (prefill and decode)
  int64_t logit_rows = 0;      // rows whose logits or token were computed
  // Speculative decoding: the draft model's passes, and per verified tree the entries accepted.
  double draft_seconds = 0;
  int64_t draft_rows = 0;
  int64_t drafted_tokens = 0;
  std::span<const int32_t> accepted_lengths;
};

class ServerMetrics {
 public:
  ServerMetrics();
  ~ServerMetrics();

  // Serves /metrics on `address` (host:port; port 0 picks one). Returns the bound port, or -1
  // with `error` set.
  int listen(const std::string& address, std::string* error);

  void record_step(const StepRecord& step);
  // kv_pages_used: pages referenced by live requests and sessions; kv_pages_free: pages on the
  // free list (used + free + cached = the pool).
  void set_engine_state(int32_t queued_jobs, int32_t live_jobs, int32_t kv_pages_used,
                        int32_t kv_pages_free);
  // The prefix cache (engine/prefix_cache.h): its pages now, and its counters' totals so far.
  void set_prefix_cache(int64_t cached_pages, int64_t hit_tokens_total,
                        int64_t evicted_pages_total);
  // Works preempted to free KV so far (engine/scheduler.h); they recompute later.
  void set_preemptions(int64_t preemptions_total);
  // Refreshes the windowed rate gauges (call now and then, also while idle).
  void refresh_rates();
  // One finished RPC; `code` is the gRPC status code's name ("OK", "INVALID_ARGUMENT", ...);
  // `key_id` the caller's API key id ("" without keys or when the call had no valid key).
  void record_request(const std::string& rpc, const std::string& code, const std::string& key_id);
  // Tokens streamed to a caller with an API key (deft_key_generated_tokens_total{key}).
  void record_key_tokens(const std::string& key_id, int64_t tokens);

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<MetricsHttpServer> http_;
  prometheus::Family<prometheus::Counter>* requests_ = nullptr;
  prometheus::Family<prometheus::Counter>* key_tokens_ = nullptr;
  prometheus::Counter* steps_ = nullptr;
  prometheus::Counter* generated_tokens_ = nullptr;
  prometheus::Counter* prompt_tokens_ = nullptr;
  prometheus::Counter* step_rows_ = nullptr;
  prometheus::Counter* step_logit_rows_ = nullptr;
  prometheus::Counter* plan_seconds_ = nullptr;
  prometheus::Counter* forward_seconds_ = nullptr;
  prometheus::Counter* step_seconds_ = nullptr;
  prometheus::Counter* kv_tokens_read_ = nullptr;
  prometheus::Gauge* tokens_per_second_ = nullptr;
  prometheus::Gauge* steps_per_second_ = nullptr;
  prometheus::Gauge* queue_depth_ = nullptr;
  prometheus::Gauge* live_jobs_ = nullptr;
  prometheus::Gauge* kv_pages_used_ = nullptr;
  prometheus::Gauge* kv_pages_free_ = nullptr;
  prometheus::Gauge* kv_pages_cached_ = nullptr;
  prometheus::Counter* prefix_hit_tokens_ = nullptr;
  prometheus::Counter* prefix_evicted_pages_ = nullptr;
  int64_t prefix_hit_tokens_total_ = 0;  // what the counters were last advanced to
  int64_t prefix_evicted_pages_total_ = 0;
  prometheus::Counter* preemptions_ = nullptr;
  prometheus::Counter* draft_seconds_ = nullptr;
  prometheus::Counter* draft_rows_ = nullptr;
  prometheus::Counter* drafted_tokens_ = nullptr;
  prometheus::Counter* accepted_tokens_ = nullptr;
  prometheus::Histogram* accept_length_ = nullptr;
  int64_t preemptions_total_ = 0;
  prometheus::Gauge* forward_share_ = nullptr;
  prometheus::Gauge* attention_share_ = nullptr;
  prometheus::Gauge* plan_share_ = nullptr;
  prometheus::Histogram* step_latency_ = nullptr;

  // Steps of the last few seconds, for the rate gauges.
  struct Sample {
    std::chrono::steady_clock::time_point at;
    int64_t tokens;
  };
  std::mutex window_mutex_;
  std::deque<Sample> window_;
};

}  // namespace deft::server
