// The one function that puts text into generated shell scripts.
//
// shell_quote() returns a single POSIX-shell word (bash, dash, ksh) that expands to exactly
// `value`, byte for byte: words made only of [A-Za-z0-9_@%+=:,./-] are returned as they are,
// anything else is wrapped in single quotes, with each ' written as '\''. Inside single quotes
// no character is special ($, `, \, !, #, newlines, non-ASCII bytes all stay literal), so no
// value can run a command.
//
// A value holding a NUL byte cannot be any shell word: it is rejected with ConfigError naming
// `what` (a config key path, say). Thread-safe; pure.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace hpctrial::core {

std::string shell_quote(std::string_view value, std::string_view what = "value");

// Quotes each word and joins them with single spaces: a command line for a script.
std::string shell_join(const std::vector<std::string>& words, std::string_view what = "command");

}  // namespace hpctrial::core
