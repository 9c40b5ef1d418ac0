// The schedulers behind core::Scheduler: the registry, the neutral job states, and the Slurm and
// PBS implementations over fake runners (the argv they run for pause, activate and cancel).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>

#include <unistd.h>

#include "../../support/temp_dir.h"
#include "hpctrial/core/config_node.h"
#include "hpctrial/core/diagnostics.h"
#include "hpctrial/core/env.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/experiment_dir.h"
#include "hpctrial/launcher/schedulers.h"
#include "hpctrial/pbs/scheduler.h"
#include "hpctrial/slurm/scheduler.h"

namespace hpctrial {
namespace {

using testing::ElementsAre;
using testing::HasSubstr;
using Argvs = std::vector<std::vector<std::string>>;

TEST(SchedulerRegistry, FindsEachSchedulerByNameAndByTheFormOfItsJobIds) {
  EXPECT_EQ(launcher::scheduler("slurm").name(), "slurm");
  EXPECT_EQ(launcher::scheduler("pbs").name(), "pbs");
  EXPECT_EQ(launcher::scheduler("local").name(), "local");
  EXPECT_EQ(launcher::schedulers().back()->name(), "local") << "asked last: every process runs in it";
  try {
    launcher::scheduler("lsf");
    FAIL() << "an unknown scheduler was found";
  } catch (const SchedulerError& e) {
    EXPECT_THAT(e.what(), HasSubstr("no scheduler is called \"lsf\"; hpctrial knows slurm, pbs, local"));
  }
  EXPECT_EQ(launcher::scheduler_of_job("1234")->name(), "slurm");
  EXPECT_EQ(launcher::scheduler_of_job("1234_3")->name(), "slurm");
  EXPECT_EQ(launcher::scheduler_of_job("1234.pbs1")->name(), "pbs");
  EXPECT_EQ(launcher::scheduler_of_job("1234[2].pbs1")->name(), "pbs");
  EXPECT_EQ(launcher::scheduler_of_job("runs/exp"), nullptr);
}

// The errors of `yaml` loaded as a config file against the registry, one "file:line:col: ..." a line.
std::string config_errors(const std::string& yaml, std::vector<std::string> overrides = {}) {
  testing_support::TempDir dir;
  const std::string path = dir.write("exp.yaml", "name: t\nentrypoint: ./trial\n"
                                                 "searcher: {name: single, metric: loss, max_length: {batches: 10}}\n" +
                                                     yaml);
  try {
    core::load_experiment_config({path, "", std::move(overrides)}, "", launcher::schedulers());
    return "";
  } catch (const ConfigError& e) {
    std::string text = e.what();
    for (std::size_t at; (at = text.find(path)) != std::string::npos;) text.replace(at, path.size(), "exp.yaml");
    return text;
  }
}

TEST(SchedulerRegistry, ScheduledTypeIsANameInTheRegistryAndEachVetsItsOwnOptions) {
  EXPECT_THAT(config_errors("scheduler: {type: slurmm}\n"),
              HasSubstr("exp.yaml:4:19: scheduler.type: unknown scheduler \"slurmm\"; use one of slurm, pbs, "
                        "local (did you mean 'slurm'?)"));
  EXPECT_THAT(config_errors("scheduler: {type: pbs, partition: gpu}\n"),
              HasSubstr("exp.yaml:4:35: scheduler.partition: is a Slurm option; PBS calls it scheduler.queue"));
  EXPECT_THAT(config_errors("scheduler: {type: pbs, qos: high}\n"),
              HasSubstr("exp.yaml:4:29: scheduler.qos: is a Slurm option that PBS does not have; remove it"));
  EXPECT_THAT(config_errors("scheduler: {type: slurm, queue: gpu}\n"),
              HasSubstr("exp.yaml:4:33: scheduler.queue: is a PBS option; Slurm calls it scheduler.partition"));
  // --set is checked the same way and named as the place it came from.
  EXPECT_THAT(config_errors("scheduler: {partition: gpu}\n", {"scheduler.type=pbs"}),
              HasSubstr("scheduler.partition: is a Slurm option; PBS calls it scheduler.queue"));
  EXPECT_THAT(config_errors("", {"scheduler.type=lsf"}),
              HasSubstr("--set scheduler.type=lsf: scheduler.type: unknown scheduler \"lsf\""));
  // Whatever a scheduler does not reject loads; local rejects nothing.
  EXPECT_EQ(config_errors("scheduler: {type: slurm, partition: gpu, qos: high, account: p1}\n"), "");
  EXPECT_EQ(config_errors("scheduler: {type: pbs, queue: workq@pbs01, account: p1}\n"), "");
  EXPECT_EQ(config_errors("scheduler: {partition: gpu, queue: workq}\n"), "");
  // A key no scheduler has, and a value an option cannot take, whichever scheduler runs it.
  EXPECT_EQ(config_errors("scheduler: {type: slurm, partiton: gpu}\n"),
            "exp.yaml:4:26: scheduler.partiton: unknown key; did you mean 'partition'?");
  EXPECT_THAT(config_errors("scheduler: {partition: \"gpu; rm -rf /\"}\n"),
              HasSubstr("scheduler.partition: must be a name of letters, digits"));
  EXPECT_THAT(config_errors("scheduler: {type: slurm, partition: a@b}\n"),
              HasSubstr("scheduler.partition: must be a name of letters, digits, '.', '_' and '-', got \"a@b\""));
}

TEST(SchedulerRegistry, ErrorsInATemplateNameTheTemplateFile) {
  testing_support::TempDir dir;
  const std::string tmpl = dir.write("site.yaml", "scheduler:\n  tpye: slurm\n");
  const std::string config = dir.write("exp.yaml", "name: t\nentrypoint: ./trial\n"
                                                   "searcher: {name: single, metric: loss, max_length: {batches: 10}}\n");
  try {
    core::load_experiment_config({config, tmpl, {}}, "", launcher::schedulers());
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()), tmpl + ":2:3: scheduler.tpye: unknown key; did you mean 'type'?");
  }
}

