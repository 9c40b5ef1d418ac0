// core::lock_file_exclusive: flock where the filesystem has it, an open file description lock
// where it does not (Lustre without -o flock, some NFS), and an error naming the path and the
// mount option where it has neither; never silently no lock.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>

#include "../../support/temp_dir.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/files.h"

namespace hpctrial::core {
namespace {

using testing::HasSubstr;
using testing_support::TempDir;

// A filesystem whose flock says ENOSYS, like Lustre mounted without -o flock; optionally
// without open file description locks either.
class NoFlockFileSystem : public FileSystem {
 public:
  int flock_errno = ENOSYS;
  int fcntl_errno = 0;  // 0: the real fcntl
  int flock_calls = 0;
  int fcntl_calls = 0;

  int flock(int, int) override {
    ++flock_calls;
    errno = flock_errno;
    return -1;
  }
  int fcntl_lock(int fd, int command, struct ::flock* lock) override {
    ++fcntl_calls;
    if (fcntl_errno == 0) return FileSystem::fcntl_lock(fd, command, lock);
    errno = fcntl_errno;
    return -1;
  }
};

UniqueFd open_lock(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
  EXPECT_GE(fd.get(), 0) << path;
  return fd;
}

// Whether another process could take the lock now (a forked child tries both kinds).
bool free_for_another_process(const std::string& path) {
  const pid_t child = ::fork();
  if (child == 0) {
    const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    struct ::flock whole {};
    whole.l_type = F_WRLCK;
    whole.l_whence = SEEK_SET;
    const bool ofd = ::fcntl(fd, F_OFD_SETLK, &whole) == 0;
    const bool bsd = ::flock(fd, LOCK_EX | LOCK_NB) == 0;
    ::_exit(ofd && bsd ? 0 : 1);
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

TEST(FileLock, WithoutFlockAnOpenFileDescriptionLockExcludesASecondOpener) {
  for (int flock_errno : {ENOSYS, EOPNOTSUPP, ENOLCK}) {
    TempDir dir;
    const std::string path = (dir.path() / ".experiment.lock").string();
    NoFlockFileSystem lustre;
    lustre.flock_errno = flock_errno;
    UniqueFd first = open_lock(path);
    EXPECT_TRUE(lock_file_exclusive(first.get(), path, LockWait::kWait, lustre));
    EXPECT_EQ(lustre.flock_calls, 1);
    EXPECT_EQ(lustre.fcntl_calls, 1);

    // A second open of the file in this process is another open file description: refused.
    UniqueFd second = open_lock(path);
    EXPECT_FALSE(lock_file_exclusive(second.get(), path, LockWait::kTry, lustre)) << std::strerror(flock_errno);
    struct ::flock whole {};
    whole.l_type = F_WRLCK;
    whole.l_whence = SEEK_SET;
    EXPECT_EQ(::fcntl(second.get(), F_OFD_SETLK, &whole), -1) << "the first lock is a real OFD lock";
    EXPECT_EQ(errno, EAGAIN);
    EXPECT_FALSE(free_for_another_process(path));

    // Closing the first open releases it.
    first = UniqueFd();
    EXPECT_TRUE(lock_file_exclusive(second.get(), path, LockWait::kTry, lustre));
    second = UniqueFd();
    EXPECT_TRUE(free_for_another_process(path));
  }
}

// A waiting locker takes the lock once the holder lets go.
TEST(FileLock, WithoutFlockAWaitingLockerGetsTheLockWhenTheHolderEnds) {
  TempDir dir;
  const std::string path = (dir.path() / ".launcher.lock").string();
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t holder = ::fork();
  if (holder == 0) {
    NoFlockFileSystem lustre;
    UniqueFd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
    lock_file_exclusive(fd.get(), path, LockWait::kWait, lustre);
    if (::write(ready[1], "x", 1) != 1) ::_exit(2);
    ::usleep(300 * 1000);
    ::_exit(0);  // the lock goes with the process
  }
  char byte = 0;
  ASSERT_EQ(::read(ready[0], &byte, 1), 1);
  NoFlockFileSystem lustre;
  UniqueFd fd = open_lock(path);
  EXPECT_FALSE(lock_file_exclusive(fd.get(), path, LockWait::kTry, lustre)) << "the holder has it";
  const auto start = std::chrono::steady_clock::now();
  EXPECT_TRUE(lock_file_exclusive(fd.get(), path, LockWait::kWait, lustre));
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(150))
      << "the lock was taken while its holder still had it";
  int status = 0;
  ASSERT_EQ(::waitpid(holder, &status, 0), holder);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  ::close(ready[0]);
  ::close(ready[1]);
}

TEST(FileLock, WithNeitherKindOfLockTheErrorNamesThePathAndTheMountOption) {
  TempDir dir;
  const std::string path = (dir.path() / ".experiment.lock").string();
  NoFlockFileSystem nolock;
  nolock.fcntl_errno = EINVAL;
  UniqueFd fd = open_lock(path);
  try {
    lock_file_exclusive(fd.get(), path, LockWait::kWait, nolock);
    FAIL() << "locked without a lock";
  } catch (const IoError& e) {
    EXPECT_THAT(e.what(), HasSubstr("cannot lock " + path + ": its filesystem supports neither flock (" +
                                    std::strerror(ENOSYS) + ") nor open file description locks (" +
                                    std::strerror(EINVAL) + ")"));
    EXPECT_THAT(e.what(), HasSubstr("mount the filesystem with `-o flock` (Lustre)"));
    EXPECT_THAT(e.what(), HasSubstr("local_lock=flock"));
  }
  // Any other failure of flock is an error too, with the system's reason, and no fallback.
  NoFlockFileSystem broken;
  broken.flock_errno = EBADF;
  try {
    lock_file_exclusive(fd.get(), path, LockWait::kWait, broken);
    FAIL() << "locked despite EBADF";
  } catch (const IoError& e) {
    EXPECT_THAT(e.what(), HasSubstr("cannot lock " + path + ": " + std::strerror(EBADF)));
  }
  EXPECT_EQ(broken.fcntl_calls, 0);
}

// Where flock works, the lock is a flock lock, as before.
TEST(FileLock, WhereFlockWorksItIsAFlockLock) {
  TempDir dir;
  const std::string path = (dir.path() / ".experiment.lock").string();
  UniqueFd first = open_lock(path);
  EXPECT_TRUE(lock_file_exclusive(first.get(), path));
  UniqueFd second = open_lock(path);
  EXPECT_EQ(::flock(second.get(), LOCK_EX | LOCK_NB), -1);
  EXPECT_EQ(errno, EWOULDBLOCK);
  struct ::flock whole {};
  whole.l_type = F_WRLCK;
  whole.l_whence = SEEK_SET;
  EXPECT_EQ(::fcntl(second.get(), F_OFD_SETLK, &whole), 0) << "no OFD lock was taken beside the flock";
  whole.l_type = F_UNLCK;
  ::fcntl(second.get(), F_OFD_SETLK, &whole);
  EXPECT_FALSE(lock_file_exclusive(second.get(), path, LockWait::kTry));
  first = UniqueFd();
  EXPECT_TRUE(lock_file_exclusive(second.get(), path, LockWait::kTry));
}

}  // namespace
}  // namespace hpctrial::core
