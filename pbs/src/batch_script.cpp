#include "hpctrial/pbs/batch_script.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <utility>
#include <vector>

#include "hpctrial/core/batch_job.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/search.h"
#include "hpctrial/core/shell_quote.h"
#include "hpctrial/core/text.h"

namespace hpctrial::pbs {
namespace {

constexpr std::size_t kMaxJobName = 236;

// Options hpctrial sets itself: an extra directive may not change them, or rerun, successor
// jobs, output and private files stop working. -l and -W are refused only for these resources
// and attributes.
constexpr const char* kOutput = "the job's output is kept in the experiment directory, where `hpctrial logs` reads it";
const std::pair<char, const char*> kOwnOptions[] = {
    {'r', "the job is rerunnable: PBS reruns it after a node fails, and it resumes from its latest checkpoint"},
    {'j', kOutput},
    {'o', kOutput},
    {'e', kOutput},
    {'k', kOutput},
    {'J', "a search is one array job, one subjob per trial; set searcher.max_concurrent_trials to limit how many "
          "run at once"},
    {'h', "hpctrial holds and releases the job itself: `hpctrial pause` and `hpctrial activate`"},
    {'N', "the job's name comes from the experiment's name; set name instead"},
};
// qsub's options that take no value (OpenPBS: -f -h -I -V -X -z): getopt reads the next letter
// of their word as another option. The others take a value, attached or in the next word.
constexpr const char* kQsubFlags = "fhIVXz";
const char* const kOwnResources[] = {"select", "walltime", "nodes", "ncpus", "mpiprocs", "ngpus", "mem"};
const char* const kOwnAttributes[] = {"umask", "depend", "max_run_subjobs"};

std::vector<std::string> split(const std::string& text, char separator) {
  std::vector<std::string> parts;
  std::stringstream in(text);
  for (std::string part; std::getline(in, part, separator);) parts.push_back(part);
  if (!text.empty() && text.back() == separator) parts.emplace_back();
  return parts;
}

// The name before '=' of "name=value" (the whole word without one).
std::string name_of(const std::string& word) { return word.substr(0, word.find('=')); }

void check_extra_directive(const std::string& extra, const std::string& key) {
  const std::vector<std::string> words = split(extra, ' ');
  const bool one_option = (words.size() == 1 || words.size() == 2) && words[0].size() >= 2 && words[0][0] == '-' &&
                          std::all_of(words.begin(), words.end(), [](const std::string& w) { return core::is_plain_word(w); });
  if (!one_option) {
    throw ConfigError(key + ": \"" + extra + "\" must be one qsub option and its value, separated by one blank, "
                      "each of letters, digits and _@%+=:,./- only, e.g. \"-l place=scatter\"");
  }
  // The word as qsub's getopt reads it: options without a value, then at most one that takes
  // a value, attached to it or in the next word.
  const std::string& word = words[0];
  std::string option, value;
  for (std::size_t i = 1; i < word.size() && option.empty(); ++i) {
    const char letter = word[i];
    for (const auto& [own, reason] : kOwnOptions) {
      if (letter != own) continue;
      const std::string shown = std::string("-") + letter;
      if (word == shown) {
        throw ConfigError(key + ": " + shown + " is set by hpctrial itself (" + reason + "); remove it");
      }
      throw ConfigError(key + ": " + word + " sets " + shown + ": qsub takes an option's value attached to it, and "
                        "several options in one word; " + shown + " is set by hpctrial itself (" + reason +
                        "); remove it");
    }
    if (std::strchr(kQsubFlags, letter) != nullptr) continue;
    option = std::string("-") + letter;
    value = word.substr(i + 1);
  }
  if (!value.empty() && words.size() == 2) {
    throw ConfigError(key + ": \"" + extra + "\" must be one qsub option and its value: " + option + " has its value "
                      "attached already (" + value + ")");
  }
  if (value.empty() && words.size() == 2) value = words[1];
  if (!value.empty() && (option == "-l" || option == "-W")) {
    for (const std::string& item : split(value, ',')) {
      const std::string name = name_of(item);
      const auto& own = option == "-l" ? std::vector<std::string>(std::begin(kOwnResources), std::end(kOwnResources))
                                       : std::vector<std::string>(std::begin(kOwnAttributes), std::end(kOwnAttributes));
      if (std::find(own.begin(), own.end(), name) != own.end()) {
        throw ConfigError(key + ": " + option + " " + name + " is set by hpctrial from " +
                          (option == "-l" ? "resources and scheduler.time_limit" : "the experiment") +
                          "; set it there, or remove this directive");
      }
    }
  }
}

}  // namespace

std::string directive_word(const std::string& value, const std::string& key) {
  if (core::is_plain_word(value)) return value;
  for (char c : value) {
    if (c == '\n' || c == '\r' || c == '\0') {
      throw ConfigError(key + ": holds a line break or a NUL byte, which cannot go into a #PBS line");
    }
  }
  throw ConfigError(key + ": \"" + value + "\" cannot go into a #PBS line: qsub splits directives at blanks and "
                    "reads quotes and '#' its own way; use letters, digits and _@%+=:,./- only");
}

std::string job_name(const std::string& name) {
  std::string out;
  for (char c : name.substr(0, kMaxJobName)) {
    const bool kept = std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '+' || c == '-';
    out += kept ? c : '_';
  }
  if (out.empty() || !std::isalnum(static_cast<unsigned char>(out[0]))) out = ("h" + out).substr(0, kMaxJobName);
  return out;
}

std::string format_walltime(std::int64_t seconds) {
  seconds = std::max<std::int64_t>(1, seconds);
  char text[64];
  std::snprintf(text, sizeof text, "%02lld:%02lld:%02lld", static_cast<long long>(seconds / 3600),
                static_cast<long long>(seconds / 60 % 60), static_cast<long long>(seconds % 60));
  return text;
}

std::string render_batch_script(const core::ExperimentConfig& config, const BatchScriptOptions& options) {
  const core::Resources& r = config.resources;
  const core::SchedulerConfig& s = config.scheduler;
  if (!core::is_plain_word(options.experiment_dir) || options.experiment_dir.find(':') != std::string::npos) {
    throw ConfigError("experiment directory " + options.experiment_dir + ": PBS reads the output path of a #PBS "
                      "line as host:path and splits it at blanks; choose a directory of letters, digits and "
                      "_@%+=,./- only (hpctrial submit --experiment DIR)");
  }
  std::ostringstream out;
  out << (s.modules.empty() ? "#!/bin/bash\n" : "#!/bin/bash -l\n");
  // No config value goes into a comment: a line break there would end it.
  out << "# The batch job of an hpctrial experiment, written by `hpctrial submit` at\n"
      << "# " << core::utc_now_iso() << ". It runs `hpctrial launch` on the\n"
      << "# experiment directory; the launcher starts the ranks with mpirun, checkpoints before the\n"
      << "# walltime ends or on `hpctrial pause`, and submits the job that resumes it. Submitting\n"
      << "# this script again with qsub also resumes.\n";
  auto directive = [&](const std::string& option, const std::string& value, const std::string& key) {
    out << "#PBS " << option << " " << directive_word(value, key) << "\n";
  };
  directive("-N", job_name(config.name), "name");
  const int per_node = std::min(r.slots_per_node, r.slots_per_trial);
  // resources.spare_nodes: chunks beyond the ranks', each on a host of its own (place=scatter).
  std::string select = "select=" + std::to_string(r.nodes() + r.spare_nodes) + ":ncpus=" + std::to_string(per_node * r.cpus_per_slot) +
                       ":mpiprocs=" + std::to_string(per_node);
  if (r.gpus_per_slot > 0) select += ":ngpus=" + std::to_string(r.gpus_per_slot * per_node);
  if (r.memory_per_node_bytes) {
    select += ":mem=" + std::to_string((*r.memory_per_node_bytes + (1u << 20) - 1) >> 20) + "mb";
  }
  directive("-l", select, "resources");
  if (r.spare_nodes > 0) directive("-l", "place=scatter", "resources.spare_nodes");
  if (s.time_limit_seconds) directive("-l", "walltime=" + format_walltime(*s.time_limit_seconds), "scheduler.time_limit");
  if (const std::string queue = s.option("queue"); !queue.empty()) directive("-q", queue, "scheduler.queue");
  if (!s.account.empty()) directive("-A", s.account, "scheduler.account");
  out << "# Rerunnable; one output stream, kept in the experiment directory; private files.\n"
      << "#PBS -r y\n#PBS -j oe\n";
  directive("-o", options.experiment_dir + "/pbs-scheduler.out", "experiment directory");
  out << "#PBS -W umask=077\n";
  // A search's subjob N runs trial N; an adaptive search's is worker N (PBS has no array of one).
  const int workers = options.one_worker ? 1 : core::search_workers(config);
  const int trials = workers > 0 || options.trial >= 0 ? 1 : core::trial_count(config);
  if (workers > 1) {
    out << "# One subjob per worker of the " << core::to_string(config.searcher.name)
        << " searcher (searcher.max_concurrent_trials):\n# each asks the search log which trial to train next.\n";
    out << "#PBS -J 0-" << workers - 1 << "\n";
  } else if (trials > 1) {
    out << "# One subjob per trial of the " << core::to_string(config.searcher.name) << " searcher.\n";
    out << "#PBS -J 0-" << trials - 1 << "\n";
    if (config.searcher.max_concurrent_trials < trials) {
      out << "#PBS -W max_run_subjobs=" << config.searcher.max_concurrent_trials << "\n";
    }
  }
  for (std::size_t i = 0; i < s.extra_directives.size(); ++i) {
    const std::string key = "scheduler.extra_directives[" + std::to_string(i) + "]";
    check_extra_directive(s.extra_directives[i], key);
    out << "#PBS " << s.extra_directives[i] << "\n";
  }
  out << "\n# Every run's output, appended (PBS would copy its own file back only at the end).\n"
      << "exec >>" << core::shell_quote(options.experiment_dir + "/pbs-", "experiment directory")
      << "\"${PBS_JOBID}.out\" 2>&1\n";
  out << core::render_job_body(config, {options.experiment_dir, options.hpctrial, trials > 1 ? "PBS_ARRAY_INDEX" : "",
                                        workers > 0 ? -1 : options.trial, workers > 0});
  return out.str();
}

}  // namespace hpctrial::pbs
