// Which experiment a rank's trial belongs to: the identity every checkpoint names and that keys
// the trial's staged data. Internal to the trainer; no LibTorch.
#pragma once

#include <string>

#include "hpctrial/comm/communicator.h"
#include "hpctrial/core/experiment_dir.h"

namespace hpctrial::trainer::detail {

struct RankIdentity {
  core::ExperimentIdentity identity;
  std::string recorded_in;  // the directory whose experiment.json records it
};

// Collective on `world`: the same identity on every rank. A rank the launcher started
// (`experiment_dir` set) reads its experiment's; IoError naming the file where none is recorded.
// A rank run alone keeps one in its trial directory `trial_dir`, which the chief makes there, for
// an experiment called `name`, the first time: two programs run alone, in two trial directories,
// are two experiments, whatever their configs are called. Every rank fails alike.
RankIdentity rank_identity(const std::string& experiment_dir, const std::string& trial_dir, const std::string& name,
                           comm::Communicator& world);

}  // namespace hpctrial::trainer::detail
