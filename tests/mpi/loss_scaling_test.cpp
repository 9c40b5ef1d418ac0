// Loss scaling on 2 and 4 ranks, with overflows injected on the chief or on another rank: every
// rank skips the step and backs off alike, a scaled run trains as an unscaled one that leaves the
// same batches out, the scale survives stop and resume, and a ZeRO-2 engine skips as stage 0.
// (float16 itself needs a GPU: tests/gpu runs it there; here the gradients are float32, which the
// scaler treats the same way.)
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <limits>
#include <optional>
#include <set>

#include "../support/same_weights.h"
#include "../unit/trainer/test_trial.h"
#include "hpctrial/comm/communicator.h"
#include "hpctrial/comm/watchdog.h"
#include "hpctrial/trainer/engine_trial.h"
#include "hpctrial/trainer/grad_scaler.h"
#include "mlp_trial_support.h"
#include "mpi_test_env.h"

namespace hpctrial::trainer {
namespace loss_scaling_test {  // named: the target compiles its sources together (UNITY_BUILD)

using testing::HasSubstr;
using testing_mpi::env;
using testing_mpi::bitwise_equal;
using testing_mpi::max_relative_difference;
using testing_mpi::Mlp;
using testing_mpi::mlp_dataset;
using testing_mpi::remove_dir;

// A start of 2^10, growing after 3 clean steps: with overflows at batches 1 and 4 of 6, the scale
// goes 1024, 512 (batch 1), 512, 512, 256 (batch 4), 256; a resume that lost it would end at 512.
GradScalerOptions scaling() {
  GradScalerOptions options;
  options.init_scale = 1024;
  options.growth_interval = 3;
  return options;
}

struct Injection {
  bool scaler = true;
  std::set<std::int64_t> overflow_at = {1, 4};  // global batches whose loss is inf on overflow_rank
  int overflow_rank = 0;
  bool leave_out = false;  // no scaler: the overflow batches are not trained at all
  std::atomic<bool>* stop = nullptr;  // set after batch 2 on stop_rank
  int stop_rank = 0;
};

struct Seen {
  std::vector<torch::Tensor> parameters;
  double scale = 0;
  std::int64_t skipped = 0;
  double lr = 0;
};

torch::Tensor maybe_overflow(const torch::Tensor& loss, const Injection& setup, std::int64_t batch_idx, int rank) {
  if (setup.overflow_at.count(batch_idx) == 0 || rank != setup.overflow_rank) return loss;
  return loss * std::numeric_limits<float>::infinity();
}

void stop_if_asked(const Injection& setup, std::int64_t batch_idx, int rank) {
  if (setup.stop != nullptr && batch_idx == 2 && rank == setup.stop_rank) setup.stop->store(true);
}

// An ordinary trial: backward(scaler.scale(loss)), step_optimizer(optimizer, scaler, clip).
class ScaledTrial : public Trial {
 public:
  ScaledTrial(TrialContext& context, Injection setup, Seen* seen)
      : context_(context), setup_(setup), seen_(seen), data_(mlp_dataset()) {
    torch::manual_seed(static_cast<std::int64_t>(context.trial_seed()));
    model_ = context.wrap_model(Mlp());
    optimizer_ = context.wrap_optimizer(std::make_shared<torch::optim::Adam>(
        model_->parameters(), torch::optim::AdamOptions(context.hparam<double>("lr"))));
    if (setup_.scaler) scaler_ = context.wrap_scaler(std::make_shared<GradScaler>(scaling()));
  }
  ~ScaledTrial() override {
    if (seen_ == nullptr) return;
    for (const auto& p : model_->parameters()) seen_->parameters.push_back(p.detach().clone());
    if (scaler_) seen_->scale = scaler_->get_scale(), seen_->skipped = scaler_->skipped_steps();
  }
  Metrics train_batch(Batch& batch, std::int64_t, std::int64_t batch_idx) override {
    const int rank = context_.distributed().rank;
    auto loss = torch::mse_loss(model_->forward(batch.data), batch.target);
    stop_if_asked(setup_, batch_idx, rank);
    if (setup_.leave_out && setup_.overflow_at.count(batch_idx) != 0) return {{"loss", loss.detach()}};
    // The clip must see the unscaled gradients for the runs to agree.
    const auto clip = [](std::vector<torch::Tensor>& p) { torch::nn::utils::clip_grad_norm_(p, 0.05); };
    if (scaler_) {
      context_.backward(scaler_->scale(maybe_overflow(loss, setup_, batch_idx, rank)));
      context_.step_optimizer(*optimizer_, *scaler_, clip);
    } else {
      context_.backward(loss);
      context_.step_optimizer(*optimizer_, clip);
    }
    return {{"loss", loss.detach()}};
  }
  Metrics evaluate_batch(Batch& batch) override {
    return {{"validation_loss", torch::mse_loss(model_->forward(batch.data), batch.target)}};
  }
  DataLoader build_training_data_loader() override { return {data_, context_.per_slot_batch_size(), DataLoaderOptions()}; }
  DataLoader build_validation_data_loader() override { return {data_, 4, false}; }

