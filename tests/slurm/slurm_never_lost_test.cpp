// What hpctrial does on the real local Slurm cluster of the test tier when the scheduler does not
// do what it is asked, or no longer names what hpctrial recorded: a recorded job id that Slurm
// has given to another job, and a requeue at the end of a job that fails.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "../support/read_file.h"
#include "../support/slurm_jobs.h"
#include "../support/temp_dir.h"
#include "hpctrial/core/experiment_dir.h"
#include "hpctrial/core/launch_contract.h"
#include "hpctrial/core/subprocess.h"

namespace hpctrial {
namespace {

using namespace std::chrono_literals;
using testing::HasSubstr;
using testing::Not;
using testing_support::job_field;
using testing_support::read_file;
using testing_support::TempDir;
namespace fs = std::filesystem;

class SlurmNeverLost : public testing::Test {
 protected:
  void SetUp() override {
    const auto ping = run({"scontrol", "ping"});
    if (!ping.ok() || ping.out.find("is UP") == std::string::npos) {
      GTEST_SKIP() << "no local Slurm cluster answers (scripts/local-slurm.sh needs root): " << ping.describe();
    }
  }
  void TearDown() override {
    for (const std::string& job : others_) run({"scancel", job});
  }
  // `argv` with `path` (when given) first on PATH: the submitter's environment, which the job gets.
  core::RunResult run(const std::vector<std::string>& argv, std::chrono::seconds limit = 60s,
                      const std::string& path = "") const {
    core::RunOptions options;
    options.timeout = limit;
    options.env_set = {{"OMPI_ALLOW_RUN_AS_ROOT", "1"}, {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"}};
    if (!path.empty()) options.env_set.emplace_back("PATH", path + ":" + std::getenv("PATH"));
    return core::run_process(argv, options);
  }
  std::string config(std::int64_t batches) const {
    return dir_.write("exp.yaml",
        "name: slurm-never-lost\nentrypoint: " + std::string(HPCTRIAL_FAULTY_TRIAL) + "\n"
        "searcher: {name: single, metric: validation_loss, max_length: {batches: " + std::to_string(batches) + "}}\n"
        "hyperparameters: {global_batch_size: 16, fail_rank: -1, fail_batch: 0, fail_mode: none, batch_ms: 2}\n"
        "resources: {slots_per_trial: 2, slots_per_node: 2}\nmin_checkpoint_period: {batches: 100}\n"
        "reproducibility: {experiment_seed: 11}\n"
        "scheduler: {type: slurm, time_limit: 30m, preemption_grace: 20s}\n");
  }
  std::string experiment() const { return (dir_.path() / "exp").string(); }
  std::string submit(const std::string& config_path, const std::string& path = "") {
    const auto r = run({HPCTRIAL_CLI, "submit", config_path, "--experiment", experiment()}, 60s, path);
    EXPECT_TRUE(r.ok()) << r.describe() << "\n" << r.out << r.err;
    const auto at = r.out.find("submitted slurm job ");
    if (at == std::string::npos) return "";
    const std::size_t start = at + std::strlen("submitted slurm job ");
    return r.out.substr(start, r.out.find('\n', start) - start);
  }
  // A plain job of no experiment (its output outside any), cancelled after the test.
  std::string other_job(const std::vector<std::string>& options) {
    std::vector<std::string> argv = {"sbatch", "--parsable", "--job-name=someone-else", "--chdir",
                                     dir_.path().string(), "--output", (dir_.path() / "other-%j.out").string()};
    argv.insert(argv.end(), options.begin(), options.end());
    argv.insert(argv.end(), {"--wrap", "sleep 300"});
    const auto r = run(argv);
    EXPECT_TRUE(r.ok()) << r.describe() << r.err;
    others_.push_back(r.out.substr(0, r.out.find_first_of(";\n")));
    return others_.back();
  }
  long long heartbeat() const {
    std::ifstream in(experiment() + "/trial-0/launch/heartbeat/rank-0");
    std::string word;
    long long step = -1;
    in >> word >> step;
    return step;
  }
  TempDir dir_;
  std::vector<std::string> others_;
};

// A job id recorded for the experiment that Slurm has given to another job (a controller started
// afresh with its ids from 1, ids that wrapped): pause, activate and kill refuse it with exit 1,
// naming the job, whose it is and the experiment directory, and the other job is left as it was.
TEST_F(SlurmNeverLost, VerbsRefuseARecordedJobIdThatSlurmGaveToAnotherJob) {
  // An experiment whose own job is gone.
  const std::string own = submit(config(100000));
  ASSERT_FALSE(own.empty());
  const auto killed = run({HPCTRIAL_CLI, "kill", experiment()});
  ASSERT_TRUE(killed.ok()) << killed.describe() << killed.err;
  ASSERT_TRUE(testing_support::wait_for_state(own, "CANCELLED", 60s)) << job_field(own, "JobState");

  const std::string running = other_job({});
  const std::string held = other_job({"--hold"});
  ASSERT_TRUE(testing_support::wait_for_state(running, "RUNNING", 60s)) << job_field(running, "JobState");
  ASSERT_EQ(job_field(held, "JobState"), "PENDING");
  const std::string stop = core::ExperimentLayout{experiment()}.trial(0).stop_file();
  fs::remove(stop);  // what the killed job's launcher may have left
  for (const std::string& other : {running, held}) {
    core::record_job({experiment()}, "slurm", other);  // as `hpctrial submit` records its job
    for (const char* verb : {"pause", "activate", "kill"}) {
      const auto r = run({HPCTRIAL_CLI, verb, experiment()});
      EXPECT_EQ(r.exit_code, 1) << verb << " " << other << ": " << r.out << r.err;
      EXPECT_THAT(r.err, HasSubstr("hpctrial " + std::string(verb) + ": slurm job " + other + " is not the job of " +
                                   experiment() + ": it is job \"someone-else\" of user "))
          << verb;
      EXPECT_THAT(r.err, HasSubstr("its output in " + (dir_.path() / ("other-" + other + ".out")).string()));
      EXPECT_THAT(r.err, HasSubstr("nothing was signalled, held, released or cancelled"));
      EXPECT_THAT(r.err, HasSubstr("`hpctrial submit " + experiment() + "/experiment.yaml --experiment " +
                                   experiment() + "`) to resume it"));
    }
  }
  EXPECT_EQ(job_field(running, "JobState"), "RUNNING") << "neither cancelled nor requeued";
  EXPECT_EQ(job_field(held, "JobState"), "PENDING");
  EXPECT_THAT(job_field(held, "Reason"), testing::StartsWith("JobHeld")) << "still held: not released";
  EXPECT_FALSE(fs::exists(stop)) << "no stop request for another's job";
  // describe shows the experiment's last job as forgotten, not the other's state.
  const auto describe = run({HPCTRIAL_CLI, "describe", experiment()});
  EXPECT_EQ(describe.exit_code, 0) << describe.err;
  EXPECT_THAT(describe.out, HasSubstr("slurm:       " + held + " (slurm no longer knows it)"));
  // Submitting the experiment again is not refused for the other job.
  const std::string again = submit(experiment() + "/experiment.yaml");
  ASSERT_FALSE(again.empty());
  const auto kill = run({HPCTRIAL_CLI, "kill", experiment()});
  EXPECT_TRUE(kill.ok()) << kill.err;
  EXPECT_THAT(kill.out, HasSubstr("slurm job " + again + " cancelled"));
  EXPECT_EQ(job_field(running, "JobState"), "RUNNING");
}

// `scontrol requeue` fails at the end of a paused job (a controller that does not answer): the
// launcher tries it 3 times, 2 s and 6 s apart, records the failure with the command that
// resumes the trial, and describe shows it; that command, run by hand, then activate, resume
// the trial to its end.
TEST_F(SlurmNeverLost, AFailingRequeueIsRetriedThenRecordedAndShownWithTheCommandToResume) {
  constexpr int kBatches = 1000;
  // A scontrol first on the job's PATH (sbatch --export=ALL passes the submitter's) whose
  // requeues fail, and which runs the real one for everything else.
  const auto real = run({"bash", "-c", "command -v scontrol"});
  ASSERT_TRUE(real.ok());
  const std::string requeues = (dir_.path() / "requeues").string();
  const std::string wrapper = dir_.write("bin/scontrol",
      "#!/bin/bash\ncase ${1-} in\n  requeue | requeuehold)\n    echo \"$*\" >>" + requeues + "\n"
      "    echo 'slurm_requeue error: Unable to contact slurm controller (connect failure)' >&2\n    exit 1 ;;\n"
      "esac\nexec " + real.out.substr(0, real.out.find('\n')) + " \"$@\"\n");
  ::chmod(wrapper.c_str(), 0755);
  const std::string job = submit(config(kBatches), (dir_.path() / "bin").string());
  ASSERT_FALSE(job.empty());
  ASSERT_TRUE(testing_support::wait_for_state(job, "RUNNING", 60s));
  const auto until = std::chrono::steady_clock::now() + 60s;
  while (heartbeat() < 300 && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(100ms);
  ASSERT_GE(heartbeat(), 300) << "the job never reached its first checkpoint";

  const auto pause = run({HPCTRIAL_CLI, "pause", experiment()});
  ASSERT_TRUE(pause.ok()) << pause.describe() << pause.err;
  ASSERT_TRUE(testing_support::wait_for_state(job, "FAILED", 90s)) << job_field(job, "JobState");
  EXPECT_EQ(job_field(job, "ExitCode"), "75:0") << "stopped after a durable checkpoint";
  EXPECT_EQ(read_file(requeues), "requeuehold " + job + "\nrequeuehold " + job + "\nrequeuehold " + job + "\n");
  const std::string log = read_file(experiment() + "/slurm-" + job + ".err");
  EXPECT_THAT(log, HasSubstr("trial 0 stopped (pause) after a durable checkpoint"));
  EXPECT_THAT(log, HasSubstr("'scontrol requeuehold " + job + "' exited with code 1: slurm_requeue error: Unable to "
                             "contact slurm controller (connect failure) (try 1 of 3); trying again in 2 s"));
  EXPECT_THAT(log, HasSubstr("(try 2 of 3); trying again in 6 s"));
  EXPECT_THAT(log, HasSubstr("(3 tries). Resume it by hand: scontrol requeuehold " + job));

  const auto state = nlohmann::json::parse(read_file(experiment() + "/trial-0/launcher-state.json"));
  ASSERT_TRUE(state.contains("failed_hand_over")) << state.dump();
  const auto& failed = state["failed_hand_over"];
  EXPECT_EQ(failed["job"], job);
  EXPECT_EQ(failed["tries"], 3);
  EXPECT_EQ(failed["resume"], "scontrol requeuehold " + job);
  EXPECT_THAT(failed["error"].get<std::string>(), HasSubstr("cannot requeue slurm job " + job + ": "));
  auto describe = run({HPCTRIAL_CLI, "describe", experiment()});
  EXPECT_EQ(describe.exit_code, 0) << describe.err;
  EXPECT_THAT(describe.out, HasSubstr("  hand-over:   failed at "));
  EXPECT_THAT(describe.out, HasSubstr(" when job " + job + " stopped (3 tries): cannot requeue slurm job " + job));
  EXPECT_THAT(describe.out, HasSubstr("  resume with: scontrol requeuehold " + job + "\n"));

  // The command as a user pastes it into a shell (the real scontrol), then activate.
  const auto by_hand = run({"bash", "-c", failed["resume"].get<std::string>()});
  ASSERT_TRUE(by_hand.ok()) << by_hand.describe() << by_hand.err;
  ASSERT_TRUE(testing_support::wait_for_state(job, "PENDING", 30s)) << job_field(job, "JobState");
  const auto activate = run({HPCTRIAL_CLI, "activate", experiment()});
  ASSERT_TRUE(activate.ok()) << activate.describe() << activate.err;
  ASSERT_TRUE(testing_support::wait_for_state(job, "COMPLETED", 180s))
      << job_field(job, "JobState") << "\n" << read_file(experiment() + "/slurm-" + job + ".err");
  const std::string all = read_file(experiment() + "/slurm-" + job + ".err");
  EXPECT_THAT(all, HasSubstr("resumed from "));
  EXPECT_THAT(all, HasSubstr("trial 0 finished"));
  describe = run({HPCTRIAL_CLI, "describe", experiment()});
  EXPECT_THAT(describe.out, Not(HasSubstr("hand-over:"))) << "the trial was resumed";
}

}  // namespace
}  // namespace hpctrial
