// The checkpoint writer on a filesystem that opens files with O_DIRECT and then refuses direct
// writes with EINVAL: the save goes on through the page cache, says so once, and the file is
// complete and verifies.
#include <fcntl.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "../../support/temp_dir.h"
#include "hpctrial/checkpoint/format.h"
#include "hpctrial/checkpoint/shared_write.h"
#include "hpctrial/core/error.h"

namespace hpctrial::checkpoint {
namespace {

using testing::HasSubstr;
using testing_support::TempDir;

// Opens with O_DIRECT succeed (the flag is dropped, so any filesystem will do); writes through
// such a descriptor fail with EINVAL after the first `direct_writes_taken`.
class DirectRefusingFileSystem : public FileSystem {
 public:
  int direct_writes_taken = 0;
  int direct_opens = 0;
  int direct_writes = 0;
  int refused = 0;

  int open(const std::string& path, int flags, mode_t mode) override {
    const int fd = FileSystem::open(path, flags & ~O_DIRECT, mode);
    if (fd >= 0 && (flags & O_DIRECT) != 0) {
      direct_.insert(fd);
      ++direct_opens;
    }
    return fd;
  }
  ssize_t pwrite(int fd, const void* data, std::size_t size, off_t offset) override {
    if (direct_.count(fd) != 0 && direct_writes++ >= direct_writes_taken) {
      ++refused;
      errno = EINVAL;
      return -1;
    }
    return FileSystem::pwrite(fd, data, size, offset);
  }
  int close(int fd) override {
    direct_.erase(fd);
    return FileSystem::close(fd);
  }

 private:
  std::set<int> direct_;
};

std::vector<float> ramp(std::size_t count, float first) {
  std::vector<float> v(count);
  std::iota(v.begin(), v.end(), first);
  return v;
}

int occurrences(const std::string& text, const std::string& part) {
  int n = 0;
  for (auto at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}

void expect_same_bytes(const Contents& read, const std::string& name, const std::vector<float>& expected,
                       const std::string& path) {
  const Dataset& d = read.at(name, path);
  ASSERT_EQ(d.nbytes(), expected.size() * sizeof(float)) << name;
  EXPECT_EQ(std::memcmp(d.data->data(), expected.data(), d.nbytes()), 0) << name;
}

TEST(CheckpointWriter, ADirectWriteRefusedWithEinvalFallsBackToThePageCache) {
  for (int taken : {0, 1}) {  // refused at the first direct write, or after one went through
    TempDir dir;
    const std::string path = (dir.path() / "ckpt-100.h5").string();
    const std::vector<float> weight = ramp(300001, 0.5f), state = ramp(70000, -9.0f);
    Contents contents;
    contents.add("model/0/fc1.weight", DType::kFloat32, {300001}, weight.data());
    contents.add("optimizer/0/state/0/exp_avg", DType::kFloat32, {70000}, state.data());
    contents.add_text("progress", R"({"batches": 100})");
    contents.attributes["batches"] = "100";
    DirectRefusingFileSystem fs;
    fs.direct_writes_taken = taken;
    WriteOptions options;
    options.fs = &fs;

    testing::internal::CaptureStderr();
    write_checkpoint(path, contents, options);
    const std::string log = testing::internal::GetCapturedStderr();

    EXPECT_EQ(fs.direct_opens, 1);
    EXPECT_EQ(fs.refused, 1) << "after one refusal the rest of the file goes through the page cache";
    EXPECT_EQ(fs.direct_writes, taken + 1);
    EXPECT_EQ(occurrences(log, "refused a direct write (EINVAL); writing the rest of it through the page cache"), 1)
        << log;
    EXPECT_THAT(log, HasSubstr(temporary_path(path) + ": the filesystem opened the file for direct I/O"));
    EXPECT_FALSE(std::filesystem::exists(temporary_path(path)));
    const Contents read = read_checkpoint(path);  // every CRC checked
    expect_same_bytes(read, "model/0/fc1.weight", weight, path);
    expect_same_bytes(read, "optimizer/0/state/0/exp_avg", state, path);
    EXPECT_EQ(read.at("progress", path).text(), R"({"batches": 100})");
    EXPECT_EQ(read.attributes.at("batches"), "100");
  }
}

// Another failure of a direct write is still an error naming the file.
TEST(CheckpointWriter, OtherDirectWriteFailuresStillFailTheSave) {
  class FullFileSystem : public DirectRefusingFileSystem {
    ssize_t pwrite(int fd, const void* data, std::size_t size, off_t offset) override {
      const ssize_t n = DirectRefusingFileSystem::pwrite(fd, data, size, offset);
      if (n < 0) errno = ENOSPC;
      return n;
    }
  } fs;
  TempDir dir;
  const std::string path = (dir.path() / "ckpt-5.h5").string();
  const std::vector<float> weight = ramp(300001, 0.5f);
  Contents contents;
  contents.add("model/0/fc1.weight", DType::kFloat32, {300001}, weight.data());
  WriteOptions options;
  options.fs = &fs;
  try {
    write_checkpoint(path, contents, options);
    FAIL() << "saved despite ENOSPC";
  } catch (const IoError& e) {
    EXPECT_THAT(e.what(), HasSubstr("cannot write " + temporary_path(path) + ": " + std::strerror(ENOSPC)));
  }
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_FALSE(std::filesystem::exists(temporary_path(path)));
}

// The writers of a checkpoint written in pieces (shared_write.h) fall back the same way.
TEST(CheckpointWriter, APieceWriterFallsBackToThePageCacheOnEinval) {
  TempDir dir;
  const std::string path = (dir.path() / "ckpt-7.h5").string();
  const std::vector<float> state = ramp(50000, -100.0f);
  FilePlan plan = plan_checkpoint(path, {{"optimizer/0/state/0/exp_avg", DType::kFloat32, {50000}}}, {{"batches", "7"}});
  DirectRefusingFileSystem fs;
  WriteOptions options;
  options.fs = &fs;
  // Memory that lines up with the file, so that the middle of the piece is written direct.
  const std::size_t size = state.size() * sizeof(float);
  const std::uint64_t offset = plan.offsets[0];
  Buffer aligned(size + Buffer::kAlignment);
  char* from = static_cast<char*>(aligned.data()) + offset % Buffer::kAlignment;
  std::memcpy(from, state.data(), size);

  testing::internal::CaptureStderr();
  {
    PieceWriter out(plan.temp, options);
    out.write(offset, from, size);
    out.write(offset, from, size);  // again: through the page cache from the start
    out.sync();
  }
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_EQ(fs.direct_opens, 1);
  EXPECT_EQ(fs.refused, 1);
  EXPECT_EQ(occurrences(log, plan.temp + ": the filesystem opened the file for direct I/O (O_DIRECT) but refused a "
                                         "direct write (EINVAL)"),
            1)
      << log;
  finish_checkpoint(plan, {crc32c(state.data(), size)}, options);
  const Contents read = read_checkpoint(path);
  expect_same_bytes(read, "optimizer/0/state/0/exp_avg", state, path);
  EXPECT_EQ(read.attributes.at("batches"), "7");
}

}  // namespace
}  // namespace hpctrial::checkpoint
