// What `hpctrial describe` (as text and --json), `jobs` and `report` read of an experiment
// directory: a trial's latest checkpoint and batches, and the experiment as one JSON model.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>

#include "hpctrial/core/experiment_config.h"
#include "hpctrial/core/layout.h"
#include "job_verbs.h"

namespace hpctrial::cli {

// The file `latest` names in a trial's checkpoint directory (where checkpoint_storage puts it),
// and its batch count.
struct LatestCheckpoint {
  std::string file;
  std::string path;
  std::int64_t batches = 0;
};
std::optional<LatestCheckpoint> latest_checkpoint(const core::ExperimentLayout& layout, int trial);

// Batches trained: what rank 0 last reported while running, else the latest checkpoint's; "-"
// when neither says.
std::string batches_text(const core::ExperimentLayout& layout, int trial, bool running);

// A string as JSON, null when empty.
nlohmann::json text_or_null(const std::string& text);

// The experiment as `describe --json` prints it: its name, directory, searcher, jobs, the trials
// ranked by the metric, and each trial (hyperparameters, its job, batches, checkpoint, runs,
// failures). `t` names the scheduler that knows its jobs.
nlohmann::json describe_model(const Target& t, const core::ExperimentLayout& layout, const core::ExperimentConfig& config);

}  // namespace hpctrial::cli
