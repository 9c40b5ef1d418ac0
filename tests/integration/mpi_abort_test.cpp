// A fatal error on one rank ends the whole job through MPI_Abort - with the rank's message and
// exit code - instead of leaving the other ranks waiting forever.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "hpctrial/core/subprocess.h"

namespace hpctrial {
namespace mpi_abort_test {  // named: the target compiles its sources together (UNITY_BUILD)

using testing::HasSubstr;

core::RunResult run_ranks(int np, const std::string& mode, int failing_rank, int value) {
  core::RunOptions options;
  options.timeout = std::chrono::seconds(120);
  // Open MPI refuses root without these; CI runs as root.
  options.env_set = {{"OMPI_ALLOW_RUN_AS_ROOT", "1"}, {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"}};
  return core::run_process({HPCTRIAL_MPIRUN, "-np", std::to_string(np), "--oversubscribe",
                            HPCTRIAL_MPI_ABORT_HELPER, mode, std::to_string(failing_rank),
                            std::to_string(value)},
                           options);
}

TEST(MpiAbort, OneFailingRankEndsTheJobWithItsCode) {
  const auto r = run_ranks(2, "abort", 1, 7);
  EXPECT_FALSE(r.timed_out) << "the job hung after one rank failed";
  EXPECT_EQ(r.exit_code, 7) << r.describe() << "\n" << r.err;
  EXPECT_THAT(r.err, HasSubstr("[rank 1] fatal on "));
  EXPECT_THAT(r.err, HasSubstr("injected failure: the data file vanished; aborting the job"));
}

TEST(MpiAbort, TheChiefFailingEndsFourRanks) {
  const auto r = run_ranks(4, "abort", 0, 9);
  EXPECT_FALSE(r.timed_out) << "the job hung after the chief failed";
  EXPECT_EQ(r.exit_code, 9) << r.describe() << "\n" << r.err;
  EXPECT_THAT(r.err, HasSubstr("[rank 0] fatal on "));
}

// A rank that stops answering (in user code, not in MPI) leaves the others waiting in a
// collective: the watchdog ends the job and names the operation, the step and the rank.
TEST(CollectiveWatchdog, EndsAJobWhoseRankStoppedAnswering) {
  const auto start = std::chrono::steady_clock::now();
  const auto r = run_ranks(4, "hang", 2, 2);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_FALSE(r.timed_out) << "the watchdog did not end the job";
  EXPECT_NE(r.exit_code, 0) << r.describe() << "\n" << r.err;
  EXPECT_LT(took, 30) << r.err;
  EXPECT_THAT(r.err, HasSubstr("watchdog: allreduce (collective #7, step 3) has not finished after "));
  EXPECT_THAT(r.err, HasSubstr("(optimizations.collective_timeout is 2 s); rank 2 did not arrive: rank 2 is "
                               "at step 3 and has entered 6 collectives"));
  // The flight recorder: the others wait in the 7th collective (1000 floats), the stuck rank
  // finished its 6th, at step 2, and began nothing after it.
  for (const int waiting : {0, 1, 3}) {
    EXPECT_THAT(r.err, testing::ContainsRegex("watchdog: rank " + std::to_string(waiting) +
                                              "'s last operations: [^\n]*allreduce #7 \\(step 3, 3.9 KiB\\) began "
                                              "[0-9.]+ s ago, not finished\n"));
  }
  EXPECT_THAT(r.err, testing::ContainsRegex("watchdog: rank 2's last operations: [^\n]*#6 \\(step 2[^\n]*\\) began "
                                            "[0-9.]+ s ago, took [0-9.]+ s\n"));
}

TEST(CollectiveWatchdog, NamesTheChiefWhenTheChiefStopsAnswering) {
  const auto r = run_ranks(2, "hang", 0, 2);
  EXPECT_FALSE(r.timed_out) << "the watchdog did not end the job";
  EXPECT_NE(r.exit_code, 0) << r.describe() << "\n" << r.err;
  EXPECT_THAT(r.err, HasSubstr("rank 0 did not arrive: rank 0 is at step 3 and has entered 6 collectives"));
  // The chief's watchdog thread reports its own rank's operations too.
  EXPECT_THAT(r.err, testing::ContainsRegex("watchdog: rank 0's last operations: [^\n]*#6 \\(step 2[^\n]*\\) began "
                                            "[0-9.]+ s ago, took [0-9.]+ s\n"));
  EXPECT_THAT(r.err, testing::ContainsRegex("watchdog: rank 1's last operations: [^\n]*allreduce #7 \\(step 3, 3.9 KiB\\) "
                                            "began [0-9.]+ s ago, not finished\n"));
}

// More operations queued than the flight recorder holds: the oldest unfinished one, where the
// job hangs, stays in it (each step: 10 all-reduces of 1 KiB and `any`, 11 collectives).
TEST(CollectiveWatchdog, TheFlightRecorderKeepsTheOldestUnfinishedOperation) {
  const auto r = run_ranks(2, "hang-queued", 1, 2);
  EXPECT_FALSE(r.timed_out) << "the watchdog did not end the job";
  EXPECT_NE(r.exit_code, 0) << r.describe() << "\n" << r.err;
  EXPECT_THAT(r.err, testing::ContainsRegex("watchdog: rank 0's last operations: allreduce #34 \\(step 3, 1.0 KiB\\) "
                                            "began [0-9.]+ s ago, not finished;"));
  EXPECT_THAT(r.err, testing::ContainsRegex("watchdog: rank 1's last operations: [^\n]*; allreduce #33 \\(step 2, 8 B\\) "
                                            "began [0-9.]+ s ago, took [0-9.]+ s\n"))
      << "the stopped rank's last is the 33rd, step 2's `any`";
}

// Messages and the collectives of a group are counted apart from the world's: a rank that did not
// send is named with the messages it sent, the chief as another rank, and a waiting rank in the
// chain (one that did not send because it waits itself) leads to the rank that stopped.
TEST(CollectiveWatchdog, NamesTheRankThatDidNotSendAMessage) {
  const auto r = run_ranks(4, "hang-message", 2, 2);
  EXPECT_FALSE(r.timed_out) << "the watchdog did not end the job";
  EXPECT_NE(r.exit_code, 0) << r.describe() << "\n" << r.err;
  EXPECT_THAT(r.err, HasSubstr("recv (message #4 from rank 2 to rank 3, step 3)"));
  EXPECT_THAT(r.err, HasSubstr("rank 2 did not arrive: rank 2 is at step 3 and has sent 3 messages to rank 3"));
}

TEST(CollectiveWatchdog, NamesTheChiefWhenTheChiefDidNotSend) {
  const auto r = run_ranks(2, "hang-message", 0, 2);
  EXPECT_FALSE(r.timed_out) << "the watchdog did not end the job";
  EXPECT_NE(r.exit_code, 0) << r.describe() << "\n" << r.err;
  EXPECT_THAT(r.err, HasSubstr("watchdog: recv (message #4 from rank 0 to rank 1, step 3) has not finished after "));
  EXPECT_THAT(r.err, HasSubstr("rank 0 did not arrive: rank 0 is at step 3 and has sent 3 messages to rank 1"));
}

TEST(CollectiveWatchdog, NamesTheGroupAndTheRankThatDidNotArriveInIt) {
  const auto r = run_ranks(4, "hang-group", 2, 2);
  EXPECT_FALSE(r.timed_out) << "the watchdog did not end the job";
  EXPECT_NE(r.exit_code, 0) << r.describe() << "\n" << r.err;
  EXPECT_THAT(r.err, HasSubstr("watchdog: allreduce (collective #4 of the group of ranks 0, 2, step 3) has not "
                               "finished after "));
  EXPECT_THAT(r.err, HasSubstr("rank 2 did not arrive: rank 2 is at step 3 and has entered 3 collectives of that "
                               "group"));
}

}  // namespace mpi_abort_test
}  // namespace hpctrial
