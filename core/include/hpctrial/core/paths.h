// The one place where paths that come from users (configs, command lines) and from
// checkpoints are checked before hpctrial uses them.
//
// A path is refused when it is empty, longer than PATH_MAX, holds a control character (a
// newline would break generated scripts and log lines), or starts with '~' (hpctrial runs
// without a shell, so nothing would expand it). A relative path is made absolute against
// `base_dir`, and the result is lexically normalised (no "." or ".." parts).
// Throws ConfigError("<what>: <reason and fix>"). Pure; thread-safe.
#pragma once

#include <filesystem>
#include <string>
#include <string_view>

namespace hpctrial::core {

std::filesystem::path resolve_user_path(const std::string& text, const std::filesystem::path& base_dir,
                                        std::string_view what);

// True when `name` is a single path component with no separator and no "." or "..": safe to
// join to a directory (checkpoint file names read back from disk, trial ids).
bool is_safe_file_name(const std::string& name);

}  // namespace hpctrial::core
