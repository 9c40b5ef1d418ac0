// An adaptive search's worker: the "what next?" loop over the search log (search/event_log.h),
// each trial run by launch() to its rung.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <nlohmann/json.hpp>

#include "hpctrial/core/error.h"
#include "hpctrial/core/experiment_dir.h"
#include "hpctrial/core/json_file.h"
#include "hpctrial/core/logging.h"
#include "hpctrial/core/text.h"
#include "hpctrial/launcher/launcher.h"
#include "hpctrial/launcher/schedulers.h"
#include "hpctrial/search/event_log.h"
#include "hand_over.h"
#include "launcher_internal.h"
#include "processes.h"

namespace hpctrial::launcher {
namespace {

using search::Decision;
using search::Event;

// The trial's last validation (metrics.jsonl): the searcher metric (NaN, which ranks last, when
// it has none) and the batch it was taken at (-1: no validation).
struct Validated {
  double metric = std::nan("");
  std::int64_t batches = -1;
};
Validated last_validation(const core::TrialLayout& trial, const std::string& metric, bool quiet = false) {
  std::ifstream in(trial.metrics_file());
  Validated last;
  std::optional<double> found;
  for (std::string line; std::getline(in, line);) {
    try {
      const auto record = nlohmann::json::parse(line);
      if (record.value("kind", "") != "validation" || !record.contains("metrics")) continue;
      last.batches = record.value("batches", std::int64_t{-1});
      const auto& metrics = record.at("metrics");
      found = metrics.contains(metric) ? core::number_of(metrics.at(metric)) : std::nullopt;
    } catch (const nlohmann::json::exception&) {
      // a line cut short by a killed rank: the ones before it stand
    }
  }
  if (!found && !quiet) {
    core::log_warning("{} holds no validation of {}: the rung counts it last", trial.metrics_file(), metric);
  }
  last.metric = found.value_or(std::nan(""));
  return last;
}

// Every trial directory that records the search event that made it (TrialLayout::search_record)
// is a trial the log made, at that time: a log restored from an older copy, or cut short, would
// make the trial again and take its old checkpoints and metrics for new ones.
void check_trials_known(const core::ExperimentLayout& layout, const std::vector<Event>& events, const std::string& log) {
  std::map<int, std::string> created;
  for (const Event& e : events) {
    if (e.kind == Event::Kind::kCreated) created[e.trial] = e.time;
  }
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(layout.dir, ec)) {
    const std::string record = core::TrialLayout{entry.path().string()}.search_record();
    if (!core::TrialLayout::trial_of(entry.path().filename().string()) || !std::filesystem::exists(record, ec)) continue;
    const nlohmann::json made = core::read_json_file(record);
    const int trial = core::json_field(made, "trial", -1, record);
    const std::string time = core::json_field(made, "created", std::string(), record);
    const auto it = created.find(trial);
    if (it == created.end() || it->second != time) {
      throw search::SearchError(
          record + " says the search made trial " + std::to_string(trial) + " at " + time + ", but the search log " +
          log + (it == created.end() ? " does not know that trial" : " made it at " + it->second) +
          ": the log was cut short or restored from an older copy, and going on would train the trial again over its "
          "own checkpoints. Restore the log that made the trial, or run the search as a new experiment "
          "(--experiment DIR)");
    }
  }
}

// Under the log's lock: the next decision, its trial leased (its launcher lock held) and the
// decision appended. Trials whose lease is free while the log says they train were left by a
// worker that is gone.
struct Leased {
  Decision decision;
  core::UniqueFd lease;
  bool all_held = false;  // done, because every trial the search gave is held by another launcher
};
Leased decide(const search::EventLog& log, const search::AshaOptions& options, const core::ExperimentLayout& layout,
              std::optional<int> prefer, const std::string& worker, mode_t mode, const std::string& experiment_id) {
  auto locked = log.lock();
  const std::vector<Event> events = locked.read();
  check_trials_known(layout, events, log.path());
  const search::Asha asha = search::replay(options, events, log.path());
  std::map<int, core::UniqueFd> free;  // probed leases, held until the decision is made
  std::set<int> busy;                  // trials another launcher holds
  const auto running = [&](int trial) {
    if (free.count(trial) > 0) return false;
    if (busy.count(trial) > 0) return true;
    core::create_directories(layout.trial_dir(trial), mode);
    core::UniqueFd fd = detail::try_lock_trial(layout.trial_dir(trial));
    if (fd.get() < 0) {
      busy.insert(trial);
      return true;
    }
    free.emplace(trial, std::move(fd));
    return false;
  };
  Leased out;
  // A chosen trial whose lease another launcher still holds (`hpctrial run --trial`, or one
  // letting it go) is passed over: the search decides again without it.
  for (int tries = 0; tries <= asha.created() && out.lease.get() < 0; ++tries) {
    out.decision = asha.next(running, prefer);
    const Decision& d = out.decision;
    if (d.kind == Decision::Kind::kDone) return out;
    if (const auto it = free.find(d.trial); it != free.end()) {
      out.lease = std::move(it->second);
      free.erase(it);
    } else if (!running(d.trial)) {
      out.lease = std::move(free.at(d.trial));
      free.erase(d.trial);
    }
    if (out.lease.get() < 0 && prefer == d.trial) prefer.reset();
  }
  if (out.lease.get() < 0) {
    out.decision = Decision{};  // every candidate held by another launcher: nothing for this worker now
    out.all_held = true;
    return out;
  }
  const Decision& d = out.decision;
  std::vector<Event> decided;
  if (d.create) {
    decided.push_back(search::make_event(Event::Kind::kCreated, d.trial, 0));
    decided.back().bracket = d.bracket;
    decided.back().time = core::utc_now_iso();
  }
  decided.push_back(search::make_event(d.promote ? Event::Kind::kPromoted : Event::Kind::kStarted, d.trial, d.rung));
  locked.append(decided, worker);
  if (d.create) {
    // After the event: a worker that dies between the two leaves a trial the log knows.
    core::write_json_file(layout.trial(d.trial).search_record(),
                          {{"experiment_id", experiment_id}, {"trial", d.trial}, {"bracket", d.bracket},
                           {"created", decided.front().time}});
  }
  return out;
}

// The trial's last validation, refused when it lies past the end of the rung the log says the
// trial trains toward: the trial's directory holds another training than the log records (a
// log restored from an older copy), and going on would record a stale metric.
Validated check_trained_within(const core::ExperimentLayout& layout, const core::ExperimentConfig& config,
                               const search::EventLog& log, int trial, int rung, std::int64_t length,
                               bool quiet = false) {
  const Validated validated = last_validation(layout.trial(trial), config.searcher.metric, quiet);
  if (config.searcher.max_length.unit == core::LengthUnit::kBatches && validated.batches > length) {
    throw search::SearchError(
        layout.trial(trial).metrics_file() + ": the last validation of trial " + std::to_string(trial) +
        " is at batch " + std::to_string(validated.batches) + ", but rung " + std::to_string(rung) +
        " of the search log " + log.path() + " ends at batch " + std::to_string(length) + ": the trial's "
        "directory holds another training than the log records. Restore the log that made the trial, or run "
        "the search as a new experiment (--experiment DIR)");
  }
  return validated;
}

// Under the log's lock, once the trial's ranks ended: what its rung led to. The chief records
// the rung itself at the rung's end (and trains on when promoted in place: search_rungs.h); a
// trial that ended itself before (set_stop_requested) is recorded here with its last validation.
// The lease is let go before the log is, unless the trial goes on here (stop_once): a trial that
// waits for a promotion is free for the worker that promotes it.
search::RungRecorded after_training(const search::EventLog& log, const search::AshaOptions& options, const Decision& d,
                                    const core::ExperimentLayout& layout, const core::ExperimentConfig& config,
                                    const std::string& worker, core::UniqueFd& lease) {
  auto locked = log.lock();
  const search::Asha asha = search::replay(options, locked.read(), log.path());
  const search::TrialState& t = asha.trials().at(d.trial);
  search::RungRecorded recorded;
  if (t.training) {
    const std::int64_t length = search::training_length(asha, d.trial, log.path());
    const Validated validated = check_trained_within(layout, config, log, d.trial, t.rung, length);
    recorded = search::record_rung(locked, options, log.path(), d.trial, validated.metric, false, worker);
  } else {
    recorded.rung = t.rung;
    recorded.after = t.finished ? search::AfterRung::kFinish
                     : t.stopped ? search::AfterRung::kStop
                                 : search::AfterRung::kPause;
  }
  if (!(recorded.after == search::AfterRung::kContinue && options.stop_once)) lease = core::UniqueFd();
  return recorded;
}

// Appends `kind` (kFailed, kInvalid) for the trial at the rung the log says it trains toward.
void record_end(const search::EventLog& log, const search::AshaOptions& options, Event::Kind kind, int trial,
                const std::string& worker) {
  auto locked = log.lock();
  const search::Asha asha = search::replay(options, locked.read(), log.path());
  locked.append({search::make_event(kind, trial, asha.trials().at(trial).rung)}, worker);
}

// Before the worker takes a trial: a pause of its job (core::job_stop_reason, or PBS's URG), a
// warning (USR1, USR2: the time limit, a preemption) that came while it held none, or the job's end within the
// grace, which leaves no time for a trial. Empty: none. The warnings are taken (they are blocked:
// detail::hold_warning_signals), so that the next trial's launcher does not see them again.
std::string stop_between_trials(const core::ExperimentLayout& layout, const core::Allocation& allocation,
                                const core::ExperimentConfig& config) {
  std::string reason = core::job_stop_reason(layout, allocation);
  const auto grace = std::chrono::seconds(config.scheduler.preemption_grace_seconds);
  if (reason.empty() && allocation.end_time && std::chrono::system_clock::now() + grace >= *allocation.end_time) {
    reason = "deadline";
  }
  sigset_t warnings, pending;
  sigemptyset(&warnings);
  sigaddset(&warnings, SIGUSR1);
  sigaddset(&warnings, SIGUSR2);
  sigaddset(&warnings, SIGURG);
  if (::sigpending(&pending) != 0) return reason;
  if (sigismember(&pending, SIGUSR1) == 1 || sigismember(&pending, SIGUSR2) == 1 || sigismember(&pending, SIGURG) == 1) {
    const bool pause = sigismember(&pending, SIGURG) == 1;
    const timespec now{};
    while (::sigtimedwait(&warnings, nullptr, &now) > 0) {
    }
    if (reason.empty()) reason = pause ? "pause" : "preemption";
  }
  return reason;
}

// The worker stops holding no trial: its job goes back to the queue (held, for a pause) to be a
// worker again; nothing of the search is lost whatever happens to it.
int stop_worker(const std::string& reason, const core::Allocation& allocation, const core::ExperimentConfig& config,
                const LaunchOptions& options, const core::EnvSource& env, const core::CommandRunner& run) {
  const bool cancelled = reason == "cancel";
  core::log_info("search worker stopped ({}) between trials{}", reason,
                 !allocation.in_job() ? "" : cancelled ? "; its job ends" : "; it works on when the job runs again");
  if (!allocation.in_job()) return kExitStopped;
  if (cancelled) {  // `hpctrial cancel`: the job ends; the search's trials wait in its log
    core::clear_job_stop(core::ExperimentLayout{options.experiment_dir}, allocation.job_id);
    return kExitFinished;
  }
  // The SIGTERM of the requeue that follows, as the launcher's, waits for the hand-over to be said.
  detail::SignalFd held_back;
  core::clear_job_stop(core::ExperimentLayout{options.experiment_dir}, allocation.job_id);
  detail::hand_over_worker(scheduler(allocation.scheduler),
                           {allocation, config, options.experiment_dir, -1, reason == "pause", true, &env, run, {}});
  return kExitStopped;
}

}  // namespace

