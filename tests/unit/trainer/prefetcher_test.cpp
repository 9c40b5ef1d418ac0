#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include <torch/torch.h>

#include "data/prefetcher.h"
#include "hpctrial/core/error.h"
#include "hpctrial/trainer/data.h"

namespace hpctrial::trainer::detail {
namespace prefetcher_test {  // named: the target compiles its sources together (UNITY_BUILD)

using testing::HasSubstr;
using Where = ReadPlacement::Where;

class CountingDataset : public Dataset {
 public:
  std::uint64_t size() const override { return 1000; }
  Batch get_batch(const std::vector<std::int64_t>& indices) override {
    if (indices.front() == fail_at) throw IoError("the disk went away at " + std::to_string(fail_at));
    return {torch::tensor(indices), torch::tensor(indices)};
  }
  std::int64_t fail_at = -1;
};

Prefetcher::Read reader(CountingDataset& dataset) {
  return [&dataset](const std::vector<std::int64_t>& indices) { return dataset.get_batch(indices); };
}

TEST(Prefetcher, DeliversBatchesInOrderWithAnyWorkersAndDepth) {
  for (std::size_t workers : {0, 1, 3}) {
    for (std::size_t depth : {1, 4}) {
      CountingDataset dataset;
      std::int64_t next = 0;
      Prefetcher prefetcher(reader(dataset), [&] { return std::vector<std::int64_t>{next++}; }, workers, depth);
      for (std::int64_t i = 0; i < 50; ++i) {
        ASSERT_EQ(prefetcher.next().data[0].item<std::int64_t>(), i) << workers << " workers, depth " << depth;
      }
    }
  }
}

TEST(Prefetcher, WorkersReadAtOnceAndStillHandOverInOrder) {
  // In each run of three batches the first takes longest (6, 4, 2 ms), so with three workers
  // later batches finish first.
  std::atomic<int> reading{0}, most{0};
  std::int64_t next = 0;
  Prefetcher prefetcher(
      [&](const std::vector<std::int64_t>& indices) {
        const int now = ++reading;
        int seen = most.load();
        while (now > seen && !most.compare_exchange_weak(seen, now)) {
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(2 * (3 - indices[0] % 3)));
        --reading;
        return Batch(torch::tensor(indices), torch::tensor(indices));
      },
      [&] { return std::vector<std::int64_t>{next++}; }, 3, 3);
  for (std::int64_t i = 0; i < 30; ++i) ASSERT_EQ(prefetcher.next().data[0].item<std::int64_t>(), i);
  EXPECT_GT(most.load(), 1);
}

TEST(Prefetcher, AReadErrorReachesTheTrainingThreadAfterTheBatchesBeforeIt) {
  for (std::size_t workers : {0, 1, 3}) {
    CountingDataset dataset;
    dataset.fail_at = 3;
    std::int64_t next = 0;
    Prefetcher prefetcher(reader(dataset), [&] { return std::vector<std::int64_t>{next++}; }, workers, 2);
    for (std::int64_t i = 0; i < 3; ++i) ASSERT_EQ(prefetcher.next().data[0].item<std::int64_t>(), i);
    for (int attempt = 0; attempt < 2; ++attempt) {  // and again: the failed batch stays failed
      try {
        prefetcher.next();
        FAIL() << workers << " workers";
      } catch (const IoError& e) {
        EXPECT_THAT(e.what(), HasSubstr("the disk went away at 3"));
      }
    }
  }
}

TEST(Prefetcher, StopsCleanlyWithBatchesStillQueued) {
  CountingDataset dataset;
  std::int64_t next = 0;
  { Prefetcher prefetcher(reader(dataset), [&] { return std::vector<std::int64_t>{next++}; }, 4, 8); }
  SUCCEED();
}


// The placement's rule on measured steps: a window ahead, a window inline, the faster kept.
ReadPlacement::Options small_windows() {
  ReadPlacement::Options o;
  o.warmup = 2;
  o.window = 4;
  o.recheck = 10;
  o.max_recheck = 40;
  return o;
}

// Feeds `steps` steps of `step_s` (inline) or `ahead_s` (ahead), reads of `read_s`, and returns
// where the placement stood after each.
std::vector<Where> feed(ReadPlacement& p, int steps, double ahead_s, double inline_s, double read_s) {
  std::vector<Where> where;
  for (int i = 0; i < steps; ++i) {
    const Where w = p.where();
    p.step(w == Where::kAhead ? ahead_s : inline_s, w, read_s);
    where.push_back(p.where());
  }
  return where;
}

TEST(ReadPlacement, ReadsInlineWhenThatMakesTheStepFaster) {
  ReadPlacement p(small_windows());
  EXPECT_EQ(p.where(), Where::kAhead);  // until measured
  const auto where = feed(p, 16, 100e-6, 95e-6, 5e-6);
  EXPECT_EQ(where.back(), Where::kInline);
  EXPECT_DOUBLE_EQ(p.ahead_step_s(), 100e-6);
  EXPECT_DOUBLE_EQ(p.inline_step_s(), 95e-6);
}

TEST(ReadPlacement, StaysAheadWhenInlineIsNoFasterThanTheMargin) {
  ReadPlacement p(small_windows());
  EXPECT_EQ(feed(p, 16, 100e-6, 99.8e-6, 5e-6).back(), Where::kAhead);
}

TEST(ReadPlacement, NeverTriesInlineWhenAReadTakesATenthOfTheStep) {
  ReadPlacement p(small_windows());
  for (const Where w : feed(p, 200, 1e-3, 1e-6, 0.2e-3)) EXPECT_EQ(w, Where::kAhead);
  EXPECT_EQ(p.inline_step_s(), 0);
}

TEST(ReadPlacement, MeasuresAgainLaterAndLessOftenWhileTheChoiceStays) {
  ReadPlacement p(small_windows());
  const auto where = feed(p, 400, 100e-6, 90e-6, 5e-6);
  // Every re-measurement reads ahead for a window (and the two steps it skips): count them.
  std::vector<int> ahead_runs_at;
  for (int i = 1; i < static_cast<int>(where.size()); ++i) {
    if (where[i] == Where::kAhead && where[i - 1] == Where::kInline) ahead_runs_at.push_back(i);
  }
  ASSERT_GE(ahead_runs_at.size(), 3u);
  const int first_gap = ahead_runs_at[1] - ahead_runs_at[0];
  const int second_gap = ahead_runs_at[2] - ahead_runs_at[1];
  EXPECT_GT(second_gap, first_gap);  // the recheck doubled
  // And the choice follows the machine: reads that became slow move the batches ahead again.
  const auto later = feed(p, 400, 100e-6, 200e-6, 50e-6);
  EXPECT_EQ(later.back(), Where::kAhead);
}

// Feeds the same as feed(), and hand-overs of `ahead_fetch_s` and `inline_fetch_s`.
std::vector<Where> feed_fetches(ReadPlacement& p, int steps, double ahead_s, double inline_s, double ahead_fetch_s,
                                double inline_fetch_s) {
  std::vector<Where> where;
  for (int i = 0; i < steps; ++i) {
    const Where w = p.where();
    const bool ahead = w == Where::kAhead;
    p.step(ahead ? ahead_s : inline_s, w, 1e-6, ahead ? ahead_fetch_s : inline_fetch_s);
    where.push_back(p.where());
  }
  return where;
}

TEST(ReadPlacement, TheHandOverDecidesWhereTheStepsAreWithinTheMargin) {
  {  // Steps 0.1 % apart (noise): the hand-over ahead costs 14 us, inline 12 us.
    ReadPlacement p(small_windows());
    EXPECT_EQ(feed_fetches(p, 16, 100e-6, 100.1e-6, 14e-6, 12e-6).back(), Where::kInline);
    EXPECT_DOUBLE_EQ(p.ahead_fetch_s(), 14e-6);
    EXPECT_DOUBLE_EQ(p.inline_fetch_s(), 12e-6);
  }
  {  // A paced reader's hand-over, 0.2 us, against the read inline.
    ReadPlacement p(small_windows());
    EXPECT_EQ(feed_fetches(p, 16, 100.1e-6, 100e-6, 0.2e-6, 12e-6).back(), Where::kAhead);
  }
  {  // Steps ahead faster by more than the margin win over a shorter hand-over inline.
    ReadPlacement p(small_windows());
    EXPECT_EQ(feed_fetches(p, 16, 90e-6, 100e-6, 14e-6, 12e-6).back(), Where::kAhead);
  }
}

TEST(ReadPlacement, TheHandOverIsTheMeanOfAllButTheSlowestTenth) {
  ReadPlacement::Options o = small_windows();
  o.window = 10;
  ReadPlacement q(o);
  // Two steps of warm-up, two skipped, then a window of ten ahead: every other hand-over wakes a
  // reader (1 us, 13 us), and in the last the machine took the core away.
  for (int i = 0; i < 2 + 2 + 10; ++i) q.step(100e-6, Where::kAhead, 1e-6, i == 13 ? 5e-3 : (i % 2 == 0 ? 1e-6 : 13e-6));
  EXPECT_NEAR(q.ahead_fetch_s(), (5 * 1e-6 + 4 * 13e-6) / 9, 1e-12);
}

TEST(ReadPlacement, OneMeasurementAgainstTheChoiceIsRepeatedBeforeItCounts) {
  ReadPlacement p(small_windows());
  ASSERT_EQ(feed(p, 16, 100e-6, 90e-6, 5e-6).back(), Where::kInline);
  // The next measurement finds inline slower, once: the choice stays, and it measures again at once.
  std::vector<Where> where;
  for (int i = 0; i < 400 && where.size() < 2; ++i) {
    const Where w = p.where();
    const bool measuring_again = !where.empty();
    const double inline_s = measuring_again ? 90e-6 : 200e-6;
    const Where before = w;
    p.step(w == Where::kAhead ? 100e-6 : inline_s, w, 5e-6);
    if (before != Where::kInline || p.where() != Where::kInline) continue;
    if (p.inline_step_s() == 200e-6 && where.empty()) where.push_back(p.where());
    if (p.inline_step_s() == 90e-6 && !where.empty()) where.push_back(p.where());
  }
  ASSERT_EQ(where.size(), 2u);
  EXPECT_EQ(where[0], Where::kInline) << "one window against the choice moved it";
  EXPECT_EQ(where[1], Where::kInline);
  // Two in a row do move it.
  EXPECT_EQ(feed(p, 400, 100e-6, 200e-6, 5e-6).back(), Where::kAhead);
}

TEST(ReadPlacement, IgnoresBatchesReadTheOtherWayAndTheFirstTwoOfAWindow) {
  ReadPlacement p(small_windows());
  p.step(1, Where::kAhead, 0);
  p.step(1, Where::kAhead, 0);  // warm-up done
  for (int i = 0; i < 2; ++i) p.step(50, Where::kAhead, 0);  // skipped: the window's first two
  for (int i = 0; i < 4; ++i) p.step(100e-6, Where::kAhead, 1e-6);
  ASSERT_EQ(p.where(), Where::kInline);
  for (int i = 0; i < 10; ++i) p.step(1, Where::kAhead, 0);  // batches read ahead before the switch
  EXPECT_EQ(p.where(), Where::kInline);
  for (int i = 0; i < 2 + 4; ++i) p.step(80e-6, Where::kInline, 1e-6);
  EXPECT_EQ(p.where(), Where::kInline);
  EXPECT_DOUBLE_EQ(p.ahead_step_s(), 100e-6);
  EXPECT_DOUBLE_EQ(p.inline_step_s(), 80e-6);
}

// A training loop's steps: each takes the next batch, which must be the next in order, then
// computes (spins) for `work`.
class Steps {
 public:
  explicit Steps(Prefetcher& prefetcher) : prefetcher_(prefetcher) {}
  void take(std::chrono::microseconds work) {
    ASSERT_EQ(prefetcher_.next().data[0].item<std::int64_t>(), expected_++);
    const auto until = std::chrono::steady_clock::now() + work;
    while (std::chrono::steady_clock::now() < until) {
    }
  }

