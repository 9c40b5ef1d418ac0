#include "hpctrial/core/logging.h"

#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <ctime>

#include "hpctrial/core/env.h"
#include "hpctrial/core/error.h"

namespace hpctrial::core {
namespace {

std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};
std::atomic<int> g_rank{-1};

std::string lowercase(std::string_view text) {
  std::string out(text);
  for (char& c : out) {
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  }
  return out;
}

void write_all(int fd, const std::string& text) noexcept {
  const char* data = text.data();
  std::size_t left = text.size();
  while (left > 0) {
    const ssize_t n = ::write(fd, data, left);
    if (n < 0) {
      if (errno == EINTR) continue;
      return;
    }
    data += n;
    left -= static_cast<std::size_t>(n);
  }
}

}  // namespace

LogLevel parse_log_level(std::string_view text) {
  const std::string value = lowercase(text);
  if (value == "debug") return LogLevel::kDebug;
  if (value == "info") return LogLevel::kInfo;
  if (value == "warning" || value == "warn") return LogLevel::kWarning;
  if (value == "error") return LogLevel::kError;
  if (value == "off") return LogLevel::kOff;
  throw ConfigError("unknown log level \"" + std::string(text) +
                    "\"; use one of debug, info, warning, error, off");
}

std::string_view to_string(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug: return "debug";
    case LogLevel::kInfo: return "info";
    case LogLevel::kWarning: return "warning";
    case LogLevel::kError: return "error";
    case LogLevel::kOff: return "off";
  }
  return "unknown";
}

void set_log_level(LogLevel level) { g_level.store(static_cast<int>(level)); }
LogLevel log_level() { return static_cast<LogLevel>(g_level.load()); }
void set_log_rank(int rank) { g_rank.store(rank); }

void init_logging(const EnvSource& env) {
  const auto value = env.get("HPCTRIAL_LOG_LEVEL");
  if (!value || value->empty()) return;
  try {
    set_log_level(parse_log_level(*value));
  } catch (const ConfigError& e) {
    log_warning("HPCTRIAL_LOG_LEVEL: {}; keeping level {}", e.what(), to_string(log_level()));
  }
}

bool log_enabled(LogLevel level) {
  return level != LogLevel::kOff && static_cast<int>(level) >= g_level.load();
}

void log_message(LogLevel level, std::string_view message) noexcept {
  try {
    const auto now = std::chrono::system_clock::now();
    const std::time_t seconds = std::chrono::system_clock::to_time_t(now);
    const auto millis =
        std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000;
    std::tm utc{};
    gmtime_r(&seconds, &utc);
    char stamp[32];
    std::strftime(stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%S", &utc);

    std::string line = fmt::format("{}.{:03d}Z [{}] ", stamp, static_cast<int>(millis), to_string(level));
    const int rank = g_rank.load();
    if (rank >= 0) line += fmt::format("[rank {}] ", rank);
    line.append(message.data(), message.size());
    line.push_back('\n');
    write_all(STDERR_FILENO, line);
  } catch (...) {
    // Logging never throws.
  }
}

}  // namespace hpctrial::core
