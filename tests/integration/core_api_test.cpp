// The core API in a program that is not a trial: ranks stop together, whether one of them asks
// or a signal arrives, and the chief's metrics land in metrics.jsonl and TensorBoard.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <signal.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <thread>

#include "../support/event_files.h"
#include "../support/background_process.h"
#include "../support/temp_dir.h"
#include "hpctrial/core/launch_contract.h"
#include "hpctrial/core/subprocess.h"

namespace hpctrial {
namespace core_api_test {  // named: the target compiles its sources together (UNITY_BUILD)

using testing::HasSubstr;
using testing::Not;
using testing_support::TempDir;

core::RunResult run_program(const std::vector<std::string>& launcher, const std::vector<std::string>& args,
                            const std::vector<std::pair<std::string, std::string>>& env = {}) {
  std::vector<std::string> argv = launcher;
  argv.push_back(HPCTRIAL_CORE_API_PROGRAM);
  argv.insert(argv.end(), args.begin(), args.end());
  core::RunOptions options;
  options.timeout = std::chrono::seconds(120);
  options.env_set = {{"OMPI_ALLOW_RUN_AS_ROOT", "1"}, {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"}};
  options.env_set.insert(options.env_set.end(), env.begin(), env.end());
  return core::run_process(argv, options);
}

// The step at which each rank said it stopped.
std::set<long> stop_steps(const std::string& out, int ranks) {
  std::set<long> steps;
  const std::regex line("rank ([0-9]+) stopped at step ([0-9]+)");
  int seen = 0;
  for (std::sregex_iterator it(out.begin(), out.end(), line), end; it != end; ++it, ++seen) {
    steps.insert(std::stol((*it)[2]));
  }
  EXPECT_EQ(seen, ranks) << out;
  return steps;
}

std::vector<nlohmann::json> lines(const std::string& path) {
  std::ifstream in(path);
  std::vector<nlohmann::json> out;
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line));
  return out;
}

TEST(CoreApi, AStopRequestedOnOneRankStopsEveryRankAtTheSameStep) {
  TempDir dir;
  const std::string trial_dir = (dir.path() / "run").string();
  const auto r = run_program({HPCTRIAL_MPIRUN, "-np", "2"}, {"--trial-dir", trial_dir, "request", "100"});
  ASSERT_TRUE(r.ok()) << r.describe() << "\n" << r.err;
  EXPECT_EQ(stop_steps(r.out, 2), std::set<long>{5});
  const auto metrics = lines(trial_dir + "/metrics.jsonl");
  ASSERT_EQ(metrics.size(), 3u);  // training at 2 and 4, validation at 5, the chief's only
  EXPECT_EQ(metrics[0]["kind"], "training");
  EXPECT_EQ(metrics[0]["batches"], 2);
  EXPECT_EQ(metrics[0]["metrics"]["rank"], 0);
  EXPECT_EQ(metrics[2]["kind"], "validation");
  EXPECT_EQ(metrics[2]["metrics"]["steps"], 5);
  // The same values in the chief's TensorBoard event file.
  const auto read = testing_support::read_events(testing_support::event_files(trial_dir + "/tensorboard"));
  ASSERT_TRUE(read.ok) << read.error;
  EXPECT_EQ(testing_support::scalars(read.events, "training/rank"),
            (std::vector<std::pair<std::int64_t, double>>{{2, 0.0}, {4, 0.0}}));
  EXPECT_EQ(testing_support::scalars(read.events, "validation/steps"),
            (std::vector<std::pair<std::int64_t, double>>{{5, 5.0}}));
}

TEST(CoreApi, ASignalOnOneRankStopsEveryRank) {
  TempDir dir;
  const auto r = run_program({HPCTRIAL_MPIRUN, "-np", "2"},
                             {"--trial-dir", (dir.path() / "run").string(), "signal", "100"});
  ASSERT_TRUE(r.ok()) << r.describe() << "\n" << r.err;
  EXPECT_EQ(stop_steps(r.out, 2), std::set<long>{3});
}

TEST(CoreApi, SigusrToMpirunStopsEveryRankTogether) {
  TempDir dir;
  const std::string beats = (dir.path() / "heartbeat").string();
  std::filesystem::create_directory(beats);
  testing_support::BackgroundProcess mpirun(
      {HPCTRIAL_MPIRUN, "-np", "2", HPCTRIAL_CORE_API_PROGRAM, "--trial-dir", (dir.path() / "run").string(), "wait",
       "3000"},
      {{"OMPI_ALLOW_RUN_AS_ROOT", "1"}, {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"}, {core::kEnvHeartbeatDir, beats}},
      (dir.path() / "output").string());
  // SIGUSR2 to mpirun once both ranks have reported a step (their handlers are in place: a
  // signal before that would end them), however long start-up takes; mpirun forwards it.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(90);
  const auto both_stepping = [&] {
    const auto records = core::read_heartbeats(beats);
    return records.size() == 2 && records.begin()->second.step >= 1 && records.rbegin()->second.step >= 1;
  };
  while (!both_stepping() && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_TRUE(both_stepping()) << "the ranks never reported a step\n" << mpirun.output();
  mpirun.signal(SIGUSR2);
  ASSERT_TRUE(mpirun.wait(std::chrono::seconds(60)).has_value()) << "the ranks did not stop\n" << mpirun.output();
  ASSERT_EQ(mpirun.exit_code(), 0) << mpirun.output();
  const auto steps = stop_steps(mpirun.output(), 2);
  ASSERT_EQ(steps.size(), 1u) << "the ranks stopped at different steps";
  EXPECT_LT(*steps.begin(), 3000);
}

TEST(CoreApi, TheLaunchersStopFileAndHeartbeatRecordsReachAProgram) {
  TempDir dir;
  const std::string stop = dir.write("stop-request", "pause\n");
  const std::string beats = (dir.path() / "heartbeat").string();
  std::filesystem::create_directory(beats);
  const auto r = run_program({HPCTRIAL_MPIRUN, "-np", "2"}, {"--trial-dir", (dir.path() / "run").string(), "wait", "3000"},
                             {{core::kEnvStopFile, stop}, {core::kEnvHeartbeatDir, beats}});
  ASSERT_TRUE(r.ok()) << r.describe() << "\n" << r.err;
  const auto steps = stop_steps(r.out, 2);
  ASSERT_EQ(steps.size(), 1u) << "the ranks stopped at different steps";
  EXPECT_LT(*steps.begin(), 100) << "the stop file was not seen";
  const auto records = core::read_heartbeats(beats);
  ASSERT_EQ(records.size(), 2u);
  for (const auto& [rank, record] : records) {
    EXPECT_EQ(record.step, *steps.begin()) << "rank " << rank;  // the last report's step
    ASSERT_TRUE(record.end.has_value()) << "rank " << rank;
    EXPECT_EQ(record.end->kind, core::RankEnd::Kind::kExit);
    EXPECT_EQ(record.end->code, 0);
  }
}

// On the chief and on another rank: the failing rank's peers wait for it in should_stop().
TEST(CoreApi, AnExceptionLeavingTheContextOnOneRankEndsTheJobInsteadOfHangingItsPeers) {
  for (const auto& [mode, failing] : {std::pair{"throw-chief", 0}, std::pair{"throw", 1}}) {
    TempDir dir;
    const std::string beats = (dir.path() / "heartbeat").string();
    std::filesystem::create_directory(beats);
    const auto r = run_program({HPCTRIAL_MPIRUN, "-np", "2"}, {"--trial-dir", (dir.path() / "run").string(), mode, "100000"},
                               {{core::kEnvHeartbeatDir, beats}});
    EXPECT_FALSE(r.ok()) << mode;
    EXPECT_FALSE(r.timed_out) << mode << ": the other rank waited for the failed one";
    EXPECT_THAT(r.err, HasSubstr("an exception left the scope of hpctrial::CoreContext")) << mode;
    bool recorded = false;
    for (const auto& [rank, record] : core::read_heartbeats(beats)) {
      if (rank == failing && record.end && record.end->kind == core::RankEnd::Kind::kAbort) recorded = true;
    }
    EXPECT_TRUE(recorded) << mode << ": rank " << failing << " did not record its abort";
  }
  TempDir dir;
  const auto alone = run_program({}, {"--trial-dir", (dir.path() / "alone").string(), "throw", "10"});
  EXPECT_EQ(alone.exit_code, 3) << alone.describe() << "\n" << alone.err;
  EXPECT_THAT(alone.err, HasSubstr("caught: bad record"));
}

// Epochs and accumulators across restarts at other numbers of ranks: 2 ranks stop in epoch 1
// (batch 7 of 5 a epoch), 4 ranks go on to stop in epoch 3, 1 rank finishes. Every epoch saw
// each of the 40 samples once, and a loop inside the loop is refused.
TEST(CoreApi, EpochsAndAccumulatorsContinueAcrossRestartsAtOtherNumbersOfRanks) {
  TempDir dir;
  const std::string trial_dir = (dir.path() / "run").string();
  const auto first = run_program({HPCTRIAL_MPIRUN, "-np", "2"}, {"--trial-dir", trial_dir, "epochs", "5", "7"});
  ASSERT_EQ(first.exit_code, 75) << first.describe() << "\n" << first.err;
  EXPECT_THAT(first.out, HasSubstr("rank 0 epoch 0 from 0"));
  EXPECT_THAT(first.out, HasSubstr("nested: remaining_epochs_until(5) was called inside the loop of another (in epoch 0)"));
  EXPECT_THAT(first.out, HasSubstr("rank 1 saved after 7 batches"));
  const auto second = run_program({HPCTRIAL_MPIRUN, "-np", "4", "--oversubscribe"},
                                  {"--trial-dir", trial_dir, "epochs", "5", "18"});
  ASSERT_EQ(second.exit_code, 75) << second.describe() << "\n" << second.err;
  EXPECT_THAT(second.out, HasSubstr("rank 3 epoch 1 from 16"));  // epoch 0 skipped, epoch 1 continued
  EXPECT_THAT(second.out, Not(HasSubstr("epoch 0 from")));
  const auto last = run_program({}, {"--trial-dir", trial_dir, "epochs", "5", "0"});
  ASSERT_TRUE(last.ok()) << last.describe() << "\n" << last.err;
  EXPECT_THAT(last.out, HasSubstr("rank 0 epoch 3 from 24"));
  EXPECT_THAT(last.out, HasSubstr("finished 5 epochs: epoch0=40 epoch1=40 epoch2=40 epoch3=40 epoch4=40 "
                                  "epochs_counted=5 index_sum=3900 records=200"));
  EXPECT_EQ(std::filesystem::status(trial_dir + "/core-state.json").permissions() & std::filesystem::perms::others_all,
            std::filesystem::perms::none);
}

// As AdaptDL's remaining_epochs_until: leaving the loop by a break or an exception finishes the
// epoch it left.
TEST(CoreApi, ABreakOrAnExceptionOutOfAnEpochLoopFinishesThatEpoch) {
  TempDir dir;
  const auto r = run_program({}, {"--trial-dir", (dir.path() / "run").string(), "epoch-exits"});
  ASSERT_TRUE(r.ok()) << r.describe() << "\n" << r.err;
  EXPECT_THAT(r.out, HasSubstr("after a break in epoch 1: finished 2\n"));
  EXPECT_THAT(r.out, HasSubstr("after an exception in epoch 2: finished 3, current none\n"));
}

TEST(CoreApi, TheConfigIsReadAndHpctrialOptionsAreTakenOutOfArgv) {
  TempDir dir;
  const std::string config = dir.write("exp.yaml",
      "name: core-program\nentrypoint: ./core_api_program\nsearcher: {name: single, metric: loss, "
      "max_length: {batches: 10}}\nhyperparameters: {global_batch_size: 4}\n");
  const std::string trial_dir = (dir.path() / "run").string();
  const auto r = run_program({}, {"--config", config, "--trial-dir=" + trial_dir, "request", "7"});
  ASSERT_TRUE(r.ok()) << r.describe() << "\n" << r.err;
  EXPECT_THAT(r.out, HasSubstr("rank 0 stopped at step 5"));
  std::ifstream effective(trial_dir + "/effective-config.yaml");
  std::stringstream text;
  text << effective.rdbuf();
  EXPECT_THAT(text.str(), HasSubstr("name: \"core-program\""));
  const auto bad = run_program({}, {"--config", (dir.path() / "missing.yaml").string(), "request", "7"});
  EXPECT_NE(bad.exit_code, 0);
}

}  // namespace core_api_test
}  // namespace hpctrial
