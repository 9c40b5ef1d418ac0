// `hpctrial run` with real mpirun and the fault hook of the trainer (HPCTRIAL_FAULT): every way a
// rank can fail ends the attempt quickly, with a failure record and no process left behind;
// failures restart from the latest checkpoint up to max_restarts; a stop request checkpoints
// and exits 75, and running again ends with the weights of an uninterrupted run.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <regex>

#include "../support/read_file.h"
#include "../support/same_weights.h"
#include "launcher_fixture.h"
#include "hpctrial/checkpoint/format.h"
#include "hpctrial/core/env.h"
#include "hpctrial/core/subprocess.h"

namespace hpctrial {
namespace launcher_test {  // named: the target compiles its sources together (UNITY_BUILD)

using testing::HasSubstr;
using testing::Not;
using testing_launcher::Launcher;
using testing_support::BackgroundProcess;
using testing_support::processes_running;
using testing_support::read_file;
using nlohmann::json;
using namespace std::chrono_literals;

struct FaultCase {
  const char* name;
  const char* fault;
  int ranks;
  int exit_code;
  const char* reason;  // in the failure record and the launcher's message
  int signal = 0;      // the signal that ends the rank, if one does
};

class EachFault : public Launcher, public testing::WithParamInterface<FaultCase> {};

// max_restarts 0: the first failure ends the run, with the rank, how it failed (its own exit
// code or signal, whichever process saw it first) and its log tail. Only the hang is ended by
// the launcher's hang watch; the others keep its default, because its clock runs from the start
// for the first step, and under load the ranks can take longer than a short timeout to get there.
TEST_P(EachFault, EndsTheRunWithARecordAndNoRankLeft) {
  const FaultCase& c = GetParam();
  const bool hang = std::string(c.name) == "hang";
  const std::string exp = config(std::string("max_restarts: 0\noptimizations: {collective_timeout: 1h}\n") +
                                     (hang ? "launcher: {hang_timeout: 10s}\n" : ""),
                                 100000, c.ranks);
  auto p = run(exp, c.fault);
  const std::string out = p->output();
  EXPECT_EQ(p->exit_code(), c.exit_code) << out;
  std::printf("[ measured ] %s on %d ranks: hpctrial run ended after %.1f s\n", c.name, c.ranks, p->seconds());
  EXPECT_LT(p->seconds(), 45) << out;
  EXPECT_THAT(out, HasSubstr("trial 0 failed: "));
  EXPECT_THAT(out, HasSubstr(c.reason));
  EXPECT_THAT(out, HasSubstr("It has failed 1 time(s) and max_restarts is 0, so it is not restarted"));
  const auto records = failures();
  ASSERT_EQ(records.size(), 1u) << out;
  EXPECT_THAT(records[0]["reason"].get<std::string>(), HasSubstr(c.reason));
  if (c.signal != 0) {
    EXPECT_EQ(records[0]["signal"], c.signal) << records[0].dump(1);
  }
  EXPECT_TRUE(records[0]["last_steps"].is_object());
  EXPECT_TRUE(std::filesystem::exists(trial() + "/launch/abort-0"))
      << "the signal for ranks on other hosts, which the launcher cannot reach";
  if (!hang) {
    const int rank = c.fault[4] - '0';
    EXPECT_EQ(records[0]["rank"], rank);
    EXPECT_EQ(records[0]["phase"], "batch");
    EXPECT_EQ(records[0]["step"], 12);
    EXPECT_THAT(out, HasSubstr("trial 0 failed: rank " + std::to_string(rank) + " "));
    EXPECT_THAT(records[0]["log_tail"].dump(), HasSubstr("injected fault")) << records[0].dump(1);
  }
  expect_no_rank_left();
}

INSTANTIATE_TEST_SUITE_P(
    Launcher, EachFault,
    testing::Values(
        FaultCase{"exit", "rank1:step12:exit3", 2, 3, "exited with code 3"},
        FaultCase{"sigkill", "rank2:step12:sigkill", 4, 128 + 9, "was killed by signal 9", 9},
        FaultCase{"segfault", "rank1:step12:segv", 2, 128 + 11, "was killed by signal 11", 11},
        FaultCase{"exit0", "rank1:step12:exit0", 2, 1, "exited with code 0 while the others still ran"},
        FaultCase{"throw", "rank1:step12:throw", 2, 1, "failed and aborted the job with code 1"},
        FaultCase{"hang", "rank1:step12:hang", 2, 1,
                  "no rank finished a training step for 10 s (launcher.hang_timeout)"}),
    [](const testing::TestParamInfo<FaultCase>& info) { return std::string(info.param.name); });

// A grid on a workstation: `hpctrial run` runs its trials one after the other, each with its own
// values; --trial N runs one; a trial that does not exist is refused before anything is written.
TEST_F(Launcher, AGridRunsEachTrialInTurnOrTheOneNamed) {
  const std::string grid = dir_.write("grid.yaml",
      "name: grid\nentrypoint: " + std::string(HPCTRIAL_FAULTY_TRIAL) + "\n"
      "searcher: {name: grid, metric: validation_loss, max_length: {batches: 50}}\n"
      "hyperparameters: {global_batch_size: 16, fail_rank: -1, fail_batch: 0, fail_mode: none,\n"
      "                  lr: {type: categorical, vals: [0.5, 0.25]}}\n"
      "resources: {slots_per_trial: 1}\nreproducibility: {experiment_seed: 7}\n");
  auto bad = run(grid, "", {"--trial", "2"});
  EXPECT_EQ(bad->exit_code(), 2);
  EXPECT_THAT(bad->output(), HasSubstr("--trial 2 does not exist: the grid searcher makes 2 trial(s), 0 to 1"));
  EXPECT_FALSE(std::filesystem::exists(experiment())) << "a refused --trial wrote the experiment";
  auto p = run(grid);
  ASSERT_EQ(p->exit_code(), 0) << p->output();
  EXPECT_THAT(p->output(), HasSubstr("trial 0 finished"));
  EXPECT_THAT(p->output(), HasSubstr("trial 1 finished"));
  EXPECT_THAT(read_file(experiment() + "/trial-0/effective-config.yaml"), HasSubstr("lr: 0.5"));
  EXPECT_THAT(read_file(experiment() + "/trial-1/effective-config.yaml"), HasSubstr("lr: 0.25"));
  // describe --json says what the text says: the ranking, each trial's checkpoint and runs.
  const auto text = core::run_process({HPCTRIAL_CLI, "describe", experiment()});
  const auto described = core::run_process({HPCTRIAL_CLI, "describe", experiment(), "--json"});
  ASSERT_EQ(described.exit_code, 0) << described.err;
  const json d = json::parse(described.out);
  EXPECT_EQ(d["experiment"], "grid");
  EXPECT_EQ(d["searcher"], "grid");
  ASSERT_EQ(d["ranking"].size(), 2u);
  ASSERT_EQ(d["trials"].size(), 2u);
  for (const auto& trial : d["trials"]) {
    const int id = trial["trial"];
    EXPECT_EQ(trial["batches"], 50);
    EXPECT_EQ(trial["checkpoint"], experiment() + "/trial-" + std::to_string(id) + "/checkpoints/ckpt-50.h5");
    EXPECT_THAT(text.out, HasSubstr("  checkpoint:  " + trial["checkpoint"].get<std::string>() + "\n"));
    EXPECT_EQ(trial["hparams"]["lr"], id == 0 ? "0.5" : "0.25");
    ASSERT_EQ(trial["runs"].size(), 1u);
    EXPECT_EQ(trial["runs"][0]["ranks"], 1);
    EXPECT_EQ(trial["failures"], 0);
  }
  // The best first, as the text's ranking lists it.
  for (int place = 0; place < 2; ++place) {
    EXPECT_THAT(text.out, testing::ContainsRegex("\n  " + std::to_string(place + 1) + " +" +
                                                 std::to_string(d["ranking"][place]["trial"].get<int>()) + " +"));
  }
  const std::string other = (dir_.path() / "one").string();
  auto one = run(grid, "", {"--trial", "1", "--experiment", other});
  ASSERT_EQ(one->exit_code(), 0) << one->output();
  EXPECT_TRUE(std::filesystem::exists(other + "/trial-1/checkpoints/ckpt-50.h5"));
  EXPECT_FALSE(std::filesystem::exists(other + "/trial-0"));
}

// Over the loopback interface named in optimizations.network_interface, too: both attempts'
// mpirun wire up their daemons and ranks over it alone. The checkpoints are written before
// training goes on (`async: false`): an asynchronous one of batch 20 may still be on its way at
// batch 30, when the fault strikes, and then the latest checkpoint is none.
TEST_F(Launcher, AFailureRestartsFromTheLatestCheckpoint) {
  const std::string exp = config("max_restarts: 2\nmin_checkpoint_period: {batches: 20}\n"
                                 "checkpoint_storage: {async: false}\n"
                                 "optimizations: {network_interface: lo}\n", 200);
  auto p = run(exp, "rank1:step30:restart0:sigkill");
  const std::string out = p->output();
  EXPECT_EQ(p->exit_code(), 0) << out;
  EXPECT_THAT(out, HasSubstr("restarting from its latest checkpoint (restart 1 of max_restarts 2)"));
  EXPECT_THAT(out, HasSubstr("resumed from " + trial() + "/checkpoints/ckpt-20.h5 after 20 batches"));
  EXPECT_THAT(out, HasSubstr("trial 0 finished"));
  const auto records = failures();
  ASSERT_EQ(records.size(), 1u);
  EXPECT_EQ(records[0]["rank"], 1);
  EXPECT_EQ(records[0]["signal"], 9);
  EXPECT_THAT(records[0]["reason"].get<std::string>(), HasSubstr("was killed by signal 9"));
  EXPECT_GE(records[0]["last_steps"]["0"].get<long long>(), 20);
  expect_no_rank_left();
}

// launcher.startup_hook runs before the ranks with their environment, its output in the log; a
// hook that fails ends the run with its status and last lines, named as the hook's, no rank
// started and nothing counted as the trial's failure.
TEST_F(Launcher, AStartupHookRunsBeforeTheRanksAndItsFailureIsItsOwn) {
  const std::string ran = (dir_.path() / "hook-ran").string();
  const std::string good = config("launcher: {startup_hook: 'echo prepared for trial $HPCTRIAL_TRIAL_ID; touch " + ran +
                                  "'}\n", 20);
  auto p = run(good);
  std::string out = p->output();
  EXPECT_EQ(p->exit_code(), 0) << out;
  EXPECT_THAT(out, HasSubstr("startup hook on 1 node(s): echo prepared for trial"));
  EXPECT_THAT(out, HasSubstr("[startup hook] prepared for trial 0"));
  EXPECT_LT(out.find("[startup hook] prepared"), out.find("starting 2 rank(s) of trial 0")) << out;
  EXPECT_TRUE(std::filesystem::exists(ran));

  std::filesystem::remove_all(experiment());
  const std::string bad = config("max_restarts: 3\nlauncher: {startup_hook: [/bin/sh, -c, 'echo no scratch space "
                                 "left >&2; exit 7']}\n", 20);
  p = run(bad);
  out = p->output();
  EXPECT_EQ(p->exit_code(), 7) << out;
  EXPECT_THAT(out, HasSubstr("the startup hook (launcher.startup_hook: echo no scratch space left >&2; exit 7) "
                             "exited with status 7; the ranks were not started and the trial is not retried"));
  EXPECT_THAT(out, HasSubstr("Its last lines:\n  no scratch space left"));
  EXPECT_THAT(out, Not(HasSubstr("starting 2 rank(s)")));
  EXPECT_TRUE(failures().empty());
  const json state = json::parse(testing_support::read_file(trial() + "/launcher-state.json"));
  EXPECT_EQ(state["startup_hook_failure"]["exit_code"], 7);
  EXPECT_EQ(state.value("failures", 0), 0);
  expect_no_rank_left();
}

// The entrypoint's program is frozen when the experiment is made: every start runs the copy,
// whose digest runs.jsonl and the checkpoints record; the program rebuilt at its path is refused,
// naming both digests, until --update-code, which runs it and records the change.
TEST_F(Launcher, TheProgramIsFrozenWhenTheExperimentIsMadeAndAnUpdateIsRecorded) {
  const std::string program = (dir_.path() / "my-trial").string();
  std::filesystem::copy_file(HPCTRIAL_FAULTY_TRIAL, program);
  std::string exp = config("min_checkpoint_period: {batches: 10}\n", 20);
  {
    std::string text = testing_support::read_file(exp);
    text.replace(text.find(HPCTRIAL_FAULTY_TRIAL), std::string(HPCTRIAL_FAULTY_TRIAL).size(), program);
    exp = dir_.write("exp.yaml", text);
  }
  auto p = run(exp);
  std::string out = p->output();
  ASSERT_EQ(p->exit_code(), 0) << out;
  const json first = json::parse(testing_support::read_file(experiment() + "/experiment.json"));
  const std::string digest = first["code"]["digest"];
  const std::string frozen = experiment() + "/code/" + digest + "/my-trial";
  EXPECT_EQ(digest.size(), 64u);
  EXPECT_EQ(first["code"]["source"], program);
  EXPECT_EQ(first["code"]["path"], frozen);
  EXPECT_THAT(testing_support::read_file(experiment() + "/experiment.yaml"), HasSubstr(frozen));
  EXPECT_THAT(out, HasSubstr("the experiment runs " + program + " as frozen now"));
  EXPECT_THAT(testing_support::read_file(trial() + "/runs.jsonl"), HasSubstr("\"code\":\"" + digest + "\""));
  EXPECT_EQ(checkpoint::read_summary(trial() + "/checkpoints/ckpt-20.h5").attributes["code_digest"], digest);

  // Rebuilt: other bytes at the path.
  std::ofstream(program, std::ios::app) << "rebuilt";
  p = run(exp);
  out = p->output();
  EXPECT_EQ(p->exit_code(), 2) << out;
  EXPECT_THAT(out, HasSubstr(program + " is not the code this experiment runs: its SHA-256 is "));
  EXPECT_THAT(out, HasSubstr("and the experiment froze " + digest + " (" + program + ", kept as " + frozen + ")"));
  EXPECT_THAT(out, HasSubstr("Pass --update-code"));

  p = run(exp, "", {"--update-code"});
  out = p->output();
  EXPECT_EQ(p->exit_code(), 0) << out;
  const json updated = json::parse(testing_support::read_file(experiment() + "/experiment.json"));
  const std::string now = updated["code"]["digest"];
  EXPECT_NE(now, digest);
  ASSERT_EQ(updated["code_changes"].size(), 1u);
  EXPECT_EQ(updated["code_changes"][0]["from"], digest);
  EXPECT_EQ(updated["code_changes"][0]["to"], now);
  EXPECT_TRUE(std::filesystem::exists(frozen)) << "the copy the checkpoints name stays";
  EXPECT_THAT(testing_support::read_file(trial() + "/runs.jsonl"), HasSubstr("\"code\":\"" + now + "\""));
}

// context: the folder is frozen with the code through its .hpctrialignore (a pattern, a folder,
// a negation), the ranks and the startup hook run in the copy; the folder changed is refused,
// naming both digests, until --update-code, which records the change; a folder beyond the size
// limit is refused naming its largest file, and a symbolic link naming the fix.
TEST_F(Launcher, TheContextFolderIsFrozenAndTheRanksRunInIt) {
  const std::filesystem::path context = dir_.path() / "context";
  dir_.write("context/notes.txt", "first notes\n");
  dir_.write("context/sub/keep.txt", "kept\n");
  dir_.write("context/weights.bin", "large");
  dir_.write("context/sub/needed.bin", "needed");
  dir_.write("context/logs/old.log", "old");
  dir_.write("context/.hpctrialignore", "# not the trial's\n*.bin\n!sub/needed.bin\nlogs/\n");
  const std::string exp = config("context: " + context.string() + "\n"
                                 "launcher: {startup_hook: 'cat notes.txt; echo in $(pwd)'}\n", 20);
  auto p = run(exp);
  std::string out = p->output();
  ASSERT_EQ(p->exit_code(), 0) << out;
  const json first = json::parse(testing_support::read_file(experiment() + "/experiment.json"));
  const std::string digest = first["context"]["digest"];
  const std::string frozen = experiment() + "/code/" + digest + "/context";
  EXPECT_EQ(first["context"]["source"], context.string());
  EXPECT_EQ(first["context"]["path"], frozen);
  EXPECT_THAT(testing_support::read_file(experiment() + "/experiment.yaml"), HasSubstr("context: \"" + frozen + "\""));
  EXPECT_THAT(out, HasSubstr("[startup hook] first notes"));
  EXPECT_THAT(out, HasSubstr("[startup hook] in " + frozen));
  namespace fs = std::filesystem;
  EXPECT_TRUE(fs::exists(frozen + "/notes.txt"));
  EXPECT_TRUE(fs::exists(frozen + "/sub/keep.txt"));
  EXPECT_TRUE(fs::exists(frozen + "/sub/needed.bin")) << "kept again by the negation";
  EXPECT_TRUE(fs::exists(frozen + "/.hpctrialignore"));
  EXPECT_FALSE(fs::exists(frozen + "/weights.bin"));
  EXPECT_FALSE(fs::exists(frozen + "/logs"));
  EXPECT_EQ(fs::status(frozen + "/notes.txt").permissions() & fs::perms::others_read, fs::perms::none);

  // Changed: refused until --update-code, which freezes the folder anew and records the change.
  dir_.write("context/notes.txt", "second notes\n");
  p = run(exp, "", {"--set", "searcher.max_length={batches: 30}"});
  out = p->output();
  EXPECT_EQ(p->exit_code(), 2) << out;
  EXPECT_THAT(out, HasSubstr("context: " + context.string() + " now holds files of SHA-256 "));
  EXPECT_THAT(out, HasSubstr("but the experiment froze " + digest + " (kept as " + frozen + ")"));
  p = run(exp, "", {"--set", "searcher.max_length={batches: 30}", "--update-code"});
  out = p->output();
  EXPECT_EQ(p->exit_code(), 0) << out;
  EXPECT_THAT(out, HasSubstr("[startup hook] second notes"));
  const json updated = json::parse(testing_support::read_file(experiment() + "/experiment.json"));
  ASSERT_EQ(updated["context_changes"].size(), 1u);
  EXPECT_EQ(updated["context_changes"][0]["from"], digest);
  EXPECT_EQ(updated["context_changes"][0]["to"], updated["context"]["digest"]);
  EXPECT_TRUE(fs::exists(frozen + "/notes.txt")) << "the first copy stays";

  // Beyond the limit (a sparse file: its size, not its blocks), and a symbolic link.
  fs::remove_all(experiment());
  {
    std::ofstream big(context / "big.data");
  }
  fs::resize_file(context / "big.data", std::uintmax_t{97} << 20);
  p = run(exp);
  out = p->output();
  EXPECT_EQ(p->exit_code(), 2) << out;
  EXPECT_THAT(out, HasSubstr("more than the 96 MiB an experiment freezes; the largest: big.data (97.0 MiB)"));
  fs::remove(context / "big.data");
  fs::create_symlink("/etc/hostname", context / "link");
  p = run(exp);
  out = p->output();
  EXPECT_EQ(p->exit_code(), 2) << out;
  EXPECT_THAT(out, HasSubstr("context: " + (context / "link").string() + " is a symbolic link"));
}

// Each rank sees what torchrun would set: its rank, local rank and the sizes, and one rendezvous
// address and port for all.
TEST_F(Launcher, EachRankSeesTorchsLaunchVariables) {
  const std::string exp = config("", 4, 2, 0, ", print_torch_env: true");
  auto p = run(exp);
  ASSERT_EQ(p->exit_code(), 0) << p->output();
  const std::string host = core::host_name();
  std::string port;
  for (int rank = 0; rank < 2; ++rank) {
    const std::string log = read_file(trial() + "/logs/rank-" + std::to_string(rank) + ".log");
    std::smatch m;
    ASSERT_TRUE(std::regex_search(log, m, std::regex("torch env RANK=(\\d+) LOCAL_RANK=(\\d+) WORLD_SIZE=2 "
                                                     "LOCAL_WORLD_SIZE=2 MASTER_ADDR=(\\S+) MASTER_PORT=(\\d+)")))
        << log;
    EXPECT_EQ(m[1], std::to_string(rank));
    EXPECT_EQ(m[2], std::to_string(rank));
    EXPECT_EQ(m[3], host);
    if (rank == 0) port = m[4];
    EXPECT_EQ(m[4], port) << "one port for all ranks";
    EXPECT_GT(std::stoi(port), 0);
  }
  // `hpctrial logs --tail N`: the last N lines, as tail -n N prints them.
  const std::string log = read_file(trial() + "/logs/rank-0.log");
  std::vector<std::string> lines;
  for (std::size_t at = 0; at < log.size();) {
    const auto end = log.find('\n', at);
    lines.push_back(log.substr(at, end - at + 1));
    at = end + 1;
  }
  ASSERT_GE(lines.size(), 3u) << log;
  const auto tail = core::run_process({HPCTRIAL_CLI, "logs", experiment(), "--rank", "0", "--tail", "2"});
  EXPECT_EQ(tail.exit_code, 0) << tail.err;
  EXPECT_EQ(tail.out, lines[lines.size() - 2] + lines.back());
  EXPECT_EQ(core::run_process({HPCTRIAL_CLI, "logs", experiment(), "--rank", "0", "--tail", "100000"}).out, log);
  EXPECT_EQ(core::run_process({HPCTRIAL_CLI, "logs", experiment(), "--rank", "0", "-n", "0"}).out, "");
}

TEST_F(Launcher, ATrialThatFailsEveryTimeStopsAfterMaxRestarts) {
  const std::string exp = config("max_restarts: 2\n", 200);
  auto p = run(exp, "rank0:step5:exit3");
  const std::string out = p->output();
  EXPECT_EQ(p->exit_code(), 3) << out;
  EXPECT_THAT(out, HasSubstr("(restart 1 of max_restarts 2)"));
  EXPECT_THAT(out, HasSubstr("(restart 2 of max_restarts 2)"));
  EXPECT_THAT(out, HasSubstr("It has failed 3 time(s) and max_restarts is 2, so it is not restarted; the failures are "
                             "recorded in " + trial() + "/failures.jsonl"));
  EXPECT_EQ(failures().size(), 3u);
  expect_no_rank_left();
}

// A rank's output and message that are not UTF-8 are recorded all the same, in valid JSON.
TEST_F(Launcher, BytesThatAreNotUtf8AreRecordedAsTheyCanBe) {
  const std::string exp = dir_.write("binary.yaml",
      "name: binary\nentrypoint: " + std::string(HPCTRIAL_FAULTY_TRIAL) + "\n"
      "searcher: {name: single, metric: validation_loss, max_length: {batches: 100}}\n"
      "hyperparameters: {global_batch_size: 16, fail_rank: 1, fail_batch: 5, fail_mode: binary}\n"
      "resources: {slots_per_trial: 2}\nmax_restarts: 0\n");
  auto p = run(exp);
  const std::string out = p->output();
  EXPECT_EQ(p->exit_code(), 1) << out;
  const auto records = failures();  // parses every line
  ASSERT_EQ(records.size(), 1u) << out;
  EXPECT_EQ(records[0].value("rank", -1), 1);
  EXPECT_THAT(records[0].value("message", ""), HasSubstr("undecodable \xEF\xBF\xBD\xEF\xBF\xBD bytes"))
      << "each byte that is not UTF-8 becomes U+FFFD";
  EXPECT_THAT(records[0].dump(), HasSubstr("from a dying library"));
  expect_no_rank_left();
}

// SIGUSR2 (the scheduler's warning, as the batch shell gets it) -> every rank checkpoints after
// the same step and exits 75; running again ends exactly where an uninterrupted run does.
TEST_F(Launcher, AStopRequestCheckpointsAndRunningAgainEndsWithTheSameWeights) {
  // Ranks that sleep 1 ms a batch (a trial waiting on its device) leave the 2 cores of a test
  // machine to the launcher and the test: the signal lands mid-run however busy the machine.
  constexpr std::int64_t kBatches = 4000;
  // The uninterrupted run without the sleep, which changes no number.
  const std::string straight_config = config("", kBatches, 2, 0);
  auto straight = run(straight_config, "", {"--experiment", (dir_.path() / "straight").string()});
  ASSERT_EQ(straight->exit_code(), 0) << straight->output();

  auto first = start(config("", kBatches, 2, 1));
  wait_for_step(50);
  const long long at_signal = heartbeat(0);
  first->signal(SIGUSR2);
  ASSERT_TRUE(first->wait(60s).has_value());
  const std::string out = first->output();
  EXPECT_EQ(first->exit_code(), 75) << out << "\nstop request: " << std::filesystem::exists(trial() + "/stop-request")
                                    << "\nheartbeat at the signal: " << at_signal;
  EXPECT_THAT(out, HasSubstr("trial 0 stopped (preemption) after a durable checkpoint"));
  std::smatch m;
  ASSERT_TRUE(std::regex_search(out, m, std::regex("stopping after batch ([0-9]+) of 4000"))) << out;
  const std::string stopped_at = m[1];
  EXPECT_TRUE(std::filesystem::exists(trial() + "/checkpoints/ckpt-" + stopped_at + ".h5"));
  EXPECT_THAT(out, testing::Not(HasSubstr("Exit code:"))) << "mpirun's report of the 75s is held back";
  expect_no_rank_left();

  auto second = run(config("", kBatches, 2, 1));
  EXPECT_EQ(second->exit_code(), 0) << second->output();
  EXPECT_THAT(second->output(), HasSubstr("resumed from " + trial() + "/checkpoints/ckpt-" + stopped_at + ".h5"));

  const std::string end = "/trial-0/checkpoints/ckpt-" + std::to_string(kBatches) + ".h5";
  testing_support::expect_same_weights((dir_.path() / "straight").string() + end, experiment() + end);
}

// Ctrl-C as soon as the ranks train, while mpirun is too young to be signalled safely: the
// launcher signals it once it has seen the first rank, and the ranks stop within a few steps of
// the request (2 ms steps: a request noticed only by the chief's look at the request on disk,
// once a second, would land hundreds of steps later).
TEST_F(Launcher, AStopRightAfterTheStartLandsWithinAFewSteps) {
  auto p = start(config("", 100000, 2, 2));
  wait_for_step(1);
  const long long at_signal = heartbeat(0);
  p->signal(SIGINT);
  ASSERT_TRUE(p->wait(60s).has_value());
  const std::string out = p->output();
  EXPECT_EQ(p->exit_code(), 75) << out;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(out, m, std::regex("stopping after batch ([0-9]+) of 100000"))) << out;
  EXPECT_LT(std::stoll(m[1]) - at_signal, 150) << "the signal reached the ranks late:\n" << out;
  expect_no_rank_left();
}

// A warning that comes while the ranks still load their libraries (before their handlers exist)
// waits for the handlers: the ranks stop with a checkpoint instead of dying of SIGUSR2.
TEST_F(Launcher, AWarningBeforeTheRanksHandleSignalsStopsThemWithACheckpoint) {
  const auto marks = dir_.path() / "starting";
  std::filesystem::create_directories(marks);
  extra_env_ = {{"FAULTY_TRIAL_START_MS", "6000"}, {"FAULTY_TRIAL_START_MARKS", marks.string()}};
  auto launcher = start(config("", 100000, 2, 1));
  const auto ranks_started = [&] {
    const auto entries = std::filesystem::directory_iterator(marks);
    return std::distance(std::filesystem::begin(entries), std::filesystem::end(entries));
  };
  const auto until = std::chrono::steady_clock::now() + 60s;
  while (ranks_started() < 2 && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(20ms);
  ASSERT_EQ(ranks_started(), 2) << launcher->output();
  // Past the 2 s after which the launcher passes a warning to mpirun; the ranks sleep 6 s.
  std::this_thread::sleep_for(2500ms);
  EXPECT_EQ(heartbeat(0), -1) << "the ranks were to be still starting";
  launcher->signal(SIGUSR2);
  ASSERT_TRUE(launcher->wait(60s).has_value());
  const std::string out = launcher->output();
  EXPECT_EQ(launcher->exit_code(), 75) << out;
  EXPECT_THAT(out, HasSubstr("trial 0 stopped (preemption) after a durable checkpoint"));
  EXPECT_THAT(out, testing::Not(HasSubstr("killed by signal 12")));
  EXPECT_FALSE(std::filesystem::exists(trial() + "/failures.jsonl"));
  expect_no_rank_left();
}

TEST_F(Launcher, CtrlCStopsWithACheckpointAndASecondCtrlCAbortsAtOnce) {
  auto p = start(config(""), "rank1:checkpoint:hang");  // the stop's checkpoint never completes
  wait_for_step(5);
  p->signal(SIGINT);
  std::this_thread::sleep_for(1s);
  EXPECT_FALSE(p->wait(0ms).has_value()) << "rank 1 hangs, so the stop cannot complete";
  p->signal(SIGINT);
  ASSERT_TRUE(p->wait(20s).has_value()) << p->output();
  EXPECT_EQ(p->exit_code(), 130) << p->output();
  EXPECT_THAT(p->output(), HasSubstr("press Ctrl-C again to abort now"));
  EXPECT_THAT(p->output(), HasSubstr("second Ctrl-C: aborting now"));
  expect_no_rank_left();
}

// One launcher per trial: a second `hpctrial run` of a running experiment is refused at once,
// naming the first, which goes on undisturbed. (In a batch job the second waits instead: a job
// that resumes a trial may start while the one before it ends.)
TEST_F(Launcher, ASecondLauncherOfARunningTrialIsRefusedAndTheFirstGoesOn) {
  const std::string exp = config("", 100000, 2, 1);
  auto first = start(exp);
  wait_for_step(20);
  auto second = run(exp, "", {}, 60s);
  EXPECT_EQ(second->exit_code(), 1) << second->output();
  EXPECT_THAT(second->output(), testing::ContainsRegex("trial 0 in " + trial() + " is run by the launcher of pid " +
                                                       std::to_string(first->pid()) + " on \\S+; wait for it to end"));
  const long long before = heartbeat(0);
  std::this_thread::sleep_for(500ms);
  EXPECT_GT(heartbeat(0), before) << "the first run was disturbed";
  first->signal(SIGINT);
  ASSERT_TRUE(first->wait(60s).has_value()) << first->output();
  EXPECT_EQ(first->exit_code(), 75) << first->output();
  expect_no_rank_left();
}

TEST_F(Launcher, TheLauncherKilledTakesItsRanksWithItAndTheNextRunResumes) {
  // Long enough that the first run is still going when it is killed, short enough that the run
  // resuming it ends well within its limit on a loaded machine (about 100 batches/s).
  const std::string exp = config("min_checkpoint_period: {batches: 1000}\n", 6000);
  auto p = start(exp);
  wait_for_step(1500);
  ASSERT_FALSE(p->wait(0ms).has_value()) << "the run ended before it could be killed";
  p->signal(SIGKILL);
  p->wait(5s);
  const auto killed = std::chrono::steady_clock::now();
  while (!processes_running(HPCTRIAL_FAULTY_TRIAL, "HPCTRIAL_EXPERIMENT_DIR=" + experiment()).empty() &&
         std::chrono::steady_clock::now() - killed < 20s) {
    std::this_thread::sleep_for(50ms);
  }
  const double gone = std::chrono::duration<double>(std::chrono::steady_clock::now() - killed).count();
  std::printf("[ measured ] ranks gone %.1f s after the launcher was killed\n", gone);
  EXPECT_LT(gone, 10);
  // Its mpirun's session directory is left: nothing of the attempt remained to remove it.
  expect_no_rank_left(/*session_dirs=*/false);

  auto again = run(exp, "", {}, 300s);
  EXPECT_EQ(again->exit_code(), 0) << again->output();
  EXPECT_THAT(again->output(), testing::ContainsRegex("resumed from .*/ckpt-[0-9]+\\.h5 after [0-9]+ batches"));
  expect_no_rank_left();  // the next launcher removed it: its mpirun was gone
}

// describe (and jobs) name the checkpoint where the trainer wrote it: checkpoint_storage.host_path
// when set, else the trial's own folder.
TEST_F(Launcher, DescribeNamesTheLatestCheckpointWhereverItIs) {
  for (const std::string& storage : std::vector<std::string>{"", "checkpoint_storage: {host_path: " + (dir_.path() / "elsewhere").string() + "}\n"}) {
    std::filesystem::remove_all(experiment());
    auto p = run(config(storage, 30, 2));
    ASSERT_EQ(p->exit_code(), 0) << p->output();
    BackgroundProcess describe({HPCTRIAL_CLI, "describe", experiment()}, env(), (dir_.path() / "describe.txt").string());
    ASSERT_TRUE(describe.wait(30s).has_value());
    const std::string out = describe.output();
    EXPECT_EQ(describe.exit_code(), 0) << out;
    // A shared store keeps each experiment in a folder of its own, recorded in experiment.json.
    std::ifstream record(experiment() + "/experiment.json");
    const std::string folder = nlohmann::json::parse(record).at("host_folder").get<std::string>();
    EXPECT_THAT(folder, testing::MatchesRegex("launched-[0-9a-f]{16}"));
    const std::string expected = storage.empty() ? trial() + "/checkpoints/ckpt-30.h5"
                                                 : (dir_.path() / "elsewhere" / folder / "trial-0" / "ckpt-30.h5").string();
    EXPECT_TRUE(std::filesystem::exists(expected)) << "the trainer wrote it elsewhere";
    EXPECT_THAT(out, HasSubstr("checkpoint:  " + expected + "\n")) << out;
    EXPECT_THAT(out, HasSubstr("batches:     30 of 30")) << out;
    EXPECT_THAT(out, testing::ContainsRegex("run 1: .*, started [0-9T:.-]+Z by mpirun\n")) << out;
    // Where each rank ran: this host, the CPUs the kernel let it use (mpirun binds none here), the CPU.
    const std::string cpus = hpctrial::core::cpu_affinity();
    EXPECT_THAT(out, HasSubstr("    " + hpctrial::core::host_name() + ": rank 0 (cpus " + cpus + ", cpu), rank 1 (cpus " +
                               cpus + ", cpu)\n"))
        << out;
  }
}

// --dry-run prints the command of this config as it would run, exports secrets by name only,
// and writes nothing.
TEST_F(Launcher, DryRunPrintsTheCommandAndWritesNothing) {
  const std::string exp = config("environment: {TOKEN: \"${env:SECRET_TOKEN}\"}\n"
                                 "launcher: {prefix: [nice, -n, \"1\"]}\n");
  auto e = env();
  e.emplace_back("SECRET_TOKEN", "hunter2");
  BackgroundProcess p({HPCTRIAL_CLI, "run", exp, "--experiment", experiment(), "--np", "2", "--dry-run",
                       "--set", "max_restarts=1"},
                      e, (dir_.path() / "dry.txt").string());
  ASSERT_TRUE(p.wait(30s).has_value());
  const std::string out = p.output();
  EXPECT_EQ(p.exit_code(), 0) << out;
  EXPECT_THAT(out, HasSubstr("# in " + dir_.path().string() + " (local)"));
  EXPECT_THAT(out, HasSubstr("HPCTRIAL_TRIAL_DIR=" + trial()));
  EXPECT_THAT(out, testing::ContainsRegex("mpirun -np 2 --map-by slot --bind-to none --mca pml ob1 --tag-output "));
  EXPECT_THAT(out, HasSubstr(" -x TOKEN "));
  EXPECT_THAT(out, HasSubstr(" nice -n 1 " + std::string(HPCTRIAL_FAULTY_TRIAL) + "\n"));
  EXPECT_THAT(out, testing::Not(HasSubstr("hunter2"))) << "a secret reached the command line";
  EXPECT_FALSE(std::filesystem::exists(experiment())) << "a dry run wrote the experiment directory";
}

TEST_F(Launcher, MistakesAreClearErrorsWithinSeconds) {
  // A bad entrypoint.
  const std::string bad = dir_.write("bad.yaml", "name: bad\nentrypoint: ./no-such-trial\n"
                                                 "searcher: {name: single, metric: m, max_length: {batches: 5}}\n"
                                                 "hyperparameters: {global_batch_size: 4}\n");
  auto p = run(bad, "", {}, 30s);
  EXPECT_EQ(p->exit_code(), 2);
  EXPECT_THAT(p->output(), HasSubstr("entrypoint: " + (dir_.path() / "no-such-trial").string() +
                                     " does not exist; build it, or fix entrypoint in the config"));
  EXPECT_LT(p->seconds(), 10);
  EXPECT_FALSE(std::filesystem::exists(trial() + "/checkpoints"));

  // Too many ranks for this machine, without --oversubscribe.
  auto many = std::make_unique<BackgroundProcess>(
      std::vector<std::string>{HPCTRIAL_CLI, "run", config(""), "--experiment", experiment(), "--np", "64"}, env(),
      (dir_.path() / "many.txt").string());
  ASSERT_TRUE(many->wait(30s).has_value());
  EXPECT_EQ(many->exit_code(), 2);
  EXPECT_THAT(many->output(), testing::ContainsRegex("64 ranks were asked for but this machine has [0-9]+ cores; pass "
                                                     "--oversubscribe"));
  EXPECT_FALSE(std::filesystem::exists(trial() + "/checkpoints"));

  // A config that cannot be read.
  auto missing = run((dir_.path() / "nope.yaml").string(), "", {}, 30s);
  EXPECT_EQ(missing->exit_code(), 2);
  EXPECT_THAT(missing->output(), HasSubstr("nope.yaml"));
  EXPECT_THAT(missing->output(), HasSubstr("cannot read"));
}

}  // namespace launcher_test
}  // namespace hpctrial
