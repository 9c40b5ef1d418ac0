// The asynchronous successive halving of adaptive_asha and async_halving against hand-worked
// cases: the brackets and rung lengths of each mode (Determined's formulas), promotions in the
// asynchronous order, stop_once, a worker's trial taken over, failures; a replay of the log gives
// the same decisions; and the log on disk: NaN and infinities round-trip, a torn last line is
// never read, another experiment's log is refused.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <random>
#include <set>

#include "hpctrial/search/asha.h"
#include "hpctrial/search/event_log.h"
#include "../../support/temp_dir.h"

namespace hpctrial::search {
namespace {

using testing::HasSubstr;

// An event as the workers append them.
Event ev(Event::Kind kind, int trial = -1, int bracket = 0, int rung = 0, double metric = 0) {
  Event e;
  e.kind = kind;
  e.trial = trial;
  e.bracket = bracket;
  e.rung = rung;
  e.metric = metric;
  return e;
}

std::vector<int> rungs_of(const std::vector<Bracket>& brackets) {
  std::vector<int> out;
  for (const auto& b : brackets) out.push_back(b.rungs);
  return out;
}
std::vector<int> trials_of(const std::vector<Bracket>& brackets) {
  std::vector<int> out;
  for (const auto& b : brackets) out.push_back(b.max_trials);
  return out;
}
std::vector<int> concurrency_of(const std::vector<Bracket>& brackets) {
  std::vector<int> out;
  for (const auto& b : brackets) out.push_back(b.max_concurrent_trials);
  return out;
}

// max_length 256, divisor 4, max_rungs 5, 64 trials: 256 allows 5 rungs, 64 trials only 4
// (4^3 = 64 trials reach... the top rung holds one), so every mode works with 4.
AshaOptions sixty_four() {
  AshaOptions o;
  o.max_length = 256;
  o.max_trials = 64;
  o.max_concurrent_trials = 16;
  return o;
}

TEST(AshaBrackets, EachModeMakesDeterminedsBrackets) {
  AshaOptions o = sixty_four();
  o.mode = AshaOptions::Mode::kAggressive;
  auto b = make_brackets(o);
  EXPECT_EQ(rungs_of(b), (std::vector<int>{4}));
  EXPECT_EQ(trials_of(b), (std::vector<int>{64}));
  EXPECT_EQ(concurrency_of(b), (std::vector<int>{16}));

  // standard: rungs (4 - 1) / 2 + 1 = 2 to 4; weights 4^3/4 = 16, 4^2/3, 4/2: 43.9, 14.6, 5.5
  // trials, rounded down, the 2 left to the first; 16 workers, 6 + 5 + 5.
  o.mode = AshaOptions::Mode::kStandard;
  b = make_brackets(o);
  EXPECT_EQ(rungs_of(b), (std::vector<int>{4, 3, 2}));
  EXPECT_EQ(trials_of(b), (std::vector<int>{45, 14, 5}));
  EXPECT_EQ(concurrency_of(b), (std::vector<int>{6, 5, 5}));

  o.mode = AshaOptions::Mode::kConservative;
  b = make_brackets(o);
  EXPECT_EQ(rungs_of(b), (std::vector<int>{4, 3, 2, 1}));
  EXPECT_EQ(trials_of(b), (std::vector<int>{43, 14, 5, 2}));
  EXPECT_EQ(concurrency_of(b), (std::vector<int>{4, 4, 4, 4}));

  // bracket_rungs as given (sorted, most rungs first); async_halving's one bracket.
  o.bracket_rungs = {2, 3};
  o.divisor = 2;
  o.max_trials = 10;
  o.max_concurrent_trials = 1;  // at least one a bracket
  b = make_brackets(o);
  EXPECT_EQ(rungs_of(b), (std::vector<int>{3, 2}));
  EXPECT_EQ(trials_of(b), (std::vector<int>{6, 4}));
  EXPECT_EQ(concurrency_of(b), (std::vector<int>{1, 1}));
  o.num_rungs = 3;
  EXPECT_EQ(rungs_of(make_brackets(o)), (std::vector<int>{3}));
  EXPECT_EQ(trials_of(make_brackets(o)), (std::vector<int>{10}));
}

// Determined gives every bracket a trial even when max_trials is smaller than that makes
// (getBracketMaxTrials, master/pkg/searcher/adaptive_asha.go): here the least aggressive
// brackets give theirs back, so that the search makes max_trials trials at most.
TEST(AshaBrackets, TheBracketsMakeExactlyMaxTrials) {
  AshaOptions o = sixty_four();
  o.bracket_rungs = {3, 2, 1};
  o.max_trials = 2;  // weights 16/3, 2, 1: 1, 0 and 0 trials, each raised to 1 by Determined
  auto b = make_brackets(o);
  EXPECT_EQ(rungs_of(b), (std::vector<int>{3, 2}));
  EXPECT_EQ(trials_of(b), (std::vector<int>{1, 1}));
  // Weights 4^3/4 = 16, 4^2/3, 4/2, 1 (total 24.33) of 5 trials: 3.29, 1.10, 0.41, 0.21, rounded
  // down to 3, 1, 0, 0. Determined raises each to 1: 3, 1, 1, 1 - six trials.
  o.bracket_rungs = {4, 3, 2, 1};
  o.divisor = 4;
  o.max_trials = 5;
  b = make_brackets(o);
  EXPECT_EQ(rungs_of(b), (std::vector<int>{4, 3, 2}));
  EXPECT_EQ(trials_of(b), (std::vector<int>{3, 1, 1}));
}

// Determined caps the rungs at int(log(x) / log(divisor)) + 1 for max_length and max_trials
// (makeBrackets, master/pkg/searcher/adaptive_asha.go), which in doubles is one rung short on
// exact powers of the divisor: log(1000) / log(10) is 2.9999999999999996, so 1000 gets 3 rungs
// where 999 gets 3 and 1001 gets 4. hpctrial counts the rungs whose shortest still holds one
// unit: a power of the divisor counts as itself.
TEST(AshaBrackets, TheTopRungMustBeAbleToHoldATrial) {
  AshaOptions o = sixty_four();
  o.mode = AshaOptions::Mode::kAggressive;
  o.max_trials = 1000;  // 1000 = 10^3: 4 rungs of divisor 10 (Determined: 3)
  o.divisor = 10;
  o.max_length = 100000;
  EXPECT_EQ(rungs_of(make_brackets(o)), (std::vector<int>{4}));
  o.max_trials = 999;  // 2.9996: 3 rungs, as Determined
  EXPECT_EQ(rungs_of(make_brackets(o)), (std::vector<int>{3}));
  o.max_trials = 1001;  // 3.0004: 4 rungs, as Determined
  EXPECT_EQ(rungs_of(make_brackets(o)), (std::vector<int>{4}));
  o.max_rungs = 10;
  o.max_trials = 1000000;  // 10^6: 7 rungs (Determined: 5.999999999999999, 6)
  o.max_length = 100000000;
  EXPECT_EQ(rungs_of(make_brackets(o)), (std::vector<int>{7}));
  o.divisor = 3;
  o.max_trials = 243;  // 3^5: 6 rungs (Determined: 4.999999999999999, 5)
  EXPECT_EQ(rungs_of(make_brackets(o)), (std::vector<int>{6}));
  o.max_trials = 59049;  // 3^10: 11 rungs (Determined: 9.999999999999998, 10)
  o.max_rungs = 12;
  EXPECT_EQ(rungs_of(make_brackets(o)), (std::vector<int>{11}));
  o.max_trials = 1000;
  o.divisor = 10;
  o.max_rungs = 5;
  o.max_length = 50;  // 50 batches: 2 rungs (5 and 50)
  EXPECT_EQ(rungs_of(make_brackets(o)), (std::vector<int>{2}));
  EXPECT_EQ(rung_lengths(2, 10, 50), (std::vector<std::int64_t>{5, 50}));
}

TEST(AshaBrackets, RungsEndAtMaxLengthDividedByTheDivisorPerRungLeft) {
  EXPECT_EQ(rung_lengths(4, 4, 256), (std::vector<std::int64_t>{4, 16, 64, 256}));
  EXPECT_EQ(rung_lengths(3, 4, 256), (std::vector<std::int64_t>{16, 64, 256}));
  EXPECT_EQ(rung_lengths(3, 3, 100), (std::vector<std::int64_t>{11, 33, 100}));
  EXPECT_EQ(rung_lengths(5, 4, 100), (std::vector<std::int64_t>{1, 1, 6, 25, 100}));  // at least 1
  EXPECT_EQ(rung_lengths(1, 4, 100), (std::vector<std::int64_t>{100}));
}

// A search driven as its workers drive it, the log kept alongside.
struct Search {
  explicit Search(AshaOptions o) : asha(std::move(o)) { log(ev(Event::Kind::kSearch)); }
  void log(Event e) {
    e.experiment_id = e.kind == Event::Kind::kSearch ? "exp" : "";
    asha.apply(e);
    events.push_back(e);
  }
  Decision ask(std::optional<int> prefer = std::nullopt) const {
    return asha.next([this](int trial) { return running.count(trial) > 0; }, prefer);
  }
  // What a worker appends for its decision.
  void take(const Decision& d) {
    ASSERT_EQ(d.kind, Decision::Kind::kRun);
    if (d.create) log(ev(Event::Kind::kCreated, d.trial, d.bracket));
    log(ev(d.promote ? Event::Kind::kPromoted : Event::Kind::kStarted, d.trial, 0, d.rung));
    running.insert(d.trial);
  }
  // The trial validated at the end of its rung.
  AfterRung reach(int trial, double metric) {
    Event e = ev(Event::Kind::kRung, trial, 0, asha.trials().at(trial).rung, metric);
    log(e);
    running.erase(trial);
    return asha.after_rung(trial, e.rung);
  }
  Asha asha;
  std::vector<Event> events;
  std::set<int> running;
};

// async_halving, 3 rungs of divisor 2 over 8 batches: rungs end at 2, 4 and 8.
AshaOptions halving(bool stop_once) {
  AshaOptions o;
  o.max_length = 8;
  o.max_trials = 8;
  o.max_concurrent_trials = 2;
  o.divisor = 2;
  o.num_rungs = 3;
  o.stop_once = stop_once;
  return o;
}

Decision expect_run(const Decision& d, int trial, int rung, bool create, bool promote) {
  EXPECT_EQ(d.kind, Decision::Kind::kRun);
  EXPECT_EQ(d.trial, trial);
  EXPECT_EQ(d.rung, rung);
  EXPECT_EQ(d.create, create);
  EXPECT_EQ(d.promote, promote);
  return d;
}

TEST(Asha, PromotesAsynchronouslyTheTopOfEachRungAsTrialsArrive) {
  Search s(halving(false));
  EXPECT_EQ(s.asha.length(0, 0), 2);
  s.take(expect_run(s.ask(), 0, 0, true, false));
  s.take(expect_run(s.ask(), 1, 0, true, false));
  // Trial 0 first at rung 0: 1 trial there, floor(1 / 2) = 0 promoted: it waits.
  EXPECT_EQ(s.reach(0, 0.5), AfterRung::kPause);
  // Its worker takes a new trial.
  s.take(expect_run(s.ask(0), 2, 0, true, false));
  // Trial 1 better: 2 there, the top 1 goes on, and it is trial 1 itself.
  EXPECT_EQ(s.reach(1, 0.3), AfterRung::kContinue);
  const Decision own = expect_run(s.ask(1), 1, 1, false, true);
  EXPECT_EQ(own.length, 4);
  s.take(own);
  // Trial 2 worse than both: 3 there, top 1 (trial 1, promoted): a new trial.
  EXPECT_EQ(s.reach(2, 0.9), AfterRung::kPause);
  s.take(expect_run(s.ask(2), 3, 0, true, false));
  // Trial 3: 4 there, top 2 = trials 1 and 3: goes on.
  EXPECT_EQ(s.reach(3, 0.4), AfterRung::kContinue);
  s.take(expect_run(s.ask(3), 3, 1, false, true));
  // Trial 1 at rung 1 alone: waits. Its worker starts trial 4.
  EXPECT_EQ(s.reach(1, 0.25), AfterRung::kPause);
  s.take(expect_run(s.ask(1), 4, 0, true, false));
  // Trial 4 the worst at rung 0: 5 there, top 2 promoted already. Trial 3 reaches rung 1: 2 there,
  // top 1 is trial 1 (0.25 < 0.35), which waited: the asynchronous promotion goes to trial 1,
  // from rung 1 to 2, before anything at rung 0.
  EXPECT_EQ(s.reach(4, 0.95), AfterRung::kPause);
  s.take(expect_run(s.ask(4), 5, 0, true, false));
  EXPECT_EQ(s.reach(3, 0.35), AfterRung::kPause);
  const Decision later = expect_run(s.ask(3), 1, 2, false, true);
  EXPECT_EQ(later.length, 8);
  s.take(later);
  // Trial 5 arrives worse than trial 0: 6 at rung 0, top 3 = trials 1, 3 and 0: trial 0, which
  // waited since the start, is promoted now.
  EXPECT_EQ(s.reach(5, 0.6), AfterRung::kPause);
  s.take(expect_run(s.ask(5), 0, 1, false, true));
  // Trial 1 at the top rung: finished.
  EXPECT_EQ(s.reach(1, 0.2), AfterRung::kFinish);
  EXPECT_TRUE(s.asha.trials().at(1).finished);
  EXPECT_EQ(s.asha.standings(0, 0).front(), (std::pair<int, double>{1, 0.3}));
}

TEST(Asha, StopOnceStopsATrialForGoodUnlessItLeadsItsRungSoFar) {
  Search s(halving(true));
  s.take(s.ask());
  s.take(s.ask());
  // Alone at rung 0: max(floor(1 / 2), 1) = 1 goes on.
  EXPECT_EQ(s.reach(0, 0.5), AfterRung::kContinue);
  s.log(ev(Event::Kind::kPromoted, 0, 0, 1));
  s.running.insert(0);
  // Worse than one of 2: stopped.
  EXPECT_EQ(s.reach(1, 0.7), AfterRung::kStop);
  s.log(ev(Event::Kind::kStopped, 1, 0, 0));
  // Never promoted later: the next is a new trial even once rung 0 holds many.
  s.take(expect_run(s.ask(1), 2, 0, true, false));
  EXPECT_EQ(s.reach(2, 0.3), AfterRung::kContinue);
  s.log(ev(Event::Kind::kPromoted, 2, 0, 1));
  s.running.insert(2);
  s.take(expect_run(s.ask(), 3, 0, true, false));
  // Equal to trial 0 counts ahead of it (Determined places a newcomer before equals): 4 there,
  // top 2, one better (trial 2): goes on.
  EXPECT_EQ(s.reach(3, 0.5), AfterRung::kContinue);
  EXPECT_TRUE(s.asha.trials().at(1).stopped);
}

TEST(Asha, ATrialLeftByAWorkerThatIsGoneIsTakenOverFirst) {
  Search s(halving(false));
  s.take(s.ask());
  s.take(s.ask());
  // The worker of trial 0 is gone: its lease is free while the log says it trains.
  s.running.erase(0);
  const Decision d = s.ask();
  expect_run(d, 0, 0, false, false);
  EXPECT_TRUE(d.resume);
  s.log(ev(Event::Kind::kStarted, 0, 0, 0));
  s.running.insert(0);
  EXPECT_EQ(s.reach(0, 0.1), AfterRung::kPause);
}

// A worker that died between logging a trial's creation and its start: the trial is taken over
// as one left half-way. A trial that another launcher holds is never chosen.
TEST(Asha, ACreatedTrialNeverStartedIsTakenOverAndAHeldTrialIsPassedOver) {
  Search s(halving(false));
  s.log(ev(Event::Kind::kCreated, 0));
  const Decision d = s.ask();
  expect_run(d, 0, 0, false, false);
  EXPECT_TRUE(d.resume);
  s.take(d);
  s.take(s.ask());
  EXPECT_EQ(s.reach(0, 0.1), AfterRung::kPause);
  EXPECT_EQ(s.reach(1, 0.2), AfterRung::kPause);  // 2 there: trial 0 promotable
  s.running.insert(0);                            // but still held by the worker letting it go
  expect_run(s.ask(), 2, 0, true, false);
  s.running.erase(0);
  expect_run(s.ask(), 0, 1, false, true);
  // A trial that reached its rung does not start it again.
  EXPECT_THROW(s.asha.apply(ev(Event::Kind::kStarted, 1, 0, 0)), SearchError);
}

TEST(Asha, AFailedTrialRanksLastAtItsRung) {
  Search s(halving(false));
  s.take(s.ask());
  s.take(s.ask());
  s.log(ev(Event::Kind::kFailed, 0, 0, 0));
  s.running.erase(0);
  EXPECT_TRUE(s.asha.trials().at(0).failed);
  EXPECT_EQ(s.reach(1, std::numeric_limits<double>::infinity()), AfterRung::kContinue);  // inf beats a failure
  EXPECT_TRUE(std::isnan(s.asha.standings(0, 0).back().second));
}

// Determined grants a promotion when a trial arrives (asha.go, promotionsAsync), and the grant
// sticks; deciding only when a worker asks would promote a subset. Two workers, W1 and W2, on
// async_halving of 3 rungs (2, 4, 8 batches), divisor 2, max_trials 3:
//   W1 starts trial 0, W2 trial 1. Trial 0 reaches rung 0 at 0.5: 1 there, floor(1/2) = 0 due.
//   W1 starts trial 2. W2's job is preempted, leaving trial 1 half-way.
//   Trial 2 reaches rung 0 at 0.6: 2 there, 1 due, trial 2 ranks second: trial 0, at the old
//   edge (index 0), is granted. W1 asks: trial 1, left by a worker that is gone, comes first.
//   Trial 1 reaches rung 0 at 0.4: 3 there, still 1 due, trial 1 ranks first: granted. W1 asks,
//   preferring it: trial 1 to rung 1. Trial 0 is now out of the top 1 of rung 0.
//   W2 comes back and asks. Determined: trial 0's grant stands - promoted to rung 1. (Deciding
//   from the top floor(3/2) = 1 at that moment, trial 1 alone, would end the search here.)
TEST(Asha, AGrantedPromotionSticksAsDeterminedsFlagDoes) {
  AshaOptions o = halving(false);
  o.max_trials = 3;
  Search s(o);
  s.take(expect_run(s.ask(), 0, 0, true, false));  // W1
  s.take(expect_run(s.ask(), 1, 0, true, false));  // W2
  EXPECT_EQ(s.reach(0, 0.5), AfterRung::kPause);
  s.take(expect_run(s.ask(0), 2, 0, true, false));  // W1
  s.running.erase(1);                               // W2 gone
  EXPECT_EQ(s.reach(2, 0.6), AfterRung::kPause);
  EXPECT_TRUE(s.asha.trials().at(0).granted);
  const Decision over = expect_run(s.ask(2), 1, 0, false, false);
  EXPECT_TRUE(over.resume);
  s.log(ev(Event::Kind::kStarted, 1, 0, 0));
  s.running.insert(1);
  EXPECT_EQ(s.reach(1, 0.4), AfterRung::kContinue);
  s.take(expect_run(s.ask(1), 1, 1, false, true));   // W1
  EXPECT_EQ(s.asha.standings(0, 0).front().first, 1);
  s.take(expect_run(s.ask(), 0, 1, false, true));    // W2, back: the grant stands
  EXPECT_FALSE(s.asha.trials().at(0).granted) << "taken";
  EXPECT_EQ(s.ask().kind, Decision::Kind::kDone);
}

// A failed trial ranks last at the rung it trained toward, as Determined's worst value
// (ashaExitedMetricValue); granted a promotion there, it fails at the next rung at once (asha.go
// promoteAsync's recursion), where it counts. Divisor 2, rungs at 2, 4 and 8:
//   trial 0 fails at rung 0 (1 there, none due); trial 1 fails too (2 there, 1 due, trial 1 ranks
//   second: trial 0 at the edge is granted - and fails at rung 1, 1 there);
//   trial 2 reaches rung 0 at 0.3 (3 there, 1 due: ranks first, goes on), then rung 1 at 0.4: 2
//   there with trial 0's failure, 1 due, trial 2 first: it goes on to the top rung at once.
TEST(Asha, AFailedTrialInTheTopOfItsRungFailsAtTheNextAndCountsThere) {
  Search s(halving(false));
  for (int i = 0; i < 3; ++i) s.take(s.ask());
  s.log(ev(Event::Kind::kFailed, 0, 0, 0));
  s.running.erase(0);
  s.log(ev(Event::Kind::kFailed, 1, 0, 0));
  s.running.erase(1);
  EXPECT_EQ(s.asha.trials().at(0).rung, 1) << "carried to rung 1";
  EXPECT_EQ(s.asha.trials().at(0).metrics.size(), 2u);
  EXPECT_EQ(s.asha.standings(0, 1).size(), 1u);
  EXPECT_FALSE(s.asha.trials().at(0).granted);
  EXPECT_EQ(s.reach(2, 0.3), AfterRung::kContinue);
  s.take(expect_run(s.ask(2), 2, 1, false, true));
  EXPECT_EQ(s.reach(2, 0.4), AfterRung::kContinue);
  s.take(expect_run(s.ask(2), 2, 2, false, true));
}

// NaN ranks last, always. Determined's sort.Search with a NaN in a rung's list places a later,
// worse value after the NaN (its comparisons with NaN are false), so at divisor 2 the arrivals
// 1, NaN, 5, 6 grant trial 0 (at the second arrival) and then the NaN trial (at the fourth: the
// edge, index 1, holds the NaN). hpctrial grants the trial with 5 instead - a defect not copied.
TEST(Asha, ANaNRanksLastAndIsNotGrantedAheadOfAFiniteValue) {
  AshaOptions o = halving(false);
  o.max_concurrent_trials = 4;
  Search s(o);
  for (int i = 0; i < 4; ++i) s.take(s.ask());
  EXPECT_EQ(s.reach(0, 1.0), AfterRung::kPause);
  EXPECT_EQ(s.reach(1, std::nan("")), AfterRung::kPause);
  EXPECT_TRUE(s.asha.trials().at(0).granted);
  EXPECT_EQ(s.reach(2, 5.0), AfterRung::kPause);
  EXPECT_EQ(s.reach(3, 6.0), AfterRung::kPause);
  EXPECT_TRUE(s.asha.trials().at(2).granted);
  EXPECT_FALSE(s.asha.trials().at(1).granted);
}

// Determined's InvalidHP (asha.go trialExitedEarly): the trial leaves every rung, does not count
// toward max_trials, and a new trial of its bracket replaces it.
TEST(Asha, ATrialWithInvalidHyperparametersIsReplacedWithoutCounting) {
  AshaOptions o = halving(false);
  o.max_trials = 2;
  Search s(o);
  s.take(s.ask());
  s.take(s.ask());
  EXPECT_EQ(s.reach(0, 0.5), AfterRung::kPause);
  s.log(ev(Event::Kind::kInvalid, 1, 0, 0));
  s.running.erase(1);
  EXPECT_TRUE(s.asha.trials().at(1).invalid);
  EXPECT_EQ(s.asha.invalid(), 1);
  s.take(expect_run(s.ask(0), 2, 0, true, false));  // the replacement, beyond max_trials' 2 made
  EXPECT_EQ(s.reach(2, 0.6), AfterRung::kPause);
  EXPECT_EQ(s.asha.standings(0, 0).size(), 2u) << "trial 1 left the rung";
  s.take(expect_run(s.ask(2), 0, 1, false, true));  // 2 there: trial 0 granted
  EXPECT_EQ(s.ask().kind, Decision::Kind::kDone);
  EXPECT_THROW(s.asha.apply(ev(Event::Kind::kInvalid, 1, 0, 0)), SearchError) << "ended already";
  EXPECT_THROW(s.asha.apply(ev(Event::Kind::kInvalid, 2, 0, 0)), SearchError) << "not training";
  // Reported invalid at rung 1, after it reached rung 0: it leaves rung 0 too, and is replaced.
  s.log(ev(Event::Kind::kInvalid, 0, 0, 1));
  s.running.erase(0);
  EXPECT_EQ(s.asha.standings(0, 0).size(), 1u);
  s.take(expect_run(s.ask(), 3, 0, true, false));
  // A third: max_trials (2) invalid trials at most are replaced, so the search ends.
  s.log(ev(Event::Kind::kInvalid, 3, 0, 0));
  s.running.erase(3);
  EXPECT_EQ(s.ask().kind, Decision::Kind::kDone);
}

TEST(Asha, TheSearchEndsOnceEveryTrialIsCreatedAndNoneIsPromotable) {
  AshaOptions o = halving(false);
  o.max_trials = 2;
  Search s(o);
  s.take(s.ask());
  s.take(s.ask());
  EXPECT_EQ(s.reach(0, 0.5), AfterRung::kPause);
  EXPECT_EQ(s.ask(0).kind, Decision::Kind::kDone);  // trial 1 still runs: its worker goes on
  EXPECT_EQ(s.reach(1, 0.6), AfterRung::kPause);
  s.take(expect_run(s.ask(1), 0, 1, false, true));  // 2 there: the top 1 (trial 0)
}

TEST(Asha, EventsThatDoNotFollowAreRefused) {
  Asha asha(halving(false));
  asha.apply(ev(Event::Kind::kSearch));
  EXPECT_THROW(asha.apply(ev(Event::Kind::kCreated, 1)), SearchError);  // trial 0 comes first
  asha.apply(ev(Event::Kind::kCreated, 0));
  EXPECT_THROW(asha.apply(ev(Event::Kind::kRung, 0, 0, 0, 0.5)), SearchError);  // never started
  asha.apply(ev(Event::Kind::kStarted, 0, 0, 0));
  EXPECT_THROW(asha.apply(ev(Event::Kind::kPromoted, 0, 0, 1)), SearchError);  // rung 0 not reached
  EXPECT_THROW(asha.apply(ev(Event::Kind::kStarted, 7, 0, 0)), SearchError);
}

// Workers drive a search of 40 trials at random; each decision is recorded with the events
// before it. The log replayed to each point, through its text, gives the same decision.
TEST(Asha, TheSameEventsGiveTheSameDecisions) {
  AshaOptions o = sixty_four();
  o.max_trials = 40;
  o.max_length = 64;
  o.mode = AshaOptions::Mode::kStandard;
  Search s(o);
  std::mt19937 random(11);
  struct Asked {
    std::size_t events;
    std::optional<int> prefer;
    std::set<int> running;
    Decision decision;
  };
  std::vector<Asked> asked;
  std::vector<int> workers(4, -1);
  for (int step = 0; step < 400; ++step) {
    const std::size_t w = random() % workers.size();
    std::optional<int> prefer;
    if (workers[w] >= 0) {
      const int trial = workers[w];
      // The metric: trial-dependent, better with length.
      const double metric = std::fmod(trial * 0.37, 1.0) / (1 + s.asha.trials().at(trial).rung);
      const AfterRung after = s.reach(trial, metric);
      workers[w] = -1;
      if (after == AfterRung::kFinish) s.log(ev(Event::Kind::kFinished, trial, 0, s.asha.trials().at(trial).rung));
      prefer = trial;
    }
    const Decision d = s.ask(prefer);
    asked.push_back({s.events.size(), prefer, s.running, d});
    if (d.kind == Decision::Kind::kDone) continue;
    s.take(d);
    workers[w] = d.trial;
  }
  EXPECT_EQ(s.asha.created(), 40);
  std::vector<Event> parsed;
  for (const auto& e : s.events) parsed.push_back(parse_event(to_json_line(e), "test"));
  for (const auto& a : asked) {
    const Asha again = replay(o, std::vector<Event>(parsed.begin(), parsed.begin() + a.events), "log");
    const Decision d = again.next([&](int t) { return a.running.count(t) > 0; }, a.prefer);
    EXPECT_EQ(d.kind, a.decision.kind);
    EXPECT_EQ(d.trial, a.decision.trial);
    EXPECT_EQ(d.rung, a.decision.rung);
    EXPECT_EQ(d.promote, a.decision.promote);
  }
}

// A trial's chief records its rung itself (record_rung, in place): the rung and what follows are
// appended together - a promotion granted at once is appended as kPromoted, and the chief trains
// on to the next rung's end; a trial that waits only has its rung. A trial the log says is not
// training cannot reach a rung.
TEST(SearchLog, AChiefRecordsItsRungAndAPromotionAtOnceTrainsOnInPlace) {
  testing_support::TempDir dir;
  EventLog log((dir.path() / "search-events.jsonl").string(), (dir.path() / ".search.lock").string(), "exp-1",
               settings_of(halving(false)));
  {
    auto locked = log.lock();
    locked.read();
    locked.append({ev(Event::Kind::kCreated, 0), ev(Event::Kind::kStarted, 0), ev(Event::Kind::kCreated, 1),
                   ev(Event::Kind::kStarted, 1)},
                  "w");
  }
  auto locked = log.lock();
  const RungRecorded waits = record_rung(locked, halving(false), log.path(), 0, 0.5, true, "chief of 0");
  EXPECT_EQ(waits.after, AfterRung::kPause);
  EXPECT_EQ(waits.rung, 0);
  EXPECT_EQ(waits.next_length, 0);
  // 2 at rung 0, trial 1 the better: granted at once, promoted in place to rung 1 (4 batches).
  const RungRecorded goes_on = record_rung(locked, halving(false), log.path(), 1, 0.3, true, "chief of 1");
  EXPECT_EQ(goes_on.after, AfterRung::kContinue);
  EXPECT_EQ(goes_on.next_length, 4);
  const auto events = locked.read();
  EXPECT_EQ(events.back().kind, Event::Kind::kPromoted);
  EXPECT_EQ(events.back().rung, 1);
  EXPECT_EQ(events.back().worker, "chief of 1");
  const Asha asha = replay(halving(false), events, log.path());
  EXPECT_TRUE(asha.trials().at(1).training);
  EXPECT_EQ(training_length(asha, 1, log.path()), 4);
  try {
    record_rung(locked, halving(false), log.path(), 0, 0.1, true, "chief of 0");
    ADD_FAILURE() << "trial 0 waits: it reached no rung";
  } catch (const SearchError& e) {
    EXPECT_THAT(e.what(), HasSubstr("says trial 0 is not training toward a rung, but its ranks are"));
  }
}

TEST(SearchLog, MetricsOfAnyValueRoundTripAndATornLastLineIsNeverRead) {
  testing_support::TempDir dir;
  const std::string path = (dir.path() / "search-events.jsonl").string();
  EventLog log(path, (dir.path() / ".search.lock").string(), "exp-1", settings_of(halving(false)));
  {
    auto locked = log.lock();
    EXPECT_EQ(locked.read().size(), 1u);  // the search's line, written now
    std::vector<Event> events = {ev(Event::Kind::kCreated, 0), ev(Event::Kind::kStarted, 0)};
    for (double metric : {std::nan(""), std::numeric_limits<double>::infinity(), -0.25}) {
      events.push_back(ev(Event::Kind::kRung, 0, 0, 0, metric));
    }
    locked.append(events, "worker \"A\"\t1");  // escapes: read by the slow path
  }
  {
    std::ofstream torn(path, std::ios::app);
    torn << R"({"event":"rung","trial":0,"ru)";
  }
  auto locked = log.lock();
  auto read = locked.read();
  ASSERT_EQ(read.size(), 6u);
  EXPECT_EQ(read[0].experiment_id, "exp-1");
  EXPECT_TRUE(std::isnan(read[3].metric));
  EXPECT_EQ(read[4].metric, std::numeric_limits<double>::infinity());
  EXPECT_EQ(read[5].metric, -0.25);
  EXPECT_EQ(read[5].worker, "worker \"A\"\t1");
  EXPECT_EQ(read[1].kind, Event::Kind::kCreated);
  EXPECT_FALSE(read[5].time.empty());
  locked.append({ev(Event::Kind::kFinished, 0)}, "worker B");
  read = locked.read();
  ASSERT_EQ(read.size(), 7u);  // the torn line cut off, the new one whole
  EXPECT_EQ(read[6].kind, Event::Kind::kFinished);
  EXPECT_EQ(read[6].worker, "worker B");
  // Each line reads the same whichever way it is read.
  for (const auto& e : read) {
    const Event again = parse_event(to_json_line(e), "test");
    EXPECT_EQ(again.kind, e.kind);
    EXPECT_EQ(again.trial, e.trial);
    EXPECT_EQ(again.worker, e.worker);
  }
}

TEST(SearchLog, AnotherExperimentsLogAndAMalformedLineAreRefusedNamingThem) {
  testing_support::TempDir dir;
  const std::string path = (dir.path() / "search-events.jsonl").string();
  const std::string lock = (dir.path() / ".search.lock").string();
  const std::string settings = settings_of(halving(false));
  EventLog(path, lock, "exp-1", settings).lock().read();
  try {
    EventLog(path, lock, "exp-2", settings).lock().read();
    ADD_FAILURE() << "another experiment's log was read";
  } catch (const SearchError& e) {
    EXPECT_THAT(e.what(), HasSubstr(path + " is the search of experiment exp-1, not of this one (exp-2)"));
  }
  // A divisor that prints long (2.2) reads back as the same settings.
  {
    AshaOptions decimal = halving(false);
    decimal.divisor = 2.2;
    const std::string other_path = (dir.path() / "decimal.jsonl").string();
    EventLog(other_path, lock, "exp-1", settings_of(decimal)).lock().read();
    EXPECT_EQ(EventLog(other_path, lock, "exp-1", settings_of(decimal)).lock().read().size(), 1u);
    EXPECT_EQ(EventLog(other_path, lock, "exp-1", settings_of(decimal)).read_only().size(), 1u);
  }
  // Other settings (another divisor): refused, naming both.
  AshaOptions other = halving(false);
  other.divisor = 3;
  try {
    EventLog(path, lock, "exp-1", settings_of(other)).lock().read();
    ADD_FAILURE() << "a search was continued with other settings";
  } catch (const SearchError& e) {
    EXPECT_THAT(e.what(), HasSubstr(path + ":1: the search began with the settings {\"brackets\":[[3,8]],\"divisor\":2.0,"));
    EXPECT_THAT(e.what(), HasSubstr("and the config now makes {\"brackets\":[[3,8]],\"divisor\":3.0,"));
  }
  {
    std::ofstream out(path, std::ios::app);
    out << "{\"event\":\"created\",\"trial\":0,\"bracket\":0}\n{\"event\":\"teleported\",\"trial\":0}\n";
  }
  try {
    EventLog(path, lock, "exp-1", settings).lock().read();
    ADD_FAILURE() << "a malformed line was read";
  } catch (const SearchError& e) {
    EXPECT_THAT(e.what(), HasSubstr(path + ":3: unknown event 'teleported'"));
  }
  // Events that do not follow name their line too.
  std::vector<Event> events = {ev(Event::Kind::kSearch), ev(Event::Kind::kCreated, 0), ev(Event::Kind::kRung, 0, 0, 0, 1.0)};
  try {
    replay(halving(false), events, path);
    ADD_FAILURE() << "a rung never started was replayed";
  } catch (const SearchError& e) {
    EXPECT_THAT(e.what(), HasSubstr(path + ":3: a 'rung' event of trial 0 reaches a rung"));
  }
}

}  // namespace
}  // namespace hpctrial::search
