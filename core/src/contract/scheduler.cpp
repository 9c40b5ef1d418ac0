#include "hpctrial/core/scheduler.h"

#include <algorithm>

#include "hpctrial/core/error.h"

namespace hpctrial::core {
namespace {

// The first declaration of `key` among the schedulers' options.
const SchedulerOption* find_option(const std::vector<SchedulerOption>& declared, const std::string& key) {
  const auto it = std::find_if(declared.begin(), declared.end(),
                               [&](const SchedulerOption& option) { return option.key == key; });
  return it != declared.end() ? &*it : nullptr;
}

void check_type(const ExperimentConfig& config, const std::vector<const Scheduler*>& schedulers,
                Diagnostics& diagnostics) {
  const SchedulerConfig& s = config.scheduler;
  std::vector<std::string> names;
  for (const Scheduler* scheduler : schedulers) names.push_back(scheduler->name());
  std::string message = "unknown scheduler \"" + s.type + "\"; use one of ";
  for (std::size_t i = 0; i < names.size(); ++i) message += (i ? ", " : "") + names[i];
  const std::string suggestion = closest_match(s.type, names);
  if (!suggestion.empty()) message += " (did you mean '" + suggestion + "'?)";
  const auto at = s.written_at.find("type");
  diagnostics.error(at != s.written_at.end() ? at->second : SourceLocation{config.source_path}, "scheduler.type",
                    message);
}

}  // namespace

std::vector<SchedulerOption> Scheduler::options() const { return {}; }

void Scheduler::check_config(const SchedulerConfig&, Diagnostics&) const {}

std::vector<std::string> Scheduler::submission_warnings(const ExperimentConfig&) const { return {}; }

std::vector<std::string> Scheduler::update_job(const JobUpdate&) const {
  throw ConfigError("the " + name() + " scheduler has no queue of jobs to change");
}

const char* stop_reason_of(StopMode mode) { return mode == StopMode::kEnd ? "cancel" : "pause"; }

bool Scheduler::can_leave_out(const Allocation&, int, int) const { return false; }
bool Scheduler::allows_srun() const { return false; }
std::vector<std::string> Scheduler::end_leftover_steps(const Allocation&) const { return {}; }

void check_scheduler_config(const ExperimentConfig& config, const std::vector<const Scheduler*>& schedulers,
                            Diagnostics& diagnostics) {
  const SchedulerConfig& s = config.scheduler;
  std::vector<SchedulerOption> declared;
  for (const Scheduler* scheduler : schedulers) {
    for (const SchedulerOption& option : scheduler->options()) {
      if (find_option(declared, option.key) == nullptr) declared.push_back(option);
    }
  }
  // The keys of scheduler: as the config reference lists them: type, the schedulers' own, the rest.
  const std::vector<std::string>& common = scheduler_common_keys();
  std::vector<std::string> known = {common.front()};
  for (const SchedulerOption& option : declared) known.push_back(option.key);
  known.insert(known.end(), common.begin() + 1, common.end());
  for (const ConfigEntry& entry : s.options) {
    const std::string path = "scheduler." + entry.key;
    if (const SchedulerOption* option = find_option(declared, entry.key)) {
      check_scheduler_name(entry.value, path, diagnostics, option->allow_at);
    } else {
      diagnostics.error(entry.key_where, path, unknown_key(entry.key, known));
    }
  }
  const auto named = std::find_if(schedulers.begin(), schedulers.end(),
                                  [&](const Scheduler* scheduler) { return scheduler->name() == s.type; });
  if (named != schedulers.end()) {
    (*named)->check_config(s, diagnostics);
    if (config.launcher.mpi == LauncherConfig::Mpi::kSrun && !(*named)->allows_srun()) {
      const auto at = s.written_at.find("type");
      diagnostics.error(at != s.written_at.end() ? at->second : SourceLocation{}, "scheduler.type",
                        "is " + s.type + ", whose jobs do not start ranks with srun, but launcher.mpi is srun; set "
                        "launcher.mpi: mpirun");
    }
  } else {
    check_type(config, schedulers, diagnostics);
  }
}

ExperimentConfig load_experiment_config(const ConfigSources& given, const std::string& site_path,
                                        const std::vector<const Scheduler*>& schedulers) {
  ConfigSources sources = given;
  // Determined's config has a section for each batch scheduler (slurm:, pbs:), none for running here.
  for (const Scheduler* scheduler : schedulers) {
    if (!scheduler->script_name().empty()) sources.scheduler_sections.push_back(scheduler->name());
  }
  return load_experiment_config(sources, site_path, [&](const ExperimentConfig& config, Diagnostics& diagnostics) {
    check_scheduler_config(config, schedulers, diagnostics);
  });
}

const char* to_string(JobState state) {
  switch (state) {
    case JobState::kQueued: return "queued";
    case JobState::kHeld: return "held";
    case JobState::kRunning: return "running";
    case JobState::kEnding: return "ending";
    case JobState::kSuspended: return "suspended";
    case JobState::kEnded: return "ended";
  }
  return "unknown";
}

}  // namespace hpctrial::core