 private:
  TrialContext& context_;
  Injection setup_;
  Seen* seen_;
  std::shared_ptr<TensorDataset> data_;
  Mlp model_{nullptr};
  std::shared_ptr<torch::optim::Adam> optimizer_;
  std::shared_ptr<GradScaler> scaler_;
};

// An engine trial whose engine has a GradScaler (what engine.fp16 gives it on a GPU).
class ScaledEngineTrial : public EngineTrial {
 public:
  ScaledEngineTrial(EngineTrialContext& context, Injection setup, Seen* seen)
      : context_(context), setup_(setup), seen_(seen), data_(mlp_dataset()) {
    torch::manual_seed(static_cast<std::int64_t>(context.trial_seed()));
    model_ = Mlp();
    optimizer_ = std::make_shared<torch::optim::Adam>(model_->parameters(),
                                                      torch::optim::AdamOptions(context.hparam<double>("lr")));
    engine_ = std::make_shared<ModelEngine>(model_, optimizer_, std::make_shared<torch::optim::StepLR>(*optimizer_, 2, 0.5));
    if (setup_.scaler) engine_->use_grad_scaler(std::make_shared<GradScaler>(scaling()));
    context.wrap_model_engine(engine_);
  }
  ~ScaledEngineTrial() override {
    if (seen_ == nullptr) return;
    for (const auto& p : model_->parameters()) seen_->parameters.push_back(p.detach().clone());
    if (engine_->grad_scaler() != nullptr) {
      seen_->scale = engine_->grad_scaler()->get_scale();
      seen_->skipped = engine_->grad_scaler()->skipped_steps();
    }
    seen_->lr = optimizer_->param_groups()[0].options().get_lr();
  }
  Metrics train_batch(DataIterator& data, std::int64_t, std::int64_t batch_idx) override {
    const int rank = context_.distributed().rank;
    Batch batch = data.next();
    auto loss = torch::mse_loss(model_->forward(batch.data), batch.target);
    // The first micro-batch of the global batch overflows.
    engine_->backward(data.remaining() + 1 == static_cast<std::size_t>(context_.gradient_accumulation_steps())
                          ? maybe_overflow(loss, setup_, batch_idx, rank)
                          : loss);
    engine_->step();
    stop_if_asked(setup_, batch_idx, rank);
    return {{"loss", loss.detach()}};
  }
  Metrics evaluate_batch(DataIterator& data, std::int64_t) override {
    Batch batch = data.next();
    return {{"validation_loss", torch::mse_loss(model_->forward(batch.data), batch.target)}};
  }
  DataLoader build_training_data_loader() override {
    return {data_, context_.train_micro_batch_size_per_gpu(), DataLoaderOptions()};
  }
  DataLoader build_validation_data_loader() override { return {data_, 4, false}; }

