// What the job verbs (pause, activate, kill, jobs, logs, describe) share: naming a job by its id
// or by its experiment directory, and the scheduler that runs it.
#pragma once

#include <boost/program_options.hpp>

#include <string>
#include <vector>

#include "hpctrial/core/experiment_config.h"
#include "hpctrial/core/scheduler.h"

namespace hpctrial::cli {

// A job or an experiment a user named, with the scheduler that runs it.
struct Target {
  const core::Scheduler* scheduler = nullptr;
  core::JobTarget jobs;  // the experiment directory (empty when not found) and the job named, if any
  std::string job;       // the job named, else the experiment's latest job (empty: none)
};

// JOB|EXPDIR -> the scheduler and the job or experiment. A directory's scheduler is its latest
// job's; a job's experiment directory is where its output file lies. ConfigError for anything
// else, and for a directory with no batch job when `need_job`.
Target resolve_target(const std::string& what, bool need_job = true);

// The one positional argument of a verb, JOB|EXPDIR, with the verb's own `options` (read
// into `vm`) if it has any; empty after --help.
std::string target_argument(const std::vector<std::string>& args, const char* verb, const char* usage,
                            const boost::program_options::options_description* options = nullptr,
                            boost::program_options::variables_map* vm = nullptr);

// JOB|EXPDIR -> its experiment: resolve_target's, which must name an experiment directory (one
// holding experiment.yaml). SchedulerError or ConfigError saying what was found instead.
Target experiment_target(const std::string& what);

// A job's state as the scheduler writes it, and whether it is held: "PENDING (held)".
std::string state_text(const core::JobStatus& job);

}  // namespace hpctrial::cli
