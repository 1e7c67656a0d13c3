// The server's Prometheus endpoint as serve_bench reads it: counters read at the edges of a
// level's window (their differences give steps/s, rows per step, step time), and gauges sampled
// in the background through the level for their maxima (KV pages used, queue depth, live jobs).
#pragma once

#include <atomic>
#include <map>
#include <mutex>
#include <string>
#include <thread>

namespace deft::bench::serve {

// Unlabelled samples of one scrape, name -> value; histogram sums and counts are among them
// (deft_step_latency_seconds_sum / _count), buckets and labelled series are not.
using MetricValues = std::map<std::string, double>;

class MetricsScraper {
 public:
  // `address`: host:port of /metrics; empty: no endpoint (every scrape is empty).
  explicit MetricsScraper(std::string address) : address_(std::move(address)) {}
  ~MetricsScraper() { stop_sampling(); }

  bool enabled() const { return !address_.empty(); }
  // One GET /metrics; empty when the endpoint does not answer.
  MetricValues scrape() const;

  // Scrapes every `interval_s` on a thread of its own until stop_sampling(), which returns
  // each sample's maximum over the scrapes.
  void start_sampling(double interval_s);
  MetricValues stop_sampling();

 private:
  std::string address_;
  std::thread sampler_;
  std::atomic<bool> sampling_{false};
  std::mutex maxima_mutex_;
  MetricValues maxima_;
};

}  // namespace deft::bench::serve