TEST(SchedulerRegistry, LocalHasNoJobsAndSaysWhatToDoInstead) {
  const std::string name = "local";  // a named string: GCC 13 warns of a reference through a temporary
  const core::Scheduler& local = launcher::scheduler(name);
  EXPECT_FALSE(local.available());
  const auto allocation = local.detect(core::MapEnv(), {});
  ASSERT_TRUE(allocation.has_value());
  EXPECT_FALSE(allocation->in_job());
  EXPECT_THROW(local.stop({"/x", ""}, core::StopMode::kPause), ConfigError);
  core::ExperimentConfig config;
  config.source_path = "exp.yaml";
  try {
    local.render_script(config, {});
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("exp.yaml: scheduler.type is local, so there is nothing to submit"));
  }
}

TEST(JobStates, MapEachSchedulersWordsToOneNeutralState) {
  slurm::JobInfo s;
  s.state = "PENDING";
  EXPECT_EQ(slurm::job_state(s), core::JobState::kQueued);
  s.reason = "JobHeldUser";
  EXPECT_EQ(slurm::job_state(s), core::JobState::kHeld);
  s.state = "RUNNING";
  EXPECT_EQ(slurm::job_state(s), core::JobState::kRunning);
  s.state = "COMPLETING";
  EXPECT_EQ(slurm::job_state(s), core::JobState::kEnding);
  s.state = "TIMEOUT";
  EXPECT_EQ(slurm::job_state(s), core::JobState::kEnded);
  pbs::JobInfo p;
  for (const auto& [word, state] : std::vector<std::pair<std::string, core::JobState>>{
           {"Q", core::JobState::kQueued}, {"H", core::JobState::kHeld}, {"R", core::JobState::kRunning},
           {"B", core::JobState::kRunning}, {"E", core::JobState::kEnding}, {"S", core::JobState::kSuspended},
           {"F", core::JobState::kEnded}, {"X", core::JobState::kEnded}}) {
    p.state = word;
    EXPECT_EQ(pbs::job_state(p), state) << word;
    EXPECT_EQ(p.active(), state != core::JobState::kEnded) << word;
  }
}

