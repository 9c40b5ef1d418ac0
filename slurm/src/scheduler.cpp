#include "hpctrial/slurm/scheduler.h"

#include <algorithm>
#include <chrono>
#include <sstream>
#include <thread>

#include "hpctrial/core/batch_job.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/logging.h"
#include "hpctrial/core/search.h"
#include "hpctrial/core/shell_quote.h"
#include "hpctrial/core/subprocess.h"
#include "hpctrial/slurm/batch_script.h"
#include "hpctrial/slurm/job_environment.h"

namespace hpctrial::slurm {

core::JobState job_state(const JobInfo& job) {
  using core::JobState;
  const std::string& s = job.state;
  if (s == "PENDING") return job.held() ? JobState::kHeld : JobState::kQueued;
  if (s == "REQUEUE_HOLD") return JobState::kHeld;
  if (s == "REQUEUED" || s == "REQUEUE_FED") return JobState::kQueued;
  if (s == "RUNNING" || s == "CONFIGURING" || s == "RESIZING" || s == "SIGNALING") return JobState::kRunning;
  if (s == "COMPLETING" || s == "STAGE_OUT") return JobState::kEnding;
  if (s == "SUSPENDED") return JobState::kSuspended;
  return JobState::kEnded;
}

int trial_of(const JobInfo& task) {
  if (task.array_task.empty()) return 0;
  if (task.array_task.find_first_not_of("0123456789") != std::string::npos) return -1;
  return std::stoi(task.array_task);
}

bool is_worker(const JobInfo& task) {
  // slurm-<array>_w<task>.err, as the script of an adaptive search names a worker's output.
  const std::string& output = task.std_err.empty() ? task.std_out : task.std_err;
  const std::string name = output.substr(output.rfind('/') + 1);
  return !task.array_job_id.empty() && name.rfind("slurm-" + task.array_job_id + "_w", 0) == 0;
}

namespace {

core::JobStatus status_of(const JobInfo& job) {
  core::JobStatus s;
  s.id = job.display_id();
  s.name = job.name;
  s.user = job.user_name;
  s.state = job_state(job);
  s.native_state = job.state;
  if (is_worker(job)) {
    // A worker trains whichever trial the search gives it: the one it records, if any.
    const std::string dir = core::experiment_of_output(job.std_err.empty() ? job.std_out : job.std_err);
    s.trial = dir.empty() ? -1 : core::worker_trial({dir}, s.id).value_or(-1);
    if (s.trial < 0 && trial_of(job) < 0) s.tasks = job.array_task;
  } else {
    s.trial = trial_of(job);
    if (s.trial < 0) s.tasks = job.array_task;
  }
  s.restarts = job.restarts;
  s.elapsed = job.run_time;
  if (!s.live()) s.exit = job.exit_code;
  s.output = job.std_err.empty() ? job.std_out : job.std_err;
  s.priority = job.priority;
  s.queue = job.partition;
  s.slots_needed = job.num_tasks;
  s.slots_acquired = job.state == "RUNNING" || job.state == "COMPLETING" ? job.num_tasks : 0;
  return s;
}

// True when `task` is one of the experiment's: its output goes to the experiment directory, as
// the script of `hpctrial submit` asks (--output, --error). A recorded id names another job once
// the controller was started afresh (its ids begin again) or the ids wrapped.
bool of_experiment(const JobInfo& task, const std::string& experiment_dir) {
  return core::output_in_experiment(task.std_out, experiment_dir) ||
         core::output_in_experiment(task.std_err, experiment_dir);
}

// Why a verb refuses a recorded job that is now another's: the job, what it is, and what to do.
SchedulerError not_of_experiment(const JobInfo& task, const std::string& experiment_dir) {
  const std::string output = task.std_out.empty() ? task.std_err : task.std_out;
  return SchedulerError(
      "slurm job " + task.display_id() + " is not the job of " + experiment_dir + ": it is job \"" + task.name +
      "\" of user " + (task.user_id.empty() ? std::string("?") : task.user_id) + ", its output in " +
      (output.empty() ? std::string("no file Slurm names") : output) + " (working directory " +
      (task.work_dir.empty() ? std::string("unknown") : task.work_dir) + "). Slurm gave the id recorded in " +
      core::ExperimentLayout{experiment_dir}.state() + " to another job (its controller started afresh, or its "
      "ids wrapped), so the experiment's own job has ended; nothing was signalled, held, released or cancelled. "
      "Submit the experiment again (`" +
      core::shell_join({"hpctrial", "submit", core::ExperimentLayout{experiment_dir}.config(), "--experiment",
                        experiment_dir}) +
      "`) to resume it from its latest checkpoint");
}

// slurm-<job>.err, or slurm-<array>_<trial>.err for a task of a search: what the script's
// --output/--error name (batch_script.cpp).
std::string output_file(const core::ExperimentLayout& layout, const std::string& job, int trial, int trials) {
  const std::string base = job.substr(0, job.find('_'));
  return layout.job_file("slurm-" + (trials > 1 ? base + "_" + std::to_string(trial) : base) + ".err");
}

}  // namespace

bool Scheduler::available() const { return core::on_path("scontrol"); }

std::optional<core::Allocation> Scheduler::detect(const core::EnvSource& env, const core::CommandRunner& run) const {
  return job_allocation(env, run);
}

bool Scheduler::is_job_id(const std::string& text) const { return is_valid_job_id(text); }

std::vector<core::SchedulerOption> Scheduler::options() const {
  return {{"partition", false}, {"qos", false}, {"gpu_type", false}};
}

void Scheduler::check_config(const core::SchedulerConfig& config, core::Diagnostics& diagnostics) const {
  if (const auto at = config.written_at.find("queue"); at != config.written_at.end()) {
    diagnostics.error(at->second, "scheduler.queue", "is a PBS option; Slurm calls it scheduler.partition");
  }
}

std::vector<std::string> Scheduler::submission_warnings(const core::ExperimentConfig& config) const {
  if (config.resources.gpus_per_slot > 0) return {};
  const std::string no_gpus = " but resources.gpus_per_slot is 0, so the job asks for no GPU: an hpctrial slot is a "
                              "rank, not a GPU as in Determined; set resources.gpus_per_slot (1: one GPU a rank)";
  std::vector<std::string> out;
  if (const std::string type = config.scheduler.option("gpu_type"); !type.empty()) {
    out.push_back("scheduler.gpu_type names GPUs of type " + type + no_gpus);
  }
  if (const std::string partition = config.scheduler.option("partition");
      !partition.empty() && client_.partition_has_gpus(partition)) {
    out.push_back("partition " + partition + " has GPUs (its TRES counts gres/gpu)" + no_gpus);
  }
  return out;
}

std::string Scheduler::render_script(const core::ExperimentConfig& config, const core::ScriptOptions& options) const {
  if (options.trial >= 0) {
    throw ConfigError("a slurm job resumes by requeueing itself; there is no script for one trial of a search");
  }
  return render_batch_script(config, {options.experiment_dir, options.hpctrial});
}

std::string Scheduler::submit(const core::SubmitRequest& request) const {
  if (!request.after.empty()) throw SchedulerError("slurm jobs of hpctrial requeue themselves; none waits for another");
  return client_.submit(request.script, request.env, request.hold);
}

std::vector<core::JobStatus> Scheduler::live_jobs(const core::ExperimentLayout& layout) const {
  std::vector<core::JobStatus> live;
  const auto latest = core::latest_job(layout);
  if (!latest || !is_valid_job_id(latest->id)) return live;
  for (const JobInfo& task : client_.job_tasks(latest->id)) {
    if (!of_experiment(task, layout.dir)) continue;  // the id given to another job
    if (core::JobStatus s = status_of(task); s.live()) live.push_back(std::move(s));
  }
  return live;
}

std::string Scheduler::describe_search(int trials, int concurrent) const {
  return "a job array of " + std::to_string(trials) + " trials (task N runs trial N, at most " +
         std::to_string(std::min(trials, concurrent)) + " at a time)";
}

std::optional<core::JobStatus> Scheduler::job(const std::string& id) const {
  const auto tasks = client_.job_tasks(id);
  if (tasks.empty()) return std::nullopt;
  return status_of(tasks.front());
}

std::vector<core::JobStatus> Scheduler::user_jobs(core::JobOwners owners) const {
  std::vector<core::JobStatus> jobs;
  for (const JobInfo& job : client_.user_jobs(owners)) jobs.push_back(status_of(job));
  return jobs;
}

std::vector<core::JobStatus> Scheduler::trial_jobs(const core::ExperimentLayout& layout, int trial, int trials) const {
  // A Slurm job requeues itself: the experiment's latest job is the one that ran the trial.
  const auto latest = core::latest_job(layout);
  if (!latest || !is_valid_job_id(latest->id)) return {};
  core::JobStatus forgotten;
  forgotten.id = trials > 1 ? latest->id + "_" + std::to_string(trial) : latest->id;
  forgotten.trial = trial;
  forgotten.output = output_file(layout, latest->id, trial, trials);
  const auto tasks = client_.job_tasks(latest->id);
  bool workers = false;
  if (tasks.empty()) {
    // Forgotten: a search's workers had outputs of their own (slurm-<array>_w<task>), none a trial's.
    try {
      workers = core::search_workers(core::load_experiment_config({layout.config(), "", {}})) > 0;
    } catch (const Error&) {
      // no config to read: the trial's task, as for any search
    }
  }
  for (const JobInfo& task : tasks) {
    if (!of_experiment(task, layout.dir)) continue;
    if (is_worker(task)) {
      // A worker's output holds every trial it trained: the one training `trial` now, if any.
      workers = true;
      core::JobStatus s = status_of(task);
      if (s.trial == trial) return {s};
      continue;
    }
    if (trial_of(task) != trial) continue;
    core::JobStatus s = status_of(task);
    s.output = forgotten.output;
    return {s};
  }
  if (workers) return {};
  return {forgotten};
}

std::pair<std::string, std::vector<JobInfo>> Scheduler::target_tasks(const core::JobTarget& target) const {
  std::string job = target.job;
  if (job.empty()) {
    const auto latest = core::latest_job({target.experiment_dir});
    if (!latest || !is_valid_job_id(latest->id)) {
      throw ConfigError(target.experiment_dir + " has no slurm job recorded; submit it with `hpctrial submit`");
    }
    job = latest->id;
  }
  auto tasks = client_.job_tasks(job);
  if (tasks.empty()) {
    throw SchedulerError("slurm no longer knows job " + job + " (it ended a while ago); see its experiment "
                         "directory for what it did");
  }
  // A job named by its id has the experiment directory its output lies in; one recorded for a
  // directory must still be the experiment's before anything acts on it.
  if (!target.experiment_dir.empty()) {
    for (const JobInfo& task : tasks) {
      if (!of_experiment(task, target.experiment_dir)) throw not_of_experiment(task, target.experiment_dir);
    }
  }
  return {job, std::move(tasks)};
}

std::vector<core::StopStep> Scheduler::stop(const core::JobTarget& target, core::StopMode mode) const {
  const auto [job, tasks] = target_tasks(target);
  const std::string reason = core::stop_reason_of(mode);
  std::vector<core::StopStep> steps;
  for (const JobInfo& task : tasks) {
    const std::string id = task.display_id();
    if (task.state == "PENDING" && mode == core::StopMode::kEnd) {
      client_.cancel(id);  // nothing trained since its checkpoint
      steps.push_back({core::StopStep::Kind::kEnded, id, trial_of(task)});
    } else if (task.state == "PENDING") {
      if (task.held()) {
        steps.push_back({core::StopStep::Kind::kAlreadyHeld, id, trial_of(task)});
      } else {
        client_.hold(id);
        steps.push_back({core::StopStep::Kind::kHeld, id, trial_of(task)});
      }
    } else if (task.state == "RUNNING") {
      if (target.experiment_dir.empty()) {
        throw SchedulerError("cannot find the experiment directory of slurm job " + id + " (its output file is " +
                             task.std_out + "); " + (mode == core::StopMode::kEnd ? "cancel" : "pause") +
                             " it by its experiment directory instead");
      }
      const core::ExperimentLayout layout{target.experiment_dir};
      int trial = trial_of(task);
      if (is_worker(task)) {
        // A worker's trial may change at any moment: the request is its job's, for this run of it,
        // read by its launcher when the signal comes or by the worker before its next trial.
        core::request_job_stop(layout, id, task.restarts, reason);
        trial = core::worker_trial(layout, id).value_or(-1);
      } else {
        core::request_stop(layout, trial, reason);
      }
      // By the task's own name: the raw id of an array's last task is the array's, which scancel takes
      // for every task of it, each of which would stop without its request.
      if (!client_.signal_batch(id, "USR2")) {  // the batch shell: hpctrial launch
        // It left RUNNING since it was listed: it read the request already and requeued itself,
        // or ended. Seen pending and not held, it is held like any waiting task.
        const auto now = client_.job(id);
        if (now && now->state == "PENDING" && mode == core::StopMode::kEnd) {
          client_.cancel(id);
        } else if (now && now->state == "PENDING" && !now->held()) {
          client_.hold(id);
        }
      }
      steps.push_back({core::StopStep::Kind::kStopping, id, trial});
    }
  }
  if (steps.empty()) {
    throw SchedulerError("slurm job " + job + " is neither pending nor running; only those can be " +
                         (mode == core::StopMode::kEnd ? "cancelled" : "paused"));
  }
  return steps;
}

// Slurm lets a user lower a job's priority (Nice >= 0, which Slurm subtracts from it), move a
// pending job to another partition, and put it first among the user's own pending jobs of its
// partition (scontrol top, where the site allows users it); nothing places a job just ahead of
// or behind another.
std::vector<std::string> Scheduler::update_job(const core::JobUpdate& update) const {
  using Order = core::JobUpdate::Order;
  if (update.order == Order::kAheadOf || update.order == Order::kBehindOf) {
    throw ConfigError("Slurm orders a user's waiting jobs only by putting one first among them (scontrol top): "
                      "use --top, or --priority to lower another job");
  }
  std::vector<std::string> done;
  const auto refused = [&](const SchedulerError& e, const std::string& hint) {
    return SchedulerError("slurm refused to change job " + update.job + ": " + e.what() + hint);
  };
  if (update.priority) {
    // A user's hold is a priority of 0, which a new Nice replaces: the job would start.
    if (const auto now = client_.job(update.job); now && now->held()) {
      throw SchedulerError("slurm job " + update.job + " is held, and Slurm lets a held job start as soon as its "
                           "Nice changes; release it first (hpctrial activate), then change its priority");
    }
    try {
      client_.update(update.job, {"Nice=" + std::to_string(-*update.priority)});
    } catch (const SchedulerError& e) {
      throw refused(e, *update.priority > 0 ? " (Slurm lets users lower a job's priority, --priority 0 or less, "
                                              "which sets its Nice to the opposite; only an operator raises it)"
                                            : "");
    }
    done.push_back("slurm job " + update.job + ": Nice=" + std::to_string(-*update.priority) + " (priority " +
                   std::to_string(*update.priority) + ")");
  }
  if (!update.queue.empty()) {
    try {
      client_.update(update.job, {"Partition=" + update.queue});
    } catch (const SchedulerError& e) {
      throw refused(e, " (only a pending job changes partition)");
    }
    done.push_back("slurm job " + update.job + ": partition " + update.queue);
  }
  if (update.order == Order::kTop) {
    try {
      client_.top(update.job);
    } catch (const SchedulerError& e) {
      throw refused(e, " (scontrol top is the site's to allow users: SchedulerParameters=enable_user_top)");
    }
    done.push_back("slurm job " + update.job + ": first among your pending jobs of its partition");
  }
  return done;
}

std::vector<std::string> Scheduler::activate(const core::JobTarget& target) const {
  std::vector<std::string> released;
  for (const JobInfo& task : target_tasks(target).second) {
    if (!task.held()) continue;
    client_.release(task.display_id());
    released.push_back(task.display_id());
  }
  return released;
}

std::vector<std::string> Scheduler::cancel(const core::JobTarget& target) const {
  const auto [job, tasks] = target_tasks(target);
  client_.cancel(job);  // every task of an array
  return {job};
}

namespace {

// The job's ExcNodeList with `nodes` added (a hostlist: "a,b,node[3-5]"); each of `nodes` once.
std::string with_excluded(const std::string& listed, const std::vector<std::string>& nodes) {
  std::vector<std::string> words;
  std::string word;
  int depth = 0;
  for (const char c : listed + ",") {
    depth += c == '[' ? 1 : c == ']' ? -1 : 0;
    if (c == ',' && depth == 0) {
      if (!word.empty()) words.push_back(word);
      word.clear();
    } else {
      word += c;
    }
  }
  for (const std::string& node : nodes) {
    if (std::find(words.begin(), words.end(), node) == words.end()) words.push_back(node);
  }
  std::string joined;
  for (const std::string& w : words) joined += (joined.empty() ? "" : ",") + w;
  return joined;
}

}  // namespace

bool Scheduler::can_leave_out(const core::Allocation& allocation, int left_out, int needed) const {
  std::optional<JobInfo> job;
  try {
    job = client_.job(allocation.job_id);
  } catch (const Error&) {
    return false;
  }
  if (!job) return false;
  int most = 0;
  std::istringstream partitions(job->partition);
  for (std::string partition; std::getline(partitions, partition, ',');) {
    most = std::max(most, client_.partition_nodes(partition));
  }
  return most - left_out >= needed;
}

// A killed mpirun leaves the steps of its daemons on the other nodes running (the daemons wait on
// a parent that is gone), and they hold those nodes' task slots: the next mpirun's srun would wait
// for them forever. The launcher runs its attempts one at a time, so every program step of the
// job is the last attempt's: each is cancelled, and awaited for up to 30 s.
std::vector<std::string> Scheduler::end_leftover_steps(const core::Allocation& allocation) const {
  std::vector<std::string> steps;
  try {
    steps = client_.program_steps(allocation.job_id);
    for (const std::string& step : steps) client_.cancel(step);
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (!client_.program_steps(allocation.job_id).empty() && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  } catch (const Error& e) {
    core::log_warning("cannot end the steps slurm job {} has left from its last attempt: {}", allocation.job_id,
                      e.what());
  }
  return steps;
}

std::optional<core::HandOverFailure> Scheduler::hand_over(const core::HandOver& stopped) const {
  const std::string& job = stopped.allocation.job_id;
  const Client client(stopped.run);
  // Only a pending job takes a new ExcNodeList: one that leaves nodes out waits held until it has it.
  const bool leave_out = !stopped.exclude_nodes.empty();
  std::string error;
  try {
    client.requeue(job, stopped.hold || leave_out);
  } catch (const Error& e) {
    error = e.what();
  }
  // The requeue's SIGTERM reaches every process of the job, scontrol among them, which may die
  // after the requeue took effect: a second try is told the job is pending, requeued (and held,
  // when it asked that) by the first.
  if (!error.empty() && error.find("Job is pending execution") == std::string::npos) {
    // Slurm requeues a job that has ended as long as it still knows it (MinJobAge).
    return core::HandOverFailure{"cannot requeue slurm job " + job + ": " + error,
                                 core::shell_join({"scontrol", stopped.hold ? "requeuehold" : "requeue", job})};
  }
  std::string left_out;
  if (leave_out) {
    std::string nodes = with_excluded("", stopped.exclude_nodes);
    try {
      const auto now = client.job(job);
      nodes = with_excluded(now ? now->excluded_nodes : "", stopped.exclude_nodes);
      client.exclude_nodes(job, nodes);
      if (!stopped.hold) client.release(job);
    } catch (const Error& e) {
      return core::HandOverFailure{
          "slurm job " + job + " is requeued and held, but cannot leave out " + nodes + ": " + e.what(),
          core::shell_join({"scontrol", "update", "JobId=" + job, "ExcNodeList=" + nodes}) + " && " +
              core::shell_join({"scontrol", "release", job})};
    }
    left_out = " without node(s) " + nodes;
  }
  core::log_info("slurm job {} requeued after run {} of this job{}{}", job, stopped.allocation.restart_count + 1,
                 left_out, stopped.hold ? " and held: `hpctrial activate " + job + "` resumes it" : "");
  return std::nullopt;
}

}  // namespace hpctrial::slurm
