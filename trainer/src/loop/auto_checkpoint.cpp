#include "loop/auto_checkpoint.h"

#include <algorithm>
#include <numeric>

namespace hpctrial::trainer::detail {

AutoCheckpointPeriod::AutoCheckpointPeriod(double overhead, double max_interval_s, double first_after_s)
    : overhead_(overhead), max_interval_s_(max_interval_s), first_after_s_(first_after_s) {}

void AutoCheckpointPeriod::record_cost(double seconds) {
  recent_.push_back(std::max(0.0, seconds));
  if (recent_.size() > kRecent) recent_.pop_front();
}

std::optional<double> AutoCheckpointPeriod::cost_s() const {
  if (recent_.empty()) return std::nullopt;
  return std::accumulate(recent_.begin(), recent_.end(), 0.0) / static_cast<double>(recent_.size());
}

double AutoCheckpointPeriod::interval_s() const {
  const auto cost = cost_s();
  if (!cost) return std::min(first_after_s_, max_interval_s_);
  // Never more often than the first: a small model's checkpoints would otherwise follow each
  // other within seconds, each one a file to write, publish and prune.
  return std::min(std::max(*cost / overhead_, first_after_s_), max_interval_s_);
}

AutoCheckpointPeriod::Limit AutoCheckpointPeriod::limit() const {
  const auto cost = cost_s();
  const double wanted = cost ? *cost / overhead_ : first_after_s_;
  if (wanted >= max_interval_s_ || first_after_s_ >= max_interval_s_) return Limit::kBound;
  return wanted < first_after_s_ ? Limit::kFloor : Limit::kShare;
}

}  // namespace hpctrial::trainer::detail
