// Where a config value came from, and the list of problems found in a config.
//
// Validation does not stop at the first problem: it records each one as a Diagnostic (location,
// key path, message) and reports them all at once. Plain values; not thread-safe.
#pragma once

#include <string>
#include <vector>

namespace hpctrial::core {

// A place in a config source. `file` is a path, or a description such as
// "--set resources.slots_per_trial=4". Line and column are 1-based; 0 means unknown.
struct SourceLocation {
  std::string file;
  int line = 0;
  int column = 0;

  // "exp.yaml:14:5", "exp.yaml", or "--set a.b=1".
  std::string to_string() const;
};

struct Diagnostic {
  SourceLocation where;
  std::string key_path;  // "resources.slots_per_trial"; empty for whole-file problems
  std::string message;   // "must be a positive integer, got \"-2\""

  // "exp.yaml:14:5: resources.slots_per_trial: must be a positive integer, got \"-2\""
  std::string to_string() const;
};

class Diagnostics {
 public:
  void error(SourceLocation where, std::string key_path, std::string message);
  bool empty() const { return items_.empty(); }
  std::size_t size() const { return items_.size(); }
  const std::vector<Diagnostic>& items() const { return items_; }
  // Orders by position: files in order of first appearance, then line and column.
  void sort();
  // One diagnostic a line.
  std::string to_string() const;
  // Throws ConfigError with every diagnostic when there is at least one.
  void throw_if_any() const;

 private:
  std::vector<Diagnostic> items_;
};

// The candidate closest to `word` by edit distance (transpositions count as one edit), or ""
// when none is close enough to be a plausible typo.
std::string closest_match(const std::string& word, const std::vector<std::string>& candidates);
// "unknown key; did you mean 'type'?", or "unknown key; the keys here are: a, b" when none is close.
std::string unknown_key(const std::string& key, const std::vector<std::string>& known);

}  // namespace hpctrial::core
