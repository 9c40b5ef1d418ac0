// A batch scheduler, as the host side of hpctrial sees it — the way c10d has `Backend` and gloo
// has `transport::Device`: one interface, an implementation per scheduler folder (slurm/, pbs/,
// and `local` for `hpctrial run`), one explicit registry (launcher/schedulers.h). Nothing outside
// the implementations and the registry knows a scheduler by its name.
//
// What a scheduler does for hpctrial:
// - tell whether this process runs inside one of its jobs, and what it was given (detect);
// - render an experiment's batch script and submit it (the values that refer to the submitting
//   environment passed by name, never written);
// - hand a stopped job over: requeue it (Slurm) or submit the job that resumes its trial (PBS);
// - pause, activate and cancel an experiment's jobs, list a user's jobs and an experiment's, in
//   one neutral state, and name each job's output file.
// Every method that runs the scheduler's commands throws SchedulerError naming the command and
// what the scheduler said.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "hpctrial/core/allocation.h"
#include "hpctrial/core/env.h"
#include "hpctrial/core/experiment_config.h"
#include "hpctrial/core/experiment_dir.h"

namespace hpctrial::core {

// A job's state in the terms every scheduler maps to.
enum class JobState { kQueued, kHeld, kRunning, kEnding, kSuspended, kEnded };
const char* to_string(JobState state);  // "queued", "held", ...

// What a scheduler says of one job, or of one task of a job array.
struct JobStatus {
  std::string id;            // as users name it: "1234", "1234_3", "1234[3].srv"
  std::string name;
  std::string user;          // who submitted it; empty where the scheduler does not say
  JobState state = JobState::kEnded;
  std::string native_state;  // the scheduler's own word: "RUNNING", "R"
  int trial = -1;            // the trial it runs; -1: unknown, or a set of tasks not started yet
  std::string tasks;         // that set, as the scheduler writes it ("2-5"); else empty
  int restarts = 0;          // how often it was started before
  std::string elapsed;       // "00:01:23"; empty where the scheduler does not say
  std::string exit;          // how it ended, in the scheduler's words ("0:0", "3"); empty: not yet
  std::string output;        // its output file, absolute; empty when not known
  // Its place in the queue, as the scheduler says: its priority (Slurm's number, which orders
  // the pending jobs, higher first; PBS's Priority, -1024..1023), its partition or queue, the
  // slots (ranks: tasks, MPI processes) it asks for and how many of them it holds now. Empty or
  // 0 where the scheduler does not say.
  std::string priority;
  std::string queue;
  int slots_needed = 0;
  int slots_acquired = 0;
  bool live() const { return state != JobState::kEnded; }
  bool held() const { return state == JobState::kHeld; }
};

// Whose jobs a listing shows: the user's own (`hpctrial jobs`) or every user's (--all-users).
enum class JobOwners { kMine, kEveryone };

struct ScriptOptions {
  std::string experiment_dir;  // absolute
  std::string hpctrial;        // the hpctrial program the job runs (absolute)
  int trial = -1;              // -1: the whole experiment; N: trial N alone (a job that resumes it)
  bool one_worker = false;     // an adaptive search: one worker alone (a job that resumes a worker)
};

struct SubmitRequest {
  std::string script;  // the script's path
  // Variables the job gets from the submitting environment, by name: never in an argv or script.
  std::vector<std::pair<std::string, std::string>> env;
  bool hold = false;   // submitted held: it waits for activate
  std::string after;   // starts only once this job has ended, however it ended
};

// How `stop` stops an experiment's jobs: `hpctrial pause` (checkpoint, then wait held in the
// queue) or `hpctrial cancel` (checkpoint, then end; a queued job ends at once).
enum class StopMode { kPause, kEnd };
// The reason a stop request of that mode gives: "pause" or "cancel".
const char* stop_reason_of(StopMode mode);

// What stopping did to one job of an experiment.
struct StopStep {
  enum class Kind {
    kStopping,     // running: asked to checkpoint and stop, then held in the queue (or ended)
    kHeld,         // queued: now held
    kAlreadyHeld,  // was held already
    kEnded,        // queued or held: cancelled, as it had trained nothing since its checkpoint
  };
  Kind kind = Kind::kHeld;
  std::string job;
  int trial = -1;  // kStopping: the trial that checkpoints
};

// A change to a waiting job's place in the queue (`hpctrial job update`); what is not set stays.
struct JobUpdate {
  std::string job;                // as users name it; an array's id: its waiting tasks
  std::optional<int> priority;    // higher starts first
  std::string queue;              // the Slurm partition, the PBS queue
  enum class Order { kNone, kTop, kAheadOf, kBehindOf };
  Order order = Order::kNone;
  std::string other;              // the job of kAheadOf and kBehindOf
};

// The jobs of an experiment a verb acts on: every live job recorded for the experiment
// directory, or the one job a user named (and, found from its output file, its directory).
struct JobTarget {
  std::string experiment_dir;  // empty when it cannot be found
  std::string job;             // the job the user named; empty: the experiment's jobs
};

// A job whose ranks all stopped after a durable checkpoint, handed back to its scheduler.
struct HandOver {
  Allocation allocation;       // the job's
  ExperimentConfig config;     // the trial's
  std::string experiment_dir;
  int trial = 0;
  bool hold = false;           // paused by the user: held until activate
  // The job is one of an adaptive search's workers: it runs whichever trial the search gives it
  // (`trial`, or -1 between trials), and what resumes it is a worker again.
  bool worker = false;
  const EnvSource* env = nullptr;
  // Runs the scheduler's commands: the launcher's runner tries a failing command again
  // (launcher/src/hand_over.cpp).
  CommandRunner run;
  // Nodes the next run must not use (its ranks failed on each in two attempts), with those left
  // out before; empty: wherever the scheduler likes. Only where can_leave_out() says so.
  std::vector<std::string> exclude_nodes;
};

// A hand-over that did not happen: nothing will resume the trial until a user does.
struct HandOverFailure {
  std::string error;   // what failed, with what the scheduler said the last time
  std::string resume;  // the command that resumes the trial by hand, one shell line
};

// A key of scheduler: that one scheduler has (Slurm's partition, PBS's queue). Its value is a
// name (check_scheduler_name in experiment_config.h).
struct SchedulerOption {
  std::string key;
  bool allow_at = false;  // "workq@server"
};

class Scheduler {
 public:
  virtual ~Scheduler() = default;

