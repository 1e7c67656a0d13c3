// The decode-step GEMMs of a Llama-3-8B-shaped model (bf16, fp32 accumulation): the skinny GEMM
// (kernels/skinny_gemm.h) against cuBLAS (cublasGemmEx, the runner's call) on the same shapes in
// the same run, y = x · w^T with fp32 output (the runner's O / down calls accumulate into the fp32
// residual, QKV / gate-up write bf16; the weight stream is the same). Floor = max(weight bytes /
// 3.0 TB/s, 2 M N K / 7e14 FLOP/s) (BenchResult::floor_us; the bytes decide up to 128 rows).
// Time = CUDA events around replays of a CUDA graph of 20 launches, weights rotated over at
// least two copies and over 200 MB (> 4x the L2; --rotate-mb), median after warm-up (one copy of
// a shape over 200 MB, two copies or 8 GB measure the same). Each skinny row is checked against cuBLAS's output
// (relative error < 1e-4; 8e-3 with bf16 y) before it is written. The skinny GEMM is a programmatic
// dependent launch that reads its first weights while the launch before it runs: `skinny` rows
// replay it back to back (as in a decode step, where the kernel before it lets it start early),
// `skinny_isolated` rows with a 4-byte memset between launches, which keeps launches from
// overlapping. As in a decode step, `<method>_after_norm` rows run an RMSNorm that writes x
// (kernels/llama_ops.h, a programmatic dependent launch that lets the next kernel start early)
// before every GEMM; `norm` rows time the RMSNorm alone, so the GEMM's share is the difference.
// `read` rows: a plain kernel reading the same weights once with 16-byte loads (what this GPU
// streams; no output).
//
//   skinny_gemm_bench [--out DIR] [--reps N] [--sweep 1] [--shape NAME] [--rows M]
//                     [--rotate-mb MB] [--bf16-out 1]
//   (--sweep: also every forced split; --shape / --rows: only that shape / row count;
//   --rotate-mb: the weights' rotation, default 200 MB, at least two copies whatever it is;
//   --bf16-out: y in bf16, as the step's QKV and gate/up write it, for cuBLAS and the skinny GEMM)
// Writes <out>/skinny_gemm-<gpu>-<date>.json (../shared/BENCH_RESULTS.md).
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "bench/bench_result.h"
#include "bench/device_read_bandwidth.h"
#include "bench/graph_timing.h"
#include "bench/relative_error.h"
#include "kernels/cuda_check.h"
#include "kernels/device_buffer.h"
#include "kernels/llama_ops.h"
#include "kernels/skinny_gemm.h"
#include "models/dtype.h"

namespace deft::bench {
namespace {

using kernels::DeviceBuffer;

struct Shape {
  const char* name;
  int32_t out, in;
};
constexpr Shape kShapes[] = {{"qkv", 6144, 4096},
                             {"o", 4096, 4096},
                             {"gate_up", 28672, 4096},
                             {"down", 4096, 14336},
                             {"lm_head", 128256, 4096}};
constexpr size_t kRotateMb = 200;  // > 4x the H100's 50 MB L2
constexpr int kLaunchesPerGraph = 20;

std::vector<double> time_graph(cudaStream_t stream, int reps,
                               const std::function<void(int)>& launch) {
  return time_graph_replays(stream, kLaunchesPerGraph, /*warmup=*/3, reps, launch);
}

}  // namespace
}  // namespace deft::bench

