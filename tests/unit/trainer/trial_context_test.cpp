#include "hpctrial/trainer/trial_context.h"
#include "api/devices.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "hpctrial/core/error.h"
#include "hpctrial/comm/communicator.h"
#include "hpctrial/trainer/engine_trial.h"
#include "../../support/temp_dir.h"
#include "test_trial.h"

namespace hpctrial::trainer {
namespace trial_context_test {  // named: the target compiles its sources together (UNITY_BUILD)

using testing::HasSubstr;

TrialSettings settings_with(nlohmann::json hparams, int world = 1) {
  TrialSettings s;
  s.hparams = std::move(hparams);
  s.data_config = {{"path", "/data/x.h5"}, {"shards", 4}};
  s.trial_seed = 99;
  s.distributed.size = world;
  s.distributed.rank = world - 1;
  return s;
}

class TrialContextTest : public testing::Test {
 protected:
  comm::LocalCommunicator comm_;
};

TEST_F(TrialContextTest, Hyperparameters) {
  TrialContext context(settings_with({{"global_batch_size", 32}, {"lr", 0.5}, {"name", "adam"}, {"layers", {64, 32}}}), comm_);
  EXPECT_EQ(context.hparam<double>("lr"), 0.5);
  EXPECT_EQ(context.hparam<std::string>("name"), "adam");
  EXPECT_EQ(context.hparam<std::vector<int>>("layers"), (std::vector<int>{64, 32}));
  EXPECT_EQ(context.hparams().size(), 4u);
  try {
    context.hparam<double>("momentum");
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()),
              "hyperparameter 'momentum' is not in the experiment config (it has: global_batch_size, "
              "layers, lr, name); add hyperparameters.momentum to it");
  }
  try {
    context.hparam<double>("name");
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("hyperparameter 'name' is \"adam\" (string), which the trial cannot read"));
  }
}

TEST_F(TrialContextTest, BatchSizesSeedsAndDistribution) {
  TrialContext context(settings_with({{"global_batch_size", 32}}, /*world=*/4), comm_);
  EXPECT_EQ(context.global_batch_size(), 32);
  EXPECT_EQ(context.per_slot_batch_size(), 8);
  EXPECT_EQ(context.trial_seed(), 99u);
  EXPECT_EQ(context.distributed().size, 4);
  EXPECT_EQ(context.distributed().rank, 3);
  EXPECT_FALSE(context.distributed().is_chief());
  EXPECT_EQ(context.data_config()["shards"], 4);
}