class SchedulerOverFakes : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = (std::filesystem::temp_directory_path() / ("hpctrial-scheduler-" + std::to_string(::getpid()))).string();
    std::filesystem::create_directories(dir_ + "/trial-0");
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  // A runner that records every argv and answers `show job`/`qstat` with `answer`.
  auto runner(std::string answer) {
    return [this, answer](const std::vector<std::string>& argv, const core::RunOptions&) {
      ran_.push_back(argv);
      core::RunResult r;
      r.argv = argv;
      r.exit_code = 0;
      if (argv[0] == "scontrol" && argv[1] == "-o") r.out = answer;
      if (argv[0] == "qstat") r.out = answer;
      return r;
    };
  }
  std::string dir_;
  Argvs ran_;
};

TEST_F(SchedulerOverFakes, SlurmPausesARunningJobWithTheStopRequestAndUsr2) {
  const slurm::Scheduler slurm{slurm::Client(runner(
      "JobId=7 JobName=exp UserId=u(0) JobState=RUNNING Reason=None Restarts=0 RunTime=00:00:09 "
      "StdOut=" + dir_ + "/slurm-7.err StdErr=" + dir_ + "/slurm-7.err"))};
  const auto steps = slurm.stop({dir_, "7"}, core::StopMode::kPause);
  ASSERT_EQ(steps.size(), 1u);
  EXPECT_EQ(steps[0].kind, core::StopStep::Kind::kStopping);
  EXPECT_EQ(steps[0].trial, 0);
  EXPECT_EQ(core::stop_reason(dir_ + "/trial-0"), "pause");
  EXPECT_EQ(ran_.back(), (std::vector<std::string>{"scancel", "--batch", "--signal=USR2", "--verbose", "7"}));
}

// The job read the request and requeued itself between the listing and the signal: no batch
// shell takes the signal; the job is stopping all the same, and a task found pending and not
// held is held.
TEST_F(SchedulerOverFakes, SlurmPausesAJobThatLeftRunningBeforeItsSignal) {
  int listed = 0;
  const slurm::Scheduler slurm{slurm::Client([&](const std::vector<std::string>& argv, const core::RunOptions&) {
    ran_.push_back(argv);
    core::RunResult r;
    r.argv = argv;
    r.exit_code = 0;
    const std::string state = listed++ == 0 ? "RUNNING Reason=None" : "PENDING Reason=BeginTime";
    if (argv[0] == "scontrol" && argv[1] == "-o") {
      r.out = "JobId=7 JobName=exp UserId=u(0) JobState=" + state + " Restarts=0 StdOut=" + dir_ + "/slurm-7.err";
    }
    if (argv[0] == "scancel") {
      r.exit_code = 1;
      r.err = "scancel: error: Kill job error on job id 7: Job can not be altered now, try again later\n";
    }
    return r;
  })};
  const auto steps = slurm.stop({dir_, "7"}, core::StopMode::kPause);
  ASSERT_EQ(steps.size(), 1u);
  EXPECT_EQ(steps[0].kind, core::StopStep::Kind::kStopping);
  EXPECT_EQ(core::stop_reason(dir_ + "/trial-0"), "pause");
  EXPECT_EQ(ran_.back(), (std::vector<std::string>{"scontrol", "hold", "7"}));
}

TEST_F(SchedulerOverFakes, SlurmHoldsAWaitingJobAndNamesAForgottenOne) {
  const slurm::Scheduler slurm{slurm::Client(runner(
      "JobId=8 JobName=exp UserId=u(0) JobState=PENDING Reason=Priority Restarts=0 RunTime=00:00:00 "
      "StdOut=" + dir_ + "/slurm-8.err"))};
  const auto steps = slurm.stop({dir_, "8"}, core::StopMode::kPause);
  ASSERT_EQ(steps.size(), 1u);
  EXPECT_EQ(steps[0].kind, core::StopStep::Kind::kHeld);
  EXPECT_EQ(ran_.back(), (std::vector<std::string>{"scontrol", "hold", "8"}));
  EXPECT_EQ(core::stop_reason(dir_ + "/trial-0"), "") << "a waiting job has no ranks to stop";
  const slurm::Scheduler forgetful{slurm::Client([](const std::vector<std::string>& argv, const core::RunOptions&) {
    core::RunResult r;
    r.argv = argv;
    r.exit_code = 1;
    r.err = "slurm_load_jobs error: Invalid job id specified";
    return r;
  })};
  try {
    forgetful.stop({dir_, "9"}, core::StopMode::kPause);
    FAIL();
  } catch (const SchedulerError& e) {
    EXPECT_THAT(e.what(), HasSubstr("slurm no longer knows job 9"));
  }
}

