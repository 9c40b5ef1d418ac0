#include "hpctrial/slurm/batch_script.h"

#include <algorithm>
#include <cstring>
#include <sstream>
#include <vector>

#include "hpctrial/core/batch_job.h"
#include "hpctrial/core/env.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/search.h"
#include "hpctrial/core/shell_quote.h"
#include "hpctrial/core/text.h"

namespace hpctrial::slurm {
namespace {

// Options hpctrial sets itself: an extra directive may not change them, or pause, requeue and
// logs stop working. `letter` is the short form, if the option has one.
struct OwnOption {
  const char* name;  // without "--"
  char letter;
  const char* reason;
};
constexpr const char* kRequeues = "hpctrial requeues the job to resume it after a pause, a preemption or the time limit";
constexpr const char* kOutput = "the job's output goes to the experiment directory, where `hpctrial logs` reads it";
constexpr const char* kEnvironment = "the job's environment comes from scheduler.environment; set variables there";
const OwnOption kOwnOptions[] = {
    {"requeue", 0, kRequeues},
    {"no-requeue", 0, kRequeues},
    {"open-mode", 0, "every run of a requeued job appends to the same output files"},
    {"signal", 0, "the launcher checkpoints on the USR2 that Slurm sends scheduler.preemption_grace before the end; "
                  "set scheduler.preemption_grace instead"},
    {"output", 'o', kOutput},
    {"error", 'e', kOutput},
    {"export", 0, kEnvironment},
    {"export-file", 0, kEnvironment},
    {"array", 'a', "a search is one job array, one task per trial (or per worker of an adaptive search); set "
                   "searcher.max_concurrent_trials to limit how many run at once"},
    {"parsable", 0, "hpctrial reads sbatch's answer to learn the job id"},
    {"wrap", 0, "the batch script hpctrial writes is the job"},
    {"hold", 'H', "hpctrial holds and releases the job itself: `hpctrial pause` and `hpctrial activate`"},
};

// sbatch's short options that take no value (Slurm 22.05: -H -O -Q -s -v -W, and -h -V, which
// end sbatch): getopt reads the next letter of their word as another option. The others take
// a value, attached or in the next word (-k an optional one, attached only).
constexpr const char* kShortFlags = "HOQsvWhV";

std::string own_refusal(const std::string& key, const std::string& option, const OwnOption& own) {
  return key + ": " + option + " is set by hpctrial itself (" + own.reason + "); remove it";
}

// Why an extra directive would change an option of ours as sbatch reads it with getopt_long:
// the long option, a unique prefix of it, or its short form with its value attached and after
// other short options in one word; "" when it changes none.
std::string refusal(const std::string& extra, const std::string& key) {
  if (extra.rfind("--", 0) == 0) {
    const std::string word = extra.substr(0, extra.find_first_of("= \t"));
    const std::string name = word.substr(2);
    if (name.empty()) return "";
    std::vector<const OwnOption*> abbreviated;
    for (const OwnOption& own : kOwnOptions) {
      if (name == own.name) return own_refusal(key, word, own);  // an exact name wins over a longer one
      if (std::string(own.name).rfind(name, 0) == 0) abbreviated.push_back(&own);
    }
    // No option of sbatch is a proper prefix of one of these: a prefix of ours is ours, or
    // ambiguous, which sbatch refuses anyway.
    if (abbreviated.empty()) return "";
    std::string meant, reasons;
    for (const OwnOption* own : abbreviated) {
      meant += (meant.empty() ? "--" : " or --") + std::string(own->name);
      if (reasons.find(own->reason) == std::string::npos) reasons += (reasons.empty() ? "" : "; ") + std::string(own->reason);
    }
    return key + ": " + word + " abbreviates " + meant + " (sbatch accepts any unambiguous prefix of a long option); " +
           (abbreviated.size() == 1 ? meant + " is" : std::string("each is")) + " set by hpctrial itself (" + reasons +
           "); remove it";
  }
  for (std::size_t i = 1; i < extra.size(); ++i) {
    const char letter = extra[i];
    for (const OwnOption& own : kOwnOptions) {
      if (own.letter == 0 || own.letter != letter) continue;
      const std::string option = std::string("-") + letter;
      const std::string word = extra.substr(0, extra.find_first_of(" \t"));
      if (word == option) return own_refusal(key, option, own);
      return key + ": " + word + " sets " + option + " (--" + own.name + "): sbatch takes a short option's value "
             "attached to it, and several short options in one word; " + option + " is set by hpctrial itself (" +
             own.reason + "); remove it";
    }
    if (std::strchr(kShortFlags, letter) == nullptr || letter == '\0') return "";  // the rest is its value
  }
  return "";
}

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
  } else if (r.spare_nodes > 0) {
    out << "# " << r.spare_nodes << " spare node(s) beyond the ranks' (resources.spare_nodes): one takes the ranks of a "
        << "node they failed on.\n";
    directive("--nodes", std::to_string(r.nodes() + r.spare_nodes), "resources.spare_nodes");
    directive("--ntasks-per-node", std::to_string(std::min(r.slots_per_node, r.slots_per_trial)),
              "resources.slots_per_node");
  } else {
    directive("--nodes", std::to_string(r.nodes()), "resources.slots_per_trial");
    directive("--ntasks-per-node", std::to_string(std::min(r.slots_per_node, r.slots_per_trial)),
              "resources.slots_per_node");
  }
  directive("--cpus-per-task", std::to_string(r.cpus_per_slot), "resources.cpus_per_slot");
  if (r.gpus_per_slot > 0) {
    const std::string type = s.option("gpu_type");
    directive("--gpus-per-node",
              (type.empty() ? "" : type + ":") +
                  std::to_string(r.gpus_per_slot * std::min(r.slots_per_node, r.slots_per_trial)),
              "resources.gpus_per_slot");
  }
  if (r.memory_per_node_bytes) {
    const std::uint64_t mib = (*r.memory_per_node_bytes + (1u << 20) - 1) >> 20;
    directive("--mem", std::to_string(mib) + "M", "resources.memory_per_node");
  }
  if (s.time_limit_seconds) directive("--time", format_time_limit(*s.time_limit_seconds), "scheduler.time_limit");
  if (const std::string partition = s.option("partition"); !partition.empty()) {
    directive("--partition", partition, "scheduler.partition");
  }
  if (!s.account.empty()) directive("--account", s.account, "scheduler.account");
  if (const std::string qos = s.option("qos"); !qos.empty()) directive("--qos", qos, "scheduler.qos");
  out << "# Requeued on preemption, pause and time limit; output appended across runs.\n";
  out << "#SBATCH --requeue\n#SBATCH --open-mode=append\n";
  directive("--signal", "B:USR2@" + std::to_string(s.preemption_grace_seconds), "scheduler.preemption_grace");
  // A search is one job array: task N runs trial N; or, for an adaptive search, task N is worker N.
  const int workers = core::search_workers(config);
  const int trials = workers > 0 ? 1 : core::trial_count(config);
  if (workers > 0) {
    out << "# One array task per worker of the " << core::to_string(config.searcher.name)
        << " searcher (searcher.max_concurrent_trials):\n# each asks the search log which trial to train next.\n";
    directive("--array", "0-" + std::to_string(workers - 1), "searcher.max_concurrent_trials");
  } else if (trials > 1) {
    out << "# One array task per trial of the " << core::to_string(config.searcher.name) << " searcher.\n";
    std::string range = "0-" + std::to_string(trials - 1);
    if (config.searcher.max_concurrent_trials < trials) {
      range += "%" + std::to_string(config.searcher.max_concurrent_trials);
    }
    directive("--array", range, "searcher");
  }
  // A worker's output names it as one (worker_output, scheduler.cpp).
  const std::string name = workers > 0 ? "slurm-%A_w%a" : trials > 1 ? "slurm-%A_%a" : "slurm-%j";
  directive("--output", literal_filename(options.experiment_dir) + "/" + name + ".out", "experiment directory");
  directive("--error", literal_filename(options.experiment_dir) + "/" + name + ".err", "experiment directory");
  for (std::size_t i = 0; i < s.extra_directives.size(); ++i) {
    const std::string& extra = s.extra_directives[i];
    const std::string key = "scheduler.extra_directives[" + std::to_string(i) + "]";
    if (const std::string why = refusal(extra, key); !why.empty()) throw ConfigError(why);
    if (extra.find('#') != std::string::npos || extra.find_first_of(" \t") != std::string::npos) {
      throw ConfigError(key + ": \"" + extra + "\" must be one option without blanks or '#', e.g. "
                        "--constraint=a100 rather than -C a100");
    }
    out << "#SBATCH " << directive_value(extra, key) << "\n";
  }
  out << core::render_job_body(config, {options.experiment_dir, options.hpctrial,
                                        trials > 1 ? "SLURM_ARRAY_TASK_ID" : "", -1, workers > 0});
  return out.str();
}

}  // namespace hpctrial::slurm
