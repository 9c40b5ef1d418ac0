// The sbatch script of an experiment, rendered from its config.
//
// The script is meant to be read: a comment says where it came from, the #SBATCH directives
// follow from the config (job name, nodes, tasks per node, CPUs per task, GPUs, memory, time
// limit, partition, account, QoS), then the directives hpctrial relies on (--requeue,
// --open-mode=append, --signal=B:USR2@<preemption_grace>, output and error files in the
// experiment directory), then scheduler.extra_directives, then `module load` lines, exports of
// scheduler.environment and `exec hpctrial launch --experiment DIR`.
//
// Two parsers read it, and every value is made safe for both:
// - Slurm reads the #SBATCH lines itself: it splits them at blanks, takes ' and " as quotes and
//   \ as an escape, and ends a line at an unquoted '#'. Values that are plain words stay as they
//   are; others are double-quoted; a value holding a newline, a NUL, a quote or a backslash
//   could be misread and is refused with ConfigError naming its key.
// - bash reads the rest: every word goes through core::shell_quote.
// The body after the directives is core::render_job_body(); scheduler.environment values that
// refer to the submitting environment are passed to sbatch in its environment
// (core::exported_environment(); sbatch --export=ALL passes them on), never written.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "hpctrial/core/env.h"
#include "hpctrial/core/experiment_config.h"

namespace hpctrial::slurm {

struct BatchScriptOptions {
  std::string experiment_dir;  // absolute
  std::string hpctrial;        // the hpctrial program the job runs (absolute)
};

std::string render_batch_script(const core::ExperimentConfig& config, const BatchScriptOptions& options);

// One value of an #SBATCH line, as Slurm's directive parser will read it back; ConfigError
// naming `key` when it cannot be written safely.
std::string directive_value(const std::string& value, const std::string& key);

// Slurm's --time: "D-HH:MM:SS" (at least one minute).
std::string format_time_limit(std::int64_t seconds);

}  // namespace hpctrial::slurm
