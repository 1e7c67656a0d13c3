// models/gemm_tuner.h against cublasGemmEx's default algorithm (the tuner with tuning off) on
// the same inputs: every candidate the tuner timed (and its choice) on every Llama-3-8B decode
// GEMM shape (QKV, O, gate/up, down, LM head) at M in {1, 20, 64}, and odd sizes; 16-bit out,
// fp32 out, fp32 accumulated into (beta = 1). Candidates differ from the default only in fp32
// summation order (split-K, tiles), so fp32 outputs agree to 1e-4 of the output's norm (K up
// to 14336) and 16-bit outputs to rounding. Also: rows not tuned follow their bucket's choice, and
// a captured CUDA graph replays the eager launch bit for bit.
#include "models/gemm_tuner.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/llama_ops.h"
#include "tests/gpu/gpu_test_support.h"

namespace deft::models {
namespace {

using kernels::DeviceBuffer;
using kernels::DType;

constexpr size_t kWorkspaceBytes = size_t{32} << 20;  // the runner's
constexpr double kFp32Tolerance = 1e-4;
constexpr double kHalfTolerance = 4e-3;  // one bf16 ulp is 2^-8 of an element

struct Operands {
  GemmShape shape;
  DeviceBuffer x, w, y;
  std::vector<float> y_start;  // fp32 y before each launch (accumulate), else empty
};

Operands make_operands(const GemmShape& shape, uint32_t seed) {
  Operands o;
  o.shape = shape;
  o.x.reset(size_t{2} * shape.rows * shape.in);
  o.w.reset(size_t{2} * shape.out * shape.in);
  kernels::launch_random_uniform(int64_t{shape.rows} * shape.in, seed, std::sqrt(3.0f), 0.0f,
                                 shape.dtype, o.x.data(), nullptr);
  kernels::launch_random_uniform(int64_t{shape.out} * shape.in, seed + 1,
                                 std::sqrt(3.0f / shape.in), 0.0f, shape.dtype, o.w.data(),
                                 nullptr);
  const size_t y_count = static_cast<size_t>(shape.rows) * shape.out;
  o.y.reset(y_count * (shape.y_fp32 ? 4 : 2));
  if (shape.accumulate) {
    std::mt19937 rng(seed + 2);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    o.y_start.resize(y_count);
    for (float& v : o.y_start) v = normal(rng);
  }
  DEFT_CUDA_CHECK(cudaDeviceSynchronize());
  return o;
}

// y as floats after one gemm() on the tuner's current choice.
std::vector<float> run(GemmTuner& tuner, Operands& o, cudaStream_t stream) {
  const size_t y_count = static_cast<size_t>(o.shape.rows) * o.shape.out;
  if (o.shape.accumulate) {
    DEFT_CUDA_CHECK(
        cudaMemcpyAsync(o.y.data(), o.y_start.data(), y_count * 4, cudaMemcpyHostToDevice, stream));
  } else {
    DEFT_CUDA_CHECK(cudaMemsetAsync(o.y.data(), 0xff, o.y.bytes(), stream));  // NaN
  }
  tuner.gemm(o.shape, o.x.data(), o.w.data(), o.y.data());
  DEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<float> y(y_count);
  if (o.shape.y_fp32) {
    DEFT_CUDA_CHECK(cudaMemcpy(y.data(), o.y.data(), y_count * 4, cudaMemcpyDeviceToHost));
  } else {
    std::vector<uint16_t> bits(y_count);
    DEFT_CUDA_CHECK(cudaMemcpy(bits.data(), o.y.data(), y_count * 2, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < y_count; ++i) y[i] = kernels::from_bits(bits[i], o.shape.dtype);
  }
  return y;
}

// Norm-relative difference; NaN anywhere counts as infinite.
double difference(const std::vector<float>& y, const std::vector<float>& ref) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < y.size(); ++i) {
    if (!std::isfinite(y[i])) return INFINITY;
    diff += double(y[i] - ref[i]) * (y[i] - ref[i]);
    norm += double(ref[i]) * ref[i];
  }
  return std::sqrt(diff / std::max(norm, 1e-30));
}

class GemmTunerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!kernels::cuda_device_visible()) GTEST_SKIP() << "no CUDA device visible";
    DEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    workspace_.reset(kWorkspaceBytes);
    tuner_ = std::make_unique<GemmTuner>(stream_, workspace_.data(), workspace_.bytes());
  }
  void TearDown() override {
    tuner_.reset();
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  // Tunes `shape`, then checks the default and every candidate against the default.
  void check_every_candidate(const GemmShape& shape, uint32_t seed) {
    SCOPED_TRACE(gemm_shape_name(shape) + ", seed " + std::to_string(seed));
    Operands o = make_operands(shape, seed);
    const void* weights[] = {o.w.data()};
    const GemmTuneResult result = tuner_->tune(shape, weights, o.x.data(), o.y.data());
    ASSERT_GT(result.default_us, 0.0);
    tuner_->set_enabled(false);
    const std::vector<float> ref = run(*tuner_, o, stream_);
    tuner_->set_enabled(true);
    const double tolerance = shape.y_fp32 ? kFp32Tolerance : kHalfTolerance;
    int32_t timed = 0;
    for (int32_t i = 0; i < static_cast<int32_t>(result.candidates.size()); ++i) {
      if (result.candidates[i].median_us <= 0) continue;  // failed to launch: never chosen
      ++timed;
      tuner_->force_choice(shape, i);
      EXPECT_LT(difference(run(*tuner_, o, stream_), ref), tolerance)
          << "candidate " << i << ": " << result.candidates[i].algo;
    }
    EXPECT_GT(timed, 0) << "no cuBLASLt candidate ran";
    tuner_->force_choice(shape, result.chosen);
    EXPECT_LT(difference(run(*tuner_, o, stream_), ref), tolerance) << result.chosen_algo();
    std::printf("[ tuner    ] %-36s default %8.2f us, chosen %8.2f us (%d candidates): %s\n",
                gemm_shape_name(shape).c_str(), result.default_us, result.chosen_us(),
                static_cast<int>(result.candidates.size()), result.chosen_algo().c_str());
  }

  cudaStream_t stream_ = nullptr;
  DeviceBuffer workspace_;
  std::unique_ptr<GemmTuner> tuner_;
};

