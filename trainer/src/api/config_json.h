// The experiment config's free-form parts as JSON, the form a trial reads them in. Internal.
#pragma once

#include <nlohmann/json.hpp>

#include "hpctrial/core/experiment_config.h"

namespace hpctrial::trainer::detail {

// YAML's typing: plain scalars become integers, numbers, booleans or null when they read as
// such; quoted scalars stay strings.
nlohmann::json to_json(const core::ConfigNode& node);

// The trial's hyperparameter values. A range (int, double, log, categorical) needs a searcher
// to pick a value: running one trial directly is a ConfigError naming the hyperparameter.
nlohmann::json trial_hparams(const core::ExperimentConfig& config);

}  // namespace hpctrial::trainer::detail