// `hpctrial cancel`: a running job's stop request says "cancel", and a waiting one is cancelled
// (it trained nothing since its checkpoint), on either scheduler.
TEST_F(SchedulerOverFakes, CancelAsksARunningJobToCheckpointAndEndsAWaitingOne) {
  const slurm::Scheduler running{slurm::Client(runner(
      "JobId=7 JobName=exp UserId=u(0) JobState=RUNNING Reason=None Restarts=0 RunTime=00:00:09 "
      "StdOut=" + dir_ + "/slurm-7.err"))};
  auto steps = running.stop({dir_, "7"}, core::StopMode::kEnd);
  ASSERT_EQ(steps.size(), 1u);
  EXPECT_EQ(steps[0].kind, core::StopStep::Kind::kStopping);
  EXPECT_EQ(core::stop_reason(dir_ + "/trial-0"), "cancel");
  EXPECT_EQ(ran_.back(), (std::vector<std::string>{"scancel", "--batch", "--signal=USR2", "--verbose", "7"}));
  std::filesystem::remove(core::TrialLayout{dir_ + "/trial-0"}.stop_file());
  const slurm::Scheduler waiting{slurm::Client(runner(
      "JobId=8 JobName=exp UserId=u(0) JobState=PENDING Reason=JobHeldUser Priority=0 Restarts=0 "
      "RunTime=00:00:00 StdOut=" + dir_ + "/slurm-8.err"))};
  steps = waiting.stop({dir_, "8"}, core::StopMode::kEnd);
  ASSERT_EQ(steps.size(), 1u);
  EXPECT_EQ(steps[0].kind, core::StopStep::Kind::kEnded);
  EXPECT_EQ(ran_.back(), (std::vector<std::string>{"scancel", "8"}));
  EXPECT_EQ(core::stop_reason(dir_ + "/trial-0"), "");

  core::record_job({dir_}, "pbs", "6.srv", -1);
  ran_.clear();
  const pbs::Scheduler pbs_running{pbs::Client(runner(
      "Job Id: 6.srv\n    job_state = R\n    Output_Path = login1:" + dir_ + "/pbs-scheduler.out\n"))};
  steps = pbs_running.stop({dir_, ""}, core::StopMode::kEnd);
  ASSERT_EQ(steps.size(), 1u);
  EXPECT_EQ(steps[0].kind, core::StopStep::Kind::kStopping);
  EXPECT_EQ(core::stop_reason(dir_ + "/trial-0"), "cancel");
  EXPECT_EQ(ran_.back(), (std::vector<std::string>{"qsig", "-s", "SIGURG", "6.srv"}));
  ran_.clear();
  const pbs::Scheduler pbs_held{pbs::Client(runner(
      "Job Id: 6.srv\n    job_state = H\n    Hold_Types = u\n    Output_Path = login1:" + dir_ +
      "/pbs-scheduler.out\n"))};
  steps = pbs_held.stop({dir_, ""}, core::StopMode::kEnd);
  ASSERT_EQ(steps.size(), 1u);
  EXPECT_EQ(steps[0].kind, core::StopStep::Kind::kEnded);
  EXPECT_EQ(ran_.back().front(), "qdel");
  EXPECT_EQ(ran_.back().back(), "6.srv");
}