TEST_F(TrialContextTest, GlobalBatchSizeIsRequiredAndSplitOverRanks) {
  auto error_of = [&](nlohmann::json hparams, int world) {
    try {
      TrialContext context(settings_with(std::move(hparams), world), comm_);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_THAT(error_of(nlohmann::json::object(), 1), HasSubstr("hyperparameters.global_batch_size is required"));
  EXPECT_THAT(error_of({{"global_batch_size", 0}}, 1), HasSubstr("must be a positive integer, got 0"));
  EXPECT_THAT(error_of({{"global_batch_size", "64"}}, 1), HasSubstr("must be a positive integer, got \"64\""));
  EXPECT_THAT(error_of({{"global_batch_size", 3}}, 4),
              HasSubstr("global_batch_size (3) is smaller than the number of ranks (4)"));
  // As in Determined: global // ranks each, the remainder dropped (with a warning).
  TrialContext context(settings_with({{"global_batch_size", 10}}, 4), comm_);
  EXPECT_EQ(context.per_slot_batch_size(), 2);
  EXPECT_EQ(context.global_batch_size(), 8);
}

TEST_F(TrialContextTest, DeviceAndToDevice) {
  TrialContext context(settings_with({{"global_batch_size", 8}}), comm_);
  EXPECT_EQ(context.device(), torch::Device(torch::kCPU));
  const Batch moved = context.to_device(Batch{torch::ones({2, 3}), torch::zeros({2})});
  EXPECT_EQ(moved.data.device(), torch::Device(torch::kCPU));
  EXPECT_TRUE(torch::equal(moved.data, torch::ones({2, 3})));
  if (!torch::cuda::is_available()) {
    TrialSettings gpu = settings_with({{"global_batch_size", 8}});
    gpu.gpus_per_slot = 1;
    try {
      TrialContext context2(gpu, comm_);
      FAIL();
    } catch (const ConfigError& e) {
      EXPECT_THAT(e.what(), HasSubstr("resources.gpus_per_slot is 1 but rank 0 on ")); EXPECT_THAT(e.what(), HasSubstr(" sees no GPU"));
    }
  }
}

// The slot's devices: the node's split by local rank, or a rank's own; never shared.
TEST(SlotDevices, RanksSplitTheirNodesDevicesOrTakeTheirOwn) {
  detail::SlotDeviceQuery q;
  q.gpus_per_slot = 2;
  q.visible = 4;
  q.local_size = 2;
  q.local_rank = 1;
  q.node = "n1";
  EXPECT_EQ(detail::slot_device_indices(q), (std::vector<int>{2, 3}));
  q.local_rank = 0;
  EXPECT_EQ(detail::slot_device_indices(q), (std::vector<int>{0, 1}));
  q.visible = 2;  // each rank sees its own two (CUDA_VISIBLE_DEVICES set per rank)
  q.own_devices = true;
  q.local_rank = 1;
  EXPECT_EQ(detail::slot_device_indices(q), (std::vector<int>{0, 1}));
}

// The ConfigError's message, or why there was none.
std::string refusal(const detail::SlotDeviceQuery& q) {
  try {
    const auto devices = detail::slot_device_indices(q);
    return "no refusal: " + std::to_string(devices.size()) + " devices";
  } catch (const ConfigError& e) {
    return e.what();
  }
}

TEST(SlotDevices, TooFewDevicesForTheNodesRanksAreRefusedWithTheCounts) {
  detail::SlotDeviceQuery q;
  q.gpus_per_slot = 1;
  q.visible = 2;
  q.local_size = 4;
  q.local_rank = 3;
  q.rank = 7;
  q.node = "n1";
  q.visible_devices = "0,1";
  EXPECT_THAT(refusal(q), HasSubstr("node n1 runs 4 ranks with resources.gpus_per_slot 1, which need 4 GPUs, and "
                                    "its ranks see 2 (CUDA_VISIBLE_DEVICES=0,1): ranks would share a device. Set "
                                    "resources.slots_per_node to at most 2"));
  q.gpus_per_slot = 4;  // not one slot fits on the node: fewer ranks would not help
  EXPECT_THAT(refusal(q), HasSubstr("which need 16 GPUs, and its ranks see 2 (CUDA_VISIBLE_DEVICES=0,1): ranks would "
                                    "share a device. Lower resources.gpus_per_slot to 2 or fewer and "
                                    "resources.slots_per_node to 1, or request more GPUs per node"));
  q.own_devices = true;
  q.gpus_per_slot = 2;
  q.visible = 1;
  EXPECT_THAT(refusal(q), HasSubstr("rank 7 on n1 sees 1 device(s) of its own (CUDA_VISIBLE_DEVICES=0,1): bind 2 "
                                    "GPUs to each rank, or lower resources.gpus_per_slot to 1"));
}

TEST_F(TrialContextTest, EpochPositionAndStopRequests) {
  TrialContext context(settings_with({{"global_batch_size", 8}}), comm_);
  context.set_loop_position(true, false, 0);
  EXPECT_TRUE(context.is_epoch_start());
  EXPECT_FALSE(context.is_epoch_end());
  context.set_loop_position(false, true, 7);
  EXPECT_TRUE(context.is_epoch_end());
  EXPECT_FALSE(context.get_stop_requested());
  context.set_stop_requested(true);
  EXPECT_TRUE(context.get_stop_requested());
}

TEST_F(TrialContextTest, WrapsModelsOptimizersSchedulersAndReducers) {
  TrialContext context(settings_with({{"global_batch_size", 8}}), comm_);
  auto a = context.wrap_model(torch::nn::Linear(2, 2));
  auto b = context.wrap_model(std::make_shared<torch::nn::LinearImpl>(2, 1));
  auto opt_a = context.wrap_optimizer(std::make_shared<torch::optim::SGD>(a->parameters(), torch::optim::SGDOptions(0.1)));
  auto opt_b = context.wrap_optimizer(std::make_shared<torch::optim::Adam>(b->parameters()));
  auto sched = context.wrap_lr_scheduler(std::make_shared<torch::optim::StepLR>(*opt_a, 1), StepMode::Manual);
  EXPECT_EQ(context.models().size(), 2u);
  EXPECT_EQ(context.optimizers().size(), 2u);
  ASSERT_EQ(context.lr_schedulers().size(), 1u);
  EXPECT_EQ(context.lr_schedulers()[0].mode, StepMode::Manual);
  context.wrap_reducer([](const std::vector<nlohmann::json>& v) { return static_cast<double>(v.size()); }, "count");
  EXPECT_THROW(context.wrap_reducer([](const std::vector<nlohmann::json>&) { return 0.0; }, "count"), ConfigError);
  EXPECT_THROW(context.wrap_reducer([](const std::vector<nlohmann::json>&) { return 0.0; }, ""), ConfigError);
  context.wrap_reducer([](const std::vector<nlohmann::json>&) { return nlohmann::json::object(); });  // name=None
  context.wrap_reducer([](const std::vector<nlohmann::json>&) { return nlohmann::json::object(); });
  ASSERT_EQ(context.reducers().size(), 3u);
  EXPECT_EQ(context.reducers()[0].key, "count");
  EXPECT_FALSE(context.reducers()[1].name.has_value());
  EXPECT_EQ(context.reducers()[2].key, "unnamed reducer 2");
}

TEST_F(TrialContextTest, StepOptimizerClipsStepsAndZeroes) {
  TrialContext context(settings_with({{"global_batch_size", 8}}), comm_);
  auto model = context.wrap_model(torch::nn::Linear(1, 1));
  auto optimizer = context.wrap_optimizer(std::make_shared<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(1.0)));
  const auto before = model->weight.detach().clone();
  auto loss = (model->forward(torch::ones({1, 1})) * 100).sum();
  context.backward(loss);
  int clipped = 0;
  context.step_optimizer(*optimizer, [&](std::vector<torch::Tensor>& params) {
    ++clipped;
    EXPECT_EQ(params.size(), 2u);
    torch::nn::utils::clip_grad_norm_(params, 1.0);
  });
  EXPECT_EQ(clipped, 1);
  // The gradient (100, 100) was clipped to norm 1 before the step of size 1.
  EXPECT_NEAR((before - model->weight.detach()).item<double>(), 1.0 / std::sqrt(2.0), 1e-5);
  EXPECT_FALSE(model->weight.grad().defined() && model->weight.grad().abs().sum().item<double>() > 0);

  auto loss2 = model->forward(torch::ones({1, 1})).sum();
  context.backward(loss2);
  context.step_optimizer(*optimizer, {}, /*auto_zero_grads=*/false);
  EXPECT_EQ(model->weight.grad().item<double>(), 1.0);
}

TEST_F(TrialContextTest, StepOptimizerRefusesAnUnwrappedOptimizer) {
  TrialContext context(settings_with({{"global_batch_size", 8}}), comm_);
  auto model = context.wrap_model(torch::nn::Linear(1, 1));
  torch::optim::SGD stray(model->parameters(), torch::optim::SGDOptions(0.1));
  try {
    context.step_optimizer(stray);
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("step_optimizer: this optimizer was not wrapped"));
  }
}

