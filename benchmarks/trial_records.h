// What the launch benchmarks read of a running trial: the chief's step and the newest checkpoint.
#pragma once

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <system_error>

#include "hpctrial/core/launch_contract.h"
#include "hpctrial/core/layout.h"

namespace hpctrial::bench {

// The chief's last step (its heartbeat record), or -1.
inline long long chief_step(const core::TrialLayout& trial) {
  const auto chief = core::read_heartbeat(trial.heartbeat_dir(), 0);
  return chief ? chief->step : -1;
}

// The batches of the trial's newest checkpoint (a stop's), or -1.
inline long long newest_checkpoint(const core::TrialLayout& trial) {
  long long newest = -1;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(trial.default_checkpoint_dir(), ec)) {
    long long batches = -1;
    if (std::sscanf(entry.path().filename().c_str(), "ckpt-%lld.h5", &batches) == 1) newest = std::max(newest, batches);
  }
  return newest;
}

}  // namespace hpctrial::bench
