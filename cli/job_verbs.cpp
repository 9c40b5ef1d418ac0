// hpctrial pause / activate / kill: the batch jobs of an experiment, named by a job id or by the
// experiment directory, through the scheduler that runs them.
#include "job_verbs.h"

#include <boost/program_options.hpp>

#include <filesystem>
#include <functional>
#include <iostream>

#include "hpctrial/core/error.h"
#include "hpctrial/core/experiment_dir.h"
#include "hpctrial/core/text.h"
#include "hpctrial/launcher/schedulers.h"
#include "verb.h"
#include "verb_args.h"

namespace po = boost::program_options;
namespace fs = std::filesystem;

namespace hpctrial::cli {

Target resolve_target(const std::string& what, bool need_job) {
  Target t;
  if (!fs::is_directory(what)) {
    t.scheduler = launcher::scheduler_of_job(what);
    if (t.scheduler == nullptr) {
      throw ConfigError(what + " is neither a job id nor an experiment directory; give the id `hpctrial submit` "
                        "printed, or the experiment directory");
    }
    const auto job = t.scheduler->job(what);
    if (!job) {
      throw SchedulerError(t.scheduler->name() + " no longer knows job " + what + " (it ended a while ago); give " +
                           "its experiment directory instead");
    }
    t.jobs = {core::experiment_of_output(job->output), what};
    t.job = what;
    return t;
  }
  t.jobs.experiment_dir = fs::absolute(what).lexically_normal().string();
  const core::ExperimentLayout layout{t.jobs.experiment_dir};
  const auto latest = core::latest_job(layout);
  if (latest) {
    t.scheduler = &launcher::scheduler(latest->scheduler);
    t.job = latest->id;
  } else if (need_job) {
    throw ConfigError(layout.dir + " has no batch job recorded in " + layout.state() + "; submit it with "
                      "`hpctrial submit`");
  } else {
    t.scheduler = &launcher::scheduler("local");
  }
  return t;
}

std::string target_argument(const std::vector<std::string>& args, const char* verb, const char* usage,
                            const po::options_description* own, po::variables_map* vm_out) {
  VerbArgs command_line(std::string(usage) + "\n");
  if (own != nullptr) command_line.add(*own);
  std::string target;
  command_line.positional("target", &target);
  const bool go_on = command_line.parse(args);
  if (vm_out != nullptr) *vm_out = command_line.values();
  if (!go_on) return "";
  if (target.empty()) throw ConfigError(std::string("hpctrial ") + verb + ": give a job id or an experiment directory");
  return target;
}

// JOB|EXPDIR for the verbs that read the experiment directory: a directory needs no job (an
// experiment of `hpctrial run` has none), a job needs its directory to be found.
Target experiment_target(const std::string& what) {
  Target t = resolve_target(what, false);
  if (t.jobs.experiment_dir.empty()) {
    throw SchedulerError("cannot find the experiment directory of job " + t.job + " (its output file is not "
                         "in one); give the experiment directory instead");
  }
  const core::ExperimentLayout layout{t.jobs.experiment_dir};
  if (!fs::exists(layout.config())) {
    throw ConfigError(layout.dir + " is not an experiment directory: there is no " + layout.config());
  }
  return t;
}

std::string state_text(const core::JobStatus& job) {
  return (job.native_state.empty() ? core::to_string(job.state) : job.native_state) + (job.held() ? " (held)" : "");
}

namespace {

// How to name the target back to the user: the experiment directory where it is known.
std::string name_of(const Target& t, const std::string& what) {
  return t.jobs.experiment_dir.empty() ? what : t.jobs.experiment_dir;
}

// What `hpctrial pause` and `hpctrial cancel` did, job by job.
int report_stop(const Target& t, const std::string& what, core::StopMode mode) {
  const std::string scheduler = t.scheduler->name();
  const bool end = mode == core::StopMode::kEnd;
  int held = 0, stopping = 0;
  for (const core::StopStep& step : t.scheduler->stop(t.jobs, mode)) {
    switch (step.kind) {
      case core::StopStep::Kind::kStopping:
        std::cout << (end ? "cancelling " : "pausing ") << scheduler << " job " << step.job << ": the ranks of "
                  << (step.trial >= 0 ? "trial " + std::to_string(step.trial) : std::string("the trial it trains"))
                  << " checkpoint after their current step, then " << (end ? "it ends" : "it is held in the queue")
                  << "\n";
        ++stopping;
        break;
      case core::StopStep::Kind::kHeld:
        std::cout << scheduler << " job " << step.job << " was waiting; now held\n";
        ++held;
        break;
      case core::StopStep::Kind::kEnded:
        std::cout << scheduler << " job " << step.job << " was waiting; cancelled\n";
        ++held;
        break;
      case core::StopStep::Kind::kAlreadyHeld:
        break;
    }
  }
  if (stopping == 0 && held == 0) std::cout << scheduler << " job " << t.job << " is already held\n";
  std::cout << (end ? "`hpctrial submit` of the experiment resumes it from its checkpoint"
                    : "`hpctrial activate " + name_of(t, what) + "` resumes it")
            << "\n";
  return kExitOk;
}

int run_pause(const std::vector<std::string>& args) {
  const std::string what = target_argument(args, "pause", R"(usage: hpctrial pause JOB|EXPDIR

Pauses a running job: the ranks checkpoint after their current step, and the job goes back to
the queue, held (its allocation is freed). `hpctrial activate` resumes it from the checkpoint.
A job that has not started yet is simply held. For a job array (a search), every task is
paused; JOB_N pauses task N alone. On PBS, which lets no user requeue a job, the paused job
submits the job that resumes it, held, before it ends.
Only the experiment's own jobs are touched: a job id recorded for EXPDIR that the scheduler
has since given to another job (a cluster started afresh, ids that wrapped) is refused with
exit 1, and nothing is signalled.
)");
  if (what.empty()) return kExitOk;
  return report_stop(resolve_target(what), what, core::StopMode::kPause);
}

int run_cancel(const std::vector<std::string>& args) {
  const std::string what = target_argument(args, "cancel", R"(usage: hpctrial cancel JOB|EXPDIR

Cancels a job gracefully: the ranks checkpoint after their current step, and the job ends (it
does not go back to the queue). A job that has not started, or is held, is cancelled at once.
For a job array (a search), every task; JOB_N cancels task N alone. Submitting the experiment
again resumes every trial from its latest checkpoint. `hpctrial kill` ends a job now instead.
Only the experiment's own jobs are touched: a job id recorded for EXPDIR that the scheduler
has since given to another job (a cluster started afresh, ids that wrapped) is refused with
exit 1, and nothing is signalled.
)");
  if (what.empty()) return kExitOk;
  return report_stop(resolve_target(what), what, core::StopMode::kEnd);
}

int run_activate(const std::vector<std::string>& args) {
  const std::string what = target_argument(args, "activate", R"(usage: hpctrial activate JOB|EXPDIR

Releases a paused (held) job, or every held task of a job array: it runs again when the
scheduler starts it, and resumes from its latest checkpoint. On PBS: every held job of the
experiment (qrls).
Only the experiment's own jobs are touched: a job id recorded for EXPDIR that the scheduler
has since given to another job (a cluster started afresh, ids that wrapped) is refused with
exit 1, and nothing is signalled.
)");
  if (what.empty()) return kExitOk;
  const Target t = resolve_target(what);
  const auto released = t.scheduler->activate(t.jobs);
  if (released.empty()) {
    std::cout << name_of(t, what) << " has no held " << t.scheduler->name() << " job; nothing to activate\n";
    return kExitOk;
  }
  for (const std::string& job : released) {
    std::cout << t.scheduler->name() << " job " << job << " released; it resumes from its latest checkpoint when "
              << "it runs\n";
  }
  return kExitOk;
}

int run_kill(const std::vector<std::string>& args) {
  const std::string what = target_argument(args, "kill", R"(usage: hpctrial kill JOB|EXPDIR

Ends the job now, or every task of a job array (Slurm: scancel; PBS: qdel of every queued or
running job of the experiment). The ranks get the scheduler's SIGTERM and checkpoint if they can
within the grace; the last published checkpoint stays valid either way, and submitting the
experiment again resumes from it. `hpctrial cancel` checkpoints first.
Only the experiment's own jobs are touched: a job id recorded for EXPDIR that the scheduler
has since given to another job (a cluster started afresh, ids that wrapped) is refused with
exit 1, and nothing is signalled.
)");
  if (what.empty()) return kExitOk;
  const Target t = resolve_target(what);
  for (const std::string& job : t.scheduler->cancel(t.jobs)) {
    std::cout << t.scheduler->name() << " job " << job << " cancelled\n";
  }
  return kExitOk;
}

}  // namespace

Verb pause_verb() { return {"pause", "checkpoint a running job and hold it in the queue", run_pause}; }
Verb activate_verb() { return {"activate", "release a paused job; it resumes from its checkpoint", run_activate}; }
Verb cancel_verb() { return {"cancel", "checkpoint a running job, then end it (submit again to resume)", run_cancel}; }
Verb kill_verb() { return {"kill", "end a job now; its last checkpoint stays valid", run_kill}; }

}  // namespace hpctrial::cli
