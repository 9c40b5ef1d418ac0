// hpctrial against the real OpenPBS server of the pbs tier (scripts/local-pbs.sh: server,
// scheduler, comm and MoM on this host, queue workq). PBS runs no job as root, so every hpctrial
// command runs as the ordinary user the script made (runuser), in an experiment directory that
// user owns; the test reads PBS's own view with qstat. The faulty trial program trains (it fails
// only when asked); each test says which behaviour of the real server it pins.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <thread>

#include "pbs_fixture.h"
#include "../support/background_process.h"
#include "../support/read_file.h"
#include "../support/same_weights.h"
#include "../support/temp_dir.h"
#include "hpctrial/core/subprocess.h"
#include "hpctrial/core/text.h"

namespace hpctrial {
namespace {

using namespace pbs_tier;
using testing::HasSubstr;
using testing::Not;
using testing_support::expect_same_weights;

// Submit, run, finish: PBS's record (F, exit 0), the files private to the user, the output of
// the job in pbs-JOB.out, PBS's own copy of its output file back (which needs the MoM's $usecp),
// and jobs, logs and describe as the user sees them.
TEST_F(PbsServer, ASubmittedExperimentRunsToCompletion) {
  const std::string job = submit(config(300, "0", "time_limit: 10m, preemption_grace: 30s"));
  ASSERT_FALSE(job.empty());
  ASSERT_TRUE(wait_for_state(job, "F", 180s)) << "state " << state_of(job) << "\n" << job_output(job);
  EXPECT_EQ(exit_status(job), 0) << job_output(job);
  EXPECT_EQ(pbs_job(job).value("run_count", 0), 1);
  EXPECT_THAT(job_output(job), HasSubstr("trial 0 finished"));
  EXPECT_TRUE(fs::exists(trial_dir() + "/checkpoints/ckpt-300.h5"));
  expect_private({"job.pbs", "experiment.yaml", "experiment.json", "pbs-" + job + ".out"});
  ASSERT_TRUE(wait_for([&] { return fs::exists(experiment() + "/pbs-scheduler.out"); }, 30s))
      << "PBS did not copy its output file back";
  expect_private({"pbs-scheduler.out"});
  expect_no_process_of(job);

  const auto jobs = user({HPCTRIAL_CLI, "jobs", "--scheduler", "pbs"});
  ASSERT_TRUE(jobs.ok()) << jobs.describe() << jobs.err;
  EXPECT_THAT(jobs.out, testing::ContainsRegex(std::regex_replace(job, std::regex(R"([.\[\]])"), R"(\$&)") +
                                               " +pbs-real +F .*ckpt-300\\.h5 +" + experiment()));
  EXPECT_THAT(jobs.err, Not(HasSubstr("pbs:"))) << "qstat answered hpctrial jobs with an error";
  const auto describe = user({HPCTRIAL_CLI, "describe", job});
  ASSERT_TRUE(describe.ok()) << describe.describe() << describe.err;
  EXPECT_THAT(describe.out, HasSubstr("pbs:         " + job + " F, 0 restart(s), exit 0\n"));
  EXPECT_THAT(describe.out, HasSubstr("batches:     300 of 300"));
  const auto logs = user({HPCTRIAL_CLI, "logs", experiment()});
  ASSERT_TRUE(logs.ok()) << logs.describe() << logs.err;
  EXPECT_THAT(logs.out, HasSubstr("trial 0 finished"));
}

// launcher.startup_hook under the real server: a hook that fails ends the job before any rank
// starts, with the hook's status as PBS's Exit_status and its last lines in the job's output,
// reported as the hook's failure.
TEST_F(PbsServer, AFailingStartupHookEndsTheJobWithItsStatusReportedAsTheHooks) {
  const std::string path = config(20, "0", "time_limit: 10m");
  std::ofstream(path, std::ios::app) << "launcher: {startup_hook: 'echo hook in job $HPCTRIAL_JOB_ID; echo cannot "
                                        "mount scratch >&2; exit 5'}\n";
  const std::string job = submit(path);
  ASSERT_FALSE(job.empty());
  ASSERT_TRUE(wait_for_state(job, "F", 180s)) << "state " << state_of(job) << "\n" << job_output(job);
  EXPECT_EQ(exit_status(job), 5) << job_output(job);
  const std::string out = job_output(job);
  EXPECT_THAT(out, HasSubstr("] hook in job " + job));  // "[startup hook on <node>] ..."
  EXPECT_THAT(out, HasSubstr("exited with status 5; the ranks were not started and the trial is not retried"));
  EXPECT_THAT(out, HasSubstr("Its last lines:"));
  EXPECT_THAT(out, HasSubstr("  cannot mount scratch"));
  EXPECT_THAT(out, Not(HasSubstr("starting 2 rank(s)")));
  expect_no_process_of(job);
}

// pause of a running job: the stop request, and SIGURG to every process of the job (qsig; the
// login shell ignores it, where USR2 would kill it and the job), which the launcher passes to
// the ranks at once; the job exits 75 after a durable checkpoint and submits its successor
// held; activate (qrls) resumes it, and the weights equal an uninterrupted run's.
TEST_F(PbsServer, PauseOfARunningJobHoldsItsSuccessorAndActivateResumesIt) {
  constexpr int kBatches = 1500;  // ~6 s of 4 ms steps
  const std::string exp = config(kBatches, "4", "time_limit: 10m, preemption_grace: 30s");
  const std::string straight = straight_run(exp, kBatches);
  const std::string first = submit(exp);
  ASSERT_FALSE(first.empty());
  wait_for_training(300);

  const auto pause = user({HPCTRIAL_CLI, "pause", experiment()});
  ASSERT_TRUE(pause.ok()) << pause.describe() << pause.out << pause.err;
  EXPECT_THAT(pause.out, HasSubstr("pausing pbs job " + first));
  ASSERT_TRUE(wait_for_state(first, "F", 120s)) << "state " << state_of(first) << "\n" << job_output(first);
  EXPECT_EQ(exit_status(first), 75) << "the paused job ends as stopped, not killed\n" << job_output(first);
  EXPECT_THAT(job_output(first), HasSubstr("trial 0 stopped (pause) after a durable checkpoint"));
  EXPECT_THAT(job_output(first), HasSubstr("SIGURG: a pause of the job (hpctrial pause); passing it to the ranks"));
  const auto ids = recorded_jobs();
  ASSERT_EQ(ids.size(), 2u) << job_output(first);
  const std::string second = ids.back();
  EXPECT_EQ(state_of(second), "H") << "the successor of a paused job waits for activate";
  EXPECT_THAT(pbs_job(second).value("Submit_arguments", std::string()), HasSubstr("-h -W depend=afterany:" + first));
  expect_no_process_of(first);
  const auto verify = user({HPCTRIAL_CLI, "checkpoint", "verify", trial_dir() + "/checkpoints"});
  EXPECT_TRUE(verify.ok()) << verify.out << verify.err;

  const auto listed = user({HPCTRIAL_CLI, "jobs", "--scheduler", "pbs"});
  ASSERT_TRUE(listed.ok()) << listed.describe() << "\n" << listed.out << listed.err;
  EXPECT_THAT(listed.out, HasSubstr(second)) << listed.err;
  EXPECT_THAT(listed.out, testing::ContainsRegex(" H \\(held\\) ")) << listed.err;
  EXPECT_THAT(user({HPCTRIAL_CLI, "describe", experiment()}).out, HasSubstr("pbs:         " + second + " H (held)"));
  const auto again = user({HPCTRIAL_CLI, "pause", experiment()});
  EXPECT_TRUE(again.ok()) << again.err;
  EXPECT_THAT(again.out, HasSubstr("already held"));

  const auto activate = user({HPCTRIAL_CLI, "activate", experiment()});
  ASSERT_TRUE(activate.ok()) << activate.describe() << activate.err;
  EXPECT_THAT(activate.out, HasSubstr("pbs job " + second + " released"));
  // logs --follow prints the first job's run, then follows the successor until it ends.
  const auto follow = user({HPCTRIAL_CLI, "logs", "--follow", experiment()}, 300s);
  ASSERT_TRUE(follow.ok()) << follow.describe() << follow.err;
  EXPECT_THAT(follow.out, HasSubstr("==> pbs job " + first + " <=="));
  EXPECT_THAT(follow.out, HasSubstr("==> pbs job " + second + " <=="));
  EXPECT_THAT(follow.out, HasSubstr("trial 0 finished"));
  ASSERT_TRUE(wait_for_state(second, "F", 60s)) << state_of(second);
  EXPECT_EQ(exit_status(second), 0) << job_output(second);
  EXPECT_THAT(job_output(second), HasSubstr("resumed from "));
  expect_same_weights(straight, trial_dir() + "/checkpoints/ckpt-" + std::to_string(kBatches) + ".h5");
}

// cancel of a running job: the same stop request (reason "cancel") and SIGURG; the job exits 0
// after a durable checkpoint and submits no successor; a new submission resumes it.
TEST_F(PbsServer, CancelOfARunningJobCheckpointsAndEndsItWithoutASuccessor) {
  constexpr int kBatches = 1500;
  const std::string exp = config(kBatches, "4", "time_limit: 10m, preemption_grace: 30s");
  const std::string first = submit(exp);
  ASSERT_FALSE(first.empty());
  wait_for_training(300);

  const auto cancel = user({HPCTRIAL_CLI, "cancel", experiment()});
  ASSERT_TRUE(cancel.ok()) << cancel.describe() << cancel.out << cancel.err;
  EXPECT_THAT(cancel.out, HasSubstr("cancelling pbs job " + first));
  ASSERT_TRUE(wait_for_state(first, "F", 120s)) << "state " << state_of(first) << "\n" << job_output(first);
  EXPECT_EQ(exit_status(first), 0) << job_output(first);
  EXPECT_THAT(job_output(first), HasSubstr("trial 0 stopped (cancel) after a durable checkpoint; the job ends"));
  EXPECT_EQ(recorded_jobs().size(), 1u) << "no successor\n" << job_output(first);
  expect_no_process_of(first);
  ASSERT_TRUE(fs::exists(trial_dir() + "/checkpoints/latest"));
  EXPECT_FALSE(fs::exists(trial_dir() + "/checkpoints/ckpt-" + std::to_string(kBatches) + ".h5"));

  const std::string second = submit(exp);
  ASSERT_FALSE(second.empty());
  ASSERT_TRUE(wait_for_state(second, "F", 180s)) << state_of(second) << "\n" << job_output(second);
  EXPECT_EQ(exit_status(second), 0) << job_output(second);
  EXPECT_THAT(job_output(second), HasSubstr("resumed from "));
}

// pause of a job that has not started holds it (qhold); activate releases it (qrls); kill of a
// queued job deletes it. A job of the user's own that takes both CPUs keeps it queued.
TEST_F(PbsServer, PauseHoldsAQueuedJobActivateReleasesItKillDeletesIt) {
  const std::string blocker_script = dir_.write("blocker.sh", "#!/bin/bash\nsleep 600\n");
  ::chmod(blocker_script.c_str(), 0755);
  const auto blocker = user({"qsub", "-l", "select=1:ncpus=2", "-o", "/dev/null", "-j", "oe", blocker_script});
  ASSERT_TRUE(blocker.ok()) << blocker.err;
  const std::string blocker_id = core::trim(blocker.out);
  submitted_.push_back(blocker_id);
  ASSERT_TRUE(wait_for_state(blocker_id, "R", 60s));

  const std::string job = submit(config(300, "0", "time_limit: 10m, preemption_grace: 30s"));
  ASSERT_FALSE(job.empty());
  EXPECT_EQ(state_of(job), "Q");
  const auto pause = user({HPCTRIAL_CLI, "pause", job});
  ASSERT_TRUE(pause.ok()) << pause.describe() << pause.err;
  EXPECT_EQ(state_of(job), "H");
  EXPECT_FALSE(fs::exists(trial_dir() + "/stop-request")) << "a queued job needs no stop request";
  const auto activate = user({HPCTRIAL_CLI, "activate", experiment()});
  ASSERT_TRUE(activate.ok()) << activate.err;
  EXPECT_EQ(state_of(job), "Q");
  const auto kill = user({HPCTRIAL_CLI, "kill", experiment()});
  ASSERT_TRUE(kill.ok()) << kill.describe() << kill.err;
  EXPECT_THAT(kill.out, HasSubstr("pbs job " + job + " cancelled"));
  EXPECT_TRUE(wait_for_state(job, "F", 30s)) << state_of(job);
  EXPECT_FALSE(fs::exists(trial_dir() + "/checkpoints")) << "the deleted job never ran";
  const auto nothing = user({HPCTRIAL_CLI, "kill", experiment()});
  EXPECT_FALSE(nothing.ok());
  EXPECT_THAT(nothing.err, HasSubstr("has no queued or running pbs job to kill"));
}

// `hpctrial job update` as the jobs' owner: the Priority (qalter -p) and queue (qmove) of a queued
// job, and its place among the owner's queued jobs (qorder), each as qstat shows it; a priority
// PBS does not take is refused before qalter runs.
TEST_F(PbsServer, JobUpdateChangesAQueuedJobsPriorityQueueAndPlace) {
  const std::string script = dir_.write("sleeper.sh", "#!/bin/bash\nsleep 600\n");
  ::chmod(script.c_str(), 0755);
  const auto qsub = [&](const std::string& ncpus) {
    const auto r = user({"qsub", "-l", "select=1:ncpus=" + ncpus, "-o", "/dev/null", "-j", "oe", script});
    EXPECT_TRUE(r.ok()) << r.err;
    submitted_.push_back(core::trim(r.out));
    return submitted_.back();
  };
  const std::string blocker = qsub("2");  // takes both CPUs: the others stay queued
  ASSERT_TRUE(wait_for_state(blocker, "R", 60s));
  const std::string first = qsub("1"), second = qsub("1");
  ASSERT_EQ(state_of(second), "Q");
  const auto rank = [&](const std::string& id) { return pbs_job(id).value("queue_rank", 0LL); };
  ASSERT_LT(rank(first), rank(second));

  auto r = user({HPCTRIAL_CLI, "job", "update", second, "--priority", "100", "--queue", "workq"});
  ASSERT_TRUE(r.ok()) << r.describe() << r.err;
  EXPECT_EQ(r.out, "pbs job " + second + ": priority 100\npbs job " + second + ": queue workq\n");
  EXPECT_EQ(pbs_job(second).value("Priority", 0), 100);
  r = user({HPCTRIAL_CLI, "job", "update", second, "--priority", "2000"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("--priority 2000: PBS takes -1024 to 1023"));

  r = user({HPCTRIAL_CLI, "job", "update", second, "--ahead-of", first});
  ASSERT_TRUE(r.ok()) << r.describe() << r.err;
  EXPECT_THAT(r.out, HasSubstr("ahead of " + first + " (qorder: swapped with " + first + ")"));
  EXPECT_LT(rank(second), rank(first));
  r = user({HPCTRIAL_CLI, "job", "update", second, "--ahead-of", first});
  EXPECT_THAT(r.out, HasSubstr("ahead of " + first + " already"));
  r = user({HPCTRIAL_CLI, "job", "update-batch", second + ".behind-of=" + first});
  ASSERT_TRUE(r.ok()) << r.describe() << r.err;
  EXPECT_LT(rank(first), rank(second));
  r = user({HPCTRIAL_CLI, "job", "update", second, "--top"});
  ASSERT_TRUE(r.ok()) << r.describe() << r.err;
  EXPECT_LT(rank(second), rank(first));

  // The queue columns of `hpctrial jobs`: priority and queue as PBS has them.
  r = user({HPCTRIAL_CLI, "jobs", "--all", "--scheduler", "pbs", "--queue", "workq", "--json"});
  ASSERT_TRUE(r.ok()) << r.describe() << r.err;
  const auto listed = nlohmann::json::parse(r.out);
  bool seen = false;
  for (const auto& job : listed["jobs"]) {
    if (job["id"] != second) continue;
    seen = true;
    EXPECT_EQ(job["priority"], "100");
    EXPECT_EQ(job["queue"], "workq");
    EXPECT_EQ(job["state"], "queued");
  }
  EXPECT_TRUE(seen) << r.out;

  // Every user's jobs, as another user (root) lists them: the owner's, each with its user.
  const auto everyone =
      run_as({HPCTRIAL_CLI, "jobs", "--all", "--all-users", "--scheduler", "pbs", "--json"}, 60s, false);
  ASSERT_TRUE(everyone.ok()) << everyone.describe() << everyone.err;
  int theirs = 0;
  const auto answer = nlohmann::json::parse(everyone.out);
  for (const auto& job : answer["jobs"]) {
    if (job["id"] != first && job["id"] != second && job["id"] != blocker) continue;
    ++theirs;
    EXPECT_EQ(job["user"], "pbsuser");
  }
  EXPECT_EQ(theirs, 3) << everyone.out;
  const auto mine = run_as({HPCTRIAL_CLI, "jobs", "--all", "--scheduler", "pbs", "--json"}, 60s, false);
  ASSERT_TRUE(mine.ok()) << mine.describe() << mine.err;
  EXPECT_THAT(mine.out, testing::Not(HasSubstr(second))) << "root's own jobs only";
}

// kill of a running job: qdel -W with the grace (the queue's kill_delay is 10 s); the login
// shell dies of the SIGTERM at once, the launcher and ranks checkpoint, nothing is submitted,
// no process is left, and every checkpoint verifies.
TEST_F(PbsServer, KillOfARunningJobLeavesVerifiedCheckpointsAndNoProcess) {
  const std::string job = submit(config(100000, "2", "time_limit: 10m, preemption_grace: 40s"));
  ASSERT_FALSE(job.empty());
  wait_for_training(300);
  const auto kill = user({HPCTRIAL_CLI, "kill", job});
  ASSERT_TRUE(kill.ok()) << kill.describe() << kill.err;
  EXPECT_THAT(kill.out, HasSubstr("pbs job " + job + " cancelled"));
  ASSERT_TRUE(wait_for_state(job, "F", 90s)) << state_of(job) << "\n" << job_output(job);
  expect_no_process_of(job);
  EXPECT_THAT(job_output(job), HasSubstr("SIGTERM: waiting up to 40 s for the ranks' checkpoint, but pbs kills job " +
                                         job + " 10 s after its SIGTERM (the queue's kill_delay)"));
  EXPECT_THAT(job_output(job), HasSubstr("trial 0 stopped (terminate) after a durable checkpoint"));
  EXPECT_EQ(recorded_jobs().size(), 1u) << "a deleted job submits no successor";
  ASSERT_TRUE(fs::exists(trial_dir() + "/checkpoints/latest"));
  const auto verify = user({HPCTRIAL_CLI, "checkpoint", "verify", trial_dir() + "/checkpoints"});
  EXPECT_TRUE(verify.ok()) << verify.out << verify.err;
}

// The walltime: PBS sends no warning, so each job stops scheduler.preemption_grace before its
// walltime with a checkpoint and submits its successor (afterany); each successor resumes, and
// the last one finishes with the weights of an uninterrupted run.
TEST_F(PbsServer, EachJobStopsBeforeItsWalltimeAndItsSuccessorResumes) {
  // ~18 s of 6 ms steps; each job stops 45 s before its 1-minute walltime, after ~12 s of training
  // (start-up takes the rest of its 15 s, and seconds more on a loaded machine).
  constexpr int kBatches = 3000;
  const std::string exp = config(kBatches, "6", "time_limit: 1m, preemption_grace: 45s");
  const std::string straight = straight_run(exp, kBatches);
  const std::string first = submit(exp);
  ASSERT_FALSE(first.empty());
  EXPECT_EQ(pbs_job(first)["Resource_List"].value("walltime", std::string()), "00:01:00");
  std::vector<std::string> jobs;
  ASSERT_TRUE(wait_for_chain(jobs, 300s)) << "the chain did not finish: " << jobs.size() << " job(s)\n"
                                          << job_output(jobs.back());
  ASSERT_GE(jobs.size(), 2u) << "the walltime never ran out";
  for (std::size_t i = 0; i + 1 < jobs.size(); ++i) {
    EXPECT_EQ(exit_status(jobs[i]), 75) << "job " << jobs[i] << " was not stopped before its walltime\n"
                                        << job_output(jobs[i]);
    EXPECT_THAT(job_output(jobs[i]), HasSubstr("trial 0 stopped (deadline) after a durable checkpoint"));
    EXPECT_THAT(pbs_job(jobs[i + 1]).value("Submit_arguments", std::string()), HasSubstr("depend=afterany:" + jobs[i]));
    EXPECT_THAT(job_output(jobs[i + 1]), HasSubstr("resumed from "));
  }
  EXPECT_EQ(exit_status(jobs.back()), 0) << job_output(jobs.back());
  EXPECT_THAT(job_output(jobs.back()), HasSubstr("trial 0 finished"));
  const auto describe = user({HPCTRIAL_CLI, "describe", experiment()});
  ASSERT_TRUE(describe.ok()) << describe.err;
  for (const auto& id : jobs) EXPECT_THAT(describe.out, HasSubstr("job:         pbs " + id + ", submitted "));
  EXPECT_THAT(describe.out, HasSubstr("pbs:         " + jobs.back() + " F, 0 restart(s), exit 0\n"));
  const auto logs = user({HPCTRIAL_CLI, "logs", experiment()});
  ASSERT_TRUE(logs.ok()) << logs.err;
  for (const auto& id : jobs) EXPECT_THAT(logs.out, HasSubstr("==> pbs job " + id + " <==\n"));
  expect_same_weights(straight, trial_dir() + "/checkpoints/ckpt-" + std::to_string(kBatches) + ".h5");
}

// A grid is one array job (-J 0-1), a subjob per trial, side by side on the two CPUs: trial 0
// finishes within its walltime; trial 1, slower, is stopped by its own and resumes alone in a
// job of its own, while nothing of trial 0 runs again.
TEST_F(PbsServer, AGridIsAnArrayJobAndASubjobStoppedByItsWalltimeResumesAlone) {
  constexpr int kBatches = 1200;
  // Trial 1 sleeps 20 ms a batch (~24 s of training, more than its 20 s a job), trial 0 none (a
  // second of training, within its job's 20 s even where a loaded machine slows start-up).
  const std::string array =
      submit(config(kBatches, "{type: categorical, vals: [0, 20]}", "time_limit: 1m, preemption_grace: 40s", 1));
  ASSERT_THAT(array, testing::EndsWith("[]." + array.substr(array.find("].") + 2)));
  EXPECT_THAT(read_file(experiment() + "/job.pbs"), HasSubstr("#PBS -J 0-1\n"));
  const std::string base = array.substr(0, array.find('['));
  const std::string rest = array.substr(array.find(']') + 1);
  const std::string sub0 = base + "[0]" + rest, sub1 = base + "[1]" + rest;
  // Both subjobs end (trial 1 stopped by its walltime), then trial 1's own jobs.
  ASSERT_TRUE(wait_for([&] { return state_of(sub0) == "F" && state_of(sub1) == "F"; }, 180s))
      << state_of(sub0) << " " << state_of(sub1) << "\n" << job_output(sub1);
  std::vector<std::string> jobs;
  ASSERT_TRUE(wait_for_chain(jobs, 300s)) << "trial 1 did not finish: " << jobs.size() << " job(s)\n"
                                          << job_output(sub1);
  ASSERT_GE(jobs.size(), 2u) << job_output(sub1);
  EXPECT_EQ(exit_status(sub0), 0) << job_output(sub0);
  EXPECT_EQ(exit_status(sub1), 75) << job_output(sub1);
  EXPECT_THAT(job_output(sub1), HasSubstr("trial 1 stopped (deadline) after a durable checkpoint"));
  EXPECT_EQ(jobs.front(), array);
  for (std::size_t i = 1; i < jobs.size(); ++i) {
    EXPECT_THAT(job_output(jobs[i]), HasSubstr("resumed from "));
    EXPECT_THAT(job_output(jobs[i]), Not(HasSubstr("trial 0")));
  }
  // PBS refuses a dependency on a subjob ("cannot have dependancy on subjob or range"): the
  // successor's launcher waits for the subjob's instead.
  EXPECT_THAT(pbs_job(jobs[1]).value("Submit_arguments", std::string()), Not(HasSubstr("depend")));
  EXPECT_THAT(job_output(sub1), HasSubstr("submitted to resume trial 1 once the launcher of subjob " + sub1));
  EXPECT_THAT(read_file(trial_dir(1) + "/resume.pbs"), Not(HasSubstr("#PBS -J")));
  EXPECT_EQ(exit_status(jobs.back()), 0) << job_output(jobs.back());
  for (int trial : {0, 1}) {
    EXPECT_TRUE(fs::exists(trial_dir(trial) + "/checkpoints/ckpt-" + std::to_string(kBatches) + ".h5")) << trial;
  }
  const auto describe = user({HPCTRIAL_CLI, "describe", experiment()});
  ASSERT_TRUE(describe.ok()) << describe.err;
  EXPECT_THAT(describe.out, HasSubstr("pbs:         " + sub0 + " F, 0 restart(s), exit 0\n"));
  EXPECT_THAT(describe.out, HasSubstr("pbs:         " + jobs.back() + " F, 0 restart(s), exit 0\n"));
  const auto logs = user({HPCTRIAL_CLI, "logs", experiment(), "--trial", "1"});
  ASSERT_TRUE(logs.ok()) << logs.err;
  EXPECT_THAT(logs.out, HasSubstr("==> pbs job " + sub1 + " <==\n"));
  EXPECT_THAT(logs.out, HasSubstr("trial 1 finished"));
}

}  // namespace
}  // namespace hpctrial
