// An adaptive search's worker: the "what next?" loop over the search log (search/event_log.h),
// each trial run by launch() to its rung.
#include <signal.h>
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <map>
#include <set>
#include <nlohmann/json.hpp>

#include "hpctrial/core/error.h"
#include "hpctrial/core/experiment_dir.h"
#include "hpctrial/core/json_file.h"
#include "hpctrial/core/logging.h"
#include "hpctrial/launcher/launcher.h"
#include "hpctrial/search/event_log.h"
#include "launcher_internal.h"

namespace hpctrial::launcher {
namespace {

using search::Decision;
using search::Event;

Event event(Event::Kind kind, int trial, int rung, int bracket = 0, double metric = 0) {
  Event e;
  e.kind = kind;
  e.trial = trial;
  e.rung = rung;
  e.bracket = bracket;
  e.metric = metric;
  return e;
}

// The searcher metric of the trial's last validation (metrics.jsonl); NaN, which ranks last,
// when it has none.
double last_metric(const core::TrialLayout& trial, const std::string& metric) {
  std::ifstream in(trial.metrics_file());
  std::optional<double> found;
  for (std::string line; std::getline(in, line);) {
    try {
      const auto record = nlohmann::json::parse(line);
      if (record.value("kind", "") != "validation" || !record.contains("metrics")) continue;
      const auto& metrics = record.at("metrics");
      if (metrics.contains(metric)) found = core::number_of(metrics.at(metric));
    } catch (const nlohmann::json::exception&) {
      // a line cut short by a killed rank: the ones before it stand
    }
  }
  if (!found) core::log_warning("{} holds no validation of {}: the rung counts it last", trial.metrics_file(), metric);
  return found.value_or(std::nan(""));
}

// Under the log's lock: the next decision, its trial leased (its launcher lock held) and the
// decision appended. Trials whose lease is free while the log says they train were left by a
// worker that is gone.
struct Leased {
  Decision decision;
  core::UniqueFd lease;
};
Leased decide(const search::EventLog& log, const search::AshaOptions& options, const core::ExperimentLayout& layout,
              std::optional<int> prefer, const std::string& worker, mode_t mode) {
  auto locked = log.lock();
  const search::Asha asha = search::replay(options, locked.read(), log.path());
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
    return out;
  }
  const Decision& d = out.decision;
  std::vector<Event> events;
  if (d.create) events.push_back(event(Event::Kind::kCreated, d.trial, 0, d.bracket));
  events.push_back(event(d.promote ? Event::Kind::kPromoted : Event::Kind::kStarted, d.trial, d.rung));
  locked.append(events, worker);
  return out;
}

// Under the log's lock: the rung the trial reached, and (stop_once, or the top rung) what follows
// from it, appended together. Returns what the trial does next. The lease is let go before the
// log is, unless the trial goes on here (stop_once): a trial that waits for a promotion is free
// for the worker that promotes it.
search::AfterRung record_rung(const search::EventLog& log, const search::AshaOptions& options, const Decision& d,
                              double metric, const std::string& worker, core::UniqueFd& lease) {
  auto locked = log.lock();
  search::Asha asha = search::replay(options, locked.read(), log.path());
  std::vector<Event> events = {event(Event::Kind::kRung, d.trial, d.rung, 0, metric)};
  asha.apply(events.front());
  const search::AfterRung after = asha.after_rung(d.trial, d.rung);
  if (after == search::AfterRung::kFinish) events.push_back(event(Event::Kind::kFinished, d.trial, d.rung));
  if (after == search::AfterRung::kStop) events.push_back(event(Event::Kind::kStopped, d.trial, d.rung));
  if (after == search::AfterRung::kContinue && options.stop_once) {
    events.push_back(event(Event::Kind::kPromoted, d.trial, d.rung + 1));
  }
  locked.append(events, worker);
  if (!(after == search::AfterRung::kContinue && options.stop_once)) lease = core::UniqueFd();
  return after;
}

}  // namespace