TEST_F(TrialContextTest, KeepingGradientsIsRefusedWhenBatchesAreAggregated) {
  TrialSettings settings = settings_with({{"global_batch_size", 8}});
  settings.aggregation_frequency = 2;
  TrialContext context(settings, comm_);
  auto model = context.wrap_model(torch::nn::Linear(1, 1));
  auto optimizer = context.wrap_optimizer(std::make_shared<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(1.0)));
  context.backward(model->forward(torch::ones({1, 1})).sum());
  try {
    context.step_optimizer(*optimizer, {}, /*auto_zero_grads=*/false);
    FAIL() << "auto_zero_grads = false was accepted with aggregation_frequency 2";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("step_optimizer(..., auto_zero_grads = false) with "
                                    "optimizations.aggregation_frequency 2: the gradients must be zeroed"));
  }
  context.step_optimizer(*optimizer);  // the default is accepted
}

TEST(Metric, TensorsAndNumbers) {
  Metric from_tensor(torch::tensor({2.5}));
  EXPECT_EQ(from_tensor.item(), 2.5);
  EXPECT_EQ(Metric(3).item(), 3.0);
  EXPECT_EQ(from_tensor.tensor().dim(), 0);
  const Metric matrix(torch::ones({2, 2}));  // an evaluation metric of any shape
  EXPECT_FALSE(matrix.is_scalar());
  try {
    matrix.item();
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("a metric of shape [2, 2] is not a single number"));
  }
  EXPECT_EQ(tensor_json(torch::tensor({{1.0, 2.0}, {3.0, 4.5}})), nlohmann::json::parse("[[1.0, 2.0], [3.0, 4.5]]"));
  EXPECT_EQ(tensor_json(torch::tensor(7)), nlohmann::json(7.0));
  ReducerSpec spec(std::map<std::string, Reducer>{{"errors", Reducer::kSum}});
  EXPECT_EQ(spec.reducer_for("errors"), Reducer::kSum);
  EXPECT_EQ(spec.reducer_for("loss"), Reducer::kAvg);
  EXPECT_EQ(ReducerSpec(Reducer::kMax).reducer_for("x"), Reducer::kMax);
}

