#include "models/default_model.h"

#include <cstdlib>
#include <system_error>
#include <vector>

#ifndef DEFT_SOURCE_MODEL_DIR
#define DEFT_SOURCE_MODEL_DIR "models/default"
#endif

namespace deft::models {

std::filesystem::path default_model_dir() {
  std::vector<std::filesystem::path> candidates;
  if (const char* dir = std::getenv("DEFT_DEFAULT_MODEL"); dir != nullptr && *dir != '\0') {
    candidates.emplace_back(dir);
  }
  std::error_code error;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", error);
  std::filesystem::path installed;
  if (!error) {
    installed = self.parent_path().parent_path() / "share" / "deft" / "models" / "default";
    candidates.push_back(installed);
  }
  candidates.emplace_back(DEFT_SOURCE_MODEL_DIR);
  candidates.emplace_back("models/default");
  for (const std::filesystem::path& candidate : candidates) {
    if (std::filesystem::exists(candidate / "config.json", error)) return candidate;
  }
  return installed.empty() ? std::filesystem::path(DEFT_SOURCE_MODEL_DIR) : installed;
}

}  // namespace deft::models
