// hpctrial submit: an experiment as a batch job of its scheduler (the generated script, saved in
// the experiment directory), resumed when submitted again.
#include <boost/program_options.hpp>

#include <sys/stat.h>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <iostream>

#include "hpctrial/core/experiment_dir.h"
#include "hpctrial/core/batch_job.h"
#include "hpctrial/core/env.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/experiment_config.h"
#include "hpctrial/core/files.h"
#include "hpctrial/core/logging.h"
#include "hpctrial/core/search.h"
#include "hpctrial/core/subprocess.h"
#include "hpctrial/core/text.h"
#include "hpctrial/launcher/launcher.h"
#include "hpctrial/launcher/schedulers.h"
#include "job_verbs.h"
#include "site_defaults.h"
#include "verb.h"
#include "verb_args.h"

namespace po = boost::program_options;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace hpctrial::cli {
namespace {

constexpr const char* kUsage = R"(usage: hpctrial submit EXP.yaml [options]

Submits the experiment as a batch job to Slurm or PBS (scheduler.type, or --scheduler): makes
the experiment directory (default runs/<name>), writes the effective config and the batch script
there (job.sbatch or job.pbs, readable), and submits it with sbatch or qsub. Prints the job id.
The job checkpoints before its time limit, on a preemption warning and on `hpctrial pause`, then
goes back to the queue (Slurm: the job requeues itself; PBS: the job submits the one that resumes
it); submitting the same experiment again also resumes it from its latest checkpoint.

examples:
  hpctrial submit experiment.yaml
  hpctrial submit experiment.yaml --set scheduler.time_limit=4h --set resources.slots_per_trial=8
  hpctrial submit experiment.yaml --dry-run       # print the script; submit nothing
  hpctrial submit experiment.yaml --scheduler pbs --set scheduler.queue=workq
  job=$(hpctrial submit experiment.yaml --parsable)

)";

// hpctrial submit: the experiment's batch script written and submitted; an adaptive search's is
// a job array of its workers.
int run_submit(const std::vector<std::string>& args) {
  ConfigArgs config_args;
  std::string experiment_dir;
  bool dry_run = false;
  bool update_code = false, parsable = false;
  VerbArgs command_line(kUsage);
  command_line.add_config_options(config_args);
  command_line.add_scheduler_option(config_args);
  command_line.add_options()
      ("experiment,e", po::value(&experiment_dir)->value_name("DIR"), "the experiment directory (default runs/<name>)")
      ("dry-run", po::bool_switch(&dry_run), "print the batch script; write and submit nothing")
      ("update-code", po::bool_switch(&update_code),
       "submit the program now at the entrypoint's path, though it differs from the copy the experiment "
       "froze when it was made (the change is recorded)")
      ("parsable", po::bool_switch(&parsable), "print only the job id (as sbatch --parsable), for scripts");
  command_line.add_config_file(config_args);
  if (!command_line.parse(args)) return kExitOk;
  if (config_args.config_path.empty()) return missing_config("submit");
  core::ProcessEnv env;
  const core::ExperimentConfig config =
      core::load_experiment_config(config_args.sources(), site_defaults_path(), launcher::schedulers());
  if (experiment_dir.empty()) experiment_dir = core::default_experiment_dir(config.name);
  experiment_dir = fs::absolute(experiment_dir).lexically_normal().string();
  const core::ExperimentLayout layout{experiment_dir};
  const core::Scheduler& batch = launcher::scheduler(config);
  const auto render = [&](const core::ExperimentConfig& c) {
    return batch.render_script(c, {experiment_dir, core::self_program(), -1});
  };
  for (const std::string& warning : batch.submission_warnings(config)) {
    std::cerr << "hpctrial submit: warning: " << warning << "\n";
  }

  if (dry_run) {
    const auto resolved = launcher::resolve_experiment(config, experiment_dir, update_code);
    std::cout << render(resolved);
    for (const auto& [name, value] : core::exported_environment(resolved, env)) {
      std::cout << "# passed to the job from your environment by name, not written: " << name << "\n";
    }
    return kExitOk;
  }

  // One job per experiment at a time: a second would train the same trial twice.
  if (const auto earlier = core::latest_job(layout)) {
    const core::Scheduler& before = launcher::scheduler(earlier->scheduler);
    for (const core::JobStatus& job : before.live_jobs(layout)) {
      throw ConfigError(experiment_dir + " already has " + before.name() + " job " + job.id + " (state " +
                        job.native_state + (job.held() ? ", held" : "") + "); `hpctrial activate " + experiment_dir +
                        "` resumes a paused experiment, `hpctrial kill " + experiment_dir + "` ends it");
    }
  }
  render(launcher::resolve_experiment(config, experiment_dir, update_code));  // a value the script refuses: nothing written
  const auto prepared = launcher::prepare_experiment(config, experiment_dir, update_code);
  const std::string script = layout.job_file(batch.script_name());
  core::SubmitRequest request;
  request.script = script;
  request.env = core::exported_environment(prepared, env);
  core::write_file_atomic(script, render(prepared));
  // The scheduler creates the job's output files with the submitter's umask: private, like the rest.
  ::umask(077);
  const std::string id = batch.submit(request);
  core::record_job(layout, batch.name(), id);
  if (parsable) {
    std::cout << id << "\n";
    return kExitOk;
  }
  std::cout << "submitted " << batch.name() << " job " << id << "\n";
  if (const int workers = core::search_workers(prepared); workers > 0) {
    std::cout << workers << " worker(s) of the " << core::to_string(prepared.searcher.name) << " search, "
              << prepared.searcher.max_trials << " trials in all; each worker trains the trial the search log ("
              << layout.search_log() << ") gives it next\n";
  } else if (const int trials = core::trial_count(prepared); trials > 1) {
    std::cout << batch.describe_search(trials, static_cast<int>(std::min<std::int64_t>(
                                                   trials, prepared.searcher.max_concurrent_trials)))
              << "\n";
  }
  std::cout << "experiment: " << experiment_dir << "\n";
  return kExitOk;
}

}  // namespace

Verb submit_verb() {
  return {"submit", "submit an experiment as a Slurm or PBS batch job; submit again to resume", run_submit};
}

}  // namespace hpctrial::cli