 private:
  EngineTrialContext& context_;
  Injection setup_;
  Seen* seen_;
  std::shared_ptr<TensorDataset> data_;
  Mlp model_{nullptr};
  std::shared_ptr<torch::optim::Adam> optimizer_;
  std::shared_ptr<ModelEngine> engine_;
};

std::string shared_dir(const std::string& name) { return testing_mpi::shared_dir("hpctrial-scaling", name); }

std::string yaml(const std::string& more = "") {
  return "name: test\nentrypoint: ./t\nsearcher: {name: single, metric: validation_loss, max_length: {batches: 6}}\n"
         "min_validation_period: {batches: 3}\nhyperparameters: {lr: 0.05, global_batch_size: 16}\n" + more;
}

std::string engine_yaml(int stage) {
  return yaml("engine: {gradient_accumulation_steps: 2, gradient_clipping: 0.05, zero_optimization: {stage: " +
              std::to_string(stage) + ", reduce_bucket_size: 10, stage3_param_persistence_threshold: 0}}\n");
}

LoopResult run(const std::string& config_yaml, const TrialFactory& factory, const std::string& dir,
               const std::atomic<bool>* stop = nullptr) {
  comm::Watchdog watchdog(env().world(), comm::Watchdog::Options{std::chrono::seconds(60), {}, 1, {}, nullptr});
  comm::MpiCommunicator communicator(env().world(), &watchdog);
  LoopOptions loop;
  loop.trial_dir = dir;
  loop.progress_interval_s = 0;
  loop.experiment_seed = 11;
  loop.external_stop = stop;
  loop.distributed = {env().rank(), env().size(), env().rank(), env().size(), 1};
  LoopResult result = run_training(testing_trial::config_from(config_yaml), factory, communicator, loop);
  watchdog.finish();
  return result;
}

TrialFactory trial(Injection setup, Seen* seen = nullptr) {
  return [setup, seen](TrialContext& c) -> std::unique_ptr<Trial> { return std::make_unique<ScaledTrial>(c, setup, seen); };
}

TrialFactory engine_trial(Injection setup, Seen* seen = nullptr) {
  return [setup, seen](TrialContext& c) -> std::unique_ptr<Trial> {
    return std::make_unique<detail::EngineTrialRunner>(
        c, [setup, seen](EngineTrialContext& ec) { return std::make_unique<ScaledEngineTrial>(ec, setup, seen); });
  };
}

Seen run_once(const std::string& config_yaml, const TrialFactory& factory, Seen& seen, const std::string& name) {
  const std::string dir = shared_dir(name);
  run(config_yaml, factory, dir);
  remove_dir(dir);
  return seen;
}

// Scaling by a power of two is exact: the unscaled gradients, their clip and the steps are those
// of an unscaled run, bitwise; the overflowing batches are skipped on every rank, as if no rank
// had trained them.
TEST(LossScaling, OverflowOnOneRankSkipsTheStepOnEveryRank) {
  Seen left_out;
  Injection reference;
  reference.scaler = false;
  reference.leave_out = true;
  run_once(yaml(), trial(reference, &left_out), left_out, "left-out");
  Seen clean_reference, clean;
  reference.overflow_at.clear();
  run_once(yaml(), trial(reference, &clean_reference), clean_reference, "clean-reference");
  Injection no_overflow;
  no_overflow.overflow_at.clear();
  run_once(yaml(), trial(no_overflow, &clean), clean, "clean");
  EXPECT_TRUE(bitwise_equal(clean.parameters, clean_reference.parameters)) << "scaling changed the arithmetic";
  EXPECT_EQ(clean.scale, 4096) << "grown after steps 3 and 6";
  for (int rank : {0, env().size() - 1}) {
    Seen scaled;
    Injection setup;
    setup.overflow_rank = rank;
    run_once(yaml(), trial(setup, &scaled), scaled, "scaled-" + std::to_string(rank));
    EXPECT_TRUE(bitwise_equal(scaled.parameters, left_out.parameters)) << "overflow on rank " << rank;
    EXPECT_EQ(scaled.scale, 256) << "overflow on rank " << rank;
    EXPECT_EQ(scaled.skipped, 2);
  }
}

// Stopped after batch 2 by the chief or by another rank and resumed: the weights, the optimizer
// and the scale are bitwise those of the uninterrupted run.
TEST(LossScaling, TheScaleSurvivesStopAndResume) {
  for (bool engine : {false, true}) {
    const std::string config = engine ? engine_yaml(2) : yaml();
    const auto factory = [engine](Injection setup, Seen* seen) { return engine ? engine_trial(setup, seen) : trial(setup, seen); };
    const std::string whole = shared_dir("whole");
    Seen straight;
    run(config, factory(Injection{}, &straight), whole);
    EXPECT_EQ(straight.scale, 256);
    for (int stop_rank : {0, env().size() - 1}) {
      const std::string dir = shared_dir("stopped");
      std::atomic<bool> stop{false};
      Injection stopping;
      stopping.stop = &stop;
      stopping.stop_rank = stop_rank;
      EXPECT_EQ(run(config, factory(stopping, nullptr), dir, &stop).batches_trained, 3);
      Seen resumed;
      EXPECT_EQ(run(config, factory(Injection{}, &resumed), dir).batches_trained, 6);
      EXPECT_EQ(resumed.scale, 256) << (engine ? "engine" : "trial") << ", stopped by rank " << stop_rank;
      EXPECT_EQ(resumed.skipped, 2);
      if (env().is_chief()) {
        testing_support::expect_same_weights(whole + "/checkpoints/ckpt-6.h5", dir + "/checkpoints/ckpt-6.h5");
      }
      remove_dir(dir);
    }
    remove_dir(whole);
  }
}

// At ZeRO-1 and -2 each rank checks only its shard of the gradients; the ranks agree on the skip
// all the same, and the run is stage 0's. The skipped steps leave the LR scheduler where it was.
TEST(LossScaling, ShardedEnginesSkipAsStageZeroDoes) {
  for (int rank : {0, env().size() - 1}) {
    Injection setup;
    setup.overflow_rank = rank;
    Seen stage0;
    run_once(engine_yaml(0), engine_trial(setup, &stage0), stage0, "e0");
    EXPECT_EQ(stage0.scale, 256);
    EXPECT_EQ(stage0.skipped, 2);
    for (int stage : {1, 2}) {
      Seen sharded;
      run_once(engine_yaml(stage), engine_trial(setup, &sharded), sharded, "e" + std::to_string(stage));
      EXPECT_LE(max_relative_difference(sharded.parameters, stage0.parameters), 1e-6)
          << "stage " << stage << ", overflow on rank " << rank;
      EXPECT_EQ(sharded.scale, 256);
      EXPECT_EQ(sharded.skipped, 2);
      EXPECT_DOUBLE_EQ(sharded.lr, stage0.lr);
    }
  }
  // 6 scheduler steps without overflows, 4 with: StepLR(2, 0.5) has halved once less.
  Injection clean;
  clean.overflow_at.clear();
  Seen unskipped, skipped;
  run_once(engine_yaml(2), engine_trial(clean, &unskipped), unskipped, "eclean");
  run_once(engine_yaml(2), engine_trial(Injection{}, &skipped), skipped, "eskipped");
  EXPECT_DOUBLE_EQ(skipped.lr, 2 * unskipped.lr);
}

// Two engines sharing one GradScaler, as PyTorch's one scaler for several optimizers: only the
// engine whose gradients overflowed skips its step and its LR scheduler's, even when the other
// steps after it in the same batch; the shared scale backs off once per overflowing batch.
class TwoEngineTrial : public EngineTrial {
 public:
  TwoEngineTrial(EngineTrialContext& context, Injection setup, Seen* first, Seen* second)
      : context_(context), setup_(setup), seen_{first, second}, data_(mlp_dataset()) {
    torch::manual_seed(static_cast<std::int64_t>(context.trial_seed()));
    const auto scaler = std::make_shared<GradScaler>(scaling());
    for (int k = 0; k < 2; ++k) {
      models_[k] = Mlp();
      optimizers_[k] = std::make_shared<torch::optim::Adam>(models_[k]->parameters(),
                                                            torch::optim::AdamOptions(context.hparam<double>("lr")));
      engines_[k] = std::make_shared<ModelEngine>(models_[k], optimizers_[k],
                                                  std::make_shared<torch::optim::StepLR>(*optimizers_[k], 1, 0.5));
      engines_[k]->use_grad_scaler(scaler);
      context.wrap_model_engine(engines_[k]);
    }
  }
  ~TwoEngineTrial() override {
    for (int k = 0; k < 2; ++k) {
      seen_[k]->lr = optimizers_[k]->param_groups()[0].options().get_lr();
      seen_[k]->scale = engines_[k]->grad_scaler()->get_scale();
      seen_[k]->skipped = engines_[k]->grad_scaler()->skipped_steps();
    }
  }
  Metrics train_batch(DataIterator& data, std::int64_t, std::int64_t batch_idx) override {
    Batch batch = data.next();
    torch::Tensor loss;
    for (int k = 0; k < 2; ++k) {  // the first engine's loss overflows, and it steps first
      loss = torch::mse_loss(models_[k]->forward(batch.data), batch.target);
      engines_[k]->backward(k == 0 ? maybe_overflow(loss, setup_, batch_idx, context_.distributed().rank) : loss);
      engines_[k]->step();
    }
    return {{"loss", loss.detach()}};
  }
  Metrics evaluate_batch(DataIterator& data, std::int64_t) override {
    Batch batch = data.next();
    return {{"validation_loss", torch::mse_loss(models_[0]->forward(batch.data), batch.target)}};
  }
  DataLoader build_training_data_loader() override {
    return {data_, context_.train_micro_batch_size_per_gpu(), DataLoaderOptions()};
  }
  DataLoader build_validation_data_loader() override { return {data_, 4, false}; }

