// PBS Professional / OpenPBS as a core::Scheduler: qsub scripts, array jobs for searches (subjob
// N runs trial N), held, released and deleted as a whole as PBS requires. PBS lets no ordinary
// user requeue a job, so a stopped job hands over by submitting the job that resumes its trial
// (afterany on itself, held when paused), recorded in the experiment directory. Output in
// <experiment>/pbs-<job>.out.
#pragma once

#include "hpctrial/core/scheduler.h"
#include "hpctrial/pbs/client.h"

namespace hpctrial::pbs {

// The neutral state of a job as qstat describes it.
core::JobState job_state(const JobInfo& job);

class Scheduler final : public core::Scheduler {
 public:
  Scheduler() = default;
  explicit Scheduler(Client client) : client_(std::move(client)) {}

  std::string name() const override { return "pbs"; }
  bool available() const override;
  std::optional<core::Allocation> detect(const core::EnvSource& env, const core::CommandRunner& run) const override;
  // "1234.server" or "1234[]" forms: a bare number is taken for Slurm's.
  bool is_job_id(const std::string& text) const override;
  std::vector<core::SchedulerOption> options() const override;
  void check_config(const core::SchedulerConfig& config, core::Diagnostics& diagnostics) const override;
  std::string render_script(const core::ExperimentConfig& config, const core::ScriptOptions& options) const override;
  std::string script_name() const override { return "job.pbs"; }
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

  // A live job of an experiment as PBS acts on it: a plain job, or an array job with its live
  // subjobs (PBS holds, releases and deletes an array job only as a whole).
  struct Unit {
    JobInfo job;
    int trial = 0;                // a plain job's trial
    std::vector<JobInfo> subjobs;  // an array job's live subjobs
    bool array() const { return job.id.find("[]") != std::string::npos; }
  };

 private:
  std::vector<Unit> live_units(const core::JobTarget& target) const;
  // Writes the script of the job that resumes `stopped` to `script`; the error, else "".
  std::string write_resume_script(const core::HandOver& stopped, const std::string& script) const;
  Client client_;
};

// The trial of "1234[3].srv" (3), else `fallback`.
int array_index(const std::string& id, int fallback);

}  // namespace hpctrial::pbs
