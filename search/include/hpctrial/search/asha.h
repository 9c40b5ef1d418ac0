// Asynchronous successive halving (ASHA, arXiv:1810.05934) as Determined's `adaptive_asha` and
// `async_halving` searchers run it, without a process of its own: the search is an append-only
// log of events (search/event_log.h), every worker replays it and decides what to run next
// under the log's lock, and a trial that reaches a rung decides itself whether it goes on.
//
// A bracket is one ASHA of `rungs` rungs. Rung k of it ends at max_length / divisor^(rungs-1-k)
// (at least 1; the top rung at max_length), in the unit of max_length. Two ways to halve:
//   promotions (stop_once: false)  a trial stops at each rung; it is granted a promotion to the
//       next as Determined's asha.go grants it: when it arrives in the top floor(n / divisor) of
//       the n trials at that rung, or when an arrival makes that top one larger and it is the
//       best not yet granted there - at most one grant an arrival, and a grant sticks. A worker
//       takes the granted trials in the order they were granted, and resumes each from its
//       checkpoint. A failed trial ranks last; granted, it fails at the next rung at once.
//   A trial that reports its hyperparameters invalid (hpctrial::InvalidHP) leaves every rung, does
//   not count toward max_trials, and a new trial of its bracket takes its place.
//   stop_once: true                a trial that reaches a rung goes on at once if it stands in
//       the top max(floor(n / divisor), 1) of that rung so far, and is stopped for good if not.
// adaptive_asha runs several brackets (its `mode`, or `bracket_rungs`), most aggressive first;
// new trials go to the bracket with trials left and the fewest running for its share.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "hpctrial/core/error.h"
#include "hpctrial/core/experiment_config.h"

namespace hpctrial::search {

// A search log whose events do not follow from each other (edited, or of another search).
class SearchError : public Error {
 public:
  using Error::Error;
};

// The searcher's settings, in Determined's names and defaults.
struct AshaOptions {
  enum class Mode { kAggressive, kStandard, kConservative };
  std::int64_t max_length = 0;  // in the unit of searcher.max_length
  int max_trials = 1;
  int max_concurrent_trials = 16;
  double divisor = 4;
  bool stop_once = false;
  bool smaller_is_better = true;
  // adaptive_asha: `mode` and `max_rungs` make the brackets, unless `bracket_rungs` lists them.
  Mode mode = Mode::kStandard;
  int max_rungs = 5;
  std::vector<int> bracket_rungs;
  // async_halving: one bracket of `num_rungs` rungs (0: adaptive_asha).
  int num_rungs = 0;
};

// The options of an experiment's searcher (adaptive_asha or async_halving).
AshaOptions options_of(const core::ExperimentConfig& config);
// What a search keeps from its beginning to its end, as JSON text: max_length, divisor,
// stop_once, smaller_is_better and the brackets (rungs and trials). Not the workers' number.
std::string settings_of(const AshaOptions& options);

struct Bracket {
  int rungs = 1;
  int max_trials = 1;
  int max_concurrent_trials = 1;
};

// The brackets, most aggressive (most rungs) first; their max_trials add up to options.max_trials.
// Determined's makeBrackets: max_rungs capped so that the top rung can hold a trial (by
// max_length and by max_trials), trials shared for roughly equal compute per bracket.
std::vector<Bracket> make_brackets(const AshaOptions& options);
// Where each rung of a bracket of `rungs` ends.
std::vector<std::int64_t> rung_lengths(int rungs, double divisor, std::int64_t max_length);

// One line of the search log.
struct Event {
  enum class Kind {
    kSearch,    // the first line: the experiment the search belongs to
    kCreated,   // trial `trial` sampled, in bracket `bracket`
    kStarted,   // a worker trains `trial` to rung `rung` (from its checkpoint, if it has one)
    kRung,      // `trial` reached rung `rung` with `metric` (any double: NaN ranks last)
    kPromoted,  // `trial` goes on to rung `rung`
    kStopped,   // `trial` is stopped for good at rung `rung` (stop_once, or the search ended)
    kFinished,  // `trial` trained to max_length
    kFailed,    // `trial` failed past its restarts while training to rung `rung`
    kInvalid,   // `trial` reported its hyperparameters invalid (Determined's InvalidHP) at rung `rung`
  };
  Kind kind = Kind::kCreated;
  int trial = -1;
  int bracket = 0;
  int rung = 0;
  double metric = 0;
  std::string experiment_id;  // kSearch
  std::string settings;       // kSearch: the searcher's settings, as settings_of() writes them
  std::string worker;         // who appended it (job, host, pid), for people
  std::string time;           // UTC, ISO 8601
};
const char* to_string(Event::Kind kind);

// What a worker does next.
struct Decision {
  enum class Kind {
    kRun,   // train `trial` to rung `rung`, `length` units (a new trial when `create`)
    kDone,  // nothing left for a worker: every trial is created and none is promotable
  };
  Kind kind = Kind::kDone;
  int trial = -1;
  int bracket = 0;
  int rung = 0;
  std::int64_t length = 0;
  bool create = false;  // append kCreated and kStarted; otherwise kStarted or kPromoted
  bool resume = false;  // the trial was left half-way by a worker that is gone: start it again
  bool promote = false;
};

// What a trial that reached a rung does.
enum class AfterRung { kContinue, kPause, kStop, kFinish };

// A trial's standing, replayed from the log.
struct TrialState {
  int trial = -1;
  int bracket = 0;
  int rung = 0;          // the rung it trains toward, or reached last
  bool training = false;  // started or promoted, the rung not reached yet
  bool promoted = false;  // promoted past `rung` (while training: to it)
  bool stopped = false, finished = false, failed = false, invalid = false;
  // Promoted past `rung` by the rungs' rule, and not taken yet (no kPromoted); `grant` orders them.
  bool granted = false;
  std::int64_t grant = -1;
  // stop_once: the rung was reached and its decision (promoted or stopped) not logged yet; a log
  // that ends there (its worker died between the two) leaves the trial stopped.
  bool stop_pending = false;
  std::vector<double> metrics;  // by rung reached
  bool ended() const { return stopped || stop_pending || finished || failed || invalid; }
};

// The search replayed from its events: the same events, in the same order, give the same state
// and the same decisions.
class Asha {
 public:
  explicit Asha(AshaOptions options);

