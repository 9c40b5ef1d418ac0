// The patterns of an ignore file (.hpctrialignore) in .gitignore's syntax, for the context folder
// an experiment freezes (frozen_code.h):
//   - a blank line, or one that starts with '#', is no pattern ("\#" starts a pattern with '#');
//   - '!' negates: a path the pattern matches is kept again (unless a folder above it is left out,
//     whose contents are never looked at);
//   - a trailing '/' matches folders only;
//   - a '/' at the start or in the middle anchors the pattern at the folder's root; without one,
//     it matches a name at any depth;
//   - '*' is any run of characters but '/', '?' one character but '/', "[a-z]" and "[!a-z]" a
//     class; "**/" leads through any folders, "/**" is everything inside, "a/**/b" any folders
//     between;
//   - the last pattern that matches a path decides.
#pragma once

#include <regex>
#include <string>
#include <vector>

namespace hpctrial::core {

class IgnoreRules {
 public:
  IgnoreRules() = default;
  // `text`: the file's contents; `source` names it in messages. ConfigError naming the source
  // and line for a pattern that cannot be read (an unclosed '[').
  IgnoreRules(const std::string& text, const std::string& source);

  // Whether `path` (relative to the root, '/'-separated, no leading '/') is left out.
  bool ignored(const std::string& path, bool is_folder) const;
  bool empty() const { return rules_.empty(); }

 private:
  struct Rule {
    std::regex pattern;
    bool negated = false;
    bool folders_only = false;
  };
  std::vector<Rule> rules_;
};

}  // namespace hpctrial::core
