// hpctrial jobs / logs / describe: what the batch jobs of experiments are doing, as their
// schedulers say, joined with what the launcher and the chief left in each experiment directory.
#include <boost/program_options.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>

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
#include "hpctrial/core/json_file.h"
#include "hpctrial/core/search.h"
#include "hpctrial/core/text.h"
#include "hpctrial/launcher/schedulers.h"
#include "job_verbs.h"
#include "ranking.h"
#include "verb.h"
#include "verb_args.h"

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
std::optional<LatestCheckpoint> latest_checkpoint(const core::ExperimentLayout& layout, int trial) {
  const core::TrialLayout trial_layout = layout.trial(trial);
  std::string dir = trial_layout.default_checkpoint_dir();
  try {  // where the trainer put them: checkpoint_storage.host_path may say elsewhere
    dir = core::checkpoint_dir(core::load_experiment_config({layout.config(), "", {}}), trial_layout, trial,
                               core::experiment_identity(layout));
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
std::string batches_text(const core::ExperimentLayout& layout, int trial, bool running) {
  if (trial < 0) return "-";
  const auto progress = core::trial_progress(layout, trial);
  const auto ckpt = latest_checkpoint(layout, trial);
  std::int64_t batches = ckpt ? ckpt->batches : 0;
  if (running && progress.reported_step > batches) batches = progress.reported_step;
  if (!ckpt && progress.reported_step < 0) return "-";
  return std::to_string(batches);
}

void print_row(std::ostream& out, const std::vector<std::string>& cells, const std::vector<std::size_t>& widths) {
  for (std::size_t i = 0; i < cells.size(); ++i) {
    out << cells[i];
    if (i + 1 < cells.size()) out << std::string(widths[i] - cells[i].size() + 2, ' ');
  }
  out << "\n";
}

// A job's state as the scheduler writes it, and whether it is held.
std::string state_text(const core::JobStatus& job) {
  return (job.native_state.empty() ? core::to_string(job.state) : job.native_state) + (job.held() ? " (held)" : "");
}

int run_jobs(const std::vector<std::string>& args) {
  bool all = false;
  VerbArgs command_line(R"(usage: hpctrial jobs [--all]

Lists your hpctrial batch jobs that Slurm or PBS still knows (pending, running, or recently
ended), one line per task of a job array, with what their experiment directories say: batches
trained and the latest checkpoint. A scheduler that cannot be asked is reported on stderr and
the others' jobs are still listed; when none can be, the command fails.
)" "\n");
  command_line.add_options()("all,a", po::bool_switch(&all), "also list this user's jobs that are not hpctrial's");
  if (!command_line.parse(args)) return kExitOk;
  std::vector<std::vector<std::string>> rows = {
      {"JOB", "NAME", "STATE", "RESTARTS", "ELAPSED", "TRIAL", "BATCHES", "CHECKPOINT", "EXPERIMENT"}};
  const auto progress_cells = [](const std::string& dir, int trial, bool running) {
    std::pair<std::string, std::string> cells{"-", "-"};
    if (dir.empty() || trial < 0) return cells;
    const core::ExperimentLayout layout{dir};
    cells.first = batches_text(layout, trial, running);
    if (const auto latest = latest_checkpoint(layout, trial)) cells.second = latest->file;
    return cells;
  };
  // The schedulers this machine has; one that fails is reported, the others still listed.
  std::vector<const core::Scheduler*> here;
  for (const core::Scheduler* scheduler : launcher::schedulers()) {
    if (scheduler->available()) here.push_back(scheduler);
  }
  if (here.empty()) throw SchedulerError("no batch scheduler's commands are on PATH (hpctrial knows Slurm and PBS)");
  std::vector<std::string> unanswered;  // schedulers that could not be asked
  for (const core::Scheduler* scheduler : here) {
    try {
      for (const core::JobStatus& job : scheduler->user_jobs()) {
        const std::string dir = core::experiment_of_output(job.output);
        if (dir.empty() && !all) continue;
        const auto [batches, ckpt] = progress_cells(dir, job.trial, job.state == core::JobState::kRunning);
        rows.push_back({job.id, job.name, state_text(job), std::to_string(job.restarts),
                        job.elapsed.empty() ? "-" : job.elapsed,
                        job.trial >= 0 ? std::to_string(job.trial) : job.tasks.empty() ? "-" : job.tasks, batches, ckpt,
                        dir.empty() ? "-" : dir});
      }
    } catch (const SchedulerError& e) {
      if (here.size() == 1) throw;
      // The others' jobs are still listed; the exit status says the list is incomplete.
      std::cerr << "hpctrial jobs: " << scheduler->name() << ": " << e.what() << "\n";
      unanswered.push_back(scheduler->name());
    }
  }
  if (unanswered.size() == here.size()) {
    throw SchedulerError("no scheduler on this machine could be asked for jobs (above); try again, or check that "
                         "its controller is up");
  }
  if (rows.size() == 1) {
    std::string missing;
    for (const auto& name : unanswered) missing += (missing.empty() ? "" : " and ") + name;
    std::cout << "no hpctrial jobs"
              << (missing.empty() ? "" : " in what answered (" + missing + " could not be asked; see above)")
              << " (the scheduler forgets a job some time after it ends; `hpctrial describe EXPDIR` still tells its "
                 "story)\n";
    return kExitOk;
  }
  std::vector<std::size_t> widths(rows.front().size(), 0);
  for (const auto& row : rows) {
    for (std::size_t i = 0; i < row.size(); ++i) widths[i] = std::max(widths[i], row[i].size());
  }
  for (const auto& row : rows) print_row(std::cout, row, widths);
  return kExitOk;
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

// Where the last `lines` lines of `path` begin (0: the file has no more); a last line without its
// newline counts as one.
std::uintmax_t tail_offset(const std::string& path, long lines) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in || lines <= 0) return in ? static_cast<std::uintmax_t>(in.tellg()) : 0;
  std::streamoff end = in.tellg(), at = end;
  char buffer[65536];
  long newlines = 0;
  while (at > 0) {
    const std::streamoff size = std::min<std::streamoff>(at, sizeof buffer);
    at -= size;
    in.seekg(at);
    in.read(buffer, size);
    for (std::streamoff i = size - 1; i >= 0; --i) {
      // The newline that ends the file ends the last line; each one before it ends a line more.
      if (buffer[i] != '\n' || at + i == end - 1) continue;
      if (++newlines == lines) return static_cast<std::uintmax_t>(at + i + 1);
    }
  }
  return 0;
}

// The trial `hpctrial logs` prints: --trial, else the one the task named runs, else 0.
int logs_trial(const Target& t, int trial, int trials, const core::ExperimentLayout& layout) {
  if (trial < 0 && !t.jobs.job.empty()) {
    if (const auto job = t.scheduler->job(t.jobs.job)) trial = std::max(0, job->trial);  // the task named
  }
  if (trial < 0) trial = 0;
  if (trial >= trials) {
    throw ConfigError("the experiment in " + layout.dir + " has " + std::to_string(trials) + " trial(s); --trial " +
                      std::to_string(trial) + " does not exist");
  }
  return trial;
}

// A search's worker trains trial after trial: its output is the job named, or the one training
// the trial now (it holds each trial that worker trained), else the trial's rank 0 (`rank`).
void worker_logs(const Target& t, int trial, bool named, std::vector<core::JobStatus>& jobs, int& rank) {
  if (named) jobs = {t.scheduler->job(t.jobs.job).value_or(core::JobStatus{})};
  if (rank >= 0 || !jobs.empty()) return;
  rank = 0;
  std::cerr << "hpctrial logs: no worker trains trial " << trial << " now; its rank 0's log follows (a worker's "
            << "whole output: hpctrial logs JOB)\n";
}

int run_logs(const std::vector<std::string>& args) {
  po::options_description options;
  int rank = -1, trial = -1;
  long tail = -1;
  bool follow = false;
  options.add_options()
      ("rank,r", po::value(&rank)->value_name("N"), "only rank N's lines (trial-T/logs/rank-N.log)")
      ("trial", po::value(&trial)->value_name("T"), "the trial of a search (default: task 0)")
      ("tail,n", po::value(&tail)->value_name("N"), "only the last N lines (of the newest run's output)")
      ("follow,f", po::bool_switch(&follow), "keep printing what is added, until the job ends");
  po::variables_map vm;
  const std::string what = target_argument(args, "logs", R"(usage: hpctrial logs JOB|EXPDIR [--rank N] [--trial T] [--tail N] [--follow]

Prints the output of a job: the launcher's log and every rank's lines, from every run of the
job (requeued runs append). --rank N prints rank N's own log; --tail N only the last N lines of
the newest run (as tail -n N); --follow keeps printing until the job ends (until Ctrl-C when
there is no job). An experiment run with `hpctrial run` has no job: give --rank.
)", &options, &vm);
  if (what.empty()) return kExitOk;
  if ((vm.count("rank") && rank < 0) || (vm.count("trial") && trial < 0) || (vm.count("tail") && tail < 0)) {
    throw ConfigError("hpctrial logs: --rank, --trial and --tail are 0 or more");
  }
  const Target t = experiment_target(what);
  const core::ExperimentLayout layout{t.jobs.experiment_dir};
  const core::ExperimentConfig config = core::load_experiment_config({layout.config(), "", {}});
  const int trials = core::trial_ids(config);
  const bool workers = core::search_workers(config) > 0, named = !t.jobs.job.empty() && trial < 0;
  trial = logs_trial(t, trial, trials, layout);
  const std::string scheduler = t.scheduler->name();
  // The trial's jobs, oldest first, each with its own output file (a job that resumes a trial
  // may be a new job); the runs before the last are printed whole, each under its job's name.
  std::vector<core::JobStatus> jobs = t.scheduler->trial_jobs(layout, trial, trials);
  if (workers) worker_logs(t, trial, named, jobs, rank);
  std::string path;
  if (rank >= 0) {
    path = layout.trial(trial).rank_log(rank);
  } else if (!jobs.empty()) {
    for (std::size_t i = 0; i + 1 < jobs.size() && tail < 0; ++i) {
      if (!fs::exists(jobs[i].output)) continue;
      std::cout << "==> " << scheduler << " job " << jobs[i].id << " <==\n";
      copy_from(jobs[i].output, 0);
    }
    if (jobs.size() > 1 && tail < 0) std::cout << "==> " << scheduler << " job " << jobs.back().id << " <==\n";
    path = jobs.back().output;
  } else if (!t.job.empty()) {
    throw ConfigError(layout.dir + " records no " + scheduler + " job of trial " + std::to_string(trial));
  } else {
    throw ConfigError(layout.dir + " has no batch job; give --rank N for a rank's log");
  }
  if (!fs::exists(path) && !follow) {
    throw IoError(path + " does not exist (yet): " +
                  (rank >= 0 ? "trial " + std::to_string(trial) + " has not run, or has no rank " + std::to_string(rank)
                             : "the job has not started; --follow waits for it"));
  }
  std::uintmax_t offset = copy_from(path, tail < 0 ? 0 : tail_offset(path, tail));
  if (!follow) return kExitOk;
  // Follow while the trial's job may still write, on into the job that resumes it.
  std::string job = jobs.empty() ? "" : jobs.back().id;
  for (int checks = 1;; ++checks) {
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    offset = copy_from(path, offset);
    if (job.empty() || checks % 4 != 0) continue;
    if (const auto now = t.scheduler->job(job); now && now->live()) continue;
    copy_from(path, offset);
    if (rank < 0 && !workers) {
      jobs = t.scheduler->trial_jobs(layout, trial, trials);
      if (!jobs.empty() && jobs.back().id != job) {
        job = jobs.back().id;
        path = jobs.back().output;
        offset = 0;
        std::cout << "==> " << scheduler << " job " << job << " <==\n";
        continue;
      }
    }
    return kExitOk;
  }
}

// `hpctrial describe --best`: the best trial's best checkpoint, alone on a line.
int print_best(const core::ExperimentLayout& layout, const core::ExperimentConfig& config) {
  // The first in the ranking with a checkpoint and a metric that is a number.
  for (const TrialStanding& s : rank_trials(layout, config)) {
    if (!s.best || std::isnan(*s.best) || s.checkpoint.empty()) continue;
    std::cout << s.checkpoint << "\n";
    return kExitOk;
  }
  throw ConfigError("no trial of " + layout.dir + " has validated " + config.searcher.metric +
                    " (as a number) with a checkpoint yet; `hpctrial describe " + layout.dir +
                    "` shows where each stands");
}

// Where a run's ranks ran, host by host (in the order of their first rank):
// "node1: rank 0 (cpus 0-3, cuda:0), rank 2 (...); node2: rank 1 (...)".
std::string placement_text(const std::vector<core::TrialRun::Place>& placement) {
  std::vector<std::pair<std::string, std::string>> hosts;  // host, its ranks
  for (std::size_t rank = 0; rank < placement.size(); ++rank) {
    const auto& place = placement[rank];
    auto it = std::find_if(hosts.begin(), hosts.end(), [&](const auto& h) { return h.first == place.host; });
    if (it == hosts.end()) it = hosts.insert(hosts.end(), {place.host, ""});
    it->second += (it->second.empty() ? "" : ", ") + ("rank " + std::to_string(rank) + " (cpus " + place.cpus + ", " +
                                                      place.device + ")");
  }
  std::string out;
  for (const auto& [host, ranks] : hosts) out += (out.empty() ? "" : "; ") + host + ": " + ranks;
  return out;
}

// A trial's last failure, with where each rank was when a watchdog ended it, and a hand-over
// that failed.
void print_failures(std::ostream& out, const core::TrialProgress& progress) {
  if (!progress.last_failure.empty()) out << "  last failure: " << progress.last_failure << "\n";
  for (const auto& [rank, operations] : progress.last_failure_flight) {
    out << "    rank " << rank << " last: " << operations << "\n";
  }
  for (const auto& [node, job] : progress.excluded_nodes) {
    out << "  left out:    node " << node << " (job " << job << "), the ranks having failed on it in two attempts\n";
  }
  if (const auto& failed = progress.failed_hand_over) {
    // The job stopped after a durable checkpoint, but its scheduler did not take the trial back.
    out << "  hand-over:   failed at " << failed->time << " when job " << failed->job << " stopped (" << failed->tries
        << (failed->tries == 1 ? " try" : " tries") << "): " << failed->error
        << "; nothing resumes the trial until you do\n"
        << "  resume with: " << (failed->resume.empty() ? "submit the experiment again" : failed->resume) << "\n";
  }
}

// describe's second line: the searcher, or an inference experiment's source.
std::string searcher_text(const core::ExperimentConfig& config, int trials) {
  return "searcher:    " + std::string(core::to_string(config.searcher.name)) + ", " + std::to_string(trials) +
         " trial(s), metric " + config.searcher.metric + "\n";
}

std::string inference_text(const core::Inference& inference) {
  return "inference:   the weights of " + inference.checkpoint +
         (inference.trial_id ? " (trial " + std::to_string(*inference.trial_id) + ")" : std::string()) +
         (inference.batch_size ? ", " + std::to_string(*inference.batch_size) + " records a batch" : std::string()) +
         "\n";
}

// An inference trial's records predicted and durable, from its progress record.
std::string inference_progress_text(const core::TrialLayout& trial) {
  std::error_code ec;
  if (!std::filesystem::exists(trial.inference_progress_file(), ec)) return "  records:     none predicted yet\n";
  try {
    const nlohmann::json p = core::read_json_file(trial.inference_progress_file());
    const bool complete = p.value("complete", false);
    return "  records:     " + std::to_string(p.value("done", std::int64_t{0})) + " of " +
           std::to_string(p.value("records", std::int64_t{0})) + " predicted" + (complete ? ", complete" : "") +
           "\n  source:      " + p.value("source_checkpoint", std::string()) + "\n" +
           (complete ? "  predictions: " + p.value("file", std::string()) + "\n" : std::string());
  } catch (const std::exception& e) {
    return "  records:     unknown: " + std::string(e.what()) + "\n";
  }
}

int run_describe(const std::vector<std::string>& args) {
  po::options_description options;
  bool best = false;
  options.add_options()("best", po::bool_switch(&best), "print only the best trial's best checkpoint (for scripts)");
  po::variables_map vm;
  const std::string what = target_argument(args, "describe", R"(usage: hpctrial describe JOB|EXPDIR [--best]

Tells an experiment's story: its config, its batch jobs and their state in Slurm or PBS, the
trials ranked by searcher.metric (each one's best validation, where it stands in an adaptive
search, its best checkpoint, the hyperparameters in which the trials differ), and for each trial
the batches trained, the latest checkpoint, the runs and the failures. A trial whose job stopped
after a checkpoint but could not be handed back to the scheduler (a failed `scontrol requeue` or
`qsub`, tried 3 times) shows the command that resumes it by hand. --best prints the path of the
best trial's best checkpoint alone.
)", &options, &vm);
  if (what.empty()) return kExitOk;
  const Target t = experiment_target(what);
  const core::ExperimentLayout layout{t.jobs.experiment_dir};
  const core::ExperimentConfig config = core::load_experiment_config({layout.config(), "", {}});
  if (best) return print_best(layout, config);
  const int trials = core::trial_count(config);
  std::cout << "experiment:  " << config.name << "\n"
            << "directory:   " << layout.dir << "\n"
            << (config.inference ? inference_text(*config.inference) : searcher_text(config, trials))
            << "resources:   "
            << (config.resources.elastic() ? std::to_string(config.resources.min_slots()) + " to " : std::string())
            << config.resources.slots_per_trial << " slot(s) per trial on "
            << (config.resources.elastic() ? std::to_string(config.resources.min_nodes()) + " to " : std::string())
            << config.resources.nodes() << " node(s)\n";
  for (const auto& job : core::recorded_jobs(layout)) {
    std::cout << "job:         " << job.scheduler << " " << job.id << ", submitted " << job.submitted << "\n";
  }
  if (const auto ranked = config.inference ? std::vector<TrialStanding>{} : rank_trials(layout, config); !ranked.empty()) {
    print_ranking(std::cout, ranked, config);
  }
  for (int trial = 0; trial < trials; ++trial) {
    const auto jobs = t.scheduler->trial_jobs(layout, trial, trials);
    std::cout << "\ntrial " << trial << ":  " << layout.trial_dir(trial) << "\n";
    if (trials > 1) std::cout << "  hparams:     " << hparams_text(core::trial_config(config, trial)) << "\n";
    bool running = false;
    if (!jobs.empty()) {
      const core::JobStatus& job = jobs.back();
      const std::string label = t.scheduler->name() + ":";
      std::cout << "  " << label << std::string(label.size() < 13 ? 13 - label.size() : 1, ' ') << job.id;
      if (job.native_state.empty()) {
        std::cout << " (" << t.scheduler->name() << " no longer knows it)\n";
      } else {
        std::cout << " " << state_text(job) << ", " << job.restarts << " restart(s)"
                  << (job.elapsed.empty() ? "" : ", elapsed " + job.elapsed)
                  << (job.exit.empty() ? "" : ", exit " + job.exit) << "\n";
      }
      running = job.state == core::JobState::kRunning;
    }
    const auto progress = core::trial_progress(layout, trial);
    const auto ckpt = latest_checkpoint(layout, trial);
    if (config.inference) {
      std::cout << inference_progress_text(core::TrialLayout{layout.trial_dir(trial)});
    } else {
      std::cout << "  batches:     " << batches_text(layout, trial, running) << " of " << config.searcher.max_length.value
                << " " << core::to_string(config.searcher.max_length.unit) << "\n"
                << "  checkpoint:  " << (ckpt ? ckpt->path : "none yet") << "\n";
    }
    std::cout << "  runs:        " << progress.starts << " start(s) of the launcher, " << progress.failures
              << " failure(s) counted against max_restarts " << config.max_restarts << "\n";
    for (std::size_t i = 0; i < progress.runs.size(); ++i) {
      const core::TrialRun& run = progress.runs[i];
      std::cout << "  run " << i + 1 << ":" << std::string(i + 1 < 10 ? 7 : 6, ' ') << run.ranks << " rank(s), batch "
                << run.batch << " (" << run.local_batch << " x " << run.accumulation << " x " << run.ranks
                << "), from " << (run.from_record ? "record " + std::to_string(*run.from_record)
                                                  : "batch " + std::to_string(run.batches))
                << ", started " << run.started
                << (run.launcher.empty() ? "" : " by " + run.launcher)
                << (run.image.empty() ? "" : ", each rank in " + run.runtime + " image " + run.image) << "\n";
      if (!run.placement.empty()) std::cout << "    " << placement_text(run.placement) << "\n";
    }
    print_failures(std::cout, progress);
    if (!jobs.empty()) std::cout << "  output:      " << jobs.back().output << "\n";
  }
  return kExitOk;
}

}  // namespace

Verb jobs_verb() { return {"jobs", "list your hpctrial batch jobs, with batches trained and checkpoints", run_jobs}; }
Verb logs_verb() { return {"logs", "print (or follow) a job's output, or one rank's", run_logs}; }
Verb describe_verb() { return {"describe", "an experiment's jobs, trials, checkpoints and failures", run_describe}; }

}  // namespace hpctrial::cli