// A running PBS job is paused by the stop request, naming the job, then SIGURG: `qsig` signals
// every process of the job, and the job's login shell dies of SIGUSR2 (with the job).
TEST_F(SchedulerOverFakes, PbsPausesARunningJobWithTheStopRequestThenSigurg) {
  core::record_job({dir_}, "pbs", "6.srv", -1);
  const pbs::Scheduler pbs{pbs::Client(runner(
      "Job Id: 6.srv\n    job_state = R\n    Output_Path = login1:" + dir_ + "/pbs-scheduler.out\n"))};
  const auto steps = pbs.stop({dir_, ""}, core::StopMode::kPause);
  ASSERT_EQ(steps.size(), 1u);
  EXPECT_EQ(steps[0].kind, core::StopStep::Kind::kStopping);
  EXPECT_EQ(core::stop_reason(dir_ + "/trial-0"), "pause");
  EXPECT_TRUE(core::stop_requested_for(dir_ + "/trial-0", "6.srv")) << "kept by the launcher of job 6.srv";
  EXPECT_FALSE(core::stop_requested_for(dir_ + "/trial-0", "7.srv"));
  ASSERT_EQ(ran_.size(), 2u) << "one qstat for every job of the experiment, then qsig";
  EXPECT_EQ(ran_[0][0], "qstat");
  EXPECT_EQ(ran_[1], (std::vector<std::string>{"qsig", "-s", "SIGURG", "6.srv"})) << "URG: the login shell ignores it";
}

// A recorded id PBS now gives to another job (the server was re-created and its ids began
// again) is not the experiment's: describe shows it unknown, and kill and pause leave it alone.
TEST_F(SchedulerOverFakes, PbsIgnoresAnotherJobThatGotARecordedIdAgain) {
  core::record_job({dir_}, "pbs", "0.srv", -1);
  std::filesystem::create_directories(dir_ + "-other");
  const pbs::Scheduler pbs{pbs::Client(runner(
      "Job Id: 0.srv\n    job_state = R\n    Job_Owner = u@h\n    Output_Path = h:" + dir_ + "-other/x.out\n"))};
  const auto jobs = pbs.trial_jobs({dir_}, 0, 1);
  ASSERT_EQ(jobs.size(), 1u);
  EXPECT_EQ(jobs[0].id, "0.srv");
  EXPECT_TRUE(jobs[0].native_state.empty()) << "shown as a job PBS no longer knows";
  EXPECT_TRUE(pbs.live_jobs({dir_}).empty());
  EXPECT_THROW(pbs.cancel({dir_, ""}), SchedulerError);
  EXPECT_THROW(pbs.stop({dir_, ""}, core::StopMode::kPause), SchedulerError);
  for (const auto& argv : ran_) EXPECT_EQ(argv[0], "qstat") << "nothing deleted or held";
  std::filesystem::remove_all(dir_ + "-other");
}

// The same for Slurm, where a verb refuses it outright: the message names the job, whose it is
// and the experiment directory, and nothing is held, released, signalled or cancelled.
TEST_F(SchedulerOverFakes, SlurmRefusesARecordedIdGivenToAnotherJob) {
  core::record_job({dir_}, "slurm", "7", -1);
  std::filesystem::create_directories(dir_ + "-other");
  for (const std::string state : {"RUNNING", "PENDING"}) {
    ran_.clear();
    const slurm::Scheduler slurm{slurm::Client(runner(
        "JobId=7 JobName=sleeper UserId=bob(1001) JobState=" + state + " Reason=JobHeldUser Restarts=0 "
        "RunTime=00:00:09 WorkDir=" + dir_ + "-other StdOut=" + dir_ + "-other/out.txt StdErr=" + dir_ +
        "-other/out.txt"))};
    const std::vector<std::pair<const char*, std::function<void()>>> verbs = {
        {"pause", [&] { slurm.stop({dir_, ""}, core::StopMode::kPause); }},
        {"activate", [&] { slurm.activate({dir_, ""}); }},
        {"kill", [&] { slurm.cancel({dir_, ""}); }}};
    for (const auto& [verb, act] : verbs) {
      try {
        act();
        ADD_FAILURE() << verb << " acted on another job";
      } catch (const SchedulerError& e) {
        EXPECT_THAT(e.what(), HasSubstr("slurm job 7 is not the job of " + dir_ + ": it is job \"sleeper\" of user "
                                        "1001, its output in " + dir_ + "-other/out.txt (working directory " +
                                        dir_ + "-other)")) << verb;
        EXPECT_THAT(e.what(), HasSubstr("nothing was signalled, held, released or cancelled")) << verb;
      }
    }
    for (const auto& argv : ran_) {
      EXPECT_THAT(argv, ElementsAre("scontrol", "-o", "show", "job", "7")) << "only asked, never acted";
    }
    EXPECT_EQ(core::stop_reason(dir_ + "/trial-0"), "") << "no stop request for another's job";
    EXPECT_TRUE(slurm.live_jobs({dir_}).empty()) << "a new submit is not refused for another's job";
    const auto jobs = slurm.trial_jobs({dir_}, 0, 1);
    ASSERT_EQ(jobs.size(), 1u);
    EXPECT_TRUE(jobs[0].native_state.empty()) << "describe shows the experiment's job as forgotten";
  }
  std::filesystem::remove_all(dir_ + "-other");
}