  // Its name in configs (scheduler.type) and job records: "slurm".
  virtual std::string name() const = 0;
  // Whether its commands are on this machine.
  virtual bool available() const = 0;
  // The job this process runs in, when it is one of this scheduler's; nullopt otherwise.
  virtual std::optional<Allocation> detect(const EnvSource& env, const CommandRunner& run) const = 0;
  // Whether `text` has the form of one of its job ids.
  virtual bool is_job_id(const std::string& text) const = 0;
  // The scheduler: keys of its own, beyond scheduler_common_keys(). None by default.
  virtual std::vector<SchedulerOption> options() const;
  // Reports the options of other schedulers it does not have (PBS has no partition, Slurm no
  // queue) at the place the user wrote them (config.scheduler.written_at). Accepts all by default.
  virtual void check_config(const SchedulerConfig& config, Diagnostics& diagnostics) const;
  // What `hpctrial submit` should tell the user before it submits `config`, though the config is
  // valid (a GPU type or a GPU partition named, and no GPUs asked for). None by default.
  virtual std::vector<std::string> submission_warnings(const ExperimentConfig& config) const;

  // The batch script of an experiment; ConfigError naming the key of a value it cannot write.
  virtual std::string render_script(const ExperimentConfig& config, const ScriptOptions& options) const = 0;
  // The script's file name in the experiment directory ("job.sbatch").
  virtual std::string script_name() const = 0;
  // Submits a rendered script; returns the job id.
  virtual std::string submit(const SubmitRequest& request) const = 0;
  // The experiment's jobs this scheduler still counts as live (queued, held, running).
  virtual std::vector<JobStatus> live_jobs(const ExperimentLayout& layout) const = 0;
  // How the tasks of a search run, for the user ("a job array of 4 trials (task N runs trial N,
  // at most 2 at a time)").
  virtual std::string describe_search(int trials, int concurrent) const = 0;

