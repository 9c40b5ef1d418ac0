// The qsub script of an experiment, rendered from its config.
//
// Like the sbatch script it is meant to be read: a comment says where it came from, the #PBS
// directives follow from the config (job name, one select chunk per node with its CPUs, MPI
// processes, GPUs and memory, walltime, queue, account), then the directives hpctrial relies on
// (-r y: rerunnable; -j oe with -o in the experiment directory; -W umask=077), a job array for a
// search (-J 0-N, throttled by -W max_run_subjobs), scheduler.extra_directives, and then the
// body bash runs: every run's output appended to pbs-$PBS_JOBID.out in the experiment directory,
// then core::render_job_body() (modules, environment, `exec hpctrial launch`).
//
// qsub reads the #PBS lines itself and splits them at blanks, with no escape that every PBS
// version honours: each value must be one plain word (letters, digits, _@%+=:,./-), or it is
// refused with ConfigError naming its key. The job name alone is sanitised instead (PBS allows
// at most 236 characters, the first a letter or digit). The experiment directory goes into -o,
// where PBS reads "host:path": it must be a plain word without ':'.
// scheduler.environment values that refer to the submitting environment are never written:
// qsub gets them in its own environment and `-v NAME` passes each on by name.
#pragma once

#include <cstdint>
#include <string>

#include "hpctrial/core/experiment_config.h"

namespace hpctrial::pbs {

struct BatchScriptOptions {
  std::string experiment_dir;  // absolute
  std::string hpctrial;        // the hpctrial program the job runs (absolute)
  // -1: the whole experiment (an array job for a search). N: a job for trial N alone, as the
  // launcher submits to resume one trial of a search.
  int trial = -1;
  // An adaptive search: a job of one worker alone, as the launcher submits to resume a worker
  // that stopped (the whole search is an array job of max_concurrent_trials workers).
  bool one_worker = false;
};

std::string render_batch_script(const core::ExperimentConfig& config, const BatchScriptOptions& options);

// The job name PBS accepts: at most 236 characters of letters, digits and _.+-, the first a
// letter or digit; anything else becomes '_'.
std::string job_name(const std::string& name);

// PBS's walltime: "HH:MM:SS", hours unbounded (at least one second).
std::string format_walltime(std::int64_t seconds);

// One value of a #PBS line; ConfigError naming `key` when PBS could read it otherwise.
std::string directive_word(const std::string& value, const std::string& key);

}  // namespace hpctrial::pbs
