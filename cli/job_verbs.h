// What the job verbs (pause, activate, kill, jobs, logs, describe, submit) share: naming a job
// by its id or by its experiment directory, and the state of its tasks.
#pragma once

#include <boost/program_options.hpp>

#include <string>
#include <vector>

#include "hpctrial/mpi_launcher/launcher.h"
#include "hpctrial/slurm/client.h"

namespace hpctrial::cli {

struct Target {
  std::string job;             // "1234", or "1234_2" for one task of an array
  std::string experiment_dir;  // empty when not known
};

// JOB or EXPDIR -> the job and, where it can be found, its experiment directory (a job's output
// file lies in its experiment directory). ConfigError for anything else.
Target resolve_target(const std::string& what, const slurm::Client& client);

// Every task of the job (one for a plain job); SchedulerError once Slurm has forgotten it.
std::vector<slurm::JobInfo> known_tasks(const std::string& id, const slurm::Client& client);

// The trial a task runs: its array index, 0 for a plain job; -1 for a line of tasks not started.
int trial_of(const slurm::JobInfo& task);

// Whether Slurm still counts the job as live (it could still run or is running).
bool is_active(const slurm::JobInfo& job);

// The one positional argument of a verb, JOB|EXPDIR, with the verb's own `options` (read
// into `vm`) if it has any; empty after --help.
std::string target_argument(const std::vector<std::string>& args, const char* verb, const char* usage,
                            const boost::program_options::options_description* options = nullptr,
                            boost::program_options::variables_map* vm = nullptr);

}  // namespace hpctrial::cli
