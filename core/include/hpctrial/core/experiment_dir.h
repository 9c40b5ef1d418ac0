// The layout of an experiment directory that more than one part of hpctrial reads: where a
// trial's checkpoints are. The trainer writes them there and the `hpctrial` verbs look there,
// through this one function.
#pragma once

#include <string>

#include "hpctrial/core/experiment_config.h"

namespace hpctrial::core {

// checkpoint_storage.host_path/trial-<id> when the config sets a host_path (a relative one is
// taken from the config file's directory), else <trial dir>/checkpoints.
std::string checkpoint_dir(const ExperimentConfig& config, const std::string& trial_dir, int trial_id);

}  // namespace hpctrial::core
