// Writes benchmark results in the format of ../shared/BENCH_RESULTS.md: one JSON file per run,
// bench/results/<benchmark>-<hardware>-<yyyymmdd>.json, made by the program itself.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"

namespace deft::bench {

struct Samples {
  double median = 0, p10 = 0, p90 = 0;
};
Samples summarize(std::vector<double> samples);

struct ResultRow {
  std::string case_name;
  std::string method;
  double median_us = 0, p10_us = 0, p90_us = 0;
  int64_t repetitions = 0;
  int64_t kv_bytes = 0;
  double floor_us = 0;  // 0: no floor for this benchmark
  nlohmann::json extra = nlohmann::json::object();

  // median_us, p10_us and p90_us from samples in µs.
  void set_times(const Samples& us) {
    median_us = us.median;
    p10_us = us.p10;
    p90_us = us.p90;
  }
};

class BenchResult {
 public:
    // `hardware_tag` names the file (e.g. "cpu", "h100"); `hardware` is the full name.
  BenchResult(std::string benchmark, std::string hardware, std::string hardware_tag, int argc,
              char** argv);
  void add(ResultRow row) { rows_.push_back(std::move(row)); }
  // Writes the file into <source>/bench/results/ (or `dir`, made if missing) and returns its
  // path; exits the program with the reason if the file cannot be written.
  std::string write(const std::string& dir = "") const;

  static std::string cpu_name();  // "model name" of /proc/cpuinfo
  // The file-name tag of `gpus` GPUs named `gpu_name` by the driver: the first word of the name
  // (words split at spaces and dashes) with a digit in it, in lower case ("NVIDIA H100 80GB
  // HBM3" -> "h100", "NVIDIA A100-SXM4-80GB" -> "a100"), "x<gpus>" appended for more than one
  // ("h200x2"); "gpu" when no word has a digit.
  static std::string gpu_tag(const std::string& gpu_name, int gpus = 1);
  static constexpr double kHbmBytesPerS = 3.0e12;
  static constexpr double kFlopsPerS = 7.0e14;
  // The floor of work that reads `bytes` and does `flops`: max(bytes / bandwidth, flops /
  // kFlopsPerS), in µs; the bandwidth is kHbmBytesPerS unless a measured one is given.
  static double floor_us(double bytes, double flops, double bytes_per_s = kHbmBytesPerS) {
    return std::max(bytes / bytes_per_s, flops / kFlopsPerS) * 1e6;
  }

 private:
  std::string benchmark_, hardware_, hardware_tag_, command_;
  std::vector<ResultRow> rows_;
};

}  // namespace deft::bench
