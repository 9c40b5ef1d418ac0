// hpctrial jobs / logs / describe: what the batch jobs of experiments are doing, read from
// Slurm (scontrol) or PBS (qstat) and joined with what the launcher and the chief left in each
// experiment directory.
#include <boost/program_options.hpp>

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <sstream>
#include <thread>

#include "hpctrial/checkpoint/store.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/experiment_config.h"
#include "hpctrial/core/experiment_dir.h"
#include "hpctrial/core/search.h"
#include "hpctrial/core/text.h"
#include "hpctrial/pbs/client.h"
#include "hpctrial/pbs/job_environment.h"
#include "hpctrial/slurm/job_environment.h"
#include "job_verbs.h"
#include "verb.h"

namespace po = boost::program_options;
namespace fs = std::filesystem;

namespace hpctrial::cli {
namespace {

// The file `latest` names in a trial's checkpoint directory, and its batch count.
struct LatestCheckpoint {
  std::string file;
  std::string path;
  std::int64_t batches = 0;
};
std::optional<LatestCheckpoint> latest_checkpoint(const mpi_launcher::ExperimentLayout& layout, int trial) {
  std::string dir = layout.trial_dir(trial) + "/checkpoints";
  try {  // where the trainer put them: checkpoint_storage.host_path may say elsewhere
    dir = core::checkpoint_dir(core::load_experiment_config({layout.config(), "", {}}), layout.trial_dir(trial), trial);
  } catch (const Error&) {
    // no readable experiment.yaml: the default place
  }
  if (!fs::is_directory(dir)) return std::nullopt;
  const checkpoint::CheckpointStore store(dir, {});
  const auto file = store.latest_file();
  if (!file) return std::nullopt;
  const std::string name = fs::path(*file).filename().string();
  return LatestCheckpoint{name, (fs::path(dir) / name).string(), checkpoint::checkpoint_batches(name).value_or(0)};
}

// Batches trained: what rank 0 last reported while running, else the latest checkpoint's.
std::string batches_text(const mpi_launcher::ExperimentLayout& layout, int trial, bool running) {
  if (trial < 0) return "-";
  const auto progress = mpi_launcher::trial_progress(layout, trial);
  const auto ckpt = latest_checkpoint(layout, trial);
  std::int64_t batches = ckpt ? ckpt->batches : 0;
  if (running && progress.reported_step > batches) batches = progress.reported_step;
  if (!ckpt && progress.reported_step < 0) return "-";
  return std::to_string(batches);
}

std::string experiment_of(const slurm::JobInfo& job) {
  if (job.std_out.empty()) return "";
  const fs::path dir = fs::path(job.std_out).parent_path();
  return fs::exists(dir / "experiment.json") && fs::exists(dir / "experiment.yaml") ? dir.string() : "";
}

// --- PBS: an experiment's jobs are several (the job that resumes a trial is a new job) ----------
std::string user_name() {
  if (const char* user = std::getenv("USER"); user != nullptr && *user != '\0') return user;
  const char* login = ::getlogin();
  return login != nullptr ? login : std::to_string(::getuid());
}

bool on_path(const std::string& program) {
  std::stringstream dirs(std::getenv("PATH") != nullptr ? std::getenv("PATH") : "");
  for (std::string dir; std::getline(dirs, dir, ':');) {
    if (!dir.empty() && ::access((dir + "/" + program).c_str(), X_OK) == 0) return true;
  }
  return false;
}

bool is_pbs_experiment(const mpi_launcher::ExperimentLayout& layout) {
  const auto latest = mpi_launcher::latest_job(layout);
  return latest && latest->scheduler == "pbs";
}

// The PBS jobs that ran or run trial `trial`, oldest first: the array job's subjob for it
// ("1234[T].srv"), and the jobs submitted to resume it.
std::vector<std::string> pbs_trial_jobs(const mpi_launcher::ExperimentLayout& layout, int trial, int trials) {
  std::vector<std::string> ids;
  for (const auto& job : mpi_launcher::recorded_jobs(layout)) {
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

// The trial a PBS job of the experiment runs: its array index, or the trial it was recorded for.
int pbs_trial_of(const pbs::JobInfo& job, const std::string& experiment_dir) {
  const std::size_t open = job.id.find('['), close = job.id.find(']');
  if (open != std::string::npos && close != std::string::npos && close > open + 1) {
    return std::stoi(job.id.substr(open + 1, close - open - 1));
  }
  if (experiment_dir.empty()) return -1;
  for (const auto& recorded : mpi_launcher::recorded_jobs({experiment_dir})) {
    if (recorded.id == job.id) return std::max(0, recorded.trial);
  }
  return -1;
}

std::string pbs_experiment_of(const pbs::JobInfo& job) {
  if (job.output_path.empty()) return "";
  const fs::path dir = fs::path(job.output_path).parent_path();
  return fs::exists(dir / "experiment.json") && fs::exists(dir / "experiment.yaml") ? dir.string() : "";
}

void print_row(std::ostream& out, const std::vector<std::string>& cells, const std::vector<std::size_t>& widths) {
  for (std::size_t i = 0; i < cells.size(); ++i) {
    out << cells[i];
    if (i + 1 < cells.size()) out << std::string(widths[i] - cells[i].size() + 2, ' ');
  }
  out << "\n";
}

// JOB|EXPDIR for the verbs that read the experiment directory: a directory needs no job (an
// experiment of `hpctrial run` has none), a job needs its directory to be found.
Target experiment_target(const std::string& what, const slurm::Client& client) {
  Target t;
  if (fs::is_directory(what)) {
    t.experiment_dir = fs::absolute(what).lexically_normal().string();
    if (const auto job = mpi_launcher::latest_job({t.experiment_dir})) t.job = job->id;
  } else if (pbs::is_valid_job_id(what) && what.find_first_of(".[") != std::string::npos) {
    const auto job = pbs::Client().job(what);
    if (!job) throw SchedulerError("pbs no longer knows job " + what + "; give the experiment directory instead");
    t = {what, pbs_experiment_of(*job)};
  } else {
    t = resolve_target(what, client);
  }
  if (t.experiment_dir.empty()) {
    throw SchedulerError("cannot find the experiment directory of job " + t.job + " (its output file is not "
                         "in one); give the experiment directory instead");
  }
  if (!fs::exists(mpi_launcher::ExperimentLayout{t.experiment_dir}.config())) {
    throw ConfigError(t.experiment_dir + " holds no experiment.yaml: it is not an experiment directory");
  }
  return t;
}

int run_jobs(const std::vector<std::string>& args) {
  po::options_description options("options");
  bool all = false;
  options.add_options()("help,h", "show this help")("all,a", po::bool_switch(&all),
                                                    "also list this user's jobs that are not hpctrial's");
  po::variables_map vm;
  po::store(po::command_line_parser(args).options(options).run(), vm);
  po::notify(vm);
  if (vm.count("help")) {
    std::cout << R"(usage: hpctrial jobs [--all]

Lists your hpctrial batch jobs that Slurm or PBS still knows (pending, running, or recently
ended), one line per task of a job array, with what their experiment directories say: batches
trained and the latest checkpoint.
)" << "\n" << options;
    return kExitOk;
  }
  std::vector<std::vector<std::string>> rows = {
      {"JOB", "NAME", "STATE", "RESTARTS", "ELAPSED", "TRIAL", "BATCHES", "CHECKPOINT", "EXPERIMENT"}};
  const auto progress_cells = [](const std::string& dir, int trial, bool running) {
    std::pair<std::string, std::string> cells{"-", "-"};
    if (dir.empty() || trial < 0) return cells;
    const mpi_launcher::ExperimentLayout layout{dir};
    cells.first = batches_text(layout, trial, running);
    if (const auto latest = latest_checkpoint(layout, trial)) cells.second = latest->file;
    return cells;
  };
  // The schedulers this machine has; one that fails is reported, the other still listed.
  const bool slurm_here = on_path("scontrol"), pbs_here = on_path("qstat");
  if (!slurm_here && !pbs_here) throw SchedulerError("neither Slurm (scontrol) nor PBS (qstat) is on PATH");
  if (slurm_here) {
    try {
      for (const slurm::JobInfo& job : slurm::Client().user_jobs()) {
        const std::string dir = experiment_of(job);
        if (dir.empty() && !all) continue;
        const int trial = trial_of(job);
        const auto [batches, ckpt] = progress_cells(dir, trial, job.state == "RUNNING");
        rows.push_back({job.display_id(), job.name, job.state + (job.held() ? " (held)" : ""),
                        std::to_string(job.restarts), job.run_time, trial >= 0 ? std::to_string(trial) : job.array_task,
                        batches, ckpt, dir.empty() ? "-" : dir});
      }
    } catch (const SchedulerError& e) {
      if (!pbs_here) throw;
      std::cerr << "hpctrial jobs: slurm: " << e.what() << "\n";
    }
  }
  if (pbs_here) {
    try {
      for (const pbs::JobInfo& job : pbs::Client().user_jobs(user_name())) {
        if (!job.active() && job.state != "F" && job.state != "X") continue;
        const std::string dir = pbs_experiment_of(job);
        if (dir.empty() && !all) continue;
        const int trial = pbs_trial_of(job, dir);
        const auto [batches, ckpt] = progress_cells(dir, trial, job.state == "R");
        rows.push_back({job.id, job.name, job.state + (job.held() ? " (held)" : ""),
                        std::to_string(std::max(0, job.run_count - 1)), "-", trial >= 0 ? std::to_string(trial) : "-",
                        batches, ckpt, dir.empty() ? "-" : dir});
      }
    } catch (const SchedulerError& e) {
      if (!slurm_here) throw;
      std::cerr << "hpctrial jobs: pbs: " << e.what() << "\n";
    }
  }
  if (rows.size() == 1) {
    std::cout << "no hpctrial jobs (the scheduler forgets a job some time after it ends; `hpctrial describe "
                 "EXPDIR` still tells its story)\n";
    return kExitOk;
  }
  std::vector<std::size_t> widths(rows.front().size(), 0);
  for (const auto& row : rows) {
    for (std::size_t i = 0; i < row.size(); ++i) widths[i] = std::max(widths[i], row[i].size());
  }
  for (const auto& row : rows) print_row(std::cout, row, widths);
  return kExitOk;
}

// The output file of one trial's job in the experiment directory (the launcher's log and every
// rank's lines): slurm-<job>.err, or slurm-<array>_<trial>.err.
std::string job_output(const mpi_launcher::ExperimentLayout& layout, const std::string& job, int trial, int trials) {
  const std::string base = job.substr(0, job.find('_'));
  return layout.dir + "/slurm-" + (trials > 1 ? base + "_" + std::to_string(trial) : base) + ".err";
}

// Copies what `path` holds from `offset` on to stdout; returns the new offset.
std::uintmax_t copy_from(const std::string& path, std::uintmax_t offset) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return offset;
  in.seekg(static_cast<std::streamoff>(offset));
  char buffer[65536];
  while (in.read(buffer, sizeof buffer) || in.gcount() > 0) {
    std::cout.write(buffer, in.gcount());
    offset += static_cast<std::uintmax_t>(in.gcount());
  }
  std::cout.flush();
  return offset;
}

int run_logs(const std::vector<std::string>& args) {
  po::options_description options;
  int rank = -1, trial = -1;
  bool follow = false;
  options.add_options()
      ("rank,r", po::value(&rank)->value_name("N"), "only rank N's lines (trial-T/logs/rank-N.log)")
      ("trial", po::value(&trial)->value_name("T"), "the trial of a search (default: task 0)")
      ("follow,f", po::bool_switch(&follow), "keep printing what is added, until the job ends");
  po::variables_map vm;
  const std::string what = target_argument(args, "logs", R"(usage: hpctrial logs JOB|EXPDIR [--rank N] [--trial T] [--follow]

Prints the output of a job: the launcher's log and every rank's lines, from every run of the
job (requeued runs append). --rank N prints rank N's own log; --follow keeps printing until
the job ends (until Ctrl-C when there is no job). An experiment run with `hpctrial run` has no
job: give --rank.
)", &options, &vm);
  if (what.empty()) return kExitOk;
  if ((vm.count("rank") && rank < 0) || (vm.count("trial") && trial < 0)) {
    throw ConfigError("hpctrial logs: --rank and --trial are 0 or more");
  }
  const slurm::Client client;
  const Target t = experiment_target(what, client);
  const mpi_launcher::ExperimentLayout layout{t.experiment_dir};
  const core::ExperimentConfig config = core::load_experiment_config({layout.config(), "", {}});
  const int trials = core::trial_count(config);
  if (trial < 0) {
    const std::size_t underscore = t.job.find('_');
    trial = underscore == std::string::npos ? 0 : std::stoi(t.job.substr(underscore + 1));
  }
  if (trial >= trials) {
    throw ConfigError("the experiment in " + layout.dir + " has " + std::to_string(trials) + " trial(s); --trial " +
                      std::to_string(trial) + " does not exist");
  }
  const bool on_pbs = is_pbs_experiment(layout);
  std::string path;
  std::vector<std::string> pbs_jobs;  // PBS: the trial's jobs, oldest first, each with its own output file
  const auto pbs_output = [&](const std::string& id) { return layout.dir + "/pbs-" + id + ".out"; };
  if (rank >= 0) {
    path = layout.trial_dir(trial) + "/logs/rank-" + std::to_string(rank) + ".log";
  } else if (on_pbs) {
    pbs_jobs = pbs_trial_jobs(layout, trial, trials);
    if (pbs_jobs.empty()) throw ConfigError(layout.dir + " records no pbs job of trial " + std::to_string(trial));
    // The runs before the last, each job's file in turn.
    for (std::size_t i = 0; i + 1 < pbs_jobs.size(); ++i) {
      if (!fs::exists(pbs_output(pbs_jobs[i]))) continue;
      std::cout << "==> pbs job " << pbs_jobs[i] << " <==\n";
      copy_from(pbs_output(pbs_jobs[i]), 0);
    }
    if (pbs_jobs.size() > 1) std::cout << "==> pbs job " << pbs_jobs.back() << " <==\n";
    path = pbs_output(pbs_jobs.back());
  } else if (!t.job.empty()) {
    path = job_output(layout, t.job, trial, trials);
  } else {
    throw ConfigError(layout.dir + " has no batch job; give --rank N for a rank's log");
  }
  if (!fs::exists(path) && !follow) {
    throw IoError(path + " does not exist (yet): " +
                  (rank >= 0 ? "trial " + std::to_string(trial) + " has not run, or has no rank " + std::to_string(rank)
                             : "the job has not started; --follow waits for it"));
  }
  std::uintmax_t offset = copy_from(path, 0);
  if (!follow) return kExitOk;
  // The job that runs this trial: follow while it may still write (on PBS, on into the job that
  // resumes it).
  const std::string base = t.job.substr(0, t.job.find('_'));
  std::string task = t.job.empty() ? "" : on_pbs ? pbs_jobs.back() : trials > 1 ? base + "_" + std::to_string(trial) : base;
  const pbs::Client pbs_client;
  int checks = 0;
  while (true) {
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    offset = copy_from(path, offset);
    if (task.empty() || ++checks % 4 != 0) continue;
    const bool active = on_pbs ? [&] { const auto job = pbs_client.job(task); return job && job->active(); }()
                               : [&] { const auto job = client.job(task); return job && is_active(*job); }();
    if (active) continue;
    copy_from(path, offset);
    if (on_pbs && rank < 0) {
      const auto now = pbs_trial_jobs(layout, trial, trials);
      if (!now.empty() && now.back() != task) {
        task = now.back();
        path = pbs_output(task);
        offset = 0;
        std::cout << "==> pbs job " << task << " <==\n";
        continue;
      }
    }
    return kExitOk;
  }
}

int run_describe(const std::vector<std::string>& args) {
  const std::string what = target_argument(args, "describe", R"(usage: hpctrial describe JOB|EXPDIR

Tells an experiment's story: its config, its batch jobs and their state in Slurm or PBS, and for
each trial the batches trained, the latest checkpoint, the runs and the failures.
)");
  if (what.empty()) return kExitOk;
  const slurm::Client client;
  const Target t = experiment_target(what, client);
  const mpi_launcher::ExperimentLayout layout{t.experiment_dir};
  const core::ExperimentConfig config = core::load_experiment_config({layout.config(), "", {}});
  const int trials = core::trial_count(config);
  std::cout << "experiment:  " << config.name << "\n"
            << "directory:   " << layout.dir << "\n"
            << "searcher:    " << core::to_string(config.searcher.name) << ", " << trials << " trial(s), metric "
            << config.searcher.metric << "\n"
            << "resources:   " << config.resources.slots_per_trial << " slot(s) per trial on "
            << config.resources.nodes() << " node(s)\n";
  // Slurm's view of each trial's task of the latest job.
  std::map<int, slurm::JobInfo> tasks;
  const auto jobs = mpi_launcher::recorded_jobs(layout);
  for (const auto& job : jobs) {
    std::cout << "job:         " << job.scheduler << " " << job.id << ", submitted " << job.submitted << "\n";
  }
  const bool on_pbs = is_pbs_experiment(layout);
  std::map<int, pbs::JobInfo> pbs_jobs;  // PBS: each trial's latest job
  if (on_pbs) {
    const pbs::Client pbs_client;
    for (int trial = 0; trial < trials; ++trial) {
      const auto ids = pbs_trial_jobs(layout, trial, trials);
      if (ids.empty()) continue;
      if (auto job = pbs_client.job(ids.back())) {
        pbs_jobs[trial] = *job;
      } else {
        std::cout << "             (PBS no longer knows job " << ids.back() << ")\n";
      }
    }
  } else if (const auto latest = mpi_launcher::latest_job(layout); latest && slurm::is_valid_job_id(latest->id)) {
    for (auto& task : client.job_tasks(latest->id)) {
      if (trial_of(task) >= 0) tasks[trial_of(task)] = task;
    }
    if (tasks.empty()) std::cout << "             (Slurm no longer knows job " << latest->id << ")\n";
  }
  for (int trial = 0; trial < trials; ++trial) {
    const auto progress = mpi_launcher::trial_progress(layout, trial);
    const auto ckpt = latest_checkpoint(layout, trial);
    const auto task = tasks.find(trial);
    const auto pbs_job = pbs_jobs.find(trial);
    const bool running = (task != tasks.end() && task->second.state == "RUNNING") ||
                         (pbs_job != pbs_jobs.end() && pbs_job->second.state == "R");
    std::cout << "\ntrial " << trial << ":  " << layout.trial_dir(trial) << "\n";
    if (trials > 1) {
      const core::ExperimentConfig resolved = core::trial_config(config, trial);
      std::cout << "  hparams:     ";
      std::string values;
      // Nested hyperparameters as dotted names; a constant list or map as its YAML.
      std::function<void(const std::vector<std::pair<std::string, core::Hyperparameter>>&, const std::string&)> list =
          [&](const auto& hps, const std::string& prefix) {
            for (const auto& [name, hp] : hps) {
              if (hp.type == core::Hyperparameter::Type::kNested) {
                list(hp.nested, prefix + name + ".");
              } else {
                values += (values.empty() ? "" : ", ") + prefix + name + "=" +
                          (hp.value.is_scalar() ? hp.value.text() : core::trim(hp.value.to_yaml()));
              }
            }
          };
      list(resolved.hyperparameters, "");
      std::cout << values << "\n";
    }
    if (task != tasks.end()) {
      std::cout << "  slurm:       " << task->second.display_id() << " " << task->second.state
                << (task->second.held() ? " (held)" : "") << ", " << task->second.restarts << " restart(s), elapsed "
                << task->second.run_time << ", exit " << task->second.exit_code << "\n";
    }
    if (pbs_job != pbs_jobs.end()) {
      const pbs::JobInfo& j = pbs_job->second;
      std::cout << "  pbs:         " << j.id << " " << j.state << (j.held() ? " (held)" : "") << ", run count "
                << j.run_count << (j.exit_status ? ", exit " + std::to_string(*j.exit_status) : "") << "\n";
    }
    std::cout << "  batches:     " << batches_text(layout, trial, running) << " of " << config.searcher.max_length.value
              << " " << core::to_string(config.searcher.max_length.unit) << "\n"
              << "  checkpoint:  " << (ckpt ? ckpt->path : "none yet")
              << "\n"
              << "  runs:        " << progress.starts << " start(s) of the launcher, " << progress.failures
              << " failure(s) counted against max_restarts " << config.max_restarts << "\n";
    if (!progress.last_failure.empty()) std::cout << "  last failure: " << progress.last_failure << "\n";
    if (on_pbs) {
      const auto ids = pbs_trial_jobs(layout, trial, trials);
      if (!ids.empty()) std::cout << "  output:      " << layout.dir << "/pbs-" << ids.back() << ".out\n";
    } else if (!jobs.empty()) {
      std::cout << "  output:      " << job_output(layout, jobs.back().id, trial, trials) << "\n";
    }
  }
  return kExitOk;
}

}  // namespace

Verb jobs_verb() { return {"jobs", "list your hpctrial batch jobs, with batches trained and checkpoints", run_jobs}; }
Verb logs_verb() { return {"logs", "print (or follow) a job's output, or one rank's", run_logs}; }
Verb describe_verb() { return {"describe", "an experiment's jobs, trials, checkpoints and failures", run_describe}; }

}  // namespace hpctrial::cli
