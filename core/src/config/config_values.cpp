#include "config_values.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <algorithm>

#include <fmt/core.h>

namespace hpctrial::core::detail {

MapReader::MapReader(const ConfigNode* node, std::string path, Diagnostics& diagnostics)
    : node_(node), path_(std::move(path)), diagnostics_(diagnostics) {}

const ConfigNode* MapReader::get(const std::string& key) {
  known_.push_back(key);
  if (!present()) return nullptr;
  return node_->find(key);
}

const ConfigNode* MapReader::require(const std::string& key, const std::string& example) {
  const ConfigNode* value = get(key);
  if (value == nullptr && (present() || node_ == nullptr)) {
    diagnostics_.error(where(), path(key),
                       "required key is missing; add it, e.g. `" + example + "`");
  }
  return value;
}

SourceLocation MapReader::where() const { return node_ != nullptr ? node_->where() : SourceLocation{}; }

std::vector<ConfigEntry> MapReader::rest() const {
  std::vector<ConfigEntry> unread;
  if (!present()) return unread;
  for (const auto& entry : node_->entries()) {
    if (std::find(known_.begin(), known_.end(), entry.key) == known_.end()) unread.push_back(entry);
  }
  return unread;
}

void MapReader::finish() {
  for (const auto& entry : rest()) diagnostics_.error(entry.key_where, path(entry.key), unknown_key(entry.key, known_));
}

void report(const ConfigNode& node, const std::string& path, Diagnostics& d, std::string message) {
  d.error(node.where(), path, std::move(message));
}

std::string describe(const ConfigNode& node) {
  if (node.is_scalar()) {
    std::string text = node.text();
    if (text.size() > 60) text = text.substr(0, 57) + "...";
    std::string escaped;
    for (char c : text) {
      if (c == '\n') escaped += "\\n";
      else if (c == '"') escaped += "\\\"";
      else escaped.push_back(c);
    }
    return "\"" + escaped + "\"";
  }
  return node.kind_name();
}

bool expect_map(const ConfigNode& node, const std::string& path, Diagnostics& d,
                const std::string& example) {
  if (node.is_map()) return true;
  std::string message = "must be a map, got " + describe(node);
  if (!example.empty()) message += "; e.g. `" + example + "`";
  report(node, path, d, message);
  return false;
}

std::optional<std::string> read_string(const ConfigNode& node, const std::string& path,
                                       Diagnostics& d, bool allow_empty) {
  if (!node.is_scalar()) {
    std::string message = "must be a string, got " + node.kind_name();
    if (node.is_null()) message += allow_empty ? "; write \"\" for an empty value" : " (an empty value)";
    report(node, path, d, message);
    return std::nullopt;
  }
  const std::string& text = node.text();
  if (text.empty() && !allow_empty) {
    report(node, path, d, "must not be empty");
    return std::nullopt;
  }
  for (char c : text) {
    const auto u = static_cast<unsigned char>(c);
    if ((u < 0x20 && c != '\t') || u == 0x7f) {
      report(node, path, d,
             "contains a control character (newline, carriage return or similar); "
             "write it on one line");
      return std::nullopt;
    }
  }
  return text;
}

std::optional<std::int64_t> parse_int(const std::string& text) {
  std::size_t i = 0;
  if (i < text.size() && (text[i] == '+' || text[i] == '-')) ++i;
  if (i == text.size()) return std::nullopt;
  for (std::size_t j = i; j < text.size(); ++j) {
    if (text[j] < '0' || text[j] > '9') return std::nullopt;
  }
  errno = 0;
  char* end = nullptr;
  const long long value = std::strtoll(text.c_str(), &end, 10);
  if (errno == ERANGE || end != text.c_str() + text.size()) return std::nullopt;
  return static_cast<std::int64_t>(value);
}

std::optional<double> parse_double(const std::string& text) {
  if (text.empty()) return std::nullopt;
  for (char c : text) {
    const bool ok = (c >= '0' && c <= '9') || c == '.' || c == 'e' || c == 'E' || c == '+' ||
                    c == '-';
    if (!ok) return std::nullopt;  // rejects nan, inf, hex floats, .nan, .inf
  }
  errno = 0;
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  if (end != text.c_str() + text.size() || errno == ERANGE || !std::isfinite(value)) {
    return std::nullopt;
  }
  return value;
}

namespace {

bool looks_non_finite(const std::string& text) {
  std::string lower;
  for (char c : text) lower.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  while (!lower.empty() && (lower[0] == '+' || lower[0] == '-' || lower[0] == '.')) lower.erase(0, 1);
  return lower == "nan" || lower == "inf" || lower == "infinity";
}

std::string quoted_hint(const ConfigNode& node, const std::string& type) {
  return "must be " + type + ", got the string " + describe(node) + " (remove the quotes)";
}

}  // namespace

std::optional<std::int64_t> read_int(const ConfigNode& node, const std::string& path,
                                     Diagnostics& d, std::int64_t min, std::int64_t max) {
  const std::string kind = min == 1 ? "a positive integer" : min == 0 ? "a non-negative integer"
                                                                      : "an integer";
  if (!node.is_scalar()) {
    report(node, path, d, "must be " + kind + ", got " + describe(node));
    return std::nullopt;
  }
  std::optional<std::int64_t> value = parse_int(node.text());
  if (value && node.quoted()) {
    report(node, path, d, quoted_hint(node, kind));
    return std::nullopt;
  }
  if (!value) {
    const auto as_double = parse_double(node.text());
    if (as_double && std::floor(*as_double) == *as_double && std::fabs(*as_double) < 9.2e18 &&
        !node.quoted() && node.text().find_first_of("eE") != std::string::npos) {
      value = static_cast<std::int64_t>(*as_double);  // 1e6 is an integer
    } else if (!node.quoted() && looks_non_finite(node.text())) {
      report(node, path, d, "must be " + kind + ", got " + describe(node) + " (not a finite number)");
      return std::nullopt;
    } else {
      report(node, path, d, "must be " + kind + ", got " + describe(node));
      return std::nullopt;
    }
  }
  if (*value < min) {
    report(node, path, d,
           "must be " + (min <= 1 && min >= 0 ? kind : "at least " + std::to_string(min)) +
               ", got " + describe(node));
    return std::nullopt;
  }
  if (*value > max) {
    report(node, path, d, "must be at most " + std::to_string(max) + ", got " + describe(node));
    return std::nullopt;
  }
  return value;
}

std::optional<double> read_double(const ConfigNode& node, const std::string& path, Diagnostics& d,
                                  double min, double max, bool min_exclusive) {
  if (!node.is_scalar()) {
    report(node, path, d, "must be a number, got " + describe(node));
    return std::nullopt;
  }
  const auto value = parse_double(node.text());
  if (value && node.quoted()) {
    report(node, path, d, quoted_hint(node, "a number"));
    return std::nullopt;
  }
  if (!value) {
    if (looks_non_finite(node.text())) {
      report(node, path, d, "must be a finite number, got " + describe(node));
    } else {
      report(node, path, d, "must be a number, got " + describe(node));
    }
    return std::nullopt;
  }
  if (min_exclusive ? *value <= min : *value < min) {
    const std::string bound = fmt::format("{}", min);
    report(node, path, d,
           "must be " + std::string(min_exclusive ? "greater than " : "at least ") + bound +
               ", got " + describe(node));
    return std::nullopt;
  }
  if (*value > max) {
    report(node, path, d, fmt::format("must be at most {}, got {}", max, describe(node)));
    return std::nullopt;
  }
  return value;
}

std::optional<bool> read_bool(const ConfigNode& node, const std::string& path, Diagnostics& d) {
  if (node.is_scalar() && !node.quoted()) {
    const std::string& t = node.text();
    if (t == "true" || t == "True" || t == "TRUE") return true;
    if (t == "false" || t == "False" || t == "FALSE") return false;
  }
  report(node, path, d, "must be true or false, got " + describe(node));
  return std::nullopt;
}

std::optional<std::vector<std::string>> read_string_list(const ConfigNode& node,
                                                         const std::string& path, Diagnostics& d) {
  if (node.is_null()) return std::vector<std::string>{};
  if (!node.is_sequence()) {
    report(node, path, d, "must be a list of strings, got " + describe(node) + "; e.g. [a, b]");
    return std::nullopt;
  }
  std::vector<std::string> out;
  bool ok = true;
  for (std::size_t i = 0; i < node.items().size(); ++i) {
    auto value = read_string(node.items()[i], path + "[" + std::to_string(i) + "]", d);
    if (value) {
      out.push_back(*value);
    } else {
      ok = false;
    }
  }
  if (!ok) return std::nullopt;
  return out;
}

}  // namespace hpctrial::core::detail
