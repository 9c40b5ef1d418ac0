// The rank runtime: the stop file, the rank record, and the fault hook.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <thread>

#include "hpctrial/rank/runtime.h"
#include "../../support/read_file.h"
#include "../../support/temp_dir.h"
#include "hpctrial/core/error.h"

namespace hpctrial::rank {
namespace {

using testing::HasSubstr;
using testing_support::read_file;
using testing_support::TempDir;
using namespace std::chrono_literals;

std::string message_of(const std::string& spec) {
  try {
    FaultPlan(spec, 0, 0);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(FaultPlan, KeepsOnlyTheFaultsOfThisRankAndRestart) {
  EXPECT_TRUE(FaultPlan("", 0, 0).empty());
  EXPECT_FALSE(FaultPlan("rank1:step7:sigkill", 1, 0).empty());
  EXPECT_TRUE(FaultPlan("rank1:step7:sigkill", 0, 0).empty());
  EXPECT_TRUE(FaultPlan("rank1:restart0:step7:sigkill", 1, 1).empty()) << "the restarted run goes on";
  EXPECT_FALSE(FaultPlan("step7:exit3", 5, 2).empty()) << "no rank or restart: every one";
  EXPECT_FALSE(FaultPlan("rank0:exit3,rank2:hang", 2, 0).empty());
}

TEST(FaultPlan, ActsAtItsPhaseAndStepOnly) {
  const FaultPlan plan("rank0:step7:validation:throw", 0, 0);
  EXPECT_NO_THROW(plan.at(FaultPhase::kBatch, 7));
  EXPECT_NO_THROW(plan.at(FaultPhase::kValidation, 6));
  EXPECT_THROW(plan.at(FaultPhase::kValidation, 7), std::runtime_error);
  const FaultPlan any_step("throw", 0, 0);
  EXPECT_THROW(any_step.at(FaultPhase::kBatch, 123), std::runtime_error) << "batch is the default phase";
  EXPECT_NO_THROW(any_step.at(FaultPhase::kCheckpoint, 123));
  // `writer` (or `shards`): on the thread that writes this rank's part, not as the checkpoint starts.
  for (const char* spec : {"step4:shards:throw", "step4:writer:throw"}) {
    const FaultPlan writer(spec, 0, 0);
    EXPECT_NO_THROW(writer.at(FaultPhase::kCheckpoint, 4)) << spec;
    EXPECT_THROW(writer.at(FaultPhase::kCheckpoint, 4, /*writer=*/true), std::runtime_error) << spec;
    EXPECT_NO_THROW(writer.at(FaultPhase::kCheckpoint, 2, /*writer=*/true)) << spec;
  }
  EXPECT_NO_THROW(FaultPlan("step4:checkpoint:throw", 0, 0).at(FaultPhase::kCheckpoint, 4, /*writer=*/true));
}

TEST(FaultPlan, SleepWaitsItsSecondsAndGoesOn) {
  const auto start = std::chrono::steady_clock::now();
  EXPECT_NO_THROW(FaultPlan("step3:sleep1,step3:throw", 0, 0).at(FaultPhase::kBatch, 2));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(500)) << "another step: no sleep";
  EXPECT_THROW(FaultPlan("step3:sleep1,step3:throw", 0, 0).at(FaultPhase::kBatch, 3), std::runtime_error)
      << "the faults after it still act";
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::seconds(1));
}

TEST(FaultPlan, ExitAndSignalActionsEndTheProcessAsAsked) {
  EXPECT_EXIT(FaultPlan("step2:exit3", 0, 0).at(FaultPhase::kBatch, 2), testing::ExitedWithCode(3),
              "injected fault step2:exit3 on rank 0 at step 2");
  EXPECT_EXIT(FaultPlan("checkpoint:sigkill", 0, 0).at(FaultPhase::kCheckpoint, 1), testing::KilledBySignal(SIGKILL),
              "");
  EXPECT_EXIT(FaultPlan("segv", 0, 0).at(FaultPhase::kBatch, 1), testing::KilledBySignal(SIGSEGV), "");
  EXPECT_EXIT(FaultPlan("abort", 0, 0).at(FaultPhase::kBatch, 1), testing::KilledBySignal(SIGABRT), "");
}

TEST(FaultPlan, AnUnknownWordOrNoActionIsAnErrorNamingIt) {
  EXPECT_THAT(message_of("rank1:step7:explode"), HasSubstr("HPCTRIAL_FAULT: \"explode\" in \"rank1:step7:explode\""));
  EXPECT_THAT(message_of("rankone:exit1"), HasSubstr("\"rankone\""));
  EXPECT_THAT(message_of("rank1:step7"), HasSubstr("names no action"));
  EXPECT_THAT(message_of("exit1,bogus"), HasSubstr("\"bogus\""));
}

TEST(AbortWatch, ARankKillsItselfWhenTheLaunchersAbortFileAppears) {
  TempDir dir;
  const std::string path = (dir.path() / "abort-0").string();
  EXPECT_EXIT(
      {
        AbortWatch watch(path);
        std::ofstream(path) << "now\n";
        std::this_thread::sleep_for(5s);
        std::exit(0);
      },
      testing::KilledBySignal(SIGKILL), "the launcher ended this attempt");
  std::remove(path.c_str());
  {
    AbortWatch watch(path);
    AbortWatch nothing("");
    std::this_thread::sleep_for(700ms);
  }
  SUCCEED() << "no file, no exit; and the watch ends with its owner";
}

TEST(StopFile, SeenOnceItExistsAndRemembered) {
  TempDir dir;
  const std::string path = (dir.path() / "stop-request").string();
  StopFile stop(path);
  EXPECT_FALSE(stop.requested());
  dir.write("stop-request", "{}\n");
  EXPECT_FALSE(stop.requested()) << "looked at most once a second";
  std::this_thread::sleep_for(1100ms);
  EXPECT_TRUE(stop.requested());
  std::remove(path.c_str());
  EXPECT_TRUE(stop.requested()) << "a request is not taken back";
}

core::HeartbeatRecord decoded(const std::string& path) {
  const auto r = core::heartbeat_decode(read_file(path));
  EXPECT_TRUE(r.has_value()) << read_file(path);
  return r.value_or(core::HeartbeatRecord{});
}

TEST(RankRecord, SaysWhoAndWhereAtOnceAndEachStepAndPhaseAsTheyHappen) {
  TempDir dir;
  char host[256] = "";
  ::gethostname(host, sizeof host - 1);
  const std::string path = (dir.path() / "rank-3").string();
  {
    RankRecord record(dir.path().string(), 3);
    EXPECT_EQ(RankRecord::current(), &record);
    auto r = decoded(path);
    EXPECT_EQ(r.step, -1);
    EXPECT_EQ(r.pid, ::getpid());
    EXPECT_EQ(r.host, host);
    EXPECT_FALSE(r.end.has_value());
    record_step(17);
    record_phase(core::RankPhase::kCheckpoint);
    r = decoded(path);  // no wait: the file is the mapped record
    EXPECT_EQ(r.step, 17);
    EXPECT_EQ(r.phase, core::RankPhase::kCheckpoint);
    {
      PhaseRecord validating(core::RankPhase::kValidation);
      EXPECT_EQ(decoded(path).phase, core::RankPhase::kValidation);
    }
    EXPECT_EQ(decoded(path).phase, core::RankPhase::kCheckpoint) << "the phase before comes back";
    EXPECT_NO_THROW(record.check());
  }
  EXPECT_EQ(RankRecord::current(), nullptr);
}

TEST(RankRecord, APhaseLeftByAnExceptionStaysRecorded) {
  TempDir dir;
  RankRecord record(dir.path().string(), 0);
  record_phase(core::RankPhase::kBatch);
  try {
    PhaseRecord checkpointing(core::RankPhase::kCheckpoint);
    throw std::runtime_error("disk full");
  } catch (const std::runtime_error&) {
  }
  EXPECT_EQ(current_phase(), core::RankPhase::kCheckpoint) << "where the failure happened";
}

TEST(RankRecord, RecordsHowTheRankEnded) {
  TempDir dir;
  const std::string path = (dir.path() / "rank-1").string();
  EXPECT_EXIT(
      {
        RankRecord record(dir.path().string(), 1);
        record_phase(core::RankPhase::kEvaluate);
        std::exit(3);
      },
      testing::ExitedWithCode(3), "");
  auto r = decoded(path);
  ASSERT_TRUE(r.end.has_value());
  EXPECT_EQ(r.end->kind, core::RankEnd::Kind::kExit);
  EXPECT_EQ(r.end->code, 3);
  EXPECT_EQ(r.phase, core::RankPhase::kEvaluate);

  EXPECT_EXIT(
      {
        RankRecord record(dir.path().string(), 1);
        record_phase(core::RankPhase::kAgreement);
        ::raise(SIGSEGV);
      },
      testing::KilledBySignal(SIGSEGV), "");
  r = decoded(path);
  ASSERT_TRUE(r.end.has_value());
  EXPECT_EQ(r.end->kind, core::RankEnd::Kind::kSignal);
  EXPECT_EQ(r.end->code, SIGSEGV);
  EXPECT_EQ(r.phase, core::RankPhase::kAgreement);

  EXPECT_EXIT(
      {
        RankRecord record(dir.path().string(), 1);
        record_abort(1, "cannot write /exp/metrics.jsonl: No space left on device");
        std::exit(1);  // as MPI_Abort ends it: the exit does not overwrite the abort
      },
      testing::ExitedWithCode(1), "");
  r = decoded(path);
  ASSERT_TRUE(r.end.has_value());
  EXPECT_EQ(r.end->kind, core::RankEnd::Kind::kAbort);
  EXPECT_EQ(r.message, "cannot write /exp/metrics.jsonl: No space left on device");
}

// exit() from inside the training loop ends the process at once with its code: the exit
// handlers registered before the record (HDF5's closing of its library, say) would run while
// the harness's threads still use what they close. At start-up and shutdown they run as usual.
TEST(RankRecord, AnExitFromInsideTheLoopSkipsTheLaterExitHandlers) {
  // A fresh process for each case (the order of exit handlers is the process's history): the
  // child runs this test again from the top, and finds its directory in the environment.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  std::optional<TempDir> owned;
  const char* given = std::getenv("HPCTRIAL_EXIT_HANDLER_TEST_DIR");
  if (given == nullptr) {
    owned.emplace();
    ::setenv("HPCTRIAL_EXIT_HANDLER_TEST_DIR", owned->path().c_str(), 1);
  }
  const std::string dir = given != nullptr ? given : owned->path().string();
  static std::string marker;
  marker = dir + "/handler-ran";
  const auto program = [&](core::RankPhase phase) {
    std::atexit([] { std::ofstream(marker) << "ran\n"; });
    RankRecord record(dir, 0);
    record_phase(phase);
    std::exit(3);
  };
  EXPECT_EXIT(program(core::RankPhase::kBatch), testing::ExitedWithCode(3), "");
  EXPECT_FALSE(std::filesystem::exists(marker)) << "an earlier exit handler ran during training";
  EXPECT_EQ(decoded(dir + "/rank-0").end->code, 3);
  EXPECT_EXIT(program(core::RankPhase::kShutdown), testing::ExitedWithCode(3), "");
  EXPECT_TRUE(std::filesystem::exists(marker)) << "after the loop, exit handlers run as usual";
  ::unsetenv("HPCTRIAL_EXIT_HANDLER_TEST_DIR");
}

TEST(RankRecord, AFullDiskIsAnErrorNamingTheFile) {
  TempDir dir;
  const std::string path = (dir.path() / "rank-0").string();
  ASSERT_EQ(::symlink("/dev/full", path.c_str()), 0);  // every write: ENOSPC
  try {
    RankRecord record(dir.path().string(), 0);
    FAIL() << "a record on a full disk";
  } catch (const IoError& e) {
    EXPECT_THAT(e.what(), HasSubstr("the heartbeat file " + path));
    EXPECT_THAT(e.what(), HasSubstr("No space left on device"));
  }
}

}  // namespace
}  // namespace hpctrial::rank
