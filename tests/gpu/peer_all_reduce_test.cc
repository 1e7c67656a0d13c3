// kernels/peer_all_reduce.h on two GPUs (skipped with fewer, or without peer access): every
// rank's thread reduces its random data, for counts from 0 to the capacity (tails past a float4
// too), once eagerly and then 20 times from a CUDA graph (the device-side call counters, the
// alternating staging halves), against the CPU twin's sum in rank order
// (models/host_collectives.h): bit for bit.
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
  constexpr int64_t kCapacity = 64 * 8192;
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
  const std::vector<int64_t> counts = {1, 7, 4096, 20 * 4096, 20 * 8192 + 2, kCapacity, 0, 33};
  for (int64_t count : counts) {
    std::vector<std::vector<float>> inputs(kRanks, std::vector<float>(count));
    for (auto& input : inputs) {
      for (float& v : input) v = normal(rng);
    }
    // One call sums the inputs; each further call sums equal data, doubling it: after the
    // eager call and kReplays graph replays, (a + b) * 2^kReplays, exact in fp32.
    constexpr int kReplays = 20;
    std::vector<float> once(count), replayed(count);
    for (int64_t i = 0; i < count; ++i) {
      once[i] = inputs[0][i] + inputs[1][i];
      replayed[i] = once[i] * static_cast<float>(1 << kReplays);
    }
    std::vector<std::vector<float>> got_once(kRanks), got_replayed(kRanks);
    std::vector<std::thread> threads;
    for (int r = 0; r < kRanks; ++r) {
      threads.emplace_back([&, r] {
        const DeviceScope on_device(r);
        cudaStream_t stream;
        DEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        float* x = data[r].as<float>();
        got_once[r].resize(count);
        got_replayed[r].resize(count);
        DEFT_CUDA_CHECK(
            cudaMemcpy(x, inputs[r].data(), count * sizeof(float), cudaMemcpyHostToDevice));
        launch_peer_all_reduce(table, r, x, count, stream);
        DEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
        DEFT_CUDA_CHECK(
            cudaMemcpy(got_once[r].data(), x, count * sizeof(float), cudaMemcpyDeviceToHost));
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        DEFT_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        launch_peer_all_reduce(table, r, x, count, stream);
        DEFT_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
        DEFT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
        for (int replay = 0; replay < kReplays; ++replay) {
          DEFT_CUDA_CHECK(cudaGraphLaunch(exec, stream));
        }
        DEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
        DEFT_CUDA_CHECK(
            cudaMemcpy(got_replayed[r].data(), x, count * sizeof(float), cudaMemcpyDeviceToHost));
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(graph);
        cudaStreamDestroy(stream);
      });
    }
    for (std::thread& thread : threads) thread.join();
    for (int r = 0; r < kRanks; ++r) {
      EXPECT_TRUE(got_once[r] == once) << "rank " << r << ", " << count << " floats";
      EXPECT_TRUE(got_replayed[r] == replayed) << "rank " << r << ", " << count << " floats";
    }
  }
}

}  // namespace
}  // namespace deft::kernels