int run_search_worker(const LaunchOptions& options, const core::EnvSource& env, const core::CommandRunner& run) {
  const core::ExperimentLayout layout{options.experiment_dir};
  if (options.write_config) {
    core::create_directories(layout.dir, options.write_config->checkpoint_storage.group_readable ? 0750 : 0700);
    prepare_experiment(*options.write_config, layout.dir);
  }
  const core::ExperimentConfig config = core::load_experiment_config({layout.config(), "", {}});
  if (!config.searcher.adaptive()) {
    throw ConfigError(layout.config() + ": searcher " + std::string(core::to_string(config.searcher.name)) +
                      " has no workers; its trials run by number (hpctrial launch --trial N)");
  }
  const search::AshaOptions asha = search::options_of(config);
  const search::EventLog log(layout.search_log(), layout.search_lock(),
                             core::ensure_experiment_identity(layout, config.name).id, search::settings_of(asha));
  const std::string worker = detail::launcher_name(detect_allocation(env, run));
  const mode_t mode = config.checkpoint_storage.group_readable ? 0750 : 0700;
  std::optional<int> prefer;
  while (true) {
    Leased next = decide(log, asha, layout, prefer, worker, mode);
    Decision d = next.decision;
    if (d.kind == Decision::Kind::kDone) {
      core::log_info("the search in {} has nothing left for this worker: every trial is created and none waits "
                     "for a promotion", layout.dir);
      return kExitFinished;
    }
    for (bool same_trial = true; same_trial;) {
      core::log_info("search: {} trial {} to rung {} ({} {})", d.create ? "starting" : d.resume ? "taking over" : "promoting",
                     d.trial, d.rung, d.length, core::to_string(config.searcher.max_length.unit));
      LaunchOptions trial = options;
      trial.trial_id = d.trial;
      trial.write_config.reset();
      trial.max_length = core::Length{config.searcher.max_length.unit, d.length};
      detail::name_holder(next.lease, core::TrialLayout{layout.trial_dir(d.trial)}.launcher_lock(),
                          detect_allocation(env, run));
      const int code = launch(trial, env, run, &next.lease);
      // Stopped (the trial's checkpoint is durable; a worker takes it over), aborted by a second
      // Ctrl-C, or ended before it could checkpoint in its grace (its last checkpoint stands): the
      // worker ends too, the trial left to be taken over.
      if (code == kExitStopped || code == kExitAborted || code == 128 + SIGTERM) return code;
      if (code != kExitFinished) {
        core::log_error("search: trial {} failed (exit code {}); recorded, and the search goes on", d.trial, code);
        auto locked = log.lock();
        locked.append({event(Event::Kind::kFailed, d.trial, d.rung)}, worker);
        next.lease = core::UniqueFd();
        prefer.reset();
        break;
      }
      const double metric = last_metric(layout.trial(d.trial), config.searcher.metric);
      const search::AfterRung after = record_rung(log, asha, d, metric, worker, next.lease);
      core::log_info("search: trial {} reached rung {} with {} {}: {}", d.trial, d.rung, config.searcher.metric, metric,
                     after == search::AfterRung::kFinish ? "finished" : after == search::AfterRung::kStop ? "stopped"
                     : after == search::AfterRung::kPause ? "waits for a promotion" : "goes on");
      // stop_once: a trial that goes on is promoted already and stays leased.
      same_trial = after == search::AfterRung::kContinue && asha.stop_once;
      if (same_trial) {
        d.rung += 1;
        const auto brackets = search::make_brackets(asha);
        d.length = search::rung_lengths(brackets.at(static_cast<std::size_t>(d.bracket)).rungs, asha.divisor,
                                        asha.max_length)
                       .at(static_cast<std::size_t>(d.rung));
        d.create = d.resume = false;
        d.promote = true;
      }
      prefer = d.trial;
    }
  }
}

}  // namespace hpctrial::launcher
