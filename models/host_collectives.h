// The CPU twin of the NCCL collectives tensor parallelism uses (models/tensor_parallel.h), for
// ranks that are threads of one process: an all-reduce (sum, fp32) and an all-gather. The
// contract is NCCL's: every rank calls the same collectives in the same order with the same
// sizes, each from its own thread, and a call returns once every rank's data is in. Sums run in
// rank order (0, 1, ..., N-1) on every rank, so every rank holds the same bits.
#pragma once

#include <barrier>
#include <cstdint>
#include <span>
#include <vector>

namespace deft::models {

class HostCollectives {
 public:
  explicit HostCollectives(int32_t ranks);
  HostCollectives(const HostCollectives&) = delete;
  HostCollectives& operator=(const HostCollectives&) = delete;

  int32_t ranks() const { return static_cast<int32_t>(send_.size()); }
  // data = the sum over ranks of every rank's data (same size on every rank).
  void all_reduce_sum(int32_t rank, std::span<float> data);
  // received = [ranks][send.size()]: rank r's send at r * send.size().
  void all_gather(int32_t rank, std::span<const float> send, std::span<float> received);

 private:
  std::barrier<> barrier_;
  std::vector<const float*> send_;  // each rank's input of the collective in flight
};

}  // namespace deft::models
