// Engine trials with engine.pipeline under the real loop, on 2 ranks (2 stages) and 4 (2 stages x
// 2 replicas, with and without ZeRO-1 over the replicas, and 4 stages): a pipeline of 7 layers
// trains within 1e-6 of the same layers as one model on one rank with the same global batch,
// validates alike, and a run stopped by SIGUSR2 on the first or on the last stage resumes
// bitwise, on fewer replicas within 1e-5, and on another number of stages and replicas within
// 1e-5 over 100 more steps, and with its layers cut elsewhere on as many stages within 1e-5.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <signal.h>

#include <filesystem>
#include <map>

#include "hpctrial/comm/communicator.h"
#include "hpctrial/rank/stop_signals.h"
#include "hpctrial/trainer/engine_trial.h"
#include "../unit/trainer/test_trial.h"
#include "loaded_trial_support.h"
#include "mpi_test_env.h"

namespace hpctrial::trainer {
namespace pipeline_engine_test {  // named: the target compiles its sources together (UNITY_BUILD)

using testing_mpi::env;
using testing_trial::config_from;

constexpr std::int64_t kFeatures = 6, kRecords = 384;

std::vector<LayerSpec> layers() {
  std::vector<LayerSpec> out;
  std::int64_t width = kFeatures;
  for (int i = 0; i < 4; ++i) {
    const std::int64_t next = i == 3 ? 2 : 12;
    out.push_back(LayerSpec::of<torch::nn::Linear>(width, next));
    if (i < 3) out.push_back(LayerSpec::function("tanh", [](const torch::Tensor& x) { return torch::tanh(x); }));
    width = next;
  }
  return out;  // 7 layers: 4 linear, 3 tanh
}

torch::Tensor mse(const torch::Tensor& output, const torch::Tensor& target) { return torch::mse_loss(output, target); }

// The layers as a pipeline (engine.pipeline), or whole on one rank trained micro-batch by
// micro-batch with engine.backward and engine.step.
class PipelineTrial : public EngineTrial {
 public:
  struct Options {
    bool pipeline = true;
    std::map<std::string, torch::Tensor>* parameters_out = nullptr;
    std::int64_t signal_after = -1;  // raise SIGUSR2 on `signal_rank` after this global batch
    int signal_rank = 0;
  };
  PipelineTrial(EngineTrialContext& context, Options options) : context_(context), options_(options) {
    torch::manual_seed(3);
    const auto x = torch::randn({kRecords, kFeatures});
    data_ = std::make_shared<TensorDataset>(x, torch::stack({torch::sin(x.sum(1)), torch::cos(x.select(1, 0))}, 1));
    if (options.pipeline) {
      module_ = context.pipeline_module(layers(), mse);
    } else {
      PipelineOptions whole;
      whole.seed = context.trial_seed();
      module_ = PipelineModule(layers(), mse, 0, whole);
    }
    auto optimizer = std::make_shared<torch::optim::Adam>(module_->parameters(),
                                                          torch::optim::AdamOptions(context.hparam<double>("lr")));
    engine_ = context.wrap_model_engine(std::make_shared<ModelEngine>(module_, optimizer));
  }
  ~PipelineTrial() override {
    if (options_.parameters_out == nullptr) return;
    options_.parameters_out->clear();
    for (const auto& item : module_->named_parameters()) (*options_.parameters_out)[item.key()] = item.value().detach().clone();
  }

