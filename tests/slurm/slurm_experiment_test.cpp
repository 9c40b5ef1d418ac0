// hpctrial submit, pause, activate and kill against the real local Slurm cluster of the test
// tier (scripts/local-slurm.sh), with the faulty trial program (which fails only when asked).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <map>
#include <fstream>
#include <regex>
#include <thread>

#include "../support/background_process.h"
#include "../support/read_file.h"
#include "../support/same_weights.h"
#include "../support/slurm_jobs.h"
#include "../support/temp_dir.h"
#include "hpctrial/checkpoint/format.h"
#include "hpctrial/core/subprocess.h"

namespace hpctrial {
namespace {

using namespace std::chrono_literals;
using testing::HasSubstr;
using testing_support::processes_running;
using testing_support::expect_same_weights;
using testing_support::read_file;
using testing_support::TempDir;

core::RunResult run(const std::vector<std::string>& argv, std::chrono::seconds limit = 60s) {
  return testing_support::run_command(argv, limit);
}

using testing_support::job_field;
bool wait_for(const std::string& job, const std::string& state, std::chrono::seconds limit) {
  return testing_support::wait_for_state(job, state, limit);
}

class SlurmExperiment : public testing::Test {
 protected:
  void SetUp() override {
    const auto ping = run({"scontrol", "ping"});
    if (!ping.ok() || ping.out.find("is UP") == std::string::npos) {
      GTEST_SKIP() << "no local Slurm cluster answers (scripts/local-slurm.sh needs root): " << ping.describe();
    }
  }
  std::string config(std::int64_t batches, int batch_ms,
                     const std::string& scheduler = "time_limit: 30m, preemption_grace: 20s",
                     const std::string& fault = "fail_rank: -1, fail_batch: 0, fail_mode: none",
                     const std::string& extra = "min_checkpoint_period: {batches: 100}\n") {
    return dir_.write("exp.yaml",
        "name: slurm-exp\nentrypoint: " + std::string(HPCTRIAL_FAULTY_TRIAL) + "\n"
        "searcher: {name: single, metric: validation_loss, max_length: {batches: " + std::to_string(batches) + "}}\n"
        "hyperparameters: {global_batch_size: 16, " + fault + ", batch_ms: " + std::to_string(batch_ms) + "}\n"
        "resources: {slots_per_trial: 2, slots_per_node: 2}\n" + extra +
        "reproducibility: {experiment_seed: 11}\n"
        "scheduler: {type: slurm, " + scheduler + "}\n");
  }
  // The same experiment run uninterrupted on this machine, without the per-batch sleep (which
  // changes no number); returns its final checkpoint.
  std::string straight_run(const std::string& config_path, std::int64_t batches) {
    const std::string dir = (dir_.path() / "straight").string();
    const auto r = run({HPCTRIAL_CLI, "run", config_path, "--set", "scheduler.type=local", "--set",
                        "launcher.mpi=mpirun", "--set", "hyperparameters.batch_ms=0", "--experiment", dir}, 180s);
    EXPECT_TRUE(r.ok()) << r.describe() << r.err;
    return dir + "/trial-0/checkpoints/ckpt-" + std::to_string(batches) + ".h5";
  }
  std::string final_checkpoint(std::int64_t batches) const {
    return experiment() + "/trial-0/checkpoints/ckpt-" + std::to_string(batches) + ".h5";
  }
  std::string job_log(const std::string& job) const { return read_file(experiment() + "/slurm-" + job + ".err"); }
  // metrics.jsonl reads as one run: every training report once, in order.
  void expect_each_step_counted_once(std::int64_t batches) const {
    std::ifstream in(experiment() + "/trial-0/metrics.jsonl");
    std::int64_t previous = 0;
    int lines = 0;
    for (std::string line; std::getline(in, line);) {
      const auto j = nlohmann::json::parse(line);
      if (j["kind"] != "training") continue;
      const std::int64_t at = j["batches"];
      EXPECT_GT(at, previous) << "batch " << at << " reported again after " << previous;
      previous = at;
      ++lines;
    }
    EXPECT_EQ(previous, batches);
    EXPECT_GT(lines, 0);
  }
  std::string experiment() const { return (dir_.path() / "exp").string(); }
  std::string submit(const std::string& config_path) {
    const auto r = run({HPCTRIAL_CLI, "submit", config_path, "--experiment", experiment()});
    EXPECT_TRUE(r.ok()) << r.describe() << "\n" << r.out << r.err;
    const auto at = r.out.find("submitted slurm job ");
    if (at == std::string::npos) return "";
    const std::size_t start = at + std::strlen("submitted slurm job ");
    return r.out.substr(start, r.out.find('\n', start) - start);
  }
  long long heartbeat() const {
    std::ifstream in(experiment() + "/trial-0/launch/heartbeat/rank-0");
    std::string word;
    long long step = -1;
    in >> word >> step;
    return step;
  }
  // No rank of this test's experiment may outlive its job (ranks of other tests may run).
  void expect_no_rank_left() const {
    const std::string mine = "HPCTRIAL_EXPERIMENT_DIR=" + experiment();
    const auto until = std::chrono::steady_clock::now() + 10s;
    while (!processes_running(HPCTRIAL_FAULTY_TRIAL, mine).empty() && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(100ms);
    }
    EXPECT_TRUE(processes_running(HPCTRIAL_FAULTY_TRIAL, mine).empty()) << "a rank outlived its job";
  }
  // Submits the experiment, pauses it past batch 300, activates it, and compares its final
  // weights with those of the same run uninterrupted.
  void pause_and_activate(const std::string& extra);
  TempDir dir_;
};

TEST_F(SlurmExperiment, ASubmittedExperimentRunsToCompletionWithPrivateFiles) {
  const std::string job = submit(config(300, 0));
  ASSERT_FALSE(job.empty());
  ASSERT_TRUE(wait_for(job, "COMPLETED", 120s)) << "state " << job_field(job, "JobState") << "\n"
                                                << read_file(experiment() + "/slurm-" + job + ".err");
  EXPECT_TRUE(std::filesystem::exists(experiment() + "/trial-0/checkpoints/ckpt-300.h5"));
  EXPECT_THAT(read_file(experiment() + "/trial-0/metrics.jsonl"), HasSubstr("\"batches\":300"));
  EXPECT_THAT(read_file(experiment() + "/slurm-" + job + ".err"), HasSubstr("trial 0 finished"));
  const auto state = nlohmann::json::parse(read_file(experiment() + "/experiment.json"));
  EXPECT_EQ(state["job_id"], job);
  EXPECT_EQ(state["scheduler"], "slurm");
  for (const std::string& file : std::vector<std::string>{"job.sbatch", "experiment.yaml", "slurm-" + job + ".err",
                                                         "slurm-" + job + ".out"}) {
    struct stat st {};
    ASSERT_EQ(::stat((experiment() + "/" + file).c_str(), &st), 0) << file;
    EXPECT_EQ(st.st_mode & 0077, 0u) << file << " is readable by others";
  }
  // The script as submitted passes shellcheck.
  const auto lint = run({"shellcheck", experiment() + "/job.sbatch"});
  EXPECT_TRUE(lint.ok()) << lint.out << lint.err;
  // Each rank ran bound to a core of its own (cpus_per_slot 1), as the run's record and describe say.
  const auto runs = nlohmann::json::parse(read_file(experiment() + "/trial-0/runs.jsonl"));
  const auto& placement = runs.at("placement");
  ASSERT_EQ(placement.size(), 2u) << runs.dump();
  for (const auto& place : placement) {
    EXPECT_THAT(place.at("cpus").get<std::string>(), testing::MatchesRegex("[0-9]+")) << runs.dump();
    EXPECT_EQ(place.at("device"), "cpu");
  }
  EXPECT_NE(placement[0].at("cpus"), placement[1].at("cpus")) << runs.dump();
  const std::string host = placement[0].at("host").get<std::string>();
  const auto describe = run({HPCTRIAL_CLI, "describe", experiment()});
  EXPECT_THAT(describe.out, HasSubstr("    " + host + ": rank 0 (cpus " + placement[0].at("cpus").get<std::string>() +
                                      ", cpu), rank 1 (cpus " + placement[1].at("cpus").get<std::string>() + ", cpu)\n"))
      << describe.out;
}

TEST_F(SlurmExperiment, PauseHoldsTheJobAndActivateEndsWithTheWeightsOfAnUninterruptedRun) {
  pause_and_activate("min_checkpoint_period: {batches: 100}\n");
}

// The same with the ranks started by srun (launcher.mpi: srun): a step of the job, whose tasks
// the pause's signal reaches through srun.
TEST_F(SlurmExperiment, UnderSrunPauseHoldsTheJobAndActivateEndsWithTheWeightsOfAnUninterruptedRun) {
  pause_and_activate("min_checkpoint_period: {batches: 100}\nlauncher: {mpi: srun}\n");
  EXPECT_FALSE(std::filesystem::exists(experiment() + "/trial-0/launch/hostfile")) << "mpirun ran the ranks";
  const auto describe = run({HPCTRIAL_CLI, "describe", experiment()});
  EXPECT_THAT(describe.out, testing::ContainsRegex("run 1: .* by srun\n(.|\n)*run 2: .* by srun\n")) << describe.out;
}

void SlurmExperiment::pause_and_activate(const std::string& extra) {
  constexpr int kBatches = 1500;
  const std::string exp = config(kBatches, 2, "time_limit: 30m, preemption_grace: 20s",
                                 "fail_rank: -1, fail_batch: 0, fail_mode: none", extra);
  const std::string job = submit(exp);
  ASSERT_FALSE(job.empty());
  ASSERT_TRUE(wait_for(job, "RUNNING", 60s));
  const auto until = std::chrono::steady_clock::now() + 60s;
  while (heartbeat() < 300 && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(100ms);
  ASSERT_GE(heartbeat(), 300) << "the job never reached its first checkpoint";

  const auto pause = run({HPCTRIAL_CLI, "pause", job});
  ASSERT_TRUE(pause.ok()) << pause.describe() << pause.err;
  ASSERT_TRUE(wait_for(job, "PENDING", 60s)) << "state " << job_field(job, "JobState");
  EXPECT_EQ(job_field(job, "Reason"), "job_requeued_in_held_state");
  expect_no_rank_left();
  const std::string log = read_file(experiment() + "/slurm-" + job + ".err");
  EXPECT_THAT(log, HasSubstr("trial 0 stopped (pause) after a durable checkpoint"));
  EXPECT_THAT(log, HasSubstr("requeued after run 1 of this job and held"));
  ASSERT_TRUE(std::filesystem::exists(experiment() + "/trial-0/checkpoints/latest"));
  EXPECT_FALSE(std::filesystem::exists(experiment() + "/trial-0/checkpoints/ckpt-" + std::to_string(kBatches) + ".h5"))
      << "paused before the end";
  // While the job is held: the same experiment, uninterrupted, on this machine.
  const std::string straight = straight_run(exp, kBatches);

  const auto activate = run({HPCTRIAL_CLI, "activate", experiment()});
  ASSERT_TRUE(activate.ok()) << activate.describe() << activate.err;
  EXPECT_THAT(activate.out, HasSubstr("released"));
  ASSERT_TRUE(wait_for(job, "COMPLETED", 180s)) << "state " << job_field(job, "JobState") << "\n"
                                                << read_file(experiment() + "/slurm-" + job + ".err");
  const std::string all = read_file(experiment() + "/slurm-" + job + ".err");
  EXPECT_THAT(all, HasSubstr("resumed from ")) << "the output file keeps every run (append)";
  EXPECT_THAT(all, HasSubstr("trial 0 stopped (pause)")) << "the first run's output is still there";
  expect_same_weights(straight, final_checkpoint(kBatches));
}

// `hpctrial cancel`: the ranks checkpoint and the job ends (COMPLETED: it did as asked), not back
// in the queue; submitting the experiment again resumes from that checkpoint and finishes.
TEST_F(SlurmExperiment, CancelCheckpointsAndEndsTheJobAndASubmissionResumesIt) {
  constexpr int kBatches = 1500;
  const std::string exp = config(kBatches, 2, "time_limit: 30m, preemption_grace: 20s",
                                 "fail_rank: -1, fail_batch: 0, fail_mode: none", "min_checkpoint_period: {batches: 100}\n");
  const std::string job = submit(exp);
  ASSERT_FALSE(job.empty());
  ASSERT_TRUE(wait_for(job, "RUNNING", 60s));
  const auto until = std::chrono::steady_clock::now() + 60s;
  while (heartbeat() < 300 && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(100ms);
  ASSERT_GE(heartbeat(), 300) << "the job never reached its first checkpoint";

  const auto cancel = run({HPCTRIAL_CLI, "cancel", experiment()});
  ASSERT_TRUE(cancel.ok()) << cancel.describe() << cancel.err;
  EXPECT_THAT(cancel.out, HasSubstr("cancelling slurm job " + job + ": the ranks of trial 0 checkpoint after their "
                                    "current step, then it ends"));
  ASSERT_TRUE(wait_for(job, "COMPLETED", 60s)) << "state " << job_field(job, "JobState") << "\n" << job_log(job);
  expect_no_rank_left();
  const std::string log = read_file(experiment() + "/slurm-" + job + ".err");
  EXPECT_THAT(log, HasSubstr("trial 0 stopped (cancel) after a durable checkpoint; the job ends as `hpctrial cancel` "
                             "asked"));
  EXPECT_THAT(log, testing::Not(HasSubstr("requeued")));
  ASSERT_TRUE(std::filesystem::exists(experiment() + "/trial-0/checkpoints/latest"));
  EXPECT_FALSE(std::filesystem::exists(experiment() + "/trial-0/checkpoints/ckpt-" + std::to_string(kBatches) + ".h5"));

  const std::string again = submit(exp);
  ASSERT_FALSE(again.empty());
  EXPECT_NE(again, job);
  ASSERT_TRUE(wait_for(again, "COMPLETED", 180s)) << "state " << job_field(again, "JobState") << "\n" << job_log(again);
  EXPECT_THAT(read_file(experiment() + "/slurm-" + again + ".err"), HasSubstr("resumed from "));
  EXPECT_TRUE(std::filesystem::exists(experiment() + "/trial-0/checkpoints/ckpt-" + std::to_string(kBatches) + ".h5"));
}

// The code frozen at submission: the program rebuilt while the job is held, the activated job
// still runs the frozen copy - every run's digest in runs.jsonl, and the last checkpoint's, is
// the one frozen - and a run of the rebuilt program is refused, naming both digests.
TEST_F(SlurmExperiment, AProgramRebuiltWhileTheJobIsHeldLeavesTheJobOnItsFrozenCopy) {
  const std::string program = (dir_.path() / "my-trial").string();
  std::filesystem::copy_file(HPCTRIAL_FAULTY_TRIAL, program);
  std::string text = read_file(config(600, 2));
  text.replace(text.find(HPCTRIAL_FAULTY_TRIAL), std::string(HPCTRIAL_FAULTY_TRIAL).size(), program);
  const std::string exp = dir_.write("exp.yaml", text);
  const std::string job = submit(exp);
  ASSERT_FALSE(job.empty());
  const std::string digest =
      nlohmann::json::parse(read_file(experiment() + "/experiment.json"))["code"].value("digest", "");
  ASSERT_EQ(digest.size(), 64u);
  ASSERT_TRUE(wait_for(job, "RUNNING", 60s));
  const auto until = std::chrono::steady_clock::now() + 60s;
  while (heartbeat() < 100 && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(100ms);
  ASSERT_GE(heartbeat(), 100) << job_log(job);
  const auto pause = run({HPCTRIAL_CLI, "pause", job});
  ASSERT_TRUE(pause.ok()) << pause.describe() << pause.err;
  ASSERT_TRUE(wait_for(job, "PENDING", 60s)) << "state " << job_field(job, "JobState");

  std::ofstream(program, std::ios::app) << "rebuilt";  // other bytes at the path, while the job waits
  const auto activate = run({HPCTRIAL_CLI, "activate", experiment()});
  ASSERT_TRUE(activate.ok()) << activate.describe() << activate.err;
  ASSERT_TRUE(wait_for(job, "COMPLETED", 180s)) << "state " << job_field(job, "JobState") << "\n" << job_log(job);
  std::ifstream runs(experiment() + "/trial-0/runs.jsonl");
  int lines = 0;
  for (std::string line; std::getline(runs, line); ++lines) {
    EXPECT_EQ(nlohmann::json::parse(line).value("code", ""), digest) << line;
  }
  EXPECT_EQ(lines, 2) << "a run before the pause and one after";
  EXPECT_EQ(checkpoint::read_summary(final_checkpoint(600)).attributes["code_digest"], digest);
  const auto again = run({HPCTRIAL_CLI, "run", exp, "--set", "scheduler.type=local", "--experiment", experiment()});
  EXPECT_EQ(again.exit_code, 2) << again.out << again.err;
  EXPECT_THAT(again.err, HasSubstr("and the experiment froze " + digest));
}

// The time limit, with Slurm's warning (--signal=B:USR2@grace, which may come up to a minute
// early) or the launcher's own deadline: every run ends with a checkpoint and a requeue of the
// same job, the next run resumes exactly there, and the end is the uninterrupted run's.
TEST_F(SlurmExperiment, TheTimeLimitRequeuesAndEachRunResumesWhereTheLastStopped) {
  // ~17 s of 2.5 ms steps; the launcher's deadline ends each run of the 1-minute job 15 s after it
  // starts (sooner where Slurm's warning comes first), start-up included: at least two runs. A
  // loaded machine slows start-up by seconds, and a budget of a few seconds would leave each run
  // only a few batches.
  constexpr int kBatches = 7000;
  const std::string exp = config(kBatches, 2, "time_limit: 1m, preemption_grace: 45s",
                                 "fail_rank: -1, fail_batch: 0, fail_mode: none",
                                 "min_checkpoint_period: {batches: 1000}\n");
  const std::string straight = straight_run(exp, kBatches);
  const std::string job = submit(exp);
  ASSERT_FALSE(job.empty());
  ASSERT_TRUE(wait_for(job, "COMPLETED", 300s)) << "state " << job_field(job, "JobState") << "\n" << job_log(job);
  const std::string log = job_log(job);
  const int restarts = std::stoi(job_field(job, "Restarts"));
  EXPECT_GE(restarts, 1) << log;
  // Each stop's step is the next run's starting step.
  const std::regex stopped(R"(\[rank 0\] stop requested: stopping after batch (\d+) of)");
  const std::regex resumed(R"(resumed from \S+/ckpt-(\d+)\.h5 after (\d+) batches \(restart (\d+)\))");
  std::vector<std::string> stops, starts;
  for (auto it = std::sregex_iterator(log.begin(), log.end(), stopped); it != std::sregex_iterator(); ++it) {
    stops.push_back((*it)[1]);
  }
  for (auto it = std::sregex_iterator(log.begin(), log.end(), resumed); it != std::sregex_iterator(); ++it) {
    EXPECT_EQ((*it)[1], (*it)[2]);
    starts.push_back((*it)[1]);
  }
  EXPECT_EQ(stops, starts) << log;
  EXPECT_EQ(static_cast<int>(starts.size()), restarts) << log;
  EXPECT_THAT(log, testing::ContainsRegex("trial 0 stopped \\((preemption|deadline)\\) after a durable checkpoint"));
  EXPECT_THAT(log, HasSubstr("slurm job " + job + " requeued after run 1 of this job"));
  EXPECT_THAT(log, HasSubstr("trial 0 finished"));
  expect_each_step_counted_once(kBatches);
  expect_same_weights(straight, final_checkpoint(kBatches));
}

// An admin's `scontrol requeue` (or a preemption without warning): SIGTERM to every process of
// the job, Slurm requeues it itself; the next run resumes from the last published checkpoint (the
// ranks' emergency one when it was written in time) and no step is counted twice.
TEST_F(SlurmExperiment, ARequeueWithoutWarningResumesFromTheLastPublishedCheckpoint) {
  constexpr int kBatches = 3000;
  const std::string exp = config(kBatches, 2, "time_limit: 30m, preemption_grace: 20s",
                                 "fail_rank: -1, fail_batch: 0, fail_mode: none",
                                 "min_checkpoint_period: {batches: 500}\n");
  const std::string job = submit(exp);
  ASSERT_FALSE(job.empty());
  ASSERT_TRUE(wait_for(job, "RUNNING", 60s));
  const auto until = std::chrono::steady_clock::now() + 60s;
  while (heartbeat() < 1200 && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(100ms);
  ASSERT_GE(heartbeat(), 1200);
  const auto requeue = run({"scontrol", "requeue", job});
  ASSERT_TRUE(requeue.ok()) << requeue.describe() << requeue.err;
  ASSERT_TRUE(wait_for(job, "PENDING", 60s)) << "state " << job_field(job, "JobState");
  const std::string published = read_file(experiment() + "/trial-0/checkpoints/latest");
  std::smatch m;
  const std::regex step(R"(ckpt-(\d+)\.h5)");
  ASSERT_TRUE(std::regex_search(published, m, step)) << published;
  const std::string at = m[1];
  EXPECT_GE(std::stoll(at), 1000);
  expect_no_rank_left();
  // While Slurm holds the requeued job back (its credentials' expiry): the uninterrupted run.
  const std::string straight = straight_run(exp, kBatches);

  ASSERT_TRUE(wait_for(job, "COMPLETED", 180s)) << "state " << job_field(job, "JobState") << "\n" << job_log(job);
  EXPECT_EQ(job_field(job, "Restarts"), "1");
  const std::string log = job_log(job);
  EXPECT_THAT(log, HasSubstr("stop requested (terminate)"));
  EXPECT_THAT(log, HasSubstr("/ckpt-" + at + ".h5 after " + at + " batches (restart 1)")) << log;
  EXPECT_THAT(log, testing::Not(HasSubstr("requeued after run"))) << "Slurm requeues it, not the launcher";
  expect_each_step_counted_once(kBatches);
  expect_same_weights(straight, final_checkpoint(kBatches));
}

// Slurm never stops a job that requeues itself: failures are capped by max_restarts inside the
// job, and the job then ends FAILED with the rank's code, not requeued.
TEST_F(SlurmExperiment, ATrialThatAlwaysFailsEndsTheJobAfterMaxRestarts) {
  const std::string exp = config(1000, 2, "time_limit: 30m, preemption_grace: 20s",
                                 "fail_rank: 1, fail_batch: 50, fail_mode: throw", "max_restarts: 2\n");
  const std::string job = submit(exp);
  ASSERT_FALSE(job.empty());
  ASSERT_TRUE(wait_for(job, "FAILED", 120s)) << "state " << job_field(job, "JobState") << "\n" << job_log(job);
  EXPECT_EQ(job_field(job, "Restarts"), "0");
  EXPECT_NE(job_field(job, "ExitCode"), "0:0");
  const std::string log = job_log(job);
  EXPECT_THAT(log, HasSubstr("(restart 2 of max_restarts 2)"));
  EXPECT_THAT(log, HasSubstr("It has failed 3 time(s) and max_restarts is 2, so it is not restarted"));
  EXPECT_THAT(log, testing::Not(HasSubstr("requeued")));
  std::ifstream records(experiment() + "/trial-0/failures.jsonl");
  int failures = 0;
  for (std::string line; std::getline(records, line);) ++failures;
  EXPECT_EQ(failures, 3);
  std::this_thread::sleep_for(3s);
  EXPECT_EQ(job_field(job, "JobState"), "FAILED") << "the job went back to the queue";
  expect_no_rank_left();
}

// A grid of 3 trials is one job array; an admin's requeue of one task restarts that task alone,
// which resumes from its checkpoint, and each trial ends with the weights of its own
// uninterrupted run. jobs, logs and describe see every task.
TEST_F(SlurmExperiment, AGridIsOneJobArrayAndARequeueOfOneTaskLeavesTheOthersAlone) {
  constexpr int kBatches = 2500;
  const std::string exp = dir_.write("grid.yaml",
      "name: grid-exp\nentrypoint: " + std::string(HPCTRIAL_FAULTY_TRIAL) + "\n"
      "searcher: {name: grid, metric: validation_loss, max_length: {batches: " + std::to_string(kBatches) + "}}\n"
      "hyperparameters: {global_batch_size: 16, fail_rank: -1, fail_batch: 0, fail_mode: none, batch_ms: 2,\n"
      "                  lr: {type: log, minval: -3, maxval: -1, count: 3}}\n"
      "resources: {slots_per_trial: 1}\n"
      "min_checkpoint_period: {batches: 500}\n"
      "reproducibility: {experiment_seed: 5}\n"
      "scheduler: {type: slurm, time_limit: 30m, preemption_grace: 20s}\n");
  const std::string job = submit(exp);
  ASSERT_FALSE(job.empty());
  EXPECT_THAT(read_file(experiment() + "/job.sbatch"), HasSubstr("#SBATCH --array=0-2\n"));
  const std::string task1 = job + "_1";
  ASSERT_TRUE(wait_for(task1, "RUNNING", 60s));
  auto step = [&](int trial) {
    std::ifstream in(experiment() + "/trial-" + std::to_string(trial) + "/launch/heartbeat/rank-0");
    std::string word;
    long long at = -1;
    in >> word >> at;
    return at;
  };
  const auto until = std::chrono::steady_clock::now() + 60s;
  while (step(1) < 1100 && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(100ms);
  ASSERT_GE(step(1), 1100);
  const auto listed = run({HPCTRIAL_CLI, "jobs", "--scheduler", "slurm"});
  ASSERT_TRUE(listed.ok()) << listed.describe() << listed.err;
  for (const std::string& task : {job + "_0", task1, job + "_2"}) {
    EXPECT_THAT(listed.out, testing::ContainsRegex(task + " +grid-exp +(RUNNING|PENDING|COMPLETED)")) << listed.out;
  }
  EXPECT_THAT(listed.out, HasSubstr(experiment()));
  // The same tasks in --json, each of the experiment, with its trial.
  const auto as_json = run({HPCTRIAL_CLI, "jobs", "--scheduler", "slurm", "--json"});
  ASSERT_TRUE(as_json.ok()) << as_json.describe() << as_json.err;
  std::map<std::string, int> trials;
  const auto parsed = nlohmann::json::parse(as_json.out);
  for (const auto& j : parsed["jobs"]) {
    if (j["experiment"] == experiment()) trials[j["id"].get<std::string>()] = j["trial"].get<int>();
  }
  EXPECT_EQ(trials, (std::map<std::string, int>{{job + "_0", 0}, {task1, 1}, {job + "_2", 2}})) << as_json.out;

  const auto requeue = run({"scontrol", "requeue", task1});
  ASSERT_TRUE(requeue.ok()) << requeue.describe() << requeue.err;
  // While Slurm holds task 1 back: trial 1 alone, uninterrupted, on this machine.
  const std::string straight = (dir_.path() / "straight").string();
  const auto r = run({HPCTRIAL_CLI, "run", exp, "--trial", "1", "--set", "scheduler.type=local", "--set",
                      "hyperparameters.batch_ms=0", "--experiment", straight}, 180s);
  ASSERT_TRUE(r.ok()) << r.describe() << r.err;
  EXPECT_FALSE(std::filesystem::exists(straight + "/trial-0")) << "--trial 1 runs trial 1 alone";
  for (const std::string& task : {job + "_0", task1, job + "_2"}) {
    ASSERT_TRUE(wait_for(task, "COMPLETED", 240s)) << task << " is " << job_field(task, "JobState");
  }
  EXPECT_EQ(job_field(task1, "Restarts"), "1");
  EXPECT_EQ(job_field(job + "_0", "Restarts"), "0") << "requeueing task 1 touched task 0";
  EXPECT_EQ(job_field(job + "_2", "Restarts"), "0") << "requeueing task 1 touched task 2";
  const std::string log1 = read_file(experiment() + "/slurm-" + job + "_1.err");
  EXPECT_THAT(log1, HasSubstr("(restart 1)"));
  for (const char* other : {"_0", "_2"}) {
    const std::string log = read_file(experiment() + "/slurm-" + job + other + ".err");
    EXPECT_THAT(log, testing::Not(HasSubstr("resumed from"))) << other;
    EXPECT_THAT(log, HasSubstr("trial " + std::string(1, other[1]) + " finished"));
  }
  // Each trial its own values of the grid, and its uninterrupted weights.
  const std::vector<std::string> lrs = {"0.001", "0.01", "0.1"};
  for (int trial = 0; trial < 3; ++trial) {
    const std::string t = std::to_string(trial);
    EXPECT_THAT(read_file(experiment() + "/trial-" + t + "/effective-config.yaml"), HasSubstr("lr: " + lrs[trial]));
  }
  const std::string end = "/trial-1/checkpoints/ckpt-" + std::to_string(kBatches) + ".h5";
  expect_same_weights(straight + end, experiment() + end);

  const auto described = run({HPCTRIAL_CLI, "describe", experiment()});
  ASSERT_TRUE(described.ok()) << described.describe() << described.err;
  EXPECT_THAT(described.out, HasSubstr("searcher:    grid, 3 trial(s)"));
  EXPECT_THAT(described.out, HasSubstr(task1 + " COMPLETED, 1 restart(s)"));
  EXPECT_THAT(described.out, HasSubstr("batches:     " + std::to_string(kBatches) + " of " +
                                       std::to_string(kBatches) + " batches"));
  const auto logs = run({HPCTRIAL_CLI, "logs", task1});
  ASSERT_TRUE(logs.ok()) << logs.describe() << logs.err;
  EXPECT_EQ(logs.out, log1);
  const auto rank_log = run({HPCTRIAL_CLI, "logs", experiment(), "--trial", "2", "--rank", "0"});
  ASSERT_TRUE(rank_log.ok()) << rank_log.describe() << rank_log.err;
  EXPECT_THAT(rank_log.out, HasSubstr("finished: " + std::to_string(kBatches) + " batches"));
  const auto follow = run({HPCTRIAL_CLI, "logs", job + "_0", "--follow"}, 30s);
  EXPECT_TRUE(follow.ok()) << "--follow of an ended job returns: " << follow.describe();
}

TEST_F(SlurmExperiment, KillCancelsAndLeavesNoRankAndAValidCheckpoint) {
  const std::string job = submit(config(100000, 2));
  ASSERT_TRUE(wait_for(job, "RUNNING", 60s));
  const auto until = std::chrono::steady_clock::now() + 60s;
  while (heartbeat() < 150 && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(100ms);
  const auto kill = run({HPCTRIAL_CLI, "kill", experiment()});
  ASSERT_TRUE(kill.ok()) << kill.describe() << kill.err;
  ASSERT_TRUE(wait_for(job, "CANCELLED", 60s)) << "state " << job_field(job, "JobState");
  expect_no_rank_left();
  const auto verify = run({HPCTRIAL_CLI, "checkpoint", "verify", experiment() + "/trial-0/checkpoints"});
  EXPECT_TRUE(verify.ok()) << verify.out << verify.err;
}

TEST_F(SlurmExperiment, MistakesAreClearErrors) {
  auto r = run({HPCTRIAL_CLI, "pause", "999999"});
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("slurm no longer knows job 999999"));
  r = run({HPCTRIAL_CLI, "activate", (dir_.path() / "nowhere").string()});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("is neither a job id nor an experiment directory"));
  const std::string exp = dir_.write("bad.yaml",
      "name: bad\nentrypoint: /bin/true\nsearcher: {name: single, metric: m, max_length: {batches: 1}}\n"
      "scheduler: {type: slurm, extra_directives: [--output=/tmp/elsewhere]}\n");
  r = run({HPCTRIAL_CLI, "submit", exp, "--experiment", experiment()});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("scheduler.extra_directives[0]: --output is set by hpctrial itself"));
  EXPECT_FALSE(std::filesystem::exists(experiment() + "/job.sbatch"));
}

}  // namespace
}  // namespace hpctrial
