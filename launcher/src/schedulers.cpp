#include "hpctrial/launcher/schedulers.h"

#include "hpctrial/core/error.h"
#include "hpctrial/pbs/scheduler.h"
#include "hpctrial/slurm/scheduler.h"

namespace hpctrial::launcher {
namespace {

// This machine: `hpctrial run`, or `hpctrial launch` outside any batch job. It has no jobs to
// submit, list or pause; a stopped run is resumed by running it again.
class LocalScheduler final : public core::Scheduler {
 public:
  std::string name() const override { return "local"; }
  bool available() const override { return false; }  // no batch commands: nothing to list
  std::optional<core::Allocation> detect(const core::EnvSource&, const core::CommandRunner&) const override {
    return core::Allocation{};
  }
  bool is_job_id(const std::string&) const override { return false; }
  std::string render_script(const core::ExperimentConfig& config, const core::ScriptOptions&) const override {
    throw ConfigError((config.source_path.empty() ? std::string("the config") : config.source_path) +
                      ": scheduler.type is local, so there is nothing to submit; run it here with `hpctrial run`, "
                      "or submit with --scheduler slurm (or pbs)");
  }
  std::string script_name() const override { return ""; }
  std::string submit(const core::SubmitRequest&) const override { throw no_jobs(); }
  std::vector<core::JobStatus> live_jobs(const core::ExperimentLayout&) const override { return {}; }
  std::string describe_search(int trials, int) const override {
    return std::to_string(trials) + " trials, one after the other";
  }
  std::optional<core::JobStatus> job(const std::string&) const override { return std::nullopt; }
  std::vector<core::JobStatus> user_jobs(core::JobOwners) const override { return {}; }
  std::vector<core::JobStatus> trial_jobs(const core::ExperimentLayout&, int, int) const override { return {}; }
  std::vector<core::StopStep> stop(const core::JobTarget&, core::StopMode) const override { throw no_jobs(); }
  std::vector<std::string> activate(const core::JobTarget&) const override { throw no_jobs(); }
  std::vector<std::string> cancel(const core::JobTarget&) const override { throw no_jobs(); }
  std::optional<core::HandOverFailure> hand_over(const core::HandOver&) const override { return std::nullopt; }
  bool allows_srun() const override { return true; }  // inside salloc

 private:
  static ConfigError no_jobs() {
    return ConfigError("an experiment of `hpctrial run` has no batch job: Ctrl-C stops it after a checkpoint, and "
                       "running it again resumes it");
  }
};

}  // namespace

const std::vector<const core::Scheduler*>& schedulers() {
  static const slurm::Scheduler slurm;
  static const pbs::Scheduler pbs;
  static const LocalScheduler local;
  static const std::vector<const core::Scheduler*> all = {&slurm, &pbs, &local};
  return all;
}

const core::Scheduler& scheduler(const std::string& name) {
  std::string known;
  for (const core::Scheduler* s : schedulers()) {
    if (s->name() == name) return *s;
    known += (known.empty() ? "" : ", ") + s->name();
  }
  throw SchedulerError("no scheduler is called \"" + name + "\"; hpctrial knows " + known);
}

const core::Scheduler& scheduler(const core::ExperimentConfig& config) {
  return scheduler(config.scheduler.type);
}

const core::Scheduler* scheduler_of_job(const std::string& id) {
  for (const core::Scheduler* s : schedulers()) {
    if (s->is_job_id(id)) return s;
  }
  return nullptr;
}

}  // namespace hpctrial::launcher
