// min_checkpoint_period: auto: the interval keeps measured checkpoint costs within the share of
// training time, never past the wall-clock bound, and the first checkpoint comes early.
#include "loop/auto_checkpoint.h"

#include <gtest/gtest.h>

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

}  // namespace auto_checkpoint_test
}  // namespace hpctrial::trainer::detail