  // SearchError for an event that does not follow from the ones before.
  void apply(const Event& event);

  // What a worker does next. `running(trial)` says whether a worker holds a trial now (its lease);
  // a trial left training by a worker that is gone is taken over first, and a trial held is never
  // chosen. With `prefer` (the trial
  // the asking worker just brought to a rung), that trial is taken when it is promotable.
  Decision next(const std::function<bool(int trial)>& running, std::optional<int> prefer = std::nullopt) const;
  // Whether `trial`, which just reached rung `rung` (its kRung applied), goes on at once, waits
  // for a promotion, is stopped (stop_once) or has finished (the top rung).
  AfterRung after_rung(int trial, int rung) const;

  const AshaOptions& options() const { return options_; }
  const std::vector<Bracket>& brackets() const { return brackets_; }
  std::int64_t length(int bracket, int rung) const;
  const std::map<int, TrialState>& trials() const { return trials_; }
  int created() const { return static_cast<int>(trials_.size()); }
  // The trials reported invalid: they do not count toward max_trials, up to max_trials of them.
  int invalid() const { return invalid_; }
  // The trials that reached rung `rung` of `bracket`, best first: (trial, metric).
  std::vector<std::pair<int, double>> standings(int bracket, int rung) const;

 private:
  struct Arrival {
    int trial;
    double metric;       // NaN for a failure
    std::int64_t order;  // when it arrived: earlier ranks first among equals
    bool granted;        // Determined's trialMetric.Promoted
  };
  bool better(const Arrival& a, const Arrival& b) const;
  const std::vector<Arrival>& ranked(int bracket, int rung) const;  // best first
  std::optional<Decision> promotion(std::optional<int> prefer, const std::function<bool(int)>& running) const;
  std::optional<Decision> new_trial(const std::function<bool(int)>& running) const;
  // `t` arrives at its rung `t.rung` with `metric` (a failure: NaN), and the rung grants a
  // promotion if one is due.
  void arrive(TrialState& t, double metric);
  void grant(TrialState& t);
  void invalidate(TrialState& t);

  AshaOptions options_;
  std::vector<Bracket> brackets_;
  std::vector<std::vector<std::int64_t>> lengths_;  // by bracket, by rung
  std::map<int, TrialState> trials_;
  // By bracket, by rung: the trials that reached it, best first (among equals, by arrival).
  std::vector<std::vector<std::vector<Arrival>>> rungs_;
  std::int64_t arrivals_ = 0;
  std::int64_t grants_ = 0;
  int invalid_ = 0;
  std::vector<int> owed_;  // by bracket: trials reported invalid and not replaced yet
  std::set<int> uncounted_;  // trials reported invalid that do not count toward max_trials
  bool has_search_ = false;
};

}  // namespace hpctrial::search
