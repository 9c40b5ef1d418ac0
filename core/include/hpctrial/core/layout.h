// The names of the files and folders in an experiment directory and in a trial directory, owned
// here once: every part of hpctrial that reads or writes them (the launcher, the ranks, the
// `hpctrial` verbs, the schedulers' hand-over, the trainer) goes through these functions, and no
// other source file spells a name (tests/layering/check_layering.sh checks it).
//
//   <experiment>/experiment.yaml         the effective config (written by prepare_experiment)
//   <experiment>/experiment.json         the launcher's record: where the ranks run, the jobs
//   <experiment>/trial-<id>/             one per trial: metrics, checkpoints/, logs/rank-<N>.log,
//                                        failures.jsonl, launcher-state.json, launch/ (the
//                                        contract's stop, heartbeat, abort and verdict files)
//
// A trial directory need not lie in an experiment directory: a rank run alone uses --trial-dir,
// or runs/<name> itself. TrialLayout is therefore made from any directory.
//
// Each function returns `dir` joined with the name it answers; with an empty `dir`, the name
// alone (relative to the working directory). Pure; thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace hpctrial::core {

// The files of one trial directory.
struct TrialLayout {
  std::string dir;  // <experiment>/trial-<id>, or a rank's --trial-dir, $HPCTRIAL_TRIAL_DIR or runs/<name>

  // "trial-<id>": a trial's folder, below its experiment directory and below the experiment's
  // folder in checkpoint_storage.host_path.
  static std::string folder(int trial_id);
  // The trial id a folder's name gives ("trial-<id>"); nullopt for any other name.
  static std::optional<int> trial_of(std::string_view folder_name);

  // Written by the chief.
  // <dir>/metrics.jsonl: the trial's metrics, a JSON line a report.
  std::string metrics_file() const;
  // <dir>/tensorboard: the TensorBoard event files.
  std::string tensorboard_dir() const;
  // <dir>/tensorboard/traces/rank-<rank>.batches-<first>-<last>.json: the profiler's trace of
  // one rank over batches first to last.
  std::string profiler_trace(int rank, std::int64_t first, std::int64_t last) const;
  // <dir>/effective-config.yaml: the config the trial's ranks run with (its values of the
  // searcher's ranges filled in).
  std::string effective_config() const;
  // <dir>/core-state.json: a Core API program's saved state (finished epochs, accumulators,
  // the program's own state), read when it starts again.
  std::string core_state_file() const;
  // <dir>/runs.jsonl: the chief's record of each run of the trial (each start of its ranks), a
  // JSON line a run: {"started", "ranks", "batch", "local_batch", "accumulation", "batches"} -
  // the batch it started with (an adaptive batch changes it later) and the batches trained
  // before it.
  std::string runs_file() const;
  // <dir>/elastic.json: what the chief's adaptive batch prefers for the trial's next run,
  // rewritten at each checkpoint: {"preferred_slots": N} (docs/adaptive.md).
  std::string elastic_file() const;
  // An inference run's result (one row per record, the checkpoint format), and the record of
  // the rows durable in its temporary while it runs (trainer/src/loop/inference.cpp).
  std::string predictions_file() const;
  std::string inference_progress_file() const;
  // <dir>/checkpoints: where the trial's checkpoints go when the config sets no
  // checkpoint_storage.host_path (core::checkpoint_dir chooses between the two).
  std::string default_checkpoint_dir() const;

  // Written by the launcher.
  // <dir>/launcher-state.json: the launcher's record of the trial's attempts:
  // {"starts": N, "failures": M}, and a failed hand-over.
  std::string launcher_state_file() const;
  // <dir>/launcher-config.yaml: the experiment's config as the trial's launcher found it when it
  // started, which its ranks read (HPCTRIAL_CONFIG) at every restart.
  std::string launch_config() const;
  // <dir>/.launcher.lock: held by the trial's one running launcher.
  std::string launcher_lock() const;
  // <dir>/failures.jsonl: a JSON line for each failed attempt, with its reason.
  std::string failures_file() const;
  // <dir>/logs: the output of the ranks and of mpirun.
  std::string logs_dir() const;
  // <dir>/logs/rank-<rank>.log: what one rank wrote to stdout and stderr.
  std::string rank_log(int rank) const;
  // <dir>/logs/mpirun.log: what mpirun itself wrote.
  std::string mpirun_log() const;

