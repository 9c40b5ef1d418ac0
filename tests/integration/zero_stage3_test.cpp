// ZeRO stage 3 with the real `hpctrial run` and mpirun, on the engine fault trial (a regression
// trained by a ModelEngine with Adam): its parameters partitioned over 2 and 4 ranks train within
// 1e-6 of stage 0 on one rank over 200 steps; stopped by SIGUSR2 on the chief or on the last rank
// it resumes bitwise; a checkpoint of 4 ranks at stage 3 resumes on 2 ranks at stage 1 and on one
// rank at stage 0, within 1e-5 of the uninterrupted run after 100 more steps.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>

#include "../support/exported_model.h"
#include "../support/same_weights.h"
#include "hpctrial/checkpoint/format.h"
#include "hpctrial/core/subprocess.h"
#include "launcher_fixture.h"

namespace hpctrial {
namespace zero_stage3_test {  // named: the target compiles its sources together (UNITY_BUILD)

using testing::HasSubstr;
using testing_launcher::Launcher;

class ZeroStageThree : public Launcher {
 protected:
  // Global batches of 16 records in micro-batches of 4: 4 micro-batches a step on one rank, 2
  // on 2, 1 on 4. Each rank's share is a contiguous slice of the global batch, so every run
  // computes the same micro-batches.
  // `zero`: more keys of zero_optimization.
  std::string engine_config(const std::string& name, int ranks, int stage, std::int64_t batches,
                            const std::string& zero = "") {
    return dir_.write(name + ".yaml",
        "name: launched\nentrypoint: " + std::string(HPCTRIAL_ENGINE_FAULT_TRIAL) + "\n"
        "searcher: {name: single, metric: validation_loss, max_length: {batches: " + std::to_string(batches) + "}}\n"
        "hyperparameters: {global_batch_size: 16, own_files: false}\n"
        "engine: {train_micro_batch_size_per_gpu: 4, zero_optimization: {stage: " + std::to_string(stage) +
        ", reduce_bucket_size: 50, stage3_param_persistence_threshold: 0" + zero + "}}\n"
        "resources: {slots_per_trial: " + std::to_string(ranks) + "}\nreproducibility: {experiment_seed: 7}\n");
  }
  // Runs `config` to its end in the experiment `name` (under the test's directory); its last checkpoint.
  std::string run_to_end(const std::string& config, const std::string& name, std::int64_t batches,
                         const std::vector<std::string>& extra = {}) {
    std::vector<std::string> args = {"--experiment", (dir_.path() / name).string()};
    args.insert(args.end(), extra.begin(), extra.end());
    auto p = run(config, "", args);
    EXPECT_EQ(p->exit_code(), 0) << p->output();
    return (dir_.path() / name / "trial-0/checkpoints" / ("ckpt-" + std::to_string(batches) + ".h5")).string();
  }
};

// The largest difference between the model's tensors in two checkpoints, relative to the
// largest magnitude of each tensor.
double max_model_difference(const std::string& a_path, const std::string& b_path) {
  const auto a = checkpoint::read_checkpoint(a_path);
  const auto b = checkpoint::read_checkpoint(b_path);
  double most = 0;
  int compared = 0;
  for (const auto& d : a.datasets) {
    if (d.name.rfind("model/", 0) != 0 || d.dtype != checkpoint::DType::kFloat32) continue;
    const auto* other = b.find(d.name);
    EXPECT_NE(other, nullptr) << d.name << " is missing from " << b_path;
    if (other == nullptr || other->nbytes() != d.nbytes()) return INFINITY;
    const auto* x = static_cast<const float*>(d.data->data());
    const auto* y = static_cast<const float*>(other->data->data());
    double scale = 0, diff = 0;
    for (std::size_t i = 0; i < d.nbytes() / 4; ++i) {
      scale = std::max(scale, static_cast<double>(std::fabs(y[i])));
      diff = std::max(diff, static_cast<double>(std::fabs(x[i] - y[i])));
    }
    most = std::max(most, scale > 0 ? diff / scale : diff);
    ++compared;
  }
  EXPECT_GE(compared, 4) << "the model's tensors in " << a_path;
  return most;
}

std::string format_difference(double difference) {
  char text[32];
  std::snprintf(text, sizeof text, "%.3g", difference);
  return text;
}

TEST_F(ZeroStageThree, TwoAndFourRanksTrainWithinAMillionthOfStageZeroOnOneRank) {
  const std::string one = run_to_end(engine_config("one", 1, 0, 200), "one", 200);
  for (const int ranks : {2, 4}) {
    const std::string name = "stage3-" + std::to_string(ranks);
    const std::string partitioned = run_to_end(engine_config(name, ranks, 3, 200), name, 200);
    const double difference = max_model_difference(partitioned, one);
    RecordProperty("difference_" + std::to_string(ranks) + "_ranks", format_difference(difference));
    EXPECT_LE(difference, 1e-6) << ranks << " ranks";
  }
}

class ZeroStageThreeStopped : public ZeroStageThree, public testing::WithParamInterface<int> {};

// SIGUSR2 raised in the chief or in the last rank at step 35: every rank checkpoints the same
// batch and the run exits 75; run again, it ends with an uninterrupted run's weights and
// optimizer state, bit for bit.
TEST_P(ZeroStageThreeStopped, BySigusr2OnAnyRankResumesBitwise) {
  const int rank = GetParam();
  const std::string config = engine_config("exp", 2, 3, 120);
  auto first = run(config, "rank" + std::to_string(rank) + ":step35:restart0:usr2");
  EXPECT_EQ(first->exit_code(), 75) << first->output();
  EXPECT_THAT(first->output(), HasSubstr("injected fault rank" + std::to_string(rank) + ":step35:restart0:usr2"));
  EXPECT_THAT(first->output(), HasSubstr("stopped after 36 batches; checkpoint " + trial() +
                                         "/checkpoints/ckpt-36.h5 is durable"));
  auto second = run(config);
  ASSERT_EQ(second->exit_code(), 0) << second->output();
  EXPECT_THAT(second->output(), HasSubstr("resumed from " + trial() + "/checkpoints/ckpt-36.h5"));
  const std::string straight = run_to_end(config, "straight", 120);
  testing_support::expect_same_weights(straight, trial() + "/checkpoints/ckpt-120.h5");
  expect_no_rank_left();
}

INSTANTIATE_TEST_SUITE_P(ChiefAndLastRank, ZeroStageThreeStopped, testing::Values(0, 1),
                         [](const testing::TestParamInfo<int>& info) { return "rank" + std::to_string(info.param); });

// A stage-3 checkpoint of 4 ranks after 100 batches, resumed to batch 200 on 2 ranks at stage 1
// and on one rank at stage 0: each within 1e-5 of the 4 ranks' uninterrupted run.
TEST_F(ZeroStageThree, AFourRankCheckpointResumesOnTwoRanksAtStageOneAndOnOneAtStageZero) {
  const std::string straight = run_to_end(engine_config("straight", 4, 3, 200), "straight", 200);
  for (const auto& [ranks, stage] : {std::pair{2, 1}, std::pair{1, 0}}) {
    const std::string name = "resumed-" + std::to_string(ranks);
    run_to_end(engine_config(name + "-first", 4, 3, 100), name, 100);
    const std::string resumed = run_to_end(engine_config(name, ranks, stage, 200), name, 200);
    const double difference = max_model_difference(resumed, straight);
    RecordProperty("difference_" + std::to_string(ranks) + "_ranks_stage_" + std::to_string(stage),
                   format_difference(difference));
    EXPECT_LE(difference, 1e-5) << ranks << " rank(s) at stage " << stage;
  }
}

// offload_optimizer with device nvme: each rank's optimizer state in a swap file under nvme_path
// between steps, stepped 40 elements of parameters at a time.
class ZeroOffload : public ZeroStageThree {
 protected:
  // With `param`, offload_param on nvme too (stage 3): the parameters' parts in the same files.
  std::string nvme_keys(bool param = false) {
    std::filesystem::create_directories(dir_.path() / "nvme");
    const std::string path = (dir_.path() / "nvme").string();
    return ", sub_group_size: 40, offload_optimizer: {device: nvme, nvme_path: " + path + "}" +
           (param ? ", offload_param: {device: nvme, nvme_path: " + path + "}" : "");
  }
  // The swap directories left under nvme_path.
  int left_in_nvme() {
    int n = 0;
    for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir_.path() / "nvme")) ++n;
    return n;
  }
};

