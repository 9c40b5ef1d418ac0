#include "hpctrial/core/batch_job.h"

#include <algorithm>
#include <sstream>
#include <string_view>

#include "hpctrial/core/shell_quote.h"

namespace hpctrial::core {

bool is_plain_word(const std::string& value) {
  return !value.empty() && std::all_of(value.begin(), value.end(), [](unsigned char c) {
    return std::isalnum(c) || std::string_view("_@%+=:,./-").find(static_cast<char>(c)) != std::string_view::npos;
  });
}

bool refers_to_submitter(const std::string& value) { return value.find("${env:") != std::string::npos; }

std::vector<std::pair<std::string, std::string>> exported_environment(const ExperimentConfig& config,
                                                                      const EnvSource& env) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& var : config.scheduler.environment) {
    if (!refers_to_submitter(var.value)) continue;
    out.emplace_back(var.name, expand_env_references(var.value, env, "scheduler.environment." + var.name));
  }
  return out;
}

std::string render_job_body(const ExperimentConfig& config, const JobBodyOptions& options) {
  const SchedulerConfig& s = config.scheduler;
  std::ostringstream out;
  out << "\numask 077  # what the job writes is private\n";
  // A warning (USR2) or a pause (USR1/USR2) before the launcher handles signals would end the
  // job: ignored until then, when the launcher takes them over. It loses none that matters: it
  // keeps its own deadline before the job's end, and a pause's request is on disk.
  out << "trap '' USR1 USR2\n";
  if (!s.modules.empty()) {
    out << "# Modules (scheduler.modules)\n";
    for (std::size_t i = 0; i < s.modules.size(); ++i) {
      const std::string word = shell_quote(s.modules[i], "scheduler.modules[" + std::to_string(i) + "]");
      out << "module load " << word << " || { echo \"hpctrial: module load " << word
          << " failed (scheduler.modules)\" >&2; exit 1; }\n";
    }
  }
  bool any_export = false;
  for (const auto& var : s.environment) {
    if (refers_to_submitter(var.value)) continue;  // passed by the submit command, never written
    if (!any_export) out << "# Environment (scheduler.environment)\n";
    any_export = true;
    out << "export " << var.name << "=" << shell_quote(var.value, "scheduler.environment." + var.name) << "\n";
  }
  out << "\nexec " << shell_join({options.hpctrial, "launch", "--experiment", options.experiment_dir},
                                 "experiment directory")
      << (options.search_worker                ? std::string(" --search-worker")
          : !options.trial_variable.empty() ? " --trial \"$" + options.trial_variable + "\""
          : options.trial >= 0              ? " --trial " + std::to_string(options.trial)
                                            : std::string())
      << "\n";
  return out.str();
}

}  // namespace hpctrial::core
