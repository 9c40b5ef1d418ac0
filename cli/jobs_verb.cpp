// hpctrial jobs: what the batch jobs of experiments are doing, as their schedulers say, joined
// with what the launcher and the chief left in each experiment directory.
#include <boost/program_options.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "hpctrial/core/error.h"
#include "hpctrial/core/experiment_dir.h"
#include "hpctrial/core/logging.h"
#include "hpctrial/launcher/schedulers.h"
#include "hpctrial/view/experiment_view.h"
#include "job_verbs.h"
#include "verb.h"
#include "verb_args.h"

namespace po = boost::program_options;

namespace hpctrial::cli {
namespace {

void print_row(std::ostream& out, const std::vector<std::string>& cells, const std::vector<std::size_t>& widths) {
  for (std::size_t i = 0; i < cells.size(); ++i) {
    out << cells[i];
    if (i + 1 < cells.size()) out << std::string(widths[i] - cells[i].size() + 2, ' ');
  }
  out << "\n";
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
          row.batches = view::trained_batches(layout, job.trial, job.state == core::JobState::kRunning);
          if (const auto latest = view::latest_checkpoint(layout, job.trial)) row.checkpoint = latest->file;
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
                    {"user", view::text_or_null(r.job.user)},
                    {"state", core::to_string(r.job.state)},
                    {"native_state", r.job.native_state},
                    {"held", r.job.held()},
                    {"restarts", r.job.restarts},
                    {"priority", view::text_or_null(r.job.priority)},
                    {"queue", view::text_or_null(r.job.queue)},
                    {"slots_needed", r.job.slots_needed},
                    {"slots_acquired", r.job.slots_acquired},
                    {"elapsed", view::text_or_null(r.job.elapsed)},
                    {"trial", r.job.trial >= 0 ? nlohmann::json(r.job.trial) : nlohmann::json()},
                    {"tasks", view::text_or_null(r.job.tasks)},
                    {"batches", r.batches ? nlohmann::json(*r.batches) : nlohmann::json()},
                    {"checkpoint", view::text_or_null(r.checkpoint)},
                    {"experiment", view::text_or_null(r.experiment)}});
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

}  // namespace

Verb jobs_verb() { return {"jobs", "list your hpctrial batch jobs, with batches trained and checkpoints", run_jobs}; }

}  // namespace hpctrial::cli
