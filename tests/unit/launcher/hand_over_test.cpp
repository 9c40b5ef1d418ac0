// The launcher's hand-over of a stopped trial (launcher/src/hand_over.cpp): a failing scheduler
// command tried again with a growing delay, and a hand-over that still fails recorded in the
// trial's launcher state with the command that resumes the trial by hand.
#include <signal.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <fstream>
#include <memory>

#include "../../support/temp_dir.h"
#include "hand_over.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/experiment_dir.h"
#include "hpctrial/core/json_file.h"
#include "hpctrial/launcher/schedulers.h"

namespace hpctrial::launcher {
namespace {

using namespace std::chrono_literals;
using detail::RetryPolicy;
using testing::ElementsAre;
using testing::HasSubstr;

// A runner whose commands fail `failures` times, then succeed; records each argv.
struct FlakyRunner {
  explicit FlakyRunner(int failures_, bool time_out_ = false) : failures(failures_), time_out(time_out_) {}
  int failures;
  bool time_out;
  std::vector<std::vector<std::string>> ran;
  core::CommandRunner runner() {
    return [this](const std::vector<std::string>& argv, const core::RunOptions&) {
      ran.push_back(argv);
      core::RunResult r;
      r.argv = argv;
      r.timed_out = time_out;
      r.exit_code = static_cast<int>(ran.size()) <= failures ? 1 : 0;
      if (r.exit_code != 0) r.err = "slurm_requeue error: Unable to contact slurm controller (connect failure)";
      return r;
    };
  }
};

// A policy whose waits are recorded instead of slept.
RetryPolicy recording(std::vector<std::chrono::milliseconds>& waits) {
  RetryPolicy policy;
  policy.sleep = [&waits](std::chrono::milliseconds d) { waits.push_back(d); };
  return policy;
}

TEST(RetryingRunner, RunsAFailingCommandThreeTimesWithAGrowingDelay) {
  FlakyRunner flaky{100};
  std::vector<std::chrono::milliseconds> waits;
  auto tries = std::make_shared<int>(0);
  const auto run = detail::retrying_runner(flaky.runner(), recording(waits), tries);
  const core::RunResult r = run({"scontrol", "requeue", "12"}, {});
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(flaky.ran.size(), 3u);
  EXPECT_EQ(*tries, 3);
  EXPECT_THAT(waits, ElementsAre(2000ms, 6000ms)) << "8 s of waits in all, then the failure is returned";
}

TEST(RetryingRunner, StopsAtTheFirstSuccessAndNeverRepeatsACommandThatTimedOut) {
  FlakyRunner flaky{1};
  std::vector<std::chrono::milliseconds> waits;
  auto tries = std::make_shared<int>(0);
  EXPECT_TRUE(detail::retrying_runner(flaky.runner(), recording(waits), tries)({"qsub", "x"}, {}).ok());
  EXPECT_EQ(flaky.ran.size(), 2u);
  EXPECT_EQ(*tries, 2);
  EXPECT_THAT(waits, ElementsAre(2000ms));

  FlakyRunner slow{100, true};  // a qsub whose answer was lost may have submitted the job
  waits.clear();
  EXPECT_TRUE(detail::retrying_runner(slow.runner(), recording(waits), tries)({"qsub", "x"}, {}).timed_out);
  EXPECT_EQ(slow.ran.size(), 1u);
  EXPECT_EQ(*tries, 1);
  EXPECT_TRUE(waits.empty());
}

class HandOverTrial : public testing::Test {
 protected:
  core::HandOver stopped(const std::string& scheduler, const std::string& job, bool hold) const {
    core::HandOver h;
    h.allocation.scheduler = scheduler;
    h.allocation.job_id = job;
    h.experiment_dir = dir_.path().string();
    h.trial = 0;
    h.hold = hold;
    return h;
  }
  std::string trial_dir() const { return dir_.path().string() + "/trial-0"; }
  testing_support::TempDir dir_;
};

TEST_F(HandOverTrial, AFailingRequeueIsTriedThreeTimesThenRecordedWithTheCommandToResume) {
  std::filesystem::create_directories(trial_dir());
  core::write_json_file(core::TrialLayout{trial_dir()}.launcher_state_file(), {{"starts", 2}, {"failures", 1}});
  FlakyRunner flaky{100};
  core::HandOver h = stopped("slurm", "12", false);
  h.run = flaky.runner();
  std::vector<std::chrono::milliseconds> waits;
  const auto failed = detail::hand_over_trial(scheduler("slurm"), h, trial_dir(), recording(waits));
  ASSERT_TRUE(failed.has_value());
  EXPECT_THAT(flaky.ran, ElementsAre(ElementsAre("scontrol", "requeue", "12"), ElementsAre("scontrol", "requeue", "12"),
                                     ElementsAre("scontrol", "requeue", "12")));
  EXPECT_THAT(waits, ElementsAre(2000ms, 6000ms));
  EXPECT_EQ(failed->tries, 3);
  EXPECT_EQ(failed->job, "12");
  EXPECT_EQ(failed->resume, "scontrol requeue 12");
  EXPECT_THAT(failed->error, HasSubstr("cannot requeue slurm job 12: 'scontrol requeue 12' exited with code 1: "
                                       "slurm_requeue error: Unable to contact slurm controller"));
  // In the launcher state, beside what was there, as describe reads it.
  const auto state = core::read_json_file(core::TrialLayout{trial_dir()}.launcher_state_file());
  EXPECT_EQ(state["starts"], 2);
  EXPECT_EQ(state["failures"], 1);
  EXPECT_EQ(state[core::kFailedHandOverKey]["resume"], "scontrol requeue 12");
  EXPECT_EQ(state[core::kFailedHandOverKey]["tries"], 3);
  const auto progress = core::trial_progress({dir_.path().string()}, 0);
  ASSERT_TRUE(progress.failed_hand_over.has_value());
  EXPECT_EQ(progress.failed_hand_over->resume, "scontrol requeue 12");
  EXPECT_EQ(progress.failed_hand_over->error, failed->error);
  EXPECT_FALSE(progress.failed_hand_over->time.empty());
}

TEST_F(HandOverTrial, ARequeueThatSucceedsOnItsSecondTryRecordsNothing) {
  std::filesystem::create_directories(trial_dir());
  FlakyRunner flaky{1};
  core::HandOver h = stopped("slurm", "13", true);
  h.run = flaky.runner();
  std::vector<std::chrono::milliseconds> waits;
  EXPECT_FALSE(detail::hand_over_trial(scheduler("slurm"), h, trial_dir(), recording(waits)).has_value());
  EXPECT_THAT(flaky.ran, ElementsAre(ElementsAre("scontrol", "requeuehold", "13"),
                                     ElementsAre("scontrol", "requeuehold", "13")));
  EXPECT_FALSE(core::trial_progress({dir_.path().string()}, 0).failed_hand_over.has_value());
}

// The requeue's own SIGTERM kills scontrol after the requeue took effect; the tries after it are
// told the job is pending: handed over, nothing recorded. A worker's hand-over that fails records
// nothing in any trial (the search loses the worker, not its trial).
TEST_F(HandOverTrial, ARequeueKilledByItsOwnSigtermHasTakenEffect) {
  std::filesystem::create_directories(trial_dir());
  std::vector<std::vector<std::string>> ran;
  core::HandOver h = stopped("slurm", "14_1", true);
  h.run = [&ran](const std::vector<std::string>& argv, const core::RunOptions&) {
    ran.push_back(argv);
    core::RunResult r;
    r.argv = argv;
    if (ran.size() == 1) {
      r.signal = SIGTERM;
    } else {
      r.exit_code = 1;
      r.err = "14_1: Job is pending execution";
    }
    return r;
  };
  std::vector<std::chrono::milliseconds> waits;
  EXPECT_FALSE(detail::hand_over_trial(scheduler("slurm"), h, trial_dir(), recording(waits)).has_value());
  EXPECT_EQ(ran.size(), 3u);
  EXPECT_FALSE(core::trial_progress({dir_.path().string()}, 0).failed_hand_over.has_value());

  FlakyRunner down{100};
  h.run = down.runner();
  h.worker = true;
  detail::hand_over_worker(scheduler("slurm"), h, recording(waits));
  EXPECT_EQ(down.ran.size(), 3u);
  EXPECT_FALSE(core::trial_progress({dir_.path().string()}, 0).failed_hand_over.has_value());
}

// A job that leaves a node out waits held until its ExcNodeList has it with those it had (a
// hostlist of the user's own), then is released; a paused one stays held. One that cannot be
// updated is recorded with the commands that finish the hand-over.
TEST_F(HandOverTrial, ALeftOutNodeJoinsTheJobsExcNodeListWhileItIsHeld) {
  std::filesystem::create_directories(trial_dir());
  std::vector<std::vector<std::string>> ran;
  bool update_fails = false;
  core::HandOver h = stopped("slurm", "15", false);
  h.exclude_nodes = {"n7", "n2"};
  h.run = [&](const std::vector<std::string>& argv, const core::RunOptions&) {
    ran.push_back(argv);
    core::RunResult r;
    r.argv = argv;
    r.exit_code = 0;
    if (argv[1] == "-o") r.out = "JobId=15 JobName=e UserId=u(0) JobState=PENDING Partition=p ExcNodeList=n[1-3],n7\n";
    if (argv[1] == "update" && update_fails) {
      r.exit_code = 1;
      r.err = "slurm_update error: Invalid node name specified";
    }
    return r;
  };
  std::vector<std::chrono::milliseconds> waits;
  EXPECT_FALSE(detail::hand_over_trial(scheduler("slurm"), h, trial_dir(), recording(waits)).has_value());
  EXPECT_THAT(ran, ElementsAre(ElementsAre("scontrol", "requeuehold", "15"),
                               ElementsAre("scontrol", "-o", "show", "job", "15"),
                               ElementsAre("scontrol", "update", "JobId=15", "ExcNodeList=n[1-3],n7,n2"),
                               ElementsAre("scontrol", "release", "15")));
  ran.clear();
  h.hold = true;
  EXPECT_FALSE(detail::hand_over_trial(scheduler("slurm"), h, trial_dir(), recording(waits)).has_value());
  ASSERT_EQ(ran.size(), 3u);
  EXPECT_THAT(ran.back(), ElementsAre("scontrol", "update", "JobId=15", "ExcNodeList=n[1-3],n7,n2"));
  update_fails = true;
  const auto failed = detail::hand_over_trial(scheduler("slurm"), h, trial_dir(), recording(waits));
  ASSERT_TRUE(failed.has_value());
  EXPECT_THAT(failed->error, HasSubstr("slurm job 15 is requeued and held, but cannot leave out n[1-3],n7,n2"));
  EXPECT_EQ(failed->resume, "scontrol update JobId=15 'ExcNodeList=n[1-3],n7,n2' && scontrol release 15");
}

TEST_F(HandOverTrial, ARecordOfTheWrongShapeIsAnErrorNamingTheFile) {
  std::filesystem::create_directories(trial_dir());
  std::ofstream(core::TrialLayout{trial_dir()}.launcher_state_file()) << R"({"starts": 1, "failed_hand_over": "yes"})";
  try {
    core::trial_progress({dir_.path().string()}, 0);
    FAIL() << "a string read as a hand-over record";
  } catch (const IoError& e) {
    EXPECT_THAT(e.what(), HasSubstr("launcher-state.json: \"failed_hand_over\" holds \"yes\", which is not an object"));
  }
}

}  // namespace
}  // namespace hpctrial::launcher
