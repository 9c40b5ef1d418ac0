// An adaptive search (adaptive_asha) of the mlp example submitted to the real local Slurm cluster:
// a job array of two workers, each taking its trials from the search log. It runs to its end
// through a worker killed mid-trial, a preemption warning and a pause/activate of the
// experiment, and no trial is lost or trained twice: every rung each trial reached is in the log
// once, with the metric the same search run uninterrupted on this machine gives, and every
// trial's metrics count each batch once.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <signal.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <thread>

#include <nlohmann/json.hpp>

#include "../support/read_file.h"
#include "../support/search_log.h"
#include "../support/slurm_jobs.h"
#include "../support/temp_dir.h"
#include "hpctrial/core/subprocess.h"

namespace hpctrial {
namespace {

using namespace std::chrono_literals;
using testing::HasSubstr;
using testing_support::events_in;
using testing_support::job_field;
using testing_support::read_file;
using testing_support::TempDir;

constexpr int kTrials = 16;

core::RunResult run(const std::vector<std::string>& argv, std::chrono::seconds limit = 60s) {
  return testing_support::run_command(argv, limit);
}

using testing_support::Validations;

// Every process of task `task` of job array `array` (the worker, its mpirun and ranks), SIGKILLed
// at once: a node that died under it.
int kill_task(const std::string& array, int task) {
  const std::string job = "SLURM_ARRAY_JOB_ID=" + array, index = "SLURM_ARRAY_TASK_ID=" + std::to_string(task);
  int killed = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    const std::string name = entry.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream environ_file(entry.path() / "environ", std::ios::binary);
    bool has_job = false, has_index = false;
    for (std::string item; std::getline(environ_file, item, '\0');) {
      has_job = has_job || item == job;
      has_index = has_index || item == index;
    }
    if (has_job && has_index && ::kill(static_cast<pid_t>(std::stol(name)), SIGKILL) == 0) ++killed;
  }
  return killed;
}

class SlurmSearch : public testing::Test {
 protected:
  static void SetUpTestSuite() {
    shared_ = std::make_unique<TempDir>();
    const auto made = run({HPCTRIAL_MLP_MAKE_DATASET, (shared_->path() / "data").string()});
    ASSERT_TRUE(made.ok()) << made.describe() << made.err;
  }
  static void TearDownTestSuite() { shared_.reset(); }

  void SetUp() override {
    const auto ping = run({"scontrol", "ping"});
    if (!ping.ok() || ping.out.find("is UP") == std::string::npos) {
      GTEST_SKIP() << "no local Slurm cluster answers (scripts/local-slurm.sh needs root): " << ping.describe();
    }
  }

  static std::string config() {
    const std::string data = (shared_->path() / "data").string();
    return shared_->write("asha.yaml", testing_support::mlp_search_yaml("slurm-asha", HPCTRIAL_MLP, kTrials, data,
        "scheduler: {type: slurm, time_limit: 30m, preemption_grace: 20s}"));
  }

  // The same configurations (trial N of random samples what trial N of the search does) each
  // trained straight to max_length on this machine, validated every 8 batches (each rung's end):
  // what every validation of the search must read. Run once for the suite.
  static const Validations& reference() {
    static const Validations validations = [] {
      const std::string dir = (shared_->path() / "reference").string();
      const auto r = run({HPCTRIAL_CLI, "run", testing_support::reference_config(config()), "--experiment", dir}, 600s);
      EXPECT_TRUE(r.ok()) << r.describe() << r.out << r.err;
      return testing_support::validation_losses(dir, kTrials);
    }();
    return validations;
  }

  std::string experiment() const { return (dir_.path() / "exp").string(); }
  std::string log() const { return experiment() + "/search-events.jsonl"; }
  std::string worker_output(const std::string& array, int task) const {
    return read_file(experiment() + "/slurm-" + array + "_w" + std::to_string(task) + ".err");
  }

  // Submits the search; returns the array's id.
  std::string submit() {
    const auto r = run({HPCTRIAL_CLI, "submit", config(), "--experiment", experiment()});
    EXPECT_TRUE(r.ok()) << r.describe() << "\n" << r.out << r.err;
    EXPECT_THAT(r.out, HasSubstr("2 worker(s) of the adaptive_asha search, 16 trials in all"));
    const std::string prefix = "submitted slurm job ";
    const auto at = r.out.find(prefix);
    if (at == std::string::npos) return "";
    const std::size_t start = at + prefix.size();
    return r.out.substr(start, r.out.find('\n', start) - start);
  }

  // The trial worker `task` trains now (its worker file), -1 between trials or before.
  int worker_trial(const std::string& array, int task) const {
    std::ifstream in(experiment() + "/worker." + array + "_" + std::to_string(task) + ".json");
    if (!in) return -1;
    try {
      return nlohmann::json::parse(in).value("trial", -1);
    } catch (const nlohmann::json::exception&) {
      return -1;  // read while it was replaced
    }
  }

  template <typename Condition>
  bool wait_until(Condition condition, std::chrono::seconds limit) const {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (!condition()) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::sleep_for(100ms);
    }
    return true;
  }

