// Pipeline parallelism on 2 and 4 ranks: a model of 8 layers cut into 2 and 4 stages trains, with
// the 1F1B schedule over 4 and 8 micro-batches, within 1e-6 of the same layers as one model on
// one rank with the same global batch; every stage gets the same loss; no stage holds more
// micro-batches than 1F1B allows; clipping takes the global norm; activation checkpointing changes nothing but memory (dropout
// included); validation gives the one model's loss; an activation whose shape changes is an error.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "hpctrial/comm/communicator.h"
#include "hpctrial/core/error.h"
#include "hpctrial/trainer/pipeline.h"
#include "mpi_test_env.h"
#include "parallel/pipeline_plan.h"
#include "parallel/pipeline_runner.h"

namespace hpctrial::trainer::detail {
namespace pipeline_test {  // named: the target compiles its sources together (UNITY_BUILD)

using testing::HasSubstr;
using testing_mpi::env;

constexpr std::uint64_t kSeed = 1234;
constexpr std::int64_t kGlobalBatch = 32;
constexpr int kSteps = 5;

std::vector<LayerSpec> layers(double dropout = 0) {
  std::vector<LayerSpec> specs = {
      LayerSpec::of<torch::nn::Linear>(8, 16),
      LayerSpec::function("tanh", [](const torch::Tensor& x) { return torch::tanh(x); }),
      LayerSpec::of<torch::nn::Linear>(16, 16),
      LayerSpec::function("tanh", [](const torch::Tensor& x) { return torch::tanh(x); }),
      LayerSpec::of<torch::nn::Linear>(16, 16),
      LayerSpec::of<torch::nn::Dropout>(dropout),
      LayerSpec::of<torch::nn::Linear>(16, 16),
      LayerSpec::of<torch::nn::Linear>(16, 3),
  };
  return specs;
}

torch::Tensor cross_entropy(const torch::Tensor& output, const torch::Tensor& target) {
  return torch::nn::functional::cross_entropy(output, target);
}

// The global batch of a step, the same on every rank: inputs and classes.
std::pair<torch::Tensor, torch::Tensor> batch(int step) {
  torch::manual_seed(100 + step);
  return {torch::randn({kGlobalBatch, 8}), torch::randint(0, 3, {kGlobalBatch})};
}

// Trains kSteps global batches of `micro` micro-batches with SGD, on `pipe`'s stages (the whole
// model on a pipe of one rank), and returns each step's loss.
struct Trained {
  PipelineModule module{nullptr};
  std::vector<double> losses;
  std::int64_t peak = 0;
};

Trained train(comm::Communicator& pipe, std::int64_t micro, PipelineOptions options, double dropout = 0,
              double clip = 0) {
  options.stages = pipe.size();
  options.seed = kSeed;
  Trained run;
  run.module = PipelineModule(layers(dropout), cross_entropy, pipe.rank(), options);
  torch::optim::SGD optimizer(run.module->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  PipelineRunner runner(*run.module, pipe);
  for (int step = 0; step < kSteps; ++step) {
    const auto [inputs, targets] = batch(step);
    std::vector<torch::Tensor> input_parts, target_parts;
    if (run.module->is_first_stage()) input_parts = inputs.chunk(micro);
    if (run.module->is_last_stage()) target_parts = targets.chunk(micro);
    torch::manual_seed(7 + step);  // the same dropout draws in every arrangement
    run.losses.push_back(runner.train(input_parts, target_parts, micro));
    if (clip > 0) runner.clip_grad_norm(clip);
    optimizer.step();
    optimizer.zero_grad();
    run.peak = std::max(run.peak, runner.peak_in_flight());
  }
  return run;
}

// The same layers as one model (built from the same seeds), trained on each step's whole global
// batch at once: the reference, which knows nothing of stages or micro-batches.
struct OneModel {
  torch::nn::Sequential model;
  std::vector<double> losses;
};

OneModel train_one_model(double clip = 0) {
  OneModel one;
  const auto specs = layers();
  for (std::size_t i = 0; i < specs.size(); ++i) {
    torch::manual_seed(kSeed + i);
    one.model->push_back(specs[i].build());
  }
  torch::optim::SGD optimizer(one.model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < kSteps; ++step) {
    const auto [inputs, targets] = batch(step);
    const torch::Tensor loss = cross_entropy(one.model->forward(inputs), targets);
    loss.backward();
    if (clip > 0) torch::nn::utils::clip_grad_norm_(one.model->parameters(), clip);
    optimizer.step();
    optimizer.zero_grad();
    one.losses.push_back(loss.item<double>());
  }
  return one;
}

// Each of this stage's layers against the one model's layer of the same index.
void expect_same_layers(PipelineModuleImpl& stage, const std::function<std::vector<torch::Tensor>(std::size_t)>& reference,
                        double tolerance) {
  for (std::size_t i = stage.first_layer(); i < stage.end_layer(); ++i) {
    const auto mine = stage.layer(i).ptr()->parameters();
    const auto theirs = reference(i);
    ASSERT_EQ(mine.size(), theirs.size());
    for (std::size_t p = 0; p < mine.size(); ++p) {
      EXPECT_LE((mine[p] - theirs[p]).abs().max().item<double>(), tolerance)
          << "layer " << i << " parameter " << p << " on stage " << stage.stage();
    }
  }
}

void expect_pipeline_equals_one_model(int stages, std::int64_t micro, const std::string& partition,
                                      double clip = 0) {
  comm::MpiCommunicator world(env().world());
  if (world.size() % stages != 0) GTEST_SKIP() << stages << " stages do not divide " << world.size() << " ranks";
  const auto pipe = world.split(world.rank() / stages, world.rank());
  PipelineOptions options;
  options.partition_method = partition;
  OneModel whole = train_one_model(clip);
  Trained pipelined = train(*pipe, micro, options, 0, clip);
  expect_same_layers(*pipelined.module, [&](std::size_t i) { return whole.model[i]->parameters(); }, 1e-6);
  for (int step = 0; step < kSteps; ++step) {
    EXPECT_NEAR(pipelined.losses[step], whole.losses[step], 1e-6) << "step " << step;
  }
  EXPECT_EQ(pipelined.peak, in_flight_1f1b(stages, pipe->rank(), micro));
}

TEST(Pipeline, TwoStagesOfFourMicroBatchesTrainAsOneModel) { expect_pipeline_equals_one_model(2, 4, "parameters"); }
TEST(Pipeline, TwoStagesOfEightMicroBatchesTrainAsOneModel) { expect_pipeline_equals_one_model(2, 8, "uniform"); }
TEST(Pipeline, FourStagesOfFourMicroBatchesTrainAsOneModel) { expect_pipeline_equals_one_model(4, 4, "uniform"); }
TEST(Pipeline, FourStagesOfEightMicroBatchesTrainAsOneModel) { expect_pipeline_equals_one_model(4, 8, "parameters"); }
// Clipped by the norm of every stage's gradients together, as one model's would be (the clip is
// below the gradients' norm at every step).
TEST(Pipeline, ClippingTakesTheNormAcrossStages) { expect_pipeline_equals_one_model(2, 4, "uniform", 0.05); }

// Recomputed segments draw the same dropout masks: the weights are those of the same pipeline
// that keeps its activations, to the bit.
TEST(Pipeline, ActivationCheckpointingChangesNothingButMemory) {
  comm::MpiCommunicator world(env().world());
  const auto pipe = world.split(world.rank() / 2, world.rank());
  PipelineOptions kept, recomputed;
  recomputed.activation_checkpoint_interval = 2;
  Trained a = train(*pipe, 4, kept, 0.25);
  Trained b = train(*pipe, 4, recomputed, 0.25);
  expect_same_layers(*b.module, [&](std::size_t i) { return a.module->layer(i).ptr()->parameters(); }, 0);
  EXPECT_EQ(a.losses, b.losses);
}

TEST(Pipeline, ValidationGivesTheOneModelsLoss) {
  comm::MpiCommunicator world(env().world());
  const auto pipe = world.split(world.rank() / 2, world.rank());
  PipelineOptions options;
  options.stages = 2;
  options.seed = kSeed;
  PipelineModule stage(layers(), cross_entropy, pipe->rank(), options);
  OneModel one;
  const auto specs = layers();
  for (std::size_t i = 0; i < specs.size(); ++i) {
    torch::manual_seed(kSeed + i);
    one.model->push_back(specs[i].build());
  }
  stage->eval();
  one.model->eval();
  PipelineRunner runner(*stage, *pipe);
  const auto [inputs, targets] = batch(0);
  // Micro-batches of 10, 10, 10 and 2 records: the short last one travels with its own shape.
  const auto input_parts = inputs.split(10), target_parts = targets.split(10);
  const double loss = runner.evaluate(stage->is_first_stage() ? input_parts : std::vector<torch::Tensor>{},
                                      stage->is_last_stage() ? target_parts : std::vector<torch::Tensor>{}, 4);
  double expected = 0;
  for (std::size_t i = 0; i < input_parts.size(); ++i) {
    expected += cross_entropy(one.model->forward(input_parts[i]), target_parts[i]).item<double>() / 4;
  }
  EXPECT_NEAR(loss, expected, 1e-6);
}

TEST(PipelineModule, BuildsOnlyItsOwnLayers) {
  PipelineOptions options;
  options.stages = 4;
  options.partition_method = "parameters";
  PipelineModule stage(layers(), cross_entropy, 1, options);
  // Parameters: 144, 0, 272, 0, 272, 0, 272, 51: DeepSpeed's partition_balanced cuts 2/2/2/2.
  EXPECT_EQ(stage->bounds(), (std::vector<std::size_t>{0, 2, 4, 6, 8}));
  EXPECT_EQ(stage->first_layer(), 2u);
  EXPECT_EQ(stage->parameters().size(), 2u) << "layer 2's weight and bias, nothing else";
  EXPECT_THROW(stage->layer(0), InternalError);
  options.partition_method = "explicit";
  options.bounds = {0, 4};
  EXPECT_THROW(PipelineModule(layers(), cross_entropy, 0, options), ConfigError);
  options.partition_method = "by-hand";
  try {
    PipelineModule(layers(), cross_entropy, 0, options);
    ADD_FAILURE();
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("the pipeline's partition_method is 'by-hand'; it is one of parameters, uniform, "
                                    "type:REGEX or a list of stage bounds"));
  }
}

// DeepSpeed's "type:REGEX": each layer whose name the expression finds (case aside) weighs 1 -
// here the five torch::nn::LinearImpl, [1, 0, 1, 0, 1, 0, 1, 1] - and partition_balanced cuts
// them as it returns for those weights. A frozen layer's parameters do not count under
// "parameters" (DeepSpeed's _count_layer_params counts requires_grad only): with the first Linear
// frozen, [0, 0, 272, 0, 272, 0, 272, 51] on 2 stages are cut at 6, not at 4.
TEST(PipelineModule, TypePartitionsAndFrozenLayersAreDeepSpeeds) {
  PipelineOptions options;
  options.stages = 4;
  options.partition_method = "type:linear";
  EXPECT_EQ(PipelineModule(layers(), cross_entropy, 0, options)->bounds(), (std::vector<std::size_t>{0, 4, 6, 7, 8}));
  options.partition_method = "type:conv";
  try {
    PipelineModule(layers(), cross_entropy, 0, options);
    ADD_FAILURE();
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("the pipeline's partition_method type:conv finds no layer to balance; the layers are "
                                    "torch::nn::LinearImpl, tanh"));
  }
  std::vector<LayerSpec> frozen = layers();
  frozen[0] = LayerSpec("frozen", [] {
    torch::nn::Linear linear(8, 16);
    for (auto& p : linear->parameters()) p.set_requires_grad(false);
    return torch::nn::AnyModule(linear);
  });
  options.stages = 2;
  options.partition_method = "parameters";
  EXPECT_EQ(PipelineModule(frozen, cross_entropy, 0, options)->bounds(), (std::vector<std::size_t>{0, 6, 8}));
  EXPECT_EQ(PipelineModule(layers(), cross_entropy, 0, options)->bounds(), (std::vector<std::size_t>{0, 4, 8}));
}

// DeepSpeed's _is_checkpointable: an activation-checkpointing segment without parameters (a tanh
// alone, a dropout alone) runs as it is; the others are recomputed in backward.
TEST(PipelineModule, SegmentsWithoutParametersAreNotRecomputed) {
  PipelineOptions options;
  options.activation_checkpoint_interval = 1;
  PipelineModule whole(layers(), cross_entropy, 0, options);
  EXPECT_EQ(whole->recomputed_segments(), (std::vector<bool>{true, false, true, false, true, false, true, true}));
  options.activation_checkpoint_interval = 2;
  PipelineModule pairs(layers(), cross_entropy, 0, options);
  EXPECT_EQ(pairs->recomputed_segments(), (std::vector<bool>{true, true, true, true}));
}

}  // namespace pipeline_test
}  // namespace hpctrial::trainer::detail