  Metrics train_batch(DataIterator& data, std::int64_t, std::int64_t batch_idx) override {
    torch::Tensor loss;
    if (options_.pipeline) {
      loss = engine_->train_batch(data);
    } else {
      const Batch batch = data.next();
      loss = module_->loss(module_->forward(batch.data), batch.target);
      engine_->backward(loss);
      engine_->step();
    }
    if (batch_idx + 1 == options_.signal_after && context_.distributed().rank == options_.signal_rank) ::raise(SIGUSR2);
    return {{"loss", loss}};
  }
  Metrics evaluate_batch(DataIterator& data, std::int64_t) override {
    if (options_.pipeline) return {{"validation_loss", engine_->eval_batch(data)}};
    const Batch batch = data.next();
    return {{"validation_loss", module_->loss(module_->forward(batch.data), batch.target)}};
  }
  DataLoader build_training_data_loader() override { return {data_, context_.train_micro_batch_size_per_gpu()}; }
  DataLoader build_validation_data_loader() override { return {data_, 16, false}; }

 private:
  EngineTrialContext& context_;
  Options options_;
  std::shared_ptr<TensorDataset> data_;
  PipelineModule module_{nullptr};
  std::shared_ptr<ModelEngine> engine_;
};

struct Setup {
  int stages = 2;
  int zero = 0;
  double clipping = 0;
  std::string partition = "uniform";  // engine.pipeline.partition_method: a method, or the cut "[0, 2, 7]"
};

std::string yaml(int slots, const Setup& setup, bool pipeline, std::int64_t batches) {
  std::string engine = "{train_batch_size: 32, gradient_accumulation_steps: 4, gradient_clipping: " +
                       std::to_string(setup.clipping) + ", zero_optimization: {stage: " + std::to_string(setup.zero) + "}";
  if (pipeline) {
    engine += ", pipeline: {stages: " + std::to_string(setup.stages) + ", partition_method: " + setup.partition + "}";
  }
  return "name: pipeline\nentrypoint: ./pipeline\nhyperparameters: {lr: 0.01}\nengine: " + engine +
         "}\nsearcher: {name: single, metric: validation_loss, smaller_is_better: true, max_length: {batches: " +
         std::to_string(batches) + "}}\nmin_validation_period: {batches: 10}\nresources: {slots_per_trial: " +
         std::to_string(slots) + "}\n";
}

TrialFactory pipeline_factory(PipelineTrial::Options options) {
  return [options](TrialContext& context) {
    return std::unique_ptr<Trial>(std::make_unique<detail::EngineTrialRunner>(
        context, [options](EngineTrialContext& engine) { return std::make_unique<PipelineTrial>(engine, options); }));
  };
}

LoopResult train(comm::Communicator& comm, const std::string& dir, const Setup& setup, std::int64_t batches,
                 PipelineTrial::Options options) {
  LoopOptions loop;
  loop.trial_dir = dir + "/trial";
  loop.checkpoint_dir = dir + "/checkpoints";
  loop.progress_interval_s = 0;
  loop.experiment_seed = 5;
  loop.distributed = {comm.rank(), comm.size(), comm.rank(), comm.size(), 1};
  loop.external_stop = &rank::stop_signal_received();
  rank::install_stop_handlers();
  LoopResult result = run_training(config_from(yaml(comm.size(), setup, options.pipeline, batches)),
                                   pipeline_factory(options), comm, loop);
  rank::clear_stop_signal();
  return result;
}

// Each parameter this rank's stage holds against the same parameter of the whole model.
void expect_close(const std::map<std::string, torch::Tensor>& stage, const std::map<std::string, torch::Tensor>& whole,
                  double tolerance) {
  EXPECT_FALSE(stage.empty());
  for (const auto& [name, tensor] : stage) {
    ASSERT_EQ(whole.count(name), 1u) << name;
    const auto& reference = whole.at(name);
    const double scale = reference.abs().max().item<double>() + 1e-12;
    EXPECT_LT((tensor - reference).abs().max().item<double>() / scale, tolerance) << name;
  }
}

void expect_equivalent(const Setup& setup) {
  comm::MpiCommunicator world(env().world());
  if (world.size() % setup.stages != 0) GTEST_SKIP() << setup.stages << " stages on " << world.size() << " ranks";
  const std::string dir = testing_mpi::shared_dir("hpctrial-pipeline-engine", "equivalence");
  std::map<std::string, torch::Tensor> stage, whole;
  PipelineTrial::Options options;
  options.parameters_out = &stage;
  const LoopResult piped = train(world, dir, setup, 20, options);
  comm::LocalCommunicator alone;
  options.pipeline = false;
  options.parameters_out = &whole;
  const LoopResult one = train(alone, dir + "/whole-" + std::to_string(world.rank()), setup, 20, options);
  expect_close(stage, whole, 1e-6);
  EXPECT_NEAR(piped.last_validation.at("validation_loss"), one.last_validation.at("validation_loss"), 1e-6);
  MPI_Barrier(env().world());
  if (env().is_chief()) std::filesystem::remove_all(dir);
}

TEST(PipelineEngine, TwoStagesTrainLikeTheWholeModelOnOneRank) { expect_equivalent({2, 0, 0}); }
TEST(PipelineEngine, TwoStagesWithZeroOneOverTheReplicasAndClippingTrainLikeOneRank) { expect_equivalent({2, 1, 0.05}); }
TEST(PipelineEngine, FourStagesTrainLikeTheWholeModelOnOneRank) { expect_equivalent({4, 0, 0.05}); }

// Stopped by SIGUSR2 after global batch 7 on `stopping_rank`, then resumed to batch 20: the
// weights of an uninterrupted run, bit for bit.
void expect_bitwise_resume(int stopping_rank) {
  comm::MpiCommunicator world(env().world());
  const std::string dir = testing_mpi::shared_dir("hpctrial-pipeline-engine", "resume-" + std::to_string(stopping_rank));
  const Setup setup{2, world.size() > 2 ? 1 : 0, 0.05};
  std::map<std::string, torch::Tensor> straight, resumed;
  PipelineTrial::Options options;
  options.parameters_out = &straight;
  train(world, dir + "/straight", setup, 20, options);
  options.parameters_out = nullptr;
  options.signal_after = 7;
  options.signal_rank = stopping_rank;
  const LoopResult stopped = train(world, dir + "/stopped", setup, 20, options);
  EXPECT_TRUE(stopped.stopped_early);
  options.signal_after = -1;
  options.parameters_out = &resumed;
  const LoopResult finished = train(world, dir + "/stopped", setup, 20, options);
  EXPECT_FALSE(finished.stopped_early);
  ASSERT_EQ(resumed.size(), straight.size());
  for (const auto& [name, tensor] : resumed) EXPECT_TRUE(torch::equal(tensor, straight.at(name))) << name;
  MPI_Barrier(env().world());
  if (env().is_chief()) std::filesystem::remove_all(dir);
}

// 2 stages x 2 replicas with ZeRO-1, stopped after global batch 7, resumed as 2 stages x 1
// replica (each half of the world resuming a copy of the checkpoint on its own) to batch 20:
// within 1e-5 of the same layers trained whole on one rank (a replica count changes only the
// order in which gradients are summed).
TEST(PipelineEngine, AStopResumesOnFewerReplicas) {
  comm::MpiCommunicator world(env().world());
  if (world.size() != 4) GTEST_SKIP() << "2 stages x 2 replicas need 4 ranks";
  const std::string dir = testing_mpi::shared_dir("hpctrial-pipeline-engine", "fewer-replicas");
  const pipeline_engine_test::Setup setup{2, 1, 0.05};
  PipelineTrial::Options options;
  options.signal_after = 7;
  options.signal_rank = 1;
  const LoopResult stopped = train(world, dir + "/stopped", setup, 20, options);
  EXPECT_TRUE(stopped.stopped_early);
  const int half = world.rank() / 2;
  if (world.rank() == 2) {
    std::error_code error;  // a failure shows as the resume's missing checkpoint, not as a hang
    std::filesystem::create_directories(dir + "/copy", error);
    std::filesystem::copy(dir + "/stopped/checkpoints", dir + "/copy/checkpoints",
                          std::filesystem::copy_options::recursive, error);
    EXPECT_FALSE(error) << error.message();
  }
  MPI_Barrier(env().world());
  const auto pipeline = world.split(half, world.rank());
  std::map<std::string, torch::Tensor> resumed, whole;
  options.signal_after = -1;
  options.parameters_out = &resumed;
  const LoopResult finished = train(*pipeline, dir + (half == 0 ? "/stopped" : "/copy"), setup, 20, options);
  EXPECT_FALSE(finished.stopped_early);
  EXPECT_EQ(finished.batches_trained, 20);
  comm::LocalCommunicator alone;
  options.pipeline = false;
  options.parameters_out = &whole;
  train(alone, dir + "/whole-" + std::to_string(world.rank()), setup, 20, options);
  expect_close(resumed, whole, 1e-5);
  MPI_Barrier(env().world());
  if (env().is_chief()) std::filesystem::remove_all(dir);
}

// 2 stages x 2 replicas with ZeRO-1, stopped after global batch 7, resumed as 4 stages x 1
// replica for 100 more: each stage takes its layers, and their optimizer state, from whichever
// stage of the first run held them; within 1e-5 of the same layers trained whole on one rank.
TEST(PipelineEngine, AStopResumesOnAnotherNumberOfStagesAndReplicas) {
  comm::MpiCommunicator world(env().world());
  if (world.size() != 4) GTEST_SKIP() << "2 stages x 2 replicas, then 4 stages, need 4 ranks";
  const std::string dir = testing_mpi::shared_dir("hpctrial-pipeline-engine", "other-stages");
  PipelineTrial::Options options;
  options.signal_after = 7;
  options.signal_rank = 1;
  const LoopResult stopped = train(world, dir + "/run", {2, 1, 0.05}, 107, options);
  EXPECT_TRUE(stopped.stopped_early);
  EXPECT_EQ(stopped.batches_trained, 7);
  std::map<std::string, torch::Tensor> resumed, whole;
  options.signal_after = -1;
  options.parameters_out = &resumed;
  const LoopResult finished = train(world, dir + "/run", {4, 1, 0.05}, 107, options);
  EXPECT_FALSE(finished.stopped_early);
  EXPECT_EQ(finished.batches_trained, 107);
  comm::LocalCommunicator alone;
  options.pipeline = false;
  options.parameters_out = &whole;
  const LoopResult one = train(alone, dir + "/whole-" + std::to_string(world.rank()), {4, 1, 0.05}, 107, options);
  expect_close(resumed, whole, 1e-5);
  EXPECT_NEAR(finished.last_validation.at("validation_loss"), one.last_validation.at("validation_loss"), 1e-5);
  MPI_Barrier(env().world());
  if (env().is_chief()) std::filesystem::remove_all(dir);
}

// 2 stages cut [0, 4, 7], stopped after global batch 7 by the chief or by the last rank, resumed
// to batch 20 with the layers cut elsewhere on as many stages ([0, 2, 7]: the first stage keeps
// only some of its layers; [0, 6, 7]: it takes some of the second's): each stage takes its layers,
// and their optimizer state, from whichever part held them; within 1e-5 of the layers trained
// whole on one rank.
TEST(PipelineEngine, AStopResumesWithTheLayersCutElsewhereOnAsManyStages) {
  comm::MpiCommunicator world(env().world());
  const int zero = world.size() > 2 ? 1 : 0;
  std::map<std::string, torch::Tensor> whole;
  PipelineTrial::Options options;
  {
    const std::string dir = testing_mpi::shared_dir("hpctrial-pipeline-engine", "cut-whole");
    comm::LocalCommunicator alone;
    options.pipeline = false;
    options.parameters_out = &whole;
    train(alone, dir + "/whole-" + std::to_string(world.rank()), {2, zero, 0.05}, 20, options);
    options.pipeline = true;
  }
  for (const std::string cut : {"[0, 2, 7]", "[0, 6, 7]"}) {
    for (const int stopping_rank : {0, world.size() - 1}) {
      SCOPED_TRACE(cut + ", stopped by rank " + std::to_string(stopping_rank));
      const std::string dir = testing_mpi::shared_dir("hpctrial-pipeline-engine", "cut-" + std::to_string(stopping_rank));
      options.signal_after = 7;
      options.signal_rank = stopping_rank;
      options.parameters_out = nullptr;
      const LoopResult stopped = train(world, dir + "/run", {2, zero, 0.05, "[0, 4, 7]"}, 20, options);
      EXPECT_TRUE(stopped.stopped_early);
      EXPECT_EQ(stopped.batches_trained, 7);
      std::map<std::string, torch::Tensor> resumed;
      options.signal_after = -1;
      options.parameters_out = &resumed;
      const LoopResult finished = train(world, dir + "/run", {2, zero, 0.05, cut}, 20, options);
      EXPECT_FALSE(finished.stopped_early);
      EXPECT_EQ(finished.batches_trained, 20);
      expect_close(resumed, whole, 1e-5);
      MPI_Barrier(env().world());
      if (env().is_chief()) std::filesystem::remove_all(dir);
      MPI_Barrier(env().world());
    }
  }
}

// A pipeline of 2 stages, cut at explicit bounds, loaded on one process: its 7 layers as one
// stage hold every stage's weights bit for bit and evaluate the validation set as the run did.
TEST(LoadTrial, APipelineOfTwoStagesLoadsOnOneProcessAndEvaluatesAsTheRun) {
  comm::MpiCommunicator world(env().world());
  if (world.size() % 2 != 0) GTEST_SKIP() << "2 stages on " << world.size() << " ranks";
  const std::string dir = testing_mpi::shared_dir("hpctrial-pipeline-engine", "load");
  std::map<std::string, torch::Tensor> stage, loaded_parameters;
  PipelineTrial::Options options;
  options.parameters_out = &stage;
  pipeline_engine_test::Setup cut;
  cut.partition = "[0, 2, 7]";
  const LoopResult piped = train(world, dir, cut, 20, options);
  options.parameters_out = &loaded_parameters;
  {
    const LoadedTrial loaded = load_trial_from_checkpoint(dir + "/checkpoints", pipeline_factory(options));
    EXPECT_EQ(loaded.config().engine->pipeline.stages, 1);
    EXPECT_NEAR(testing_mpi::mean_evaluation(loaded, "validation_loss"),
                piped.last_validation.at("validation_loss").number(), 1e-6);
  }
  EXPECT_EQ(loaded_parameters.size(), 8u);  // 4 linear layers' weights and biases
  // Exported, the stages' layers are one model that torch::load reads into the whole pipeline.
  const std::string archive = dir + "/model-" + std::to_string(world.rank()) + ".pt";
  EXPECT_EQ(export_model(dir + "/checkpoints", archive), 8u);
  PipelineModule whole(layers(), mse, 0, PipelineOptions());
  torch::load(whole, archive);
  std::map<std::string, torch::Tensor> exported;
  for (const auto& item : whole->named_parameters()) exported[item.key()] = item.value();
  for (const auto& [name, tensor] : stage) {
    ASSERT_EQ(loaded_parameters.count(name), 1u) << name;
    EXPECT_TRUE(torch::equal(tensor, loaded_parameters.at(name))) << name;
    EXPECT_TRUE(torch::equal(tensor, exported.at(name))) << name;
  }
  MPI_Barrier(env().world());
  if (env().is_chief()) std::filesystem::remove_all(dir);
}

TEST(PipelineEngine, AStopOnTheFirstStageResumesBitwise) { expect_bitwise_resume(0); }
TEST(PipelineEngine, AStopOnTheLastStageResumesBitwise) { expect_bitwise_resume(1); }

}  // namespace pipeline_engine_test
}  // namespace hpctrial::trainer
