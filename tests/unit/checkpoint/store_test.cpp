// The checkpoint directory under failure: a crash at every step of a save leaves `latest` naming
// a complete checkpoint; disk-full and permission errors leave it untouched and name the path
// and the reason; a damaged latest falls back to the previous good one; retention keeps the
// newest and the best and never what `latest` names.
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <limits>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "../../support/temp_dir.h"
#include "hpctrial/checkpoint/store.h"
#include "hpctrial/core/error.h"

namespace hpctrial::checkpoint {
namespace {

using testing::HasSubstr;
using testing_support::TempDir;

Contents state(std::int64_t batches, std::optional<double> metric = std::nullopt) {
  Contents c;
  std::vector<float> a(5000, static_cast<float>(batches)), b(3000, 1.0f);
  c.add("model/0/a", DType::kFloat32, {5000}, a.data());
  c.add("model/0/b", DType::kFloat32, {3000}, b.data());
  c.add_text("meta/note", "batches " + std::to_string(batches));
  c.attributes[kBatchesAttribute] = std::to_string(batches);
  if (metric) c.attributes[kMetricAttribute] = std::to_string(*metric);
  return c;
}

// Counts every call through the seam; at call `crash_at` it ends the process (a pwrite first
// writes half its bytes), or fails with `fail_errno`.
class FaultyFileSystem : public FileSystem {
 public:
  int crash_at = -1;
  int fail_at = -1;
  int fail_errno = 0;
  int calls = 0;

  int open(const std::string& path, int flags, mode_t mode) override {
    if (hit()) return fail();
    return FileSystem::open(path, flags, mode);
  }
  ssize_t pwrite(int fd, const void* data, std::size_t size, off_t offset) override {
    if (calls == crash_at) {
      FileSystem::pwrite(fd, data, size / 2 / 4096 * 4096, offset);
      ::_exit(0);
    }
    if (hit()) return fail();
    return FileSystem::pwrite(fd, data, size, offset);
  }
  int fsync(int fd) override { return hit() ? fail() : FileSystem::fsync(fd); }
  int rename(const std::string& from, const std::string& to) override {
    return hit() ? fail() : FileSystem::rename(from, to);
  }

