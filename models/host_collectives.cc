#include "models/host_collectives.h"

#include <algorithm>

#include "kernels/check.h"

namespace deft::models {

HostCollectives::HostCollectives(int32_t ranks)
    : barrier_(ranks), send_(static_cast<size_t>(ranks), nullptr) {
  DEFT_CHECK(ranks >= 1, "HostCollectives: %d ranks", ranks);
}

void HostCollectives::all_reduce_sum(int32_t rank, std::span<float> data) {
  // Every rank sums every rank's input into its own scratch, then (after all have read) writes it.
  send_[static_cast<size_t>(rank)] = data.data();
  barrier_.arrive_and_wait();
  std::vector<float> sum(send_[0], send_[0] + data.size());
  for (size_t r = 1; r < send_.size(); ++r) {
    for (size_t i = 0; i < data.size(); ++i) sum[i] += send_[r][i];
  }
  barrier_.arrive_and_wait();
  std::copy(sum.begin(), sum.end(), data.begin());
}

void HostCollectives::all_gather(int32_t rank, std::span<const float> send,
                                 std::span<float> received) {
  DEFT_CHECK(received.size() == send.size() * send_.size(),
             "all_gather: %zu floats received for %zu sent by %zu ranks", received.size(),
             send.size(), send_.size());
  send_[static_cast<size_t>(rank)] = send.data();
  barrier_.arrive_and_wait();
  for (size_t r = 0; r < send_.size(); ++r) {
    std::copy(send_[r], send_[r] + send.size(), received.begin() + r * send.size());
  }
  barrier_.arrive_and_wait();
}

}  // namespace deft::models