// At stages 2 and 3 on 2 ranks, the run with its optimizer state swapped to files (and at stage 3
// with the parameters' parts too) ends with the weights and optimizer state of the run that kept
// them in memory, bit for bit; the ranks leave no swap file behind.
TEST_F(ZeroOffload, AnNvmeOffloadedRunEqualsTheInMemoryOneBitwise) {
  for (const int stage : {2, 3}) {
    const std::string name = "stage" + std::to_string(stage);
    const std::string memory = run_to_end(engine_config(name + "-memory", 2, stage, 60), name + "-memory", 60);
    const std::string offloaded =
        run_to_end(engine_config(name + "-nvme", 2, stage, 60, nvme_keys()), name + "-nvme", 60);
    testing_support::expect_same_weights(memory, offloaded);
    EXPECT_EQ(left_in_nvme(), 0) << "stage " << stage;
    if (stage != 3) continue;
    const std::string params =
        run_to_end(engine_config(name + "-param", 2, stage, 60, nvme_keys(true)), name + "-param", 60);
    testing_support::expect_same_weights(memory, params);
    EXPECT_EQ(left_in_nvme(), 0) << "offload_param";
  }
}

// hpctrial checkpoint export reads a stage-3 checkpoint of 2 ranks with both offloads as any
// other: its archive holds the model of the run kept in memory, bit for bit, as torch.jit.load
// and the Python reader read it.
TEST_F(ZeroOffload, ACheckpointWithBothOffloadsExportsAsTheInMemoryRunsModel) {
  const std::string memory = run_to_end(engine_config("export-memory", 2, 3, 30), "export-memory", 30);
  const std::string offloaded =
      run_to_end(engine_config("export-nvme", 2, 3, 30, nvme_keys(true)), "export-nvme", 30);
  std::map<std::string, std::uint32_t> crcs;  // the in-memory run's model, by parameter name
  for (const auto& d : checkpoint::read_checkpoint(memory).datasets) {
    if (d.name.rfind("model/0/", 0) == 0) crcs[d.name.substr(8)] = checkpoint::crc32c(d.data->data(), d.nbytes());
  }
  ASSERT_GE(crcs.size(), 4u) << memory;
  const std::string archive = (dir_.path() / "model.pt").string();
  const auto exported = core::run_process({HPCTRIAL_CLI, "checkpoint", "export", offloaded, archive});
  ASSERT_TRUE(exported.ok()) << exported.describe() << "\n" << exported.err;
  EXPECT_THAT(exported.out, HasSubstr("wrote " + archive + ": " + std::to_string(crcs.size()) + " tensors"));
  EXPECT_EQ(testing_support::exported_model_crcs(offloaded, archive, (dir_.path() / "state_dict.pt").string()), crcs);
}

