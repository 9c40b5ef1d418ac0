// An experiment directory read once: its trials, their jobs, batches, checkpoints, runs and
// failures, and the ranking; and the same as one JSON document.
#include "hpctrial/view/experiment_view.h"

#include <filesystem>
#include <system_error>

#include "hpctrial/checkpoint/store.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/json_file.h"
#include "hpctrial/core/search.h"

namespace fs = std::filesystem;

namespace hpctrial::view {

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
  std::error_code ec;  // another user's private directory reads as none
  if (!fs::is_directory(dir, ec)) return std::nullopt;
  const checkpoint::CheckpointStore store(dir, {});
  const auto file = store.latest_file();
  if (!file) return std::nullopt;
  const std::string name = fs::path(*file).filename().string();
  return LatestCheckpoint{name, (fs::path(dir) / name).string(), checkpoint::checkpoint_batches(name).value_or(0)};
}

std::optional<std::int64_t> trained_batches(const core::ExperimentLayout& layout, int trial, bool running) {
  if (trial < 0) return std::nullopt;
  const auto progress = core::trial_progress(layout, trial);
  const auto ckpt = latest_checkpoint(layout, trial);
  if (!ckpt && progress.reported_step < 0) return std::nullopt;
  std::int64_t batches = ckpt ? ckpt->batches : 0;
  if (running && progress.reported_step > batches) batches = progress.reported_step;
  return batches;
}

namespace {

InferenceProgress inference_progress(const core::TrialLayout& trial) {
  InferenceProgress out;
  std::error_code ec;
  if (!fs::exists(trial.inference_progress_file(), ec)) return out;
  out.started = true;
  try {
    const nlohmann::json p = core::read_json_file(trial.inference_progress_file());
    out.done = p.value("done", std::int64_t{0});
    out.records = p.value("records", std::int64_t{0});
    out.complete = p.value("complete", false);
    out.source_checkpoint = p.value("source_checkpoint", std::string());
    if (out.complete) out.predictions = p.value("file", std::string());
  } catch (const std::exception& e) {
    out.error = e.what();
  }
  return out;
}

TrialView read_trial(const core::ExperimentLayout& layout, const core::ExperimentConfig& config,
                     const core::Scheduler* scheduler, int trial, int trials) {
  TrialView t;
  t.trial = trial;
  t.directory = layout.trial_dir(trial);
  t.hparams = hparam_values(core::trial_config(config, trial));
  if (scheduler != nullptr) {
    const auto jobs = scheduler->trial_jobs(layout, trial, trials);
    if (!jobs.empty()) t.job = jobs.back();
  }
  t.running = t.job && t.job->state == core::JobState::kRunning;
  t.batches = trained_batches(layout, trial, t.running);
  t.checkpoint = latest_checkpoint(layout, trial);
  t.progress = core::trial_progress(layout, trial);
  if (config.inference) t.inference = inference_progress(core::TrialLayout{t.directory});
  return t;
}

nlohmann::json job_json(const std::string& scheduler, const core::JobStatus& job) {
  return {{"scheduler", scheduler}, {"id", job.id},
          {"state", job.native_state.empty() ? nlohmann::json() : nlohmann::json(core::to_string(job.state))},
          {"native_state", text_or_null(job.native_state)}, {"restarts", job.restarts},
          {"elapsed", text_or_null(job.elapsed)}, {"exit", text_or_null(job.exit)}, {"output", job.output}};
}

nlohmann::json trial_json(const std::string& scheduler, const TrialView& t) {
  nlohmann::json out{{"trial", t.trial}, {"directory", t.directory}, {"job", nullptr}};
  nlohmann::json hparams = nlohmann::json::object();
  for (const auto& [name, value] : t.hparams) hparams[name] = value;
  out["hparams"] = hparams;
  if (t.job) out["job"] = job_json(scheduler, *t.job);
  out["batches"] = t.batches ? nlohmann::json(*t.batches) : nlohmann::json();
  out["checkpoint"] = t.checkpoint ? nlohmann::json(t.checkpoint->path) : nlohmann::json();
  const core::TrialProgress& progress = t.progress;
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
                    {"level", text_or_null(run.level)},
                    {"placement", placement}});
  }
  out["runs"] = runs;
  if (const auto& failed = progress.failed_hand_over) {
    out["failed_hand_over"] = {{"time", failed->time}, {"job", failed->job}, {"tries", failed->tries},
                               {"error", failed->error}, {"resume", failed->resume}};
  }
  if (const auto& inference = t.inference) {
    out["inference"] = {{"records", inference->records}, {"done", inference->done},
                        {"complete", inference->complete},
                        {"source_checkpoint", text_or_null(inference->source_checkpoint)},
                        {"predictions", text_or_null(inference->predictions)},
                        {"error", text_or_null(inference->error)}};
  }
  return out;
}

}  // namespace

ExperimentView read_experiment(const core::ExperimentLayout& layout, const core::ExperimentConfig& config,
                               const core::Scheduler* scheduler) {
  ExperimentView view;
  view.directory = layout.dir;
  view.config = config;
  view.scheduler = scheduler != nullptr ? scheduler->name() : "";
  view.jobs = core::recorded_jobs(layout);
  if (!config.inference) view.ranking = rank_trials(layout, config);
  const int trials = core::trial_count(config);
  for (int trial = 0; trial < trials; ++trial) view.trials.push_back(read_trial(layout, config, scheduler, trial, trials));
  return view;
}

nlohmann::json to_json(const ExperimentView& view) {
  const core::ExperimentConfig& config = view.config;
  nlohmann::json out{{"experiment", config.name},
                     {"directory", view.directory},
                     {"searcher", core::to_string(config.searcher.name)},
                     {"metric", config.searcher.metric},
                     {"smaller_is_better", config.searcher.smaller_is_better},
                     {"max_length", {{"unit", core::to_string(config.searcher.max_length.unit)},
                                     {"value", config.searcher.max_length.value}}},
                     {"max_restarts", config.max_restarts},
                     {"inference", config.inference.has_value()}};
  nlohmann::json jobs = nlohmann::json::array(), ranking = nlohmann::json::array(), trials = nlohmann::json::array();
  for (const auto& job : view.jobs) {
    jobs.push_back({{"scheduler", job.scheduler}, {"id", job.id}, {"submitted", job.submitted}});
  }
  for (const TrialStanding& s : view.ranking) {
    ranking.push_back({{"trial", s.trial}, {"best", s.best ? core::json_number(*s.best) : nlohmann::json()},
                       {"best_batches", s.best_batches}, {"state", s.state},
                       {"checkpoint", text_or_null(s.checkpoint)}, {"hparams", s.hparams}});
  }
  for (const TrialView& t : view.trials) trials.push_back(trial_json(view.scheduler, t));
  out["jobs"] = jobs;
  out["ranking"] = ranking;
  out["trials"] = trials;
  return out;
}

}  // namespace hpctrial::view
