#include "auto_checkpoint.h"

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
  // Never more often than the first: what the loop measures of an asynchronous checkpoint (its
  // stall, the copy wait) is less than the writer costs a busy machine.
  return std::min(std::max(*cost / overhead_, first_after_s_), max_interval_s_);
}

bool AutoCheckpointPeriod::bounded() const {
  const auto cost = cost_s();
  return cost && *cost / overhead_ > max_interval_s_;
}

}  // namespace hpctrial::trainer::detail
