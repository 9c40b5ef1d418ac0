// What an experiment directory says, read once for every view of it: `hpctrial describe` (text
// and --json), `jobs`, `plot` and `report` take their values from here, so that the forms cannot
// disagree. Reads files and asks the scheduler; writes nothing.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "hpctrial/core/experiment_config.h"
#include "hpctrial/core/experiment_dir.h"
#include "hpctrial/core/layout.h"
#include "hpctrial/core/scheduler.h"
#include "hpctrial/view/ranking.h"

namespace hpctrial::view {

// The file `latest` names in a trial's checkpoint directory (where checkpoint_storage puts it),
// and its batch count.
struct LatestCheckpoint {
  std::string file;
  std::string path;
  std::int64_t batches = 0;
};
std::optional<LatestCheckpoint> latest_checkpoint(const core::ExperimentLayout& layout, int trial);

// Batches trained: what rank 0 last reported while `running`, else the latest checkpoint's;
// nullopt when neither says.
std::optional<std::int64_t> trained_batches(const core::ExperimentLayout& layout, int trial, bool running);

// An inference trial's records: predicted and durable, from its progress record.
struct InferenceProgress {
  bool started = false;  // a progress record exists
  std::int64_t done = 0;
  std::int64_t records = 0;
  bool complete = false;
  std::string source_checkpoint;
  std::string predictions;  // the predictions file, once complete
  std::string error;        // the record could not be read: why
};

// One trial: its directory, hyperparameters, latest job, batches, checkpoint, runs and failures.
struct TrialView {
  int trial = 0;
  std::string directory;
  std::vector<std::pair<std::string, std::string>> hparams;
  std::optional<core::JobStatus> job;  // its latest job as the scheduler knows it now
  bool running = false;
  std::optional<std::int64_t> batches;
  std::optional<LatestCheckpoint> checkpoint;
  core::TrialProgress progress;
  std::optional<InferenceProgress> inference;  // an inference experiment's trial
};

struct ExperimentView {
  std::string directory;
  core::ExperimentConfig config;
  std::string scheduler;                 // the scheduler that knows its jobs; empty: none asked
  std::vector<core::RecordedJob> jobs;   // as submitted, oldest first
  std::vector<TrialStanding> ranking;    // empty for an inference experiment
  std::vector<TrialView> trials;         // every trial of the config, by number
};

// Reads the experiment; `scheduler` (may be null: no jobs asked) says what became of its jobs.
ExperimentView read_experiment(const core::ExperimentLayout& layout, const core::ExperimentConfig& config,
                               const core::Scheduler* scheduler);

// The view as `describe --json` prints it and `report` draws it: names and values of the text
// form, a NaN metric as "NaN", what is not known as null.
nlohmann::json to_json(const ExperimentView& view);

// A string as JSON, null when empty.
nlohmann::json text_or_null(const std::string& text);

}  // namespace hpctrial::view
