// hpctrial run: an experiment on this machine (or inside an allocation), resumed when run again.
#include <boost/program_options.hpp>

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <iostream>

#include "hpctrial/core/experiment_dir.h"
#include "hpctrial/core/env.h"
#include "hpctrial/core/experiment_config.h"
#include "hpctrial/core/logging.h"
#include "hpctrial/core/search.h"
#include "hpctrial/core/subprocess.h"
#include "hpctrial/launcher/launcher.h"
#include "hpctrial/launcher/schedulers.h"
#include "launch_options.h"
#include "site_defaults.h"
#include "verb.h"
#include "verb_args.h"

namespace po = boost::program_options;
namespace fs = std::filesystem;

namespace hpctrial::cli {

std::vector<std::string> rank_parent_command() { return {core::self_program(), "_rank", "--"}; }

std::string find_worker() {
  if (const auto set = core::ProcessEnv().get("HPCTRIAL_WORKER")) return *set;
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  if (ec) return "";
  for (const fs::path& candidate : {self.parent_path() / "hpctrial-worker",
                                   self.parent_path().parent_path() / "trainer" / "hpctrial-worker"}) {
    if (::access(candidate.c_str(), X_OK) == 0) return candidate.string();
  }
  return "";
}

namespace {

constexpr const char* kUsage = R"(usage: hpctrial run EXP.yaml [options]

Runs the experiment's trial with mpirun on this machine (or in the allocation it runs in):
makes the experiment directory (default runs/<name>), writes the effective config there, and
starts resources.slots_per_trial ranks. A grid or random search runs its trials one after
the other (trial-0, trial-1, ...), or only the one --trial names. Running the same command
again resumes from the latest checkpoint. Ctrl-C: checkpoint at the next step and stop (exit
75); Ctrl-C again: abort at once. A failed run restarts from its latest checkpoint up to
max_restarts times.

examples:
  hpctrial run examples/mlp/experiment.yaml
  hpctrial run exp.yaml --np 4 --oversubscribe --set hyperparameters.learning_rate=0.01
  hpctrial run exp.yaml --dry-run

)";

// An adaptive search: this command is one of its workers.
int run_search_worker(const core::ExperimentConfig& config, int only_trial, const launcher::LaunchOptions& launch,
                      const core::EnvSource& env) {
  if (only_trial >= 0) {
    std::cerr << "hpctrial run: --trial: the " << core::to_string(config.searcher.name)
              << " searcher chooses which trial runs next and for how long; run without --trial\n";
    return kExitUsage;
  }
  return launcher::run_search_worker(launch, env, core::real_command_runner());
}

int run_run(const std::vector<std::string>& args) {
  ConfigArgs config_args;
  std::string experiment_dir;
  int only_trial = -1;
  launcher::LaunchOptions launch;
  VerbArgs command_line(kUsage);
  command_line.add_config_options(config_args);
  command_line.add_options()
      ("experiment,e", po::value(&experiment_dir)->value_name("DIR"), "the experiment directory (default runs/<name>)")
      ("np,n", po::value(&launch.np)->value_name("N"), "ranks to start (default: slots_per_trial)")
      ("trial", po::value(&only_trial)->value_name("ID"), "run only this trial of a search (default: each in turn)")
      ("oversubscribe", po::bool_switch(&launch.oversubscribe), "allow more ranks than cores")
      ("dry-run", po::bool_switch(&launch.dry_run), "print the mpirun command; start nothing")
      ("update-code", po::bool_switch(&launch.update_code),
       "run the program now at the entrypoint's path, though it differs from the copy the experiment "
       "froze when it was made (the change is recorded)");
  command_line.add_config_file(config_args);
  if (!command_line.parse(args)) return kExitOk;
  if (config_args.config_path.empty()) return missing_config("run");
  if (command_line.given("trial") && only_trial < 0) {
    std::cerr << "hpctrial run: --trial must be 0 or more\n";
    return kExitUsage;
  }
  if (command_line.given("np") && launch.np < 1) {
    std::cerr << "hpctrial run: --np must be at least 1\n";
    return kExitUsage;
  }
  core::ProcessEnv env;
  core::init_logging(env);
  const core::ExperimentConfig config =
      core::load_experiment_config(config_args.sources(), site_defaults_path(), launcher::schedulers());
  if (experiment_dir.empty()) experiment_dir = core::default_experiment_dir(config.name);
  launch.experiment_dir = fs::absolute(experiment_dir).lexically_normal().string();
  launch.worker = find_worker();
  launch.rank_parent = rank_parent_command();
  launch.reset_failures = true;
  // Checked before anything is written: a mistyped --trial leaves the experiment as it was.
  const int trials = core::trial_count(config);
  if (only_trial >= trials) {
    std::cerr << "hpctrial run: --trial " << only_trial << " does not exist: the "
              << core::to_string(config.searcher.name) << " searcher makes " << trials << " trial(s), 0 to "
              << trials - 1 << "\n";
    return kExitUsage;
  }
  launch.trial_id = std::max(only_trial, 0);
  if (launch.dry_run) {
    // This config as it would run, with nothing written.
    launch.working_dir = launcher::experiment_workdir(config);
    launcher::print_launch_plan(launcher::resolve_experiment(config, launch.experiment_dir, launch.update_code), launch, env,
                                    core::real_command_runner());
    return kExitOk;
  }
  launch.write_config = config;  // written by the launcher once it holds the trial
  if (config.searcher.adaptive()) return run_search_worker(config, only_trial, launch, env);
  for (int trial = std::max(only_trial, 0); trial < trials; ++trial) {
    launch.trial_id = trial;
    const int code = launcher::launch(launch, env, core::real_command_runner());
    if (code != kExitOk || only_trial >= 0) return code;
  }
  return kExitOk;
}

}  // namespace

Verb run_verb() {
  return {"run", "run an experiment here with mpirun; run again to resume", run_run};
}

}  // namespace hpctrial::cli
