// Nothing is ever lost or mixed, in ordinary situations: experiments that share a checkpoint
// store stay apart and refuse each other's checkpoints; a metric that turns NaN resumes and is
// ranked last; a closed terminal (SIGHUP, a closed stdout, SIGPIPE) stops with a checkpoint or
// does nothing; a second run never replaces the config of a running one; a bad name or a damaged
// state file is a one-line error; with no period set, a run checkpoints by itself; replicas that
// diverge end the run, naming the tensor and the ranks.
#include <signal.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <thread>

#include "../support/read_file.h"
#include "launcher_fixture.h"

namespace hpctrial {
namespace never_lost_test {  // named: the target compiles its sources together (UNITY_BUILD)

using testing::HasSubstr;
using testing::Not;
using testing_launcher::Launcher;
using testing_support::BackgroundProcess;
using testing_support::processes_running;
using testing_support::read_file;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

nlohmann::json experiment_record(const std::string& dir) {
  return nlohmann::json::parse(read_file(fs::path(dir) / "experiment.json"));
}

std::set<std::string> checkpoint_files(const fs::path& dir) {
  std::set<std::string> out;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("ckpt-", 0) == 0) out.insert(name);
  }
  return out;
}

class NeverLost : public Launcher {
 protected:
  std::string store() const { return (dir_.path() / "store").string(); }
  // `name`'s experiment in `dir`, checkpointing every 10 batches into the shared store.
  std::string shared_config(const std::string& file, const std::string& name, std::int64_t batches = 30) {
    const std::string text = read_file(config("checkpoint_storage: {host_path: " + store() + "}\n"
                                              "min_checkpoint_period: {batches: 10}\n",
                                              batches, 2));
    return dir_.write(file, std::regex_replace(text, std::regex("^name: launched"), "name: " + name));
  }
  std::unique_ptr<BackgroundProcess> run_in(const std::string& config_path, const std::string& experiment_dir) {
    return run(config_path, "", {"--experiment", experiment_dir});
  }
  // The experiment's own folder in the shared store.
  fs::path folder_of(const std::string& experiment_dir) const {
    const nlohmann::json record = experiment_record(experiment_dir);
    return fs::path(store()) / record.at("host_folder").get<std::string>();
  }
};

// Different names, and the same name in two directories: each experiment has a folder of its
// own in the shared store, starts from batch 0, and leaves the other's files as they were.
TEST_F(NeverLost, ExperimentsSharingAHostPathStayApart) {
  const std::string a = (dir_.path() / "a").string();
  auto first = run_in(shared_config("a.yaml", "mlp"), a);
  ASSERT_EQ(first->exit_code(), 0) << first->output();
  const fs::path a_folder = folder_of(a);
  const nlohmann::json a_record = experiment_record(a);
  EXPECT_EQ(a_record.at("experiment_name"), "mlp");
  EXPECT_THAT(a_folder.filename().string(), testing::MatchesRegex("mlp-[0-9a-f]{16}"));
  ASSERT_TRUE(fs::exists(a_folder / "trial-0" / "ckpt-30.h5"));
  const auto a_files = checkpoint_files(a_folder / "trial-0");
  const auto a_time = fs::last_write_time(a_folder / "trial-0" / "ckpt-30.h5");

  for (const auto& [file, name, dir] : std::vector<std::tuple<std::string, std::string, std::string>>{
           {"b.yaml", "other", (dir_.path() / "b").string()}, {"c.yaml", "mlp", (dir_.path() / "c").string()}}) {
    auto p = run_in(shared_config(file, name), dir);
    ASSERT_EQ(p->exit_code(), 0) << p->output();
    EXPECT_THAT(p->output(), Not(HasSubstr("resumed from"))) << name << " in " << dir << " took another's checkpoint";
    const fs::path folder = folder_of(dir);
    EXPECT_NE(folder, a_folder);
    EXPECT_NE(experiment_record(dir).at("experiment_id"), a_record.at("experiment_id"));
    EXPECT_TRUE(fs::exists(folder / "trial-0" / "ckpt-30.h5")) << folder;
  }
  EXPECT_EQ(checkpoint_files(a_folder / "trial-0"), a_files) << "another experiment pruned this one's checkpoints";
  EXPECT_EQ(fs::last_write_time(a_folder / "trial-0" / "ckpt-30.h5"), a_time);
  EXPECT_FALSE(fs::exists(fs::path(store()) / "trial-0")) << "the old shared layout was used";

  // Run again: each resumes its own.
  auto again = run_in(shared_config("a.yaml", "mlp", 40), a);
  ASSERT_EQ(again->exit_code(), 0) << again->output();
  EXPECT_THAT(again->output(), HasSubstr("resumed from " + (a_folder / "trial-0" / "ckpt-30.h5").string()));
}

