// hpctrial on PBS, end to end, without a PBS server (the pbs tier, tests/pbs/, runs against a real
// one): the qsub script that `hpctrial submit` writes is run by bash under the environment PBS
// gives a job (PBS_JOBID, PBS_NODEFILE, PBS_O_WORKDIR, PBS_ENVIRONMENT), as the child of a login
// shell, so the real launcher, mpirun and trainer run; qsub, qstat, qhold, qrls and qdel are the
// stand-ins in tests/support/fake-pbs, which record every command line and answer as the real
// server does.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <signal.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <ctime>
#include <memory>
#include <thread>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

#include "../support/background_process.h"
#include "../support/read_file.h"
#include "../support/same_weights.h"
#include "../support/temp_dir.h"
#include "hpctrial/core/subprocess.h"
#include "hpctrial/core/text.h"

namespace hpctrial {
namespace pbs_experiment_test {  // named: the target compiles its sources together (UNITY_BUILD)

using namespace std::chrono_literals;
using testing::HasSubstr;
using testing::Not;
using testing_support::expect_same_weights;
using testing_support::read_file;
using testing_support::TempDir;
namespace fs = std::filesystem;

class PbsExperiment : public testing::Test {
 protected:
  void SetUp() override { fs::create_directories(pbs_dir()); }

