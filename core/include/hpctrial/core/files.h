// Publishing a file so that readers see either the old content or the new, never a mix.
//
// write_file_atomic() writes `content` to a temporary file beside `path` (same directory, so
// the rename cannot cross filesystems), fsyncs it, renames it over `path`, and fsyncs the
// directory so the rename itself survives a crash. The file gets `mode` (default 0600: files
// hpctrial writes are private unless said otherwise). On failure the temporary file is removed
// and IoError names the path and the system's reason. Thread-safe for distinct paths.
#pragma once

#include <sys/types.h>

#include <string>
#include <string_view>

namespace hpctrial::core {

// A file descriptor closed on scope exit unless release()d. Move-only.
class UniqueFd {
 public:
  explicit UniqueFd(int fd = -1) : fd_(fd) {}
  ~UniqueFd();
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept;
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  int get() const { return fd_; }
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_;
};

void write_file_atomic(const std::string& path, std::string_view content, mode_t mode = 0600);

// Creates `path` and any missing parent directories, each new one with exactly `mode` (default
// 0700: private), whatever the umask. Directories that already exist keep their mode. IoError
// names the directory that could not be made, and why.
void create_directories(const std::string& path, mode_t mode = 0700);

// Writes all of `data` to `fd`, retrying short writes and EINTR; IoError("cannot write
// <what>: <reason>") otherwise.
void write_fully(int fd, std::string_view data, const std::string& what);

}  // namespace hpctrial::core
