// The skinny GEMM (kernels/skinny_gemm.h) against its CPU twin (float64 sums over inputs already
// rounded to the element type) and against cuBLAS (bf16/fp16 in, fp32 compute) on fresh random
// inputs: every Llama-3-8B decode-step shape (QKV, O, gate/up, down, LM head) with 1..128 rows,
// odd sizes (K not a multiple of 64, N not a multiple of 128, one row), forced splits, fp32 and
// 16-bit outputs, accumulate on and off. Between them they take each form of the kernel's grid: a
// tile per CTA (gate/up), tiles split along K in a cluster (QKV, O, down, forced splits), and
// stream-K with partial tiles handed over through global memory (LM head, forced splits the
// grid caps). Outputs are poisoned with NaN before each launch; every
// element must be written. The reference of the large shapes covers sampled weight rows only.
#include "kernels/skinny_gemm.h"

#include <cublas_v2.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/llama_ops.h"
#include "kernels/skinny_gemm_cpu.h"
#include "tests/gpu/gpu_test_support.h"

namespace deft::kernels {
namespace {

// A launch outside the contract aborts naming what is wrong, before it touches a GPU (so this runs
// on machines without one too). The pointers are never dereferenced.
TEST(SkinnyGemmContract, UnsupportedLaunchesAbortNamingTheProblem) {
  const void* aligned = reinterpret_cast<const void*>(uintptr_t{4096});
  const void* misaligned = reinterpret_cast<const void*>(uintptr_t{4098});
  void* out = reinterpret_cast<void*>(uintptr_t{8192});
  EXPECT_DEATH(launch_skinny_gemm({.rows = 1, .in = 12, .out = 8}, DType::kBf16, aligned, aligned,
                                  out, true, false, nullptr),
               "launch_skinny_gemm: unsupported product: rows 1 .*in 12 "
               "\\(> 0, a multiple of 8\\)");
  EXPECT_DEATH(launch_skinny_gemm({.rows = 0, .in = 64, .out = 8}, DType::kBf16, aligned, aligned,
                                  out, true, false, nullptr),
               "unsupported product: rows 0 \\(1\\.\\.");
  EXPECT_DEATH(launch_skinny_gemm({.rows = 2, .in = 64, .out = 8}, DType::kBf16, aligned,
                                  misaligned, out, true, false, nullptr),
               "16-byte aligned \\(yes, no\\)");
  EXPECT_DEATH(launch_skinny_gemm_swiglu(2, 64, 0, DType::kBf16, aligned, aligned, out, nullptr),
               "launch_skinny_gemm_swiglu: width 0 must be > 0");
}

// fp32 outputs of products of already-rounded operands differ from float64 only by fp32
// accumulation order.
constexpr double kFp32OutTolerance = 1e-4;

struct Problem {
  SkinnyGemmDims dims;
  DType dtype = DType::kBf16;
  DeviceBuffer x, w;
  std::vector<float> x_values;        // [rows][in]
  std::vector<int32_t> sampled;       // weight rows the reference covers
  std::vector<float> w_sampled;       // [sampled][in]
};

// w on the device by the seeded uniform fill (std 1 / sqrt(in)); x from the host (std 1).
Problem make_problem(const SkinnyGemmDims& dims, DType dtype, std::mt19937& rng,
                     int32_t max_sampled) {
  Problem p;
  p.dims = dims;
  p.dtype = dtype;
  const Tensor16 x = random_tensor(static_cast<size_t>(dims.rows) * dims.in, dtype, rng);
  p.x = to_device(x.bits);
  p.x_values = x.values;
  const size_t w_count = static_cast<size_t>(dims.out) * dims.in;
  p.w.reset(w_count * 2);
  const float half_width = std::sqrt(3.0f / static_cast<float>(dims.in));
  launch_random_uniform(static_cast<int64_t>(w_count), rng(), half_width, 0.0f, dtype, p.w.data(),
                        nullptr);
  DEFT_CUDA_CHECK(cudaDeviceSynchronize());
  if (dims.out <= max_sampled) {
    for (int32_t n = 0; n < dims.out; ++n) p.sampled.push_back(n);
  } else {
    // The first and last rows of the first tiles (128 rows each), then random rows.
    for (int32_t n : {0, 1, 127, 128, dims.out - 1}) p.sampled.push_back(n);
    while (static_cast<int32_t>(p.sampled.size()) < max_sampled) {
      p.sampled.push_back(static_cast<int32_t>(rng() % dims.out));
    }
  }
  std::vector<uint16_t> row(dims.in);
  p.w_sampled.resize(p.sampled.size() * dims.in);
  for (size_t i = 0; i < p.sampled.size(); ++i) {
    DEFT_CUDA_CHECK(cudaMemcpy(row.data(), p.w.as<uint16_t>() + size_t{1} * p.sampled[i] * dims.in,
                               dims.in * 2, cudaMemcpyDeviceToHost));
    for (int32_t k = 0; k < dims.in; ++k) p.w_sampled[i * dims.in + k] = from_bits(row[k], dtype);
  }
  return p;
}

// y as floats (fp32 or widened 16-bit).
std::vector<float> read_y(const DeviceBuffer& y, size_t count, bool y_fp32, DType dtype) {
  if (y_fp32) return to_host<float>(y, count);
  const std::vector<uint16_t> bits = to_host<uint16_t>(y, count);
  std::vector<float> out(count);
  for (size_t i = 0; i < count; ++i) out[i] = from_bits(bits[i], dtype);
  return out;
}

struct Outcome {
  double error_vs_reference = 0.0;
  int64_t unwritten = 0;  // NaN (poison) left in y
  std::vector<float> y;
};

// Runs one product (y poisoned first, or y0 when accumulating) and checks the sampled columns.
Outcome run_checked(const Problem& p, bool y_fp32, bool accumulate, int32_t split_k,
                    const std::vector<float>& y0) {
  const SkinnyGemmDims& d = p.dims;
  const size_t count = static_cast<size_t>(d.rows) * d.out;
  DeviceBuffer y(count * (y_fp32 ? 4 : 2));
  std::vector<float> y_start(count);
  if (accumulate) {
    if (y_fp32) {
      y_start = y0;
      DEFT_CUDA_CHECK(cudaMemcpy(y.data(), y0.data(), count * 4, cudaMemcpyHostToDevice));
    } else {
      std::vector<uint16_t> bits(count);
      for (size_t i = 0; i < count; ++i) {
        bits[i] = to_bits(y0[i], p.dtype);
        y_start[i] = from_bits(bits[i], p.dtype);
      }
      DEFT_CUDA_CHECK(cudaMemcpy(y.data(), bits.data(), count * 2, cudaMemcpyHostToDevice));
    }
  } else if (y_fp32) {
    const std::vector<float> nan(count, std::nanf(""));
    DEFT_CUDA_CHECK(cudaMemcpy(y.data(), nan.data(), count * 4, cudaMemcpyHostToDevice));
  } else {
    const std::vector<uint16_t> nan(count, nan_bits(p.dtype));
    DEFT_CUDA_CHECK(cudaMemcpy(y.data(), nan.data(), count * 2, cudaMemcpyHostToDevice));
  }
  launch_skinny_gemm(d, p.dtype, p.x.data(), p.w.data(), y.data(), y_fp32, accumulate, nullptr,
                     split_k);
  DEFT_CUDA_CHECK(cudaDeviceSynchronize());
  Outcome o;
  o.y = read_y(y, count, y_fp32, p.dtype);
  for (float v : o.y) o.unwritten += std::isnan(v) ? 1 : 0;
  // Reference over the sampled weight rows: the CPU twin on [sampled][in].
  const int32_t s = static_cast<int32_t>(p.sampled.size());
  std::vector<float> ref(static_cast<size_t>(d.rows) * s, 0.0f);
  for (int32_t m = 0; m < d.rows; ++m) {
    for (int32_t i = 0; i < s; ++i) ref[m * s + i] = y_start[size_t{1} * m * d.out + p.sampled[i]];
  }
  skinny_gemm_cpu({.rows = d.rows, .in = d.in, .out = s}, p.x_values.data(), p.w_sampled.data(),
                  ref.data(), accumulate);
  std::vector<float> ours(ref.size());
  for (int32_t m = 0; m < d.rows; ++m) {
    for (int32_t i = 0; i < s; ++i) ours[m * s + i] = o.y[size_t{1} * m * d.out + p.sampled[i]];
  }
  o.error_vs_reference = compare(ours, std::vector<double>(ref.begin(), ref.end())).relative_error;
  return o;
}

// cuBLAS y = x · w^T in fp32 (the runner's call before the skinny kernel).
std::vector<float> cublas_product(const Problem& p) {
  const SkinnyGemmDims& d = p.dims;
  cublasHandle_t handle;
  EXPECT_EQ(cublasCreate(&handle), CUBLAS_STATUS_SUCCESS);
  DeviceBuffer y(static_cast<size_t>(d.rows) * d.out * 4);
  const float alpha = 1.0f, beta = 0.0f;
  const cudaDataType type = p.dtype == DType::kBf16 ? CUDA_R_16BF : CUDA_R_16F;
  EXPECT_EQ(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, d.out, d.rows, d.in, &alpha,
                         p.w.data(), type, d.in, p.x.data(), type, d.in, &beta, y.data(),
                         CUDA_R_32F, d.out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
            CUBLAS_STATUS_SUCCESS);
  DEFT_CUDA_CHECK(cudaDeviceSynchronize());
  cublasDestroy(handle);
  return to_host<float>(y, static_cast<size_t>(d.rows) * d.out);
}

std::vector<float> random_floats(size_t count, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(count);
  for (float& f : v) f = normal(rng);
  return v;
}

// ---- Llama-3-8B decode shapes -----------------------------------------------------------------

struct Shape {
  const char* name;
  int32_t out, in;
};
constexpr Shape kLlamaShapes[] = {{"qkv", 6144, 4096},
                                  {"o", 4096, 4096},
                                  {"gate_up", 28672, 4096},
                                  {"down", 4096, 14336},
                                  {"lm_head", 128256, 4096}};

class SkinnyGemmLlamaTest : public testing::TestWithParam<std::tuple<int, int32_t>> {};

TEST_P(SkinnyGemmLlamaTest, MatchesReferenceAndCublas) {
  DEFT_SKIP_WITHOUT_GPU();
  const Shape& shape = kLlamaShapes[std::get<0>(GetParam())];
  const int32_t rows = std::get<1>(GetParam());
  const uint32_t seed = fresh_seed();
  std::mt19937 rng(seed);
  const Problem p =
      make_problem({.rows = rows, .in = shape.in, .out = shape.out}, DType::kBf16, rng, 256);
  const size_t count = static_cast<size_t>(rows) * shape.out;

  // fp32 out (the O / down / LM head calls): = and += (the residual).
  const Outcome set = run_checked(p, true, false, 0, {});
  EXPECT_EQ(set.unwritten, 0) << "seed " << seed;
  EXPECT_LT(set.error_vs_reference, kFp32OutTolerance) << "seed " << seed;
  const std::vector<float> y0 = random_floats(count, rng);
  const Outcome add = run_checked(p, true, true, 0, y0);
  EXPECT_EQ(add.unwritten, 0) << "seed " << seed;
  EXPECT_LT(add.error_vs_reference, kFp32OutTolerance) << "seed " << seed;
  // bf16 out (the QKV / gate-up calls).
  const Outcome narrow = run_checked(p, false, false, 0, {});
  EXPECT_EQ(narrow.unwritten, 0) << "seed " << seed;
  EXPECT_LT(narrow.error_vs_reference, tolerance(DType::kBf16)) << "seed " << seed;

  // Against cuBLAS on every element.
  const std::vector<float> theirs = cublas_product(p);
  const Comparison c = compare(set.y, std::vector<double>(theirs.begin(), theirs.end()));
  EXPECT_EQ(c.nan_count, 0);
  EXPECT_LT(c.relative_error, kFp32OutTolerance) << "seed " << seed;
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, SkinnyGemmLlamaTest,
    testing::Combine(testing::Range(0, 5), testing::Values(1, 7, 20, 64, 128)),
    [](const testing::TestParamInfo<std::tuple<int, int32_t>>& info) {
      return std::string(kLlamaShapes[std::get<0>(info.param)].name) + "_m" +
             std::to_string(std::get<1>(info.param));
    });

// ---- odd sizes, both dtypes, forced splits ----------------------------------------------------

class SkinnyGemmOddTest : public testing::TestWithParam<DType> {};

TEST_P(SkinnyGemmOddTest, OddSizesAndSplits) {
  DEFT_SKIP_WITHOUT_GPU();
  const uint32_t seed = fresh_seed();
  std::mt19937 rng(seed);
  const SkinnyGemmDims cases[] = {{.rows = 1, .in = 8, .out = 1},      {.rows = 3, .in = 24, .out = 200},
                                  {.rows = 13, .in = 4104, .out = 1001}, {.rows = 64, .in = 392, .out = 129},
                                  {.rows = 100, .in = 1000, .out = 300}, {.rows = 9, .in = 2056, .out = 77},
                                  {.rows = 128, .in = 136, .out = 257}};
  for (const SkinnyGemmDims& d : cases) {
    const Problem p = make_problem(d, GetParam(), rng, 2000);
    const std::vector<float> y0 = random_floats(static_cast<size_t>(d.rows) * d.out, rng);
    for (int32_t split : {0, 1, 3, 8}) {
      for (bool y_fp32 : {true, false}) {
        for (bool accumulate : {false, true}) {
          const Outcome o = run_checked(p, y_fp32, accumulate, split, y0);
          const std::string what = "rows " + std::to_string(d.rows) + " in " +
                                   std::to_string(d.in) + " out " + std::to_string(d.out) +
                                   " split " + std::to_string(split) + " fp32 " +
                                   std::to_string(y_fp32) + " acc " + std::to_string(accumulate) +
                                   " seed " + std::to_string(seed);
          EXPECT_EQ(o.unwritten, 0) << what;
          EXPECT_LT(o.error_vs_reference, y_fp32 ? kFp32OutTolerance : tolerance(GetParam()))
              << what;
        }
      }
    }
  }
}

// Same inputs, same split: bit-identical outputs (partial sums are added in a fixed order), for
// a cluster-split shape and a stream-K one.
TEST_P(SkinnyGemmOddTest, Deterministic) {
  DEFT_SKIP_WITHOUT_GPU();
  const uint32_t seed = fresh_seed();
  std::mt19937 rng(seed);
  for (const SkinnyGemmDims& d : {SkinnyGemmDims{.rows = 20, .in = 4096, .out = 4096},
                                  SkinnyGemmDims{.rows = 20, .in = 4096, .out = 40000}}) {
    const Problem p = make_problem(d, GetParam(), rng, 64);
    const Outcome first = run_checked(p, true, false, 0, {});
    const Outcome second = run_checked(p, true, false, 0, {});
    EXPECT_EQ(std::memcmp(first.y.data(), second.y.data(), first.y.size() * 4), 0)
        << "out " << d.out << " seed " << seed;
  }
}

INSTANTIATE_TEST_SUITE_P(DTypes, SkinnyGemmOddTest, testing::Values(DType::kBf16, DType::kFp16),
                         [](const testing::TestParamInfo<DType>& info) {
                           return std::string(dtype_name(info.param));
                         });

// SwiGLU fused into the product (launch_skinny_gemm_swiglu) against float64 on sampled output
// columns: silu(g) * u of the gate and up rows of each column, rounded once. The Llama-3-8B
// gate/up shape at 20, 40 and 64 rows, a width that ends inside a tile with few tiles (one CTA
// a tile instead of a K split), and 100 rows (two passes); outputs poisoned first.
TEST_P(SkinnyGemmOddTest, SwiGlu) {
  DEFT_SKIP_WITHOUT_GPU();
  const uint32_t seed = fresh_seed();
  std::mt19937 rng(seed);
  const DType dtype = GetParam();
  struct Case {
    int32_t rows, in, width;
  };
  for (const Case& c : {Case{20, 4096, 14336}, Case{40, 4096, 14336}, Case{64, 4096, 14336},
                        Case{3, 136, 200}, Case{100, 264, 1000}}) {
    const Problem p =
        make_problem({.rows = c.rows, .in = c.in, .out = 2 * c.width}, dtype, rng, 0);
    const size_t count = static_cast<size_t>(c.rows) * c.width;
    DeviceBuffer out(count * 2);
    const std::vector<uint16_t> poison(count, nan_bits(dtype));
    DEFT_CUDA_CHECK(cudaMemcpy(out.data(), poison.data(), count * 2, cudaMemcpyHostToDevice));
    launch_skinny_gemm_swiglu(c.rows, c.in, c.width, dtype, p.x.data(), p.w.data(), out.data(),
                              nullptr);
    DEFT_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<float> got = read_y(out, count, false, dtype);
    int64_t unwritten = 0;
    for (float v : got) unwritten += std::isnan(v) ? 1 : 0;
    // Sampled columns: the first and last of the first tiles and of the row, then random ones.
    std::vector<int32_t> columns = {0, 1, 63, 64, c.width - 1};
    while (columns.size() < 48) columns.push_back(static_cast<int32_t>(rng() % c.width));
    std::vector<float> ours;
    std::vector<double> ref;
    std::vector<uint16_t> gate_bits(c.in), up_bits(c.in);
    for (int32_t n : columns) {
      DEFT_CUDA_CHECK(cudaMemcpy(gate_bits.data(), p.w.as<uint16_t>() + size_t{1} * n * c.in,
                                 c.in * 2, cudaMemcpyDeviceToHost));
      DEFT_CUDA_CHECK(cudaMemcpy(up_bits.data(),
                                 p.w.as<uint16_t>() + (size_t{1} * c.width + n) * c.in, c.in * 2,
                                 cudaMemcpyDeviceToHost));
      for (int32_t m = 0; m < c.rows; ++m) {
        double g = 0.0, u = 0.0;
        for (int32_t k = 0; k < c.in; ++k) {
          const double xv = p.x_values[size_t{1} * m * c.in + k];
          g += xv * from_bits(gate_bits[k], dtype);
          u += xv * from_bits(up_bits[k], dtype);
        }
        ref.push_back(g / (1.0 + std::exp(-g)) * u);
        ours.push_back(got[size_t{1} * m * c.width + n]);
      }
    }
    const std::string what = "rows " + std::to_string(c.rows) + " in " + std::to_string(c.in) +
                             " width " + std::to_string(c.width) + " seed " + std::to_string(seed);
    EXPECT_EQ(unwritten, 0) << what;
    EXPECT_LT(compare(ours, ref).relative_error, tolerance(dtype)) << what;
  }
}

// A stream's workspace is freed with skinny_gemm_release and made again by the next launch on
// that stream (a runner releases its stream's before destroying it): results stay right.
TEST(SkinnyGemm, WorkspaceReleasedAndMadeAgain) {
  DEFT_SKIP_WITHOUT_GPU();
  const uint32_t seed = fresh_seed();
  std::mt19937 rng(seed);
  const SkinnyGemmDims d{.rows = 8, .in = 4096, .out = 40000};  // stream-K: uses the workspace
  const Problem p = make_problem(d, DType::kBf16, rng, 64);
  cudaStream_t stream = nullptr;
  DEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const size_t count = static_cast<size_t>(d.rows) * d.out;
  DeviceBuffer first(count * 4), second(count * 4);
  skinny_gemm_reserve(stream);
  launch_skinny_gemm(d, p.dtype, p.x.data(), p.w.data(), first.data(), true, false, stream);
  DEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
  skinny_gemm_release(stream);
  skinny_gemm_release(stream);  // none left: nothing to do
  launch_skinny_gemm(d, p.dtype, p.x.data(), p.w.data(), second.data(), true, false, stream);
  DEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
  skinny_gemm_release(stream);
  DEFT_CUDA_CHECK(cudaStreamDestroy(stream));
  const std::vector<float> a = to_host<float>(first, count);
  const std::vector<float> b = to_host<float>(second, count);
  EXPECT_EQ(std::memcmp(a.data(), b.data(), count * 4), 0) << "seed " << seed;
  const Outcome o = run_checked(p, true, false, 0, {});
  EXPECT_EQ(std::memcmp(a.data(), o.y.data(), count * 4), 0) << "seed " << seed;
}

TEST(SkinnyGemm, Supported) {
  EXPECT_FALSE(skinny_gemm_supported({.rows = 4, .in = 12, .out = 8}, nullptr, nullptr));
  EXPECT_FALSE(skinny_gemm_supported({.rows = 129, .in = 16, .out = 8}, nullptr, nullptr));
  EXPECT_FALSE(skinny_gemm_supported({.rows = 0, .in = 16, .out = 8}, nullptr, nullptr));
  EXPECT_TRUE(skinny_gemm_supported({.rows = 128, .in = 16, .out = 8}, nullptr, nullptr));
  alignas(16) static uint16_t buffer[16];
  EXPECT_FALSE(skinny_gemm_supported({.rows = 1, .in = 8, .out = 1}, buffer + 1, buffer));
}

}  // namespace
}  // namespace deft::kernels
