#include "bench/serve_bench/load_driver.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"

namespace deft::bench::serve {
namespace {

Clock::duration seconds(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

double since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// A client whose job failed waits this long before its next one, so that a server refusing
// work (RESOURCE_EXHAUSTED) is not hammered by a loop of instant failures.
constexpr std::chrono::milliseconds kFailureBackoff{100};

}  // namespace

std::string LoadLevel::name() const {
  return concurrency > 0 ? absl::StrCat("c", concurrency) : absl::StrCat("r", rate);
}

LoadDriver::LoadDriver(const std::string& address, const JobEnv& env, MetricsScraper* metrics,
                       int32_t channels)
    : env_(env), metrics_(metrics) {
  for (int32_t i = 0; i < channels; ++i) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // a connection of its own
    args.SetInt("deft.serve_bench.channel", i);          // (keeps channels distinct)
    args.SetMaxReceiveMessageSize(-1);                   // RunTree's whole-tree answer
    stubs_.push_back(v1::Deft::NewStub(
        grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args)));
  }
}

std::vector<JobRecord> LoadDriver::run_sequentially(JobKind kind, int32_t count,
                                                    uint64_t first_job_index) {
  std::vector<JobRecord> records;
  for (int32_t i = 0; i < count; ++i) {
    records.push_back(run_job(kind, stub(0), env_, first_job_index + i, Clock::now()));
  }
  return records;
}

LevelRun LoadDriver::run(const LoadLevel& level, const JobMix& mix, uint64_t first_job_index,
                         const std::string& label) {
  const ServeOptions& options = *env_.options;
  const bool timed = options.jobs == 0;
  LevelRun result;

  // Shared between the clients and this thread, under `mutex`.
  std::mutex mutex;
  std::condition_variable changed;  // a job ended, or no more jobs will start
  int64_t in_flight = 0;            // arrived (open loop: queued or running) and not ended
  bool sending_done = false;        // no job will arrive any more
  std::vector<std::thread> clients;

  const auto end_job = [&](JobRecord record) {
    std::lock_guard lock(mutex);
    result.jobs.push_back(std::move(record));
    --in_flight;
    changed.notify_all();
  };

  result.server_start = metrics_->scrape();
  metrics_->start_sampling(options.metrics_interval_s);
  const int64_t tokens_at_start = env_.received_tokens->load();
  result.window_start = Clock::now();
  const Clock::time_point deadline = result.window_start + seconds(options.duration_s);

  // Open loop: the dispatcher queues arrivals; clients (started as needed, up to
  // --max-inflight) take them in order.
  struct Arrival {
    uint64_t index;
    Clock::time_point at;
  };
  std::deque<Arrival> arrivals;
  std::condition_variable arrived;
  int32_t idle_clients = 0;
  std::thread dispatcher;

  const auto client_loop = [&](size_t client) {
    std::unique_lock lock(mutex);
    for (;;) {
      arrived.wait(lock, [&] { return !arrivals.empty() || sending_done; });
      if (arrivals.empty()) return;
      const Arrival arrival = arrivals.front();
      arrivals.pop_front();
      --idle_clients;
      result.max_start_delay_s = std::max(result.max_start_delay_s, since(arrival.at));
      lock.unlock();
      const uint64_t index = first_job_index + arrival.index;
      end_job(run_job(mix.pick(options.seed, index), stub(client), env_, index, arrival.at));
      lock.lock();
      ++idle_clients;
    }
  };

  // Closed loop: clients take job numbers from one counter until the level's end.
  std::atomic<uint64_t> next_job{0};
  int32_t clients_left = level.concurrency;  // under `mutex`
  if (level.concurrency > 0) {
    for (int32_t client = 0; client < level.concurrency; ++client) {
      clients.emplace_back([&, client] {
        for (;;) {
          const uint64_t i = next_job.fetch_add(1);
          const Clock::time_point now = Clock::now();
          if (timed ? now >= deadline : i >= static_cast<uint64_t>(options.jobs)) break;
          {
            std::lock_guard lock(mutex);
            ++in_flight;
          }
          const uint64_t index = first_job_index + i;
          JobRecord record = run_job(mix.pick(options.seed, index), stub(client), env_, index, now);
          const bool failed = !record.ok();
          end_job(std::move(record));
          if (failed) std::this_thread::sleep_for(kFailureBackoff);
        }
        std::lock_guard lock(mutex);
        if (--clients_left == 0) {
          sending_done = true;
          changed.notify_all();
        }
      });
    }
  } else {
    dispatcher = std::thread([&] {
      std::mt19937_64 rng(options.seed ^ first_job_index);
      std::exponential_distribution<double> gap_s(level.rate);
      Clock::time_point at = result.window_start;
      for (uint64_t i = 0;; ++i) {
        at += seconds(gap_s(rng));
        if (timed ? at >= deadline : i >= static_cast<uint64_t>(options.jobs)) break;
        std::this_thread::sleep_until(at);
        std::lock_guard lock(mutex);
        arrivals.push_back({i, at});
        ++in_flight;
        if (idle_clients == 0 && static_cast<int32_t>(clients.size()) < options.max_inflight) {
          ++idle_clients;
          clients.emplace_back(client_loop, clients.size());
        }
        arrived.notify_one();
      }
      std::lock_guard lock(mutex);
      sending_done = true;
      arrived.notify_all();
      changed.notify_all();
    });
  }

  // Progress lines until the window closes, then until the last job ends.
  const auto progress = [&](const char* phase) {
    int64_t failed = 0;
    for (const JobRecord& job : result.jobs) failed += job.ok() ? 0 : 1;
    const double elapsed_s = std::max(since(result.window_start), 1e-9);
    std::fprintf(stderr, "%s%s t=%.1f s: %zu jobs done (%lld failed), %lld in flight, %.0f tok/s\n",
                 label.c_str(), phase, elapsed_s, result.jobs.size(),
                 static_cast<long long>(failed), static_cast<long long>(in_flight),
                 static_cast<double>(env_.received_tokens->load() - tokens_at_start) / elapsed_s);
  };
  const auto all_ended = [&] { return sending_done && in_flight == 0; };
  {
    std::unique_lock lock(mutex);
    Clock::time_point next_progress = Clock::now() + seconds(options.progress_interval_s);
    while (!all_ended() && !(timed && Clock::now() >= deadline)) {
      changed.wait_until(lock, timed ? std::min(next_progress, deadline) : next_progress);
      if (Clock::now() >= next_progress) {
        progress("");
        next_progress += seconds(options.progress_interval_s);
      }
    }
    result.window_end = Clock::now();
    result.window_tokens = env_.received_tokens->load() - tokens_at_start;
  }
  result.server_end = metrics_->scrape();
  {
    std::unique_lock lock(mutex);
    Clock::time_point next_progress = Clock::now() + seconds(options.progress_interval_s);
    while (!all_ended()) {
      changed.wait_until(lock, next_progress);
      if (Clock::now() >= next_progress) {
        progress(" draining,");
        next_progress += seconds(options.progress_interval_s);
      }
    }
  }
  if (dispatcher.joinable()) dispatcher.join();
  for (std::thread& client : clients) client.join();
  result.server_max = metrics_->stop_sampling();
  result.drain_s = std::chrono::duration<double>(Clock::now() - result.window_end).count();
  return result;
}

}  // namespace deft::bench::serve
