#include "hpctrial/core/files.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "../../support/temp_dir.h"
#include "hpctrial/core/error.h"

namespace hpctrial::core {
namespace {

using testing::HasSubstr;
using testing_support::TempDir;

std::string read(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

TEST(WriteFileAtomic, WritesPrivateFilesAndLeavesNoTemporary) {
  TempDir dir;
  const auto path = dir.path() / "effective-config.yaml";
  write_file_atomic(path.string(), "a: 1\n");
  EXPECT_EQ(read(path), "a: 1\n");
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
  EXPECT_EQ(read(path), "ckpt-200.h5");
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
  EXPECT_EQ(read(target / "inside"), "keep");
  int entries = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir.path())) {
    (void)entry;
    ++entries;
  }
  EXPECT_EQ(entries, 1) << "the temporary file was left behind";
}

}  // namespace
}  // namespace hpctrial::core
