// How the launcher reads mpirun: its --tag-output stream split per rank, its boxed reports held
// back, and its words about the first rank that failed (texts as Open MPI 4.1 prints them).
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "../../support/read_file.h"
#include "../../support/temp_dir.h"
#include "launcher_internal.h"

namespace hpctrial::launcher::detail {
namespace {

using testing::ElementsAre;
using testing::HasSubstr;
using testing::Not;
using testing_support::read_file;
using testing_support::TempDir;

class RankOutputTest : public testing::Test {
 protected:
  RankOutputTest()
      : out_path_((dir_.path() / "out").string()),
        err_path_((dir_.path() / "err").string()),
        out_(::open(out_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600)),
        err_(::open(err_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600)) {}
  ~RankOutputTest() override {
    ::close(out_);
    ::close(err_);
  }
  void feed(RankOutput& output, const std::string& text, bool from_stderr = false) {
    output.feed(text.data(), text.size(), from_stderr);
  }
  core::TrialLayout trial() const { return core::TrialLayout{dir_.path().string()}; }
  std::string logs() const { return (dir_.path() / "logs").string(); }

  TempDir dir_;
  std::string out_path_, err_path_;
  int out_, err_;
};

TEST_F(RankOutputTest, TaggedLinesAreShownWithTheirRankAndFiledPerRank) {
  {
    RankOutput output(trial(), out_, err_);
    feed(output, "[1,0]<stdout>:loss 0.5\n[1,1]<stdout>:loss 0.6\n");
    feed(output, "[1,1]<stderr>:warning: slow\n");
    // A line cut across two reads, and one whose text already names its rank.
    feed(output, "[1,0]<stdout>:epo");
    feed(output, "ch 2\n[1,1]<stdout>:[rank 1] INFO ready\n");
    EXPECT_THAT(output.tail(1), ElementsAre("loss 0.6", "warning: slow", "[rank 1] INFO ready"));
    EXPECT_THAT(output.tail(0), ElementsAre("loss 0.5", "epoch 2"));
    EXPECT_TRUE(output.mpirun_text().empty());
  }
  EXPECT_EQ(read_file(out_path_), "[rank 0] loss 0.5\n[rank 1] loss 0.6\n[rank 0] epoch 2\n[rank 1] INFO ready\n");
  EXPECT_EQ(read_file(err_path_), "[rank 1] warning: slow\n") << "a rank's stderr stays stderr";
  EXPECT_EQ(read_file(logs() + "/rank-0.log"), "loss 0.5\nepoch 2\n");
  EXPECT_EQ(read_file(logs() + "/rank-1.log"), "loss 0.6\nwarning: slow\n[rank 1] INFO ready\n");
  struct stat st {};
  ASSERT_EQ(::stat((logs() + "/rank-0.log").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u) << "logs are private";
}

TEST_F(RankOutputTest, MpirunsBoxesAreHeldUntilAFailureShowsThem) {
  const std::string box =
      "--------------------------------------------------------------------------\n"
      "mpirun detected that one or more processes exited with non-zero status\n"
      "--------------------------------------------------------------------------\n";
  RankOutput output(trial(), out_, err_);
  feed(output, "plain words from mpirun\n", true);
  feed(output, box, true);
  feed(output, "[1,0]<stdout>:after the box\n");
  EXPECT_EQ(read_file(err_path_), "plain words from mpirun\n");
  EXPECT_EQ(read_file(out_path_), "[rank 0] after the box\n") << "the box does not swallow what follows it";
  EXPECT_THAT(output.mpirun_text(), HasSubstr("exited with non-zero status"));
  EXPECT_THAT(read_file(logs() + "/mpirun.log"), HasSubstr("exited with non-zero status")) << "always filed";
  output.show_held();
  EXPECT_EQ(read_file(err_path_), "plain words from mpirun\n" + box);
}

TEST_F(RankOutputTest, APartialLastLineIsWrittenOnFlushAndTheTailIsBounded) {
  RankOutput output(trial(), out_, err_);
  for (int i = 0; i < 100; ++i) feed(output, "[1,2]<stdout>:line " + std::to_string(i) + "\n");
  feed(output, "[1,2]<stdout>:no newline");
  output.flush();
  const auto tail = output.tail(2);
  ASSERT_EQ(tail.size(), 30u);
  EXPECT_EQ(tail.back(), "no newline");
  EXPECT_EQ(tail.front(), "line 71");
  EXPECT_THAT(read_file(out_path_), HasSubstr("[rank 2] no newline\n"));
}

TEST_F(RankOutputTest, AVeryLongLineIsCutNotKeptWhole) {
  RankOutput output(trial(), out_, err_);
  feed(output, std::string(200 * 1024, 'x'));
  EXPECT_EQ(read_file(logs() + "/mpirun.log").size(), 3u * (64 * 1024 + 1)) << "three full pieces so far";
}

TEST(ParseMpirunFailure, ANonZeroExit) {
  const auto f = parse_mpirun_failure(
      "mpirun detected that one or more processes exited with non-zero status, thus causing\n"
      "the job to be terminated. The first process to do so was:\n\n"
      "  Process name: [[40177,1],1]\n"
      "  Exit code:    3\n");
  EXPECT_EQ(f.rank, 1);
  EXPECT_EQ(f.exit_code, 3);
  EXPECT_FALSE(f.signal.has_value());
  EXPECT_EQ(f.how, "exited with code 3");
}

TEST(ParseMpirunFailure, ASignal) {
  const auto f = parse_mpirun_failure(
      "mpirun noticed that process rank 2 with PID 0 on node cn042 exited on signal 9 (Killed).\n");
  EXPECT_EQ(f.rank, 2);
  EXPECT_EQ(f.host, "cn042");
  EXPECT_EQ(f.signal, 9);
  EXPECT_EQ(f.how, "was killed by signal 9 (Killed)");
}

TEST(ParseMpirunFailure, ASignalWithoutItsNameAcrossLines) {
  const auto f = parse_mpirun_failure("mpirun noticed that process rank 3 with PID 1234 on\nnode cn7 exited on signal 11.\n");
  EXPECT_EQ(f.rank, 3);
  EXPECT_EQ(f.host, "cn7");
  EXPECT_EQ(f.signal, 11);
  EXPECT_THAT(f.how, HasSubstr("signal 11 ("));
}

TEST(ParseMpirunFailure, MpiAbort) {
  const auto f = parse_mpirun_failure(
      "MPI_ABORT was invoked on rank 1 in communicator MPI_COMM_WORLD\nwith errorcode 7.\n\n"
      "NOTE: invoking MPI_ABORT causes Open MPI to kill all MPI processes.\n");
  EXPECT_EQ(f.rank, 1);
  EXPECT_EQ(f.exit_code, 7);
  EXPECT_EQ(f.how, "called MPI_Abort with code 7");
}

TEST(ParseMpirunFailure, AnEarlyCleanExit) {
  const auto f = parse_mpirun_failure(
      "mpirun has exited due to process rank 1 with PID 0 on\nnode ws01 exiting improperly. There are three reasons "
      "this could occur:\n");
  EXPECT_EQ(f.rank, 1);
  EXPECT_EQ(f.host, "ws01");
  EXPECT_EQ(f.exit_code, 0);
  EXPECT_THAT(f.how, HasSubstr("exited before the others"));
}

TEST(ParseMpirunFailure, NothingKnownMeansNoRank) {
  EXPECT_EQ(parse_mpirun_failure("").rank, -1);
  EXPECT_EQ(parse_mpirun_failure("Warning: Permanently added 'cn1' to the list of known hosts.\n").rank, -1);
}

core::HeartbeatRecord rank_record(long long step, core::RankPhase phase, std::optional<core::RankEnd> end = {}) {
  core::HeartbeatRecord r;
  r.step = step;
  r.phase = phase;
  r.pid = 100;
  r.host = "cn1";
  r.end = end;
  return r;
}

const char kMpirunSawRank0Killed[] =
    "mpirun noticed that process rank 0 with PID 0 on node cn1 exited on signal 9 (Killed).\n";

// The rank's own record wins over mpirun's report, whatever order they were seen in: mpirun
// reports whichever rank it noticed first, which may be one the launcher killed.
TEST(AttributeFailure, TheRanksOwnRecordWinsOverMpirun) {
  using core::RankEnd;
  using core::RankPhase;
  const std::vector<std::pair<int, core::HeartbeatRecord>> records = {
      {0, rank_record(12, RankPhase::kAgreement)},
      {1, rank_record(12, RankPhase::kBatch, RankEnd{RankEnd::Kind::kExit, 3, 1000})}};
  const RankFailure f = attribute_failure(records, std::nullopt, kMpirunSawRank0Killed, std::nullopt);
  EXPECT_EQ(f.rank, 1);
  EXPECT_EQ(f.exit_code, 3);
  EXPECT_FALSE(f.signal.has_value());
  EXPECT_EQ(f.how, "exited with code 3");
  EXPECT_EQ(f.phase, "batch");
  EXPECT_EQ(f.step, 12);
  EXPECT_EQ(f.host, "cn1");
}

TEST(AttributeFailure, TheEarliestFailedEndIsTheCause) {
  using core::RankEnd;
  using core::RankPhase;
  auto abort = rank_record(5, RankPhase::kCheckpoint, RankEnd{RankEnd::Kind::kAbort, 1, 2000});
  abort.message = "cannot write /x: No space left on device";
  const std::vector<std::pair<int, core::HeartbeatRecord>> records = {
      {0, abort},
      {1, rank_record(5, RankPhase::kAgreement, RankEnd{RankEnd::Kind::kSignal, 6, 2500})},
      {2, rank_record(5, RankPhase::kAgreement, RankEnd{RankEnd::Kind::kExit, 75, 100})}};
  const RankFailure f = attribute_failure(records, std::nullopt, "", std::nullopt);
  EXPECT_EQ(f.rank, 0) << "a 75 is no failure, and rank 1's abort came later";
  EXPECT_EQ(f.exit_code, 1);
  EXPECT_EQ(f.phase, "checkpoint");
  EXPECT_EQ(f.message, "cannot write /x: No space left on device");
}

TEST(AttributeFailure, TheWatchdogsVerdictNamesTheStuckRank) {
  const std::vector<std::pair<int, core::HeartbeatRecord>> records = {
      {0, rank_record(20, core::RankPhase::kAgreement)}, {1, rank_record(19, core::RankPhase::kEvaluate)}};
  const RankFailure f = attribute_failure(records, core::Verdict{{1}, "watchdog: allgather ...", {{0, "allgather #9 ... not finished"}, {1, "barrier #8 ..."}}},
                                          "MPI_ABORT was invoked on rank 0 in communicator MPI_COMM_WORLD\n"
                                          "with errorcode 1.\n",
                                          std::nullopt);
  EXPECT_EQ(f.rank, 1);
  EXPECT_THAT(f.how, HasSubstr("stopped answering"));
  EXPECT_EQ(f.phase, "evaluate");
  EXPECT_EQ(f.step, 19);
  EXPECT_FALSE(f.exit_code.has_value());
  EXPECT_EQ(f.flight, (std::vector<std::pair<int, std::string>>{{0, "allgather #9 ... not finished"}, {1, "barrier #8 ..."}}));
}

TEST(AttributeFailure, WithoutRecordsMpirunThenTheLaunchersOwnSight) {
  const std::vector<std::pair<int, core::HeartbeatRecord>> records = {
      {0, rank_record(7, core::RankPhase::kBatch)}, {1, rank_record(7, core::RankPhase::kValidation)}};
  RankFailure observed;
  observed.rank = 1;
  observed.how = "ended without an exit code (killed by a signal, or crashed)";
  RankFailure f = attribute_failure(records, std::nullopt,
                                    "mpirun noticed that process rank 1 with PID 0 on node cn1 exited on signal 9 "
                                    "(Killed).\n",
                                    observed);
  EXPECT_EQ(f.rank, 1);
  EXPECT_EQ(f.signal, 9) << "mpirun knows the signal that the launcher did not see";
  EXPECT_EQ(f.phase, "validation");
  f = attribute_failure(records, std::nullopt, "", observed);
  EXPECT_EQ(f.rank, 1);
  EXPECT_FALSE(f.signal.has_value());
  observed.signal = 9;  // the launcher read the zombie's status itself: exact
  observed.rank = 0;
  f = attribute_failure(records, std::nullopt, kMpirunSawRank0Killed, observed);
  EXPECT_EQ(f.rank, 0);
  EXPECT_EQ(attribute_failure({}, std::nullopt, "", std::nullopt).rank, -1);
}

TEST(ZombieStatus, AChildThatEndedButWasNotReaped) {
  const pid_t child = ::fork();
  if (child == 0) ::_exit(42);
  std::optional<int> status;
  for (int i = 0; i < 500 && !(status = zombie_status(child)); ++i) ::usleep(2000);
  ASSERT_TRUE(status.has_value());
  EXPECT_TRUE(WIFEXITED(*status));
  EXPECT_EQ(WEXITSTATUS(*status), 42);
  int reaped = 0;
  ::waitpid(child, &reaped, 0);
  EXPECT_FALSE(zombie_status(child).has_value()) << "gone once reaped";
  EXPECT_FALSE(zombie_status(::getpid()).has_value()) << "running";
}

}  // namespace
}  // namespace hpctrial::launcher::detail
