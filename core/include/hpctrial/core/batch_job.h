// What every scheduler's batch script of an experiment shares, whatever its directives: the
// body that bash runs (private umask, `module load` lines, exports of scheduler.environment,
// `exec hpctrial launch`), and the environment handed to the submit command instead of being
// written.
//
// scheduler.environment values that refer to the submitting environment (${env:NAME}) are
// never written into a script: the submit command gets them in its own environment and passes
// them on (sbatch --export=ALL, qsub -v NAME), so no value lands in a script, a log or an argv.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "hpctrial/core/env.h"
#include "hpctrial/core/experiment_config.h"

namespace hpctrial::core {

struct JobBodyOptions {
  std::string experiment_dir;  // absolute
  std::string hpctrial;        // the hpctrial program the job runs (absolute)
  // For a search (one array task per trial): the variable holding the task's index, e.g.
  // SLURM_ARRAY_TASK_ID. Empty for a single trial.
  std::string trial_variable;
  // Without a trial_variable: the one trial this job runs (-1: trial 0, no --trial given).
  int trial = -1;
  // An adaptive search's worker (`--search-worker`): the search gives it its trials; no --trial.
  bool search_worker = false;
};

// From `umask 077` to the `exec hpctrial launch` line, every word quoted by shell_quote.
std::string render_job_body(const ExperimentConfig& config, const JobBodyOptions& options);

// Whether a scheduler.environment value refers to the submitting environment.
bool refers_to_submitter(const std::string& value);

// The scheduler.environment variables whose values refer to the submitting environment, as
// NAME=value with the references resolved from `env`.
std::vector<std::pair<std::string, std::string>> exported_environment(const ExperimentConfig& config,
                                                                      const EnvSource& env);

// A value made of letters, digits and _@%+=:,./- only: the same word to bash and to every
// scheduler's directive parser.
bool is_plain_word(const std::string& value);

}  // namespace hpctrial::core