  // One job as the scheduler knows it; nullopt once it has forgotten the job.
  virtual std::optional<JobStatus> job(const std::string& id) const = 0;
  // The jobs the scheduler still knows of this user (or of every user), one per task of an array.
  virtual std::vector<JobStatus> user_jobs(JobOwners owners) const = 0;
  // The jobs that ran or run `trial` of the experiment, oldest first (a resumed trial may have
  // had several), as the scheduler knows them now; a forgotten job has state kEnded and only its
  // id and output file.
  virtual std::vector<JobStatus> trial_jobs(const ExperimentLayout& layout, int trial, int trials) const = 0;

  // Asks each running job or task to checkpoint after its current step (a stop request with
  // stop_reason_of(mode), then a signal), and holds (kPause) or cancels (kEnd) the queued ones.
  virtual std::vector<StopStep> stop(const JobTarget& target, StopMode mode) const = 0;
  // Changes a waiting job's priority, partition or queue, or its order among its user's jobs,
  // with the scheduler's own commands and only as far as it lets an ordinary user; returns what
  // it did, a line each. SchedulerError with the scheduler's words where it refuses; ConfigError
  // for a change it has no command for (and where no scheduler has jobs).
  virtual std::vector<std::string> update_job(const JobUpdate& update) const;
  // Releases held jobs; returns their ids.
  virtual std::vector<std::string> activate(const JobTarget& target) const = 0;
  // Cancels live jobs; returns their ids.
  virtual std::vector<std::string> cancel(const JobTarget& target) const = 0;

  // Every rank stopped after a durable checkpoint: the trial goes back to the queue to resume.
  // Never throws: a failure is returned with the command that resumes the trial by hand (the
  // checkpoint is durable); the launcher records it where `hpctrial describe` shows it.
  virtual std::optional<HandOverFailure> hand_over(const HandOver& stopped) const = 0;
  // Whether hand_over can send `allocation`'s job back to the queue without `left_out` of its
  // nodes and the job still find the `needed` nodes it runs on. Never by default.
  virtual bool can_leave_out(const Allocation& allocation, int left_out, int needed) const;
  // After an attempt of a job on several nodes ended: ends what its mpirun left running in the
  // job (Slurm: the steps of Open MPI's daemons, which a killed mpirun leaves, and which hold
  // their nodes' slots so that the next attempt cannot start). Returns what it ended; nothing by
  // default.
  virtual std::vector<std::string> end_leftover_steps(const Allocation& allocation) const;
  // Whether its runs may start their ranks with srun (launcher.mpi: srun): Slurm's jobs, and
  // `hpctrial run`, which may run inside salloc (the launcher checks that it does). Not by default.
  virtual bool allows_srun() const;
};

// Reports a scheduler.type that names none of `schedulers`, a scheduler: key that none of them
// has, a value an option cannot take, and the options the named scheduler rejects.
void check_scheduler_config(const ExperimentConfig& config, const std::vector<const Scheduler*>& schedulers,
                            Diagnostics& diagnostics);
// load_experiment_config (experiment_config.h) with check_scheduler_config: what the commands
// that submit or run use.
ExperimentConfig load_experiment_config(const ConfigSources& sources, const std::string& site_path,
                                        const std::vector<const Scheduler*>& schedulers);

}  // namespace hpctrial::core