namespace {

// One worker's loop, its setting fixed once.
struct Worker {
  const LaunchOptions& options;
  const core::EnvSource& env;
  const core::CommandRunner& run;
  const core::ExperimentLayout layout;
  const core::ExperimentConfig& config;
  const search::AshaOptions& asha;
  const search::EventLog& log;
  const core::Allocation& allocation;
  const std::string name;  // in the log's events: detail::launcher_name

  // Trains the decided trial to its rung, and on (stop_once) while it goes on. Returns the
  // worker's exit code when it ends here; nullopt to ask the search again (`prefer` set to the
  // trial it would rather promote).
  std::optional<int> train(Decision d, core::UniqueFd& lease, std::optional<int>& prefer) const {
    for (bool same_trial = true; same_trial;) {
      core::log_info("search: {} trial {} to rung {} ({} {})", d.create ? "starting" : d.resume ? "taking over" : "promoting",
                     d.trial, d.rung, d.length, core::to_string(config.searcher.max_length.unit));
      LaunchOptions trial = options;
      trial.trial_id = d.trial;
      trial.write_config.reset();
      trial.max_length = core::Length{config.searcher.max_length.unit, d.length};
      trial.search_worker = name;
      detail::name_holder(lease, core::TrialLayout{layout.trial_dir(d.trial)}.launcher_lock(), allocation);
      if (allocation.in_job()) {
        // Recorded before the job's stop request is read again: a pause either finds the trial
        // here (and asks it to stop) or is seen now, before the trial starts.
        core::record_worker_trial(layout, allocation.job_id, d.trial);
        if (const std::string stop = core::job_stop_reason(layout, allocation); !stop.empty()) {
          lease = core::UniqueFd();  // taken over by the next worker, as decided
          core::record_worker_trial(layout, allocation.job_id, -1);
          return stop_worker(stop, allocation, config, options, env, run);
        }
      }
      // Before anything trains: a trial whose directory is past the rung is not the log's.
      check_trained_within(layout, config, log, d.trial, d.rung, d.length, /*quiet=*/true);
      const int code = launch(trial, env, run, &lease);
      if (allocation.in_job()) core::record_worker_trial(layout, allocation.job_id, -1);
      // Stopped (the trial's checkpoint is durable; a worker takes it over), aborted by a second
      // Ctrl-C, or ended before it could checkpoint in its grace (its last checkpoint stands): the
      // worker ends too, the trial left to be taken over.
      if (code == kExitStopped || code == kExitAborted || code == 128 + SIGTERM) {
        const std::string stop = core::job_stop_reason(layout, allocation);
        if (!stop.empty()) core::clear_job_stop(layout, allocation.job_id);
        return code == kExitStopped && stop == "cancel" ? kExitFinished : code;  // cancelled: the job ends
      }
      if (code == kExitInvalidHP || code != kExitFinished) {
        if (code == kExitInvalidHP) {
          core::log_info("search: trial {} reported its hyperparameters invalid; a new trial takes its place", d.trial);
        } else {
          core::log_error("search: trial {} failed (exit code {}); recorded, and the search goes on", d.trial, code);
        }
        record_end(log, asha, code == kExitInvalidHP ? Event::Kind::kInvalid : Event::Kind::kFailed, d.trial, name);
        lease = core::UniqueFd();
        prefer.reset();
        return std::nullopt;
      }
      const search::RungRecorded recorded = after_training(log, asha, d, layout, config, name, lease);
      const search::AfterRung after = recorded.after;
      core::log_info("search: trial {} ended at rung {}: {}", d.trial, recorded.rung,
                     after == search::AfterRung::kFinish ? "finished" : after == search::AfterRung::kStop ? "stopped"
                     : after == search::AfterRung::kPause ? "waits for a promotion" : "goes on");
      // stop_once: a trial that goes on is promoted already and stays leased.
      same_trial = after == search::AfterRung::kContinue && asha.stop_once;
      if (same_trial) {
        d.rung = recorded.rung + 1;
        d.length = recorded.next_length;
        d.create = d.resume = false;
        d.promote = true;
      }
      prefer = d.trial;
    }
    return std::nullopt;
  }
};

}  // namespace

