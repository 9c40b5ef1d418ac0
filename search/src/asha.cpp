#include "hpctrial/search/asha.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include <nlohmann/json.hpp>
#include <numeric>


namespace hpctrial::search {
namespace {

// int(log(x) / log(divisor)) + 1, a power of the divisor counting as one (log(1000) / log(10)
// is 2.9999999999999996 in doubles).
int rungs_that_fit(double x, double divisor) {
  return static_cast<int>(std::floor(std::log(x) / std::log(divisor) + 1e-9)) + 1;
}

std::vector<int> bracket_rungs_of(const AshaOptions& o) {
  if (o.num_rungs > 0) return {o.num_rungs};
  if (!o.bracket_rungs.empty()) return o.bracket_rungs;
  // The top rung must be able to hold a trial: no more rungs than max_length and max_trials allow.
  const int max_rungs = std::max(1, std::min({o.max_rungs, rungs_that_fit(static_cast<double>(o.max_length), o.divisor),
                                              rungs_that_fit(o.max_trials, o.divisor)}));
  std::vector<int> out;
  switch (o.mode) {
    case AshaOptions::Mode::kAggressive:
      out = {max_rungs};
      break;
    case AshaOptions::Mode::kStandard:
      for (int i = (max_rungs - 1) / 2 + 1; i <= max_rungs; ++i) out.push_back(i);
      break;
    case AshaOptions::Mode::kConservative:
      for (int i = 1; i <= max_rungs; ++i) out.push_back(i);
      break;
  }
  return out;
}

}  // namespace

const char* to_string(Event::Kind kind) {
  switch (kind) {
    case Event::Kind::kSearch: return "search";
    case Event::Kind::kCreated: return "created";
    case Event::Kind::kStarted: return "started";
    case Event::Kind::kRung: return "rung";
    case Event::Kind::kPromoted: return "promoted";
    case Event::Kind::kStopped: return "stopped";
    case Event::Kind::kFinished: return "finished";
    case Event::Kind::kFailed: return "failed";
    case Event::Kind::kInvalid: return "invalid_hp";
  }
  return "?";
}

AshaOptions options_of(const core::ExperimentConfig& config) {
  const core::Searcher& s = config.searcher;
  AshaOptions o;
  o.max_length = s.max_length.value;
  o.max_trials = static_cast<int>(s.max_trials);
  o.max_concurrent_trials = static_cast<int>(s.max_concurrent_trials);
  o.divisor = s.divisor;
  o.stop_once = s.stop_once;
  o.smaller_is_better = s.smaller_is_better;
  o.mode = s.mode == core::Searcher::Mode::kAggressive ? AshaOptions::Mode::kAggressive
           : s.mode == core::Searcher::Mode::kStandard ? AshaOptions::Mode::kStandard
                                                       : AshaOptions::Mode::kConservative;
  o.max_rungs = s.max_rungs;
  o.bracket_rungs = s.bracket_rungs;
  o.num_rungs = s.name == core::Searcher::Name::kAsyncHalving ? s.num_rungs : 0;
  return o;
}

std::string settings_of(const AshaOptions& o) {
  nlohmann::json brackets = nlohmann::json::array();
  for (const auto& b : make_brackets(o)) brackets.push_back({b.rungs, b.max_trials});
  return nlohmann::json({{"brackets", brackets},
                         {"divisor", o.divisor},
                         {"max_length", o.max_length},
                         {"smaller_is_better", o.smaller_is_better},
                         {"stop_once", o.stop_once}})
      .dump();
}

std::vector<std::int64_t> rung_lengths(int rungs, double divisor, std::int64_t max_length) {
  std::vector<std::int64_t> out;
  for (int k = 0; k < rungs; ++k) {
    const double downsampling = std::pow(divisor, rungs - k - 1);
    out.push_back(std::max<std::int64_t>(static_cast<std::int64_t>(static_cast<double>(max_length) / downsampling), 1));
  }
  return out;
}

std::vector<Bracket> make_brackets(const AshaOptions& o) {
  std::vector<int> rungs = bracket_rungs_of(o);
  // Brackets that stop more trials early first: they speed the search up soonest.
  std::sort(rungs.begin(), rungs.end(), std::greater<>());
  // Roughly equal compute per bracket: a bracket of r rungs evaluates divisor^(r-1) trials in
  // about r x max_length.
  std::vector<double> weights;
  for (const int r : rungs) weights.push_back(std::pow(o.divisor, r - 1) / r);
  const double total = std::accumulate(weights.begin(), weights.end(), 0.0);
  std::vector<Bracket> out;
  int allocated = 0;
  for (std::size_t i = 0; i < rungs.size(); ++i) {
    Bracket b;
    b.rungs = rungs[i];
    b.max_trials = std::max(static_cast<int>(weights[i] / total * o.max_trials), 1);
    allocated += b.max_trials;
    out.push_back(b);
  }
  out[0].max_trials += std::max(o.max_trials - allocated, 0);
  // Determined gives every bracket a trial, which can make more than max_trials: the least
  // aggressive brackets give theirs back, and a bracket left with none is dropped.
  for (std::size_t i = out.size(); allocated > o.max_trials && i-- > 1;) {
    while (allocated > o.max_trials && out[i].max_trials > 0) {
      --out[i].max_trials;
      --allocated;
    }
    if (out[i].max_trials == 0) out.erase(out.begin() + static_cast<std::ptrdiff_t>(i));
  }
  // max_concurrent_trials shared evenly, the remainder to the most aggressive brackets.
  const int brackets = static_cast<int>(out.size());
  const int concurrent = std::max(o.max_concurrent_trials, brackets);
  for (int i = 0; i < brackets; ++i) out[i].max_concurrent_trials = concurrent / brackets + (i < concurrent % brackets ? 1 : 0);
  return out;
}

Asha::Asha(AshaOptions options) : options_(std::move(options)), brackets_(make_brackets(options_)) {
  for (const auto& b : brackets_) {
    lengths_.push_back(rung_lengths(b.rungs, options_.divisor, options_.max_length));
    rungs_.emplace_back(static_cast<std::size_t>(b.rungs));
  }
  owed_.assign(brackets_.size(), 0);
}

std::int64_t Asha::length(int bracket, int rung) const {
  return lengths_.at(static_cast<std::size_t>(bracket)).at(static_cast<std::size_t>(rung));
}

// Better first: a smaller (or, with smaller_is_better false, larger) metric; NaN last; among
// equals, the one that arrived first.
bool Asha::better(const Arrival& a, const Arrival& b) const {
  const bool a_nan = std::isnan(a.metric), b_nan = std::isnan(b.metric);
  if (a_nan != b_nan) return b_nan;
  if (!a_nan && a.metric != b.metric) return options_.smaller_is_better ? a.metric < b.metric : a.metric > b.metric;
  return a.order < b.order;
}

const std::vector<Asha::Arrival>& Asha::ranked(int bracket, int rung) const {
  return rungs_.at(static_cast<std::size_t>(bracket)).at(static_cast<std::size_t>(rung));
}

std::vector<std::pair<int, double>> Asha::standings(int bracket, int rung) const {
  std::vector<std::pair<int, double>> out;
  for (const auto& a : ranked(bracket, rung)) out.emplace_back(a.trial, a.metric);
  return out;
}

void Asha::apply(const Event& e) {
  const auto wrong = [&](const std::string& why) {
    return SearchError(std::string("a '") + to_string(e.kind) + "' event of trial " + std::to_string(e.trial) +
                           " " + why);
  };
  if (e.kind == Event::Kind::kSearch) {
    if (has_search_ || !trials_.empty()) throw wrong("comes after the search began");
    has_search_ = true;
    return;
  }
  if (e.kind == Event::Kind::kCreated) {
    if (e.trial != created()) throw wrong("is out of order: the next trial is " + std::to_string(created()));
    if (e.bracket < 0 || e.bracket >= static_cast<int>(brackets_.size())) {
      throw wrong("names bracket " + std::to_string(e.bracket) + " of " + std::to_string(brackets_.size()));
    }
    TrialState t;
    t.trial = e.trial;
    t.bracket = e.bracket;
    trials_[e.trial] = t;
    int& owed = owed_[static_cast<std::size_t>(e.bracket)];
    owed = std::max(0, owed - 1);
    return;
  }
  const auto it = trials_.find(e.trial);
  if (it == trials_.end()) throw wrong("names a trial that was never created");
  TrialState& t = it->second;
  const int top = brackets_[static_cast<std::size_t>(t.bracket)].rungs - 1;
  if (e.rung < 0 || e.rung > top) throw wrong("names rung " + std::to_string(e.rung) + " past the bracket's");
  switch (e.kind) {
    case Event::Kind::kStarted:
      if (e.rung != t.rung || t.ended() || static_cast<int>(t.metrics.size()) != t.rung) {
        throw wrong("does not continue the trial");
      }
      t.training = true;
      break;
    case Event::Kind::kRung:
      if (!t.training || e.rung != t.rung) throw wrong("reaches a rung the trial was not training toward");
      t.training = false;
      arrive(t, e.metric);
      if (e.rung == top) t.finished = true;
      // With stop_once a rung's decision is appended with it; a log that ends between the two
      // (the worker died) leaves the trial stopped.
      if (options_.stop_once && e.rung < top) t.stop_pending = true;
      break;
    case Event::Kind::kPromoted:
      if (t.training || e.rung != t.rung + 1 || static_cast<int>(t.metrics.size()) != e.rung || t.failed ||
          t.stopped || t.finished) {
        throw wrong("promotes a trial that has not reached rung " + std::to_string(e.rung - 1) + ", or has ended");
      }
      t.rung = e.rung;
      t.training = true;
      t.stop_pending = false;
      t.granted = false;
      break;
    case Event::Kind::kStopped:
      t.stopped = true;
      t.stop_pending = false;
      t.training = false;
      break;
    case Event::Kind::kFinished:
      t.finished = true;
      break;
    case Event::Kind::kFailed:
      // Determined's trialExitedEarly: the worst value at the rung it trained toward, so that the
      // rung's counts move on (asha.go 326).
      t.failed = true;
      if (t.training) {
        t.training = false;
        arrive(t, std::nan(""));
      }
      break;
    case Event::Kind::kInvalid:
      if (!t.training) throw wrong("reports a trial invalid that is not training");
      invalidate(t);
      break;
    default:
      break;
  }
}

// Determined's promotionsAsync (asha.go 90-127): of the n trials at the rung before this one,
// floor(n / divisor) are due a promotion; the newcomer is granted one if it ranks within the top
// floor((n + 1) / divisor), and otherwise, if that number grew, the trial at its old edge is,
// unless granted already. Ranks as better(): NaN and failures last, among equals by arrival
// (Determined's sort.Search places a newcomer after equals, and a NaN where its comparisons fall).
void Asha::arrive(TrialState& t, double metric) {
  t.metrics.push_back(metric);
  // Each rung's arrivals are kept best first: the newcomer goes after every one better or equal.
  auto& rung = rungs_[static_cast<std::size_t>(t.bracket)][static_cast<std::size_t>(t.rung)];
  const Arrival mine{t.trial, metric, arrivals_++, false};
  const int n = static_cast<int>(rung.size());
  const auto at = rung.insert(
      std::upper_bound(rung.begin(), rung.end(), mine, [this](const Arrival& a, const Arrival& b) { return better(a, b); }),
      mine);
  const int top = brackets_[static_cast<std::size_t>(t.bracket)].rungs - 1;
  if (options_.stop_once || t.rung == top) return;
  const int was_due = static_cast<int>(static_cast<double>(n) / options_.divisor);
  const int due = static_cast<int>(static_cast<double>(n + 1) / options_.divisor);
  Arrival* chosen = nullptr;
  if (at - rung.begin() < due) {
    chosen = &*at;
  } else if (due != was_due && !rung[static_cast<std::size_t>(was_due)].granted) {
    chosen = &rung[static_cast<std::size_t>(was_due)];
  }
  if (chosen == nullptr) return;
  chosen->granted = true;
  grant(trials_.at(chosen->trial));
}

// Determined's InvalidHP (asha.go 296-322): out of every rung, not counted, replaced by a new
// trial of its bracket. Promotions it caused stand, as Determined's flags do.
void Asha::invalidate(TrialState& t) {
  t.invalid = true;
  t.training = t.granted = false;
  for (auto& rung : rungs_[static_cast<std::size_t>(t.bracket)]) {
    rung.erase(std::remove_if(rung.begin(), rung.end(), [&](const Arrival& a) { return a.trial == t.trial; }),
               rung.end());
  }
  // As many replaced as max_trials at most: a space where most samples are invalid ends.
  if (++invalid_ <= options_.max_trials) {
    ++owed_[static_cast<std::size_t>(t.bracket)];
    uncounted_.insert(t.trial);
  }
}

// A granted trial waits for a worker; a failed one fails at the next rung at once, as Determined's
// promoteAsync does for an early-exited trial (asha.go 223-229).
void Asha::grant(TrialState& t) {
  if (!t.failed) {
    t.granted = true;
    t.grant = grants_++;
    return;
  }
  t.rung += 1;
  arrive(t, std::nan(""));
}

AfterRung Asha::after_rung(int trial, int rung) const {
  const TrialState& t = trials_.at(trial);
  const Bracket& b = brackets_[static_cast<std::size_t>(t.bracket)];
  if (rung == b.rungs - 1) return AfterRung::kFinish;
  if (options_.stop_once) {
    const auto all = ranked(t.bracket, rung);
    const int top = static_cast<int>(static_cast<double>(all.size()) / options_.divisor);
    // Determined's asha_stopping: the trial is placed before those equal to it.
    const Arrival* mine = nullptr;
    for (const auto& a : all) {
      if (a.trial == trial) mine = &a;
    }
    int ahead = 0;
    for (const auto& a : all) {
      if (a.trial != trial && better(a, *mine) && !(a.metric == mine->metric)) ++ahead;
    }
    return ahead < std::max(top, 1) ? AfterRung::kContinue : AfterRung::kStop;
  }
  return t.granted && t.rung == rung ? AfterRung::kContinue : AfterRung::kPause;
}

// The granted trial the asking worker brought to its rung (`prefer`), else the one granted
// first: Determined hands its promotions out in the order the rungs grant them.
std::optional<Decision> Asha::promotion(std::optional<int> prefer, const std::function<bool(int)>& running) const {
  if (options_.stop_once) return std::nullopt;
  const auto promotable = [&](const TrialState& t) {
    return t.granted && !t.training && !t.ended() && static_cast<int>(t.metrics.size()) == t.rung + 1 &&
           !running(t.trial);
  };
  const TrialState* chosen = nullptr;
  if (prefer && promotable(trials_.at(*prefer))) {
    chosen = &trials_.at(*prefer);
  } else {
    for (const auto& [id, t] : trials_) {
      if (promotable(t) && (chosen == nullptr || t.grant < chosen->grant)) chosen = &t;
    }
  }
  if (chosen == nullptr) return std::nullopt;
  Decision d;
  d.kind = Decision::Kind::kRun;
  d.trial = chosen->trial;
  d.bracket = chosen->bracket;
  d.rung = chosen->rung + 1;
  d.length = length(chosen->bracket, chosen->rung + 1);
  d.promote = true;
  return d;
}

// The next trial to sample, in the first bracket with trials left and room under its share of
// the workers (else the first with trials left).
std::optional<Decision> Asha::new_trial(const std::function<bool(int)>& running) const {
  std::vector<int> made(brackets_.size(), 0), busy(brackets_.size(), 0);
  for (const auto& [id, t] : trials_) {
    if (uncounted_.count(id) == 0) ++made[static_cast<std::size_t>(t.bracket)];
    if (t.training && running(id)) ++busy[static_cast<std::size_t>(t.bracket)];
  }
  std::optional<int> chosen;
  // A trial reported invalid is replaced in its own bracket first, as Determined's bracket
  // searcher creates the replacement itself.
  for (int b = 0; b < static_cast<int>(brackets_.size()) && !chosen; ++b) {
    if (owed_[static_cast<std::size_t>(b)] > 0) chosen = b;
  }
  for (int b = 0; b < static_cast<int>(brackets_.size()) && !chosen; ++b) {
    const Bracket& bracket = brackets_[static_cast<std::size_t>(b)];
    if (made[b] < bracket.max_trials && busy[b] < bracket.max_concurrent_trials) chosen = b;
  }
  for (int b = 0; b < static_cast<int>(brackets_.size()) && !chosen; ++b) {
    if (made[b] < brackets_[static_cast<std::size_t>(b)].max_trials) chosen = b;
  }
  if (!chosen) return std::nullopt;
  Decision d;
  d.kind = Decision::Kind::kRun;
  d.trial = created();
  d.bracket = *chosen;
  d.rung = 0;
  d.length = length(*chosen, 0);
  d.create = true;
  return d;
}

Decision Asha::next(const std::function<bool(int trial)>& running, std::optional<int> prefer) const {
  // A trial left half-way by a worker that is gone (killed, preempted, requeued) goes on first;
  // so does one created by a worker that died before it could log the start.
  for (const auto& [id, t] : trials_) {
    const bool unstarted = !t.training && t.metrics.empty() && !t.ended();
    if ((t.training || unstarted) && !running(id)) {
      Decision d;
      d.kind = Decision::Kind::kRun;
      d.trial = id;
      d.bracket = t.bracket;
      d.rung = t.rung;
      d.length = length(t.bracket, t.rung);
      d.resume = true;
      return d;
    }
  }
  if (auto d = promotion(prefer, running)) return *d;
  if (auto d = new_trial(running)) return *d;
  return {};
}

}  // namespace hpctrial::search
