#include "server/metrics.h"

#include <exception>

#include "absl/strings/str_cat.h"
#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"
#include "server/metrics_http_server.h"

namespace deft::server {
namespace {

// Window of the rate gauges.
constexpr std::chrono::seconds kRateWindow{5};

prometheus::Counter& counter(prometheus::Registry& registry, const std::string& name,
                             const std::string& help) {
  return prometheus::BuildCounter().Name(name).Help(help).Register(registry).Add({});
}

prometheus::Gauge& gauge(prometheus::Registry& registry, const std::string& name,
                         const std::string& help) {
  return prometheus::BuildGauge().Name(name).Help(help).Register(registry).Add({});
}

}  // namespace

ServerMetrics::ServerMetrics() : registry_(std::make_shared<prometheus::Registry>()) {
  prometheus::Registry& r = *registry_;
  requests_ = &prometheus::BuildCounter()
                   .Name("deft_requests_total")
                   .Help("Finished RPCs by method, status code and API key id")
                   .Register(r);
  key_tokens_ = &prometheus::BuildCounter()
                     .Name("deft_key_generated_tokens_total")
                     .Help("Generated tokens streamed to callers, by API key id")
                     .Register(r);
  steps_ = &counter(r, "deft_engine_steps_total", "Engine steps (forward passes)");
  generated_tokens_ = &counter(r, "deft_generated_tokens_total", "Tokens sampled");
  prompt_tokens_ = &counter(r, "deft_prompt_tokens_total",
                            "Tokens clients sent that the model was fed (prompts, extensions, "
                            "scored continuations, Verify trees; cached prefixes not counted)");
  step_rows_ = &counter(r, "deft_step_rows_total",
                        "Query rows of all steps (mean rows per step: / deft_engine_steps_total)");
  step_logit_rows_ = &counter(r, "deft_step_logit_rows_total",
                              "Query rows whose next-token logits or token were computed");
  plan_seconds_ = &counter(r, "deft_step_plan_seconds_total", "Host time planning attention");
  forward_seconds_ = &counter(r, "deft_step_forward_seconds_total",
                              "Time in the model's forward pass (sampling on the device included)");
  step_seconds_ = &counter(r, "deft_step_seconds_total",
                           "Time in engine steps: planning, forward, sampling, streaming");
  kv_tokens_read_ = &counter(r, "deft_attention_kv_tokens_read_total",
                             "KV tokens read by attention plans (per layer and KV head)");
  tokens_per_second_ = &gauge(r, "deft_tokens_per_second", "Tokens sampled per second (last 5 s)");
  steps_per_second_ = &gauge(r, "deft_steps_per_second", "Engine steps per second (last 5 s)");
  queue_depth_ = &gauge(r, "deft_queue_depth", "Jobs waiting for admission");
  live_jobs_ = &gauge(r, "deft_live_jobs", "Jobs being decoded");
  kv_pages_used_ = &gauge(r, "deft_kv_pages_used",
                          "KV cache pages in use by live requests and sessions (cached prefixes "
                          "aside: deft_kv_pages_cached)");
  kv_pages_free_ = &gauge(r, "deft_kv_pages_free", "KV cache pages free");
  kv_pages_cached_ = &gauge(r, "deft_kv_pages_cached",
                            "KV cache pages of finished requests kept as a prefix cache "
                            "(evicted when pages are needed)");
  prefix_hit_tokens_ = &counter(r, "deft_prefix_cache_hit_tokens_total",
                                "Prompt tokens whose KV was found in the prefix cache");
  prefix_evicted_pages_ = &counter(r, "deft_prefix_cache_evicted_pages_total",
                                   "KV pages evicted from the prefix cache");
  preemptions_ = &counter(r, "deft_preemptions_total",
                          "Requests preempted when a step ran short of KV (their KV is "
                          "recomputed when they are admitted again)");
  draft_seconds_ = &counter(r, "deft_draft_seconds_total",
                            "Time in the speculative draft model's passes (part of the steps)");
  draft_rows_ = &counter(r, "deft_draft_rows_total", "Query rows run by the draft model");
  drafted_tokens_ = &counter(r, "deft_speculative_drafted_tokens_total",
                             "Drafted tokens verified by the target model");
  accepted_tokens_ = &counter(r, "deft_speculative_accepted_tokens_total",
                              "Drafted tokens the target model accepted");
  accept_length_ =
      &prometheus::BuildHistogram()
           .Name("deft_speculative_accept_length")
           .Help("Drafted tokens accepted per verified tree (a branch's step commits one more)")
           .Register(r)
           .Add({}, prometheus::Histogram::BucketBoundaries{0, 1, 2, 3, 4, 5, 6, 8, 12, 16, 32});
  forward_share_ = &gauge(r, "deft_step_forward_share",
                          "Share of the last step spent in the model forward pass (attention "
                          "included)");
  attention_share_ = &gauge(r, "deft_step_attention_share",
                            "Share of a recent step spent in attention (sampled every 16 steps)");
  plan_share_ = &gauge(r, "deft_step_plan_share",
                       "Share of the last step spent planning attention (QKV preparation)");
  step_latency_ =
      &prometheus::BuildHistogram()
           .Name("deft_step_latency_seconds")
           .Help("Engine step latency")
           .Register(r)
           .Add({}, prometheus::Histogram::BucketBoundaries{0.0005, 0.001, 0.002, 0.005, 0.01, 0.02,
                                                            0.05, 0.1, 0.2, 0.5, 1, 2, 5});
}

ServerMetrics::~ServerMetrics() = default;

int ServerMetrics::listen(const std::string& address, std::string* error) {
  http_ = std::make_unique<MetricsHttpServer>(
      [registry = registry_] { return prometheus::TextSerializer().Serialize(registry->Collect()); });
  absl::StatusOr<int> port = http_->listen(address);
  if (!port.ok()) {
    *error = std::string(port.status().message());
    http_.reset();
    return -1;
  }
  return *port;
}

void ServerMetrics::record_step(const StepRecord& step) {
  steps_->Increment();
  generated_tokens_->Increment(static_cast<double>(step.generated_tokens));
  prompt_tokens_->Increment(static_cast<double>(step.prompt_tokens));
  step_rows_->Increment(static_cast<double>(step.rows));
  step_logit_rows_->Increment(static_cast<double>(step.logit_rows));
  plan_seconds_->Increment(step.plan_seconds);
  forward_seconds_->Increment(step.forward_seconds);
  step_seconds_->Increment(step.step_seconds);
  kv_tokens_read_->Increment(static_cast<double>(step.kv_tokens_read));
  step_latency_->Observe(step.step_seconds);
  draft_seconds_->Increment(step.draft_seconds);
  draft_rows_->Increment(static_cast<double>(step.draft_rows));
  drafted_tokens_->Increment(static_cast<double>(step.drafted_tokens));
  for (int32_t accepted : step.accepted_lengths) {
    accepted_tokens_->Increment(accepted);
    accept_length_->Observe(accepted);
  }
  if (step.step_seconds > 0) {
    forward_share_->Set(step.forward_seconds / step.step_seconds);
    plan_share_->Set(step.plan_seconds / step.step_seconds);
    if (step.attention_seconds >= 0) {
      attention_share_->Set(step.attention_seconds / step.step_seconds);
    }
  }
  {
    std::lock_guard lock(window_mutex_);
    window_.push_back({std::chrono::steady_clock::now(), step.generated_tokens});
  }
  refresh_rates();
}

void ServerMetrics::refresh_rates() {
  std::lock_guard lock(window_mutex_);
  const auto now = std::chrono::steady_clock::now();
  while (!window_.empty() && now - window_.front().at > kRateWindow) window_.pop_front();
  int64_t tokens = 0;
  for (const Sample& sample : window_) tokens += sample.tokens;
  const double seconds = std::chrono::duration<double>(kRateWindow).count();
  tokens_per_second_->Set(static_cast<double>(tokens) / seconds);
  steps_per_second_->Set(static_cast<double>(window_.size()) / seconds);
}

void ServerMetrics::set_engine_state(int32_t queued_jobs, int32_t live_jobs, int32_t kv_pages_used,
                                     int32_t kv_pages_free) {
  queue_depth_->Set(queued_jobs);
  live_jobs_->Set(live_jobs);
  kv_pages_used_->Set(kv_pages_used);
  kv_pages_free_->Set(kv_pages_free);
}

void ServerMetrics::set_prefix_cache(int64_t cached_pages, int64_t hit_tokens_total,
                                     int64_t evicted_pages_total) {
  kv_pages_cached_->Set(static_cast<double>(cached_pages));
  prefix_hit_tokens_->Increment(static_cast<double>(hit_tokens_total - prefix_hit_tokens_total_));
  prefix_evicted_pages_->Increment(
      static_cast<double>(evicted_pages_total - prefix_evicted_pages_total_));
  prefix_hit_tokens_total_ = hit_tokens_total;
  prefix_evicted_pages_total_ = evicted_pages_total;
}

void ServerMetrics::set_preemptions(int64_t preemptions_total) {
  preemptions_->Increment(static_cast<double>(preemptions_total - preemptions_total_));
  preemptions_total_ = preemptions_total;
}

void ServerMetrics::record_request(const std::string& rpc, const std::string& code,
                                   const std::string& key_id) {
  // Without keys the label is left out, so the series are those of a server without auth.
  if (key_id.empty()) {
    requests_->Add({{"rpc", rpc}, {"code", code}}).Increment();
  } else {
    requests_->Add({{"rpc", rpc}, {"code", code}, {"key", key_id}}).Increment();
  }
}

void ServerMetrics::record_key_tokens(const std::string& key_id, int64_t tokens) {
  key_tokens_->Add({{"key", key_id}}).Increment(static_cast<double>(tokens));
}

}  // namespace deft::server
