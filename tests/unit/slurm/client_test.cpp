// slurm::Client over a fake runner: the argv it runs, how it reads `scontrol -o show job` (lines as
// Slurm 22 prints them, for a plain job and for the tasks of a job array), and which of squeue's
// JSON and scontrol's text it lists jobs from.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <chrono>
#include <map>
#include <optional>

#include "hpctrial/core/error.h"
#include "hpctrial/slurm/client.h"

namespace hpctrial::slurm {
namespace {

using testing::ElementsAre;
using testing::HasSubstr;

const std::string kTask =
    "JobId=18 ArrayJobId=18 ArrayTaskId=2 ArrayTaskThrottle=2 JobName=my exp UserId=alice(1000) GroupId=alice(1000) "
    "MCS_label=N/A Priority=4294901741 Nice=0 Account=(null) QOS=(null) JobState=FAILED Reason=NonZeroExitCode "
    "Dependency=(null) Requeue=1 Restarts=2 BatchFlag=1 Reboot=0 ExitCode=1:0 RunTime=00:01:07 TimeLimit=00:30:00 "
    "TimeMin=N/A SubmitTime=2026-11-22T15:58:49 EligibleTime=2026-11-22T15:59:02 StartTime=2026-11-22T15:59:02 "
    "EndTime=2026-11-22T16:00:09 Partition=debug AllocNode:Sid=localhost:6786 NodeList=vm BatchHost=vm NumNodes=1 "
    "Command=/tmp/a b/job.sbatch WorkDir=/tmp/a b StdErr=/tmp/a b/slurm-18_2.err StdIn=/dev/null "
    "StdOut=/tmp/a b/slurm-18_2.out Power=";
const std::string kPendingTasks =
    "JobId=20 ArrayJobId=20 ArrayTaskId=3-5%2 JobName=grid UserId=bob(1001) JobState=PENDING "
    "Reason=JobArrayTaskLimit Restarts=0 RunTime=00:00:00 StdOut=/x/slurm-20_4294967294.out";
const std::string kHeld = "JobId=21 JobName=one UserId=bob(1001) JobState=PENDING Reason=job_requeued_in_held_state "
                          "Restarts=1 RunTime=00:00:00 StdOut=/x/slurm-21.out";

TEST(SlurmJobLine, ReadsEveryFieldEvenWithBlanksInValues) {
  const JobInfo j = parse_job_line(kTask);
  EXPECT_EQ(j.id, "18");
  EXPECT_EQ(j.name, "my exp");
  EXPECT_EQ(j.state, "FAILED");
  EXPECT_EQ(j.reason, "NonZeroExitCode");
  EXPECT_EQ(j.restarts, 2);
  EXPECT_EQ(j.run_time, "00:01:07");
  EXPECT_EQ(j.exit_code, "1:0");
  EXPECT_EQ(j.submit_time, "2026-11-22T15:58:49");
  EXPECT_EQ(j.start_time, "2026-11-22T15:59:02");
  EXPECT_EQ(j.node_list, "vm");
  EXPECT_EQ(j.work_dir, "/tmp/a b");
  EXPECT_EQ(j.std_out, "/tmp/a b/slurm-18_2.out");
  EXPECT_EQ(j.std_err, "/tmp/a b/slurm-18_2.err");
  EXPECT_EQ(j.user_id, "1000");
  EXPECT_EQ(j.array_job_id, "18");
  EXPECT_EQ(j.array_task, "2");
  EXPECT_EQ(j.display_id(), "18_2");
  EXPECT_FALSE(j.held());
}

TEST(SlurmJobLine, NamesTasksNotStartedYetTheWaySlurmAcceptsThem) {
  EXPECT_EQ(parse_job_line(kPendingTasks).display_id(), "20_[3-5]");
  JobInfo bracketed = parse_job_line(kPendingTasks);
  bracketed.array_task = "[3-5%2]";
  EXPECT_EQ(bracketed.display_id(), "20_[3-5]");
  const JobInfo plain = parse_job_line(kHeld);
  EXPECT_EQ(plain.display_id(), "21");
  EXPECT_TRUE(plain.held());
}

struct FakeSlurm {
  std::map<std::string, core::RunResult> answers;  // argv joined by blanks -> result
  std::vector<std::vector<std::string>> asked;
  std::vector<core::RunOptions> options;
  Client client() {
    return Client([this](const std::vector<std::string>& argv, const core::RunOptions& o) {
      asked.push_back(argv);
      options.push_back(o);
      std::string key;
      for (const auto& a : argv) key += (key.empty() ? "" : " ") + a;
      const auto it = answers.find(key);
      if (it != answers.end()) return it->second;
      core::RunResult ok;
      ok.argv = argv;
      ok.exit_code = 0;
      return ok;
    });
  }
  static core::RunResult said(const std::string& out, int code = 0, const std::string& err = "") {
    core::RunResult r;
    r.exit_code = code;
    r.out = out;
    r.err = err;
    return r;
  }
};

TEST(SlurmClient, ListsEveryTaskOfAnArrayAndForgetsGracefully) {
  FakeSlurm fake;
  fake.answers["scontrol -o show job 18"] = FakeSlurm::said(kTask + "\n" + kPendingTasks + "\n\n");
  fake.answers["scontrol -o show job 9"] =
      FakeSlurm::said("", 1, "slurm_load_jobs error: Invalid job id specified\n");
  fake.answers["scontrol -o show job 10"] = FakeSlurm::said("", 1, "slurm_load_jobs error: Unable to contact slurm controller\n");
  const Client c = fake.client();
  const auto tasks = c.job_tasks("18");
  ASSERT_EQ(tasks.size(), 2u);
  EXPECT_EQ(tasks[0].display_id(), "18_2");
  EXPECT_EQ(tasks[1].display_id(), "20_[3-5]");
  EXPECT_EQ(c.job("18")->id, "18");
  EXPECT_TRUE(c.job_tasks("9").empty());
  EXPECT_FALSE(c.job("9").has_value());
  EXPECT_THROW(c.job_tasks("10"), SchedulerError);
}

TEST(SlurmClient, UserJobsComeFromSqueuesJsonAndAreThisUsersOnly) {
  const std::string me = std::to_string(::getuid()), other = std::to_string(::getuid() + 1);
  const std::string listed = R"({"jobs": [{"job_id": 5, "job_state": "RUNNING", "user_id": )" + me +
                             R"(, "user_name": "me"}, {"job_id": 6, "job_state": "RUNNING", "user_id": )" + other +
                             R"(, "user_name": "other"}]})";
  FakeSlurm fake;
  // Slurm 22.05 ignores --me beside --json: both users' jobs come back.
  fake.answers["squeue --json --states=all --me"] = FakeSlurm::said(listed);
  fake.answers["squeue --json --states=all"] = FakeSlurm::said(listed);
  const Client c = fake.client();
  const auto mine = c.user_jobs(core::JobOwners::kMine);
  ASSERT_EQ(mine.size(), 1u);
  EXPECT_EQ(mine[0].id, "5");
  EXPECT_EQ(c.reads_json(), true);
  const auto everyone = c.user_jobs(core::JobOwners::kEveryone);
  ASSERT_EQ(everyone.size(), 2u);
  EXPECT_EQ(everyone[1].user_name, "other");
  EXPECT_THAT(fake.asked, ElementsAre(ElementsAre("squeue", "--json", "--states=all", "--me"),
                                      ElementsAre("squeue", "--json", "--states=all")));
}

TEST(SlurmClient, WithoutSqueuesJsonTheTextOfScontrolIsRead) {
  const std::string me = std::to_string(::getuid());
  FakeSlurm fake;
  fake.answers["squeue --json --states=all --me"] =
      FakeSlurm::said("", 1, "squeue: unrecognized option '--json'\nTry \"squeue --help\" for more information\n");
  fake.answers["scontrol -o show job"] = FakeSlurm::said(
      "JobId=5 JobName=a UserId=me(" + me + ") JobState=RUNNING Restarts=0\nJobId=6 JobName=b UserId=other(" +
      std::to_string(::getuid() + 1) + ") JobState=RUNNING\n");
  const Client c = fake.client();
  const auto mine = c.user_jobs(core::JobOwners::kMine);
  ASSERT_EQ(mine.size(), 1u);
  EXPECT_EQ(mine[0].id, "5");
  EXPECT_EQ(mine[0].user_name, "me");
  EXPECT_EQ(c.reads_json(), false);
  c.user_jobs(core::JobOwners::kMine);  // known now: squeue is not asked again
  EXPECT_THAT(fake.asked, ElementsAre(ElementsAre("squeue", "--json", "--states=all", "--me"),
                                      ElementsAre("scontrol", "-o", "show", "job"),
                                      ElementsAre("scontrol", "-o", "show", "job")));

  // A controller that does not answer is an error, not a reason to ask scontrol.
  FakeSlurm down;
  down.answers["squeue --json --states=all --me"] =
      FakeSlurm::said("", 1, "slurm_load_jobs error: Unable to contact slurm controller (connect failure)\n");
  try {
    down.client().user_jobs(core::JobOwners::kMine);
    ADD_FAILURE() << "no error";
  } catch (const SchedulerError& e) {
    EXPECT_THAT(e.what(), HasSubstr("Unable to contact slurm controller"));
  }
  EXPECT_EQ(down.asked.size(), 1u);
}

TEST(SlurmClient, RunsTheVerbsByArgvWithSecretsOnlyInTheEnvironment) {
  FakeSlurm fake;
  fake.answers["sbatch --parsable --export=ALL /e/job.sbatch"] = FakeSlurm::said("77;cluster\n");
  const Client c = fake.client();
  EXPECT_EQ(c.submit("/e/job.sbatch", {{"TOKEN", "s3cret"}}), "77");
  EXPECT_EQ(fake.options.back().env_set, (std::vector<std::pair<std::string, std::string>>{{"TOKEN", "s3cret"}}));
  c.requeue("18_2", true);
  c.requeue("18_2", false);
  c.hold("20_[3-5]");
  c.release("21");
  c.cancel("18");
  c.signal_batch("19", "USR2");
  const std::vector<std::vector<std::string>> expected = {
      {"sbatch", "--parsable", "--export=ALL", "/e/job.sbatch"}, {"scontrol", "requeuehold", "18_2"},
      {"scontrol", "requeue", "18_2"}, {"scontrol", "hold", "20_[3-5]"}, {"scontrol", "release", "21"},
      {"scancel", "18"}, {"scancel", "--batch", "--signal=USR2", "--verbose", "19"}};
  EXPECT_EQ(fake.asked, expected);
  fake.answers["sbatch --parsable --export=ALL /e/bad.sbatch"] = FakeSlurm::said("Submitted batch job 5\n");
  try {
    c.submit("/e/bad.sbatch", {});
    ADD_FAILURE() << "no error";
  } catch (const SchedulerError& e) {
    EXPECT_THAT(e.what(), HasSubstr("sbatch answered \"Submitted batch job 5\", not a job id"));
  }
}

// scancel asks again for 95 s while the controller says the job cannot take a signal now; the
// client cuts it short and answers false. Another error is one, with scancel's own line.
TEST(SlurmClient, ASignalToAJobWithNoBatchShellIsFalseAndOtherErrorsThrow) {
  FakeSlurm fake;
  const Client c = fake.client();
  EXPECT_TRUE(c.signal_batch("19", "USR2"));
  EXPECT_EQ(fake.options.back().timeout, std::optional<std::chrono::milliseconds>(Client::kSignalWait));
  core::RunResult retrying = FakeSlurm::said("", -1,
                                             "scancel: select/cons_tres: common_init: select/cons_tres loaded\n"
                                             "scancel: Signal 12 to batch job 20\n"
                                             "scancel: Job is in transitional state, retrying\n");
  retrying.timed_out = true;
  fake.answers["scancel --batch --signal=USR2 --verbose 20"] = retrying;
  EXPECT_FALSE(c.signal_batch("20", "USR2"));
  fake.answers["scancel --batch --signal=USR2 --verbose 21"] =
      FakeSlurm::said("", 1, "scancel: error: Kill job error on job id 21: Job can not be altered now, try again later\n");
  EXPECT_FALSE(c.signal_batch("21", "USR2"));
  fake.answers["scancel --batch --signal=USR2 --verbose 22"] =
      FakeSlurm::said("", 1, "scancel: Signal 12 to batch job 22\nscancel: error: Access/permission denied\n");
  try {
    c.signal_batch("22", "USR2");
    ADD_FAILURE() << "no error";
  } catch (const SchedulerError& e) {
    EXPECT_THAT(e.what(), HasSubstr("cannot signal slurm job 22: scancel: error: Access/permission denied"));
  }
}

}  // namespace
}  // namespace hpctrial::slurm
