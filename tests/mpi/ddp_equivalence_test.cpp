// Data-parallel training is the same training: the mlp example with the same global batch on
// 2 and 4 ranks (this binary runs under both) ends with the weights of one rank training alone,
// and aggregation_frequency 2 at half the batch equals the full batch. Every rank also trains
// the one-rank reference itself, so the comparison needs no files.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>

#include "hpctrial/comm/communicator.h"
#include "hpctrial/comm/watchdog.h"
#include "../support/capturing_mlp.h"
#include "mlp_trial.h"
#include "mpi_test_env.h"
#include "synthetic_data.h"

namespace hpctrial {
namespace ddp_equivalence_test {  // named: the target compiles its sources together (UNITY_BUILD)

using testing_mpi::env;

constexpr std::int64_t kSteps = 60;

using testing_support::CapturingMlp;

// The largest difference between two sets of weights, relative to the largest weight of each
// tensor.
double max_relative_difference(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    const double scale = b[i].abs().max().item<double>();
    worst = std::max(worst, (a[i] - b[i]).abs().max().item<double>() / scale);
  }
  return worst;
}

class DdpEquivalence : public testing::Test {
 protected:
  static void SetUpTestSuite() {
    comm::MpiCommunicator communicator(env().world());
    std::string dir;
    if (communicator.is_chief()) {
      char pattern[] = "/tmp/hpctrial-ddp-XXXXXX";
      dir = ::mkdtemp(pattern);
      mlp_example::SyntheticSpec spec;
      mlp_example::write_synthetic_dataset(dir + "/train.h5", spec);
      spec.samples = 512;
      spec.seed = 2;
      mlp_example::write_synthetic_dataset(dir + "/validation.h5", spec);
    }
    communicator.broadcast(dir, 0);
    dir_ = dir;
  }
  static void TearDownTestSuite() {
    MPI_Barrier(env().world());
    if (env().is_chief()) std::filesystem::remove_all(dir_);
  }

  std::vector<torch::Tensor> train(comm::Communicator& communicator, std::vector<std::string> overrides,
                                   const std::string& name, const std::string& checkpoint_dir = "") {
    overrides.push_back("data.train=" + dir_ + "/train.h5");
    overrides.push_back("data.validation=" + dir_ + "/validation.h5");
    overrides.push_back("resources.slots_per_trial=" + std::to_string(communicator.size()));
    const core::ExperimentConfig config =
        core::load_experiment_config({HPCTRIAL_SOURCE_DIR "/examples/mlp/experiment.yaml", "", overrides});
    trainer::LoopOptions options;
    options.trial_dir = dir_ + "/" + name + "-rank" + std::to_string(env().rank());
    options.experiment_seed = *config.reproducibility.experiment_seed;
    options.progress_interval_s = 0;
    options.distributed = {communicator.rank(), communicator.size(), communicator.rank(), communicator.size(), 1};
    options.checkpoint_dir = checkpoint_dir;
    std::vector<torch::Tensor> weights;
    trainer::run_training(config, [&](TrialContext& context) {
      return std::unique_ptr<Trial>(std::make_unique<CapturingMlp>(context, &weights));
    }, communicator, options);
    return weights;
  }

  std::vector<torch::Tensor> one_rank(std::vector<std::string> overrides, const std::string& name,
                                      const std::string& checkpoint_dir = "") {
    comm::LocalCommunicator local;
    return train(local, std::move(overrides), name, checkpoint_dir);
  }