// A checkpoint of another experiment put where this one looks is refused, naming both.
TEST_F(NeverLost, AForeignCheckpointIsRefusedNamingBothExperiments) {
  const std::string a = (dir_.path() / "a").string();
  const std::string b = (dir_.path() / "b").string();
  ASSERT_EQ(run_in(shared_config("a.yaml", "mlp"), a)->exit_code(), 0);
  ASSERT_EQ(run_in(shared_config("b.yaml", "other", 20), b)->exit_code(), 0);
  const fs::path mine = folder_of(b) / "trial-0";
  fs::copy_file(folder_of(a) / "trial-0" / "ckpt-30.h5", mine / "ckpt-30.h5");
  std::ofstream(mine / "latest") << "ckpt-30.h5\n";
  auto p = run_in(shared_config("b.yaml", "other", 40), b);
  EXPECT_EQ(p->exit_code(), 2) << p->output();
  const std::string a_id = experiment_record(a).at("experiment_id");
  const std::string b_id = experiment_record(b).at("experiment_id");
  EXPECT_THAT(p->output(), HasSubstr((mine / "ckpt-30.h5").string() + " belongs to experiment 'mlp' (id " + a_id +
                                     ", trial 0), not to this one, 'other' (id " + b_id + ", trial 0)"));
  EXPECT_THAT(p->output(), Not(HasSubstr("resumed from")));
  EXPECT_EQ(checkpoint_files(mine), (std::set<std::string>{"ckpt-20.h5", "ckpt-30.h5"})) << "nothing is pruned";
  expect_no_rank_left();
}

// Validation turns NaN after batch 20: the run is stopped, resumed and finishes; the checkpoint
// kept as the best is the finite one of batch 10; metrics.jsonl holds "NaN".
TEST_F(NeverLost, ANaNMetricRunResumesAndRetentionKeepsTheFiniteBest) {
  const std::string exp = config("min_checkpoint_period: {batches: 10}\nmin_validation_period: {batches: 10}\n"
                                 "checkpoint_storage: {save_trial_best: 1, save_trial_latest: 1}\n",
                                 400, 2, 5, ", nan_from_batch: 20");
  auto first = start(exp);
  wait_for_step(60);
  first->signal(SIGINT);
  ASSERT_TRUE(first->wait(60s).has_value());
  ASSERT_EQ(first->exit_code(), 75) << first->output();
  auto second = run(exp);
  ASSERT_EQ(second->exit_code(), 0) << second->output();
  EXPECT_THAT(second->output(), HasSubstr("resumed from"));
  EXPECT_THAT(second->output(), Not(HasSubstr("malformed")));
  const auto kept = checkpoint_files(trial() + "/checkpoints");
  EXPECT_EQ(kept, (std::set<std::string>{"ckpt-10.h5", "ckpt-400.h5"})) << "the finite best was not kept";
  EXPECT_THAT(read_file(trial() + "/metrics.jsonl"), HasSubstr("\"validation_loss\":\"NaN\""));
}

// kill -HUP (a dropped ssh session): a stop with a checkpoint, exit 75, nothing left running, and
// the same command resumes.
TEST_F(NeverLost, SighupStopsWithACheckpointAndTheSameCommandResumes) {
  const std::string exp = config("", 100000, 2, 1);
  auto p = start(exp);
  wait_for_step(20);
  p->signal(SIGHUP);
  ASSERT_TRUE(p->wait(60s).has_value()) << p->output();
  EXPECT_EQ(p->exit_code(), 75) << p->output();
  EXPECT_THAT(p->output(), HasSubstr("trial 0 stopped (hangup) after a durable checkpoint; run the same command "
                                     "again to resume"));
  expect_no_rank_left();
  std::smatch m;
  const std::string out = p->output();
  ASSERT_TRUE(std::regex_search(out, m, std::regex("stopping after batch ([0-9]+)"))) << out;
  const std::string ckpt = trial() + "/checkpoints/ckpt-" + m[1].str() + ".h5";
  EXPECT_TRUE(fs::exists(ckpt));
  auto again = start(exp);
  wait_for_step(std::stoll(m[1]) + 5);
  again->signal(SIGINT);
  ASSERT_TRUE(again->wait(60s).has_value());
  EXPECT_THAT(again->output(), HasSubstr("resumed from " + ckpt));
}

