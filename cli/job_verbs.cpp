// hpctrial pause / activate / kill: a Slurm job of an experiment (or every task of its job
// array), or every live PBS job of an experiment, named by its id or by the experiment directory.
#include "job_verbs.h"

#include <boost/program_options.hpp>

#include <filesystem>
#include <iostream>

#include "hpctrial/core/error.h"
#include "hpctrial/pbs/client.h"
#include "hpctrial/pbs/job_environment.h"
#include "hpctrial/slurm/job_environment.h"
#include "verb.h"

namespace po = boost::program_options;
namespace fs = std::filesystem;

namespace hpctrial::cli {

Target resolve_target(const std::string& what, const slurm::Client& client) {
  if (slurm::is_valid_job_id(what) && !fs::is_directory(what)) {
    Target t{what, ""};
    for (const auto& task : client.job_tasks(what)) {
      if (task.std_out.empty()) continue;
      const fs::path dir = fs::path(task.std_out).parent_path();
      if (fs::exists(dir / "experiment.json")) t.experiment_dir = dir.string();
      break;
    }
    return t;
  }
  if (!fs::is_directory(what)) {
    throw ConfigError(what + " is neither a job id nor an experiment directory; give the id `hpctrial submit` "
                      "printed, or the experiment directory");
  }
  const mpi_launcher::ExperimentLayout layout{fs::absolute(what).lexically_normal().string()};
  const auto job = mpi_launcher::latest_job(layout);
  if (!job || !slurm::is_valid_job_id(job->id)) {
    throw ConfigError(layout.dir + " has no batch job recorded in " + layout.state() + "; submit it with "
                      "`hpctrial submit`");
  }
  return {job->id, layout.dir};
}

std::vector<slurm::JobInfo> known_tasks(const std::string& id, const slurm::Client& client) {
  auto tasks = client.job_tasks(id);
  if (tasks.empty()) {
    throw SchedulerError("slurm no longer knows job " + id + " (it ended a while ago); see its experiment "
                         "directory for what it did");
  }
  return tasks;
}

int trial_of(const slurm::JobInfo& task) {
  if (task.array_task.empty()) return 0;
  if (task.array_task.find_first_not_of("0123456789") != std::string::npos) return -1;
  return std::stoi(task.array_task);
}

bool is_active(const slurm::JobInfo& job) {
  for (const char* state : {"PENDING", "RUNNING", "REQUEUED", "SUSPENDED", "CONFIGURING", "COMPLETING", "RESIZING",
                            "REQUEUE_HOLD", "REQUEUE_FED", "SIGNALING", "STAGE_OUT"}) {
    if (job.state == state) return true;
  }
  return false;
}

std::string target_argument(const std::vector<std::string>& args, const char* verb, const char* usage,
                            const po::options_description* own, po::variables_map* vm_out) {
  po::options_description options("options");
  options.add_options()("help,h", "show this help");
  if (own != nullptr) options.add(*own);
  po::options_description hidden;
  std::string target;
  hidden.add_options()("target", po::value(&target));
  po::options_description all;
  all.add(options).add(hidden);
  po::positional_options_description pos;
  pos.add("target", 1);
  po::variables_map local;
  po::variables_map& vm = vm_out != nullptr ? *vm_out : local;
  po::store(po::command_line_parser(args).options(all).positional(pos).run(), vm);
  po::notify(vm);
  if (vm.count("help")) {
    std::cout << usage << "\n" << options;
    return "";
  }
  if (target.empty()) throw ConfigError(std::string("hpctrial ") + verb + ": give a job id or an experiment directory");
  return target;
}

namespace {

// --- PBS ------------------------------------------------------------------------------------
// PBS job ids carry their server ("1234.pbs1") or an array index ("1234[]"); a bare number is
// taken for Slurm's.
bool is_pbs_job_id(const std::string& what) {
  return pbs::is_valid_job_id(what) && what.find_first_of(".[") != std::string::npos && !fs::is_directory(what);
}

// The PBS jobs of an experiment that PBS still counts as live. PBS holds, releases and deletes
// an array job as a whole (its subjobs cannot be held one by one), so a search's array job is
// one unit; the subjobs that run are signalled one by one, each for its own trial.
struct PbsUnit {
  pbs::JobInfo job;                 // a plain job, or an array job ("1234[].srv")
  int trial = 0;                    // a plain job's trial
  std::vector<pbs::JobInfo> subjobs;  // an array job's live subjobs
  bool array() const { return job.id.find("[]") != std::string::npos; }
};

// The trial of "1234[3].srv" (3), else `fallback`.
int pbs_trial(const std::string& id, int fallback) {
  const std::size_t open = id.find('['), close = id.find(']');
  if (open == std::string::npos || close == std::string::npos || close <= open + 1) return fallback;
  return std::stoi(id.substr(open + 1, close - open - 1));
}

// The experiment a PBS target names and its live jobs: every job recorded for the experiment
// directory, or the one job named.
struct PbsTarget {
  std::string experiment_dir;
  std::vector<PbsUnit> live;
};

PbsTarget resolve_pbs(const std::string& what, const pbs::Client& client) {
  PbsTarget t;
  std::vector<mpi_launcher::RecordedJob> jobs;
  if (is_pbs_job_id(what)) {
    const auto job = client.job(what);
    if (!job) throw SchedulerError("pbs no longer knows job " + what + "; see its experiment directory");
    const fs::path dir = fs::path(job->output_path).parent_path();
    if (fs::exists(dir / "experiment.json")) t.experiment_dir = dir.string();
    int trial = -1;
    if (!t.experiment_dir.empty()) {
      for (const auto& r : mpi_launcher::recorded_jobs({t.experiment_dir})) {
        if (r.id == what) trial = r.trial;
      }
    }
    jobs.push_back({what, "pbs", "", trial});
  } else {
    t.experiment_dir = fs::absolute(what).lexically_normal().string();
    jobs = mpi_launcher::recorded_jobs({t.experiment_dir});
  }
  for (const auto& recorded : jobs) {
    if (recorded.scheduler != "pbs" || !pbs::is_valid_job_id(recorded.id)) continue;
    auto job = client.job(recorded.id);
    if (!job || !job->active()) continue;
    PbsUnit unit{*job, pbs_trial(recorded.id, std::max(0, recorded.trial)), {}};
    if (unit.array()) {
      for (auto& sub : client.job_tasks(recorded.id)) {
        if (sub.active() && sub.id != recorded.id) unit.subjobs.push_back(std::move(sub));
      }
    }
    t.live.push_back(std::move(unit));
  }
  return t;
}

// Whether `what` names a PBS job or an experiment whose latest job is PBS's.
bool targets_pbs(const std::string& what) {
  if (is_pbs_job_id(what)) return true;
  if (!fs::is_directory(what)) return false;
  const auto job = mpi_launcher::latest_job({fs::absolute(what).lexically_normal().string()});
  return job && job->scheduler == "pbs";
}

int pause_pbs(const std::string& what) {
  const pbs::Client client;
  const PbsTarget t = resolve_pbs(what, client);
  int paused = 0, held = 0, already = 0;
  const auto stop = [&](const pbs::JobInfo& job, int trial) {
    if (t.experiment_dir.empty()) {
      throw SchedulerError("cannot find the experiment directory of pbs job " + job.id + " (its output goes to " +
                           job.output_path + "); pause it by its experiment directory instead");
    }
    mpi_launcher::request_stop({t.experiment_dir}, trial, "pause");
    client.signal(job.id, "USR2");
    std::cout << "pausing pbs job " << job.id << ": the ranks checkpoint after their current step, then it "
              << "submits the job that resumes trial " << trial << ", held\n";
    ++paused;
  };
  for (const PbsUnit& unit : t.live) {
    bool queued = unit.job.state == "Q" || unit.job.state == "W";
    if (unit.array()) {
      queued = false;
      for (const auto& sub : unit.subjobs) {
        if (sub.state == "R") stop(sub, pbs_trial(sub.id, 0));
        if (sub.state == "Q" || sub.state == "W") queued = true;
      }
    } else if (unit.job.state == "R") {
      stop(unit.job, unit.trial);
    }
    if (unit.job.held()) {
      ++already;
    } else if (queued) {
      client.hold(unit.job.id);  // an array job: its queued subjobs wait with it
      ++held;
    }
  }
  if (paused + held + already == 0) throw SchedulerError(what + " has no queued or running pbs job to pause");
  if (held > 0) std::cout << held << " queued pbs job(s) held\n";
  if (paused == 0 && held == 0) std::cout << what << " is already held\n";
  std::cout << "`hpctrial activate " << (t.experiment_dir.empty() ? what : t.experiment_dir) << "` resumes it\n";
  return kExitOk;
}

int activate_pbs(const std::string& what) {
  const pbs::Client client;
  int released = 0;
  for (const PbsUnit& unit : resolve_pbs(what, client).live) {
    if (!unit.job.held()) continue;
    client.release(unit.job.id);
    std::cout << "pbs job " << unit.job.id << " released; "
              << (unit.array() ? std::string("its subjobs resume") : "trial " + std::to_string(unit.trial) + " resumes")
              << " from the latest checkpoint when it runs\n";
    ++released;
  }
  if (released == 0) std::cout << what << " has no held pbs job; nothing to activate\n";
  return kExitOk;
}

int kill_pbs(const std::string& what) {
  const pbs::Client client;
  const PbsTarget t = resolve_pbs(what, client);
  if (t.live.empty()) throw SchedulerError(what + " has no queued or running pbs job to kill");
  for (const PbsUnit& unit : t.live) {
    client.cancel(unit.job.id);  // an array job with all its subjobs
    std::cout << "pbs job " << unit.job.id << " deleted\n";
  }
  return kExitOk;
}

int run_pause(const std::vector<std::string>& args) {
  const std::string what = target_argument(args, "pause", R"(usage: hpctrial pause JOB|EXPDIR

Pauses a running job: the ranks checkpoint after their current step, and the job goes back to
the queue, held (its allocation is freed). `hpctrial activate` resumes it from the checkpoint.
A job that has not started yet is simply held. For a job array (a search), every task is
paused; JOB_N pauses task N alone. On PBS, which lets no user requeue a job, the paused job
submits the job that resumes it, held, before it ends.
)");
  if (what.empty()) return kExitOk;
  if (targets_pbs(what)) return pause_pbs(what);
  const slurm::Client client;
  const Target t = resolve_target(what, client);
  int paused = 0, held = 0, already = 0;
  for (const slurm::JobInfo& task : known_tasks(t.job, client)) {
    const std::string id = task.display_id();
    if (task.state == "PENDING") {
      if (task.held()) {
        ++already;
      } else {
        client.hold(id);
        ++held;
      }
    } else if (task.state == "RUNNING") {
      if (t.experiment_dir.empty()) {
        throw SchedulerError("cannot find the experiment directory of slurm job " + id + " (its output file is " +
                             task.std_out + "); pause it by its experiment directory instead");
      }
      mpi_launcher::request_stop(mpi_launcher::ExperimentLayout{t.experiment_dir}, trial_of(task), "pause");
      client.signal_batch(task.id, "USR2");
      std::cout << "pausing slurm job " << id << ": the ranks checkpoint after their current step, then the job "
                << "is requeued and held\n";
      ++paused;
    }
  }
  if (paused + held + already == 0) {
    throw SchedulerError("slurm job " + t.job + " is neither pending nor running; only those can be paused");
  }
  if (held > 0) std::cout << "slurm job " << t.job << ": " << held << " waiting task(s) held\n";
  if (paused == 0 && held == 0) std::cout << "slurm job " << t.job << " is already held\n";
  std::cout << "`hpctrial activate " << t.job << "` resumes it\n";
  return kExitOk;
}

int run_activate(const std::vector<std::string>& args) {
  const std::string what = target_argument(args, "activate", R"(usage: hpctrial activate JOB|EXPDIR

Releases a paused (held) job, or every held task of a job array: it runs again when Slurm
schedules it, and resumes from its latest checkpoint. On PBS: every held job of the experiment
(qrls).
)");
  if (what.empty()) return kExitOk;
  if (targets_pbs(what)) return activate_pbs(what);
  const slurm::Client client;
  const Target t = resolve_target(what, client);
  int released = 0;
  for (const slurm::JobInfo& task : known_tasks(t.job, client)) {
    if (!task.held()) continue;
    client.release(task.display_id());
    ++released;
  }
  if (released == 0) {
    std::cout << "slurm job " << t.job << " is not held; nothing to activate\n";
    return kExitOk;
  }
  std::cout << "slurm job " << t.job << " released; it resumes from its latest checkpoint when it runs\n";
  return kExitOk;
}

int run_kill(const std::vector<std::string>& args) {
  const std::string what = target_argument(args, "kill", R"(usage: hpctrial kill JOB|EXPDIR

Cancels the job, or every task of a job array (scancel). The ranks get Slurm's SIGTERM and
checkpoint if they can within the grace; the last published checkpoint stays valid either way,
and submitting the experiment again resumes from it. On PBS: every queued or running job of the
experiment (qdel).
)");
  if (what.empty()) return kExitOk;
  if (targets_pbs(what)) return kill_pbs(what);
  const slurm::Client client;
  const Target t = resolve_target(what, client);
  client.cancel(t.job);
  std::cout << "slurm job " << t.job << " cancelled\n";
  return kExitOk;
}

}  // namespace

Verb pause_verb() { return {"pause", "checkpoint a running job and hold it in the queue", run_pause}; }
Verb activate_verb() { return {"activate", "release a paused job; it resumes from its checkpoint", run_activate}; }
Verb kill_verb() { return {"kill", "cancel a job; its last checkpoint stays valid", run_kill}; }

}  // namespace hpctrial::cli
