// An adaptive search (adaptive_asha) of the mlp example submitted to the real local OpenPBS: an
// array job of two workers, each taking its trials from the search log, each worker that stops
// (its walltime, a pause) followed by a job of one worker that goes on. The search runs to its
// end through walltimes, a worker killed mid-trial and a pause/activate, and no trial is lost or
// trained twice (testing_support::expect_search_complete).
#include <signal.h>

#include "pbs_fixture.h"
#include "../support/inference_files.h"
#include "../support/search_log.h"

namespace hpctrial {
namespace {

using namespace pbs_tier;
using testing::HasSubstr;
using testing_support::events_in;

constexpr int kTrials = 16;

// Every process of PBS job `id` (the worker, its mpirun and ranks), SIGKILLed at once: a node
// that died under it.
int kill_job(const std::string& id) {
  int killed = 0;
  for (const pid_t pid : processes_running("", "PBS_JOBID=" + id)) killed += ::kill(pid, SIGKILL) == 0;
  return killed;
}

class PbsSearch : public PbsServer {
 protected:
  static void SetUpTestSuite() {
    shared_ = std::make_unique<TempDir>();
    ::chmod(shared_->path().c_str(), 0755);  // the user's jobs read the data
    const auto made = run_as({HPCTRIAL_MLP_MAKE_DATASET, data_dir()}, 60s, false);
    ASSERT_TRUE(made.ok()) << made.describe() << made.err;
    for (const char* file : {"/train.h5", "/validation.h5"}) ::chmod((data_dir() + file).c_str(), 0644);
    ::chmod(data_dir().c_str(), 0755);
  }
  static void TearDownTestSuite() { shared_.reset(); }
  static std::string data_dir() { return (shared_->path() / "data").string(); }

  void SetUp() override {
    PbsServer::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    ASSERT_TRUE(user({"test", "-x", HPCTRIAL_MLP}, 30s).ok()) << kUser << " cannot run " << HPCTRIAL_MLP;
  }

  std::string search_config(const std::string& scheduler) {
    return dir_.write("asha.yaml", testing_support::mlp_search_yaml("pbs-asha", HPCTRIAL_MLP, kTrials, data_dir(),
        "scheduler: {type: pbs, queue: workq, " + scheduler + "}"));
  }

  // The same configurations each trained straight to max_length on this machine, validated at
  // every rung's end (testing_support::reference_config). Run once for the suite, by the user in
  // the user's environment, as the jobs run: PBS gives a job the environment of the user's login,
  // not the test's, and a variable such as OPENBLAS_CORETYPE in the test's would choose other
  // kernels, whose sums round otherwise.
  static const testing_support::Validations& reference(const std::string& config_path) {
    static const testing_support::Validations validations = [&] {
      const fs::path home = shared_->path() / "reference";
      const fs::path dir = home / "exp";
      fs::create_directories(home);
      const passwd* pw = ::getpwnam(kUser.c_str());
      EXPECT_TRUE(pw != nullptr && ::chown(home.c_str(), pw->pw_uid, pw->pw_gid) == 0) << home;
      const auto r = user({HPCTRIAL_CLI, "run", testing_support::reference_config(config_path), "--experiment",
                           dir.string()}, 600s);
      EXPECT_TRUE(r.ok()) << r.describe() << r.out << r.err;
      return testing_support::validation_losses(dir.string(), kTrials);
    }();
    return validations;
  }

  std::string log() const { return experiment() + "/search-events.jsonl"; }
  // The trial the worker in job `id` trains now; -1 between trials or before it started.
  int worker_trial(const std::string& id) const {
    std::ifstream in(experiment() + "/worker." + id + ".json");
    if (!in) return -1;
    const json record = json::parse(in, nullptr, false);
    return record.is_object() ? record.value("trial", -1) : -1;
  }
  std::string subjob(const std::string& array, int index) const {
    return array.substr(0, array.find("[]") + 1) + std::to_string(index) + array.substr(array.find("[]") + 1);
  }
  // Every output of the experiment's jobs, one after another.
  std::string all_output() {
    std::string out;
    for (const auto& entry : fs::directory_iterator(experiment())) {
      const std::string name = entry.path().filename().string();
      if (name.rfind("pbs-", 0) == 0 && name != "pbs-scheduler.out") out += read_file(entry.path().string());
    }
    return out;
  }
  // Waits until every job the experiment recorded has ended (a worker that stops records the
  // job that goes on before it ends).
  bool wait_for_all_ended(std::chrono::seconds limit) {
    return wait_for([&] {
      const auto ids = recorded_jobs();
      const auto states = job_states();
      return !ids.empty() && std::all_of(ids.begin(), ids.end(), [&](const std::string& id) {
        const auto it = states.find(id);
        return it != states.end() && (it->second == "F" || it->second == "X");
      });
    }, limit);
  }

