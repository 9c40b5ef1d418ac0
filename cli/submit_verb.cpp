// hpctrial submit: an experiment as a Slurm batch job (the generated sbatch script, saved in the
// experiment directory), resumed when submitted again.
#include <boost/program_options.hpp>

#include <sys/stat.h>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <iostream>

#include "hpctrial/core/batch_job.h"
#include "hpctrial/core/env.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/experiment_config.h"
#include "hpctrial/core/files.h"
#include "hpctrial/core/logging.h"
#include "hpctrial/core/search.h"
#include "hpctrial/core/subprocess.h"
#include "hpctrial/core/text.h"
#include "hpctrial/mpi_launcher/launcher.h"
#include "hpctrial/pbs/batch_script.h"
#include "hpctrial/pbs/client.h"
#include "hpctrial/pbs/job_environment.h"
#include "hpctrial/slurm/batch_script.h"
#include "hpctrial/slurm/client.h"
#include "hpctrial/slurm/job_environment.h"
#include "job_verbs.h"
#include "site_defaults.h"
#include "verb.h"

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

options)";

int run_submit(const std::vector<std::string>& args) {
  core::ConfigSources sources;
  std::string experiment_dir, scheduler;
  bool dry_run = false;
  po::options_description options("options");
  options.add_options()
      ("help,h", "show this help")
      ("template,t", po::value(&sources.template_path)->value_name("T.yaml"), "merge this template under the config")
      ("set,s", po::value(&sources.overrides)->value_name("KEY.PATH=VALUE")->composing(),
       "override one config value (repeatable)")
      ("scheduler", po::value(&scheduler)->value_name("slurm|pbs"), "the scheduler (default scheduler.type)")
      ("experiment,e", po::value(&experiment_dir)->value_name("DIR"), "the experiment directory (default runs/<name>)")
      ("dry-run", po::bool_switch(&dry_run), "print the batch script; write and submit nothing");
  po::options_description hidden;
  hidden.add_options()("config", po::value(&sources.config_path));
  po::options_description all;
  all.add(options).add(hidden);
  po::positional_options_description pos;
  pos.add("config", 1);
  po::variables_map vm;
  po::store(po::command_line_parser(args).options(all).positional(pos).run(), vm);
  po::notify(vm);
  if (vm.count("help")) {
    std::cout << kUsage << ":\n" << options;
    return kExitOk;
  }
  if (sources.config_path.empty()) {
    std::cerr << "hpctrial submit: give the experiment config, e.g. 'hpctrial submit experiment.yaml'\n";
    return kExitUsage;
  }
  if (!scheduler.empty()) sources.overrides.push_back("scheduler.type=" + scheduler);
  core::ProcessEnv env;
  const core::ExperimentConfig config = core::load_experiment_config(sources, site_defaults_path());
  if (config.scheduler.type == core::SchedulerConfig::Type::kLocal) {
    throw ConfigError(sources.config_path + ": scheduler.type is local, so there is nothing to submit; run it here "
                      "with `hpctrial run " + sources.config_path + "`, or submit with --scheduler slurm (or pbs)");
  }
  if (experiment_dir.empty()) experiment_dir = (fs::path("runs") / config.name).string();
  experiment_dir = fs::absolute(experiment_dir).lexically_normal().string();
  const mpi_launcher::ExperimentLayout layout{experiment_dir};
  const bool pbs = config.scheduler.type == core::SchedulerConfig::Type::kPbs;
  const auto render = [&](const core::ExperimentConfig& c) {
    return pbs ? pbs::render_batch_script(c, {experiment_dir, core::self_program()})
               : slurm::render_batch_script(c, {experiment_dir, core::self_program()});
  };
  const char* scheduler_name = pbs ? "pbs" : "slurm";

  if (dry_run) {
    const auto resolved = mpi_launcher::resolve_experiment(config, experiment_dir);
    std::cout << render(resolved);
    for (const auto& [name, value] : core::exported_environment(resolved, env)) {
      std::cout << "# passed by " << (pbs ? "qsub" : "sbatch") << " from your environment, not written: " << name << "\n";
    }
    return kExitOk;
  }

  // One job per experiment at a time: a second would train the same trial twice.
  if (pbs) {
    const pbs::Client client;
    for (const auto& earlier : mpi_launcher::recorded_jobs(layout)) {
      if (earlier.scheduler != "pbs" || !pbs::is_valid_job_id(earlier.id)) continue;
      for (const auto& job : client.job_tasks(earlier.id)) {
        if (!job.active()) continue;
        throw ConfigError(experiment_dir + " already has pbs job " + job.id + " (state " + job.state +
                          (job.held() ? ", held" : "") + "); `hpctrial activate " + experiment_dir +
                          "` resumes a paused experiment, `hpctrial kill " + experiment_dir + "` ends it");
      }
    }
  } else if (const auto earlier = mpi_launcher::latest_job(layout); earlier && slurm::is_valid_job_id(earlier->id)) {
    for (const auto& job : slurm::Client().job_tasks(earlier->id)) {
      if (!is_active(job)) continue;
      throw ConfigError(experiment_dir + " already has slurm job " + job.display_id() + " (" + job.state +
                        (job.held() ? ", held" : "") + "); `hpctrial activate " + earlier->id +
                        "` resumes a paused job, `hpctrial kill " + earlier->id + "` ends it");
    }
  }
  render(mpi_launcher::resolve_experiment(config, experiment_dir));  // a value the script refuses: nothing written
  const auto prepared = mpi_launcher::prepare_experiment(config, experiment_dir);
  const std::string script = experiment_dir + (pbs ? "/job.pbs" : "/job.sbatch");
  const auto exported = core::exported_environment(prepared, env);
  core::write_file_atomic(script, render(prepared));
  // The scheduler creates the job's output files with the submitter's umask: private, like the rest.
  ::umask(077);
  std::string id;
  if (pbs) {
    pbs::Client::Submit submit;
    submit.script = script;
    submit.env = exported;
    id = pbs::Client().submit(submit);
  } else {
    id = slurm::Client().submit(script, exported);
  }
  mpi_launcher::record_job(layout, scheduler_name, id);
  std::cout << "submitted " << scheduler_name << " job " << id << "\n";
  if (const int trials = core::trial_count(prepared); trials > 1) {
    std::cout << (pbs ? "an array job of " : "a job array of ") << trials << " trials (" << (pbs ? "subjob" : "task")
              << " N runs trial N, at most " << std::min<std::int64_t>(trials, prepared.searcher.max_concurrent_trials)
              << " at a time)\n";
  }
  std::cout << "experiment: " << experiment_dir << "\n";
  return kExitOk;
}

}  // namespace

Verb submit_verb() {
  return {"submit", "submit an experiment as a Slurm or PBS batch job; submit again to resume", run_submit};
}

}  // namespace hpctrial::cli