// On one rank there is nothing to shard, but offload_optimizer still swaps the state (ZeRO-Offload
// on a single device): the run equals the one at stage 0 in memory, bit for bit.
TEST_F(ZeroOffload, OnOneRankTheSwappedRunEqualsStageZero) {
  const std::string memory = run_to_end(engine_config("one-memory", 1, 0, 40), "one-memory", 40);
  const std::string offloaded = run_to_end(engine_config("one-nvme", 1, 2, 40, nvme_keys()), "one-nvme", 40);
  testing_support::expect_same_weights(memory, offloaded);
  EXPECT_EQ(left_in_nvme(), 0);
}

class ZeroOffloadStopped : public ZeroOffload, public testing::WithParamInterface<int> {};

// SIGUSR2 raised in the chief or in the last rank: the run with its optimizer state and its
// parameters' parts offloaded checkpoints (their bytes mapped from the files) and resumes to an
// uninterrupted offloaded run's weights and state, bit for bit; that run's checkpoint resumes on
// one rank at stage 0 without offload.
TEST_P(ZeroOffloadStopped, BySigusr2OnAnyRankResumesBitwise) {
  const int rank = GetParam();
  const std::string config = engine_config("exp", 2, 3, 80, nvme_keys(true));
  auto first = run(config, "rank" + std::to_string(rank) + ":step25:restart0:usr2");
  EXPECT_EQ(first->exit_code(), 75) << first->output();
  EXPECT_THAT(first->output(), HasSubstr("stopped after 26 batches; checkpoint " + trial() +
                                         "/checkpoints/ckpt-26.h5 is durable"));
  auto second = run(config);
  ASSERT_EQ(second->exit_code(), 0) << second->output();
  EXPECT_THAT(second->output(), HasSubstr("resumed from " + trial() + "/checkpoints/ckpt-26.h5"));
  const std::string straight = run_to_end(engine_config("straight", 2, 3, 80, nvme_keys(true)), "straight", 80);
  testing_support::expect_same_weights(straight, trial() + "/checkpoints/ckpt-80.h5");
  EXPECT_EQ(left_in_nvme(), 0);
  expect_no_rank_left();
  auto p = run(engine_config("single", 1, 0, 100), "", {"--experiment", (dir_.path() / "straight").string()});
  ASSERT_EQ(p->exit_code(), 0) << p->output();
  EXPECT_THAT(p->output(), HasSubstr("resumed from " + (dir_.path() / "straight/trial-0/checkpoints/ckpt-80.h5").string()));
}

