#include "server/protobuf_log.h"

#include <google/protobuf/stubs/logging.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <map>
#include <mutex>
#include <string>
#include <utility>

namespace deft::server {
namespace {

using Clock = std::chrono::steady_clock;
constexpr std::chrono::minutes kLogInterval{1};

thread_local bool parse_error_logged = false;

struct SourceLine {
  Clock::time_point last_logged;
  int64_t held_back = 0;
};

std::mutex& lines_mutex() {
  static std::mutex mutex;
  return mutex;
}
std::map<std::pair<std::string, int>, SourceLine>& lines() {
  static std::map<std::pair<std::string, int>, SourceLine> by_source;
  return by_source;
}

void handle(google::protobuf::LogLevel level, const char* filename, int line,
            const std::string& message) {
  if (level >= google::protobuf::LOGLEVEL_ERROR) parse_error_logged = true;
  int64_t held_back = 0;
  if (level != google::protobuf::LOGLEVEL_FATAL) {
    std::lock_guard lock(lines_mutex());
    SourceLine& source = lines()[{filename, line}];
    const Clock::time_point now = Clock::now();
    if (source.last_logged != Clock::time_point{} && now - source.last_logged < kLogInterval) {
      ++source.held_back;
      return;
    }
    source.last_logged = now;
    held_back = std::exchange(source.held_back, 0);
  }
  const spdlog::level::level_enum spd_level =
      level >= google::protobuf::LOGLEVEL_ERROR     ? spdlog::level::err
      : level == google::protobuf::LOGLEVEL_WARNING ? spdlog::level::warn
                                                    : spdlog::level::info;
  if (held_back > 0) {
    spdlog::log(spd_level, "libprotobuf {}:{}: {} ({} more like it in the last minute not logged)",
                filename, line, message, held_back);
  } else {
    spdlog::log(spd_level, "libprotobuf {}:{}: {}", filename, line, message);
  }
}

}  // namespace

void route_protobuf_logs() { google::protobuf::SetLogHandler(&handle); }

bool take_protobuf_parse_error() { return std::exchange(parse_error_logged, false); }

}  // namespace deft::server