// A failing requeue is returned, with the command that requeues the job by hand (Slurm requeues
// an ended job while it still knows it); the launcher records it.
TEST_F(SchedulerOverFakes, SlurmReturnsAFailedRequeueWithTheCommandToRunByHand) {
  const slurm::Scheduler slurm;
  core::HandOver stopped;
  stopped.allocation.scheduler = "slurm";
  stopped.allocation.job_id = "12_3";
  stopped.experiment_dir = dir_;
  stopped.hold = true;
  stopped.run = [](const std::vector<std::string>& argv, const core::RunOptions&) {
    core::RunResult r;
    r.argv = argv;
    r.exit_code = 1;
    r.err = "scontrol: error: Invalid job id specified";
    return r;
  };
  const auto failed = slurm.hand_over(stopped);
  ASSERT_TRUE(failed.has_value());
  EXPECT_EQ(failed->resume, "scontrol requeuehold 12_3");
  EXPECT_THAT(failed->error, HasSubstr("cannot requeue slurm job 12_3: 'scontrol requeuehold 12_3' exited with "
                                       "code 1: scontrol: error: Invalid job id specified"));
  stopped.run = [](const std::vector<std::string>& argv, const core::RunOptions&) {
    core::RunResult r;
    r.argv = argv;
    r.exit_code = 0;
    return r;
  };
  EXPECT_FALSE(slurm.hand_over(stopped).has_value());
}

TEST_F(SchedulerOverFakes, PbsReturnsAFailedSubmissionWithTheQsubToRunByHand) {
  std::ofstream(dir_ + "/experiment.yaml") << "name: x\n";
  const pbs::Scheduler pbs;
  core::HandOver stopped;
  core::Diagnostics d;
  stopped.config = core::parse_experiment_config(
      core::parse_config_text("name: x\nentrypoint: /opt/trial\nscheduler: {type: pbs, environment: {TOKEN: '${env:MY_TOKEN}'}}\n"
                              "searcher: {name: single, metric: loss, max_length: {batches: 10}}\n", "exp.yaml", d), d);
  ASSERT_TRUE(d.empty()) << d.to_string();
  stopped.allocation.scheduler = "pbs";
  stopped.allocation.job_id = "4.srv";
  stopped.experiment_dir = dir_;
  stopped.hold = true;
  core::MapEnv env;
  env.set("TOKEN", "secret");
  stopped.env = &env;
  Argvs submitted;
  stopped.run = [&submitted](const std::vector<std::string>& argv, const core::RunOptions&) {
    submitted.push_back(argv);
    core::RunResult r;
    r.argv = argv;
    r.exit_code = 1;
    r.err = "qsub: cannot connect to server srv (errno=111)";
    return r;
  };
  const auto failed = pbs.hand_over(stopped);
  ASSERT_TRUE(failed.has_value());
  ASSERT_EQ(submitted.size(), 1u);
  EXPECT_THAT(submitted[0], testing::Contains("depend=afterany:4.srv"));
  // By hand, once the job has ended: no dependency and no hold; the submitter's values by name.
  EXPECT_EQ(failed->resume, "qsub -v TOKEN " + dir_ + "/trial-0/resume.pbs");
  EXPECT_THAT(failed->error, HasSubstr("cannot submit the pbs job that resumes trial 0: "));
  EXPECT_THAT(failed->error, HasSubstr("qsub: cannot connect to server srv (errno=111)"));
  EXPECT_TRUE(std::filesystem::exists(dir_ + "/trial-0/resume.pbs")) << "the script the command names";
  EXPECT_FALSE(core::latest_job({dir_}).has_value()) << "no job recorded";
}

