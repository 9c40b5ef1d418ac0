// Durations and memory sizes as users write them in configs.
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <fmt/core.h>

#include "config_values.h"
#include "hpctrial/core/experiment_config.h"

namespace hpctrial::core {
namespace {

std::optional<std::int64_t> digits(const std::string& text) {
  if (text.empty() || text.size() > 9) return std::nullopt;
  for (char c : text) {
    if (c < '0' || c > '9') return std::nullopt;
  }
  return std::stoll(text);
}

std::vector<std::string> split(const std::string& text, char separator) {
  std::vector<std::string> parts;
  std::size_t start = 0;
  while (true) {
    const std::size_t at = text.find(separator, start);
    parts.push_back(text.substr(start, at == std::string::npos ? std::string::npos : at - start));
    if (at == std::string::npos) return parts;
    start = at + 1;
  }
}

}  // namespace

std::optional<std::int64_t> parse_duration(const std::string& text, std::string* reason) {
  auto fail = [&](const std::string& why) -> std::optional<std::int64_t> {
    if (reason) *reason = why;
    return std::nullopt;
  };
  const std::string formats = "write e.g. 90s, 45m, 2h, 1d, 02:00:00 or 1-12:00:00";
  if (text.empty()) return fail("is empty; " + formats);

  // A number with a unit: 90s, 45m, 2h, 1d.
  const char unit = text.back();
  if (unit == 's' || unit == 'm' || unit == 'h' || unit == 'd') {
    const auto value = digits(text.substr(0, text.size() - 1));
    if (!value) return fail("is not a duration; " + formats);
    const std::int64_t scale = unit == 's' ? 1 : unit == 'm' ? 60 : unit == 'h' ? 3600 : 86400;
    return *value * scale;
  }
  if (digits(text)) {
    return fail("a bare number is ambiguous (Slurm reads minutes, PBS seconds); add a unit: " +
                formats);
  }

  // Slurm's forms: [D-]HH[:MM[:SS]] with a day part, or MM:SS / HH:MM:SS without one.
  std::int64_t days = 0;
  std::string clock = text;
  const std::size_t dash = text.find('-');
  if (dash != std::string::npos) {
    const auto d = digits(text.substr(0, dash));
    if (!d) return fail("is not a duration; " + formats);
    days = *d;
    clock = text.substr(dash + 1);
  }
  const auto parts = split(clock, ':');
  std::vector<std::int64_t> values;
  for (const auto& part : parts) {
    const auto v = digits(part);
    if (!v) return fail("is not a duration; " + formats);
    values.push_back(*v);
  }
  std::int64_t hours = 0, minutes = 0, seconds = 0;
  if (dash != std::string::npos) {
    if (values.size() > 3) return fail("is not a duration; " + formats);
    hours = values[0];
    if (values.size() > 1) minutes = values[1];
    if (values.size() > 2) seconds = values[2];
  } else if (values.size() == 2) {
    minutes = values[0];
    seconds = values[1];
  } else if (values.size() == 3) {
    hours = values[0];
    minutes = values[1];
    seconds = values[2];
  } else {
    return fail("is not a duration; " + formats);
  }
  if (minutes >= 60 && (values.size() == 3 || dash != std::string::npos)) {
    return fail("has " + std::to_string(minutes) + " minutes; minutes must be below 60");
  }
  if (seconds >= 60) return fail("has " + std::to_string(seconds) + " seconds; seconds must be below 60");
  return ((days * 24 + hours) * 60 + minutes) * 60 + seconds;
}

std::string format_duration(std::int64_t seconds) {
  const std::int64_t days = seconds / 86400;
  const std::int64_t rest = seconds % 86400;
  const std::string clock =
      fmt::format("{:02d}:{:02d}:{:02d}", rest / 3600, (rest % 3600) / 60, rest % 60);
  return days > 0 ? fmt::format("{}-{}", days, clock) : clock;
}

std::optional<std::uint64_t> parse_memory(const std::string& text, std::string* reason) {
  auto fail = [&](const std::string& why) -> std::optional<std::uint64_t> {
    if (reason) *reason = why;
    return std::nullopt;
  };
  const std::string formats = "write e.g. 512M, 64G or 1.5T (binary units: 1G = 1024M)";
  std::size_t i = 0;
  while (i < text.size() && ((text[i] >= '0' && text[i] <= '9') || text[i] == '.')) ++i;
  const std::string number = text.substr(0, i);
  std::string suffix = text.substr(i);
  for (char& c : suffix) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  const auto value = detail::parse_double(number);
  if (number.empty() || !value) return fail("is not a memory size; " + formats);
  if (suffix.empty()) {
    return fail("has no unit (Slurm reads megabytes, PBS bytes); " + formats);
  }
  if (suffix.size() == 3 && suffix.substr(1) == "IB") suffix = suffix.substr(0, 1);
  if (suffix.size() == 2 && suffix[1] == 'B') suffix = suffix.substr(0, 1);
  double scale = 0;
  if (suffix == "K") scale = 1024.0;
  else if (suffix == "M") scale = 1024.0 * 1024;
  else if (suffix == "G") scale = 1024.0 * 1024 * 1024;
  else if (suffix == "T") scale = 1024.0 * 1024 * 1024 * 1024;
  else return fail("has an unknown unit \"" + text.substr(i) + "\"; " + formats);
  const double bytes = *value * scale;
  if (bytes > 1.0e18) return fail("is larger than any node; " + formats);
  return static_cast<std::uint64_t>(std::llround(bytes));
}

std::string format_memory(std::uint64_t bytes) {
  const char* units[] = {"K", "M", "G", "T"};
  std::uint64_t scale = 1024ull * 1024 * 1024 * 1024;
  for (int u = 3; u >= 0; --u, scale /= 1024) {
    if (bytes >= scale && bytes % scale == 0) return fmt::format("{}{}", bytes / scale, units[u]);
  }
  // Not a whole number of KiB: round up to whole MiB, as schedulers allocate.
  return fmt::format("{}M", (bytes + (1u << 20) - 1) >> 20);
}

}  // namespace hpctrial::core
