#include "bench/device_read_bandwidth.h"

#include <cstdio>

#include "bench/bench_result.h"
#include "bench/graph_timing.h"
#include "kernels/cuda_check.h"
#include "kernels/device_buffer.h"
#include "kernels/device_info.h"

namespace deft::bench {
namespace {

// Reads a[0, n) and then b[0, n) (b may be null), 16 bytes a load.
__global__ void read_kernel(const uint4* __restrict__ a, const uint4* __restrict__ b, int64_t n,
                            uint32_t* sink) {
  uint32_t acc = 0;
  const int64_t total = b == nullptr ? n : 2 * n;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const uint4 v = __ldcs(i < n ? a + i : b + (i - n));
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) *sink = acc;
}

void launch_read(const void* a, const void* b, size_t bytes_each, uint32_t* sink,
                 cudaStream_t stream) {
  read_kernel<<<kernels::current_device_sm_count() * 4, 512, 0, stream>>>(
      static_cast<const uint4*>(a), static_cast<const uint4*>(b),
      static_cast<int64_t>(bytes_each / 16), sink);
  DEFT_CUDA_CHECK_LAUNCH();
}

}  // namespace

void launch_device_read(const void* data, size_t bytes, uint32_t* sink, cudaStream_t stream) {
  launch_read(data, nullptr, bytes, sink, stream);
}

void launch_device_read_pair(const void* a, const void* b, size_t bytes_each, uint32_t* sink,
                             cudaStream_t stream) {
  launch_read(a, b, bytes_each, sink, stream);
}

double measure_device_read_bytes_per_s(size_t bytes, int reps) {
  bytes -= bytes % 16;
  kernels::DeviceBuffer buffer(bytes), sink(4);
  DEFT_CUDA_CHECK(cudaMemset(buffer.data(), 0x5a, bytes));
  cudaStream_t stream = nullptr;
  DEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const auto read = [&](int) {
    launch_device_read(buffer.data(), bytes, static_cast<uint32_t*>(sink.data()), stream);
  };
  const Samples us = summarize(
      time_graph_replays(stream, /*launches_per_graph=*/1, /*warmup=*/3, reps, read));
  DEFT_CUDA_CHECK(cudaStreamDestroy(stream));
  return static_cast<double>(bytes) / (us.median * 1e-6);
}

double measure_and_print_device_read_bandwidth() {
  const double bytes_per_s = measure_device_read_bytes_per_s();
  std::printf("device read bandwidth: %.3f TB/s (2 GiB read once, median of 20; the floor "
              "assumes %.1f)\n",
              bytes_per_s / 1e12, BenchResult::kHbmBytesPerS / 1e12);
  return bytes_per_s;
}

}  // namespace deft::bench
