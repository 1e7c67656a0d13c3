// The decode-step GEMMs of a Llama-3-8B-shaped model (bf16, fp32 accumulation) with cuBLAS's
// default algorithm (cublasGemmEx, CUBLAS_GEMM_DEFAULT) against the cuBLASLt algorithm
// models/gemm_tuner.h picks by measurement ("tuned": the heuristic's candidates, the runner's
// search; "tuned_wide": also every other algorithm id, GemmTuner::set_wide_search), same
// shapes, same run, each with the runner's
// output: QKV and gate/up write bf16, O and down accumulate into an fp32 residual (beta = 1),
// the LM head writes fp32. Rows: M = 1, 20, 64, 128 and the graph buckets 32 and 256 (a
// 20-row decode step runs its GEMMs at 32 rows inside a CUDA graph). Floor = max(weight bytes /
// 3.0 TB/s, 2 M N K / 7e14 FLOP/s) (BenchResult::floor_us: the FLOPs decide at 256 rows, the
// bytes below). Time = CUDA events around replays of a CUDA graph of 20 launches, weights rotated
// over at least two copies and over 200 MB (> 4x the L2), median after warm-up (the tuner's own
// timings, eager passes of launches, are kept in the rows too). The tuned output is checked
// against the default's (norm-relative difference < 1e-4 fp32, < 4e-3 bf16) before a row is
// written.
//
//   gemm_tune_bench [--out DIR] [--reps N]
// Writes <out>/gemm_tune-<gpu>-<date>.json (../shared/BENCH_RESULTS.md).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "bench/bench_result.h"
#include "bench/graph_timing.h"
#include "bench/relative_error.h"
#include "kernels/cuda_check.h"
#include "kernels/device_buffer.h"
#include "kernels/llama_ops.h"
#include "models/gemm_tuner.h"

