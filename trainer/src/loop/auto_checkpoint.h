// min_checkpoint_period: auto - how often the chief checkpoints, from what checkpoints cost.
// Internal to the trainer; no LibTorch.
//
// A checkpoint costs training C seconds (the loop's stall, and its background write, counted
// whole). Checkpointing every I seconds, measured from one checkpoint's start
// to the next, spends C / I of the time on checkpoints; to keep that within the share `s`, the
// interval is C / s (SCR's SCR_CHECKPOINT_OVERHEAD), but never longer than the wall-clock bound,
// which caps the work a crash loses (Young/Daly's interval grows with the time between failures;
// the bound stands in for an unknown one). Before any checkpoint was measured, the first comes
// after `first_after_s` (or the bound, if shorter); none comes sooner after another than that.
#pragma once

#include <cstddef>
#include <deque>
#include <optional>

namespace hpctrial::trainer::detail {

class AutoCheckpointPeriod {
 public:
  AutoCheckpointPeriod(double overhead, double max_interval_s, double first_after_s = 60);

  // One checkpoint's cost to the loop, in seconds.
  void record_cost(double seconds);
  // Seconds from the start of one checkpoint to the next.
  double interval_s() const;
  // The cost the interval is computed from (the mean of the recent ones); nullopt before any.
  std::optional<double> cost_s() const;
  // What sets the interval: the share, the one-a-minute floor, or the wall-clock bound.
  enum class Limit { kShare, kFloor, kBound };
  Limit limit() const;
  double overhead() const { return overhead_; }

 private:
  static constexpr std::size_t kRecent = 8;
  double overhead_;
  double max_interval_s_;
  double first_after_s_;
  std::deque<double> recent_;
};

}  // namespace hpctrial::trainer::detail
