// checkpoint_levels.memory with real mpirun: a rank SIGKILLed (the chief, and the last rank)
// restarts inside the same `hpctrial run` from the copies every rank holds in node memory, newer
// than any checkpoint on the shared filesystem, and ends with the weights of an uninterrupted run;
// a copy cut short by the kill is never used; a period in seconds and the default, auto, copy at
// the same batch on every rank; state spread over the ranks (ZeRO's shards, a model split over
// ranks, each rank's own files) resumes from each rank's own copy; copies an earlier run of the
// trial left are removed at the next start and never read, as are another experiment's that no
// rank holds.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <thread>

#include "../support/same_weights.h"
#include "hpctrial/core/subprocess.h"
#include "launcher_fixture.h"

namespace hpctrial {
namespace memory_level_test {  // named: the target compiles its sources together (UNITY_BUILD)

using namespace std::chrono_literals;
using testing::HasSubstr;
using testing::Not;
using testing_launcher::Launcher;
namespace fs = std::filesystem;

constexpr std::int64_t kBatches = 120;

class MemoryLevel : public Launcher {
 protected:
  // Node memory of the test's own: a folder of the tmpfs /dev/shm (the level's folders are made
  // in it as in /dev/shm itself), removed afterwards.
  void SetUp() override {
    std::string pattern = "/dev/shm/hpctrial-memory-test-XXXXXX";
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    shm_ = pattern;
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(shm_, ec);
  }
  std::string shm() const { return shm_; }
  std::string user_dir() const { return shm() + "/hpctrial-" + std::to_string(::getuid()); }
  // Copies every 10 batches; on the shared filesystem only the last checkpoint. A batch takes
  // 5 ms (the rank sleeps, as if waiting for its device): a copy of this small trial, written to
  // the tmpfs by its thread, is out long before the next one.
  std::string memory_config(const std::string& extra = "max_restarts: 1\n") {
    return config(extra + "min_checkpoint_period: {batches: 100000}\n"
                          "checkpoint_levels: {memory: {period: {batches: 10}, dir: " + shm() + "}}\n",
                  kBatches, 2, 5);
  }
  // A run with the memory level's `memory` section, 25 ms batches, the rank killed at step 100:
  // it resumes from a copy in node memory, with the weights of an uninterrupted run.
  void expect_resumes_from_a_timed_copy(int rank, const std::string& memory, const std::string& said);
  // The uninterrupted run's last checkpoint.
  std::string straight() {
    auto p = run(config("", kBatches), "", {"--experiment", (dir_.path() / "straight").string()});
    EXPECT_EQ(p->exit_code(), 0) << p->output();
    return (dir_.path() / "straight/trial-0/checkpoints").string() + "/ckpt-" + std::to_string(kBatches) + ".h5";
  }
  std::string last_checkpoint() const { return trial() + "/checkpoints/ckpt-" + std::to_string(kBatches) + ".h5"; }
  // The sessions (runs of trials) left in node memory.
  std::string shm_;
  std::vector<fs::path> sessions() const {
    std::vector<fs::path> out;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(user_dir(), ec)) {
      if (!e.is_directory()) continue;
      for (const auto& t : fs::directory_iterator(e.path(), ec)) {
        for (const auto& s : fs::directory_iterator(t.path(), ec)) out.push_back(s.path());
      }
    }
    return out;
  }
};

class EachRankKilled : public MemoryLevel, public testing::WithParamInterface<int> {};

TEST_P(EachRankKilled, ResumesFromNodeMemoryWithTheWeightsOfAnUninterruptedRun) {
  const int rank = GetParam();
  const std::string exp = memory_config();
  auto p = run(exp, "rank" + std::to_string(rank) + ":step35:restart0:sigkill");
  const std::string out = p->output();
  ASSERT_EQ(p->exit_code(), 0) << out;
  EXPECT_THAT(out, HasSubstr("checkpoint_levels.memory: every rank holds its copy of batch 30 in node memory, newer "
                             "than any checkpoint on the shared filesystem"));
  EXPECT_THAT(out, testing::ContainsRegex("resumed from " + user_dir() + "/[^/]+/trial-0/[^/]+/rank-0/slot-[01] "
                                          "after 30 batches"));
  const auto records = failures();
  ASSERT_EQ(records.size(), 1u) << out;
  EXPECT_EQ(records[0]["rank"], rank);
  EXPECT_EQ(records[0]["signal"], 9);
  // The run records the level it resumed from, and describe says it.
  std::ifstream runs(trial() + "/runs.jsonl");
  std::vector<nlohmann::json> lines;
  for (std::string line; std::getline(runs, line);) lines.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_FALSE(lines[0].contains("resumed_from"));
  EXPECT_EQ(lines[1]["resumed_from"]["level"], "memory");
  const auto described = hpctrial::core::run_process({HPCTRIAL_CLI, "describe", experiment()});
  EXPECT_THAT(described.out, HasSubstr("from batch 30 (its copies in node memory)")) << described.out << described.err;
  testing_support::expect_same_weights(straight(), last_checkpoint());
  EXPECT_TRUE(sessions().empty()) << "the trial ended: its copies go with it";
  struct stat st {};
  ASSERT_EQ(::stat(user_dir().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  expect_no_rank_left();
}

// A rank killed as its copy of batch 20 was about to be published: that copy is never used, and
// every rank resumes from batch 10, the newest all of them hold.
TEST_P(EachRankKilled, ACopyCutShortIsNeverUsed) {
  const int rank = GetParam();
  auto p = run(memory_config(), "rank" + std::to_string(rank) + ":step20:restart0:writer:sigkill");
  const std::string out = p->output();
  ASSERT_EQ(p->exit_code(), 0) << out;
  EXPECT_THAT(out, HasSubstr("every rank holds its copy of batch 10 in node memory"));
  EXPECT_THAT(out, HasSubstr("after 10 batches"));
  testing_support::expect_same_weights(straight(), last_checkpoint());
  expect_no_rank_left();
}

void MemoryLevel::expect_resumes_from_a_timed_copy(int rank, const std::string& memory, const std::string& said) {
  const std::string exp = config("max_restarts: 1\nmin_checkpoint_period: {batches: 100000}\n"
                                 "checkpoint_levels: {memory: " + memory + "}\n", kBatches, 2, 25);
  auto p = run(exp, "rank" + std::to_string(rank) + ":step100:restart0:sigkill");
  const std::string out = p->output();
  ASSERT_EQ(p->exit_code(), 0) << out;
  EXPECT_THAT(out, HasSubstr(said));
  std::smatch m;
  ASSERT_TRUE(std::regex_search(out, m, std::regex(R"(every rank holds its copy of batch (\d+) in node memory)"))) << out;
  const std::int64_t batch = std::stoll(m[1]);
  EXPECT_GT(batch, 0);
  EXPECT_LT(batch, 100);
  EXPECT_THAT(out, HasSubstr("after " + std::to_string(batch) + " batches"));
  testing_support::expect_same_weights(straight(), last_checkpoint());
  expect_no_rank_left();
}

// A period in seconds: the chief's clock says when, and every rank copies at the same batch.
TEST_P(EachRankKilled, CopiesEveryFewSecondsAreAtTheSameBatchOnEveryRank) {
  expect_resumes_from_a_timed_copy(GetParam(), "{period: {seconds: 1}, dir: " + shm() + "}",
                                   "each rank copies its state every 1 seconds");
}

// No period: auto. The first copy a second in, the next as the measured cost allows (this small
// trial's copies cost little: one a second).
TEST_P(EachRankKilled, CopiesAsOftenAsTheirCostAllowsByDefault) {
  expect_resumes_from_a_timed_copy(GetParam(), "{dir: " + shm() + "}",
                                   "as often as the copies cost at most 1% of the time (every 1 to 60 s)");
}

// Checkpoints on the shared filesystem every 20 batches, copies every 10: each checkpoint is
// written from the chief's copy of its batch. A rank that loses its node memory (`nodeloss`)
// leaves no copy every rank holds, and the trial resumes from the checkpoint of batch 20 that a
// copy gave, to the weights of an uninterrupted run.
TEST_P(EachRankKilled, CheckpointsAreWrittenFromTheCopiesAndResumeAsAnyOther) {
  const int rank = GetParam();
  const std::string exp = config("max_restarts: 1\nmin_checkpoint_period: {batches: 20}\n"
                                 "checkpoint_levels: {memory: {period: {batches: 10}, dir: " + shm() + "}}\n",
                                 kBatches, 2, 5);
  auto p = run(exp, "rank" + std::to_string(rank) + ":step35:restart0:nodeloss");
  const std::string out = p->output();
  ASSERT_EQ(p->exit_code(), 0) << out;
  EXPECT_THAT(out, HasSubstr("the checkpoints on the shared filesystem are written from the chief's copies"));
  EXPECT_THAT(out, Not(HasSubstr("in node memory, newer than")));
  EXPECT_THAT(out, testing::ContainsRegex("resumed from \\S+/ckpt-20.h5 after 20 batches"));
  testing_support::expect_same_weights(straight(), last_checkpoint());
  expect_no_rank_left();
}

INSTANTIATE_TEST_SUITE_P(ChiefAndLastRank, EachRankKilled, testing::Values(0, 1),
                         [](const testing::TestParamInfo<int>& info) { return "rank" + std::to_string(info.param); });

// State spread over the ranks: ZeRO-2's shards of the optimizer's state and each rank's own files
// (an engine trial's save), ZeRO-3's parts of the parameters too (the biases whole on every rank,
// as persistent parameters, the first weight partitioned), or a model split over ranks (a
// pipeline of two stages, with its files). Each rank's copy holds its own (at stage 3 its parts
// of the parameters, which the restore loads as they are: a copy of whole values would be
// refused); the restart resumes every rank from it, each rank takes back its own file of that
// batch, and the run ends with the weights of an uninterrupted one.
class SpreadStateKilled : public MemoryLevel, public testing::WithParamInterface<std::tuple<std::string, int>> {
 protected:
  std::string engine_config(const std::string& kind, const std::string& extra) {
    const bool pipeline = kind == "pipeline";
    return dir_.write(kind + ".yaml",
        "name: launched\nentrypoint: " + std::string(HPCTRIAL_ENGINE_FAULT_TRIAL) + "\n"
        "searcher: {name: single, metric: validation_loss, max_length: {batches: " + std::to_string(kBatches) + "}}\n"
        "hyperparameters: {global_batch_size: 16, batch_ms: 5" + (pipeline ? ", pipeline: true" : "") + "}\n"
        "engine: " + (pipeline         ? "{gradient_accumulation_steps: 2, pipeline: {stages: 2}}"
                      : kind == "zero" ? "{zero_optimization: {stage: 2, reduce_bucket_size: 50}}"
                                       : "{zero_optimization: {stage: 3, reduce_bucket_size: 50, "
                                         "stage3_param_persistence_threshold: 16}}") + "\n"
        "resources: {slots_per_trial: 2}\nreproducibility: {experiment_seed: 7}\n" + extra);
  }
};

TEST_P(SpreadStateKilled, EachRankResumesItsOwnFromNodeMemory) {
  const auto& [kind, rank] = GetParam();
  auto p = run(engine_config(kind, "max_restarts: 1\nmin_checkpoint_period: {batches: 100000}\n"
                                   "checkpoint_levels: {memory: {period: {batches: 10}, dir: " + shm() + "}}\n"),
               "rank" + std::to_string(rank) + ":step35:restart0:sigkill");
  const std::string out = p->output();
  ASSERT_EQ(p->exit_code(), 0) << out;
  EXPECT_THAT(out, HasSubstr("checkpoint_levels.memory: every rank holds its copy of batch 30 in node memory"));
  EXPECT_THAT(out, HasSubstr("after 30 batches"));
  EXPECT_THAT(out, HasSubstr("rank 0 took back its file of batch 30"));
  EXPECT_THAT(out, HasSubstr("rank 1 took back its file of batch 30"));
  auto straight = run(engine_config(kind, ""), "", {"--experiment", (dir_.path() / "straight").string()});
  ASSERT_EQ(straight->exit_code(), 0) << straight->output();
  testing_support::expect_same_weights(
      (dir_.path() / "straight/trial-0/checkpoints").string() + "/ckpt-" + std::to_string(kBatches) + ".h5",
      last_checkpoint());
  EXPECT_TRUE(sessions().empty()) << "the trial ended: its copies go with it";
  expect_no_rank_left();
}

INSTANTIATE_TEST_SUITE_P(ChiefAndLastRank, SpreadStateKilled,
                         testing::Combine(testing::Values("zero", "zero3", "pipeline"), testing::Values(0, 1)),
                         [](const testing::TestParamInfo<std::tuple<std::string, int>>& info) {
                           return std::get<0>(info.param) + "_rank" + std::to_string(std::get<1>(info.param));
                         });

// A run that gives up (no restart left) removes its copies on the launcher's node. A job killed
// outright (the launcher, mpirun and the ranks at once) leaves its copies; the next run of the
// trial is another session: it removes them without reading them and resumes from the shared
// filesystem. A session of another experiment that no rank holds and that has not been used for
// an hour goes too; one used a moment ago stays.
TEST_F(MemoryLevel, LeftoverCopiesAreRemovedAndNeverRead) {
  const std::string exp = memory_config("max_restarts: 0\n");
  auto given_up = run(exp, "rank1:step35:restart0:sigkill");
  ASSERT_EQ(given_up->exit_code(), 128 + 9) << given_up->output();
  EXPECT_THAT(given_up->output(), HasSubstr("removed the trial's copies in node memory on this node"));
  EXPECT_TRUE(sessions().empty());

  auto first = start(exp, "rank1:step35:hang");
  const auto hung = std::chrono::steady_clock::now() + 60s;
  while (first->output().find("injected fault rank1:step35:hang") == std::string::npos &&
         std::chrono::steady_clock::now() < hung) {
    std::this_thread::sleep_for(20ms);
  }
  ASSERT_THAT(first->output(), HasSubstr("injected fault rank1:step35:hang"));
  const std::string mine = "HPCTRIAL_EXPERIMENT_DIR=" + experiment();
  first->signal(SIGKILL);
  for (const pid_t pid : testing_support::processes_running("", mine)) ::kill(pid, SIGKILL);
  first->wait(10s);
  const auto until = std::chrono::steady_clock::now() + 10s;
  while (!testing_support::processes_running(HPCTRIAL_FAULTY_TRIAL, mine).empty() &&
         std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(20ms);
  }
  const auto left = sessions();
  ASSERT_EQ(left.size(), 1u);
  EXPECT_TRUE(fs::exists(left[0] / "rank-0/slot-0"));
  EXPECT_TRUE(fs::exists(left[0] / "rank-1/slot-1"));

  const fs::path old = fs::path(user_dir()) / "another-experiment/trial-0/ended-run/rank-0";
  const fs::path fresh = fs::path(user_dir()) / "busy-experiment/trial-0/running/rank-0";
  for (const fs::path& dir : {old, fresh}) {
    fs::create_directories(dir);
    std::ofstream(dir / "ckpt-50.h5") << "not a checkpoint";
    std::ofstream(dir.parent_path() / ".lock");
  }
  const auto hour_ago = fs::file_time_type::clock::now() - std::chrono::hours(1);
  for (const fs::path& f : {old / "ckpt-50.h5", old.parent_path() / ".lock", old}) fs::last_write_time(f, hour_ago);

  auto second = run(exp);
  const std::string out = second->output();
  ASSERT_EQ(second->exit_code(), 0) << out;
  EXPECT_THAT(out, Not(HasSubstr("in node memory, newer than")));
  EXPECT_THAT(out, Not(HasSubstr("not usable")));
  EXPECT_FALSE(fs::exists(left[0])) << "the killed run's copies";
  EXPECT_FALSE(fs::exists(fs::path(user_dir()) / "another-experiment")) << "no rank held it, unused for an hour";
  EXPECT_TRUE(fs::exists(fresh / "ckpt-50.h5")) << "used a moment ago: maybe between two attempts of its run";
  expect_no_rank_left(/*session_dirs=*/false);  // the killed mpirun's is left: its launcher was killed too
}

// checkpoint_levels.partner where every rank runs on one node: off, and the log says so; no rank
// keeps another's copies. A rank that loses its node memory (`nodeloss`: its folder removed, then
// SIGKILL) leaves no batch that every rank holds, and the trial starts again from the shared
// filesystem's state (here none: from the start), to the weights of an uninterrupted run.
TEST_F(MemoryLevel, ThePartnerLevelIsOffOnOneNodeAndSaysSo) {
  const std::string exp = config("max_restarts: 1\nmin_checkpoint_period: {batches: 100000}\n"
                                 "checkpoint_levels: {memory: {period: {batches: 10}, dir: " + shm() + "}, partner: true}\n",
                                 kBatches, 2, 5);
  auto p = run(exp, "rank1:step35:restart0:nodeloss");
  const std::string out = p->output();
  ASSERT_EQ(p->exit_code(), 0) << out;
  EXPECT_THAT(out, HasSubstr("checkpoint_levels.partner: every rank runs on one node, so no copy goes to a partner"));
  EXPECT_THAT(out, HasSubstr("injected fault rank1:step35:restart0:nodeloss"));
  EXPECT_THAT(out, Not(HasSubstr("in node memory, newer than")));
  EXPECT_THAT(out, Not(HasSubstr("came from their partners")));
  const auto records = failures();
  ASSERT_EQ(records.size(), 1u) << out;
  EXPECT_EQ(records[0]["rank"], 1);
  testing_support::expect_same_weights(straight(), last_checkpoint());
  expect_no_rank_left();
}

}  // namespace memory_level_test
}  // namespace hpctrial
