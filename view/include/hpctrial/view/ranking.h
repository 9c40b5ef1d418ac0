// An experiment's trials ranked by searcher.metric (every searcher): each trial's best
// validation, where it stands in an adaptive search, its best checkpoint and the hyperparameters
// in which the trials differ.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "hpctrial/core/experiment_config.h"
#include "hpctrial/core/layout.h"

namespace hpctrial::view {

struct TrialStanding {
  int trial = 0;
  std::optional<double> best;       // the best validation of searcher.metric (NaN ranks last)
  std::int64_t best_batches = 0;    // when
  std::string state;                // "finished", "stopped at rung 1 of 3", "trained 40 of 64 batches", ...
  std::string checkpoint;           // its best checkpoint (by the metric), else its latest; empty: none
  std::string hparams;              // "lr=0.01, hidden=64": those that differ between trials
};

// Each trial's place in an adaptive search, from its log (nothing for the other searchers):
// "finished", "stopped at rung 1 of 3", "waits at rung 0 of 3 for a promotion", ...; and whether
// its training ended short of max_length (stopped, failed, or waiting when the search ended).
struct SearchPlace {
  std::string text;
  bool stopped = false;
};
std::map<int, SearchPlace> search_places(const core::ExperimentLayout& layout, const core::ExperimentConfig& config);

// The trials that have trained, best first (those without a validation last, by number).
std::vector<TrialStanding> rank_trials(const core::ExperimentLayout& layout, const core::ExperimentConfig& config);

// A trial's hyperparameters, (name, value) in the config's order: nested ones by dotted names,
// a constant list or map as its YAML (its resolved config's values).
std::vector<std::pair<std::string, std::string>> hparam_values(const core::ExperimentConfig& resolved);
// The same as "lr=0.1, layers.hidden=64".
std::string hparams_text(const core::ExperimentConfig& resolved);

}  // namespace hpctrial::view