int run_search_worker(const LaunchOptions& options, const core::EnvSource& env, const core::CommandRunner& run) {
  detail::hold_warning_signals();  // a warning before the first trial is kept for the worker to see
  const core::ExperimentLayout layout{options.experiment_dir};
  if (options.write_config) prepare_experiment(*options.write_config, layout.dir, options.update_code);
  const core::ExperimentConfig config = core::load_experiment_config({layout.config(), "", {}});
  if (!config.searcher.adaptive()) {
    throw ConfigError(layout.config() + ": searcher " + std::string(core::to_string(config.searcher.name)) +
                      " has no workers; its trials run by number (hpctrial launch --trial N)");
  }
  const search::AshaOptions asha = search::options_of(config);
  const std::string experiment_id = core::ensure_experiment_identity(layout, config.name).id;
  const search::EventLog log(layout.search_log(), layout.search_lock(), experiment_id, search::settings_of(asha));
  core::Allocation allocation = detect_allocation(env, run);
  // A job whose scheduler does not say when it ends ends scheduler.time_limit after the worker
  // started, not after each trial did.
  LaunchOptions each = options;
  if (allocation.in_job() && !allocation.end_time && config.scheduler.time_limit_seconds) {
    allocation.end_time = std::chrono::system_clock::now() + std::chrono::seconds(*config.scheduler.time_limit_seconds);
  }
  each.job_end = allocation.end_time;
  const Worker worker{each, env, run, layout, config, asha, log, allocation, detail::launcher_name(allocation)};
  const mode_t mode = config.checkpoint_storage.group_readable ? 0750 : 0700;
  std::optional<int> prefer;
  if (allocation.in_job()) core::record_worker_trial(layout, allocation.job_id, -1);  // a worker, between trials
  while (true) {
    if (const std::string stop = stop_between_trials(layout, allocation, config); !stop.empty()) {
      return stop_worker(stop, allocation, config, each, env, run);
    }
    Leased next = decide(log, asha, layout, prefer, worker.name, mode, experiment_id);
    if (next.decision.kind == Decision::Kind::kDone) {
      core::log_info("the search in {} has nothing left for this worker: {}", layout.dir,
                     next.all_held ? "each trial it could train is held by another launcher"
                                   : "every trial is created and none waits for a promotion");
      return kExitFinished;
    }
    if (const auto code = worker.train(next.decision, next.lease, prefer)) return *code;
  }
}

}  // namespace hpctrial::launcher
