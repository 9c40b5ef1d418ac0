#include "hpctrial/core/files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <utility>
#include <vector>

#include "hpctrial/core/error.h"

namespace hpctrial::core {
UniqueFd::~UniqueFd() {
  if (fd_ >= 0) ::close(fd_);
}

UniqueFd& UniqueFd::operator=(UniqueFd&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.release();
  }
  return *this;
}

void write_fully(int fd, std::string_view data, const std::string& what) {
  while (!data.empty()) {
    const ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_errno("cannot write " + what, errno);
    }
    data.remove_prefix(static_cast<std::size_t>(n));
  }
}

void create_directories(const std::string& path, mode_t mode) {
  namespace fs = std::filesystem;
  std::error_code ec;
  std::vector<fs::path> missing;
  for (fs::path p = fs::absolute(path); !p.empty() && !fs::exists(p, ec); p = p.parent_path()) {
    missing.push_back(p);
    if (p == p.parent_path()) break;
  }
  for (auto it = missing.rbegin(); it != missing.rend(); ++it) {
    if (::mkdir(it->c_str(), mode) != 0) {
      if (errno == EEXIST) continue;  // made by another process meanwhile: its mode is its own
      throw_errno("cannot create the directory " + it->string(), errno);
    }
    if (::chmod(it->c_str(), mode) != 0) throw_errno("cannot set the mode of " + it->string(), errno);
  }
  if (!fs::is_directory(path, ec)) throw IoError(path + " exists but is not a directory");
}

void write_file_atomic(const std::string& path, std::string_view content, mode_t mode) {
  const std::filesystem::path target(path);
  const std::filesystem::path dir = target.has_parent_path() ? target.parent_path() : ".";
  std::string temp = (dir / ("." + target.filename().string() + ".tmp-XXXXXX")).string();

  UniqueFd fd(::mkstemp(temp.data()));
  if (fd.get() < 0) throw_errno("cannot create a temporary file in " + dir.string(), errno);
  bool published = false;
  struct Cleanup {
    const std::string& temp;
    const bool& published;
    ~Cleanup() {
      if (!published) ::unlink(temp.c_str());
    }
  } cleanup{temp, published};

  if (::fchmod(fd.get(), mode) != 0) throw_errno("cannot set the mode of " + temp, errno);
  write_fully(fd.get(), content, temp);
  if (::fsync(fd.get()) != 0) throw_errno("cannot flush " + temp + " to disk", errno);
  if (::close(fd.release()) != 0) throw_errno("cannot close " + temp, errno);
  if (::rename(temp.c_str(), path.c_str()) != 0) {
    throw_errno("cannot rename " + temp + " to " + path, errno);
  }
  published = true;

  UniqueFd dir_fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dir_fd.get() < 0 || ::fsync(dir_fd.get()) != 0) {
    throw_errno("cannot flush directory " + dir.string() + " to disk after writing " + path, errno);
  }
}

}  // namespace hpctrial::core