// With no min_checkpoint_period, a run checkpoints by itself: the first after the bound (here
// 1 s, shorter than the first minute), then at the interval its measured cost allows, within the
// bound. The effective config and the log say so; a stop resumes from the last one.
TEST_F(NeverLost, ByDefaultARunCheckpointsPeriodically) {
  const std::string exp = config("checkpoint_storage: {auto_max_interval: 1s, save_trial_latest: 100}\n", 100000, 2, 20);
  auto p = start(exp);
  wait_for_step(150);  // 3 s of training
  const fs::path checkpoints = fs::path(trial()) / "checkpoints";
  const auto periodic = checkpoint_files(checkpoints);
  EXPECT_GE(periodic.size(), 2u) << p->output();
  p->signal(SIGINT);
  ASSERT_TRUE(p->wait(60s).has_value()) << p->output();
  EXPECT_EQ(p->exit_code(), 75) << p->output();
  const std::string out = p->output();
  EXPECT_THAT(out, testing::ContainsRegex("a checkpoint costs training [0-9.]+ s \\(its stall and its write\\): "
                                          "checkpointing every 1 s \\(min_checkpoint_period: auto, bounded by "
                                          "checkpoint_storage.auto_max_interval\\), [0-9.e+-]+ % of "
                                          "training time"));
  EXPECT_THAT(read_file(fs::path(experiment()) / "experiment.yaml"), HasSubstr("min_checkpoint_period: auto"));
  EXPECT_THAT(read_file(fs::path(experiment()) / "experiment.yaml"), HasSubstr("auto_max_interval: 00:00:01"));
  expect_no_rank_left();
}

// `hpctrial run ... | head`: a stdout and stderr nobody reads, and a SIGPIPE on top, neither
// end the run; the rank logs keep everything.
TEST_F(NeverLost, AClosedOutputAndSigpipeDoNotEndTheRun) {
  const std::string exp = config("", 2000, 2, 2);
  const std::string pid_file = (dir_.path() / "launcher.pid").string();
  BackgroundProcess shell({"bash", "-c", "\"$@\" > >(exit 0) 2>&1 & echo $! > " + pid_file +
                                             "; wait $!; echo \"launcher exit $?\"",
                           "bash", HPCTRIAL_CLI, "run", exp, "--oversubscribe", "--experiment", experiment()},
                          env(), (dir_.path() / "shell.txt").string());
  wait_for_step(20);
  const pid_t launcher = static_cast<pid_t>(std::stol(read_file(pid_file)));
  ASSERT_EQ(::kill(launcher, SIGPIPE), 0);
  ASSERT_TRUE(shell.wait(120s).has_value());
  EXPECT_THAT(shell.output(), HasSubstr("launcher exit 0")) << shell.output();
  EXPECT_TRUE(fs::exists(trial() + "/checkpoints/ckpt-2000.h5"));
  EXPECT_THAT(read_file(trial() + "/logs/rank-0.log"), HasSubstr("2000"));
  expect_no_rank_left();
}

// SIGHUP while the checkpoint of batch 1000 is held 4 s (slow storage: the chief's writer thread,
// or another rank at the checkpoint's start): the stop is taken at the next step boundary, not at
// the next periodic checkpoint (batch 2000), and its checkpoint waits for the held one.
TEST_F(NeverLost, ASighupWhileACheckpointIsBeingWrittenStopsAtTheNextStep) {
  for (const std::string fault : {"rank0:step1000:writer:sleep4", "rank1:step1000:checkpoint:sleep4"}) {
    SCOPED_TRACE(fault);
    fs::remove_all(experiment());
    auto p = start(config("min_checkpoint_period: {batches: 1000}\n", 100000, 2, 5), fault);
    const auto until = std::chrono::steady_clock::now() + 90s;
    while (p->output().find("injected fault") == std::string::npos && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(10ms);
    }
    ASSERT_THAT(p->output(), HasSubstr("injected fault " + fault));
    p->signal(SIGHUP);
    ASSERT_TRUE(p->wait(60s).has_value()) << p->output();
    EXPECT_EQ(p->exit_code(), 75) << p->output();
    std::smatch m;
    const std::string out = p->output();
    ASSERT_TRUE(std::regex_search(out, m, std::regex("stopping after batch ([0-9]+)"))) << out;
    EXPECT_GT(std::stoll(m[1]), 1000);
    EXPECT_LT(std::stoll(m[1]), 2000) << "the stop waited for the next periodic checkpoint";
    EXPECT_TRUE(fs::exists(trial() + "/checkpoints/ckpt-" + m[1].str() + ".h5"));
    expect_no_rank_left();
  }
}

