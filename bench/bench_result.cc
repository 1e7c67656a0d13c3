#include "bench/bench_result.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace deft::bench {
namespace {

std::string run_command(const std::string& command) {
  std::array<char, 256> buffer{};
  std::string out;
  if (FILE* pipe = popen(command.c_str(), "r")) {
    while (fgets(buffer.data(), buffer.size(), pipe)) out += buffer.data();
    pclose(pipe);
  }
  while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
  return out;
}

std::string today(const char* format) {
  std::time_t now = std::time(nullptr);
  std::array<char, 32> text{};
  std::strftime(text.data(), text.size(), format, std::gmtime(&now));
  return text.data();
}

}  // namespace

Samples summarize(std::vector<double> samples) {
  if (samples.empty()) return {};
  std::sort(samples.begin(), samples.end());
  auto at = [&](double q) { return samples[static_cast<size_t>(q * (samples.size() - 1) + 0.5)]; };
  return {at(0.5), at(0.1), at(0.9)};
}

BenchResult::BenchResult(std::string benchmark, std::string hardware, std::string hardware_tag,
                         int argc, char** argv)
    : benchmark_(std::move(benchmark)),
      hardware_(std::move(hardware)),
      hardware_tag_(std::move(hardware_tag)) {
  for (int i = 0; i < argc; ++i) command_ += (i ? " " : "") + std::string(argv[i]);
}

std::string BenchResult::cpu_name() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown CPU";
}

std::string BenchResult::gpu_tag(const std::string& gpu_name, int gpus) {
  std::string tag = "gpu";
  std::string spaced = gpu_name;  // "A100-SXM4-80GB": the model is the part before the dash
  std::replace(spaced.begin(), spaced.end(), '-', ' ');
  std::istringstream words(spaced);
  for (std::string word; words >> word;) {
    if (std::any_of(word.begin(), word.end(), [](unsigned char c) { return std::isdigit(c); })) {
      tag.clear();
      for (unsigned char c : word) {
        if (std::isalnum(c)) tag += static_cast<char>(std::tolower(c));
      }
      break;
    }
  }
  return gpus > 1 ? tag + "x" + std::to_string(gpus) : tag;
}

std::string BenchResult::write(const std::string& dir) const {
  nlohmann::json json;
  json["benchmark"] = benchmark_;
  json["hardware"] = hardware_;
  // DEFT_COMMIT names the commit of a binary that runs away from its checkout (a GPU machine).
  const char* commit_env = std::getenv("DEFT_COMMIT");
  std::string commit = commit_env != nullptr
                           ? std::string(commit_env)
                           : run_command("git -C " DEFT_SOURCE_DIR " rev-parse HEAD 2>/dev/null");
  if (commit_env == nullptr &&
      !run_command("git -C " DEFT_SOURCE_DIR " status --porcelain --untracked-files=no -- . :!bench/results 2>/dev/null")
           .empty()) {
    commit += "-dirty";
  }
  json["commit"] = commit.empty() ? "unknown" : commit;
  json["date"] = today("%Y-%m-%d");
  json["command"] = command_;
  json["floor"] = {{"hbm_bytes_per_s", kHbmBytesPerS}, {"flops_per_s", kFlopsPerS}};
  json["rows"] = nlohmann::json::array();
  for (const ResultRow& row : rows_) {
    nlohmann::json r = {{"case", row.case_name},       {"method", row.method},
                        {"median_us", row.median_us},  {"p10_us", row.p10_us},
                        {"p90_us", row.p90_us},        {"repetitions", row.repetitions},
                        {"kv_bytes", row.kv_bytes},    {"extra", row.extra}};
    if (row.floor_us > 0) {
      r["floor_us"] = row.floor_us;
      r["ratio_to_floor"] = row.median_us / row.floor_us;
    }
    json["rows"].push_back(r);
  }
  const std::string folder = dir.empty() ? std::string(DEFT_SOURCE_DIR) + "/bench/results" : dir;
  const std::string path = folder + "/" + benchmark_ + "-" + hardware_tag_ + "-" + today("%Y%m%d") + ".json";
  // A missing folder is made; a file that cannot be written ends the run with the reason (it
  // used to print "wrote" all the same).
  std::error_code error;
  std::filesystem::create_directories(folder, error);
  std::ofstream file(path);
  file << json.dump(2) << "\n";
  file.close();
  if (error || !file) {
    std::fprintf(stderr, "cannot write %s%s%s\n", path.c_str(), error ? ": " : "",
                 error ? error.message().c_str() : "");
    std::exit(1);
  }
  return path;
}

}  // namespace deft::bench
