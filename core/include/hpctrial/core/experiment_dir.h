// What hpctrial records in an experiment directory and reads back from it: the experiment's
// identity and batch jobs, a trial's progress, stop requests, and where a trial's checkpoints go.
// The names of the directory's files and folders are in core/layout.h (ExperimentLayout,
// TrialLayout).
#pragma once

#include <cstdint>
#include <optional>
#include <utility>
#include <string>
#include <vector>

#include "hpctrial/core/allocation.h"
#include "hpctrial/core/experiment_config.h"
#include "hpctrial/core/files.h"
#include "hpctrial/core/layout.h"

namespace hpctrial::core {

// The experiment directory a batch job's output file lies in (a job writes its output there);
// empty when the file's directory is no experiment directory.
std::string experiment_of_output(const std::string& output_file);
// True when a batch job's output file lies in `experiment_dir` (the same directory, however the
// two paths name it: compared by device and inode): the job is one of the experiment's. A job id
// recorded for an experiment names another job once the scheduler gives it again (a controller
// or server started afresh, ids that wrapped); that job is never shown, paused, released or
// cancelled as the experiment's.
bool output_in_experiment(const std::string& output_file, const std::string& experiment_dir);

// Who an experiment is, made once when its directory is first prepared and kept in
// experiment.json: a random id (two experiments of one name, in two directories or one after
// the other, differ by it), the name it was made with, and its folder in a shared
// checkpoint_storage.host_path. Every checkpoint records the id and name; a run resumes,
// prunes and cleans only checkpoints of its own experiment.
struct ExperimentIdentity {
  std::string id;    // 16 hex digits
  std::string name;  // the config's name when the experiment was made
  // The experiment's folder under host_path: "<name>-<id>". Empty for an experiment made before
  // experiments had folders, whose checkpoints lay in host_path/trial-<id>: it runs again once
  // they are moved into its folder and `hpctrial experiment repair` has named it.
  std::string host_folder;
};
// The identity recorded in experiment.json; nullopt when none is and the experiment has not
// begun (no experiment there yet). IoError naming the file and `hpctrial experiment repair` when
// the record is damaged (no JSON object), or missing or without an id for an experiment that has
// begun: an identity is never made twice.
std::optional<ExperimentIdentity> experiment_identity(const ExperimentLayout& layout);
// The same, for a rank of a trial the launcher started: IoError when there is none.
ExperimentIdentity require_experiment_identity(const ExperimentLayout& layout);
// The recorded identity, or a new one recorded now for an experiment called `name` (safe
// against concurrent callers); IoError as experiment_identity().
ExperimentIdentity ensure_experiment_identity(const ExperimentLayout& layout, const std::string& name);
// "<name>-<id>": an experiment's folder under checkpoint_storage.host_path (its name made one
// safe path component).
std::string experiment_folder(const std::string& name, const std::string& id);
// Records `identity` as the experiment's under its lock, for `hpctrial experiment repair`: where
// experiment.json is missing, damaged, records no id, or records this id without a folder (the
// rest of a readable record is kept). Returns what is recorded then. IoError when the file
// records another experiment.
ExperimentIdentity restore_experiment_identity(const ExperimentLayout& layout, const ExperimentIdentity& identity);
// Whether the experiment has begun: a trial of it was launched (its launcher state, runs or
// checkpoints folder is there) or its search has a log.
bool experiment_started(const ExperimentLayout& layout);

// The experiment's config has one owner: experiment.yaml, written when the experiment is made
// and, once it has begun (experiment_started, or a batch job recorded), changed only in its run
// settings (config_compare.h: is_run_setting), under the experiment's lock; until then a config
// that could not start (a mistyped entrypoint) may be corrected. `config` is the config a command
// would run the experiment with, resolved as it would be written.
// check_experiment_config writes nothing: ConfigError listing each key whose value differs from
// the recorded config's in what the experiment trains (and how to start another experiment);
// IoError for a damaged or lost record (experiment_identity) or a lost config of an experiment
// that has begun.
void check_experiment_config(const ExperimentLayout& layout, const ExperimentConfig& config);
// commit_experiment_config makes the experiment (identity and config) where the directory holds
// none, or checks `config` as check_experiment_config does, all under the experiment's lock; then
// records `config`'s run settings (each change logged) and `workdir`, where the ranks run.
// Returns the identity. ConfigError too for an experiment made before experiments had a folder
// of their own under checkpoint_storage.host_path: no new checkpoint goes into the shared layout.
ExperimentIdentity commit_experiment_config(const ExperimentLayout& layout, const ExperimentConfig& config,
                                            const std::string& workdir);

// Where a trial's checkpoints go: checkpoint_storage.host_path/<host_folder>/trial-<id> when the
// config sets a host_path, else trial.default_checkpoint_dir() (<trial dir>/checkpoints).
// Without an identity (a training loop embedded without one; a trial program run alone has one
// in its trial directory): host_path/<config name>/trial-<id>.
// Loading a config makes host_path absolute (relative to the file that sets it); a relative one
// left in a config made in code is checked and taken from the working directory (ConfigError
// when it is not a usable path).
std::string checkpoint_dir(const ExperimentConfig& config, const TrialLayout& trial, int trial_id,
                           const std::optional<ExperimentIdentity>& identity);

// Held while experiment.json is read, changed and written back; released when closed.
UniqueFd lock_experiment(const ExperimentLayout& layout);

// The checkpoint directory of trial `trial_id` of the experiment in `layout` (another
// experiment's, which a fine-tuning starts from), from its recorded config and identity.
// ConfigError naming the directory when it is no experiment directory or has no checkpoints of
// that trial.
std::string trial_checkpoint_dir(const ExperimentLayout& layout, int trial_id);

// The batch jobs of an experiment, recorded in experiment.json when they are submitted.
struct RecordedJob {
  std::string id;
  std::string scheduler;
  std::string submitted;  // UTC, ISO 8601
  int trial = -1;         // the one trial the job runs; -1: the whole experiment
};
// The experiment's latest batch job; nullopt when it has none.
std::optional<RecordedJob> latest_job(const ExperimentLayout& layout);
// Every job recorded for the experiment, oldest first.
std::vector<RecordedJob> recorded_jobs(const ExperimentLayout& layout);
// Records a newly submitted job as the experiment's latest (`trial`: the one trial it runs, as
// a job that resumes one trial of a search does). Safe against concurrent recorders.
void record_job(const ExperimentLayout& layout, const std::string& scheduler, const std::string& id, int trial = -1);

// One run of a trial, from TrialLayout::runs_file().
struct TrialRun {
  std::string started;  // UTC, ISO 8601
  int ranks = 0;
  std::int64_t batch = 0;         // records a step across the ranks, at the start
  std::int64_t local_batch = 0;   // records a micro-batch, a rank
  std::int64_t accumulation = 1;  // micro-batches a step
  std::int64_t batches = 0;       // batches trained before the run
  std::string launcher;           // "mpirun" or "srun"; empty in a record older than the key
  std::string runtime, image;     // the container every rank ran in; empty: none
  std::optional<std::int64_t> from_record;  // an inference run's first record
  // The level of checkpoints it resumed from: "shared_fs", "memory" (checkpoint_levels.memory);
  // empty for a fresh start (or a record older than the key).
  std::string level;
  // Where each rank ran, in rank order: its host, the CPUs it could run on, its device(s).
  struct Place {
    std::string host, cpus, device;
  };
  std::vector<Place> placement;
};

// The slots an elastic trial's next run should ask for: the chief's preference
// (TrialLayout::elastic_file), rounded down to whole nodes within [min_slots_per_trial,
// slots_per_trial]; nullopt when the trial is not elastic or states none.
std::optional<int> preferred_slots(const std::string& trial_dir, const Resources& resources);

// A hand-over of a stopped trial to its scheduler that failed after the launcher's retries (a
// `scontrol requeue` or a `qsub` of the job that resumes it): nothing resumes the trial until a
// user runs `resume`. Kept in TrialLayout::launcher_state_file() under "failed_hand_over" until
// the trial's launcher starts again.
struct FailedHandOver {
  std::string time;    // UTC, ISO 8601
  std::string job;     // the batch job that stopped
  int tries = 0;       // runs of the failing command
  std::string error;   // what failed, and what the scheduler said the last time
  std::string resume;  // the command that resumes the trial by hand, one shell line
};
inline constexpr const char* kFailedHandOverKey = "failed_hand_over";
// Records `failed` in the trial's launcher state (safe against a crash: published atomically).
void record_failed_hand_over(const std::string& trial_dir, const FailedHandOver& failed);

// How far a trial got, from what its launcher and chief left in the trial directory.
struct TrialProgress {
  std::int64_t reported_step = -1;   // the last step rank 0 reported (heartbeat); -1: none
  int starts = 0;                    // runs of the launcher, over every job
  int failures = 0;                  // failures that counted against max_restarts
  std::string last_failure;          // the reason of the newest failure record
  // Its "flight": where each rank was when a collective watchdog ended the job, by rank.
  std::vector<std::pair<int, std::string>> last_failure_flight;
  std::vector<TrialRun> runs;        // oldest first
  std::optional<FailedHandOver> failed_hand_over;  // since the last start of its launcher
  // Nodes its jobs left out, the job back in the queue without them: the ranks failed on each in
  // two attempts, or once in a job with spare nodes when none was left.
  struct ExcludedNode {
    std::string node, job;
    bool no_spare_left = false;
  };
  std::vector<ExcludedNode> excluded_nodes;
  // Nodes whose ranks a spare node took over inside the job (resources.spare_nodes).
  struct SparedNode {
    std::string node, spare, job, time;
  };
  std::vector<SparedNode> spared_nodes;
};
TrialProgress trial_progress(const ExperimentLayout& layout, int trial_id);

// Records a stop request for a trial (its reason: "pause", say) where the chief and the launcher
// look for one: the chief checks for it once a second, and a signal that follows only makes it
// look sooner. `job`, when given, is the batch job the request is for: a launcher of that job
// that starts after the request keeps it (any other discards it as spent).
void request_stop(const ExperimentLayout& layout, int trial_id, const std::string& reason,
                  const std::string& job = "");
void request_stop(const std::string& trial_dir, const std::string& reason, const std::string& job = "");
// The reason in a trial directory's stop request ("pause", "preemption", ...); empty: none.
std::string stop_reason(const std::string& trial_dir);
// True when the trial's stop request was made for batch job `job` (not empty).
bool stop_requested_for(const std::string& trial_dir, const std::string& job);
// A stop request for a whole batch job: for run `restarts` of job `job` (its restart count as the
// scheduler counts it; -1: any run), read by that job's launcher when a signal comes and by a
// search's worker before it takes a trial. `hpctrial pause` of a search's worker writes one, then
// signals the job.
void request_job_stop(const ExperimentLayout& layout, const std::string& job, int restarts,
                      const std::string& reason);
// The reason of the stop request for this run of `allocation`'s job; empty: none (or one for
// another run, which is spent).
std::string job_stop_reason(const ExperimentLayout& layout, const Allocation& allocation);

// What a search's worker in batch job `job` trains: `trial`, or -1 between trials. Written by the
// worker as it takes each trial, read by the schedulers' job listings and `hpctrial logs`.
void record_worker_trial(const ExperimentLayout& layout, const std::string& job, int trial);
// The trial the worker in batch job `job` trains now, -1 between trials; nullopt when no worker of
// that job has recorded anything (a job that is not a worker, or one that has not started).
std::optional<int> worker_trial(const ExperimentLayout& layout, const std::string& job);
// Removes the stop request of job `job` (core::request_job_stop), once it is honoured.
void clear_job_stop(const ExperimentLayout& layout, const std::string& job);

}  // namespace hpctrial::core
