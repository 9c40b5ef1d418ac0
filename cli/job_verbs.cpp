// hpctrial pause / activate / kill: a Slurm job of an experiment, named by its id or by the
// experiment directory.
#include <boost/program_options.hpp>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <iostream>

#include "hpctrial/core/error.h"
#include "hpctrial/core/files.h"
#include "hpctrial/core/text.h"
#include "hpctrial/slurm/client.h"
#include "hpctrial/slurm/job_environment.h"
#include "job_verbs.h"
#include "verb.h"

namespace po = boost::program_options;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace hpctrial::cli {

namespace {

json read_state(const mpi_launcher::ExperimentLayout& layout) {
  std::ifstream in(layout.state());
  if (!in) return json::object();
  try {
    json j = json::parse(in);
    return j.is_object() ? j : json::object();
  } catch (const json::exception& e) {
    throw IoError(layout.state() + " is not valid JSON (" + e.what() + "); remove it or restore it from a backup");
  }
}

struct Target {
  std::string job;
  std::string experiment_dir;  // empty when not known
};

// JOB or EXPDIR -> the job and, where it can be found, its experiment directory (a job's output
// file lies in its experiment directory).
Target resolve(const std::string& what, const slurm::Client& client) {
  if (slurm::is_valid_job_id(what) && !fs::is_directory(what)) {
    Target t{what, ""};
    if (const auto job = client.job(what); job && !job->std_out.empty()) {
      const fs::path dir = fs::path(job->std_out).parent_path();
      if (fs::exists(dir / "experiment.json")) t.experiment_dir = dir.string();
    }
    return t;
  }
  if (!fs::is_directory(what)) {
    throw ConfigError(what + " is neither a job id nor an experiment directory; give the id `hpctrial submit` "
                      "printed, or the experiment directory");
  }
  const mpi_launcher::ExperimentLayout layout{fs::absolute(what).lexically_normal().string()};
  const std::string job = job_of_experiment(layout);
  if (job.empty()) {
    throw ConfigError(layout.dir + " has no batch job recorded in " + layout.state() + "; submit it with "
                      "`hpctrial submit`");
  }
  return {job, layout.dir};
}

slurm::JobInfo known_job(const std::string& id, const slurm::Client& client) {
  const auto job = client.job(id);
  if (!job) {
    throw SchedulerError("slurm no longer knows job " + id + " (it ended a while ago); see its experiment "
                         "directory for what it did");
  }
  return *job;
}

// The one positional argument, JOB|EXPDIR, of pause/activate/kill.
std::string target_argument(const std::vector<std::string>& args, const char* verb, const char* usage) {
  po::options_description options("options");
  options.add_options()("help,h", "show this help");
  po::options_description hidden;
  std::string target;
  hidden.add_options()("target", po::value(&target));
  po::options_description all;
  all.add(options).add(hidden);
  po::positional_options_description pos;
  pos.add("target", 1);
  po::variables_map vm;
  po::store(po::command_line_parser(args).options(all).positional(pos).run(), vm);
  po::notify(vm);
  if (vm.count("help")) {
    std::cout << usage << "\n" << options;
    return "";
  }
  if (target.empty()) throw ConfigError(std::string("hpctrial ") + verb + ": give a job id or an experiment directory");
  return target;
}

int run_pause(const std::vector<std::string>& args) {
  const std::string what = target_argument(args, "pause", R"(usage: hpctrial pause JOB|EXPDIR

Pauses a running job: the ranks checkpoint after their current step, and the job goes back to
the queue, held (its allocation is freed). `hpctrial activate` resumes it from the checkpoint.
A job that has not started yet is simply held.
)");
  if (what.empty()) return kExitOk;
  const slurm::Client client;
  const Target t = resolve(what, client);
  const slurm::JobInfo job = known_job(t.job, client);
  if (job.state == "PENDING") {
    if (job.held()) {
      std::cout << "slurm job " << t.job << " is already held; `hpctrial activate " << t.job << "` resumes it\n";
      return kExitOk;
    }
    client.hold(t.job);
    std::cout << "slurm job " << t.job << " had not started; it is held until `hpctrial activate " << t.job << "`\n";
    return kExitOk;
  }
  if (job.state != "RUNNING") {
    throw SchedulerError("slurm job " + t.job + " is " + job.state + "; only a pending or running job can be paused");
  }
  if (t.experiment_dir.empty()) {
    throw SchedulerError("cannot find the experiment directory of slurm job " + t.job + " (its output file is " +
                         job.std_out + "); pause it by its experiment directory instead");
  }
  mpi_launcher::request_stop(mpi_launcher::ExperimentLayout{t.experiment_dir}, 0, "pause");
  client.signal_batch(t.job, "USR2");
  std::cout << "pausing slurm job " << t.job << ": the ranks checkpoint after their current step, then the job "
            << "is requeued and held; `hpctrial activate " << t.job << "` resumes it\n";
  return kExitOk;
}

int run_activate(const std::vector<std::string>& args) {
  const std::string what = target_argument(args, "activate", R"(usage: hpctrial activate JOB|EXPDIR

Releases a paused (held) job: it runs again when Slurm schedules it, and resumes from its
latest checkpoint.
)");
  if (what.empty()) return kExitOk;
  const slurm::Client client;
  const Target t = resolve(what, client);
  const slurm::JobInfo job = known_job(t.job, client);
  if (!job.held()) {
    std::cout << "slurm job " << t.job << " is " << job.state << " and not held; nothing to activate\n";
    return kExitOk;
  }
  client.release(t.job);
  std::cout << "slurm job " << t.job << " released; it resumes from its latest checkpoint when it runs\n";
  return kExitOk;
}

int run_kill(const std::vector<std::string>& args) {
  const std::string what = target_argument(args, "kill", R"(usage: hpctrial kill JOB|EXPDIR

Cancels the job (scancel). The ranks get Slurm's SIGTERM and checkpoint if they can within the
grace; the last published checkpoint stays valid either way, and submitting the experiment
again resumes from it.
)");
  if (what.empty()) return kExitOk;
  const slurm::Client client;
  const Target t = resolve(what, client);
  client.cancel(t.job);
  std::cout << "slurm job " << t.job << " cancelled\n";
  return kExitOk;
}

}  // namespace

std::string job_of_experiment(const mpi_launcher::ExperimentLayout& layout) {
  const json state = read_state(layout);
  const std::string id = state.value("job_id", std::string());
  return slurm::is_valid_job_id(id) ? id : "";
}

void record_job(const mpi_launcher::ExperimentLayout& layout, const std::string& scheduler, const std::string& id) {
  json state = read_state(layout);
  state["scheduler"] = scheduler;
  state["job_id"] = id;
  if (!state["jobs"].is_array()) state["jobs"] = json::array();
  state["jobs"].push_back({{"id", id}, {"scheduler", scheduler}, {"submitted", core::utc_now_iso()}});
  core::write_file_atomic(layout.state(), state.dump(2) + "\n");
}

Verb pause_verb() { return {"pause", "checkpoint a running job and hold it in the queue", run_pause}; }
Verb activate_verb() { return {"activate", "release a paused job; it resumes from its checkpoint", run_activate}; }
Verb kill_verb() { return {"kill", "cancel a job; its last checkpoint stays valid", run_kill}; }

}  // namespace hpctrial::cli