int main(int argc, char** argv) {
  using namespace deft;
  using namespace deft::bench;
  std::string out_dir;
  int reps = 30;
  bool sweep = false;
  std::string only_shape;
  int only_rows = 0;
  size_t rotate_bytes = kRotateMb << 20;
  bool bf16_out = false;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--out") out_dir = argv[i + 1];
    if (flag == "--reps") reps = std::atoi(argv[i + 1]);
    if (flag == "--sweep") sweep = std::atoi(argv[i + 1]) != 0;
    if (flag == "--shape") only_shape = argv[i + 1];
    if (flag == "--rows") only_rows = std::atoi(argv[i + 1]);
    if (flag == "--rotate-mb") rotate_bytes = static_cast<size_t>(std::atol(argv[i + 1])) << 20;
    if (flag == "--bf16-out") bf16_out = std::atoi(argv[i + 1]) != 0;
  }
  cudaDeviceProp prop;
  DEFT_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const std::string gpu = prop.name;
  const std::string tag = BenchResult::gpu_tag(gpu);
  BenchResult result("skinny_gemm", gpu, tag, argc, argv);
  cudaStream_t stream;
  DEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cublasHandle_t cublas;
  if (cublasCreate(&cublas) != CUBLAS_STATUS_SUCCESS ||
      cublasSetStream(cublas, stream) != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "cuBLAS init failed\n");
    return 1;
  }
  std::mt19937 rng(1234);
  const kernels::DType dtype = kernels::DType::kBf16;
  std::printf("%-8s %4s %-16s %9s %9s %6s %8s %8s\n", "shape", "m", "method", "median_us",
              "floor_us", "ratio", "TB/s", "vs_cublas");
  for (const Shape& shape : kShapes) {
    if (!only_shape.empty() && only_shape != shape.name) continue;
    const size_t w_bytes = size_t{2} * shape.out * shape.in;
    // Two copies at least: a launch must not find the previous launch's weights in L2.
    const int copies =
        static_cast<int>(std::max<size_t>(2, (rotate_bytes + w_bytes - 1) / w_bytes));
    std::vector<DeviceBuffer> weights;
    for (int c = 0; c < copies; ++c) {
      weights.emplace_back(w_bytes);
      kernels::launch_random_uniform(int64_t{shape.out} * shape.in, rng(),
                                     std::sqrt(3.0f / shape.in), 0.0f, dtype, weights.back().data(),
                                     stream);
    }
    for (int32_t rows : {1, 7, 20, 64, 128}) {
      if (only_rows > 0 && rows != only_rows) continue;
      const double floor_us = BenchResult::floor_us(w_bytes, 2.0 * rows * shape.in * shape.out);
      DeviceBuffer x(size_t{2} * rows * shape.in);  // written by the RMSNorm below
      const size_t y_count = static_cast<size_t>(rows) * shape.out;
      const size_t y_bytes = y_count * (bf16_out ? 2 : 4);
      const cudaDataType y_type = bf16_out ? CUDA_R_16BF : CUDA_R_32F;
      DeviceBuffer y_cublas(y_bytes), y_skinny(y_bytes);
      // y downloaded as floats.
      const auto download = [&](const DeviceBuffer& y) {
        std::vector<float> values(y_count);
        if (!bf16_out) {
          DEFT_CUDA_CHECK(cudaMemcpy(values.data(), y.data(), y_bytes, cudaMemcpyDeviceToHost));
          return values;
        }
        std::vector<uint16_t> bits(y_count);
        DEFT_CUDA_CHECK(cudaMemcpy(bits.data(), y.data(), y_bytes, cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < y_count; ++i) values[i] = models::bf16_to_float(bits[i]);
        return values;
      };
      const float alpha = 1.0f, beta = 0.0f;
      const auto cublas_launch = [&](int i) {
        if (cublasGemmEx(cublas, CUBLAS_OP_T, CUBLAS_OP_N, shape.out, rows, shape.in, &alpha,
                         weights[i % copies].data(), CUDA_R_16BF, shape.in, x.data(), CUDA_R_16BF,
                         shape.in, &beta, y_cublas.data(), y_type, shape.out, CUBLAS_COMPUTE_32F,
                         CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS) {
          std::fprintf(stderr, "cublasGemmEx failed\n");
          std::exit(1);
        }
      };
      // The decode step's pattern: RMSNorm of the residual into x, then the GEMM.
      DeviceBuffer residual(size_t{4} * rows * shape.in), norm_weight(size_t{4} * shape.in);
      {
        std::vector<float> host(static_cast<size_t>(rows) * shape.in);
        std::normal_distribution<float> normal(0.0f, 1.0f);
        for (float& v : host) v = normal(rng);
        DEFT_CUDA_CHECK(
            cudaMemcpy(residual.data(), host.data(), host.size() * 4, cudaMemcpyHostToDevice));
        host.assign(shape.in, 1.0f);
        DEFT_CUDA_CHECK(
            cudaMemcpy(norm_weight.data(), host.data(), shape.in * 4, cudaMemcpyHostToDevice));
      }
      const auto norm_launch = [&](int) {
        kernels::launch_rms_norm({.num_rows = rows, .width = shape.in}, dtype, nullptr,
                                 static_cast<float*>(residual.data()), nullptr,
                                 static_cast<const float*>(norm_weight.data()), x.data(), stream);
      };
      norm_launch(0);  // x = the norm's output from here on (the same every launch)
      const kernels::SkinnyGemmDims dims{.rows = rows, .in = shape.in, .out = shape.out};
      cublas_launch(0);
      DEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
      const std::vector<float> ref = download(y_cublas);
      const Samples cublas_stats = summarize(time_graph(stream, reps, cublas_launch));
      const auto add_row = [&](const std::string& method, const Samples& stats, int32_t split,
                               double rel_err) {
        ResultRow row;
        row.case_name = std::string(shape.name) + "_m" + std::to_string(rows);
        row.method = method;
        row.set_times(stats);
        row.repetitions = reps;
        row.floor_us = floor_us;
        row.extra = {{"rows", rows},
                     {"in", shape.in},
                     {"out", shape.out},
                     {"weight_bytes", w_bytes},
                     {"y", bf16_out ? "bf16" : "fp32"},
                     {"achieved_tb_per_s", w_bytes / stats.median / 1e6},
                     {"speedup_vs_cublas", cublas_stats.median / stats.median}};
        if (split > 0) row.extra["ctas"] = split;
        if (rel_err >= 0) row.extra["rel_err_vs_cublas"] = rel_err;
        std::printf("%-8s %4d %-16s %9.1f %9.1f %6.2f %8.2f %8.2f", shape.name, rows,
                    method.c_str(), stats.median, floor_us, stats.median / floor_us,
                    w_bytes / stats.median / 1e6, cublas_stats.median / stats.median);
        std::printf(split > 0 ? "   %d CTAs\n" : "\n", split);
        result.add(row);
      };
      add_row("cublas", cublas_stats, 0, -1);
      const Samples norm_stats = summarize(time_graph(stream, reps, norm_launch));
      add_row("norm", norm_stats, 0, -1);
      add_row("cublas_after_norm",
              summarize(time_graph(stream, reps,
                                   [&](int i) {
                                     norm_launch(i);
                                     cublas_launch(i);
                                   })),
              0, -1);
      if (rows == 1) {
        DeviceBuffer sink(4);
        const auto read_launch = [&](int i) {
          launch_device_read(weights[i % copies].data(), w_bytes,
                             static_cast<uint32_t*>(sink.data()), stream);
        };
        add_row("read", summarize(time_graph(stream, reps, read_launch)), 0, -1);
      }
      std::vector<int32_t> splits = {0};
      if (sweep) splits = {0, 1, 2, 3, 4, 6, 8};
      for (int32_t split : splits) {
        const auto skinny_launch = [&](int i) {
          kernels::launch_skinny_gemm(dims, dtype, x.data(), weights[i % copies].data(),
                                      y_skinny.data(), !bf16_out, false, stream, split);
        };
        DEFT_CUDA_CHECK(cudaMemsetAsync(y_skinny.data(), 0xff, y_bytes, stream));  // NaN
        skinny_launch(0);
        DEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
        const std::vector<float> ours = download(y_skinny);
        const double rel_err = relative_l2_error(ours, ref);
        const int32_t used = kernels::skinny_gemm_ctas(dims, split);
        // bf16 outputs: both sides round (to within one ulp each).
        if (!(rel_err < (bf16_out ? 8e-3 : 1e-4))) {
          std::printf("%-8s %4d skinny split %d FAILED CHECK (rel err %.2e, row not written)\n",
                      shape.name, rows, used, rel_err);
          continue;
        }
        const Samples stats = summarize(time_graph(stream, reps, skinny_launch));
        add_row(split == 0 ? "skinny" : "skinny_split" + std::to_string(split), stats, used,
                rel_err);
        if (split == 0) {
          add_row("skinny_after_norm",
                  summarize(time_graph(stream, reps,
                                       [&](int i) {
                                         norm_launch(i);
                                         skinny_launch(i);
                                       })),
                  used, rel_err);
          DeviceBuffer scratch(4);
          const auto isolated_launch = [&](int i) {
            DEFT_CUDA_CHECK(cudaMemsetAsync(scratch.data(), 0, 4, stream));
            skinny_launch(i);
          };
          add_row("skinny_isolated", summarize(time_graph(stream, reps, isolated_launch)), used,
                  rel_err);
        }
      }
    }
  }
  cublasDestroy(cublas);
  std::printf("wrote %s\n", result.write(out_dir).c_str());
  return 0;
}
