// An LD_PRELOAD library that records every kernel a process runs, graph-launched ones included
// (CUPTI activity records: start / end on the GPU's clock), and writes them as CSV when the
// process exits. For the timeline of a decode step inside its CUDA graph, which the benchmarks'
// CUDA events cannot split (the programmatic launches overlap neighbouring kernels):
//
//   KERNEL_TIMELINE_OUT=steps.csv \
//   LD_PRELOAD=build/bench/kernel_timeline/libdeft_kernel_timeline.so \
//     build/bench/e2e_step_bench --case specdec_p6000_t64 --method deft_flatten --spec-steps 12
//   python3 bench/kernel_timeline/kernel_timeline.py steps.csv
//
// CSV columns: start_ns, end_ns, graph_id (0: not graph-launched), graph_node_id, grid (CTAs),
// block (threads), kernel name (demangled, without its parameter list). Recording adds a few
// percent to a step; the durations, not the step's total, are what it is for.
#include <cupti.h>
#include <cxxabi.h>

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

namespace {

struct KernelRecord {
  uint64_t start, end, graph_node;
  uint32_t graph;
  int64_t grid, block;
  std::string name;
};

// Leaked on purpose: CUPTI may deliver buffers until the last moment of the process.
std::mutex& records_mutex = *new std::mutex;
std::vector<KernelRecord>& records = *new std::vector<KernelRecord>;

std::string short_name(const char* mangled) {
  int status = 0;
  char* demangled = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  std::string name = demangled != nullptr ? demangled : mangled;
  std::free(demangled);
  const std::string anonymous = "(anonymous namespace)::";
  for (size_t at = name.find(anonymous); at != std::string::npos; at = name.find(anonymous)) {
    name.erase(at, anonymous.size());
  }
  if (const size_t params = name.find('('); params != std::string::npos) name.resize(params);
  if (name.rfind("void ", 0) == 0) name.erase(0, 5);
  for (char& c : name) {
    if (c == ',') c = ';';  // keeps the CSV's columns
  }
  return name;
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *size = size_t{8} << 20;
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, *size));
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  std::lock_guard<std::mutex> lock(records_mutex);
  CUpti_Activity* record = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    if (record->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) continue;
    const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
    records.push_back({k->start, k->end, k->graphNodeId, k->graphId,
                       int64_t{k->gridX} * k->gridY * k->gridZ,
                       int64_t{k->blockX} * k->blockY * k->blockZ, short_name(k->name)});
  }
  std::free(buffer);
}

struct Recorder {
  Recorder() {
    if (cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS ||
        cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS) {
      std::fprintf(stderr, "kernel_timeline: CUPTI refused to record kernels\n");
    }
  }
  ~Recorder() {
    cuptiActivityFlushAll(1);
    std::lock_guard<std::mutex> lock(records_mutex);
    // Helpers the library is preloaded into too (`timeout`, a shell) ran no kernel: no file.
    if (records.empty()) return;
    const char* path = std::getenv("KERNEL_TIMELINE_OUT");
    if (path == nullptr) path = "kernel_timeline.csv";
    FILE* out = std::fopen(path, "w");
    if (out == nullptr) {
      std::fprintf(stderr, "kernel_timeline: cannot write %s\n", path);
      return;
    }
    for (const KernelRecord& r : records) {
      std::fprintf(out, "%llu,%llu,%u,%llu,%lld,%lld,%s\n",
                   static_cast<unsigned long long>(r.start), static_cast<unsigned long long>(r.end),
                   r.graph, static_cast<unsigned long long>(r.graph_node),
                   static_cast<long long>(r.grid), static_cast<long long>(r.block), r.name.c_str());
    }
    std::fclose(out);
    std::fprintf(stderr, "kernel_timeline: %zu kernels -> %s\n", records.size(), path);
  }
} recorder;

}  // namespace
