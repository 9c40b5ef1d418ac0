#include "hpctrial/core/ignore_rules.h"

#include <sstream>

#include "hpctrial/core/error.h"

namespace hpctrial::core {
namespace {

// The regular expression of one glob (without '!', the trailing '/' or a leading '/'), matched
// against a whole relative path.
std::string glob_regex(const std::string& glob, bool anchored, const std::string& where) {
  std::string re = anchored ? "" : "(?:.*/)?";
  for (std::size_t i = 0; i < glob.size(); ++i) {
    const char c = glob[i];
    if (c == '*' && i + 1 < glob.size() && glob[i + 1] == '*' &&
        (i == 0 || glob[i - 1] == '/') && (i + 2 == glob.size() || glob[i + 2] == '/')) {
      if (i + 2 == glob.size()) {
        re += ".*";  // "/**": everything inside
      } else {
        re += "(?:.*/)?";  // "**/": any folders, none included
        ++i;
      }
      ++i;
    } else if (c == '*') {
      re += "[^/]*";
    } else if (c == '?') {
      re += "[^/]";
    } else if (c == '[') {
      const std::size_t close = glob.find(']', i + 2);
      if (close == std::string::npos) throw ConfigError(where + ": '[' without its ']'; write \\[ for the character");
      std::string set = glob.substr(i + 1, close - i - 1);
      if (!set.empty() && set[0] == '!') set[0] = '^';
      std::string escaped;
      for (char s : set) escaped += s == '\\' ? std::string("\\\\") : std::string(1, s);
      re += "[" + escaped + "]";
      i = close;
    } else {
      const char literal = c == '\\' && i + 1 < glob.size() ? glob[++i] : c;
      if (std::string(".^$|()+{}[]*?\\").find(literal) != std::string::npos) re += '\\';
      re += literal;
    }
  }
  return re;
}

}  // namespace

IgnoreRules::IgnoreRules(const std::string& text, const std::string& source) {
  std::istringstream lines(text);
  int number = 0;
  for (std::string line; std::getline(lines, line);) {
    ++number;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    // Trailing spaces are dropped unless escaped.
    while (!line.empty() && line.back() == ' ' && (line.size() < 2 || line[line.size() - 2] != '\\')) line.pop_back();
    if (line.empty() || line[0] == '#') continue;
    Rule rule;
    if (line[0] == '!') {
      rule.negated = true;
      line.erase(0, 1);
    } else if (line.rfind("\\!", 0) == 0 || line.rfind("\\#", 0) == 0) {
      line.erase(0, 1);
    }
    if (!line.empty() && line.back() == '/') {
      rule.folders_only = true;
      line.pop_back();
    }
    if (line.empty()) continue;
    const bool anchored = line.find('/') != std::string::npos;
    if (line[0] == '/') line.erase(0, 1);
    const std::string where = source + ":" + std::to_string(number);
    try {
      rule.pattern = std::regex(glob_regex(line, anchored, where), std::regex::ECMAScript | std::regex::optimize);
    } catch (const std::regex_error& e) {
      throw ConfigError(where + ": the pattern '" + line + "' cannot be read (" + e.what() + ")");
    }
    rules_.push_back(std::move(rule));
  }
}

bool IgnoreRules::ignored(const std::string& path, bool is_folder) const {
  bool ignored = false;
  for (const Rule& rule : rules_) {
    if (rule.folders_only && !is_folder) continue;
    if (std::regex_match(path, rule.pattern)) ignored = !rule.negated;
  }
  return ignored;
}

}  // namespace hpctrial::core