 private:
  bool hit() {
    const int call = calls++;
    if (call == crash_at) ::_exit(0);
    return call == fail_at;
  }
  int fail() {
    errno = fail_errno;
    return -1;
  }
};

TEST(CheckpointStore, PublishesAndLoadsTheLatest) {
  TempDir dir;
  CheckpointStore store((dir.path() / "ckpts" / "trial-1").string(), {});
  struct stat st {};
  ASSERT_EQ(::stat((dir.path() / "ckpts").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u) << "a created directory is private";
  std::vector<std::string> problems;
  EXPECT_FALSE(store.load_latest(&problems).has_value());
  store.publish(state(100));
  store.publish(state(200));
  EXPECT_EQ(store.latest_file(), "ckpt-200.h5");
  const auto loaded = store.load_latest(&problems);
  ASSERT_TRUE(loaded.has_value());
  EXPECT_EQ(loaded->batches, 200);
  EXPECT_EQ(loaded->contents.at("meta/note", loaded->path).text(), "batches 200");
  EXPECT_TRUE(problems.empty());
}

TEST(CheckpointStore, RetentionKeepsTheNewestTheBestAndLatest) {
  TempDir dir;
  StoreOptions options;
  options.keep_latest = 1;
  options.keep_best = 1;
  options.smaller_is_better = true;
  CheckpointStore store(dir.path().string(), options);
  const double metrics[] = {0.5, 0.2, 0.9, 0.7, 0.8};
  for (int i = 0; i < 5; ++i) store.publish(state(100 * (i + 1), metrics[i]));
  std::vector<std::string> files;
  for (const auto& info : store.list(/*verify=*/true)) files.push_back(info.file);
  EXPECT_EQ(files, (std::vector<std::string>{"ckpt-500.h5", "ckpt-200.h5"}));
  options.smaller_is_better = false;
  options.keep_latest = 2;
  CheckpointStore larger(dir.path().string(), options);
  larger.publish(state(600, 0.1));
  files.clear();
  for (const auto& info : larger.list(true)) files.push_back(info.file);
  EXPECT_EQ(files, (std::vector<std::string>{"ckpt-600.h5", "ckpt-500.h5"}));  // 500 is newest-but-one and best (0.8)
}

// A diverged run's metrics (NaN, +-inf) rank after every finite one in both directions: the
// finite best is kept, never a NaN in its place.
TEST(CheckpointStore, RetentionRanksNonFiniteMetricsLast) {
  for (const bool smaller : {true, false}) {
    TempDir dir;
    StoreOptions options;
    options.keep_latest = 1;
    options.keep_best = 1;
    options.smaller_is_better = smaller;
    CheckpointStore store(dir.path().string(), options);
    const double nan = std::nan("");
    const double inf = std::numeric_limits<double>::infinity();
    const double metrics[] = {nan, 0.5, -inf, nan, inf, 0.7, nan};
    for (int i = 0; i < 7; ++i) store.publish(state(100 * (i + 1), metrics[i]));
    std::vector<std::string> files;
    for (const auto& info : store.list(/*verify=*/true)) files.push_back(info.file);
    EXPECT_EQ(files, (std::vector<std::string>{"ckpt-700.h5", smaller ? "ckpt-200.h5" : "ckpt-600.h5"})) << smaller;
  }
}

// An acceptor's CheckpointError skips a checkpoint that reads intact (its progress cannot be
// read) for the previous one; a ConfigError (another experiment's) ends the search.
TEST(CheckpointStore, AnAcceptorSkipsOrRefusesACheckpoint) {
  TempDir dir;
  StoreOptions options;
  options.keep_latest = 3;
  CheckpointStore store(dir.path().string(), options);
  for (int b : {100, 200, 300}) store.publish(state(b));
  std::vector<std::string> problems;
  auto loaded = store.load_latest(&problems, [](const CheckpointStore::Loaded& l) {
    if (l.batches == 300) throw CheckpointError(l.path + ": progress is malformed");
  });
  ASSERT_TRUE(loaded.has_value());
  EXPECT_EQ(loaded->batches, 200);
  EXPECT_EQ(problems, (std::vector<std::string>{store.path_for(300) + ": progress is malformed"}));
  problems.clear();
  EXPECT_THROW(store.load_latest(&problems, [](const CheckpointStore::Loaded& l) {
                 throw ConfigError(l.path + " belongs to another experiment");
               }),
               ConfigError);
}

// A resume from a damaged latest (a flipped byte in a large dataset's data, a truncated file)
// falls back to the previous good one every time, and never hangs.
TEST(CheckpointStore, ResumingFromDamagedFilesFallsBackEveryTime) {
  TempDir dir;
  StoreOptions options;
  options.keep_latest = 3;
  CheckpointStore store(dir.path().string(), options);
  const auto big = [](std::int64_t batches) {
    Contents c = state(batches);
    for (int i = 0; i < 8; ++i) {
      std::vector<float> values(50000 + i, static_cast<float>(i));
      c.add("model/1/t" + std::to_string(i), DType::kFloat32, {static_cast<std::int64_t>(values.size())},
            values.data());
    }
    return c;
  };
  store.publish(big(100));
  store.publish(big(200));
  store.publish(big(300));
  {  // 300: a byte of an early dataset's data flipped; 200: cut short
    std::fstream f(store.path_for(300), std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(0, std::ios::end);
    const auto size = static_cast<long>(f.tellg());
    f.seekg(size / 2);
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x40);
    f.seekp(size / 2);
    f.write(&c, 1);
  }
  std::filesystem::resize_file(store.path_for(200), std::filesystem::file_size(store.path_for(200)) / 2);
  for (int round = 0; round < 200; ++round) {
    auto result = std::async(std::launch::async, [&] {
      std::vector<std::string> problems;
      auto loaded = store.load_latest(&problems);
      return std::make_pair(loaded ? loaded->batches : -1, problems.size());
    });
    if (result.wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
      ADD_FAILURE() << "load_latest did not return within 60 s in round " << round;
      std::fflush(nullptr);
      std::_Exit(1);
    }
    const auto [batches, problems] = result.get();
    ASSERT_EQ(batches, 100) << "round " << round;
    ASSERT_EQ(problems, 2u) << "round " << round;
  }
}

TEST(CheckpointStore, ADamagedLatestFallsBackToThePreviousGoodOne) {
  TempDir dir;
  StoreOptions options;
  options.keep_latest = 3;
  CheckpointStore store(dir.path().string(), options);
  store.publish(state(100));
  store.publish(state(200));
  std::filesystem::resize_file(store.path_for(200), 3000);
  std::vector<std::string> problems;
  auto loaded = store.load_latest(&problems);
  ASSERT_TRUE(loaded.has_value());
  EXPECT_EQ(loaded->batches, 100);
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_THAT(problems[0], HasSubstr(store.path_for(200) + ": "));

  std::ofstream(dir.path() / "latest") << "../../etc/passwd\n";
  problems.clear();
  loaded = store.load_latest(&problems);
  ASSERT_TRUE(loaded.has_value());
  EXPECT_EQ(loaded->batches, 100);
  EXPECT_THAT(problems.front(), HasSubstr("latest: does not name a checkpoint file"));

  std::filesystem::resize_file(store.path_for(100), 10);
  problems.clear();
  EXPECT_FALSE(store.load_latest(&problems).has_value());
  EXPECT_EQ(problems.size(), 3u);
}

TEST(CheckpointStore, DiskFullAndPermissionErrorsLeaveLatestUntouched) {
  TempDir dir;
  FaultyFileSystem faulty;
  StoreOptions options;
  options.fs = &faulty;
  CheckpointStore store(dir.path().string(), options);
  store.publish(state(100));
  for (auto [at, error] : {std::pair{4, ENOSPC}, std::pair{0, EACCES}, std::pair{7, EIO}}) {
    faulty.calls = 0;
    faulty.fail_at = at;
    faulty.fail_errno = error;
    try {
      store.publish(state(200));
      ADD_FAILURE() << "the save succeeded despite " << std::strerror(error);
    } catch (const IoError& e) {
      EXPECT_THAT(e.what(), HasSubstr(dir.path().string())) << e.what();
      EXPECT_THAT(e.what(), HasSubstr(std::strerror(error))) << e.what();
    }
    EXPECT_EQ(store.latest_file(), "ckpt-100.h5");
    EXPECT_FALSE(std::filesystem::exists(temporary_path(store.path_for(200))));
  }
}

TEST(CheckpointStore, ACrashAtAnyStepOfASaveLeavesAGoodLatest) {
  TempDir dir;
  StoreOptions options;
  options.keep_latest = 5;
  const std::string path = dir.path().string();
  {
    CheckpointStore store(path, options);
    store.publish(state(100));
  }
  // How many seam calls a save makes.
  FaultyFileSystem counting;
  options.fs = &counting;
  CheckpointStore(path, options).publish(state(150));
  const int steps = counting.calls;
  ASSERT_GT(steps, 10);
  for (int crash_at = 0; crash_at < steps; ++crash_at) {
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      FaultyFileSystem faulty;
      faulty.crash_at = crash_at;
      StoreOptions child_options = options;
      child_options.fs = &faulty;
      CheckpointStore(path, child_options).publish(state(200));
      ::_exit(0);
    }
    int status = 0;
    ::waitpid(child, &status, 0);
    CheckpointStore store(path, StoreOptions{});
    std::vector<std::string> problems;
    const auto loaded = store.load_latest(&problems);
    ASSERT_TRUE(loaded.has_value()) << "no good checkpoint after a crash at step " << crash_at;
    EXPECT_TRUE(problems.empty()) << "crash at step " << crash_at << ": " << problems.front();
    EXPECT_TRUE(loaded->batches == 150 || loaded->batches == 200) << crash_at;
    EXPECT_EQ(store.latest_file(), "ckpt-" + std::to_string(loaded->batches) + ".h5");
    store.remove_temporaries();
    for (const auto& entry : std::filesystem::directory_iterator(path)) {
      EXPECT_NE(entry.path().extension(), ".tmp") << entry.path();
    }
    // Back to "latest is 150" for the next step.
    std::ofstream(std::filesystem::path(path) / "latest") << "ckpt-150.h5\n";
    std::filesystem::remove(store.path_for(200));
  }
}

}  // namespace
}  // namespace hpctrial::checkpoint