// A second run leaves the first run's config (which its restarts read) as it was: refused as
// another experiment when it trains something else, and because the trial is running when only
// its run settings differ.
TEST_F(NeverLost, ASecondRunWithAnotherConfigLeavesTheFirstRunsConfig) {
  const std::string exp = config("", 100000, 2, 1);
  auto first = start(exp);
  wait_for_step(10);
  const std::string written = read_file(experiment() + "/experiment.yaml");
  ASSERT_THAT(written, HasSubstr("batch_ms: 1"));
  auto second = run(exp, "", {"--set", "hyperparameters.batch_ms=7"}, 60s);
  EXPECT_EQ(second->exit_code(), 2) << second->output();
  EXPECT_THAT(second->output(), HasSubstr("hyperparameters.batch_ms: 1 -> 7"));
  EXPECT_THAT(second->output(), HasSubstr("(--experiment DIR)"));
  EXPECT_EQ(read_file(experiment() + "/experiment.yaml"), written) << "the refused run replaced the config";
  auto third = run(exp, "", {"--set", "max_restarts=2"}, 60s);
  EXPECT_EQ(third->exit_code(), 1) << third->output();
  EXPECT_THAT(third->output(), HasSubstr("is run by the launcher of pid " + std::to_string(first->pid())));
  EXPECT_EQ(read_file(experiment() + "/experiment.yaml"), written) << "the refused run replaced the config";
  first->signal(SIGINT);
  ASSERT_TRUE(first->wait(60s).has_value());
  EXPECT_EQ(first->exit_code(), 75) << first->output();
}

// A start-up failure that repeats identically is reported once as the cause, on the chief and
// on another rank, not retried until max_restarts is spent.
TEST_F(NeverLost, AStartupFailureThatRepeatsIsNotRetriedAgain) {
  for (const std::string rank : {"rank0", "rank1"}) {
    fs::remove_all(experiment());
    auto p = run(config("max_restarts: 5\n", 50), rank + ":startup:exit3");
    const std::string out = p->output();
    EXPECT_EQ(p->exit_code(), 3) << out;
    EXPECT_THAT(out, HasSubstr("(restart 1 of max_restarts 5)"));
    EXPECT_THAT(out, HasSubstr("The attempt before failed the same way at the same step, so it is not restarted "
                               "again (it would fail the same way); fix the cause and run again"));
    EXPECT_THAT(out, Not(HasSubstr("(restart 2 of max_restarts 5)")));
    EXPECT_EQ(failures().size(), 2u) << rank;
    expect_no_rank_left();
  }
}

// A name that is not one safe path component: exit 2, and nothing written anywhere.
TEST_F(NeverLost, BadNamesAreRefusedBeforeAnythingIsWritten) {
  const std::string exp = config("");
  const fs::path work = dir_.path() / "work";
  fs::create_directories(work);
  for (const std::string name : {"..", ".", "a/b", "../escape", "-x"}) {
    BackgroundProcess p({"bash", "-c", "cd \"$1\" && shift && exec \"$@\"", "bash", work.string(), HPCTRIAL_CLI,
                         "run", exp, "--set", "name=" + name},
                        env(), (dir_.path() / "bad-name.txt").string());
    ASSERT_TRUE(p.wait(30s).has_value());
    EXPECT_EQ(p.exit_code(), 2) << name << ": " << p.output();
    EXPECT_THAT(p.output(), HasSubstr("name: \"" + name + "\"")) << p.output();
    EXPECT_TRUE(fs::is_empty(work)) << name << " wrote into " << work;
    EXPECT_FALSE(fs::exists(dir_.path() / "escape"));
  }
}

