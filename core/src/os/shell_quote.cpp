#include "hpctrial/core/shell_quote.h"

#include "hpctrial/core/error.h"

namespace hpctrial::core {
namespace {

bool is_plain_char(char c) {
  if ((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9')) return true;
  switch (c) {
    case '_': case '@': case '%': case '+': case '=': case ':': case ',': case '.': case '/':
    case '-':
      return true;
    default:
      return false;
  }
}

}  // namespace

std::string shell_quote(std::string_view value, std::string_view what) {
  if (value.find('\0') != std::string_view::npos) {
    throw ConfigError(std::string(what) +
                      ": contains a NUL byte, which no shell word can hold; remove it");
  }
  if (value.empty()) return "''";

  bool plain = true;
  for (char c : value) plain = plain && is_plain_char(c);
  // A leading '=' or '-' is harmless for the shell, but '~' or '=' at word start can trigger
  // expansions in some shells (zsh '=cmd'); quote such words to stay on the safe side.
  if (plain && value.front() != '=') return std::string(value);

  std::string quoted;
  quoted.reserve(value.size() + 8);
  quoted.push_back('\'');
  for (char c : value) {
    if (c == '\'') {
      quoted += "'\\''";
    } else {
      quoted.push_back(c);
    }
  }
  quoted.push_back('\'');
  return quoted;
}

std::string shell_join(const std::vector<std::string>& words, std::string_view what) {
  std::string line;
  for (std::size_t i = 0; i < words.size(); ++i) {
    if (i > 0) line.push_back(' ');
    line += shell_quote(words[i], std::string(what) + "[" + std::to_string(i) + "]");
  }
  return line;
}

}  // namespace hpctrial::core
