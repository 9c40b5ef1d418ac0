// hpctrial logs: a job's output (the launcher's log and every rank's lines), or one rank's own
// log, whole, its last lines, or followed while the job runs and into the job that resumes it.
#include <boost/program_options.hpp>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <thread>

#include "hpctrial/core/error.h"
#include "hpctrial/core/experiment_config.h"
#include "hpctrial/core/experiment_dir.h"
#include "hpctrial/core/search.h"
#include "job_verbs.h"
#include "verb.h"

namespace po = boost::program_options;
namespace fs = std::filesystem;

namespace hpctrial::cli {
namespace {

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

}  // namespace

Verb logs_verb() { return {"logs", "print (or follow) a job's output, or one rank's", run_logs}; }

}  // namespace hpctrial::cli
