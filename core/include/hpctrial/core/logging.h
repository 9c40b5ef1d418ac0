// Levelled logging to stderr, with a "[rank R]" prefix on training ranks.
//
// One line is one write(2), so lines from ranks and threads never interleave mid-line.
// Thread-safe. Never throws: a log call that cannot format or write drops the line.
//
//   hpctrial::core::log_info("restored {} from {}", step, path);
//
// The level comes from HPCTRIAL_LOG_LEVEL (debug, info, warning, error, off; default info)
// through init_logging(), or from set_log_level().
#pragma once

#include <fmt/core.h>

#include <string>
#include <string_view>
#include <utility>

namespace hpctrial::core {

class EnvSource;

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3, kOff = 4 };

// Parses "debug" | "info" | "warning" | "error" | "off" (case-insensitive); throws ConfigError
// naming the accepted values.
LogLevel parse_log_level(std::string_view text);
std::string_view to_string(LogLevel level);

void set_log_level(LogLevel level);
LogLevel log_level();
// A negative rank removes the prefix.
void set_log_rank(int rank);
// Reads HPCTRIAL_LOG_LEVEL from env; an invalid value is reported once and ignored.
void init_logging(const EnvSource& env);

bool log_enabled(LogLevel level);
void log_message(LogLevel level, std::string_view message) noexcept;

template <typename... Args>
void log(LogLevel level, fmt::format_string<Args...> format, Args&&... args) noexcept {
  if (!log_enabled(level)) return;
  try {
    log_message(level, fmt::format(format, std::forward<Args>(args)...));
  } catch (...) {
    // A formatting failure must not turn a log call into an error path.
  }
}

template <typename... Args>
void log_debug(fmt::format_string<Args...> format, Args&&... args) noexcept {
  log(LogLevel::kDebug, format, std::forward<Args>(args)...);
}
template <typename... Args>
void log_info(fmt::format_string<Args...> format, Args&&... args) noexcept {
  log(LogLevel::kInfo, format, std::forward<Args>(args)...);
}
template <typename... Args>
void log_warning(fmt::format_string<Args...> format, Args&&... args) noexcept {
  log(LogLevel::kWarning, format, std::forward<Args>(args)...);
}
template <typename... Args>
void log_error(fmt::format_string<Args...> format, Args&&... args) noexcept {
  log(LogLevel::kError, format, std::forward<Args>(args)...);
}

}  // namespace hpctrial::core