TEST_F(SchedulerOverFakes, PbsHandsAStoppedJobOverToAHeldSuccessorRecordedForItsTrial) {
  std::ofstream(dir_ + "/experiment.yaml") << "name: x\n";
  const pbs::Scheduler pbs{pbs::Client(runner(""))};
  core::HandOver stopped;
  core::Diagnostics d;
  stopped.config = core::parse_experiment_config(
      core::parse_config_text("name: x\nentrypoint: /opt/trial\nscheduler: {type: pbs}\n"
                                 "searcher: {name: single, metric: loss, max_length: {batches: 10}}\n", "exp.yaml", d), d);
  stopped.allocation.scheduler = "pbs";
  stopped.allocation.job_id = "4.srv";
  stopped.experiment_dir = dir_;
  stopped.trial = 0;
  stopped.hold = true;
  Argvs submitted;
  stopped.run = [&submitted](const std::vector<std::string>& argv, const core::RunOptions&) {
    submitted.push_back(argv);
    core::RunResult r;
    r.argv = argv;
    r.exit_code = 0;
    r.out = "5.srv\n";
    return r;
  };
  EXPECT_FALSE(pbs.hand_over(stopped).has_value());
  ASSERT_EQ(submitted.size(), 1u);
  EXPECT_EQ(submitted[0][0], "qsub");
  EXPECT_THAT(submitted[0], testing::Contains("-h"));
  EXPECT_THAT(submitted[0], testing::Contains("depend=afterany:4.srv"));
  const auto latest = core::latest_job({dir_});
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(latest->id, "5.srv");
  EXPECT_EQ(latest->scheduler, "pbs");
  EXPECT_EQ(core::recorded_jobs({dir_}).back().trial, 0);
}

// PBS has no node ranges: an elastic trial's successor asks for the size its adaptive batch
// prefers (elastic.json), in whole nodes within the range.
TEST_F(SchedulerOverFakes, PbsSizesAnElasticTrialsSuccessorAsItsAdaptiveBatchPrefers) {
  std::ofstream(dir_ + "/experiment.yaml") << "name: x\n";
  std::filesystem::create_directories(dir_ + "/trial-0");
  std::ofstream(dir_ + "/trial-0/elastic.json") << "{\"preferred_slots\": 4}\n";
  const pbs::Scheduler pbs{pbs::Client(runner(""))};
  core::HandOver stopped;
  core::Diagnostics d;
  stopped.config = core::parse_experiment_config(
      core::parse_config_text("name: x\nentrypoint: /opt/trial\nscheduler: {type: pbs}\n"
                              "resources: {slots_per_trial: 8, slots_per_node: 2, min_slots_per_trial: 2}\n"
                              "searcher: {name: single, metric: loss, max_length: {batches: 10}}\n", "exp.yaml", d), d);
  ASSERT_TRUE(d.empty()) << d.to_string();
  stopped.allocation.scheduler = "pbs";
  stopped.allocation.job_id = "4.srv";
  stopped.experiment_dir = dir_;
  stopped.trial = 0;
  stopped.run = [](const std::vector<std::string>& argv, const core::RunOptions&) {
    core::RunResult r;
    r.argv = argv;
    r.exit_code = 0;
    r.out = "5.srv\n";
    return r;
  };
  pbs.hand_over(stopped);
  std::ifstream in(dir_ + "/trial-0/resume.pbs");
  const std::string script((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_THAT(script, HasSubstr("#PBS -l select=2:ncpus=2:mpiprocs=2"));
}

}  // namespace
}  // namespace hpctrial
