#include "hpctrial/core/files.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
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

int FileSystem::open(const std::string& path, int flags, mode_t mode) { return ::open(path.c_str(), flags, mode); }
ssize_t FileSystem::pwrite(int fd, const void* data, std::size_t size, off_t offset) {
  return ::pwrite(fd, data, size, offset);
}
int FileSystem::fsync(int fd) { return ::fsync(fd); }
int FileSystem::close(int fd) { return ::close(fd); }
int FileSystem::rename(const std::string& from, const std::string& to) { return ::rename(from.c_str(), to.c_str()); }
int FileSystem::unlink(const std::string& path) { return ::unlink(path.c_str()); }
int FileSystem::flock(int fd, int operation) { return ::flock(fd, operation); }
int FileSystem::fcntl_lock(int fd, int command, struct ::flock* lock) { return ::fcntl(fd, command, lock); }

FileSystem& posix_file_system() {
  static FileSystem fs;
  return fs;
}

void publish_file(const std::string& temp, const std::string& path, FileSystem& fs) {
  if (fs.rename(temp, path) != 0) throw_errno("cannot rename " + temp + " to " + path, errno);
  const std::filesystem::path target(path);
  const std::string dir = target.has_parent_path() ? target.parent_path().string() : ".";
  const int dir_fd = fs.open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC, 0);
  const bool synced = dir_fd >= 0 && fs.fsync(dir_fd) == 0;
  const int sync_errno = errno;
  if (dir_fd >= 0) fs.close(dir_fd);
  if (!synced) throw_errno("cannot flush directory " + dir + " to disk after writing " + path, sync_errno);
}

void write_file_atomic(const std::string& path, std::string_view content, mode_t mode, FileSystem& fs) {
  static std::atomic<unsigned> counter{0};
  const std::filesystem::path target(path);
  const std::filesystem::path dir = target.has_parent_path() ? target.parent_path() : ".";
  std::string temp;
  int fd = -1;
  for (int attempt = 0; fd < 0; ++attempt) {
    char unique[32];
    std::snprintf(unique, sizeof unique, "%d-%u", static_cast<int>(::getpid()), counter++);
    temp = (dir / ("." + target.filename().string() + "." + unique + ".tmp")).string();
    fd = fs.open(temp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
    if (fd < 0 && (errno != EEXIST || attempt == 100)) {
      throw_errno("cannot create a temporary file in " + dir.string(), errno);
    }
  }
  bool published = false;
  struct Cleanup {
    FileSystem& fs;
    int fd;
    const std::string& temp;
    const bool& published;
    ~Cleanup() {
      if (fd >= 0) fs.close(fd);
      if (!published) fs.unlink(temp);
    }
  } cleanup{fs, fd, temp, published};

  if (::fchmod(fd, mode) != 0) throw_errno("cannot set the mode of " + temp, errno);  // whatever the umask
  for (std::size_t done = 0; done < content.size();) {
    const ssize_t n = fs.pwrite(fd, content.data() + done, content.size() - done, static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw_errno("cannot write " + temp, n < 0 ? errno : EIO);
    done += static_cast<std::size_t>(n);
  }
  if (fs.fsync(fd) != 0) throw_errno("cannot flush " + temp + " to disk", errno);
  cleanup.fd = -1;
  if (fs.close(fd) != 0) throw_errno("cannot close " + temp, errno);
  publish_file(temp, path, fs);
  published = true;
}

namespace {

// The errors of a filesystem without flock (Lustre without -o flock, NFS without its lock
// service).
bool flock_unsupported(int error) { return error == ENOSYS || error == EOPNOTSUPP || error == ENOLCK; }
// The same for open file description locks, and EINVAL: a kernel before 3.15, without them.
bool ofd_lock_unsupported(int error) { return flock_unsupported(error) || error == EINVAL; }

}  // namespace

namespace {

bool lock_file(int fd, const std::string& path, bool exclusive, LockWait wait, FileSystem& fs) {
  const bool block = wait == LockWait::kWait;
  int error = 0;
  for (;;) {
    if (fs.flock(fd, (exclusive ? LOCK_EX : LOCK_SH) | (block ? 0 : LOCK_NB)) == 0) return true;
    error = errno;
    if (error == EINTR) continue;
    if (error == EWOULDBLOCK && !block) return false;
    break;
  }
  if (!flock_unsupported(error)) throw_errno("cannot lock " + path, error);
  // No flock here: an open file description lock on the whole file, owned like a flock lock by
  // the open file description, so it conflicts with every other open of the file.
  for (;;) {
    struct ::flock whole {};
    whole.l_type = exclusive ? F_WRLCK : F_RDLCK;
    whole.l_whence = SEEK_SET;
    whole.l_start = 0;
    whole.l_len = 0;
    if (fs.fcntl_lock(fd, block ? F_OFD_SETLKW : F_OFD_SETLK, &whole) == 0) return true;
    const int ofd_error = errno;
    if (ofd_error == EINTR) continue;
    if ((ofd_error == EAGAIN || ofd_error == EACCES) && !block) return false;
    if (ofd_lock_unsupported(ofd_error)) {
      throw IoError("cannot lock " + path + ": its filesystem supports neither flock (" + std::strerror(error) +
                    ") nor open file description locks (" + std::strerror(ofd_error) +
                    "), so nothing would keep two hpctrial processes from using it at once; mount the filesystem "
                    "with `-o flock` (Lustre), or on NFS run its lock service (NFSv4, or rpc.statd for NFSv3) "
                    "or mount with `local_lock=flock` (locks on this node only)");
    }
    throw_errno("cannot lock " + path, ofd_error);
  }
}

}  // namespace

bool lock_file_exclusive(int fd, const std::string& path, LockWait wait, FileSystem& fs) {
  return lock_file(fd, path, /*exclusive=*/true, wait, fs);
}

bool lock_file_shared(int fd, const std::string& path, LockWait wait, FileSystem& fs) {
  return lock_file(fd, path, /*exclusive=*/false, wait, fs);
}

}  // namespace hpctrial::core
