// The training loop on 2 and 4 ranks: the paths where ranks must agree before a collective, and
// the hooks the reference runs on the chief only.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>

#include "../unit/trainer/test_trial.h"
#include "hpctrial/comm/communicator.h"
#include "hpctrial/comm/watchdog.h"
#include "mpi_test_env.h"

namespace hpctrial::trainer {
namespace {

using testing_mpi::env;
using namespace testing_trial;

class CountingCallback : public Callback {
 public:
  void on_validation_step_start() override { ++step_starts; }
  void on_validation_step_end(const MetricValues&) override { ++step_ends; }
  void on_validation_end(const MetricValues&) override { ++ends; }
  void on_checkpoint_end(const std::string& path) override { checkpoints.push_back(path); }
  int step_starts = 0;
  int step_ends = 0;
  int ends = 0;
  std::vector<std::string> checkpoints;
};

// A fresh directory for the run, named by the chief and shared by every rank.
std::string shared_dir(const std::string& name) {
  std::string dir;
  if (env().is_chief()) {
    dir = (std::filesystem::temp_directory_path() /
           ("hpctrial-loop-" + std::to_string(::getpid()) + "-" + name)).string();
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
  }
  comm::MpiCommunicator comm(env().world());
  comm.broadcast(dir, 0);
  return dir;
}

LoopResult train(const std::string& yaml, LinearTrial::Options options, const std::string& dir) {
  // A hang fails the test within the watchdog's timeout instead of the test's.
  comm::Watchdog watchdog(env().world(), {std::chrono::seconds(60), {}, 1, {}});
  comm::MpiCommunicator communicator(env().world(), &watchdog);
  LoopOptions loop;
  loop.trial_dir = dir;
  loop.progress_interval_s = 0;
  loop.experiment_seed = 7;
  const core::ExperimentConfig config = config_from(yaml);
  TrialFactory factory = [&](TrialContext& context) {
    return std::unique_ptr<Trial>(std::make_unique<LinearTrial>(context, options, nullptr));
  };
  LoopResult result = run_training(config, factory, communicator, loop);
  watchdog.finish();
  return result;
}

// evaluate_full_dataset with a validation set of one batch: the ranks without a batch cannot see
// that evaluate_batch is not overridden, and must still take the chief's path (they used to
// all-gather while the chief broadcast, and waited out collective_timeout).
TEST(TrainingLoopRanks, FullDatasetEvaluationWithFewerBatchesThanRanksDoesNotHang) {
  const std::string dir = shared_dir("full");
  LinearTrial::Options options;
  options.evaluate_by_batch = false;
  options.evaluate_full = true;
  options.validation_samples = 2;  // one batch, on rank 0
  const LoopResult result = train(base_yaml(4, 8), options, dir);
  EXPECT_EQ(result.last_validation.at("samples"), 2.0) << "every rank has the chief's result";
  if (env().is_chief()) std::filesystem::remove_all(dir);
}

// on_validation_end, on_validation_step_end and on_checkpoint_end run on the chief only;
// on_validation_step_start on every rank with a batch.
TEST(TrainingLoopRanks, ChiefOnlyHooksRunOnTheChiefOnly) {
  const std::string dir = shared_dir("hooks");
  auto callback = std::make_shared<CountingCallback>();
  LinearTrial::Options options;
  options.callbacks = {{"count", callback}};
  options.validation_samples = 8;  // a global batch: one validation batch a rank
  // Validation after every 2 of 4 batches and a periodic asynchronous checkpoint after 3.
  const LoopResult result = train(base_yaml(4, 8) + "min_validation_period: {batches: 2}\n"
                                  "min_checkpoint_period: {batches: 3}\ncheckpoint_storage: {async: true}\n",
                                  options, dir);
  EXPECT_EQ(callback->step_starts, 2);  // one batch, two validations
  if (env().is_chief()) {
    EXPECT_EQ(callback->ends, 2);
    EXPECT_EQ(callback->step_ends, 2);
    // The asynchronous one at 3 is reported although the final checkpoint follows at once.
    EXPECT_THAT(callback->checkpoints, testing::ElementsAre(dir + "/checkpoints/ckpt-3.h5", dir + "/checkpoints/ckpt-4.h5"));
    std::filesystem::remove_all(dir);
  } else {
    EXPECT_EQ(callback->ends, 0);
    EXPECT_EQ(callback->step_ends, 0);
    EXPECT_TRUE(callback->checkpoints.empty());
  }
}

}  // namespace
}  // namespace hpctrial::trainer