  // The launch contract's files (core/launch_contract.h).
  // <dir>/stop-request: a stop request, written by `hpctrial pause` and the launcher, watched by
  // the chief.
  std::string stop_file() const;
  // <dir>/search-trial.json: the search event that made the trial, written by the search's worker
  // that created it: {"experiment_id", "trial", "bracket", "created"}. A search log that does not
  // know it is not the trial's (search/event_log.h).
  std::string search_record() const;
  // <dir>/launch: the files of the launcher's attempts.
  std::string launch_dir() const;
  // <dir>/launch/hostfile: the hosts and slots mpirun places the ranks on.
  std::string hostfile() const;
  // <dir>/launch/heartbeat: one heartbeat record per rank.
  std::string heartbeat_dir() const;
  // <dir>/launch/heartbeat/rank-<rank>.
  std::string heartbeat_file(int rank) const;
  // <heartbeat_dir>/rank-<rank>: for a rank, which knows only $HPCTRIAL_HEARTBEAT_DIR.
  static std::string heartbeat_file(const std::string& heartbeat_dir, int rank);
  // The rank a heartbeat file's name ("rank-<N>") is for; nullopt for any other name.
  static std::optional<int> heartbeat_rank(std::string_view file_name);
  // <dir>/launch/abort-<restart_count>: written by the launcher when it ends that attempt.
  std::string abort_file(int restart_count) const;
  // <dir>/launch/verdict-<restart_count>: the collective watchdog's verdict on that attempt.
  std::string verdict_file(int restart_count) const;
  // True for the name of an attempt's abort or verdict file ("abort-*", "verdict-*"): spent
  // once the trial's launcher starts again.
  static bool is_attempt_file(std::string_view file_name);
};

// The files of one experiment directory.
struct ExperimentLayout {
  std::string dir;

  // <dir>/experiment.yaml: the effective config (written by prepare_experiment).
  std::string config() const;
  // <dir>/experiment.json: the launcher's record: where the ranks run, the jobs, the identity.
  std::string state() const;
  // <dir>/.experiment.lock: held while experiment.json is read, changed and written back.
  std::string lock_file() const;
  // <dir>/plot.png: where `hpctrial plot` draws when told no other file.
  std::string plot() const;
  // <dir>/report.html: where `hpctrial report` writes when told no other file.
  std::string report() const;
  // <dir>/search-events.jsonl: an adaptive search's log of events (search/event_log.h), and
  // <dir>/.search.lock, held while a worker reads it, decides and appends.
  std::string search_log() const;
  std::string search_lock() const;
  // <dir>/stop-request.<job>: a stop request for batch job `job` as a whole (`hpctrial pause` of a
  // search's worker, whose trial the scheduler cannot name).
  std::string job_stop_file(const std::string& job) const;
  // <dir>/worker.<job>.json: the trial a search's worker in batch job `job` trains now.
  std::string worker_file(const std::string& job) const;
  // The trial directory <dir>/trial-<id>.
  TrialLayout trial(int trial_id) const;
  // <dir>/trial-<id>: trial(trial_id).dir.
  std::string trial_dir(int trial_id) const;
  // <dir>/code: the experiment's frozen code (frozen_code.h), a folder per digest.
  std::string code_dir() const;
  // <dir>/<name>: a file a scheduler keeps in the experiment directory (its batch script, its
  // jobs' output), named by that scheduler.
  std::string job_file(const std::string& name) const;
};

// A trial's copies in node memory (checkpoint_levels.memory, rank/node_memory.h), below `root` (a
// node-local tmpfs):
//   <root>/hpctrial-<uid>/<experiment id>/trial-<N>/<session>/rank-<R>/
struct NodeMemoryLayout {
  std::string root;
  unsigned uid = 0;
  std::string experiment_id;
  int trial = 0;
  std::string session;
  int rank = 0;
  std::string user_dir() const;        // <root>/hpctrial-<uid>
  std::string experiment_dir() const;  // .../<experiment id>
  std::string trial_dir() const;       // .../trial-<N>
  std::string session_dir() const;     // .../<session>
  std::string rank_dir() const;        // .../rank-<R>
  static std::string lock_file(const std::string& dir);  // <dir>/.lock
};

// Where an experiment named `name` goes when no directory is given: runs/<name>, relative to the
// working directory.
std::string default_experiment_dir(const std::string& name);

}  // namespace hpctrial::core