struct LlamaShape {
  const char* name;
  int32_t in, out;
};
constexpr LlamaShape kLlama3_8B[] = {{"qkv", 4096, 6144},
                                     {"o", 4096, 4096},
                                     {"gate_up", 4096, 28672},
                                     {"down", 14336, 4096},
                                     {"lm_head", 4096, 128256}};

TEST_F(GemmTunerTest, Llama3_8BShapesEveryCandidateMatchesCublas) {
  uint32_t seed = 100;
  for (const LlamaShape& llama : kLlama3_8B) {
    for (const int32_t rows : {1, 20, 64}) {
      // 16-bit out, fp32 out, fp32 accumulated into (the runner's O / down).
      for (const auto& [y_fp32, accumulate] :
           {std::pair{false, false}, std::pair{true, false}, std::pair{true, true}}) {
        check_every_candidate({.rows = rows,
                               .in = llama.in,
                               .out = llama.out,
                               .dtype = DType::kBf16,
                               .y_fp32 = y_fp32,
                               .accumulate = accumulate},
                              seed++);
      }
    }
  }
}

TEST_F(GemmTunerTest, OddSizesEveryCandidateMatchesCublas) {
  uint32_t seed = 500;
  const std::pair<int32_t, int32_t> in_out[] = {
      {64, 77}, {392, 129}, {1000, 200}, {4104, 1001}, {24, 1}};
  for (const auto& [in, out] : in_out) {
    for (const int32_t rows : {1, 3, 33, 130}) {
      for (const DType dtype : {DType::kBf16, DType::kFp16}) {
        for (const auto& [y_fp32, accumulate] :
             {std::pair{false, false}, std::pair{true, false}, std::pair{true, true}}) {
          check_every_candidate({.rows = rows,
                                 .in = in,
                                 .out = out,
                                 .dtype = dtype,
                                 .y_fp32 = y_fp32,
                                 .accumulate = accumulate},
                                seed++);
        }
      }
    }
  }
}

