// Two effective configs compared key by key, and the keys a later run of an experiment may
// change: the experiment's config has one owner (experiment_dir.h: commit_experiment_config),
// and a command whose config differs elsewhere is another experiment. Pure; thread-safe.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "hpctrial/core/experiment_config.h"

namespace hpctrial::core {

// A key whose value differs between two effective configs: "hyperparameters.learning_rate",
// with each side's value on one line ("(none)" where the key is absent).
struct ConfigDifference {
  std::string key;
  std::string recorded;
  std::string given;
};

// The keys of `given` whose values differ from `recorded`'s, each leaf key of a map on its own
// (a list is one value), in the order to_yaml writes them.
std::vector<ConfigDifference> config_differences(const ExperimentConfig& recorded, const ExperimentConfig& given);

// Whether `key` (a key of config_differences) is a run setting of an experiment made with
// `config`: where and how its trials run (resources, scheduler, launcher, environment, an engine
// trial's shape, retention and checkpoint period, data.stage), which a later run may change.
// Every other key says what the experiment trains, and another value of it is another
// experiment. searcher.max_length is a run setting only where the searcher has no rungs.
bool is_run_setting(std::string_view key, const ExperimentConfig& config);

}  // namespace hpctrial::core
