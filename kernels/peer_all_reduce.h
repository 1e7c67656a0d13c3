// One-shot all-reduce (sum, fp32, in place) over the GPUs of one process that reach each other's
// memory (peer access, NVLink), for the tensor-parallel residual all-reduces of decode-sized
// steps (models/tensor_parallel.h), where NCCL's ~8 us a call (H200 x2, 20 x 4096 floats) is
// latency, not bytes. One kernel, no host involvement: each rank stores its input into its slot
// of every rank's staging (remote stores over NVLink are posted, so their latency is paid once),
// signals every peer (a flag written into the peer's memory), waits for theirs, and sums its own
// slots in rank order: every rank ends with the same bits (the CPU twin:
// models/host_collectives.h). Work is split over kPeerAllReduceBlocks CTAs; CTA b of every rank
// meets CTA b of the others only (no grid-wide barrier). Per-CTA call counters live in device
// memory, so a CUDA graph replays the kernel as often as it likes; staging alternates between two
// halves by the counter, which with the kernels' stream order keeps a rank from overwriting a
// half a peer still reads (a peer that signalled call k has finished call k - 1 whole).
// Contract: every rank launches the same sequence of calls (same counts) on its stream; a
// rank's kernel waits for its peers', so all ranks must launch it (a missing rank hangs the
// others, as with any collective).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace deft::kernels {

inline constexpr int32_t kPeerAllReduceMaxRanks = 8;
inline constexpr int32_t kPeerAllReduceBlocks = 64;

// Bytes of one rank's buffer (flags, counters, two staging halves of `ranks` slots of
// `capacity` floats).
size_t peer_all_reduce_buffer_bytes(int32_t ranks, int64_t capacity);

// Every rank's buffer (device memory of that rank, zeroed before the first call, reachable from
// every other rank), the same table on every rank.
struct PeerAllReduceTable {
  int32_t ranks = 0;
  int64_t capacity = 0;  // floats one call may reduce
  void* buffers[kPeerAllReduceMaxRanks] = {};
};

// data[0, count) = the sum over ranks of every rank's data (count <= table.capacity; data
// 16-byte aligned), on `stream` of `rank`'s GPU.
void launch_peer_all_reduce(const PeerAllReduceTable& table, int32_t rank, float* data,
                            int64_t count, cudaStream_t stream);

}  // namespace deft::kernels
