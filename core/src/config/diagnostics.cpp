#include "hpctrial/core/diagnostics.h"

#include <algorithm>

#include "hpctrial/core/error.h"

namespace hpctrial::core {

std::string SourceLocation::to_string() const {
  std::string text = file.empty() ? "<config>" : file;
  if (line > 0) {
    text += ":" + std::to_string(line);
    if (column > 0) text += ":" + std::to_string(column);
  }
  return text;
}

std::string Diagnostic::to_string() const {
  std::string text = where.to_string() + ": ";
  if (!key_path.empty()) text += key_path + ": ";
  return text + message;
}

void Diagnostics::error(SourceLocation where, std::string key_path, std::string message) {
  items_.push_back({std::move(where), std::move(key_path), std::move(message)});
}

void Diagnostics::sort() {
  std::vector<std::string> files;
  for (const auto& item : items_) {
    if (std::find(files.begin(), files.end(), item.where.file) == files.end()) {
      files.push_back(item.where.file);
    }
  }
  auto file_rank = [&](const std::string& file) {
    return std::find(files.begin(), files.end(), file) - files.begin();
  };
  std::stable_sort(items_.begin(), items_.end(), [&](const Diagnostic& a, const Diagnostic& b) {
    const auto fa = file_rank(a.where.file), fb = file_rank(b.where.file);
    if (fa != fb) return fa < fb;
    if (a.where.line != b.where.line) return a.where.line < b.where.line;
    return a.where.column < b.where.column;
  });
}

std::string Diagnostics::to_string() const {
  std::string text;
  for (const auto& item : items_) {
    if (!text.empty()) text.push_back('\n');
    text += item.to_string();
  }
  return text;
}

void Diagnostics::throw_if_any() const {
  if (!items_.empty()) throw ConfigError(to_string());
}

namespace {

// Optimal string alignment distance.
std::size_t edit_distance(const std::string& a, const std::string& b) {
  const std::size_t n = a.size(), m = b.size();
  std::vector<std::vector<std::size_t>> d(n + 1, std::vector<std::size_t>(m + 1));
  for (std::size_t i = 0; i <= n; ++i) d[i][0] = i;
  for (std::size_t j = 0; j <= m; ++j) d[0][j] = j;
  for (std::size_t i = 1; i <= n; ++i) {
    for (std::size_t j = 1; j <= m; ++j) {
      const std::size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
      }
    }
  }
  return d[n][m];
}

}  // namespace

std::string closest_match(const std::string& word, const std::vector<std::string>& candidates) {
  std::string best;
  std::size_t best_distance = 0;
  for (const auto& candidate : candidates) {
    const std::size_t distance = edit_distance(word, candidate);
    if (best.empty() || distance < best_distance) {
      best = candidate;
      best_distance = distance;
    }
  }
  // Close enough: about a third of the longer word ("cnt" -> "count", not "foo" -> "data").
  const std::size_t limit = (std::max(word.size(), best.size()) + 2) / 3;
  if (best.empty() || best_distance > limit) return "";
  return best;
}

std::string unknown_key(const std::string& key, const std::vector<std::string>& known) {
  const std::string suggestion = closest_match(key, known);
  if (!suggestion.empty()) return "unknown key; did you mean '" + suggestion + "'?";
  std::string message = "unknown key; the keys here are: ";
  for (std::size_t i = 0; i < known.size(); ++i) message += (i ? ", " : "") + known[i];
  return message;
}

}  // namespace hpctrial::core
