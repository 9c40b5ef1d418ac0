// Slurm as a core::Scheduler: sbatch scripts, job arrays for searches (task N runs trial N), a
// stopped job requeued by itself (scontrol requeue / requeuehold), pause by the stop request and
// USR2 to the batch shell, output in <experiment>/slurm-<job>.err.
#pragma once

#include "hpctrial/core/scheduler.h"
#include "hpctrial/slurm/client.h"

namespace hpctrial::slurm {

// The neutral state of a job as `scontrol show job` describes it.
core::JobState job_state(const JobInfo& job);
// The trial a task runs: its array index, 0 for a plain job; -1 for a line of tasks not started.
int trial_of(const JobInfo& task);

// True for a task of an adaptive search's worker array, told by its output file's name
// (slurm-<array>_w<task>): its trial is the one its worker records (core::worker_trial).
bool is_worker(const JobInfo& task);

class Scheduler final : public core::Scheduler {
 public:
  Scheduler() = default;
  explicit Scheduler(Client client) : client_(std::move(client)) {}

  std::string name() const override { return "slurm"; }
  bool available() const override;
  std::optional<core::Allocation> detect(const core::EnvSource& env, const core::CommandRunner& run) const override;
  bool is_job_id(const std::string& text) const override;
  std::vector<core::SchedulerOption> options() const override;
  void check_config(const core::SchedulerConfig& config, core::Diagnostics& diagnostics) const override;
  std::vector<std::string> submission_warnings(const core::ExperimentConfig& config) const override;
  std::string render_script(const core::ExperimentConfig& config, const core::ScriptOptions& options) const override;
  std::string script_name() const override { return "job.sbatch"; }
  std::string submit(const core::SubmitRequest& request) const override;
  std::vector<core::JobStatus> live_jobs(const core::ExperimentLayout& layout) const override;
  std::string describe_search(int trials, int concurrent) const override;
  std::optional<core::JobStatus> job(const std::string& id) const override;
  std::vector<core::JobStatus> user_jobs(core::JobOwners owners) const override;
  std::vector<core::JobStatus> trial_jobs(const core::ExperimentLayout& layout, int trial, int trials) const override;
  std::vector<core::StopStep> stop(const core::JobTarget& target, core::StopMode mode) const override;
  std::vector<std::string> update_job(const core::JobUpdate& update) const override;
  std::vector<std::string> activate(const core::JobTarget& target) const override;
  std::vector<std::string> cancel(const core::JobTarget& target) const override;
  std::optional<core::HandOverFailure> hand_over(const core::HandOver& stopped) const override;
  // Where the job's partitions have `needed` nodes besides the left out ones.
  bool can_leave_out(const core::Allocation& allocation, int left_out, int needed) const override;
  bool allows_srun() const override { return true; }
  std::vector<std::string> end_leftover_steps(const core::Allocation& allocation) const override;

 private:
  // The job a target names (the experiment's latest Slurm job when it names none) and its tasks;
  // SchedulerError once Slurm has forgotten it.
  std::pair<std::string, std::vector<JobInfo>> target_tasks(const core::JobTarget& target) const;
  Client client_;
};

}  // namespace hpctrial::slurm
