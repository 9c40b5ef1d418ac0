// The trials of an experiment: the searcher turns the hyperparameter ranges into one constant
// value per trial. Deterministic: trial N of an experiment always gets the same values, from the
// config and reproducibility.experiment_seed alone, so that each task of a job array (or each
// restart of one) can work out its own trial without asking anyone.
//
//   single  one trial; every hyperparameter must be a constant.
//   grid    the product of every range's `count` points (and every categorical's `vals`); the
//           first hyperparameter varies slowest, as in Determined.
//   random  `max_trials` trials, each range sampled uniformly (log ranges in the exponent).
//   adaptive_asha, async_halving   `max_trials` trials sampled as random samples them, trained
//           for as long as asynchronous successive halving says (search/asha.h).
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "hpctrial/core/experiment_config.h"

namespace hpctrial::core {

// How many trials the searcher of `config` produces (1 for single).
int trial_count(const ExperimentConfig& config);
// The trial ids it may number, 0 to trial_ids() - 1: trial_count(), and for an adaptive search as
// many again, for the trials that replace ones reported invalid (hpctrial::InvalidHP).
int trial_ids(const ExperimentConfig& config);

// How many workers a batch job of an adaptive search has (searcher.max_concurrent_trials, at most
// max_trials): one array task each. 0 for the other searchers, whose tasks are their trials.
int search_workers(const ExperimentConfig& config);

// `config` with every range hyperparameter replaced by the constant of trial `trial_id`.
// Throws ConfigError when the trial does not exist, or when a random search has no seed.
ExperimentConfig trial_config(const ExperimentConfig& config, int trial_id);


// The points of one range along a grid, as YAML scalars (for messages and tests).
std::vector<ConfigNode> grid_points(const Hyperparameter& hp);

}  // namespace hpctrial::core
