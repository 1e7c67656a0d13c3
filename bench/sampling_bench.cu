// The GPU sampler (kernels/sampling.h) over a step's fp32 logits rows at Llama-3's vocabulary,
// by its default row split and in batch-invariant mode (--deterministic), in the same run: what
// deterministic mode's fixed split of 8 blocks a row costs where the default split would shrink
// (beyond about 33 rows on an H200, where 8 blocks a row no longer fit in one wave).
// Floor = the logits' bytes read once / 3.0 TB/s. Time = CUDA events around replays of a CUDA
// graph of 20 launches, the logits rotated over at least two copies and over 200 MB (> 4x the
// L2), median after warm-up. Before a row is written, both methods' tokens must be equal and
// their log-probabilities within 1e-5 (they differ in the normaliser's summation order only).
//
//   sampling_bench [--out DIR] [--reps N]
// Writes <out>/sampling-<gpu>-<date>.json (../shared/BENCH_RESULTS.md).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "bench/bench_result.h"
#include "bench/device_read_bandwidth.h"
#include "bench/graph_timing.h"
#include "kernels/cuda_check.h"
#include "kernels/device_buffer.h"
#include "kernels/sampling.h"

namespace deft::bench {
namespace {

using kernels::DeviceBuffer;
using kernels::RowSamplingParams;
using kernels::SampledRow;
using kernels::SampledTop;

constexpr int32_t kVocab = 128256;
constexpr size_t kRotateBytes = size_t{200} << 20;
constexpr int kLaunchesPerGraph = 20;

struct Config {
  const char* name;
  RowSamplingParams params;
};
const Config kConfigs[] = {
    {"greedy", {.temperature = 0.0f}},
    {"top_p", {.temperature = 0.8f, .top_p = 0.95f}},
    {"top_k_logprobs", {.temperature = 1.0f, .top_k = 40, .top_logprobs = 5}},
};

struct Launch {
  std::vector<SampledRow> rows;
  std::vector<double> samples_us;
};

}  // namespace
}  // namespace deft::bench

int main(int argc, char** argv) {
  using namespace deft;
  using namespace deft::bench;
  std::string out_dir;
  int reps = 30;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--out") out_dir = argv[i + 1];
    if (flag == "--reps") reps = std::atoi(argv[i + 1]);
  }
  cudaDeviceProp prop;
  DEFT_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const std::string gpu = prop.name;
  const std::string tag = BenchResult::gpu_tag(gpu);
  BenchResult result("sampling", gpu, tag, argc, argv);
  const double measured_bw = measure_and_print_device_read_bandwidth();
  cudaStream_t stream;
  DEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  // Logits like a model's: normal with a spread of 3, so top-p keeps a few hundred tokens.
  constexpr int32_t kMaxRows = 256;
  std::vector<float> host(static_cast<size_t>(kMaxRows) * kVocab);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (float& v : host) v = normal(rng);

  std::printf("%-15s %4s %-16s %9s %9s %6s\n", "config", "rows", "method", "median_us", "floor_us",
              "ratio");
  for (int32_t rows : {1, 8, 20, 33, 34, 64, 128, 256}) {
    const size_t bytes = sizeof(float) * static_cast<size_t>(rows) * kVocab;
    const int copies = static_cast<int>(std::max<size_t>(2, (kRotateBytes + bytes - 1) / bytes));
    std::vector<DeviceBuffer> logits;
    for (int c = 0; c < copies; ++c) {
      logits.emplace_back(bytes);
      DEFT_CUDA_CHECK(cudaMemcpy(logits.back().data(), host.data(), bytes, cudaMemcpyHostToDevice));
    }
    DeviceBuffer workspace(kernels::sampling_workspace_bytes(rows, kVocab));
    DeviceBuffer out(sizeof(SampledRow) * rows);
    DeviceBuffer top(sizeof(SampledTop) * rows * kernels::kSamplingMaxTopLogprobs);
    const double floor_us = BenchResult::floor_us(static_cast<double>(bytes), 0);
    for (const Config& config : kConfigs) {
      std::vector<RowSamplingParams> params(rows, config.params);
      for (int32_t r = 0; r < rows; ++r) params[r].seed = 1000 + r;
      DeviceBuffer d_params(sizeof(RowSamplingParams) * rows);
      DEFT_CUDA_CHECK(
          cudaMemcpy(d_params.data(), params.data(), d_params.bytes(), cudaMemcpyHostToDevice));
      const auto run = [&](bool batch_invariant) {
        const auto launch = [&](int i) {
          kernels::launch_sample_rows(
              {.num_rows = rows, .vocab_size = kVocab, .row_stride = kVocab},
              logits[i % copies].as<float>(), d_params.as<RowSamplingParams>(),
              workspace.as<float>(), out.as<SampledRow>(), top.as<SampledTop>(), stream,
              /*drop_logits=*/false, batch_invariant);
        };
        Launch l;
        l.samples_us = time_graph_replays(stream, kLaunchesPerGraph, /*warmup=*/3, reps, launch);
        l.rows.resize(rows);
        DEFT_CUDA_CHECK(cudaMemcpy(l.rows.data(), out.data(), out.bytes(), cudaMemcpyDeviceToHost));
        return l;
      };
      const Launch plain = run(false);
      const Launch invariant = run(true);
      bool agree = true;
      for (int32_t r = 0; r < rows; ++r) {
        const SampledRow &a = plain.rows[r], &b = invariant.rows[r];
        agree = agree && a.status == kernels::kSampledOk && b.status == kernels::kSampledOk &&
                a.token == b.token && std::abs(a.logprob - b.logprob) <= 1e-5f;
      }
      if (!agree) {
        std::fprintf(stderr, "%s, %d rows: the two methods' rows differ; not written\n",
                     config.name, rows);
        continue;
      }
      const Samples base = summarize(plain.samples_us);
      for (const auto& [method, launch] : {std::pair<const char*, const Launch*>{"default", &plain},
                                           {"batch_invariant", &invariant}}) {
        ResultRow row;
        row.case_name = std::string(config.name) + "_rows" + std::to_string(rows);
        row.method = method;
        row.set_times(summarize(launch->samples_us));
        row.repetitions = reps;
        row.floor_us = floor_us;
        row.extra = {
            {"rows", rows},
            {"vocab", kVocab},
            {"logits_bytes", bytes},
            {"ratio_to_default", row.median_us / base.median},
            {"ratio_to_measured_floor",
             row.median_us / BenchResult::floor_us(static_cast<double>(bytes), 0, measured_bw)},
            {"measured_read_bytes_per_s", measured_bw}};
        std::printf("%-15s %4d %-16s %9.1f %9.1f %6.2f\n", config.name, rows, method, row.median_us,
                    floor_us, row.median_us / floor_us);
        result.add(std::move(row));
      }
    }
  }
  std::printf("wrote %s\n", result.write(out_dir).c_str());
  return 0;
}