INSTANTIATE_TEST_SUITE_P(ChiefAndLastRank, ZeroOffloadStopped, testing::Values(0, 1),
                         [](const testing::TestParamInfo<int>& info) { return "rank" + std::to_string(info.param); });

// A memory limit: each rank may allocate 200 MiB past its start-up (RLIMIT_DATA, which the
// benchmark zero_memory sets in --probe mode). A model of 640 layers of 256 x 256 (168 MB of
// parameters) at stage 3 on 2 ranks, with Adam, for 3 steps and a checkpoint: a rank's parts of
// the parameters and of the optimizer state are 253 MB (241 MiB), and stage 3 in memory trains
// at most 286 layers under a limit of 256 MiB (benchmarks/zero_memory). Each run is
// zero_memory's probe, in an mpirun of its own.
class ZeroMemoryLimit : public ZeroOffload {
 protected:
  core::RunResult probe(bool nvme, int budget_mb, std::vector<std::string> more = {}) {
    std::vector<std::string> argv = {HPCTRIAL_MPIRUN, "-np", "2", "--oversubscribe", "--bind-to", "none",
                                     HPCTRIAL_ZERO_MEMORY, "--probe", "--stage", "3", "--layers", "640",
                                     "--hidden", "256", "--budget-mb", std::to_string(budget_mb), "--dir",
                                     (dir_.path() / (nvme ? "nvme-run" : "memory-run")).string()};
    if (nvme) {
      argv.push_back("--nvme");
      argv.push_back("--param");
    }
    argv.insert(argv.end(), more.begin(), more.end());
    core::RunOptions options;
    options.timeout = std::chrono::minutes(4);
    options.env_set = env();
    return core::run_process(argv, options);
  }
};

// In memory the run fails under the limit, and trains with a limit of 1 GiB: the limit is what
// failed it.
TEST_F(ZeroMemoryLimit, AModelWhoseStateExceedsItFailsInMemory) {
  const auto memory = probe(false, 200);
  EXPECT_FALSE(memory.ok()) << "the state in memory fit the limit: " << memory.out << memory.err;
  const auto unlimited = probe(false, 1024);
  EXPECT_TRUE(unlimited.ok()) << unlimited.describe() << "\n" << unlimited.out << unlimited.err;
}

// With both in the swap files (offload_optimizer and offload_param on nvme) the same run trains
// within the limit, and resumes under it in a new job: each rank reads from the checkpoint only
// the ranges its parts cover, a parameter at a time, into the swap file.
TEST_F(ZeroMemoryLimit, AModelWhoseStateExceedsItTrainsAndResumesWithItOnNvme) {
  const auto swapped = probe(true, 200);
  ASSERT_TRUE(swapped.ok()) << swapped.describe() << "\n" << swapped.out << swapped.err;
  EXPECT_THAT(swapped.out, HasSubstr("trained 3 batches in this run"));
  const auto resumed = probe(true, 200, {"--keep", "--batches", "5"});
  EXPECT_TRUE(resumed.ok()) << resumed.describe() << "\n" << resumed.out << resumed.err;
  EXPECT_THAT(resumed.out, HasSubstr("trained 2 batches in this run"));
}

}  // namespace zero_stage3_test
}  // namespace hpctrial
