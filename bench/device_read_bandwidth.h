// What this GPU's memory streams to its SMs, measured in the benchmark's own run: a kernel that
// reads a buffer larger than the L2 once (16-byte loads that evict first), timed with CUDA events,
// median after warm-up. The floors keep their fixed 3.0 TB/s (../shared/BENCH_RESULTS.md); this
// figure says how far the machine drawn for a run is from it, so runs on different machines (whose
// memory speeds differ by a few percent) can be compared.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace deft::bench {

// One read of [data, data + bytes) on `stream` (bytes a multiple of 16, data 16-byte aligned).
// `sink` (4 bytes of device memory) is written only if an impossible checksum comes up, which
// keeps the loads.
void launch_device_read(const void* data, size_t bytes, uint32_t* sink, cudaStream_t stream);

// One launch reading [a, a + bytes_each) and [b, b + bytes_each) (each as launch_device_read
// asks): what reading a layer's K and V costs a kernel that does nothing else.
void launch_device_read_pair(const void* a, const void* b, size_t bytes_each, uint32_t* sink,
                             cudaStream_t stream);

// Bytes per second of launch_device_read over a fresh buffer of `bytes` (filled, not zeros),
// median of `reps` timed reads after 3 untimed ones (bench/graph_timing.h, one read a replay).
double measure_device_read_bytes_per_s(size_t bytes = size_t{2} << 30, int reps = 20);

// measure_device_read_bytes_per_s() with its defaults, printed in one line beside the floor's
// fixed bandwidth (what the benches run first).
double measure_and_print_device_read_bandwidth();

}  // namespace deft::bench
