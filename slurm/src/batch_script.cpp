#include "hpctrial/slurm/batch_script.h"

#include <algorithm>
#include <sstream>

#include "hpctrial/core/batch_job.h"
#include "hpctrial/core/env.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/search.h"
#include "hpctrial/core/shell_quote.h"
#include "hpctrial/core/text.h"

namespace hpctrial::slurm {
namespace {

// Options hpctrial sets itself: an extra directive may not change them, or pause, requeue and
// logs stop working.
const char* const kOwnOptions[] = {"--requeue", "--no-requeue", "--open-mode", "--signal", "--output", "-o",
                                   "--error", "-e", "--export", "--export-file", "--array", "-a", "--parsable",
                                   "--wrap", "--hold", "-H"};

// What Slurm's filename patterns would expand ('%j' and the like), escaped.
std::string literal_filename(const std::string& path) {
  std::string out;
  for (char c : path) out += c == '%' ? std::string("%%") : std::string(1, c);
  return out;
}

}  // namespace

std::string directive_value(const std::string& value, const std::string& key) {
  for (char c : value) {
    if (c == '\n' || c == '\r' || c == '\0') {
      throw ConfigError(key + ": holds a line break or a NUL byte, which cannot go into an #SBATCH line");
    }
    if (c == '"' || c == '\'' || c == '\\') {
      throw ConfigError(key + ": holds " + (c == '\\' ? std::string("a backslash") : "a quote (" + std::string(1, c) + ")") +
                        ", which Slurm's #SBATCH parser would take as quoting; leave it out");
    }
  }
  if (value.empty()) throw ConfigError(key + ": is empty, which cannot go into an #SBATCH line");
  if (core::is_plain_word(value)) return value;
  return "\"" + value + "\"";  // blanks and '#' stay literal inside double quotes
}

std::string format_time_limit(std::int64_t seconds) {
  const std::int64_t minutes = std::max<std::int64_t>(1, (seconds + 59) / 60);
  const std::int64_t days = minutes / (24 * 60);
  char text[64];
  std::snprintf(text, sizeof text, "%lld-%02lld:%02lld:00", static_cast<long long>(days),
                static_cast<long long>(minutes / 60 % 24), static_cast<long long>(minutes % 60));
  return text;
}

std::string render_batch_script(const core::ExperimentConfig& config, const BatchScriptOptions& options) {
  const core::Resources& r = config.resources;
  const core::SchedulerConfig& s = config.scheduler;
  std::ostringstream out;
  out << (s.modules.empty() ? "#!/bin/bash\n" : "#!/bin/bash -l\n");
  // No config value goes into a comment: a line break there would end it.
  out << "# The batch job of an hpctrial experiment, written by `hpctrial submit` at\n"
      << "# " << core::utc_now_iso() << ". It runs `hpctrial launch` on the\n"
      << "# experiment directory; the launcher starts the ranks with mpirun, turns Slurm's USR2\n"
      << "# warning into a checkpoint, and requeues the job to resume. Submitting it again with\n"
      << "# sbatch also resumes.\n";
  auto directive = [&](const std::string& option, const std::string& value, const std::string& key) {
    out << "#SBATCH " << option << "=" << directive_value(value, key) << "\n";
  };
  directive("--job-name", config.name, "name");
  if (r.elastic()) {
    // As many nodes as are free within the range: Slurm gives a job no more nodes than tasks,
    // so the tasks are the most the job runs (packed on fewer nodes when fewer are granted); the
    // launcher runs slots_per_node ranks on each node it got.
    out << "# Elastic: any number of nodes in the range; the launcher starts as many ranks as granted.\n";
    directive("--nodes", std::to_string(r.min_nodes()) + "-" + std::to_string(r.nodes()), "resources.min_slots_per_trial");
    directive("--ntasks", std::to_string(r.slots_per_trial), "resources.slots_per_trial");
  } else {
    directive("--nodes", std::to_string(r.nodes()), "resources.slots_per_trial");
    directive("--ntasks-per-node", std::to_string(std::min(r.slots_per_node, r.slots_per_trial)),
              "resources.slots_per_node");
  }
  directive("--cpus-per-task", std::to_string(r.cpus_per_slot), "resources.cpus_per_slot");
  if (r.gpus_per_slot > 0) {
    directive("--gpus-per-node", std::to_string(r.gpus_per_slot * std::min(r.slots_per_node, r.slots_per_trial)),
              "resources.gpus_per_slot");
  }
  if (r.memory_per_node_bytes) {
    const std::uint64_t mib = (*r.memory_per_node_bytes + (1u << 20) - 1) >> 20;
    directive("--mem", std::to_string(mib) + "M", "resources.memory_per_node");
  }
  if (s.time_limit_seconds) directive("--time", format_time_limit(*s.time_limit_seconds), "scheduler.time_limit");
  if (!s.partition.empty()) directive("--partition", s.partition, "scheduler.partition");
  if (!s.account.empty()) directive("--account", s.account, "scheduler.account");
  if (!s.qos.empty()) directive("--qos", s.qos, "scheduler.qos");
  out << "# Requeued on preemption, pause and time limit; output appended across runs.\n";
  out << "#SBATCH --requeue\n#SBATCH --open-mode=append\n";
  directive("--signal", "B:USR2@" + std::to_string(s.preemption_grace_seconds), "scheduler.preemption_grace");
  // A search is one job array: task N runs trial N.
  const int trials = core::trial_count(config);
  if (trials > 1) {
    out << "# One array task per trial of the " << core::to_string(config.searcher.name) << " searcher.\n";
    std::string range = "0-" + std::to_string(trials - 1);
    if (config.searcher.max_concurrent_trials < trials) {
      range += "%" + std::to_string(config.searcher.max_concurrent_trials);
    }
    directive("--array", range, "searcher");
  }
  const std::string name = trials > 1 ? "slurm-%A_%a" : "slurm-%j";
  directive("--output", literal_filename(options.experiment_dir) + "/" + name + ".out", "experiment directory");
  directive("--error", literal_filename(options.experiment_dir) + "/" + name + ".err", "experiment directory");
  for (std::size_t i = 0; i < s.extra_directives.size(); ++i) {
    const std::string& extra = s.extra_directives[i];
    const std::string key = "scheduler.extra_directives[" + std::to_string(i) + "]";
    const std::string option = extra.substr(0, extra.find_first_of("= "));
    for (const char* own : kOwnOptions) {
      if (option == own) {
        throw ConfigError(key + ": " + option + " is set by hpctrial itself (requeue, signals and output files "
                          "depend on it); remove it");
      }
    }
    if (extra.find('#') != std::string::npos || extra.find_first_of(" \t") != std::string::npos) {
      throw ConfigError(key + ": \"" + extra + "\" must be one option without blanks or '#', e.g. "
                        "--constraint=a100 rather than -C a100");
    }
    out << "#SBATCH " << directive_value(extra, key) << "\n";
  }
  out << core::render_job_body(config, {options.experiment_dir, options.hpctrial,
                                        trials > 1 ? "SLURM_ARRAY_TASK_ID" : "", -1});
  return out.str();
}

}  // namespace hpctrial::slurm
