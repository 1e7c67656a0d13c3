// kernels/peer_all_reduce.h on two GPUs (skipped with fewer, or without peer access): every
// rank's thread reduces its random data, for counts from 0 to the capacity, eagerly and replayed
// from a CUDA graph many times (the device-side call counters), against the CPU twin's sum in
// rank order (models/host_collectives.h): bit for bit.
#include "kernels/peer_all_reduce.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <thread>
#include <vector>

#include "kernels/cuda_check.h"
#include "kernels/device_buffer.h"
#include "kernels/device_scope.h"

namespace deft::kernels {
namespace {

bool two_gpus_with_peer_access() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count < 2) {
    cudaGetLastError();
    return false;
  }
  int a = 0, b = 0;
  return cudaDeviceCanAccessPeer(&a, 0, 1) == cudaSuccess &&
         cudaDeviceCanAccessPeer(&b, 1, 0) == cudaSuccess && a && b;
}

TEST(PeerAllReduce, SumsInRankOrderEagerAndReplayed) {
  if (!two_gpus_with_peer_access()) GTEST_SKIP() << "needs 2 GPUs with peer access";
  constexpr int kRanks = 2;
  constexpr int64_t kCapacity = 256 * 1024;
  for (int d = 0; d < kRanks; ++d) {
    const DeviceScope on_device(d);
    const cudaError_t enabled = cudaDeviceEnablePeerAccess(1 - d, 0);
    if (enabled == cudaErrorPeerAccessAlreadyEnabled) {
      cudaGetLastError();
    } else {
      DEFT_CUDA_CHECK(enabled);
    }
  }
  std::vector<DeviceBuffer> buffers(kRanks), data(kRanks);
  PeerAllReduceTable table{.ranks = kRanks, .capacity = kCapacity};
  for (int r = 0; r < kRanks; ++r) {
    const DeviceScope on_device(r);
    buffers[r].reset(peer_all_reduce_buffer_bytes(kRanks, kCapacity));
    DEFT_CUDA_CHECK(cudaMemset(buffers[r].data(), 0, buffers[r].bytes()));
    data[r].reset(kCapacity * sizeof(float));
    table.buffers[r] = buffers[r].data();
  }
  const uint32_t seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 10.0f);
  const std::vector<int64_t> counts = {1, 7, 4096, 20 * 4096, 64 * 8192, kCapacity, 0, 33};
  for (int64_t count : counts) {
    std::vector<std::vector<float>> inputs(kRanks, std::vector<float>(count));
    for (auto& input : inputs) {
      for (float& v : input) v = normal(rng);
    }
    std::vector<float> expected(count);
    for (int64_t i = 0; i < count; ++i) expected[i] = inputs[0][i] + inputs[1][i];
    std::vector<std::vector<float>> got(kRanks);
    std::vector<std::thread> threads;
    for (int r = 0; r < kRanks; ++r) {
      threads.emplace_back([&, r] {
        const DeviceScope on_device(r);
        cudaStream_t stream;
        DEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        float* x = data[r].as<float>();
        // The input on the device, copied into x before each call (a graph node too).
        DeviceBuffer source(std::max<int64_t>(count, 1) * sizeof(float));
        DEFT_CUDA_CHECK(cudaMemcpy(source.data(), inputs[r].data(), count * sizeof(float),
                                   cudaMemcpyHostToDevice));
        const auto upload = [&] {
          if (count == 0) return;
          DEFT_CUDA_CHECK(cudaMemcpyAsync(x, source.data(), count * sizeof(float),
                                          cudaMemcpyDeviceToDevice, stream));
        };
        // Eager: three calls, each on fresh inputs.
        for (int call = 0; call < 3; ++call) {
          upload();
          launch_peer_all_reduce(table, r, x, count, stream);
        }
        // A graph of upload + reduce, replayed 20 times.
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        DEFT_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        upload();
        launch_peer_all_reduce(table, r, x, count, stream);
        DEFT_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
        DEFT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
        for (int replay = 0; replay < 20; ++replay) DEFT_CUDA_CHECK(cudaGraphLaunch(exec, stream));
        got[r].resize(count);
        DEFT_CUDA_CHECK(cudaMemcpyAsync(got[r].data(), x, count * sizeof(float),
                                        cudaMemcpyDeviceToHost, stream));
        DEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(graph);
        cudaStreamDestroy(stream);
      });
    }
    for (std::thread& thread : threads) thread.join();
    for (int r = 0; r < kRanks; ++r) {
      EXPECT_TRUE(got[r] == expected) << "rank " << r << ", " << count << " floats";
    }
  }
}

}  // namespace
}  // namespace deft::kernels
