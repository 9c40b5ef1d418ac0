// hpctrial launch: inside a batch job, start the trial's ranks in the job's allocation.
#include <boost/program_options.hpp>

#include <filesystem>
#include <iostream>

#include "hpctrial/core/env.h"
#include "hpctrial/core/logging.h"
#include "hpctrial/launcher/launcher.h"
#include "launch_options.h"
#include "verb.h"
#include "verb_args.h"

namespace po = boost::program_options;

namespace hpctrial::cli {
namespace {

constexpr const char* kUsage = R"(usage: hpctrial launch --experiment DIR [options]

Run by the batch script that `hpctrial submit` generates: reads DIR/experiment.yaml, finds
the job's nodes and slots (Slurm or PBS), and starts the ranks with mpirun. Exit 0: the trial
finished; 75: it stopped after a checkpoint and resumes when the job runs again; other: it
failed more than max_restarts times (see DIR/trial-<id>/failures.jsonl). With --search-worker
(an adaptive search's array task): trains trial after trial as the search log says; 0 once the
search has nothing left for it, 75 when it stopped (pause, preemption, the time limit).

)";

int run_launch(const std::vector<std::string>& args) {
  launcher::LaunchOptions launch;
  bool search_worker = false;
  VerbArgs command_line(kUsage);
  command_line.add_options()
      ("experiment,e", po::value(&launch.experiment_dir)->value_name("DIR"), "the experiment directory")
      ("trial", po::value(&launch.trial_id)->value_name("ID"), "the trial to run (default 0)")
      ("np,n", po::value(&launch.np)->value_name("N"), "ranks to start (default: slots_per_trial)")
      ("oversubscribe", po::bool_switch(&launch.oversubscribe), "allow more ranks than cores")
      ("dry-run", po::bool_switch(&launch.dry_run), "print the mpirun command; start nothing")
      ("search-worker", po::bool_switch(&search_worker), "be a worker of the experiment's adaptive search: train "
                                                          "the trials the search gives, until it has none left");
  if (!command_line.parse(args)) return kExitOk;
  if (search_worker && (command_line.given("trial") || launch.dry_run)) {
    std::cerr << "hpctrial launch: --search-worker: the search chooses the trials; give neither --trial nor --dry-run\n";
    return kExitUsage;
  }
  if (launch.experiment_dir.empty()) {
    std::cerr << "hpctrial launch: give the experiment directory with --experiment DIR\n";
    return kExitUsage;
  }
  if (launch.trial_id < 0 || (command_line.given("np") && launch.np < 1)) {
    std::cerr << "hpctrial launch: --trial must be 0 or more and --np at least 1\n";
    return kExitUsage;
  }
  core::ProcessEnv env;
  core::init_logging(env);
  launch.experiment_dir = std::filesystem::absolute(launch.experiment_dir).lexically_normal().string();
  launch.worker = find_worker();
  launch.rank_parent = rank_parent_command();
  if (search_worker) return launcher::run_search_worker(launch, env, core::real_command_runner());
  return launcher::launch(launch, env, core::real_command_runner());
}

}  // namespace

Verb launch_verb() {
  return {"launch", "start a trial's ranks inside a batch job (used by generated scripts)", run_launch};
}

}  // namespace hpctrial::cli