  static std::unique_ptr<TempDir> shared_;
};

std::unique_ptr<TempDir> PbsSearch::shared_;

// Each worker's job stops 45 s before its 1-minute walltime, in the middle of a trial, and a job
// of one worker goes on; worker 1 is killed with everything it started while it trains a trial,
// and the other workers take that trial over. The search ends with nothing lost. (Its wait once
// asked qstat for each recorded job three times a second; each qstat holds a reserved port for
// a minute, and with none left PBS's daemons and the jobs' own qsub stalled: a worker's job
// ended without running its script. The wait now asks once a second, for every job at once.)
TEST_F(PbsSearch, ASearchRunsToItsEndThroughWalltimesAndAKilledWorker) {
  const std::string exp = search_config("time_limit: 1m, preemption_grace: 45s");
  const auto& expected = reference(exp);
  ASSERT_FALSE(expected.empty());
  const std::string array = submit(exp);
  ASSERT_FALSE(array.empty());
  const std::string second = subjob(array, 1);
  ASSERT_TRUE(wait_for([&] { return events_in(log(), "created") >= 3 && worker_trial(second) >= 0; }, 180s))
      << all_output();
  const int taken = worker_trial(second);
  EXPECT_GT(kill_job(second), 0);
  ASSERT_TRUE(wait_for_all_ended(600s)) << all_output();
  const std::string output = all_output();
  // Killed while the trial trained, it is taken over; killed as its ranks ended, after its chief
  // recorded the rung in worker 1's name, there is nothing to take over.
  if (!testing_support::each_start_reached_its_rung(log(), taken)) {
    EXPECT_THAT(output, HasSubstr("search: taking over trial " + std::to_string(taken)));
  }
  EXPECT_THAT(output, HasSubstr("submitted to resume a worker of the search")) << "no walltime stopped a worker";
  EXPECT_THAT(output, HasSubstr("has nothing left for this worker"));
  testing_support::expect_search_complete(experiment(), kTrials, expected);
}

// A pause of the experiment while both workers train: each trial checkpoints, each worker's job
// ends and a held job of one worker takes its place; activate releases both, and they end the
// search with nothing lost.
TEST_F(PbsSearch, APauseOfTheSearchHoldsAWorkerForEachAndActivateEndsIt) {
  const std::string exp = search_config("time_limit: 10m, preemption_grace: 30s");
  const auto& expected = reference(exp);
  ASSERT_FALSE(expected.empty());
  const std::string array = submit(exp);
  ASSERT_FALSE(array.empty());
  ASSERT_TRUE(wait_for([&] { return events_in(log(), "rung") >= 1 && worker_trial(subjob(array, 0)) >= 0 &&
                                    worker_trial(subjob(array, 1)) >= 0; }, 180s))
      << all_output();
  const auto pause = user({HPCTRIAL_CLI, "pause", experiment()});
  ASSERT_TRUE(pause.ok()) << pause.describe() << pause.out << pause.err;
  EXPECT_THAT(pause.out, HasSubstr("pausing pbs job " + subjob(array, 0)));
  ASSERT_TRUE(wait_for_state(array, "F", 120s)) << state_of(array) << "\n" << all_output();
  const auto ids = recorded_jobs();
  ASSERT_EQ(ids.size(), 3u) << all_output();
  for (std::size_t i = 1; i < ids.size(); ++i) EXPECT_EQ(state_of(ids[i]), "H") << ids[i];
  const std::size_t created = events_in(log(), "created");
  std::this_thread::sleep_for(2s);
  EXPECT_EQ(events_in(log(), "created"), created) << "a paused search went on";
  EXPECT_THAT(all_output(), HasSubstr("stopped (pause)"));

  const auto activate = user({HPCTRIAL_CLI, "activate", experiment()});
  ASSERT_TRUE(activate.ok()) << activate.describe() << activate.err;
  ASSERT_TRUE(wait_for_all_ended(600s)) << all_output();
  EXPECT_THAT(all_output(), HasSubstr("resumed from "));
  testing_support::expect_search_complete(experiment(), kTrials, expected);
}

// Batch inference submitted to the real server: the job's ranks write the one result file, which
// equals a run's on this machine byte for byte, and the experiment's files are the user's alone.
TEST_F(PbsSearch, BatchInferenceUnderPbsWritesWhatARunHereWrites) {
  const std::string trained = user_dir() + "/trained";
  const auto training = user({HPCTRIAL_CLI, "run",
                              dir_.write("train.yaml", testing_support::mlp_training_yaml("mlp", HPCTRIAL_MLP,
                                                                                          data_dir(), 60)),
                              "--experiment", trained, "--oversubscribe"}, 300s);
  ASSERT_TRUE(training.ok()) << training.describe() << training.err;
  const auto config = [&](const std::string& name, const std::string& extra) {
    return dir_.write(name + ".yaml",
                      testing_support::mlp_inference_yaml(name, HPCTRIAL_MLP, data_dir(), trained, extra));
  };
  const std::string here = user_dir() + "/here";
  const auto local = user({HPCTRIAL_CLI, "run", config("here", "resources: {slots_per_trial: 2}\n"), "--experiment",
                           here, "--oversubscribe"}, 300s);
  ASSERT_TRUE(local.ok()) << local.describe() << local.err;

  const std::string job = submit(config("pbs", "resources: {slots_per_trial: 2, slots_per_node: 2}\n"
                                               "scheduler: {type: pbs, queue: workq, time_limit: 10m}\n"));
  ASSERT_FALSE(job.empty());
  ASSERT_TRUE(wait_for_state(job, "F", 180s)) << "state " << state_of(job) << "\n" << job_output(job);
  EXPECT_EQ(exit_status(job), 0) << job_output(job);
  EXPECT_THAT(job_output(job), HasSubstr("2048 records predicted in this run"));
  testing_support::expect_same_predictions(trial_dir() + "/predictions.h5", here + "/trial-0/predictions.h5");
  expect_private({"trial-0/predictions.h5", "trial-0/inference-progress.json"});
}

}  // namespace
}  // namespace hpctrial
