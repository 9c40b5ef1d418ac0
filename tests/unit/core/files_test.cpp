#include "hpctrial/core/files.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>

#include "../../support/read_file.h"
#include "../../support/temp_dir.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/json_file.h"

namespace hpctrial::core {
namespace {

using testing::HasSubstr;
using testing_support::read_file;
using testing_support::TempDir;

TEST(WriteFileAtomic, WritesPrivateFilesAndLeavesNoTemporary) {
  TempDir dir;
  const auto path = dir.path() / "effective-config.yaml";
  write_file_atomic(path.string(), "a: 1\n");
  EXPECT_EQ(read_file(path), "a: 1\n");
  struct stat info {};
  ASSERT_EQ(::stat(path.c_str(), &info), 0);
  EXPECT_EQ(info.st_mode & 0777, 0600u);
  int entries = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir.path())) {
    (void)entry;
    ++entries;
  }
  EXPECT_EQ(entries, 1);
}

TEST(WriteFileAtomic, ReplacesTheOldContentWhole) {
  TempDir dir;
  const auto path = dir.path() / "latest";
  write_file_atomic(path.string(), std::string(100000, 'a'));
  write_file_atomic(path.string(), "ckpt-200.h5", 0644);
  EXPECT_EQ(read_file(path), "ckpt-200.h5");
  struct stat info {};
  ASSERT_EQ(::stat(path.c_str(), &info), 0);
  EXPECT_EQ(info.st_mode & 0777, 0644u);
}

TEST(WriteFileAtomic, AMissingDirectoryIsAnIoErrorNamingIt) {
  TempDir dir;
  const auto path = dir.path() / "no-such-dir" / "f";
  try {
    write_file_atomic(path.string(), "x");
    FAIL();
  } catch (const IoError& e) {
    EXPECT_THAT(e.what(), HasSubstr("cannot create a temporary file in " +
                                    (dir.path() / "no-such-dir").string() +
                                    ": No such file or directory"));
  }
}

TEST(WriteFileAtomic, AFailedRenameLeavesTheOldFileAndNoTemporary) {
  TempDir dir;
  const auto target = dir.path() / "target";
  std::filesystem::create_directory(target);  // a directory cannot be replaced by a file
  std::ofstream(target / "inside") << "keep";
  EXPECT_THROW(write_file_atomic(target.string(), "x"), IoError);
  EXPECT_EQ(read_file(target / "inside"), "keep");
  int entries = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir.path())) {
    (void)entry;
    ++entries;
  }
  EXPECT_EQ(entries, 1) << "the temporary file was left behind";
}

// Fails the seam's call number `fail_at` with ENOSPC; counts the calls.
class FullDisk : public FileSystem {
 public:
  int fail_at = -1;
  int calls = 0;
  int open(const std::string& path, int flags, mode_t mode) override {
    return hit() ? -1 : FileSystem::open(path, flags, mode);
  }
  ssize_t pwrite(int fd, const void* data, std::size_t size, off_t offset) override {
    return hit() ? -1 : FileSystem::pwrite(fd, data, size, offset);
  }
  int fsync(int fd) override { return hit() ? -1 : FileSystem::fsync(fd); }
  int rename(const std::string& from, const std::string& to) override {
    return hit() ? -1 : FileSystem::rename(from, to);
  }

 private:
  bool hit() {
    if (calls++ != fail_at) return false;
    errno = ENOSPC;
    return true;
  }
};

TEST(WriteFileAtomic, AFailureAtAnyCallBeforeTheRenameLeavesTheOldContentAndNoTemporary) {
  TempDir dir;
  const auto path = dir.path() / "latest";
  write_file_atomic(path.string(), "ckpt-100.h5\n");
  FullDisk counting;
  write_file_atomic(path.string(), "ckpt-150.h5\n", 0600, counting);
  const int calls = counting.calls;  // open, pwrite, fsync, rename, open and fsync the directory
  ASSERT_EQ(calls, 6);
  for (int fail_at = 0; fail_at < calls; ++fail_at) {
    FullDisk disk;
    disk.fail_at = fail_at;
    try {
      write_file_atomic(path.string(), "ckpt-200.h5\n", 0600, disk);
      ADD_FAILURE() << "no error for a failure at call " << fail_at;
    } catch (const IoError& e) {
      EXPECT_THAT(e.what(), HasSubstr(dir.path().string())) << e.what();
      EXPECT_THAT(e.what(), HasSubstr("No space left on device")) << e.what();
    }
    // Before the rename the old content stays; after it (the directory's fsync) the new one is there.
    EXPECT_EQ(read_file(path), fail_at <= 3 ? "ckpt-150.h5\n" : "ckpt-200.h5\n") << fail_at;
    int entries = 0;
    for (const auto& entry : std::filesystem::directory_iterator(dir.path())) {
      (void)entry;
      ++entries;
    }
    EXPECT_EQ(entries, 1) << "a temporary was left by a failure at call " << fail_at;
    if (fail_at > 3) write_file_atomic(path.string(), "ckpt-150.h5\n");
  }
}

}  // namespace
}  // namespace hpctrial::core

namespace hpctrial::core {
namespace {

// A state file is an object or an error naming it: a damaged or replaced one is never read as
// an empty one (a missing one is: a state not begun).
TEST(ReadJsonFile, AFileOfAnotherKindThanAnObjectIsAnErrorNamingIt) {
  testing_support::TempDir dir;
  EXPECT_TRUE(read_json_file((dir.path() / "none.json").string()).empty());
  EXPECT_EQ(read_json_file(dir.write("ok.json", "{\"a\": 1}")).at("a"), 1);
  for (const std::string text : {"[]", "3", "\"text\"", "null", "", "{\"a\":"}) {
    const std::string path = dir.write("bad.json", text);
    try {
      read_json_file(path);
      ADD_FAILURE() << text << " was read";
    } catch (const IoError& e) {
      EXPECT_THAT(e.what(), testing::HasSubstr(path)) << text;
    }
  }
}

}  // namespace
}  // namespace hpctrial::core