  static std::string dir_;
};

std::string DdpEquivalence::dir_;

TEST_F(DdpEquivalence, EveryWorldSizeEndsWithTheWeightsOfOneRank) {
  const std::vector<std::string> overrides = {"searcher.max_length.batches=" + std::to_string(kSteps)};
  const auto reference = one_rank(overrides, "one");
  comm::Watchdog watchdog(env().world(), {std::chrono::seconds(120), {}, 1, {}, nullptr});
  comm::MpiCommunicator world(env().world(), &watchdog);
  const auto distributed = train(world, overrides, "world");
  watchdog.finish();
  const double difference = max_relative_difference(distributed, reference);
  if (world.is_chief()) {
    std::printf("[ measured ] %d ranks vs 1 after %lld steps: max relative weight difference %.3g\n",
                world.size(), static_cast<long long>(kSteps), difference);
  }
  EXPECT_LE(difference, 1e-5);
  EXPECT_GT(max_relative_difference(reference, one_rank({"searcher.max_length.batches=1"}, "short")), 1e-2)
      << "the comparison cannot tell trained weights apart";
}

TEST_F(DdpEquivalence, AggregatingTwoHalfBatchesEqualsTheFullBatch) {
  const auto reference = one_rank({"searcher.max_length.batches=" + std::to_string(kSteps)}, "full");
  comm::MpiCommunicator world(env().world());
  const auto aggregated = train(world,
                                {"searcher.max_length.batches=" + std::to_string(2 * kSteps),
                                 "hyperparameters.global_batch_size=32", "optimizations.aggregation_frequency=2"},
                                "aggregated");
  const double difference = max_relative_difference(aggregated, reference);
  if (world.is_chief()) {
    std::printf("[ measured ] %d ranks, batch 32 x aggregation 2 vs batch 64: max relative weight difference %.3g\n",
                world.size(), difference);
  }
  EXPECT_LE(difference, 1e-5);
}

// A checkpoint does not depend on the number of ranks: saved by all ranks and resumed by one,
// or saved by one and resumed by all, training ends where one rank alone would.
TEST_F(DdpEquivalence, ResumesOnAnotherNumberOfRanks) {
  const auto batches = [](int n) { return "searcher.max_length.batches=" + std::to_string(n); };
  const auto reference = one_rank({batches(kSteps)}, "straight");
  comm::MpiCommunicator world(env().world());
  const std::string from_world = dir_ + "/from-world", from_one = dir_ + "/from-one";
  train(world, {batches(25)}, "world-first", from_world);  // ends with a checkpoint at 25
  if (world.is_chief()) {
    one_rank({batches(12)}, "one-first", from_one);  // a checkpoint at 12
    const auto resumed = one_rank({batches(kSteps)}, "one-second", from_world);
    const double difference = max_relative_difference(resumed, reference);
    std::printf("[ measured ] saved by %d ranks, resumed by 1: max relative weight difference %.3g\n", world.size(),
                difference);
    EXPECT_LE(difference, 1e-5);
  }
  world.barrier();
  const auto resumed = train(world, {batches(kSteps)}, "world-second", from_one);
  const double difference = max_relative_difference(resumed, reference);
  if (world.is_chief()) {
    std::printf("[ measured ] saved by 1 rank, resumed by %d: max relative weight difference %.3g\n", world.size(),
                difference);
  }
  EXPECT_LE(difference, 1e-5);
}

TEST_F(DdpEquivalence, SmallBucketsAndCompressionStillTrainTheSameModel) {
  const std::vector<std::string> base = {"searcher.max_length.batches=" + std::to_string(kSteps)};
  const auto reference = one_rank(base, "reference");
  comm::MpiCommunicator world(env().world());
  auto small = base;
  small.push_back("optimizations.bucket_cap_mb=0.001");  // one bucket per parameter
  EXPECT_LE(max_relative_difference(train(world, small, "small"), reference), 1e-5);
  for (const char* compression : {"fp16", "bf16"}) {
    auto compressed = base;
    compressed.push_back(std::string("optimizations.gradient_compression=") + compression);
    const double difference = max_relative_difference(train(world, compressed, compression), reference);
    if (world.is_chief()) std::printf("[ measured ] %s compression: max relative weight difference %.3g\n", compression, difference);
    // 16-bit gradients round, so the weights drift a little - but only a little.
    EXPECT_GT(difference, 0.0) << compression << " changed nothing: was it applied?";
    EXPECT_LT(difference, 5e-2) << compression;
  }
}

}  // namespace ddp_equivalence_test
}  // namespace hpctrial
