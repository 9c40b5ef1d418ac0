// hpctrial jobs / describe: what the batch jobs of experiments are doing, as their
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
#include "hpctrial/core/logging.h"
#include "hpctrial/core/search.h"
#include "hpctrial/core/text.h"
#include "hpctrial/launcher/schedulers.h"
#include "experiment_model.h"
#include "job_verbs.h"
#include "ranking.h"
#include "verb.h"
#include "verb_args.h"

namespace po = boost::program_options;
namespace fs = std::filesystem;

namespace hpctrial::cli {
namespace {

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

// One line of `hpctrial jobs`: a job (a task of an array) and what its experiment directory says.
struct JobRow {
  std::string scheduler;
  core::JobStatus job;
  std::string experiment;  // empty: not an hpctrial job's
  std::optional<std::int64_t> batches;
  std::string checkpoint;  // the file `latest` names; empty: none
};

// What `hpctrial jobs` lists: whose jobs, which of them, and of which queue.
struct JobFilter {
  core::JobOwners owners = core::JobOwners::kMine;
  bool all = false;   // jobs that are not hpctrial's too
  std::string queue;  // empty: every partition or queue
};

// The jobs from each scheduler in `asked` that `filter` keeps; the names of those that could not
// be asked go to `unanswered`, each reported on stderr.
std::vector<JobRow> user_job_rows(const std::vector<const core::Scheduler*>& asked, const JobFilter& filter,
                                  std::vector<std::string>& unanswered) {
  std::vector<JobRow> rows;
  for (const core::Scheduler* scheduler : asked) {
    try {
      for (const core::JobStatus& job : scheduler->user_jobs(filter.owners)) {
        JobRow row{scheduler->name(), job, core::experiment_of_output(job.output), std::nullopt, ""};
        if ((row.experiment.empty() && !filter.all) || (!filter.queue.empty() && job.queue != filter.queue)) continue;
        if (row.experiment.empty()) {  // not hpctrial's: no trial to speak of
          row.job.trial = -1;
          row.job.tasks.clear();
        }
        if (!row.experiment.empty() && job.trial >= 0) {
          const core::ExperimentLayout layout{row.experiment};
          const std::string batches = batches_text(layout, job.trial, job.state == core::JobState::kRunning);
          if (batches != "-") row.batches = std::stoll(batches);
          if (const auto latest = latest_checkpoint(layout, job.trial)) row.checkpoint = latest->file;
        }
        rows.push_back(std::move(row));
      }
    } catch (const SchedulerError& e) {
      std::cerr << "hpctrial jobs: " << scheduler->name() << ": " << e.what() << "\n";
      unanswered.push_back(scheduler->name());
    }
  }
  return rows;
}

void print_jobs_json(const std::vector<JobRow>& rows, const std::vector<std::string>& unanswered) {
  nlohmann::json jobs = nlohmann::json::array();
  for (const JobRow& r : rows) {
    jobs.push_back({{"scheduler", r.scheduler},
                    {"id", r.job.id},
                    {"name", r.job.name},
                    {"user", text_or_null(r.job.user)},
                    {"state", core::to_string(r.job.state)},
                    {"native_state", r.job.native_state},
                    {"held", r.job.held()},
                    {"restarts", r.job.restarts},
                    {"priority", text_or_null(r.job.priority)},
                    {"queue", text_or_null(r.job.queue)},
                    {"slots_needed", r.job.slots_needed},
                    {"slots_acquired", r.job.slots_acquired},
                    {"elapsed", text_or_null(r.job.elapsed)},
                    {"trial", r.job.trial >= 0 ? nlohmann::json(r.job.trial) : nlohmann::json()},
                    {"tasks", text_or_null(r.job.tasks)},
                    {"batches", r.batches ? nlohmann::json(*r.batches) : nlohmann::json()},
                    {"checkpoint", text_or_null(r.checkpoint)},
                    {"experiment", text_or_null(r.experiment)}});
  }
  std::cout << nlohmann::json{{"jobs", jobs}, {"unanswered", unanswered}}.dump(2) << "\n";
}

// The table; with a USER column when it lists every user's jobs.
void print_jobs_table(const std::vector<JobRow>& jobs, bool users) {
  std::vector<std::vector<std::string>> rows = {
      {"JOB", "NAME", "STATE", "PRIORITY", "QUEUE", "SLOTS", "RESTARTS", "ELAPSED", "TRIAL", "BATCHES", "CHECKPOINT",
       "EXPERIMENT"}};
  if (users) rows.front().insert(rows.front().begin() + 1, "USER");
  for (const JobRow& r : jobs) {
    const core::JobStatus& job = r.job;
    const std::string slots =
        job.slots_needed > 0 ? std::to_string(job.slots_acquired) + "/" + std::to_string(job.slots_needed) : "-";
    rows.push_back({job.id, job.name, state_text(job), job.priority.empty() ? "-" : job.priority,
                    job.queue.empty() ? "-" : job.queue, slots, std::to_string(job.restarts),
                    job.elapsed.empty() ? "-" : job.elapsed,
                    job.trial >= 0 ? std::to_string(job.trial) : job.tasks.empty() ? "-" : job.tasks,
                    r.batches ? std::to_string(*r.batches) : "-", r.checkpoint.empty() ? "-" : r.checkpoint,
                    r.experiment.empty() ? "-" : r.experiment});
    if (users) rows.back().insert(rows.back().begin() + 1, job.user.empty() ? "-" : job.user);
  }
  std::vector<std::size_t> widths(rows.front().size(), 0);
  for (const auto& row : rows) {
    for (std::size_t i = 0; i < row.size(); ++i) widths[i] = std::max(widths[i], row[i].size());
  }
  for (const auto& row : rows) print_row(std::cout, row, widths);
}

int run_jobs(const std::vector<std::string>& args) {
  bool json = false, all_users = false, verbose = false;
  JobFilter filter;
  std::string only;
  VerbArgs command_line(R"(usage: hpctrial jobs [--all] [--all-users] [--scheduler slurm|pbs] [--partition P | --queue Q]
                     [--json] [--verbose]

Lists your hpctrial batch jobs that Slurm or PBS still knows (pending, running, or recently
ended), one line per task of a job array: the scheduler's state, priority (pending jobs start
highest first), partition or queue and slots (ranks held / asked for), with what their
experiment directories say: batches trained and the latest checkpoint. `hpctrial job update`
changes a waiting job's place. A scheduler that cannot be asked is reported on stderr, the
others' jobs are still listed, and the exit status is 1: the list is incomplete. --json prints
one JSON document: {"jobs": [...], "unanswered": [schedulers that could not be asked]}.
--all-users lists every user's hpctrial jobs (with --all, every job), with a USER column; another
user's experiment directory is private, so its batches and checkpoint show as "-".
--verbose says on stderr how each scheduler was asked (Slurm: `squeue --json`, or the text of
`scontrol show job` where squeue has no --json).
)" "\n");
  command_line.add_options()
      ("all,a", po::bool_switch(&filter.all), "also list the jobs that are not hpctrial's")
      ("all-users", po::bool_switch(&all_users), "every user's jobs, not only yours (a USER column)")
      ("scheduler", po::value(&only)->value_name("NAME"), "ask only this scheduler (default: every one on PATH)")
      ("partition,p", po::value(&filter.queue)->value_name("P"), "only the jobs of this Slurm partition")
      ("queue,q", po::value(&filter.queue)->value_name("Q"), "only the jobs of this PBS queue")
      ("json", po::bool_switch(&json), "print JSON instead of a table")
      ("verbose,v", po::bool_switch(&verbose), "say how each scheduler was asked");
  if (!command_line.parse(args)) return kExitOk;
  if (verbose) core::set_log_level(core::LogLevel::kDebug);
  if (all_users) filter.owners = core::JobOwners::kEveryone;
  // The schedulers this machine has (or the one named).
  std::vector<const core::Scheduler*> here;
  for (const core::Scheduler* scheduler : launcher::schedulers()) {
    if ((only.empty() && scheduler->available()) || scheduler->name() == only) here.push_back(scheduler);
  }
  if (!only.empty() && (here.empty() || !here.front()->available())) {
    throw ConfigError("hpctrial jobs: --scheduler " + only + ": " +
                      (here.empty() ? "no scheduler of that name (hpctrial knows Slurm and PBS: slurm, pbs)"
                                    : "its commands are not on PATH"));
  }
  if (here.empty()) throw SchedulerError("no batch scheduler's commands are on PATH (hpctrial knows Slurm and PBS)");
  std::vector<std::string> unanswered;  // schedulers that could not be asked
  const std::vector<JobRow> rows = user_job_rows(here, filter, unanswered);
  if (unanswered.size() == here.size()) {
    throw SchedulerError("no scheduler on this machine could be asked for jobs (above); try again, or check that "
                         "its controller is up");
  }
  const int code = unanswered.empty() ? kExitOk : kExitFailure;
  if (json) {
    print_jobs_json(rows, unanswered);
  } else if (rows.empty()) {
    std::string missing;
    for (const auto& name : unanswered) missing += (missing.empty() ? "" : " and ") + name;
    std::cout << "no hpctrial jobs"
              << (missing.empty() ? "" : " in what answered (" + missing + " could not be asked; see above)")
              << " (the scheduler forgets a job some time after it ends; `hpctrial describe EXPDIR` still tells its "
                 "story)\n";
  } else {
    print_jobs_table(rows, all_users);
  }
  return code;
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

// One trial of `hpctrial describe`: its job, batches, checkpoint, runs and failures.
void print_trial(const Target& t, const core::ExperimentLayout& layout, const core::ExperimentConfig& config, int trial,
                 int trials) {
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

int run_describe(const std::vector<std::string>& args) {
  po::options_description options;
  bool best = false, json = false;
  options.add_options()
      ("best", po::bool_switch(&best), "print only the best trial's best checkpoint (for scripts)")
      ("json", po::bool_switch(&json), "print the same as one JSON document");
  po::variables_map vm;
  const std::string what = target_argument(args, "describe", R"(usage: hpctrial describe JOB|EXPDIR [--best | --json]

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
  if (json) {
    std::cout << describe_model(t, layout, config).dump(2) << "\n";
    return kExitOk;
  }
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
  for (int trial = 0; trial < trials; ++trial) print_trial(t, layout, config, trial, trials);
  return kExitOk;
}

}  // namespace

Verb jobs_verb() { return {"jobs", "list your hpctrial batch jobs, with batches trained and checkpoints", run_jobs}; }
Verb describe_verb() { return {"describe", "an experiment's jobs, trials, checkpoints and failures", run_describe}; }

}  // namespace hpctrial::cli
