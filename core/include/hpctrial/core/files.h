// Files hpctrial writes: publishing a file so that readers see either the old content or the
// new, never a mix (the one way every part of hpctrial does it: small records, the checkpoint
// pointer, the checkpoints themselves), private directories, whole writes.
#pragma once

#include <fcntl.h>
#include <sys/types.h>

#include <cstddef>
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

// The system calls of a publication, as a seam: tests inject failures and crashes at any call
// (a full disk at the fsync, a crash between the rename and the directory's fsync).
class FileSystem {
 public:
  virtual ~FileSystem() = default;
  virtual int open(const std::string& path, int flags, mode_t mode);
  virtual ssize_t pwrite(int fd, const void* data, std::size_t size, off_t offset);
  virtual int fsync(int fd);
  virtual int close(int fd);
  virtual int rename(const std::string& from, const std::string& to);
  virtual int unlink(const std::string& path);
  // The two ways to lock a file (lock_file_exclusive): flock(2), and fcntl(2) with
  // F_OFD_SETLK / F_OFD_SETLKW.
  virtual int flock(int fd, int operation);
  virtual int fcntl_lock(int fd, int command, struct ::flock* lock);
};
FileSystem& posix_file_system();

// The last step of every publication: renames `temp`, complete and fsynced, over `path` (the
// same directory, so the rename cannot cross filesystems), then fsyncs the directory so that the
// rename itself survives a crash. IoError naming the paths and the system's reason.
void publish_file(const std::string& temp, const std::string& path, FileSystem& fs = posix_file_system());

// Writes `content` to a temporary ".<name>.<unique>.tmp" beside `path`, fsyncs it and publishes
// it (publish_file). The file gets `mode` (default 0600: files hpctrial writes are private unless
// said otherwise). On failure the temporary is removed and IoError names the path and the
// system's reason. Thread- and process-safe: concurrent writers of one path each publish whole.
void write_file_atomic(const std::string& path, std::string_view content, mode_t mode = 0600,
                       FileSystem& fs = posix_file_system());

// Creates `path` and any missing parent directories, each new one with exactly `mode` (default
// 0700: private), whatever the umask. Directories that already exist keep their mode. IoError
// names the directory that could not be made, and why.
void create_directories(const std::string& path, mode_t mode = 0700);

// Takes an exclusive advisory lock on the whole file open as `fd` (open for writing); `path`
// names it in errors. The lock belongs to the open file description: it conflicts with other
// processes and with other opens of the file in this process, and goes when the last
// descriptor of it is closed. Every lock hpctrial takes on a file goes through here.
// flock(2) first, as always. Where the filesystem has no flock (ENOSYS, EOPNOTSUPP, ENOLCK:
// Lustre mounted without -o flock, NFS without its lock service), an open file description lock
// (fcntl F_OFD_SETLKW), which Lustre and NFS have. Never no lock: IoError naming `path` and how
// to mount the filesystem when it has neither, IoError with the system's reason on any other
// failure.
// kWait blocks until the lock is free and returns true; kTry returns false at once when someone
// else holds it. Thread-safe.
enum class LockWait { kWait, kTry };
bool lock_file_exclusive(int fd, const std::string& path, LockWait wait = LockWait::kWait,
                         FileSystem& fs = posix_file_system());
// The same, shared: any number of holders, none while someone holds it exclusively (an
// exclusive lock waits for every shared one to go). `fd` open for reading.
bool lock_file_shared(int fd, const std::string& path, LockWait wait = LockWait::kWait,
                      FileSystem& fs = posix_file_system());

// Writes all of `data` to `fd`, retrying short writes and EINTR; IoError("cannot write
// <what>: <reason>") otherwise.
void write_fully(int fd, std::string_view data, const std::string& what);

}  // namespace hpctrial::core
