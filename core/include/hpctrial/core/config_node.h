// A YAML document as a plain tree whose every node knows where it came from.
//
// Config files, templates and --set overrides are parsed into ConfigNode trees, merged, and
// only then validated against the experiment schema, so that every error can name the file,
// line and column of the offending value - also after a merge.
//
// Parsing is defensive: the text size is capped, duplicate keys and non-string keys are
// errors, nesting deeper than kMaxConfigDepth and aliases that expand beyond kMaxConfigNodes
// are rejected before they cost time or memory. Plain values; not thread-safe.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "hpctrial/core/diagnostics.h"

namespace hpctrial::core {

inline constexpr std::size_t kMaxConfigBytes = 1u << 20;  // 1 MiB
inline constexpr int kMaxConfigDepth = 64;
inline constexpr std::size_t kMaxConfigNodes = 100000;

struct ConfigEntry;

class ConfigNode {
 public:
  enum class Kind { kNull, kScalar, kSequence, kMap };

  static ConfigNode null(SourceLocation where = {});
  static ConfigNode scalar(std::string text, SourceLocation where = {}, bool quoted = false);
  static ConfigNode sequence(SourceLocation where = {});
  static ConfigNode map(SourceLocation where = {});

  Kind kind() const { return kind_; }
  bool is_null() const { return kind_ == Kind::kNull; }
  bool is_scalar() const { return kind_ == Kind::kScalar; }
  bool is_sequence() const { return kind_ == Kind::kSequence; }
  bool is_map() const { return kind_ == Kind::kMap; }
  // "null", "a string", "a list", "a map": for messages.
  std::string kind_name() const;

  const std::string& text() const { return text_; }
  // True when the scalar was written in quotes ("4" is a string, 4 is a number).
  bool quoted() const { return quoted_; }
  const SourceLocation& where() const { return where_; }

  const std::vector<ConfigNode>& items() const { return items_; }
  std::vector<ConfigNode>& items() { return items_; }
  const std::vector<ConfigEntry>& entries() const { return entries_; }
  std::vector<ConfigEntry>& entries() { return entries_; }

  // Map lookup; nullptr when absent or when this is not a map.
  const ConfigNode* find(std::string_view key) const;
  ConfigNode* find(std::string_view key);
  // Sets (replacing) or appends a map entry. Requires is_map().
  ConfigNode& set(const std::string& key, ConfigNode value, SourceLocation key_where = {});

  // Marks this node and everything below it as coming from `where` (a command-line value).
  void relocate(const SourceLocation& where);

  // This node as YAML text (block style), quoting preserved.
  std::string to_yaml() const;

 private:
  Kind kind_ = Kind::kNull;
  std::string text_;
  bool quoted_ = false;
  SourceLocation where_;
  std::vector<ConfigNode> items_;
  std::vector<ConfigEntry> entries_;
};

struct ConfigEntry {
  std::string key;
  SourceLocation key_where;
  ConfigNode value;
};

// Parses YAML text holding one document. Problems go to `diagnostics`; the result is then a
// best-effort tree (possibly null). `source` names the text in messages (a path, or "--set ...").
ConfigNode parse_config_text(std::string_view text, const std::string& source,
                             Diagnostics& diagnostics);

// Reads and parses a file, refusing files larger than kMaxConfigBytes before reading them.
ConfigNode load_config_file(const std::string& path, Diagnostics& diagnostics);

// Determined's template merge: maps merge recursively, lists concatenate (template items
// first), and for anything else the config's value wins.
ConfigNode merge_template(const ConfigNode& template_root, const ConfigNode& config_root);

// Applies one "key.path=value" override to `root` (a map). The value is YAML, so
// `--set scheduler.modules=[gcc/12,openmpi]` sets a list. Missing maps on the path are
// created; a path through a non-map is reported to `diagnostics`.
void apply_override(ConfigNode& root, std::string_view assignment, Diagnostics& diagnostics);

}  // namespace hpctrial::core