  void expect_search_complete() const {
    testing_support::expect_search_complete(experiment(), kTrials, reference());
  }

  static std::unique_ptr<TempDir> shared_;
  TempDir dir_;
};

std::unique_ptr<TempDir> SlurmSearch::shared_;

// Worker 1 dies with everything it started while it trains a trial: worker 0 takes the trial
// over from its last checkpoint (or its start) and ends the search alone.
TEST_F(SlurmSearch, ASearchRunsToItsEndAndAWorkerKilledMidTrialLosesNoTrial) {
  ASSERT_FALSE(reference().empty());
  const std::string array = submit();
  ASSERT_FALSE(array.empty());
  ASSERT_TRUE(wait_until([&] { return events_in(log(), "created") >= 3 && worker_trial(array, 1) >= 0; }, 180s))
      << worker_output(array, 1);
  const int taken = worker_trial(array, 1);
  EXPECT_GT(kill_task(array, 1), 0);
  ASSERT_TRUE(testing_support::wait_for_state(array + "_0", "COMPLETED", 420s))
      << "state " << job_field(array + "_0", "JobState") << "\n" << worker_output(array, 0);
  EXPECT_NE(job_field(array + "_1", "JobState"), "COMPLETED") << "worker 1 was killed";
  // Killed while the trial trained, it is taken over; killed as its ranks ended, after its chief
  // recorded the rung in worker 1's name, there is nothing to take over.
  if (!testing_support::each_start_reached_its_rung(log(), taken)) {
    EXPECT_THAT(worker_output(array, 0), HasSubstr("search: taking over trial " + std::to_string(taken)));
  }
  EXPECT_THAT(worker_output(array, 0), HasSubstr("has nothing left for this worker"));
  expect_search_complete();

  // describe ranks the trials; --best names the best trial's checkpoint.
  const auto described = run({HPCTRIAL_CLI, "describe", experiment()});
  ASSERT_TRUE(described.ok()) << described.describe() << described.err;
  EXPECT_THAT(described.out, HasSubstr("ranking by validation_loss (smaller is better):"));
  const auto best = run({HPCTRIAL_CLI, "describe", experiment(), "--best"});
  ASSERT_TRUE(best.ok()) << best.describe() << best.err;
  EXPECT_TRUE(std::filesystem::exists(best.out.substr(0, best.out.find('\n')))) << best.out;
}

// A preemption warning to worker 0 (USR2, as Slurm sends before the time limit): its trial
// checkpoints and the task is requeued to work on. Then a pause of the whole experiment: both
// workers stop after a checkpoint and wait held; activate resumes them to the search's end.
TEST_F(SlurmSearch, APreemptionAndAPauseOfTheExperimentLoseNoTrial) {
  ASSERT_FALSE(reference().empty());
  const std::string array = submit();
  ASSERT_FALSE(array.empty());
  const std::string first = array + "_0", second = array + "_1";
  ASSERT_TRUE(wait_until([&] { return worker_trial(array, 0) >= 0 && events_in(log(), "rung") >= 1; }, 180s))
      << worker_output(array, 0);
  const auto warned = run({"scancel", "--batch", "--signal=USR2", first});
  ASSERT_TRUE(warned.ok()) << warned.describe() << warned.err;
  ASSERT_TRUE(wait_until([&] { return job_field(first, "Restarts") == "1" &&
                                      job_field(first, "JobState") == "RUNNING"; }, 180s))
      << "state " << job_field(first, "JobState") << "\n" << worker_output(array, 0);
  EXPECT_THAT(worker_output(array, 0), HasSubstr("requeued after run 1 of this job"));

  ASSERT_TRUE(wait_until([&] { return worker_trial(array, 0) >= 0 && worker_trial(array, 1) >= 0; }, 180s));
  const auto pause = run({HPCTRIAL_CLI, "pause", experiment()});
  ASSERT_TRUE(pause.ok()) << pause.describe() << pause.out << pause.err;
  for (const std::string& task : {first, second}) {
    ASSERT_TRUE(wait_until([&] { return job_field(task, "JobState") == "PENDING"; }, 120s))
        << task << " state " << job_field(task, "JobState");
    EXPECT_EQ(job_field(task, "Reason"), "job_requeued_in_held_state") << task;
  }
  for (int task : {0, 1}) EXPECT_THAT(worker_output(array, task), HasSubstr("stopped (pause)")) << "worker " << task;
  const std::size_t created = events_in(log(), "created");
  std::this_thread::sleep_for(2s);
  EXPECT_EQ(events_in(log(), "created"), created) << "a paused search went on";

  const auto activate = run({HPCTRIAL_CLI, "activate", experiment()});
  ASSERT_TRUE(activate.ok()) << activate.describe() << activate.err;
  for (const std::string& task : {first, second}) {
    ASSERT_TRUE(testing_support::wait_for_state(task, "COMPLETED", 420s))
        << task << " state " << job_field(task, "JobState") << "\n" << worker_output(array, 0) << worker_output(array, 1);
  }
  EXPECT_THAT(worker_output(array, 0) + worker_output(array, 1), HasSubstr("resumed from "));
  expect_search_complete();
}

}  // namespace
}  // namespace hpctrial
