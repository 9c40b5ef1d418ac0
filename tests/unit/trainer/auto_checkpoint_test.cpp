// min_checkpoint_period: auto: the interval keeps measured checkpoint costs within the share of
// training time, never past the wall-clock bound, and the first checkpoint comes early.
#include "loop/auto_checkpoint.h"
#include "state/rank_files.h"

#include <fstream>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "hpctrial/core/error.h"

namespace hpctrial::trainer::detail {
namespace auto_checkpoint_test {  // named: the target compiles its sources together (UNITY_BUILD)

TEST(AutoCheckpointPeriod, TheFirstComesAfterAMinuteOrTheBound) {
  EXPECT_EQ(AutoCheckpointPeriod(0.01, 1800).interval_s(), 60);
  EXPECT_EQ(AutoCheckpointPeriod(0.01, 20).interval_s(), 20);
  EXPECT_FALSE(AutoCheckpointPeriod(0.01, 1800).cost_s().has_value());
}

TEST(AutoCheckpointPeriod, TheIntervalIsTheCostOverTheShareWithinTheBound) {
  AutoCheckpointPeriod period(0.01, 1800);
  period.record_cost(0.1);
  EXPECT_DOUBLE_EQ(period.interval_s(), 60);  // 10 s would be 1 %; never sooner than the first
  EXPECT_EQ(period.limit(), AutoCheckpointPeriod::Limit::kFloor);
  period.record_cost(1.9);
  EXPECT_DOUBLE_EQ(*period.cost_s(), 1.0);  // the mean of the recent costs
  EXPECT_DOUBLE_EQ(period.interval_s(), 100);  // 1 s in every 100 s: 1 %
  EXPECT_EQ(period.limit(), AutoCheckpointPeriod::Limit::kShare);
  for (int i = 0; i < 8; ++i) period.record_cost(30);  // only the last 8 count
  EXPECT_DOUBLE_EQ(*period.cost_s(), 30);
  EXPECT_DOUBLE_EQ(period.interval_s(), 1800);  // 3000 s would be 1 %; the bound wins
  EXPECT_EQ(period.limit(), AutoCheckpointPeriod::Limit::kBound);
  AutoCheckpointPeriod generous(0.05, 1800);
  generous.record_cost(4);
  EXPECT_DOUBLE_EQ(generous.interval_s(), 80);
  AutoCheckpointPeriod short_bound(0.01, 1);  // a cheap checkpoint, but the bound is shorter than the floor
  short_bound.record_cost(0.001);
  EXPECT_DOUBLE_EQ(short_bound.interval_s(), 1);
  EXPECT_EQ(short_bound.limit(), AutoCheckpointPeriod::Limit::kBound);
}

// A rank's files as datasets and back, byte for byte, into another rank's private directory;
// what a checkpoint cannot hold (a link) is refused naming it.
TEST(RankFiles, TravelAsTheyWereAndLinksAreRefused) {
  PrivateDirectory saved("test"), restored("test");
  std::filesystem::create_directories(saved.path() / "a" / "b");
  std::ofstream(saved.path() / "a" / "b" / "bytes", std::ios::binary) << std::string("\0\1\2", 3);
  std::ofstream(saved.path() / "top.txt") << "top";
  const checkpoint::Contents contents = capture_rank_files(saved.path(), 1, 3);
  EXPECT_EQ(contents.find("rank_files/1/a/b/bytes")->nbytes(), 3u);
  EXPECT_EQ(contents.find("meta/rank_files"), nullptr) << "rank 0 says how many ranks saved";
  EXPECT_EQ(capture_rank_files(saved.path(), 0, 3).find("meta/rank_files")->text(), R"({"ranks":3})");
  extract_rank_files(contents, 1, restored.path(), "ckpt.h5");
  std::ifstream in(restored.path() / "a" / "b" / "bytes", std::ios::binary);
  EXPECT_EQ(std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>()), std::string("\0\1\2", 3));
  extract_rank_files(contents, 2, restored.path() / "other", "ckpt.h5");
  EXPECT_FALSE(std::filesystem::exists(restored.path() / "other")) << "rank 2 saved nothing";
  std::filesystem::create_symlink("/etc/passwd", saved.path() / "link");
  try {
    capture_rank_files(saved.path(), 1, 3);
    ADD_FAILURE() << "a link was taken into a checkpoint";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), testing::HasSubstr((saved.path() / "link").string() + " is not a regular file"));
  }
  std::filesystem::path gone;
  {
    PrivateDirectory directory("test");
    gone = directory.path();
    std::ofstream(gone / "file") << "x";
  }
  EXPECT_FALSE(std::filesystem::exists(gone)) << "removed with what it held";
}

}  // namespace auto_checkpoint_test
}  // namespace hpctrial::trainer::detail
