// Typed reads of config values, each reporting a precise diagnostic. Internal to core.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "hpctrial/core/config_node.h"

namespace hpctrial::core::detail {

// A map being validated: get() marks a key as known; finish() reports every other key as
// unknown, with a did-you-mean among the known ones.
class MapReader {
 public:
  // `node` may be null (the section is absent): every get() then returns nullptr.
  MapReader(const ConfigNode* node, std::string path, Diagnostics& diagnostics);
  const ConfigNode* get(const std::string& key);
  // Like get(), and reports a missing key with an example of what to write.
  const ConfigNode* require(const std::string& key, const std::string& example);
  // The entries no get() or require() asked for, in the order written.
  std::vector<ConfigEntry> rest() const;
  // Reports each of rest() as an unknown key, with the closest known one.
  void finish();

  std::string path(const std::string& key) const { return path_.empty() ? key : path_ + "." + key; }
  const std::string& path() const { return path_; }
  SourceLocation where() const;
  bool present() const { return node_ != nullptr && node_->is_map(); }
  Diagnostics& diagnostics() { return diagnostics_; }

 private:
  const ConfigNode* node_;
  std::string path_;
  Diagnostics& diagnostics_;
  std::vector<std::string> known_;
};

// True when `node` is a map; otherwise reports "must be a map".
bool expect_map(const ConfigNode& node, const std::string& path, Diagnostics& d,
                const std::string& example = "");

std::optional<std::string> read_string(const ConfigNode& node, const std::string& path,
                                       Diagnostics& d, bool allow_empty = false);
std::optional<std::int64_t> read_int(const ConfigNode& node, const std::string& path,
                                     Diagnostics& d, std::int64_t min, std::int64_t max);
std::optional<double> read_double(const ConfigNode& node, const std::string& path, Diagnostics& d,
                                  double min, double max, bool min_exclusive);
std::optional<bool> read_bool(const ConfigNode& node, const std::string& path, Diagnostics& d);
std::optional<std::vector<std::string>> read_string_list(const ConfigNode& node,
                                                         const std::string& path, Diagnostics& d);

// Strict scalar parsing, no diagnostics: used where a value may be of several types.
std::optional<std::int64_t> parse_int(const std::string& text);
std::optional<double> parse_double(const std::string& text);

// Reports `message` at `node` under `path`.
void report(const ConfigNode& node, const std::string& path, Diagnostics& d, std::string message);
// "\"text\"" for a scalar, "a map" / "a list" / "null" otherwise: what the user wrote.
std::string describe(const ConfigNode& node);

}  // namespace hpctrial::core::detail