// State files of the wrong type or no JSON at all: one line naming the file, exit 1, no core dump.
TEST_F(NeverLost, DamagedStateFilesAreOneLineErrors) {
  ASSERT_EQ(run(config("", 10))->exit_code(), 0);
  const auto describe = [&] {
    auto p = std::make_unique<BackgroundProcess>(std::vector<std::string>{HPCTRIAL_CLI, "describe", experiment()},
                                                 env(), (dir_.path() / "describe.txt").string());
    EXPECT_TRUE(p->wait(30s).has_value());
    return p;
  };
  const std::string state = trial() + "/launcher-state.json";
  std::ofstream(state) << R"({"starts": "3", "failures": 0})";
  auto p = describe();
  EXPECT_EQ(p->exit_code(), 1) << p->output();
  EXPECT_THAT(p->output(), HasSubstr(state + ": \"starts\" holds \"3\", which is not a whole number; fix the file or "
                                             "remove it"));
  std::ofstream(state) << "{\"starts\": 1, \"failures\": 0}";
  std::ofstream(experiment() + "/experiment.json") << "{\"jobs\": [{\"id\": 5}]";
  p = describe();
  EXPECT_EQ(p->exit_code(), 1) << p->output();
  EXPECT_THAT(p->output(), HasSubstr(experiment() + "/experiment.json is not valid JSON"));
  std::ofstream(experiment() + "/experiment.json") << "{\"job_id\": 5}";
  p = describe();
  EXPECT_EQ(p->exit_code(), 1) << p->output();
  EXPECT_THAT(p->output(), HasSubstr(experiment() + "/experiment.json: \"job_id\" holds 5, which is not a string"));
}

}  // namespace never_lost_test
}  // namespace hpctrial

namespace hpctrial {
namespace never_lost_test {  // named: the target compiles its sources together (UNITY_BUILD)

// Replicas made to differ on the chief (a callback's on_validation_end, which runs there alone,
// halves the weights) and on the last rank (one weight nudged): the run ends at the next check,
// naming the first tensor that differs and the rank that holds another value than the others,
// and no checkpoint of the diverged replicas is written. The one before, still being written
// (slow storage: the chief's writer sleeps), is kept: no rank's end cuts it short.
TEST_F(NeverLost, ReplicasThatDivergeOnTheChiefEndTheRunNamingTheTensorAndTheRank) {
  const std::string exp = config("min_validation_period: {batches: 10}\nmin_checkpoint_period: {batches: 5}\n"
                                 "optimizations: {replica_check_period: 5}\nmax_restarts: 0\n",
                                 40, 3, 0, ", halve_weight_on_validation: true");
  auto p = start(exp, "rank0:step5:writer:sleep3");
  ASSERT_TRUE(p->wait(120s).has_value()) << p->output();
  EXPECT_EQ(p->exit_code(), 1) << p->output();
  EXPECT_THAT(p->output(), testing::ContainsRegex(
                               "the ranks' replicas differ at batch 10: model/0/weight is not the same on every rank "
                               "\\(checksums: ranks 1, 2 hold -?[0-9]+; rank 0 holds -?[0-9]+\\)"));
  EXPECT_THAT(p->output(), HasSubstr("code that runs on the chief alone (a branch on the rank; in on_validation_end"));
  EXPECT_EQ(checkpoint_files(fs::path(trial()) / "checkpoints"), (std::set<std::string>{"ckpt-5.h5"}));
  expect_no_rank_left();
}

// The learning rate halved in on_validation_end, on the chief alone, reaches every rank: the
// same checks after every 5 batches find nothing, and the run ends complete.
TEST_F(NeverLost, ALearningRateChangedOnTheChiefReachesEveryRankAndTheChecksPass) {
  const std::string exp = config("min_validation_period: {batches: 10}\nmin_checkpoint_period: {batches: 5}\n"
                                 "optimizations: {replica_check_period: 5}\nmax_restarts: 0\n",
                                 40, 3, 0, ", halve_lr_on_validation: true");
  auto p = start(exp);
  ASSERT_TRUE(p->wait(120s).has_value()) << p->output();
  EXPECT_EQ(p->exit_code(), 0) << p->output();
  EXPECT_THAT(p->output(), testing::Not(HasSubstr("replicas differ")));
  expect_no_rank_left();
}

TEST_F(NeverLost, ReplicasThatDivergeOnTheLastRankAreFoundBeforeTheCheckpoint) {
  const std::string exp = config("min_checkpoint_period: {batches: 5}\nmax_restarts: 0\n", 40, 3, 0,
                                 ", nudge_rank: 2, nudge_batch: 7");
  auto p = start(exp, "rank0:step5:writer:sleep3");
  ASSERT_TRUE(p->wait(120s).has_value()) << p->output();
  EXPECT_EQ(p->exit_code(), 1) << p->output();
  EXPECT_THAT(p->output(), testing::ContainsRegex(
                               "the ranks' replicas differ before the checkpoint at batch 10: model/0/weight is not "
                               "the same on every rank \\(checksums: ranks 0, 1 hold -?[0-9]+; rank 2 holds "
                               "-?[0-9]+\\)"));
  EXPECT_EQ(checkpoint_files(fs::path(trial()) / "checkpoints"), (std::set<std::string>{"ckpt-5.h5"}));
  expect_no_rank_left();
}

}  // namespace never_lost_test
}  // namespace hpctrial
