// Slurm's own commands (sbatch, scontrol, scancel), run by argv through a runner, never a shell.
// Every method throws SchedulerError naming the command and what Slurm said when it fails.
#pragma once

#include <chrono>
#include <ctime>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "hpctrial/core/scheduler.h"
#include "hpctrial/core/subprocess.h"

namespace hpctrial::slurm {

// What `squeue --json` or `scontrol show job` says of a job.
struct JobInfo {
  std::string id;
  std::string name;
  std::string state;   // PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, TIMEOUT, ...
  std::string reason;  // why it is pending or held ("JobHeldUser", "None", ...)
  int restarts = 0;
  std::string run_time;  // "00:01:23"
  std::string std_out;   // the output file
  std::string std_err;
  std::string exit_code;    // "0:0": the batch script's code and the signal that ended it
  std::string submit_time;  // as Slurm prints it, e.g. 2026-11-22T15:36:20
  std::string start_time;
  std::string node_list;
  std::string batch_host;      // where the batch script runs; empty until it starts
  std::string excluded_nodes;  // ExcNodeList, "(null)" made empty
  std::string partition;       // "debug", or "a,b" for a job that may run in either
  std::string work_dir;
  std::string user_id;    // numeric
  std::string user_name;  // "alice"
  std::string priority;  // Priority: higher starts first; 0 while held
  std::string nice;      // Nice: subtracted from the priority
  int num_tasks = 0;     // NumTasks: the ranks it asks for
  // A task of a job array: the array's id and this task's index ("3"), or the indices of tasks
  // not started yet, which Slurm shows as one line ("2-5", "[2-5%2]"). Empty otherwise.
  std::string array_job_id;
  std::string array_task;
  bool held() const;
  // The name users know: "1234", or "1234_3" for a task of an array.
  std::string display_id() const;
};

// Parses one line of `scontrol -o show job` (KEY=VALUE fields, separated by blanks).
JobInfo parse_job_line(const std::string& line);

// Reads what `command` (`squeue --json`) printed: Slurm's OpenAPI job records, as 22.05 writes
// them (v0.0.38) and as later versions do (numbers as {"set", "infinite", "number"}, job_state a
// list). RunTime (as of `now`), ExitCode and the output files are computed as `scontrol show job`
// shows them. SchedulerError naming the command when it printed something else.
std::vector<JobInfo> parse_jobs_json(const std::string& text, const std::string& command, std::time_t now);

// An output path as slurmd names the file: %% %A %a %J %j %N %n %s %t %u %x, each with an
// optional width ("%5j": zero-padded). %N stays as written until the job has a batch host, and
// any other letter as Slurm leaves it.
std::string expand_output_pattern(const std::string& pattern, const JobInfo& job);

class Client {
 public:
  // The default runner runs the real commands with a one-minute timeout.
  Client() : run_(core::real_command_runner()) {}
  explicit Client(core::CommandRunner run) : run_(std::move(run)) {}

  // sbatch --parsable --export=ALL SCRIPT with `env` added to sbatch's environment (never to its
  // argv); `hold`: submitted held (--hold). Returns the job id.
  std::string submit(const std::string& script, const std::vector<std::pair<std::string, std::string>>& env,
                     bool hold = false) const;
  // scontrol requeue / requeuehold: a running job goes back to the queue (held).
  void requeue(const std::string& job, bool hold) const;
  void hold(const std::string& job) const;     // scontrol hold: a pending job waits for release
  // The job's steps that run a program (squeue -s): "<job>.<n>", not its batch or extern steps.
  std::vector<std::string> program_steps(const std::string& job) const;
  // TotalNodes of `scontrol show partition`; 0 when Slurm does not answer.
  int partition_nodes(const std::string& partition) const;
  // Whether the partition's TRES counts GPUs (gres/gpu); false when Slurm does not answer.
  bool partition_has_gpus(const std::string& partition) const;
  // scontrol update ExcNodeList=NODES: a pending job's next run avoids them (a hostlist).
  void exclude_nodes(const std::string& job, const std::string& nodes) const;
  void release(const std::string& job) const;  // scontrol release
  // scontrol update JobId=JOB FIELD=VALUE ...: what its user may change (Nice >= 0, the
  // Partition of a pending job); SchedulerError with Slurm's words otherwise.
  void update(const std::string& job, const std::vector<std::string>& fields) const;
  // scontrol top JOB: first among its user's pending jobs of its partition, account and QOS.
  void top(const std::string& job) const;
  void cancel(const std::string& job) const;   // scancel
  // scancel --batch --signal=SIG: the signal to the batch shell (hpctrial launch) only. False,
  // within kSignalWait, when the job has no batch shell to signal now (it is pending, requeued or
  // ending), where scancel alone would keep asking for 95 s.
  bool signal_batch(const std::string& job, const std::string& signal) const;
  static constexpr std::chrono::seconds kSignalWait{8};
  // nullopt once Slurm no longer knows the job (MinJobAge after it ended). For a job array, its
  // first task.
  std::optional<JobInfo> job(const std::string& id) const;
  // Every task of a job array (one element for a plain job); empty once Slurm forgot the job.
  std::vector<JobInfo> job_tasks(const std::string& id) const;
  // The jobs Slurm still knows (pending, running, just ended) of this user or of every user:
  // from `squeue --json --states=all [--me]`, or from `scontrol -o show job` where squeue has no
  // --json (before 21.08, or without its serializer plugin). Slurm 22.05 ignores squeue's filters
  // with --json, so the user's are picked here too. A single job is asked with `scontrol -o show
  // job ID` (job_tasks): the controller looks it up alone, where 22.05's squeue --json would
  // print the whole cluster's queue.
  std::vector<JobInfo> user_jobs(core::JobOwners owners) const;
  // Whether the last user_jobs read JSON: nullopt before it asked.
  std::optional<bool> reads_json() const { return json_; }

 private:
  core::RunResult checked(const std::vector<std::string>& argv, const core::RunOptions& options = {}) const;
  core::CommandRunner run_;
  mutable std::optional<bool> json_;  // whether `squeue --json` works here, once known
};

}  // namespace hpctrial::slurm
