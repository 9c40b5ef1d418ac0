// hpctrial describe: an experiment's story, as text or as one JSON document, both from the read
// model of its directory (hpctrial::view).
#include <boost/program_options.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <string>
#include <utility>
#include <vector>

#include "hpctrial/core/error.h"
#include "hpctrial/core/experiment_config.h"
#include "hpctrial/core/experiment_dir.h"
#include "hpctrial/core/json_file.h"
#include "hpctrial/view/experiment_view.h"
#include "job_verbs.h"
#include "verb.h"

namespace po = boost::program_options;

namespace hpctrial::cli {
namespace {

// The ranking's table: each trial's best value of the metric, when, where it stands, its best
// checkpoint and the hyperparameters in which the trials differ.
void print_ranking(std::ostream& out, const std::vector<view::TrialStanding>& ranked, const core::ExperimentConfig& config) {
  out << "\nranking by " << config.searcher.metric << " (" << (config.searcher.smaller_is_better ? "smaller" : "larger")
      << " is better):\n";
  std::vector<std::vector<std::string>> rows = {{"#", "trial", config.searcher.metric, "at batch", "state",
                                                 "checkpoint", "hyperparameters"}};
  for (std::size_t i = 0; i < ranked.size(); ++i) {
    const view::TrialStanding& s = ranked[i];
    rows.push_back({std::to_string(i + 1), std::to_string(s.trial), s.best ? core::json_number(*s.best).dump() : "-",
                    s.best ? std::to_string(s.best_batches) : "-", s.state,
                    s.checkpoint.empty() ? "none" : s.checkpoint, s.hparams});
  }
  std::vector<std::size_t> widths(rows.front().size(), 0);
  for (const auto& row : rows) {
    for (std::size_t c = 0; c < row.size(); ++c) widths[c] = std::max(widths[c], row[c].size());
  }
  for (const auto& row : rows) {
    out << "  ";
    for (std::size_t c = 0; c < row.size(); ++c) {
      out << row[c] << (c + 1 < row.size() ? std::string(widths[c] - row[c].size() + 2, ' ') : "\n");
    }
  }
}


// `hpctrial describe --best`: the best trial's best checkpoint, alone on a line.
int print_best(const core::ExperimentLayout& layout, const core::ExperimentConfig& config) {
  // The first in the ranking with a checkpoint and a metric that is a number.
  for (const view::TrialStanding& s : view::rank_trials(layout, config)) {
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
  for (const auto& spared : progress.spared_nodes) {
    out << "  spare node:  " << spared.spare << " took the ranks of node " << spared.node << " in job " << spared.job
        << " at " << spared.time << ", the ranks having failed there\n";
  }
  for (const auto& left : progress.excluded_nodes) {
    out << "  left out:    node " << left.node << " (job " << left.job << "), the ranks having failed on it "
        << (left.no_spare_left ? "with no spare node left" : "in two attempts") << "\n";
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
std::string inference_progress_text(const view::InferenceProgress& p) {
  if (!p.started) return "  records:     none predicted yet\n";
  if (!p.error.empty()) return "  records:     unknown: " + p.error + "\n";
  return "  records:     " + std::to_string(p.done) + " of " + std::to_string(p.records) + " predicted" +
         (p.complete ? ", complete" : "") + "\n  source:      " + p.source_checkpoint + "\n" +
         (p.complete ? "  predictions: " + p.predictions + "\n" : std::string());
}

// One trial of `hpctrial describe`: its job, batches, checkpoint, runs and failures.
void print_trial(const view::ExperimentView& v, const view::TrialView& t) {
  const core::ExperimentConfig& config = v.config;
  std::cout << "\ntrial " << t.trial << ":  " << t.directory << "\n";
  if (v.trials.size() > 1) {
    std::string hparams;
    for (const auto& [name, value] : t.hparams) hparams += (hparams.empty() ? "" : ", ") + name + "=" + value;
    std::cout << "  hparams:     " << hparams << "\n";
  }
  if (t.job) {
    const core::JobStatus& job = *t.job;
    const std::string label = v.scheduler + ":";
    std::cout << "  " << label << std::string(label.size() < 13 ? 13 - label.size() : 1, ' ') << job.id;
    if (job.native_state.empty()) {
      std::cout << " (" << v.scheduler << " no longer knows it)\n";
    } else {
      std::cout << " " << state_text(job) << ", " << job.restarts << " restart(s)"
                << (job.elapsed.empty() ? "" : ", elapsed " + job.elapsed)
                << (job.exit.empty() ? "" : ", exit " + job.exit) << "\n";
    }
  }
  const core::TrialProgress& progress = t.progress;
  if (t.inference) {
    std::cout << inference_progress_text(*t.inference);
  } else {
    std::cout << "  batches:     " << (t.batches ? std::to_string(*t.batches) : "-") << " of "
              << config.searcher.max_length.value << " " << core::to_string(config.searcher.max_length.unit) << "\n"
              << "  checkpoint:  " << (t.checkpoint ? t.checkpoint->path : "none yet") << "\n";
  }
  std::cout << "  runs:        " << progress.starts << " start(s) of the launcher, " << progress.failures
            << " failure(s) counted against max_restarts " << config.max_restarts << "\n";
  for (std::size_t i = 0; i < progress.runs.size(); ++i) {
    const core::TrialRun& run = progress.runs[i];
    std::cout << "  run " << i + 1 << ":" << std::string(i + 1 < 10 ? 7 : 6, ' ') << run.ranks << " rank(s), batch "
              << run.batch << " (" << run.local_batch << " x " << run.accumulation << " x " << run.ranks
              << "), from " << (run.from_record ? "record " + std::to_string(*run.from_record)
                                                : "batch " + std::to_string(run.batches))
              << (run.level == "memory"    ? " (its copies in node memory)"
                  : run.level == "partner" ? " (its copies in node memory, some from the partners of ranks that lost theirs)"
                                           : "")
              << ", started " << run.started
              << (run.launcher.empty() ? "" : " by " + run.launcher)
              << (run.image.empty() ? "" : ", each rank in " + run.runtime + " image " + run.image) << "\n";
    if (!run.placement.empty()) std::cout << "    " << placement_text(run.placement) << "\n";
  }
  print_failures(std::cout, progress);
  if (t.job) std::cout << "  output:      " << t.job->output << "\n";
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
  const view::ExperimentView v = view::read_experiment(layout, config, t.scheduler);
  if (json) {
    std::cout << view::to_json(v).dump(2) << "\n";
    return kExitOk;
  }
  std::cout << "experiment:  " << config.name << "\n"
            << "directory:   " << v.directory << "\n"
            << (config.inference ? inference_text(*config.inference) : searcher_text(config, static_cast<int>(v.trials.size())))
            << "resources:   "
            << (config.resources.elastic() ? std::to_string(config.resources.min_slots()) + " to " : std::string())
            << config.resources.slots_per_trial << " slot(s) per trial on "
            << (config.resources.elastic() ? std::to_string(config.resources.min_nodes()) + " to " : std::string())
            << config.resources.nodes() << " node(s)\n";
  for (const auto& job : v.jobs) {
    std::cout << "job:         " << job.scheduler << " " << job.id << ", submitted " << job.submitted << "\n";
  }
  if (!v.ranking.empty()) print_ranking(std::cout, v.ranking, config);
  for (const view::TrialView& trial : v.trials) print_trial(v, trial);
  return kExitOk;
}
}  // namespace

Verb describe_verb() { return {"describe", "an experiment's jobs, trials, checkpoints and failures", run_describe}; }

}  // namespace hpctrial::cli