 private:
  EngineTrialContext& context_;
  Injection setup_;
  Seen* seen_[2];
  std::shared_ptr<TensorDataset> data_;
  Mlp models_[2] = {Mlp(nullptr), Mlp(nullptr)};
  std::shared_ptr<torch::optim::Adam> optimizers_[2];
  std::shared_ptr<ModelEngine> engines_[2];
};

TEST(LossScaling, EnginesSharingAScalerSkipOnlyTheirOwnSteps) {
  for (int stage : {0, 2}) {
    for (int rank : {0, env().size() - 1}) {
      SCOPED_TRACE("stage " + std::to_string(stage) + ", overflow on rank " + std::to_string(rank));
      Injection setup;
      setup.overflow_rank = rank;
      Seen first, second;
      const std::string dir = shared_dir("shared");
      run(yaml("engine: {zero_optimization: {stage: " + std::to_string(stage) + ", stage3_param_persistence_threshold: 0}}\n"),
          [&](TrialContext& c) -> std::unique_ptr<Trial> {
            return std::make_unique<detail::EngineTrialRunner>(c, [&](EngineTrialContext& ec) {
              return std::make_unique<TwoEngineTrial>(ec, setup, &first, &second);
            });
          },
          dir);
      remove_dir(dir);
      // StepLR(1, 0.5) from 0.05 (LibTorch's leaves the rate at its first step): the first engine
      // stepped 4 times of 6, the second all 6.
      EXPECT_DOUBLE_EQ(first.lr, 0.05 / 8);
      EXPECT_DOUBLE_EQ(second.lr, 0.05 / 32);
      EXPECT_EQ(first.skipped, 2);
      EXPECT_EQ(first.scale, 256);
    }
  }
}

TEST(LossScaling, AScalerMustBeWrapped) {
  const std::string dir = shared_dir("unwrapped");
  std::string message;
  struct Unwrapped : ScaledTrial {
    Unwrapped(TrialContext& c, Injection s) : ScaledTrial(c, s, nullptr), context(c) {}
    Metrics train_batch(Batch& batch, std::int64_t epoch, std::int64_t batch_idx) override {
      GradScaler own;
      auto& optimizer = *context.optimizers().front();
      context.step_optimizer(optimizer, own);
      return ScaledTrial::train_batch(batch, epoch, batch_idx);
    }
    TrialContext& context;
  };
  try {
    Injection setup;
    setup.scaler = false;
    comm::MpiCommunicator communicator(env().world());
    LoopOptions loop;
    loop.trial_dir = dir;
    loop.progress_interval_s = 0;
    loop.distributed = {env().rank(), env().size(), env().rank(), env().size(), 1};
    run_training(testing_trial::config_from(yaml()),
                 [&](TrialContext& c) -> std::unique_ptr<Trial> { return std::make_unique<Unwrapped>(c, setup); },
                 communicator, loop);
  } catch (const ConfigError& e) {
    message = e.what();
  }
  EXPECT_THAT(message, HasSubstr("step_optimizer: this GradScaler was not wrapped; create it with "
                                 "context.wrap_scaler(...)"));
  remove_dir(dir);
}

}  // namespace loss_scaling_test
}  // namespace hpctrial::trainer