namespace deft::bench {
namespace {

using kernels::DeviceBuffer;

struct Shape {
  const char* name;
  int32_t out, in;
  bool y_fp32, accumulate;
};
constexpr Shape kShapes[] = {{"qkv", 6144, 4096, false, false},
                             {"o", 4096, 4096, true, true},
                             {"gate_up", 28672, 4096, false, false},
                             {"down", 4096, 14336, true, true},
                             {"lm_head", 128256, 4096, true, false}};
constexpr int32_t kRows[] = {1, 20, 32, 64, 128, 256};
constexpr size_t kRotateBytes = 200u << 20;  // > 4x the H100's 50 MB L2
constexpr int kLaunchesPerGraph = 20;
constexpr size_t kWorkspaceBytes = size_t{32} << 20;  // the runner's
// Tuned vs default output: fp32 summation order (K up to 14336), or bf16 rounding.
constexpr double kFp32Tolerance = 1e-4;
constexpr double kBf16Tolerance = 4e-3;

std::vector<double> time_graph(cudaStream_t stream, int reps,
                               const std::function<void(int)>& launch) {
  return time_graph_replays(stream, kLaunchesPerGraph, /*warmup=*/3, reps, launch);
}

// y as floats (bf16 or fp32 on the device).
std::vector<float> download(const DeviceBuffer& y, size_t count, bool fp32) {
  std::vector<float> out(count);
  if (fp32) {
    DEFT_CUDA_CHECK(cudaMemcpy(out.data(), y.data(), count * 4, cudaMemcpyDeviceToHost));
    return out;
  }
  std::vector<uint16_t> bits(count);
  DEFT_CUDA_CHECK(cudaMemcpy(bits.data(), y.data(), count * 2, cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < count; ++i) {
    const uint32_t word = uint32_t{bits[i]} << 16;
    std::memcpy(&out[i], &word, 4);
  }
  return out;
}

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
  BenchResult result("gemm_tune", gpu, tag, argc, argv);
  cudaStream_t stream;
  DEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  DeviceBuffer workspace(kWorkspaceBytes);
  models::GemmTuner tuner(stream, workspace.data(), workspace.bytes());
  std::mt19937 rng(1234);
  const kernels::DType dtype = kernels::DType::kBf16;
  std::printf("%-8s %4s %-10s %8s %8s %6s %6s %7s %7s %5s  %s\n", "shape", "m", "method", "us",
              "floor_us", "ratio", "TB/s", "speedup", "tune_ms", "cands", "chosen");
  // At 32 rows: 32 layers + the LM head.
  double step_default_us = 0, step_tuned_us = 0, step_wide_us = 0;
  for (const Shape& shape : kShapes) {
    const size_t w_bytes = size_t{2} * shape.out * shape.in;
    // Two copies at least: a launch must not find the end of the previous launch's weights in L2.
    const int copies =
        static_cast<int>(std::max<size_t>(2, (kRotateBytes + w_bytes - 1) / w_bytes));
    std::vector<DeviceBuffer> weights;
    std::vector<const void*> weight_ptrs;
    for (int c = 0; c < copies; ++c) {
      weights.emplace_back(w_bytes);
      kernels::launch_random_uniform(int64_t{shape.out} * shape.in, rng(),
                                     std::sqrt(3.0f / shape.in), 0.0f, dtype, weights.back().data(),
                                     stream);
      weight_ptrs.push_back(weights.back().data());
    }
    for (const int32_t rows : kRows) {
      const double floor_us = BenchResult::floor_us(w_bytes, 2.0 * rows * shape.in * shape.out);
      const models::GemmShape gemm_shape{.rows = rows,
                                         .in = shape.in,
                                         .out = shape.out,
                                         .dtype = dtype,
                                         .y_fp32 = shape.y_fp32,
                                         .accumulate = shape.accumulate};
      DeviceBuffer x(size_t{2} * rows * shape.in);
      kernels::launch_random_uniform(int64_t{rows} * shape.in, rng(), std::sqrt(3.0f), 0.0f, dtype,
                                     x.data(), stream);
      const size_t y_count = static_cast<size_t>(rows) * shape.out;
      DeviceBuffer y(y_count * (shape.y_fp32 ? 4 : 2));
      // Outputs of one launch each from y = 0 (accumulating adds to zeros).
      const auto one_output = [&](bool tuned_on) {
        tuner.set_enabled(tuned_on);
        DEFT_CUDA_CHECK(cudaMemsetAsync(y.data(), 0, y.bytes(), stream));
        tuner.gemm(gemm_shape, x.data(), weight_ptrs[0], y.data());
        DEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
        tuner.set_enabled(true);
        return download(y, y_count, shape.y_fp32);
      };
      const auto timed = [&](bool tuned_on) {
        tuner.set_enabled(tuned_on);
        const Samples stats = summarize(time_graph(stream, reps, [&](int i) {
          tuner.gemm(gemm_shape, x.data(), weight_ptrs[i % copies], y.data());
        }));
        tuner.set_enabled(true);
        return stats;
      };
      const std::vector<float> ref = one_output(false);
      const Samples default_stats = timed(false);
      struct Tuned {
        std::string method;
        models::GemmTuneResult result;
        Samples stats;
        double difference = 0;
      };
      std::vector<Tuned> tuned_runs;
      for (const bool wide : {false, true}) {
        tuner.set_wide_search(wide);
        Tuned run;
        run.method = wide ? "tuned_wide" : "tuned";
        run.result = tuner.tune(gemm_shape, weight_ptrs, x.data(), y.data());
        run.difference = relative_l2_error(one_output(true), ref);
        run.stats = timed(true);
        tuned_runs.push_back(std::move(run));
      }
      tuner.set_wide_search(false);
      if (rows == 32) {
        const double per_step = std::string(shape.name) == "lm_head" ? 1.0 : 32.0;
        step_default_us += per_step * default_stats.median;
        step_tuned_us += per_step * tuned_runs[0].stats.median;
        step_wide_us += per_step * tuned_runs[1].stats.median;
      }
      ResultRow base;
      base.case_name = std::string(shape.name) + "_m" + std::to_string(rows);
      base.repetitions = reps;
      base.floor_us = floor_us;
      base.extra = {{"rows", rows},
                    {"in", shape.in},
                    {"out", shape.out},
                    {"y", shape.y_fp32 ? (shape.accumulate ? "fp32 +=" : "fp32") : "bf16"},
                    {"weight_bytes", w_bytes}};
      const auto add_row = [&](ResultRow row, const std::string& method, const Samples& stats) {
        row.method = method;
        row.set_times(stats);
        row.extra["achieved_tb_per_s"] = w_bytes / stats.median / 1e6;
        row.extra["speedup_vs_default"] = default_stats.median / stats.median;
        result.add(row);
      };
      add_row(base, "cublas_default", default_stats);
      std::printf("%-8s %4d %-10s %8.1f %8.1f %6.2f %6.2f\n", shape.name, rows, "default",
                  default_stats.median, floor_us, default_stats.median / floor_us,
                  w_bytes / default_stats.median / 1e6);
      for (const Tuned& run : tuned_runs) {
        const bool correct = run.difference < (shape.y_fp32 ? kFp32Tolerance : kBf16Tolerance);
        const models::GemmTuneResult& r = run.result;
        std::printf("%-8s %4d %-10s %8.1f %8.1f %6.2f %6.2f %7.3f %7.0f %5zu  %s [%s]%s\n",
                    shape.name, rows, run.method.c_str(), run.stats.median, floor_us,
                    run.stats.median / floor_us, w_bytes / run.stats.median / 1e6,
                    default_stats.median / run.stats.median, r.tuning_ms, r.candidates.size(),
                    r.chosen_algo().c_str(),
                    r.chosen >= 0 ? r.candidates[r.chosen].source.c_str() : "default",
                    correct ? "" : " FAILED CHECK (row not written)");
        if (!correct) {
          std::printf("  difference %.3e\n", run.difference);
          continue;
        }
        nlohmann::json candidates = nlohmann::json::array();
        for (const auto& candidate : r.candidates) {
          candidates.push_back({{"algo", candidate.algo},
                                {"source", candidate.source},
                                {"tuner_median_us", candidate.median_us}});
        }
        ResultRow row = base;
        row.extra["algo"] = r.chosen_algo();
        row.extra["rel_diff_vs_default"] = run.difference;
        row.extra["tuning_ms"] = r.tuning_ms;
        row.extra["tuner_default_us"] = r.default_us;
        row.extra["tuner_chosen_us"] = r.chosen_us();
        row.extra["candidates"] = candidates;
        add_row(row, run.method, run.stats);
      }
    }
  }
  std::printf(
      "decode step at 32 rows (32 layers x QKV/O/gate-up/down + LM head): default %.0f "
      "us, tuned %.0f us, tuned_wide %.0f us\n",
      step_default_us, step_tuned_us, step_wide_us);
  std::printf("wrote %s\n", result.write(out_dir).c_str());
  return 0;
}
