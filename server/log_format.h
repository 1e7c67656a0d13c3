// The server's log lines: text (the default, for people) or JSON lines (--log-format json, for
// collectors: one object a line, {"time": UTC ISO 8601, "level", "msg", ...fields}). Structured
// events (a request's end, a refused call) carry fields: in text they follow the message as
// key=value, in JSON they are keys of the line's object. gRPC core's own log lines are routed
// here too, so a JSON log holds nothing but JSON lines.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <variant>

#include "spdlog/spdlog.h"

namespace deft::server {

// One field of a structured line. Strings are escaped as JSON needs (bytes that are not UTF-8
// become U+FFFD), so a client's text cannot forge a field or break a line.
struct LogField {
  std::string_view key;
  std::variant<std::string_view, int64_t, double> value;
};

// Installs the default logger on stderr: `format` "text" or "json", `level` as spdlog names it.
void configure_logging(const std::string& format, const std::string& level);

// Logs `message` with `fields` at `level` (nothing when the level is off).
void log_fields(spdlog::level::level_enum level, std::string_view message,
                std::initializer_list<LogField> fields);

// `text` as the body of a JSON string (no quotes), appended to `out`.
void append_json_escaped(std::string_view text, std::string& out);

}  // namespace deft::server
