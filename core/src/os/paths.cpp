#include "hpctrial/core/paths.h"

#include <climits>

#include "hpctrial/core/error.h"

namespace hpctrial::core {

std::filesystem::path resolve_user_path(const std::string& text, const std::filesystem::path& base_dir,
                                        std::string_view what) {
  const std::string where(what);
  if (text.empty()) throw ConfigError(where + ": the path is empty");
  if (text.size() >= PATH_MAX) {
    throw ConfigError(where + ": the path is " + std::to_string(text.size()) +
                      " characters; paths are limited to " + std::to_string(PATH_MAX - 1));
  }
  for (char c : text) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f) {
      throw ConfigError(where + ": the path holds a control character (newline, tab or similar); "
                                "rename the directory");
    }
  }
  if (text.front() == '~') {
    throw ConfigError(where + ": \"" + text + "\" starts with '~', which hpctrial does not "
                              "expand (there is no shell); write the full path, e.g. /home/you/...");
  }
  std::filesystem::path path(text);
  if (path.is_relative()) path = std::filesystem::absolute(base_dir) / path;
  return path.lexically_normal();
}

bool is_safe_file_name(const std::string& name) {
  if (name.empty() || name == "." || name == ".." || name.size() > NAME_MAX) return false;
  for (char c : name) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '/' || u < 0x20 || u == 0x7f) return false;
  }
  return true;
}

}  // namespace hpctrial::core
