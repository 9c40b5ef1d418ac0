#include "hpctrial/pbs/scheduler.h"

#include <pwd.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <ctime>
#include <map>

#include "hpctrial/core/batch_job.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/files.h"
#include "hpctrial/core/logging.h"
#include "hpctrial/core/search.h"
#include "hpctrial/core/shell_quote.h"
#include "hpctrial/core/subprocess.h"
#include "hpctrial/pbs/batch_script.h"
#include "hpctrial/pbs/job_environment.h"

namespace hpctrial::pbs {

core::JobState job_state(const JobInfo& job) {
  using core::JobState;
  const std::string& s = job.state;
  if (s == "H") return JobState::kHeld;
  if (s == "Q" || s == "W" || s == "T" || s == "M") return JobState::kQueued;
  if (s == "R" || s == "B") return JobState::kRunning;
  if (s == "E") return JobState::kEnding;
  if (s == "S" || s == "U") return JobState::kSuspended;
  return JobState::kEnded;
}

int array_index(const std::string& id, int fallback) {
  const std::size_t open = id.find('['), close = id.find(']');
  if (open == std::string::npos || close == std::string::npos || close <= open + 1) return fallback;
  return std::stoi(id.substr(open + 1, close - open - 1));
}

namespace {

// The script that resumes a stopped trial in a job of its own, kept in the trial's directory.
constexpr const char* kResumeScript = "resume.pbs";
// The script of a job of one worker of an adaptive search, kept in the experiment directory.
constexpr const char* kWorkerScript = "worker.pbs";

// True when PBS's `job` is one of the experiment's: its output file lies in the experiment
// directory. A recorded id names another job once the server was re-created and its ids began
// again; that job is never shown, paused or deleted as the experiment's.
bool of_experiment(const JobInfo& job, const std::string& experiment_dir) {
  return core::output_in_experiment(job.output_path, experiment_dir);
}

std::map<std::string, JobInfo> by_id(std::vector<JobInfo> jobs) {
  std::map<std::string, JobInfo> out;
  for (JobInfo& job : jobs) out.emplace(job.id, std::move(job));
  return out;
}

// True when `id` is a subjob of array job `array`: "1234[3].srv" of "1234[].srv".
bool subjob_of(const std::string& id, const std::string& array) {
  const std::size_t open = array.find("[]");
  if (open == std::string::npos || id.compare(0, open + 1, array, 0, open + 1) != 0) return false;
  const std::size_t close = id.find(']', open + 1);
  return close != std::string::npos && close > open + 1 && id.substr(close + 1) == array.substr(open + 2);
}

std::string output_file(const std::string& experiment_dir, const std::string& job) {
  return core::ExperimentLayout{experiment_dir}.job_file("pbs-" + job + ".out");
}

// True when the experiment in `layout` is an adaptive search, whose jobs are its workers.
bool runs_workers(const core::ExperimentLayout& layout) {
  try {
    return core::search_workers(core::load_experiment_config({layout.config(), "", {}})) > 0;
  } catch (const Error&) {
    return false;  // no config to read: no workers to ask
  }
}

// The trial a job of the experiment runs: the one its worker records (an adaptive search), its
// array index, or the trial it was recorded for.
int trial_of(const JobInfo& job, const std::string& experiment_dir) {
  if (!experiment_dir.empty()) {
    if (const auto trial = core::worker_trial({experiment_dir}, job.id)) return *trial;
  }
  if (const int index = array_index(job.id, -1); index >= 0) return index;
  if (experiment_dir.empty()) return -1;
  for (const auto& recorded : core::recorded_jobs({experiment_dir})) {
    if (recorded.id == job.id) return std::max(0, recorded.trial);
  }
  return -1;
}

core::JobStatus status_of(const JobInfo& job, const std::string& experiment_dir) {
  core::JobStatus s;
  s.id = job.id;
  s.name = job.name;
  s.user = job.owner.substr(0, job.owner.find('@'));
  s.state = job_state(job);
  s.native_state = job.state;
  s.trial = trial_of(job, experiment_dir);
  s.restarts = std::max(0, job.run_count - 1);
  if (job.exit_status) s.exit = std::to_string(*job.exit_status);
  s.output = job.output_path;
  s.priority = job.priority;
  s.queue = job.queue;
  s.slots_needed = job.mpiprocs;
  s.slots_acquired = job.state == "R" || job.state == "E" ? job.mpiprocs : 0;
  // A worker's own output file (its trials, one after another), as its script writes it.
  if (!experiment_dir.empty() && core::worker_trial({experiment_dir}, job.id)) s.output = output_file(experiment_dir, job.id);
  return s;
}

// The ids of the PBS jobs that ran or run `trial`, oldest first: the array job's subjob for it
// ("1234[T].srv"), and the jobs submitted to resume it.
std::vector<std::string> trial_job_ids(const core::ExperimentLayout& layout, int trial, int trials) {
  std::vector<std::string> ids;
  for (const auto& job : core::recorded_jobs(layout)) {
    if (job.scheduler != "pbs" || (job.trial >= 0 && job.trial != trial)) continue;
    const std::size_t array = job.id.find("[]");
    if (job.trial < 0 && trials > 1) {
      if (array != std::string::npos) ids.push_back(job.id.substr(0, array + 1) + std::to_string(trial) + job.id.substr(array + 1));
    } else {
      ids.push_back(job.id);
    }
  }
  return ids;
}

}  // namespace

bool Scheduler::available() const { return core::on_path("qstat"); }

std::optional<core::Allocation> Scheduler::detect(const core::EnvSource& env, const core::CommandRunner& run) const {
  return job_allocation(env, run);
}

std::vector<core::SchedulerOption> Scheduler::options() const { return {{"queue", true}}; }

void Scheduler::check_config(const core::SchedulerConfig& config, core::Diagnostics& diagnostics) const {
  for (const auto& [key, message] : {std::pair<std::string, const char*>{"partition", "is a Slurm option; PBS calls it scheduler.queue"},
                                     {"qos", "is a Slurm option that PBS does not have; remove it"},
                                     {"gpu_type", "is a Slurm option; on PBS name the GPU type in resources the queue "
                                                  "knows, through scheduler.extra_directives (e.g. -l select=...:gpu_model=a100)"}}) {
    if (const auto at = config.written_at.find(key); at != config.written_at.end()) {
      diagnostics.error(at->second, "scheduler." + key, message);
    }
  }
}

bool Scheduler::is_job_id(const std::string& text) const {
  return is_valid_job_id(text) && text.find_first_of(".[") != std::string::npos;
}

std::string Scheduler::render_script(const core::ExperimentConfig& config, const core::ScriptOptions& options) const {
  return render_batch_script(config, {options.experiment_dir, options.hpctrial, options.trial, options.one_worker});
}

std::string Scheduler::submit(const core::SubmitRequest& request) const {
  Client::Submit submit;
  submit.script = request.script;
  submit.env = request.env;
  submit.hold = request.hold;
  submit.after = request.after;
  return client_.submit(submit);
}

std::vector<core::JobStatus> Scheduler::live_jobs(const core::ExperimentLayout& layout) const {
  std::vector<std::string> ids;
  for (const auto& earlier : core::recorded_jobs(layout)) {
    if (earlier.scheduler == name() && is_valid_job_id(earlier.id)) ids.push_back(earlier.id);
  }
  std::vector<core::JobStatus> live;
  for (const JobInfo& job : client_.jobs(ids)) {
    if (job.id.find("[]") != std::string::npos) continue;  // an array job: its subjobs are what runs
    if (job.active() && of_experiment(job, layout.dir)) live.push_back(status_of(job, layout.dir));
  }
  return live;
}

std::string Scheduler::describe_search(int trials, int concurrent) const {
  return "an array job of " + std::to_string(trials) + " trials (subjob N runs trial N, at most " +
         std::to_string(std::min(trials, concurrent)) + " at a time)";
}

std::optional<core::JobStatus> Scheduler::job(const std::string& id) const {
  const auto job = client_.job(id);
  if (!job) return std::nullopt;
  return status_of(*job, core::experiment_of_output(job->output_path));
}

std::vector<core::JobStatus> Scheduler::user_jobs(core::JobOwners owners) const {
  std::vector<core::JobStatus> jobs;
  // Those that ended within a day, as Slurm keeps a job a while after it ended.
  const std::time_t day_ago = std::time(nullptr) - 24 * 3600;
  const std::string user = owners == core::JobOwners::kMine ? user_name() : "";
  for (const JobInfo& job : client_.user_jobs(user, day_ago)) {
    if (!job.active() && job.state != "F" && job.state != "X") continue;
    if (job.id.find("[]") != std::string::npos) continue;  // an array job: its subjobs are listed
    jobs.push_back(status_of(job, core::experiment_of_output(job.output_path)));
  }
  return jobs;
}

std::vector<core::JobStatus> Scheduler::trial_jobs(const core::ExperimentLayout& layout, int trial, int trials) const {
  std::vector<core::JobStatus> jobs;
  if (runs_workers(layout)) {
    // The worker that trains `trial` now, if any: a worker's output holds every trial it trained.
    std::vector<std::string> ids;
    for (const auto& recorded : core::recorded_jobs(layout)) {
      if (recorded.scheduler == name() && is_valid_job_id(recorded.id)) ids.push_back(recorded.id);
    }
    for (const JobInfo& job : client_.jobs(ids)) {
      if (job.active() && of_experiment(job, layout.dir) && core::worker_trial(layout, job.id) == trial) {
        return {status_of(job, layout.dir)};
      }
    }
    return jobs;
  }
  const std::vector<std::string> ids = trial_job_ids(layout, trial, trials);
  const std::map<std::string, JobInfo> known = by_id(client_.jobs(ids));
  for (const std::string& id : ids) {
    core::JobStatus s;
    if (const auto job = known.find(id); job != known.end() && of_experiment(job->second, layout.dir)) {
      s = status_of(job->second, layout.dir);
    }
    s.id = id;
    s.trial = trial;
    s.output = output_file(layout.dir, id);  // the job's own file, beside the others of the trial
    jobs.push_back(std::move(s));
  }
  return jobs;
}

std::vector<Scheduler::Unit> Scheduler::live_units(const core::JobTarget& target) const {
  std::vector<core::RecordedJob> jobs;
  if (!target.job.empty()) {
    int trial = -1;
    if (!target.experiment_dir.empty()) {
      for (const auto& r : core::recorded_jobs({target.experiment_dir})) {
        if (r.id == target.job) trial = r.trial;
      }
    }
    jobs.push_back({target.job, name(), "", trial});
  } else {
    jobs = core::recorded_jobs({target.experiment_dir});
  }
  std::vector<std::string> ids;
  for (const auto& recorded : jobs) {
    if (recorded.scheduler == name() && is_valid_job_id(recorded.id)) ids.push_back(recorded.id);
  }
  const std::vector<JobInfo> known = client_.jobs(ids);  // the array jobs' subjobs too
  if (!target.job.empty() && known.empty()) {
    throw SchedulerError("pbs no longer knows job " + target.job + "; see its experiment directory");
  }
  std::vector<Unit> live;
  for (const auto& recorded : jobs) {
    const auto job = std::find_if(known.begin(), known.end(), [&](const JobInfo& j) { return j.id == recorded.id; });
    if (job == known.end() || !job->active()) continue;
    if (target.job.empty() && !of_experiment(*job, target.experiment_dir)) continue;  // an id used again
    Unit unit{*job, array_index(recorded.id, std::max(0, recorded.trial)), {}};
    if (unit.array()) {
      for (const JobInfo& sub : known) {
        if (sub.active() && subjob_of(sub.id, recorded.id)) unit.subjobs.push_back(sub);
      }
    }
    live.push_back(std::move(unit));
  }
  return live;
}

std::vector<core::StopStep> Scheduler::stop(const core::JobTarget& target, core::StopMode mode) const {
  const std::string reason = core::stop_reason_of(mode);
  std::vector<core::StopStep> steps;
  const core::ExperimentLayout layout{target.experiment_dir};
  const bool workers = !target.experiment_dir.empty() && runs_workers(layout);
  const auto stop = [&](const JobInfo& job, int trial) {
    if (target.experiment_dir.empty()) {
      throw SchedulerError("cannot find the experiment directory of pbs job " + job.id + " (its output goes to " +
                           job.output_path + "); " + reason + " it by its experiment directory instead");
    }
    // The request on disk is the record; SIGURG delivers it. qsig signals every process of the
    // job, and SIGURG is the signal that every one of them but the launcher ignores (the job's
    // top process, the user's login shell, dies of SIGUSR2, and the job with it): the launcher
    // passes the stop to the ranks at once, without waiting to see the request on a shared
    // filesystem that may cache the directory for seconds. A search's worker: its job's
    // request, which the worker reads before each trial and its launcher when the signal comes
    // (the trial it trains may change at any moment: a request of the trial's could reach
    // another worker's).
    if (workers) {
      core::request_job_stop(layout, job.id, -1, reason);
      trial = core::worker_trial(layout, job.id).value_or(-1);
    } else {
      core::request_stop(layout, trial, reason, job.id);
    }
    // Refused: the job left R since it was listed, and reads the request if it runs again.
    client_.signal(job.id, "SIGURG");
    steps.push_back({core::StopStep::Kind::kStopping, job.id, trial});
  };
  for (const Unit& unit : live_units(target)) {
    bool queued = unit.job.state == "Q" || unit.job.state == "W";
    if (unit.array()) {
      queued = false;
      for (const auto& sub : unit.subjobs) {
        if (sub.state == "R") stop(sub, array_index(sub.id, 0));
        if (sub.state == "Q" || sub.state == "W") queued = true;
      }
    } else if (unit.job.state == "R") {
      stop(unit.job, unit.trial);
    }
    if (mode == core::StopMode::kEnd && (queued || (unit.job.held() && !unit.array()))) {
      // Nothing trained since its checkpoint. An array's running subjobs end on their own.
      if (unit.array()) {
        for (const auto& sub : unit.subjobs) {
          if (sub.state != "R") client_.cancel(sub.id);
        }
      } else {
        client_.cancel(unit.job.id);
      }
      steps.push_back({core::StopStep::Kind::kEnded, unit.job.id, unit.trial});
    } else if (unit.job.held()) {
      steps.push_back({core::StopStep::Kind::kAlreadyHeld, unit.job.id, unit.trial});
    } else if (queued) {
      client_.hold(unit.job.id);  // an array job: its queued subjobs wait with it
      steps.push_back({core::StopStep::Kind::kHeld, unit.job.id, unit.trial});
    }
  }
  if (steps.empty()) {
    throw SchedulerError((target.job.empty() ? target.experiment_dir : target.job) +
                         " has no queued or running pbs job to " + reason);
  }
  return steps;
}

std::vector<std::string> Scheduler::activate(const core::JobTarget& target) const {
  std::vector<std::string> released;
  for (const Unit& unit : live_units(target)) {
    if (!unit.job.held()) continue;
    client_.release(unit.job.id);
    released.push_back(unit.job.id);
  }
  return released;
}

std::vector<std::string> Scheduler::cancel(const core::JobTarget& target) const {
  const auto live = live_units(target);
  if (live.empty()) {
    throw SchedulerError((target.job.empty() ? target.experiment_dir : target.job) +
                         " has no queued or running pbs job to kill");
  }
  // The ranks get scheduler.preemption_grace between PBS's SIGTERM and its SIGKILL, not the
  // queue's kill_delay (10 s by default): time for their checkpoint.
  std::optional<int> grace;
  if (!target.experiment_dir.empty()) {
    try {
      const core::ExperimentLayout layout{target.experiment_dir};
      grace = static_cast<int>(core::load_experiment_config({layout.config(), "", {}}).scheduler.preemption_grace_seconds);
    } catch (const Error& e) {
      core::log_warning("{}; deleting with the queue's kill_delay", e.what());
    }
  }
  std::vector<std::string> cancelled;
  for (const Unit& unit : live) {
    client_.cancel(unit.job.id, grace);  // an array job with all its subjobs
    cancelled.push_back(unit.job.id);
  }
  return cancelled;
}

// The script of the job that resumes a stopped trial, or worker, written where hand_over
// submits it from; the error, when it cannot be written.
std::string Scheduler::write_resume_script(const core::HandOver& stopped, const std::string& script) const {
  const core::ExperimentLayout layout{stopped.experiment_dir};
  core::ExperimentConfig config = stopped.config;
  // PBS has no node ranges: an elastic trial's next job asks for the size its adaptive batch
  // prefers (the launcher then starts as many ranks as the job got).
  if (const auto slots = stopped.worker ? std::nullopt
                                        : core::preferred_slots(layout.trial_dir(stopped.trial), config.resources)) {
    if (*slots != config.resources.slots_per_trial) {
      core::log_info("the pbs job that resumes trial {} asks for {} slot(s), as its adaptive batch prefers",
                     stopped.trial, *slots);
    }
    config.resources.slots_per_trial = *slots;
    config.resources.min_slots_per_trial = 0;
  }
  try {
    core::write_file_atomic(script, render_script(config, {layout.dir, core::self_program(),
                                                           stopped.worker ? -1 : stopped.trial, stopped.worker}));
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

std::optional<core::HandOverFailure> Scheduler::hand_over(const core::HandOver& stopped) const {
  const core::ExperimentLayout layout{stopped.experiment_dir};
  const std::string& job = stopped.allocation.job_id;
  // A job of this trial alone (a search's array job is not submitted again), or of one worker;
  // the values from the submitter's environment are in this job's own, passed on by name.
  const std::string script =
      stopped.worker ? layout.job_file(kWorkerScript) : layout.trial_dir(stopped.trial) + "/" + kResumeScript;
  const std::string what = stopped.worker ? std::string("a worker of the search")
                                          : "trial " + std::to_string(stopped.trial);
  if (const std::string error = write_resume_script(stopped, script); !error.empty()) {
    return core::HandOverFailure{"cannot write " + script + ", the script of the pbs job that resumes " + what + ": " +
                                     error,
                                 core::shell_join({"hpctrial", "submit", layout.config(), "--experiment", layout.dir})};
  }
  core::SubmitRequest request;
  request.script = script;
  request.hold = stopped.hold;
  // PBS lets no job depend on a subjob of an array job ("cannot have dependancy on subjob or
  // range"): the successor of a subjob may start while it ends, and its launcher waits for
  // this one's (one launcher per trial; a worker lets its trial go before it hands over).
  const bool subjob = array_index(job, -1) >= 0;
  if (!subjob) request.after = job;
  std::string names;
  for (const auto& var : stopped.config.scheduler.environment) {
    if (!core::refers_to_submitter(var.value) || stopped.env == nullptr) continue;
    if (const auto value = stopped.env->get(var.name)) {
      request.env.emplace_back(var.name, *value);
      names += (names.empty() ? "" : ",") + var.name;
    }
  }
  std::string id;
  try {
    id = Scheduler(Client(stopped.run)).submit(request);
  } catch (const Error& e) {
    // By hand, once this job has ended: no dependency, not held (whoever runs it wants it to run).
    std::vector<std::string> qsub = {"qsub"};
    if (!names.empty()) qsub.insert(qsub.end(), {"-v", names});
    qsub.push_back(script);
    return core::HandOverFailure{"cannot submit the pbs job that resumes " + what + ": " + e.what(),
                                 core::shell_join(qsub)};
  }
  try {
    core::record_job(layout, name(), id, stopped.worker ? -1 : stopped.trial);
  } catch (const Error& e) {
    core::log_warning("pbs job {} resumes {}, but it could not be recorded in {} ({}): give its id to "
                      "`hpctrial pause`, `activate` and `kill`", id, what, layout.state(), e.what());
  }
  core::log_info("pbs job {} submitted to resume {} once {} has ended{}", id, what,
                 subjob ? "the launcher of subjob " + job : "job " + job,
                 stopped.hold ? "; it is held: `hpctrial activate " + id + "` releases it" : "");
  return std::nullopt;
}

}  // namespace hpctrial::pbs
