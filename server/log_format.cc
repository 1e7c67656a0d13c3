#include "server/log_format.h"

#include <grpc/support/log.h>
#include <time.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>

#include "absl/strings/str_cat.h"
#include "spdlog/pattern_formatter.h"
#include "spdlog/sinks/stdout_color_sinks.h"

namespace deft::server {
namespace {

// The fields of the line being logged on this thread (log_fields sets them around one
// spdlog call; the stderr logger formats synchronously in the caller's thread).
thread_local const std::initializer_list<LogField>* current_fields = nullptr;
std::atomic<bool> json_lines{false};

// Bytes of a valid UTF-8 sequence starting at text[at], or 0.
size_t utf8_length(std::string_view text, size_t at) {
  const auto byte = [&](size_t i) { return static_cast<unsigned char>(text[i]); };
  const unsigned char lead = byte(at);
  size_t length = 0;
  uint32_t min = 0;
  if (lead >= 0xc2 && lead <= 0xdf) {
    length = 2;
    min = 0x80;
  } else if (lead >= 0xe0 && lead <= 0xef) {
    length = 3;
    min = 0x800;
  } else if (lead >= 0xf0 && lead <= 0xf4) {
    length = 4;
    min = 0x10000;
  } else {
    return 0;
  }
  if (at + length > text.size()) return 0;
  uint32_t code = lead & (0xff >> (length + 1));
  for (size_t i = 1; i < length; ++i) {
    if ((byte(at + i) & 0xc0) != 0x80) return 0;
    code = (code << 6) | (byte(at + i) & 0x3f);
  }
  if (code < min || code > 0x10ffff || (code >= 0xd800 && code <= 0xdfff)) return 0;
  return length;
}

void append_value(const LogField& field, bool json, std::string& out) {
  if (const auto* text = std::get_if<std::string_view>(&field.value)) {
    if (json) {
      out += '"';
      append_json_escaped(*text, out);
      out += '"';
    } else if (text->empty() || text->find_first_of(" \"=\n") != std::string_view::npos) {
      out += '"';
      append_json_escaped(*text, out);  // quoted text reads the same in both formats
      out += '"';
    } else {
      out += *text;
    }
  } else if (const auto* integer = std::get_if<int64_t>(&field.value)) {
    absl::StrAppend(&out, *integer);
  } else {
    char number[32];
    std::snprintf(number, sizeof(number), "%.3f", std::get<double>(field.value));
    out += number;
  }
}

// {"time":"2026-11-28T12:00:00.123Z","level":"info","msg":"...",<fields>}
class JsonFormatter final : public spdlog::formatter {
 public:
  void format(const spdlog::details::log_msg& msg, spdlog::memory_buf_t& dest) override {
    std::string line;
    line.reserve(128 + msg.payload.size());
    const auto since_epoch = msg.time.time_since_epoch();
    const time_t seconds = std::chrono::duration_cast<std::chrono::seconds>(since_epoch).count();
    const auto millis =
        std::chrono::duration_cast<std::chrono::milliseconds>(since_epoch).count() % 1000;
    tm utc{};
    gmtime_r(&seconds, &utc);
    char time_text[96];
    std::snprintf(time_text, sizeof(time_text), "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ",
                  utc.tm_year + 1900, utc.tm_mon + 1, utc.tm_mday, utc.tm_hour, utc.tm_min,
                  utc.tm_sec, static_cast<int>(millis));
    absl::StrAppend(&line, "{\"time\":\"", time_text, "\",\"level\":\"");
    const spdlog::string_view_t level = spdlog::level::to_string_view(msg.level);
    line.append(level.data(), level.size());
    line += "\",\"msg\":\"";
    append_json_escaped(std::string_view(msg.payload.data(), msg.payload.size()), line);
    line += '"';
    if (current_fields != nullptr) {
      for (const LogField& field : *current_fields) {
        line += ",\"";
        append_json_escaped(field.key, line);
        line += "\":";
        append_value(field, /*json=*/true, line);
      }
    }
    line += "}\n";
    dest.append(line.data(), line.data() + line.size());
  }
  std::unique_ptr<spdlog::formatter> clone() const override {
    return std::make_unique<JsonFormatter>();
  }
};

// gRPC core's log lines (errors by default: GRPC_VERBOSITY) through spdlog.
void grpc_log(gpr_log_func_args* args) {
  spdlog::level::level_enum level = spdlog::level::info;
  if (args->severity == GPR_LOG_SEVERITY_ERROR) level = spdlog::level::err;
  if (args->severity == GPR_LOG_SEVERITY_DEBUG) level = spdlog::level::debug;
  spdlog::log(level, "grpc: {} ({}:{})", args->message, args->file, args->line);
}

}  // namespace

void append_json_escaped(std::string_view text, std::string& out) {
  for (size_t at = 0; at < text.size();) {
    const auto c = static_cast<unsigned char>(text[at]);
    if (c >= 0x80) {
      if (const size_t length = utf8_length(text, at); length > 0) {
        out.append(text.substr(at, length));
        at += length;
      } else {
        out += "\\ufffd";
        ++at;
      }
      continue;
    }
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20 || c == 0x7f) {
          char escaped[8];
          std::snprintf(escaped, sizeof(escaped), "\\u%04x", c);
          out += escaped;
        } else {
          out += static_cast<char>(c);
        }
    }
    ++at;
  }
}

void configure_logging(const std::string& format, const std::string& level) {
  auto logger = spdlog::stderr_color_mt("deft");
  json_lines.store(format == "json");
  if (format == "json") {
    logger->set_formatter(std::make_unique<JsonFormatter>());
  } else {
    logger->set_formatter(
        std::make_unique<spdlog::pattern_formatter>("%Y-%m-%dT%H:%M:%S.%e %^%l%$ %v"));
  }
  spdlog::set_default_logger(std::move(logger));
  spdlog::set_level(spdlog::level::from_str(level));
  gpr_set_log_function(grpc_log);
}

void log_fields(spdlog::level::level_enum level, std::string_view message,
                std::initializer_list<LogField> fields) {
  spdlog::logger* logger = spdlog::default_logger_raw();
  if (!logger->should_log(level)) return;
  if (json_lines.load(std::memory_order_relaxed)) {
    // The formatter writes the fields as keys of the line's object.
    current_fields = &fields;
    logger->log(level, "{}", message);
    current_fields = nullptr;
    return;
  }
  std::string text(message);
  for (const LogField& field : fields) {
    text += ' ';
    text.append(field.key);
    text += '=';
    append_value(field, /*json=*/false, text);
  }
  logger->log(level, "{}", text);
}

}  // namespace deft::server
