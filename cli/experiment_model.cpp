// What `hpctrial describe` (as text and --json) and `hpctrial report` read of an experiment
// directory: one model, so that its forms cannot disagree.
#include "experiment_model.h"

#include <filesystem>

#include "hpctrial/checkpoint/store.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/experiment_dir.h"
#include "hpctrial/core/json_file.h"
#include "hpctrial/core/search.h"
#include "ranking.h"

namespace fs = std::filesystem;

namespace hpctrial::cli {

nlohmann::json text_or_null(const std::string& text) { return text.empty() ? nlohmann::json() : nlohmann::json(text); }

std::optional<LatestCheckpoint> latest_checkpoint(const core::ExperimentLayout& layout, int trial) {
  const core::TrialLayout trial_layout = layout.trial(trial);
  std::string dir = trial_layout.default_checkpoint_dir();
  try {  // where the trainer put them: checkpoint_storage.host_path may say elsewhere
    dir = core::checkpoint_dir(core::load_experiment_config({layout.config(), "", {}}), trial_layout, trial,
                               core::experiment_identity(layout));
  } catch (const Error&) {
    // no readable experiment.yaml: the default place
  }
  if (!fs::is_directory(dir)) return std::nullopt;
  const checkpoint::CheckpointStore store(dir, {});
  const auto file = store.latest_file();
  if (!file) return std::nullopt;
  const std::string name = fs::path(*file).filename().string();
  return LatestCheckpoint{name, (fs::path(dir) / name).string(), checkpoint::checkpoint_batches(name).value_or(0)};
}

// Batches trained: what rank 0 last reported while running, else the latest checkpoint's.
std::string batches_text(const core::ExperimentLayout& layout, int trial, bool running) {
  if (trial < 0) return "-";
  const auto progress = core::trial_progress(layout, trial);
  const auto ckpt = latest_checkpoint(layout, trial);
  std::int64_t batches = ckpt ? ckpt->batches : 0;
  if (running && progress.reported_step > batches) batches = progress.reported_step;
  if (!ckpt && progress.reported_step < 0) return "-";
  return std::to_string(batches);
}

namespace {

// One trial as `describe --json` gives it: what the text says of it, as values.
nlohmann::json trial_json(const Target& t, const core::ExperimentLayout& layout, const core::ExperimentConfig& config,
                          int trial, int trials) {
  const auto jobs = t.scheduler->trial_jobs(layout, trial, trials);
  nlohmann::json out{{"trial", trial}, {"directory", layout.trial_dir(trial)}, {"job", nullptr}};
  nlohmann::json hparams = nlohmann::json::object();
  for (const auto& [name, value] : hparam_values(core::trial_config(config, trial))) hparams[name] = value;
  out["hparams"] = hparams;
  if (!jobs.empty()) {
    const core::JobStatus& job = jobs.back();
    out["job"] = {{"scheduler", t.scheduler->name()}, {"id", job.id},
                  {"state", job.native_state.empty() ? nlohmann::json() : nlohmann::json(core::to_string(job.state))},
                  {"native_state", text_or_null(job.native_state)}, {"restarts", job.restarts},
                  {"elapsed", text_or_null(job.elapsed)}, {"exit", text_or_null(job.exit)}, {"output", job.output}};
  }
  const bool running = !jobs.empty() && jobs.back().state == core::JobState::kRunning;
  const std::string batches = batches_text(layout, trial, running);
  out["batches"] = batches == "-" ? nlohmann::json() : nlohmann::json(std::stoll(batches));
  const auto ckpt = latest_checkpoint(layout, trial);
  out["checkpoint"] = ckpt ? nlohmann::json(ckpt->path) : nlohmann::json();
  const auto progress = core::trial_progress(layout, trial);
  out["starts"] = progress.starts;
  out["failures"] = progress.failures;
  out["last_failure"] = text_or_null(progress.last_failure);
  nlohmann::json runs = nlohmann::json::array();
  for (const core::TrialRun& run : progress.runs) {
    nlohmann::json placement = nlohmann::json::array();
    for (const auto& place : run.placement) placement.push_back({{"host", place.host}, {"cpus", place.cpus}, {"device", place.device}});
    runs.push_back({{"started", run.started}, {"ranks", run.ranks}, {"batch", run.batch}, {"local_batch", run.local_batch},
                    {"accumulation", run.accumulation}, {"from_batches", run.batches},
                    {"from_record", run.from_record ? nlohmann::json(*run.from_record) : nlohmann::json()},
                    {"launcher", text_or_null(run.launcher)}, {"image", text_or_null(run.image)},
                    {"placement", placement}});
  }
  out["runs"] = runs;
  if (const auto& failed = progress.failed_hand_over) {
    out["failed_hand_over"] = {{"time", failed->time}, {"job", failed->job}, {"tries", failed->tries},
                               {"error", failed->error}, {"resume", failed->resume}};
  }
  return out;
}

}  // namespace

nlohmann::json describe_model(const Target& t, const core::ExperimentLayout& layout, const core::ExperimentConfig& config) {
  const int trials = core::trial_count(config);
  nlohmann::json out{{"experiment", config.name},
                     {"directory", layout.dir},
                     {"searcher", core::to_string(config.searcher.name)},
                     {"metric", config.searcher.metric},
                     {"smaller_is_better", config.searcher.smaller_is_better},
                     {"max_length", {{"unit", core::to_string(config.searcher.max_length.unit)},
                                     {"value", config.searcher.max_length.value}}},
                     {"max_restarts", config.max_restarts},
                     {"inference", config.inference.has_value()}};
  nlohmann::json jobs = nlohmann::json::array(), ranking = nlohmann::json::array(), list = nlohmann::json::array();
  for (const auto& job : core::recorded_jobs(layout)) {
    jobs.push_back({{"scheduler", job.scheduler}, {"id", job.id}, {"submitted", job.submitted}});
  }
  for (const TrialStanding& s : config.inference ? std::vector<TrialStanding>{} : rank_trials(layout, config)) {
    ranking.push_back({{"trial", s.trial}, {"best", s.best ? core::json_number(*s.best) : nlohmann::json()},
                       {"best_batches", s.best_batches}, {"state", s.state},
                       {"checkpoint", text_or_null(s.checkpoint)}, {"hparams", s.hparams}});
  }
  for (int trial = 0; trial < trials; ++trial) list.push_back(trial_json(t, layout, config, trial, trials));
  out["jobs"] = jobs;
  out["ranking"] = ranking;
  out["trials"] = list;
  return out;
}


}  // namespace hpctrial::cli