// from_config: a context for calling a trial's methods by hand, its hyperparameters those of the
// asked trial of the config's searcher, and the overrides applied; an engine trial's from the same
// config; a config that does not load is the config's error.
TEST(FromConfig, BuildsAContextForATrialCalledByHand) {
  testing_support::TempDir dir;
  const std::string path = dir.write("exp.yaml",
      "name: by-hand\nentrypoint: ./t\nsearcher: {name: grid, metric: validation_loss, max_length: {batches: 4}}\n"
      "hyperparameters: {global_batch_size: 8, lr: {type: categorical, vals: [0.1, 0.2]}}\n"
      "reproducibility: {experiment_seed: 5}\ndata: {path: /data/x.h5}\n");
  const auto context = TrialContext::from_config(path, {"data.path=/other.h5"}, 1);
  EXPECT_DOUBLE_EQ(context->hparam<double>("lr"), 0.2);
  EXPECT_EQ(context->data_config().at("path"), "/other.h5");
  EXPECT_EQ(context->distributed().size, 1);
  EXPECT_EQ(context->per_slot_batch_size(), 8);

  testing_trial::Record record;
  testing_trial::LinearTrial trial(*context, {}, &record);
  DataLoader loader = trial.build_training_data_loader();
  Batch batch = loader.read({0, 1, 2, 3, 4, 5, 6, 7});
  const auto before = trial.model->weight.clone();
  const Metrics metrics = trial.train_batch(batch, 0, 0);
  EXPECT_TRUE(metrics.count("loss"));
  EXPECT_FALSE(torch::equal(before, trial.model->weight)) << "the optimizer stepped";

  const std::string engine = dir.write("engine.yaml",
      "name: engine\nentrypoint: ./t\nsearcher: {name: single, metric: loss, max_length: {batches: 4}}\n"
      "hyperparameters: {global_batch_size: 8}\nengine: {train_micro_batch_size_per_gpu: 4}\n");
  const auto engine_context = EngineTrialContext::from_config(engine);
  EXPECT_EQ(engine_context->train_batch_size(), 8);
  EXPECT_EQ(engine_context->gradient_accumulation_steps(), 2);

  try {
    TrialContext::from_config(path, {"resources.slots_per_trial=0"});
    ADD_FAILURE() << "a bad override loaded";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("resources.slots_per_trial"));
  }
}

}  // namespace trial_context_test
}  // namespace hpctrial::trainer