  std::string pbs_dir() const { return (dir_.path() / "pbs").string(); }
  std::string experiment() const { return (dir_.path() / "exp").string(); }
  std::vector<std::pair<std::string, std::string>> env() const {
    return {{"PATH", std::string(HPCTRIAL_FAKE_PBS) + ":" + (std::getenv("PATH") ? std::getenv("PATH") : "")},
            {"FAKE_PBS_DIR", pbs_dir()},
            {"OMPI_ALLOW_RUN_AS_ROOT", "1"},
            {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"}};
  }
  core::RunResult run(const std::vector<std::string>& argv, std::chrono::seconds limit = 120s) const {
    core::RunOptions options;
    options.timeout = limit;
    options.env_set = env();
    return core::run_process(argv, options);
  }
  std::string config(std::int64_t batches, const std::string& scheduler, const std::string& fault = "fail_rank: -1") {
    return dir_.write("exp.yaml",
        "name: pbs-exp\nentrypoint: " + std::string(HPCTRIAL_FAULTY_TRIAL) + "\n"
        "searcher: {name: single, metric: validation_loss, max_length: {batches: " + std::to_string(batches) + "}}\n"
        "hyperparameters: {global_batch_size: 16, " + fault + ", fail_batch: 50, fail_mode: throw, batch_ms: 2}\n"
        "resources: {slots_per_trial: 2, slots_per_node: 2}\n"
        "min_checkpoint_period: {batches: 200}\nmax_restarts: 2\n"
        "reproducibility: {experiment_seed: 11}\n"
        "scheduler: {type: pbs, queue: workq, " + scheduler + "}\n");
  }
  std::string submit(const std::string& config_path) {
    const auto r = run({HPCTRIAL_CLI, "submit", config_path, "--experiment", experiment()});
    EXPECT_TRUE(r.ok()) << r.describe() << "\n" << r.out << r.err;
    std::smatch m;
    return std::regex_search(r.out, m, std::regex(R"(submitted pbs job (\S+))")) ? m[1].str() : "";
  }
  // Runs job `id` as PBS would (see start_job) to its end; returns the script's exit code.
  int run_job(const std::string& id) {
    EXPECT_EQ(state_of(id), "Q") << id << " is not queued";
    auto shell = start_job(id);
    const auto status = shell->wait(300s);
    std::ofstream(pbs_dir() + "/" + id + ".state") << "F\n";
    std::ofstream(pbs_dir() + "/" + id + ".exit") << shell->exit_code() << "\n";
    EXPECT_TRUE(status.has_value()) << id << " did not end";
    return shell->exit_code();
  }
  // Starts job `id` as PBS would: its script (as qsub got it) run under PBS's variables, on a node
  // file naming this host twice, as the child of a login shell that leads the job's session and
  // dies of the signals PBS sends (its pid where qdel finds it).
  std::unique_ptr<testing_support::BackgroundProcess> start_job(const std::string& id) {
    char host[256] = {};
    ::gethostname(host, sizeof host - 1);
    const std::string nodes = dir_.write("nodes-" + id, std::string(host) + "\n" + host + "\n");
    const std::time_t now = std::time(nullptr);
    char stime[64];
    std::strftime(stime, sizeof stime, "%a %b %d %H:%M:%S %Y", std::localtime(&now));
    std::ofstream(pbs_dir() + "/" + id + ".stime") << stime << "\n";
    std::ofstream(pbs_dir() + "/" + id + ".state") << "R\n";
    auto variables = env();
    if (const auto open = id.find('['); open != std::string::npos) {  // a subjob of an array job
      variables.emplace_back("PBS_ARRAY_INDEX", id.substr(open + 1, id.find(']') - open - 1));
    }
    variables.insert(variables.end(), {{"PBS_JOBID", id}, {"PBS_NODEFILE", nodes},
                                       {"PBS_O_WORKDIR", dir_.path().string()}, {"PBS_ENVIRONMENT", "PBS_BATCH"},
                                       {"PBS_JOBNAME", "pbs-exp"}});
    return std::make_unique<testing_support::BackgroundProcess>(
        std::vector<std::string>{"setsid", "bash", "-c",
                                 "echo $$ > \"$FAKE_PBS_DIR/$PBS_JOBID.pid\"; bash \"$0\"; exit $?",
                                 pbs_dir() + "/" + id + ".script"},
        variables, (dir_.path() / ("shell-" + id)).string());
  }
  // Job `other`, with `first`'s script, started while `first` still runs its trial: returned once
  // its launcher says it waits for `first`'s (or after 30 s).
  std::unique_ptr<testing_support::BackgroundProcess> start_job_after(const std::string& first, const std::string& other) {
    fs::copy_file(pbs_dir() + "/" + first + ".script", pbs_dir() + "/" + other + ".script");
    std::ofstream(pbs_dir() + "/" + other + ".state") << "Q\n";
    auto waiting = start_job(other);
    const auto seen = std::chrono::steady_clock::now() + 30s;
    while (job_output(other).find("waiting for it to end") == std::string::npos &&
           std::chrono::steady_clock::now() < seen) {
      std::this_thread::sleep_for(100ms);
    }
    return waiting;
  }
  // Waits until no process of job `id`'s session is left, as PBS's MoM does before a job ends.
  bool wait_for_session_end(const std::string& id, std::chrono::seconds limit) const {
    const pid_t leader = std::stoi(read_file(pbs_dir() + "/" + id + ".pid"));
    const auto until = std::chrono::steady_clock::now() + limit;
    while (::kill(-leader, 0) == 0 && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(100ms);
    return ::kill(-leader, 0) != 0;
  }
  // Waits (up to a minute) until job `id` has trained 300 batches; the failure shows its output.
  testing::AssertionResult wait_for_training(const std::string& id) const {
    const auto until = std::chrono::steady_clock::now() + 60s;
    while (heartbeat() < 300 && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(100ms);
    if (heartbeat() >= 300) return testing::AssertionSuccess();
    return testing::AssertionFailure() << "job " << id << " reached batch " << heartbeat() << ", not 300\n"
                                       << job_output(id);
  }
  std::string state_of(const std::string& id) const { return core::trim(read_file(pbs_dir() + "/" + id + ".state")); }
  long long heartbeat() const {
    std::ifstream in(experiment() + "/trial-0/launch/heartbeat/rank-0");
    std::string word;
    long long step = -1;
    in >> word >> step;
    return step;
  }
  std::string latest_job() const {
    const auto state = nlohmann::json::parse(read_file(experiment() + "/experiment.json"));
    return state.value("job_id", std::string());
  }
  std::vector<std::string> calls(const std::string& command) const {
    std::vector<std::string> out;
    std::istringstream in(read_file(pbs_dir() + "/calls"));
    for (std::string line; std::getline(in, line);) {
      if (line.rfind(command + " ", 0) == 0) out.push_back(line);
    }
    return out;
  }
  std::string job_output(const std::string& id) const { return read_file(experiment() + "/pbs-" + id + ".out"); }
  std::string straight_run(const std::string& config_path, std::int64_t batches) {
    const std::string dir = (dir_.path() / "straight").string();
    const auto r = run({HPCTRIAL_CLI, "run", config_path, "--set", "scheduler.type=local", "--set",
                        "hyperparameters.batch_ms=0", "--experiment", dir}, 180s);
    EXPECT_TRUE(r.ok()) << r.describe() << r.err;
    return dir + "/trial-0/checkpoints/ckpt-" + std::to_string(batches) + ".h5";
  }
  TempDir dir_;
};

// The walltime runs out: the launcher's deadline stops the ranks with a checkpoint before it,
// submits the job that resumes the trial (afterany: this job), and exits; each successor resumes
// where the last stopped, until the end, with the weights of an uninterrupted run.
TEST_F(PbsExperiment, EachJobBeforeItsWalltimeSubmitsTheOneThatResumes) {
  constexpr int kBatches = 3500;  // ~10 s of 3 ms steps; each job trains for ~6 s of its minute
  const std::string exp = config(kBatches, "time_limit: 1m, preemption_grace: 52s");
  const std::string straight = straight_run(exp, kBatches);
  std::string job = submit(exp);
  ASSERT_EQ(job, "1.fakepbs");
  const std::string script = read_file(experiment() + "/job.pbs");
  EXPECT_THAT(script, HasSubstr("#PBS -l walltime=00:01:00\n"));
  EXPECT_THAT(calls("qsub"), testing::ElementsAre("qsub " + experiment() + "/job.pbs"));

  std::vector<std::string> jobs;
  for (int run = 0; run < 12 && !job.empty(); ++run) {
    jobs.push_back(job);
    const int code = run_job(job);
    const std::string next = latest_job();
    if (next == job) {
      EXPECT_EQ(code, 0) << job_output(job);
      break;
    }
    EXPECT_EQ(code, 75) << "a stopped run exits 75\n" << job_output(job);
    EXPECT_THAT(job_output(job), HasSubstr("trial 0 stopped (deadline) after a durable checkpoint"));
    EXPECT_THAT(job_output(job), HasSubstr("pbs job " + next + " submitted to resume trial 0 once job " + job +
                                           " has ended"));
    job = next;
  }
  ASSERT_GE(jobs.size(), 2u) << "the walltime never ran out";
  EXPECT_THAT(job_output(jobs.back()), HasSubstr("trial 0 finished"));
  // Every successor depends on the job before it, and runs the trial's own script.
  const auto submitted = calls("qsub");
  ASSERT_EQ(submitted.size(), jobs.size());
  for (std::size_t i = 1; i < jobs.size(); ++i) {
    EXPECT_EQ(submitted[i], "qsub -W depend=afterany:" + jobs[i - 1] + " " + experiment() + "/trial-0/resume.pbs");
    const std::regex resumed(R"(resumed from \S+/ckpt-(\d+)\.h5 after (\d+) batches)");
    EXPECT_TRUE(std::regex_search(job_output(jobs[i]), resumed)) << job_output(jobs[i]);
  }
  const auto recorded = nlohmann::json::parse(read_file(experiment() + "/experiment.json"))["jobs"];
  EXPECT_EQ(recorded.size(), jobs.size());
  // logs prints every job's output in turn; describe tells the story from the directory.
  const auto logs = run({HPCTRIAL_CLI, "logs", experiment()});
  ASSERT_TRUE(logs.ok()) << logs.describe() << logs.err;
  for (const auto& id : jobs) EXPECT_THAT(logs.out, HasSubstr("==> pbs job " + id + " <==\n"));
  EXPECT_THAT(logs.out, HasSubstr("resumed from "));
  EXPECT_THAT(logs.out, HasSubstr("trial 0 finished"));
  const auto describe = run({HPCTRIAL_CLI, "describe", experiment()});
  ASSERT_TRUE(describe.ok()) << describe.describe() << describe.err;
  for (const auto& id : jobs) EXPECT_THAT(describe.out, HasSubstr("job:         pbs " + id + ", submitted "));
  EXPECT_THAT(describe.out, HasSubstr("pbs:         " + jobs.back() + " F, 0 restart(s), exit 0\n"));
  EXPECT_THAT(describe.out, HasSubstr("output:      " + experiment() + "/pbs-" + jobs.back() + ".out\n"));
  EXPECT_THAT(describe.out, HasSubstr("batches:     " + std::to_string(kBatches) + " of "));
  expect_same_weights(straight, experiment() + "/trial-0/checkpoints/ckpt-" + std::to_string(kBatches) + ".h5");
}

// A trial that always fails stops after max_restarts inside its job and submits nothing.
TEST_F(PbsExperiment, AFailingTrialStopsAfterMaxRestartsAndSubmitsNoSuccessor) {
  const std::string job = submit(config(2500, "time_limit: 1h", "fail_rank: 1"));
  ASSERT_FALSE(job.empty());
  EXPECT_NE(run_job(job), 0);
  EXPECT_EQ(latest_job(), job);
  EXPECT_EQ(calls("qsub").size(), 1u) << "no successor for a failing trial";
  std::ifstream failures(experiment() + "/trial-0/failures.jsonl");
  int records = 0;
  for (std::string line; std::getline(failures, line);) ++records;
  EXPECT_EQ(records, 3) << "the first run and max_restarts: 2 restarts";
}

// hpctrial pause on a running PBS job: the stop request, and SIGURG to the job's processes (the
// signal its login shell ignores) that brings it to the launcher at once; the ranks checkpoint,
// the job submits its successor held (-h, afterany) and ends; activate releases it (qrls), and
// the successor ends with the weights of an uninterrupted run.
TEST_F(PbsExperiment, PauseSubmitsAHeldSuccessorAndActivateReleasesIt) {
  constexpr int kBatches = 1500;
  const std::string exp = config(kBatches, "time_limit: 1h");
  const std::string straight = straight_run(exp, kBatches);
  const std::string first = submit(exp);
  ASSERT_EQ(first, "1.fakepbs");
  auto shell = start_job(first);
  ASSERT_TRUE(wait_for_training(first));

  const auto pause = run({HPCTRIAL_CLI, "pause", experiment()});
  ASSERT_TRUE(pause.ok()) << pause.describe() << pause.out << pause.err;
  EXPECT_THAT(pause.out, HasSubstr("pausing pbs job 1.fakepbs"));
  const auto status = shell->wait(120s);
  ASSERT_TRUE(status.has_value()) << "the paused job did not end";
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 75) << job_output(first);
  std::ofstream(pbs_dir() + "/" + first + ".state") << "F\n";
  EXPECT_EQ(calls("qsig"), std::vector<std::string>{"qsig -s SIGURG 1.fakepbs"});
  EXPECT_THAT(job_output(first), HasSubstr("SIGURG: a pause of the job (hpctrial pause); passing it to the ranks"));
  const std::string second = latest_job();
  ASSERT_EQ(second, "2.fakepbs");
  EXPECT_EQ(state_of(second), "H") << "the successor of a paused job waits for activate";
  EXPECT_EQ(calls("qsub").back(), "qsub -h -W depend=afterany:1.fakepbs " + experiment() + "/trial-0/resume.pbs");
  EXPECT_THAT(job_output(first), HasSubstr("trial 0 stopped (pause) after a durable checkpoint"));
  EXPECT_THAT(job_output(first), HasSubstr("it is held: `hpctrial activate 2.fakepbs` releases it"));

  // jobs lists the held successor with its experiment; describe names it for trial 0.
  const auto listed = run({HPCTRIAL_CLI, "jobs", "--scheduler", "pbs"});
  ASSERT_TRUE(listed.ok()) << listed.describe() << listed.err;
  EXPECT_THAT(listed.out, testing::ContainsRegex("2\\.fakepbs +pbs-exp +H \\(held\\) +\\S+ +\\S+ +\\S+ +0 +- +0 +[0-9]+ +ckpt-[0-9]+\\.h5 +" +
                                                 experiment()));
  EXPECT_THAT(run({HPCTRIAL_CLI, "describe", second}).out, HasSubstr("pbs:         2.fakepbs H (held), 0 restart(s)"));
  // Slurm's controller down beside PBS: the PBS jobs are listed, Slurm is named, and the exit
  // status says the list is incomplete; --json says the same in its own form.
  {
    const std::string down = (dir_.path() / "slurm-down").string();
    fs::create_directories(down);
    // jobs asks `squeue --json`, and `scontrol show job` where squeue has no --json: both answer
    // as a Slurm whose controller is down (the real one may be up, for the slurm tier's tests).
    for (const char* command : {"squeue", "scontrol"}) {
      const std::string fake = down + "/" + command;
      std::ofstream(fake) << "#!/bin/sh\necho 'slurm_load_jobs error: Unable to contact slurm controller' >&2\nexit 1\n";
      fs::permissions(fake, fs::perms::owner_all);
    }
    core::RunOptions options;
    options.env_set = env();
    options.env_set[0].second = down + ":" + options.env_set[0].second;
    const auto partial = core::run_process({HPCTRIAL_CLI, "jobs"}, options);
    EXPECT_EQ(partial.exit_code, 1) << partial.out << partial.err;
    EXPECT_THAT(partial.err, HasSubstr("hpctrial jobs: slurm: "));
    EXPECT_THAT(partial.out, HasSubstr("2.fakepbs"));
    const auto json = core::run_process({HPCTRIAL_CLI, "jobs", "--json"}, options);
    EXPECT_EQ(json.exit_code, 1);
    const auto listed_json = nlohmann::json::parse(json.out);
    EXPECT_EQ(listed_json["unanswered"], nlohmann::json::array({"slurm"}));
    nlohmann::json held;
    for (const auto& job : listed_json["jobs"]) {
      if (job["id"] == "2.fakepbs") held = job;
    }
    ASSERT_TRUE(held.is_object()) << json.out;
    EXPECT_EQ(held["id"], "2.fakepbs");
    EXPECT_EQ(held["scheduler"], "pbs");
    EXPECT_EQ(held["state"], "held");
    EXPECT_EQ(held["held"], true);
    EXPECT_EQ(held["trial"], 0);
    EXPECT_EQ(held["experiment"], experiment());
    EXPECT_TRUE(held["batches"].is_number_integer());
    EXPECT_THAT(held["checkpoint"].get<std::string>(), testing::MatchesRegex("ckpt-[0-9]+\\.h5"));
    EXPECT_THAT(listed.out, HasSubstr(" " + std::to_string(held["batches"].get<long long>()) + " ")) << "as the table says";
  }
  // Pausing again holds nothing new; activate releases the held successor.
  const auto again = run({HPCTRIAL_CLI, "pause", experiment()});
  EXPECT_TRUE(again.ok()) << again.err;
  EXPECT_THAT(again.out, HasSubstr("already held"));
  const auto activate = run({HPCTRIAL_CLI, "activate", experiment()});
  ASSERT_TRUE(activate.ok()) << activate.describe() << activate.err;
  EXPECT_THAT(activate.out, HasSubstr("pbs job 2.fakepbs released"));
  EXPECT_THAT(calls("qrls"), testing::ElementsAre("qrls 2.fakepbs"));
  EXPECT_EQ(state_of(second), "Q");
  EXPECT_EQ(run_job(second), 0) << job_output(second);
  EXPECT_THAT(job_output(second), HasSubstr("resumed from "));
  expect_same_weights(straight, experiment() + "/trial-0/checkpoints/ckpt-" + std::to_string(kBatches) + ".h5");
}

// A job that resumes a trial can start while the job before it still ends (PBS lets no job depend
// on a subjob): its launcher waits for the other's, then resumes from its checkpoint.
TEST_F(PbsExperiment, AJobOfATrialStillRunElsewhereWaitsForItsLauncher) {
  const std::string first = submit(config(3000, "time_limit: 1h"));
  ASSERT_EQ(first, "1.fakepbs");
  auto shell = start_job(first);
  ASSERT_TRUE(wait_for_training(first));
  const std::string other = "99.fakepbs";
  auto waiting = start_job_after(first, other);
  EXPECT_THAT(job_output(other), HasSubstr("trial 0 is still run by the launcher of pbs job 1.fakepbs, pid "));
  EXPECT_FALSE(waiting->wait(0ms).has_value());
  const auto pause = run({HPCTRIAL_CLI, "pause", experiment()});
  ASSERT_TRUE(pause.ok()) << pause.err;
  ASSERT_TRUE(shell->wait(120s).has_value());
  EXPECT_EQ(shell->exit_code(), 75) << job_output(first);
  ASSERT_TRUE(waiting->wait(120s).has_value()) << job_output(other);
  EXPECT_EQ(waiting->exit_code(), 0) << job_output(other);
  EXPECT_THAT(job_output(other), HasSubstr("resumed from "));
  EXPECT_THAT(job_output(other), HasSubstr("trial 0 finished"));
}

// A warning (USR2) that comes while a job's launcher has not yet started the ranks - here it
// waits for the launcher of the job before - does not end the job: the launcher holds it, and
// once it runs the trial, stops it with a checkpoint as for any warning.
TEST_F(PbsExperiment, AWarningBeforeTheRanksStartIsHeldUntilTheLauncherCanStopThem) {
  const std::string first = submit(config(1500, "time_limit: 1h"));
  ASSERT_EQ(first, "1.fakepbs");
  auto shell = start_job(first);
  ASSERT_TRUE(wait_for_training(first));
  const std::string other = "99.fakepbs";
  auto waiting = start_job_after(first, other);
  ASSERT_THAT(job_output(other), HasSubstr("trial 0 is still run by the launcher of pbs job 1.fakepbs, pid "));
  // The batch shell, as Slurm's `--signal=B:USR2` reaches it: the job script, which is now the
  // launcher (exec).
  const auto launcher = testing_support::processes_running(HPCTRIAL_CLI, "PBS_JOBID=" + other);
  ASSERT_EQ(launcher.size(), 1u);
  ::kill(launcher.front(), SIGUSR2);
  std::this_thread::sleep_for(500ms);
  EXPECT_FALSE(waiting->wait(0ms).has_value()) << "the warning ended the waiting job\n" << job_output(other);
  const auto pause = run({HPCTRIAL_CLI, "pause", experiment()});
  ASSERT_TRUE(pause.ok()) << pause.err;
  ASSERT_TRUE(shell->wait(120s).has_value());
  EXPECT_EQ(shell->exit_code(), 75) << job_output(first);
  ASSERT_TRUE(waiting->wait(120s).has_value()) << job_output(other);
  EXPECT_EQ(waiting->exit_code(), 75) << job_output(other);
  EXPECT_THAT(job_output(other), HasSubstr("resumed from "));
  EXPECT_THAT(job_output(other), HasSubstr("trial 0 stopped (preemption) after a durable checkpoint"));
}

// pause holds a job that has not started; kill deletes every live job of the experiment; the
// verbs take the job's id as well as the directory.
TEST_F(PbsExperiment, PauseHoldsAQueuedJobAndKillDeletesIt) {
  const std::string job = submit(config(100, "time_limit: 1h"));
  ASSERT_EQ(job, "1.fakepbs");
  const auto pause = run({HPCTRIAL_CLI, "pause", job});
  ASSERT_TRUE(pause.ok()) << pause.describe() << pause.err;
  EXPECT_THAT(calls("qhold"), testing::ElementsAre("qhold 1.fakepbs"));
  EXPECT_EQ(state_of(job), "H");
  const auto second = run({HPCTRIAL_CLI, "submit", experiment() + "/experiment.yaml", "--experiment", experiment()});
  EXPECT_FALSE(second.ok()) << "a second job for the same experiment";
  EXPECT_THAT(second.err, HasSubstr("already has pbs job 1.fakepbs (state H, held)"));
  const auto kill = run({HPCTRIAL_CLI, "kill", experiment()});
  ASSERT_TRUE(kill.ok()) << kill.describe() << kill.err;
  // qdel -W: the ranks get scheduler.preemption_grace (180 s by default), not the queue's kill_delay.
  EXPECT_THAT(calls("qdel"), testing::ElementsAre("qdel -W 180 1.fakepbs"));
  EXPECT_EQ(state_of(job), "F");
  const auto nothing = run({HPCTRIAL_CLI, "kill", experiment()});
  EXPECT_FALSE(nothing.ok());
  EXPECT_THAT(nothing.err, HasSubstr("has no queued or running pbs job to kill"));
}

// A delete without warning (qdel, or the walltime reached without the grace): SIGTERM to the
// job; the ranks checkpoint within the grace, and no successor is submitted.
TEST_F(PbsExperiment, ADeleteWithoutWarningCheckpointsAndSubmitsNothing) {
  const std::string job = submit(config(100000, "time_limit: 1h, preemption_grace: 20s"));
  ASSERT_EQ(job, "1.fakepbs");
  auto shell = start_job(job);
  ASSERT_TRUE(wait_for_training(job));
  const auto kill = run({HPCTRIAL_CLI, "kill", job});
  ASSERT_TRUE(kill.ok()) << kill.describe() << kill.err;
  EXPECT_THAT(kill.out, HasSubstr("pbs job 1.fakepbs cancelled"));
  // The login shell dies of the SIGTERM at once; the launcher and the ranks checkpoint first.
  ASSERT_TRUE(shell->wait(60s).has_value()) << "the login shell outlived its SIGTERM";
  ASSERT_TRUE(wait_for_session_end(job, 60s)) << "the job outlived its SIGTERM\n" << job_output(job);
  EXPECT_THAT(calls("qdel"), testing::ElementsAre("qdel -W 20 1.fakepbs"));
  EXPECT_THAT(job_output(job), HasSubstr("trial 0 stopped (terminate) after a durable checkpoint"));
  EXPECT_EQ(calls("qsub").size(), 1u) << "a deleted job submits no successor";
  EXPECT_EQ(latest_job(), job);
  EXPECT_TRUE(fs::exists(experiment() + "/trial-0/checkpoints/latest"));
}

// A search is one array job; a subjob stopped by its walltime submits a job for its own trial
// alone, which resumes it; the other subjob is never touched.
TEST_F(PbsExperiment, ASubjobStoppedByItsWalltimeResumesItsTrialAlone) {
  constexpr int kBatches = 4000;
  const std::string exp = dir_.write("grid.yaml",
      "name: pbs-grid\nentrypoint: " + std::string(HPCTRIAL_FAULTY_TRIAL) + "\n"
      "searcher: {name: grid, metric: validation_loss, max_length: {batches: " + std::to_string(kBatches) + "}}\n"
      "hyperparameters: {global_batch_size: 16, fail_rank: -1, fail_batch: 0, fail_mode: none, batch_ms: 2,\n"
      "  variant: {type: categorical, vals: [a, b]}}\n"
      "resources: {slots_per_trial: 2, slots_per_node: 2}\nmin_checkpoint_period: {batches: 200}\n"
      "reproducibility: {experiment_seed: 11}\n"
      "scheduler: {type: pbs, time_limit: 1m, preemption_grace: 52s}\n");
  const std::string array = submit(exp);
  ASSERT_EQ(array, "1[].fakepbs");
  EXPECT_THAT(read_file(experiment() + "/job.pbs"), HasSubstr("#PBS -J 0-1\n"));
  // PBS holds and releases an array job as a whole.
  const auto pause = run({HPCTRIAL_CLI, "pause", experiment()});
  ASSERT_TRUE(pause.ok()) << pause.describe() << pause.err;
  EXPECT_THAT(calls("qhold"), testing::ElementsAre("qhold 1[].fakepbs"));
  EXPECT_EQ(state_of(array), "H");
  const auto activate = run({HPCTRIAL_CLI, "activate", experiment()});
  ASSERT_TRUE(activate.ok()) << activate.describe() << activate.err;
  EXPECT_THAT(activate.out, HasSubstr("pbs job 1[].fakepbs released"));
  EXPECT_THAT(calls("qrls"), testing::ElementsAre("qrls 1[].fakepbs"));
  std::string job = "1[1].fakepbs";
  std::vector<std::string> jobs;
  for (int run = 0; run < 12; ++run) {
    jobs.push_back(job);
    const int code = run_job(job);
    const std::string next = latest_job();
    if (next == job || next == array) {
      EXPECT_EQ(code, 0) << job_output(job);
      break;
    }
    EXPECT_EQ(code, 75) << job_output(job);
    job = next;
  }
  ASSERT_GE(jobs.size(), 2u) << "the walltime never ran out";
  const auto submitted = calls("qsub");
  ASSERT_EQ(submitted.size(), jobs.size());
  // No dependency: PBS refuses one on a subjob; the successor's launcher waits for this one's.
  EXPECT_EQ(submitted[1], "qsub " + experiment() + "/trial-1/resume.pbs");
  EXPECT_THAT(job_output("1[1].fakepbs"), HasSubstr("submitted to resume trial 1 once the launcher of subjob "
                                                    "1[1].fakepbs has ended"));
  const std::string resume = read_file(experiment() + "/trial-1/resume.pbs");
  EXPECT_THAT(resume, Not(HasSubstr("#PBS -J"))) << "the job that resumes one trial is not an array";
  EXPECT_THAT(resume, HasSubstr("launch --experiment " + experiment() + " --trial 1\n"));
  const auto recorded = nlohmann::json::parse(read_file(experiment() + "/experiment.json"))["jobs"];
  EXPECT_EQ(recorded.back().value("trial", -1), 1);
  EXPECT_THAT(job_output(jobs.back()), HasSubstr("trial 1 finished"));
  EXPECT_TRUE(fs::exists(experiment() + "/trial-1/checkpoints/ckpt-" + std::to_string(kBatches) + ".h5"));
  // Trial 0's subjob is still queued and never ran.
  EXPECT_EQ(state_of("1[0].fakepbs"), "Q");
  EXPECT_FALSE(fs::exists(experiment() + "/trial-0/checkpoints"));
  const auto logs = run({HPCTRIAL_CLI, "logs", experiment(), "--trial", "1"});
  ASSERT_TRUE(logs.ok()) << logs.describe() << logs.err;
  EXPECT_THAT(logs.out, HasSubstr("==> pbs job 1[1].fakepbs <==\n"));
  EXPECT_THAT(logs.out, HasSubstr("trial 1 finished"));
  // kill deletes the array job, and with it the subjob still queued.
  const auto kill = run({HPCTRIAL_CLI, "kill", experiment()});
  ASSERT_TRUE(kill.ok()) << kill.describe() << kill.err;
  EXPECT_THAT(calls("qdel"), testing::ElementsAre("qdel -W 52 1[].fakepbs"));
  EXPECT_EQ(state_of("1[0].fakepbs"), "F");
}

// A compute node that cannot reach the server: qstat fails in the job, and the launcher takes
// the walltime from the config, counted from its own start.
TEST_F(PbsExperiment, WithoutQstatTheConfigsTimeLimitSetsTheDeadline) {
  const std::string job = submit(config(100000, "time_limit: 1m, preemption_grace: 52s"));
  ASSERT_EQ(job, "1.fakepbs");
  std::ofstream(pbs_dir() + "/server-down") << "";
  EXPECT_EQ(run_job(job), 75) << job_output(job);
  EXPECT_THAT(job_output(job), HasSubstr("pbs did not say when job 1.fakepbs ends; assuming it ends "
                                         "scheduler.time_limit (60 s) from now"));
  EXPECT_THAT(job_output(job), HasSubstr("trial 0 stopped (deadline) after a durable checkpoint"));
  EXPECT_EQ(latest_job(), "2.fakepbs");
}

// The successor of a paused job cannot be submitted (the server is down as the job ends): qsub
// is tried 3 times, 2 s and 6 s apart; the job still exits 75 (its checkpoint is durable), the
// failure is recorded with the qsub that resumes the trial, describe shows it, and that command,
// run by hand, resumes the trial to its end (whose launcher clears the record).
TEST_F(PbsExperiment, ASuccessorThatCannotBeSubmittedIsRetriedThenRecordedWithTheCommandToResume) {
  constexpr int kBatches = 1500;
  const std::string exp = config(kBatches, "time_limit: 1h");
  const std::string first = submit(exp);
  ASSERT_EQ(first, "1.fakepbs");
  auto shell = start_job(first);
  ASSERT_TRUE(wait_for_training(first));
  std::ofstream(pbs_dir() + "/qsub-down") << "\n";
  const auto pause = run({HPCTRIAL_CLI, "pause", experiment()});
  ASSERT_TRUE(pause.ok()) << pause.describe() << pause.out << pause.err;
  ASSERT_TRUE(shell->wait(120s).has_value()) << "the paused job did not end\n" << job_output(first);
  EXPECT_EQ(shell->exit_code(), 75) << "stopped after a durable checkpoint\n" << job_output(first);
  std::ofstream(pbs_dir() + "/" + first + ".state") << "F\n";

  const std::string successor = "qsub -h -W depend=afterany:1.fakepbs " + experiment() + "/trial-0/resume.pbs";
  EXPECT_THAT(calls("qsub"), testing::ElementsAre("qsub " + experiment() + "/job.pbs", successor, successor, successor));
  EXPECT_EQ(latest_job(), first) << "no successor recorded";
  const std::string output = job_output(first);
  EXPECT_THAT(output, HasSubstr("qsub: cannot connect to server fakepbs (errno=111) (try 1 of 3); trying again in 2 s"));
  EXPECT_THAT(output, HasSubstr("(try 2 of 3); trying again in 6 s"));
  EXPECT_THAT(output, HasSubstr("trial 0 stopped after a durable checkpoint, but nothing will resume it: cannot "
                                "submit the pbs job that resumes trial 0"));
  const std::string by_hand = "qsub " + experiment() + "/trial-0/resume.pbs";
  EXPECT_THAT(output, HasSubstr("(3 tries). Resume it by hand: " + by_hand));

  const auto state = nlohmann::json::parse(read_file(experiment() + "/trial-0/launcher-state.json"));
  ASSERT_TRUE(state.contains("failed_hand_over")) << state.dump();
  const auto& failed = state["failed_hand_over"];
  EXPECT_EQ(failed["job"], first);
  EXPECT_EQ(failed["tries"], 3);
  EXPECT_EQ(failed["resume"], by_hand);
  EXPECT_THAT(failed["error"].get<std::string>(), HasSubstr("qsub: cannot connect to server fakepbs (errno=111)"));
  auto describe = run({HPCTRIAL_CLI, "describe", experiment()});
  EXPECT_EQ(describe.exit_code, 0) << describe.err;
  EXPECT_THAT(describe.out, HasSubstr("  hand-over:   failed at "));
  EXPECT_THAT(describe.out, HasSubstr(" when job 1.fakepbs stopped (3 tries): cannot submit the pbs job that resumes "
                                      "trial 0: "));
  EXPECT_THAT(describe.out, HasSubstr("  resume with: " + by_hand + "\n"));

  // The command as a user pastes it into a shell.
  fs::remove(pbs_dir() + "/qsub-down");
  const auto resumed = run({"bash", "-c", failed["resume"].get<std::string>()});
  ASSERT_TRUE(resumed.ok()) << resumed.describe() << resumed.err;
  const std::string second = core::trim(resumed.out);
  ASSERT_EQ(second, "2.fakepbs");
  EXPECT_EQ(run_job(second), 0) << job_output(second);
  EXPECT_THAT(job_output(second), HasSubstr("resumed from "));
  EXPECT_THAT(job_output(second), HasSubstr("trial 0 finished"));
  EXPECT_TRUE(fs::exists(experiment() + "/trial-0/checkpoints/ckpt-" + std::to_string(kBatches) + ".h5"));
  describe = run({HPCTRIAL_CLI, "describe", experiment()});
  EXPECT_EQ(describe.exit_code, 0) << describe.err;
  EXPECT_THAT(describe.out, Not(HasSubstr("hand-over:"))) << "the trial was resumed";
}

// A directory PBS cannot name in an #PBS -o line is refused before anything is written.
TEST_F(PbsExperiment, AnExperimentDirectoryPbsCannotNameIsRefusedBeforeAnythingIsWritten) {
  const std::string odd = (dir_.path() / "my runs" / "exp").string();
  const auto r = run({HPCTRIAL_CLI, "submit", config(100, "time_limit: 1h"), "--experiment", odd});
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("experiment directory " + odd + ": PBS reads the output path"));
  EXPECT_FALSE(fs::exists(dir_.path() / "my runs")) << "nothing is written for a refused submission";
  EXPECT_TRUE(calls("qsub").empty());
}

}  // namespace pbs_experiment_test
}  // namespace hpctrial
