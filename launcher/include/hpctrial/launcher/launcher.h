// Host side of the launcher: `hpctrial run` on a workstation, `hpctrial launch` inside a batch
// job. It finds out where it runs (Slurm, PBS or neither), starts the ranks with one mpirun,
// tags and files their output per rank, turns signals and the job's deadline into stop
// requests, watches for hangs, and applies the exit protocol:
//   all ranks 0   -> the trial is done: exit 0;
//   all ranks 75  -> stopped after a durable checkpoint: exit 75 (resume by running again, or
//                    let the scheduler requeue);
//   anything else -> every rank is made sure gone, a failure record is appended to
//                    <trial dir>/failures.jsonl, and the trial restarts from its latest
//                    checkpoint, up to max_restarts failures; then exit non-zero.
//
// The experiment directory holds experiment.yaml (the effective config), experiment.json (what
// the launcher needs besides: where the ranks run) and one trial-<id>/ per trial with the
// trial's metrics, checkpoints, logs/rank-<N>.log, failures.jsonl and launcher-state.json.
//
// No LibTorch here; the CLI uses it.
#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "hpctrial/core/allocation.h"
#include "hpctrial/core/env.h"
#include "hpctrial/core/experiment_config.h"
#include "hpctrial/core/experiment_dir.h"
#include "hpctrial/core/files.h"
#include "hpctrial/core/launch_contract.h"

namespace hpctrial::launcher {

using core::kExitAborted;
using core::kExitFailed;
using core::kExitInvalidHP;
using core::kExitFinished;
using core::kExitStopped;

using core::ExperimentLayout;

// Makes the experiment in `dir` (0700: its identity and its config), or checks that `config` is
// the config of the experiment there and records its run settings (core::commit_experiment_config:
// another experiment's config is refused before anything is written). The entrypoint's program
// or library is made absolute against the config file's directory, and that directory is
// recorded as where the ranks run, so that the experiment directory is all a batch job needs. A
// seed left unset in `config` is taken from an earlier experiment.yaml in `dir` (so that running
// again resumes with the same data order), else chosen now. Returns the config as written.
// The entrypoint's program or library is frozen when the experiment is made (core/frozen_code.h):
// copied into the experiment directory, the copy's path in the config written; other bytes at
// the path later are refused (ConfigError naming both digests) unless `update_code`, which
// freezes them anew and records the change.
core::ExperimentConfig prepare_experiment(core::ExperimentConfig config, const std::string& dir,
                                          bool update_code = false);
// What prepare_experiment() checks first, writing nothing: ConfigError when `config` is not the
// config of the experiment in `dir`; IoError for its damaged or lost record.
void check_experiment(const core::ExperimentConfig& config, const std::string& dir, bool update_code = false);
// What prepare_experiment() would write, without writing anything.
core::ExperimentConfig resolve_experiment(core::ExperimentConfig config, const std::string& dir,
                                          bool update_code = false);
// Where the ranks of an experiment made from `config` run: its config file's directory.
std::string experiment_workdir(const core::ExperimentConfig& config);

struct LaunchOptions {
  std::string experiment_dir;
  int trial_id = 0;
  int np = 0;                  // 0: resources.slots_per_trial
  bool oversubscribe = false;  // more ranks than cores, on a workstation
  bool dry_run = false;        // print the mpirun command and the hostfile; start nothing
  bool reset_failures = false; // a user's explicit run: failures of earlier runs are forgiven
  std::string mpirun;          // empty: $HPCTRIAL_MPIRUN, else "mpirun" on PATH
  std::string worker;          // hpctrial-worker, for library entrypoints
  // The command that mpirun starts in place of each rank, which then starts the rank and is its
  // parent (run_rank_parent): e.g. {"/opt/hpctrial/bin/hpctrial", "_rank", "--"}. Empty: none.
  std::vector<std::string> rank_parent;
  std::string working_dir;     // where the ranks run; empty: as recorded in experiment.json
  // `hpctrial run`: the config to prepare the experiment with (prepare_experiment), written
  // once this launcher holds the trial, never while another runs it. Unset: as recorded.
  std::optional<core::ExperimentConfig> write_config;
  // With write_config: other bytes at the entrypoint's path than the experiment froze are frozen
  // anew (`hpctrial run --update-code`), the change recorded.
  bool update_code = false;
  // An adaptive search's worker: train the trial to this length only (its rung), in the unit of
  // searcher.max_length (HPCTRIAL_MAX_LENGTH). Unset: to searcher.max_length.
  std::optional<core::Length> max_length;
  // An adaptive search's worker, as its events name it (HPCTRIAL_SEARCH_WORKER): the trial's chief
  // records each rung it reaches in the search log, and trains on when promoted there.
  std::string search_worker;
  // When the job ends, where its scheduler does not say: an adaptive search's worker assumes it
  // once, as it starts, for every trial it launches. Unset: now + scheduler.time_limit.
  std::optional<std::chrono::system_clock::time_point> job_end;
};

// Where the launcher runs: the first scheduler whose job environment is present, else none.
core::Allocation detect_allocation(const core::EnvSource& env, const core::CommandRunner& run);

// One attempt's mpirun command. `env` is set in mpirun's own environment and exported to the
// ranks by name (-x NAME), so that no value, secret or not, appears in any argv.
struct MpirunCommand {
  std::vector<std::string> argv;
  std::vector<std::pair<std::string, std::string>> env;
  std::string hostfile_path;  // empty: none (this machine, or srun)
  std::string hostfile;       // its content
  int np = 0;
  std::string working_dir;
  // launcher.mpi: srun. The ranks are a job step's tasks, children of Slurm's slurmstepd rather
  // than of the command, and its output is labelled "N: " rather than tagged.
  bool srun = false;
};

MpirunCommand build_mpirun_command(const core::ExperimentConfig& config, const core::Allocation& allocation,
                                   const LaunchOptions& options, int restart_count, const core::EnvSource& env);

// Prints the mpirun command of a first attempt of `config` (the HPCTRIAL_* values, never the
// config's environment values) and the hostfile; starts and writes nothing.
void print_launch_plan(const core::ExperimentConfig& config, const LaunchOptions& options, const core::EnvSource& env,
                       const core::CommandRunner& run);

// The parent of one rank (`hpctrial _rank -- PROGRAM ARGS...`): starts `argv`, forwards it the
// stop signals, and once it has ended records in its heartbeat record how (when the rank did not
// record it itself: a SIGKILL, an _exit()), then ends the same way. Returns the exit code.
int run_rank_parent(const std::vector<std::string>& argv, const core::EnvSource& env);

// Runs the trial to its end as the exit protocol above says; returns the exit code. `held`: the
// trial's launcher lock, taken already (an adaptive search's worker leases its trial so), which
// stays held after the return.
int launch(const LaunchOptions& options, const core::EnvSource& env, const core::CommandRunner& run,
           core::UniqueFd* held = nullptr);

// An adaptive search's worker (searcher adaptive_asha or async_halving, search/asha.h): under the
// search log's lock it asks the search what next, leases that trial (its launcher lock), appends
// the decision and lets the log go; it trains the trial with launch() to its rung
// (LaunchOptions::max_length), records the rung's validation metric and whether the trial goes
// on, and asks again, until the search has nothing left for a worker (0). A stop (pause,
// preemption, the wall-time) returns 75 with the trial's checkpoint durable: the next run of a
// worker takes the trial over where it stopped. A trial that fails past max_restarts is recorded
// as failed, and the worker goes on with the next.
int run_search_worker(const LaunchOptions& options, const core::EnvSource& env, const core::CommandRunner& run);

}  // namespace hpctrial::launcher