 private:
  Prefetcher& prefetcher_;
  std::int64_t expected_ = 0;
};

// The batches move to the training thread when the placement says so, in order, and back when
// the reads become slow. A placement that keeps inline while it is under twice ahead's step
// (margin -1) makes the move certain with reads of a few microseconds.
TEST(Prefetcher, MovesReadsToTheTrainingThreadAndBackInOrder) {
  std::atomic<bool> slow{false};
  std::atomic<int> read_on_caller{0};
  const auto caller = std::this_thread::get_id();
  std::int64_t next = 0;
  ReadPlacement::Options options;
  options.margin = -1;
  options.recheck = 64;
  Prefetcher prefetcher(
      [&](const std::vector<std::int64_t>& indices) {
        if (std::this_thread::get_id() == caller) ++read_on_caller;
        if (slow) std::this_thread::sleep_for(std::chrono::milliseconds(2));
        return Batch(torch::tensor(indices), torch::tensor(indices));
      },
      [&] { return std::vector<std::int64_t>{next++}; }, 1, 2, true, options);
  Steps steps(prefetcher);
  const auto step = [&](std::chrono::microseconds work) { steps.take(work); };
  for (int i = 0; i < 200 && prefetcher.where() != Where::kInline; ++i) step(std::chrono::microseconds(50));
  ASSERT_EQ(prefetcher.where(), Where::kInline);
  for (int i = 0; i < 10; ++i) step(std::chrono::microseconds(50));
  EXPECT_GT(read_on_caller.load(), 0);
  // Reads of 2 ms against steps of 0.5 ms: the next measurement settles ahead and stays there.
  slow = true;
  for (int i = 0; i < 400 && prefetcher.where() != Where::kAhead; ++i) step(std::chrono::microseconds(500));
  ASSERT_EQ(prefetcher.where(), Where::kAhead);
  const int inline_reads = read_on_caller.load();
  for (int i = 0; i < 20; ++i) step(std::chrono::microseconds(500));
  EXPECT_EQ(read_on_caller.load(), inline_reads);
}

// Reads far shorter than a step are paced: the reader looks by itself every nine tenths of a step
// (depth 2), and a step that takes a batch wakes no one. Slow reads are woken for.
TEST(Prefetcher, PacesAReaderOfShortReadsAndStillDeliversWhenTheStepsOutrunIt) {
  std::atomic<bool> slow{false};
  std::int64_t next = 0;
  ReadPlacement::Options ahead_only;
  ahead_only.warmup = 1 << 30;  // reads ahead throughout
  Prefetcher prefetcher(
      [&](const std::vector<std::int64_t>& indices) {
        if (slow) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        return Batch(torch::tensor(indices), torch::tensor(indices));
      },
      [&] { return std::vector<std::int64_t>{next++}; }, 1, 2, true, ahead_only);
  Steps steps(prefetcher);
  const auto step = [&](std::chrono::microseconds work) { steps.take(work); };
  EXPECT_EQ(prefetcher.reader_pace_s(), 0);  // nothing measured yet
  for (int i = 0; i < 60; ++i) step(std::chrono::microseconds(2000));
  const double pace = prefetcher.reader_pace_s();
  EXPECT_GT(pace, 0.9 * 1.5e-3);
  EXPECT_LT(pace, 0.9 * 20e-3);
  // Steps far shorter than the pace: each next() that finds the queue empty wakes the reader.
  for (int i = 0; i < 300; ++i) step(std::chrono::microseconds(0));
  // Reads of 1 ms against steps of about 1 ms: woken for every batch again.
  slow = true;
  for (int i = 0; i < 60; ++i) step(std::chrono::microseconds(1000));
  EXPECT_EQ(prefetcher.reader_pace_s(), 0);
}

TEST(Prefetcher, AReadErrorStaysWhereverTheBatchesAreRead) {
  std::int64_t next = 0;
  Prefetcher prefetcher(
      [&](const std::vector<std::int64_t>& indices) {
        if (indices[0] == 150) throw IoError("the disk went away at 150");
        return Batch(torch::tensor(indices), torch::tensor(indices));
      },
      [&] { return std::vector<std::int64_t>{next++}; }, 1, 2);
  for (std::int64_t i = 0; i < 150; ++i) ASSERT_EQ(prefetcher.next().data[0].item<std::int64_t>(), i);
  for (int attempt = 0; attempt < 2; ++attempt) {
    try {
      prefetcher.next();
      FAIL() << "read " << (150 + attempt) << " should have failed";
    } catch (const IoError& e) {
      EXPECT_THAT(e.what(), HasSubstr("the disk went away at 150"));
    }
  }
}

}  // namespace prefetcher_test
}  // namespace hpctrial::trainer::detail