// The wide search's extra candidates (every algorithm id's best few, split-K variants) too.
TEST_F(GemmTunerTest, WideSearchEveryCandidateMatchesCublas) {
  tuner_->set_wide_search(true);
  uint32_t seed = 900;
  for (const LlamaShape& llama : kLlama3_8B) {
    for (const auto& [y_fp32, accumulate] : {std::pair{false, false}, std::pair{true, true}}) {
      check_every_candidate({.rows = 20,
                             .in = llama.in,
                             .out = llama.out,
                             .dtype = DType::kBf16,
                             .y_fp32 = y_fp32,
                             .accumulate = accumulate},
                            seed++);
    }
  }
  for (const int32_t rows : {1, 33}) {
    check_every_candidate({.rows = rows,
                           .in = 1000,
                           .out = 200,
                           .dtype = DType::kFp16,
                           .y_fp32 = true,
                           .accumulate = true},
                          seed++);
  }
}

// Rows never tuned run their power-of-two bucket's choice (when cuBLASLt accepts it for them):
// whatever that is, the result equals the default's.
TEST_F(GemmTunerTest, UntunedRowsFollowTheirBucket) {
  for (const auto& [y_fp32, accumulate] : {std::pair{false, false}, std::pair{true, true}}) {
    GemmShape bucket{.rows = 32,
                     .in = 4096,
                     .out = 4096,
                     .dtype = DType::kBf16,
                     .y_fp32 = y_fp32,
                     .accumulate = accumulate};
    Operands tuned = make_operands(bucket, 7);
    const void* weights[] = {tuned.w.data()};
    const GemmTuneResult result = tuner_->tune(bucket, weights, tuned.x.data(), tuned.y.data());
    for (const int32_t rows : {17, 20, 31}) {
      GemmShape shape = bucket;
      shape.rows = rows;
      SCOPED_TRACE(gemm_shape_name(shape) + " after " + result.chosen_algo());
      Operands o = make_operands(shape, 8 + rows);
      const std::vector<float> with_bucket = run(*tuner_, o, stream_);
      tuner_->set_enabled(false);
      const std::vector<float> ref = run(*tuner_, o, stream_);
      tuner_->set_enabled(true);
      EXPECT_LT(difference(with_bucket, ref), y_fp32 ? kFp32Tolerance : kHalfTolerance);
    }
  }
}

// The choice inside a captured graph gives the eager launch's bits (the runner captures steps).
TEST_F(GemmTunerTest, GraphReplayEqualsEagerBitForBit) {
  for (const LlamaShape& llama : {kLlama3_8B[1], kLlama3_8B[3]}) {
    const GemmShape shape{.rows = 32,
                          .in = llama.in,
                          .out = llama.out,
                          .dtype = DType::kBf16,
                          .y_fp32 = true,
                          .accumulate = true};
    SCOPED_TRACE(gemm_shape_name(shape));
    Operands o = make_operands(shape, 21);
    const void* weights[] = {o.w.data()};
    const GemmTuneResult result = tuner_->tune(shape, weights, o.x.data(), o.y.data());
    const std::vector<float> eager = run(*tuner_, o, stream_);

    const size_t y_count = static_cast<size_t>(shape.rows) * shape.out;
    DEFT_CUDA_CHECK(cudaMemcpyAsync(o.y.data(), o.y_start.data(), y_count * 4,
                                    cudaMemcpyHostToDevice, stream_));
    DEFT_CUDA_CHECK(cudaStreamSynchronize(stream_));
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    DEFT_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    tuner_->gemm(shape, o.x.data(), o.w.data(), o.y.data());
    DEFT_CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
    DEFT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    DEFT_CUDA_CHECK(cudaGraphLaunch(exec, stream_));
    DEFT_CUDA_CHECK(cudaStreamSynchronize(stream_));
    std::vector<float> replayed(y_count);
    DEFT_CUDA_CHECK(cudaMemcpy(replayed.data(), o.y.data(), y_count * 4, cudaMemcpyDeviceToHost));
    DEFT_CUDA_CHECK(cudaGraphExecDestroy(exec));
    DEFT_CUDA_CHECK(cudaGraphDestroy(graph));
    EXPECT_EQ(std::memcmp(replayed.data(), eager.data(), y_count * 4), 0)
        << "chosen " << result.chosen_algo();
  }
}

}  // namespace
}  // namespace deft::models
