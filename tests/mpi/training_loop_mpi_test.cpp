// The training loop on 2 and 4 ranks: the paths where ranks must agree before a collective, the
// hooks the reference runs on the chief only, and streams that each rank reads for itself.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <atomic>
#include <filesystem>

#include "linear_trial_ranks.h"
#include "hpctrial/trainer/lr_schedulers.h"
#include "hpctrial/comm/communicator.h"
#include "hpctrial/comm/watchdog.h"
#include "mpi_test_env.h"

namespace hpctrial::trainer {
namespace training_loop_mpi_test {  // named: the target compiles its sources together (UNITY_BUILD)

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

std::string shared_dir(const std::string& name) { return testing_mpi::shared_dir("hpctrial-loop", name); }

LoopResult train(const std::string& yaml, LinearTrial::Options options, const std::string& dir) {
  return train_on_ranks(yaml, std::move(options), dir);
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

// The reference's ReduceLROnPlateau recipe as docs/trial-api.md writes it in C++: built with the
// trial's optimizer, it steps the scheduler with the validation loss in on_validation_end, which
// runs on the chief alone. Only the options differ from the page's (set by the test).
class ReduceLROnPlateauEveryValidationStep : public Callback {
 public:
  ReduceLROnPlateauEveryValidationStep(torch::optim::Optimizer& optimizer, ReduceLROnPlateauOptions options)
      : reduce_lr_(optimizer, std::move(options)), optimizer_(optimizer) {}
  void on_validation_end(const MetricValues& metrics) override { reduce_lr_.step(metrics.at("validation_loss")); }
  nlohmann::json state_dict() const override { return reduce_lr_.state_dict(); }
  void load_state_dict(const nlohmann::json& state) override { reduce_lr_.load_state_dict(state); }
  // The test's: the rate after the last validation.
  void on_trial_shutdown() override { final_lr = optimizer_.param_groups()[0].options().get_lr(); }
  double final_lr = 0;

 private:
  ReduceLROnPlateau reduce_lr_;
  torch::optim::Optimizer& optimizer_;
};

// The learning rate changed in on_validation_end reaches every rank before the next batch: the
// replicas end bitwise equal, with the chief's rate (0.1 halved at the validations after batches
// 4 and 6, and after the last, 8, before on_trial_shutdown), and replica checks after every
// batch find nothing.
TEST(TrainingLoopRanks, ALearningRateChangedOnTheChiefInOnValidationEndReachesEveryRank) {
  const std::string dir = shared_dir("plateau");
  std::shared_ptr<ReduceLROnPlateauEveryValidationStep> callback;
  std::vector<torch::Tensor> parameters;
  double lr = 0;
  LinearTrial::Options options;
  options.setup = [&](LinearTrial& trial) {
    ReduceLROnPlateauOptions plateau;
    plateau.factor = 0.5;
    plateau.patience = 0;
    // Any later loss counts as no improvement: the rate halves at every validation after the first.
    plateau.threshold_mode = "abs";
    plateau.threshold = 1e9;
    callback = std::make_shared<ReduceLROnPlateauEveryValidationStep>(*trial.optimizer, plateau);
    trial.options_.callbacks = {{"reduce_lr", callback}};  // what the trial's build_callbacks returns
  };
  options.parameters_out = &parameters;
  options.after_batch = [&](LinearTrial& trial, std::int64_t) {
    lr = trial.optimizer->param_groups()[0].options().get_lr();
  };
  const LoopResult result = train(base_yaml(8, 8) + "min_validation_period: {batches: 2}\n"
                                  "optimizations: {replica_check_period: 1}\n", options, dir);
  EXPECT_EQ(result.batches_trained, 8);
  EXPECT_EQ(lr, 0.1 * 0.5 * 0.5) << "the rate the last batch trained with, on rank " << env().rank();
  EXPECT_EQ(callback->final_lr, 0.1 * 0.5 * 0.5 * 0.5) << "after the last validation, on rank " << env().rank();
  comm::MpiCommunicator comm(env().world());
  for (std::size_t i = 0; i < parameters.size(); ++i) {
    torch::Tensor chiefs = parameters[i].clone();
    comm.broadcast_async(chiefs.data_ptr(), static_cast<std::size_t>(chiefs.nbytes()), 0)->wait();
    EXPECT_TRUE(torch::equal(parameters[i], chiefs)) << "parameter " << i << " on rank " << env().rank();
  }
  if (env().is_chief()) std::filesystem::remove_all(dir);
}

struct StreamRun {
  LoopResult result;
  std::vector<torch::Tensor> parameters;
};

// 7 batches of 8 from a 20-row stream sharded over the ranks (passes of 10 rows a rank on 2
// ranks, 5 on 4: batches span passes), stopped by `stopping_rank` after `stop_after` batches.
StreamRun train_stream(const std::string& dir, std::int64_t stop_after, int stopping_rank) {
  comm::Watchdog watchdog(env().world(), {std::chrono::seconds(60), {}, 1, {}, nullptr});
  comm::MpiCommunicator communicator(env().world(), &watchdog);
  std::atomic<bool> stop{false};
  StreamRun out;
  LinearTrial::Options options;
  options.samples = 20;
  options.stream = true;
  options.parameters_out = &out.parameters;
  options.after_batch = [&](LinearTrial&, std::int64_t batch_idx) {
    if (batch_idx + 1 == stop_after && env().rank() == stopping_rank) stop = true;
  };
  LoopOptions loop;
  loop.trial_dir = dir;
  loop.progress_interval_s = 0;
  loop.experiment_seed = 7;
  loop.distributed = slots();
  loop.external_stop = &stop;
  TrialFactory factory = [&](TrialContext& context) {
    return std::unique_ptr<Trial>(std::make_unique<LinearTrial>(context, options, nullptr));
  };
  out.result = run_training(config_from(base_yaml(7, 8) + "records_per_epoch: 20\n"), factory, communicator, loop);
  watchdog.finish();
  return out;
}

// Paused after any batch - by the chief or by the last rank - and resumed, every rank's stream
// goes on where it stood: the weights end bitwise equal to an uninterrupted run's.
TEST(TrainingLoopRanks, StreamsResumeExactlyAfterAPauseAtAnyBatch) {
  const std::string straight_dir = shared_dir("stream-straight");
  const StreamRun straight = train_stream(straight_dir, -1, 0);
  for (std::int64_t stop = 1; stop < 7; ++stop) {
    const int stopping_rank = stop % 2 == 0 ? 0 : env().size() - 1;
    const std::string dir = shared_dir("stream-" + std::to_string(stop));
    const StreamRun paused = train_stream(dir, stop, stopping_rank);
    EXPECT_TRUE(paused.result.stopped_early);
    EXPECT_EQ(paused.result.batches_trained, stop);
    const StreamRun resumed = train_stream(dir, -1, 0);
    ASSERT_EQ(resumed.parameters.size(), straight.parameters.size());
    for (std::size_t i = 0; i < straight.parameters.size(); ++i) {
      EXPECT_TRUE(torch::equal(resumed.parameters[i], straight.parameters[i]))
          << "stopped by rank " << stopping_rank << " after batch " << stop << ": parameter " << i << " differs";
    }
    if (env().is_chief()) std::filesystem::remove_all(dir);
  }
  if (env().is_chief()) std::filesystem::remove_all(straight_dir);
}

// Each rank's stream is its own: another number of ranks cannot take the positions over.
TEST(TrainingLoopRanks, AStreamCheckpointNeedsTheRanksThatWroteIt) {
  const std::string dir = shared_dir("stream-ranks");
  EXPECT_TRUE(train_stream(dir, 3, 0).result.stopped_early);
  if (env().is_chief()) {
    comm::LocalCommunicator alone;
    LoopOptions loop;
    loop.trial_dir = dir;
    loop.progress_interval_s = 0;
    loop.experiment_seed = 7;
    LinearTrial::Options options;
    options.samples = 20;
    options.stream = true;
    TrialFactory factory = [&](TrialContext& context) {
      return std::unique_ptr<Trial>(std::make_unique<LinearTrial>(context, options, nullptr));
    };
    try {
      run_training(config_from(base_yaml(7, 8) + "records_per_epoch: 20\n"), factory, alone, loop);
      ADD_FAILURE() << "a resume by 1 rank took over the streams of " << env().size();
    } catch (const CheckpointError& e) {
      EXPECT_THAT(e.what(), testing::HasSubstr("holds where the training streams of " + std::to_string(env().size()) +
                                               " rank(s) stood, and this run has 1"));
      EXPECT_THAT(e.what(), testing::HasSubstr("resources.slots_per_trial: " + std::to_string(env().size())));
    }
    std::filesystem::remove_all(dir);
  }
  comm::MpiCommunicator comm(env().world());
  comm.barrier();
}

}  // namespace training_loop_mpi_test
}  // namespace hpctrial::trainer
