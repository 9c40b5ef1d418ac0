// A trial's own model parallelism through context.set_mpu, on 2 ranks (one replica of a model in
// 2 parts) and 4 (two replicas): a hand-written 2-way tensor-parallel MLP trains like the whole
// MLP on one rank with the same global batch; its checkpoint holds each part once, written by the
// rank that owns it, and a run stopped by SIGUSR2 (on the chief, then on the last rank) resumes
// bitwise; units that do not fit are refused with what to change. The same MLP in an engine trial
// that sets its own unit trains alike, with ZeRO-1 over the replicas on 4 ranks.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <signal.h>

#include <filesystem>

#include "hpctrial/checkpoint/format.h"
#include "hpctrial/comm/communicator.h"
#include "hpctrial/rank/stop_signals.h"
#include "hpctrial/trainer/engine_trial.h"
#include "../unit/trainer/test_trial.h"
#include "loaded_trial_support.h"
#include "mpi_test_env.h"

namespace hpctrial::trainer {
namespace model_parallel_test {  // named: the target compiles its sources together (UNITY_BUILD)

using testing_mpi::env;
using testing_trial::config_from;

constexpr std::int64_t kIn = 8, kHidden = 16, kOut = 4, kRecords = 512;
constexpr int kParts = 2;

// Megatron's MLP: the first layer split by its outputs, the second by its inputs; each part's
// partial output is summed over the parts (forward: an all-reduce; backward: the gradient as it
// is), then the second bias, which every part holds, is added. One part is the whole MLP.
struct TensorParallelMlpImpl : torch::nn::Module {
  TensorParallelMlpImpl(int part, int parts, comm::Communicator* group) : group_(group) {
    torch::manual_seed(5);  // the whole model's weights, then this part's slices of them
    const auto w1 = torch::randn({kHidden, kIn}) * 0.4, b1 = torch::randn({kHidden}) * 0.1;
    const auto w2 = torch::randn({kOut, kHidden}) * 0.4;
    const std::int64_t width = kHidden / parts, from = part * width;
    this->w1 = register_parameter("w1", w1.narrow(0, from, width).clone());
    this->b1 = register_parameter("b1", b1.narrow(0, from, width).clone());
    this->w2 = register_parameter("w2", w2.narrow(1, from, width).clone());
    this->b2 = register_parameter("b2", torch::zeros({kOut}));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const auto partial = torch::nn::functional::linear(torch::relu(torch::nn::functional::linear(x, w1, b1)), w2);
    if (group_ == nullptr) return partial + b2;
    auto sum = partial.detach().contiguous().clone();
    group_->allreduce(sum.data_ptr<float>(), static_cast<std::size_t>(sum.numel()), comm::DType::kFloat32,
                      comm::ReduceOp::kSum);
    return partial + (sum - partial.detach()) + b2;
  }
  torch::Tensor w1, b1, w2, b2;
  comm::Communicator* group_;
};
TORCH_MODULE(TensorParallelMlp);

// The regression's data, and this rank's place in a split of the MLP into `parts`: ranks of one
// replica are consecutive (part rank % parts, replica rank / parts); with `parts` > 1, its unit
// (of `replicas_given` replicas instead of the layout's, when set) and the group of its parts.
struct Split {
  std::shared_ptr<TensorDataset> data;
  int part = 0;
  ModelParallelUnit unit;
  std::unique_ptr<comm::Communicator> parts_group;
};
Split split_mlp(comm::Communicator& world, int parts, int replicas_given = 0) {
  torch::manual_seed(7);
  const auto x = torch::randn({kRecords, kIn});
  const auto y = torch::sin(x.matmul(torch::linspace(-1, 1, kIn * kOut).reshape({kIn, kOut})));
  Split s;
  s.data = std::make_shared<TensorDataset>(x, y);
  s.part = world.rank() % parts;
  if (parts == 1) return s;
  const int replica = world.rank() / parts;
  s.unit.data_parallel_rank = replica;
  s.unit.data_parallel_world_size = replicas_given > 0 ? replicas_given : world.size() / parts;
  s.unit.should_report_metrics = s.part == 0;  // the parts compute the same loss
  s.unit.data_parallel_group = std::shared_ptr<comm::Communicator>(world.split(s.part, replica));
  s.parts_group = world.split(replica, s.part);
  return s;
}

// The MLP's regression, split by the trial as `parts` says.
class TensorParallelTrial : public Trial {
 public:
  struct Options {
    int parts = 1;
    std::vector<torch::Tensor>* parameters_out = nullptr;
    std::int64_t signal_after = -1;  // raise SIGUSR2 on `signal_rank` after this batch
    int signal_rank = 0;
    int replicas_given = 0;  // a unit with this many replicas instead (0: the layout's)
  };

  TensorParallelTrial(TrialContext& context, Options options)
      : context_(context), options_(options), split_(split_mlp(context.communicator(), options.parts, options.replicas_given)) {
    if (options.parts > 1) context.set_mpu(split_.unit);
    model_ = context.wrap_model(TensorParallelMlp(split_.part, options.parts, split_.parts_group.get()));
    optimizer_ = context.wrap_optimizer(
        std::make_shared<torch::optim::Adam>(model_->parameters(), torch::optim::AdamOptions(context.hparam<double>("lr"))));
  }
  ~TensorParallelTrial() override {
    if (options_.parameters_out == nullptr) return;
    options_.parameters_out->clear();
    for (const auto& p : model_->parameters()) options_.parameters_out->push_back(p.detach().clone());
  }

  Metrics train_batch(Batch& batch, std::int64_t, std::int64_t batch_idx) override {
    const auto loss = torch::mse_loss(model_->forward(batch.data), batch.target);
    context_.backward(loss);
    context_.step_optimizer(*optimizer_);
    if (batch_idx + 1 == options_.signal_after && context_.distributed().rank == options_.signal_rank) ::raise(SIGUSR2);
    return {{"loss", loss}};
  }
  Metrics evaluate_batch(Batch& batch) override {
    return {{"validation_loss", torch::mse_loss(model_->forward(batch.data), batch.target)}};
  }
  DataLoader build_training_data_loader() override { return {split_.data, context_.per_slot_batch_size()}; }
  DataLoader build_validation_data_loader() override { return {split_.data, 64, false}; }

 private:
  TrialContext& context_;
  Options options_;
  Split split_;
  TensorParallelMlp model_{nullptr};
  std::shared_ptr<torch::optim::Adam> optimizer_;
};

std::string yaml(int slots, std::int64_t batches) {
  return "name: tensor-parallel\nentrypoint: ./tensor_parallel\nhyperparameters: {global_batch_size: 32, lr: 0.01}\n"
         "searcher: {name: single, metric: validation_loss, smaller_is_better: true, max_length: {batches: " +
         std::to_string(batches) + "}}\nmin_validation_period: {batches: 10}\nresources: {slots_per_trial: " +
         std::to_string(slots) + "}\n";
}

LoopResult train(comm::Communicator& comm, const std::string& dir, std::int64_t batches,
                 TensorParallelTrial::Options options) {
  LoopOptions loop;
  loop.trial_dir = dir + "/trial";
  loop.checkpoint_dir = dir + "/checkpoints";
  loop.progress_interval_s = 0;
  loop.experiment_seed = 3;
  loop.distributed = {comm.rank(), comm.size(), comm.rank(), comm.size(), 1};
  loop.external_stop = &rank::stop_signal_received();
  rank::install_stop_handlers();
  const TrialFactory factory = [&](TrialContext& context) {
    return std::unique_ptr<Trial>(std::make_unique<TensorParallelTrial>(context, options));
  };
  LoopResult result = run_training(config_from(yaml(comm.size(), batches)), factory, comm, loop);
  rank::clear_stop_signal();
  return result;
}

// The whole MLP's parameters (w1, b1, w2, b2) from each part's, gathered over the parts of this
// rank's replica.
std::vector<torch::Tensor> whole(comm::Communicator& world, const std::vector<torch::Tensor>& mine) {
  auto parts = world.split(world.rank() / kParts, world.rank() % kParts);
  std::vector<torch::Tensor> out;
  for (std::size_t i = 0; i < mine.size(); ++i) {
    if (i == 3) {
      out.push_back(mine[i]);  // b2: every part's
      continue;
    }
    const auto local = mine[i].contiguous();
    auto gathered = torch::empty({kParts * local.numel()});
    parts->allgather(local.data_ptr<float>(), gathered.data_ptr<float>(), static_cast<std::size_t>(local.numel()),
                     comm::DType::kFloat32);
    auto pieces = gathered.view({kParts, local.numel()});
    std::vector<torch::Tensor> each;
    for (int k = 0; k < kParts; ++k) each.push_back(pieces[k].view(local.sizes()));
    out.push_back(torch::cat(each, i == 2 ? 1 : 0));  // w2 is split by its inputs
  }
  return out;
}

TEST(ModelParallel, ATensorParallelTrialTrainsLikeTheWholeModelOnOneRank) {
  comm::MpiCommunicator world(env().world());
  const std::string dir = testing_mpi::shared_dir("hpctrial-model-parallel", "equivalence");
  std::vector<torch::Tensor> split, reference;
  TensorParallelTrial::Options options;
  options.parts = kParts;
  options.parameters_out = &split;
  const LoopResult parallel = train(world, dir, 30, options);
  comm::LocalCommunicator alone;
  TensorParallelTrial::Options whole_options;
  whole_options.parameters_out = &reference;
  const LoopResult one =
      train(alone, dir + "/reference-" + std::to_string(world.rank()), 30, whole_options);
  const auto gathered = whole(world, split);
  ASSERT_EQ(gathered.size(), reference.size());
  for (std::size_t i = 0; i < gathered.size(); ++i) {
    const double scale = reference[i].abs().max().item<double>() + 1e-12;
    EXPECT_LT((gathered[i] - reference[i]).abs().max().item<double>() / scale, 1e-6) << "parameter " << i;
  }
  EXPECT_NEAR(parallel.last_validation.at("validation_loss"), one.last_validation.at("validation_loss"), 1e-6);
  MPI_Barrier(env().world());
  if (env().is_chief()) std::filesystem::remove_all(dir);
}

// Stopped by SIGUSR2 after batch 12 on `stopping_rank`, then resumed to batch 30: the weights of
// an uninterrupted run, bit for bit.
void expect_bitwise_resume(int stopping_rank) {
  comm::MpiCommunicator world(env().world());
  const std::string dir = testing_mpi::shared_dir("hpctrial-model-parallel", "resume-" + std::to_string(stopping_rank));
  TensorParallelTrial::Options options;
  options.parts = kParts;
  std::vector<torch::Tensor> straight, resumed;
  options.parameters_out = &straight;
  train(world, dir + "/straight", 30, options);
  options.parameters_out = nullptr;
  options.signal_after = 12;
  options.signal_rank = stopping_rank;
  const LoopResult stopped = train(world, dir + "/stopped", 30, options);
  EXPECT_TRUE(stopped.stopped_early);
  EXPECT_LT(stopped.batches_trained, 30);
  if (env().is_chief()) {
    // Each part once, under its own prefix, and the number of parts.
    const auto contents = checkpoint::read_checkpoint(stopped.checkpoint_path);
    for (int part = 0; part < kParts; ++part) {
      const std::string prefix = "model_parallel/" + std::to_string(part) + "/";
      EXPECT_NE(contents.find(prefix + "model/0/w1"), nullptr) << prefix;
      EXPECT_NE(contents.find(prefix + "optimizer/0/type"), nullptr) << prefix;
    }
    EXPECT_EQ(contents.find("model/0/w1"), nullptr);
    EXPECT_EQ(nlohmann::json::parse(contents.at("meta/model_parallel", "").text()).at("parts"), kParts);
  }
  options.signal_after = -1;
  options.parameters_out = &resumed;
  const LoopResult finished = train(world, dir + "/stopped", 30, options);
  EXPECT_FALSE(finished.stopped_early);
  ASSERT_EQ(resumed.size(), straight.size());
  for (std::size_t i = 0; i < resumed.size(); ++i) EXPECT_TRUE(torch::equal(resumed[i], straight[i])) << "parameter " << i;

  // The same checkpoint without the unit: every rank would take a part for the whole model.
  options = {};
  options.parts = 1;
  try {
    train(world, dir + "/stopped", 40, options);
    ADD_FAILURE() << "a model split into parts was resumed as a whole";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), testing::HasSubstr("holds a model split into 2 parts"));
    EXPECT_THAT(e.what(), testing::HasSubstr("this run's model-parallel unit makes a model whole on every rank"));
  }
  MPI_Barrier(env().world());
  if (env().is_chief()) std::filesystem::remove_all(dir);
}

TEST(ModelParallel, AStopOnTheChiefResumesBitwise) { expect_bitwise_resume(0); }
TEST(ModelParallel, AStopOnTheLastRankResumesBitwise) { expect_bitwise_resume(env().size() - 1); }

TEST(ModelParallel, AUnitThatDoesNotFitTheRanksIsRefused) {
  comm::MpiCommunicator world(env().world());
  const std::string dir = testing_mpi::shared_dir("hpctrial-model-parallel", "refused");
  TensorParallelTrial::Options options;
  options.parts = kParts;
  options.replicas_given = 3;  // 3 replicas of 2 or 4 ranks
  try {
    train(world, dir, 10, options);
    ADD_FAILURE() << "a unit of 3 replicas was accepted on " << world.size() << " ranks";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), testing::HasSubstr("set_mpu on rank " + std::to_string(world.rank()) +
                                             ": data_parallel_world_size is 3, which does not divide the " +
                                             std::to_string(world.size()) + " ranks"));
  }
  MPI_Barrier(env().world());
  if (env().is_chief()) std::filesystem::remove_all(dir);
}

// The same MLP in an engine trial whose unit the trial sets (EngineTrialContext::set_mpu): the
// engine section is resolved over the replicas, gradients averaged and ZeRO-1 sharded over the
// data-parallel group.
class EngineTensorParallelTrial : public EngineTrial {
 public:
  struct Options {
    int parts = 1;
    std::vector<torch::Tensor>* parameters_out = nullptr;
    std::int64_t* micro_batch_out = nullptr;
    bool unit_after_wrap = false;
  };

  EngineTensorParallelTrial(EngineTrialContext& context, Options options)
      : context_(context), options_(options), split_(split_mlp(context.communicator(), options.parts)) {
    if (options.parts > 1 && !options.unit_after_wrap) context.set_mpu(split_.unit);
    model_ = TensorParallelMlp(split_.part, options.parts, split_.parts_group.get());
    auto optimizer = std::make_shared<torch::optim::Adam>(model_->parameters(),
                                                          torch::optim::AdamOptions(context.hparam<double>("lr")));
    engine_ = context.wrap_model_engine(std::make_shared<ModelEngine>(model_, optimizer));
    if (options.parts > 1 && options.unit_after_wrap) context.set_mpu(split_.unit);
    if (options.micro_batch_out != nullptr) *options.micro_batch_out = context.train_micro_batch_size_per_gpu();
  }
  ~EngineTensorParallelTrial() override {
    if (options_.parameters_out == nullptr) return;
    options_.parameters_out->clear();
    for (const auto& p : model_->parameters()) options_.parameters_out->push_back(p.detach().clone());
  }

  Metrics train_batch(DataIterator& data, std::int64_t, std::int64_t) override {
    const Batch batch = data.next();
    const auto loss = torch::mse_loss(model_->forward(batch.data), batch.target);
    engine_->backward(loss);
    engine_->step();
    return {{"loss", loss}};
  }
  Metrics evaluate_batch(DataIterator& data, std::int64_t) override {
    const Batch batch = data.next();
    return {{"validation_loss", torch::mse_loss(model_->forward(batch.data), batch.target)}};
  }
  DataLoader build_training_data_loader() override { return {split_.data, context_.train_micro_batch_size_per_gpu()}; }
  DataLoader build_validation_data_loader() override { return {split_.data, 64, false}; }

 private:
  EngineTrialContext& context_;
  Options options_;
  Split split_;
  TensorParallelMlp model_{nullptr};
  std::shared_ptr<ModelEngine> engine_;
};

LoopResult train_engine(comm::Communicator& comm, const std::string& dir, int zero,
                        EngineTensorParallelTrial::Options options) {
  LoopOptions loop;
  loop.trial_dir = dir + "/trial";
  loop.checkpoint_dir = dir + "/checkpoints";
  loop.progress_interval_s = 0;
  loop.experiment_seed = 3;
  loop.distributed = {comm.rank(), comm.size(), comm.rank(), comm.size(), 1};
  const TrialFactory factory = [options](TrialContext& context) {
    return std::unique_ptr<Trial>(std::make_unique<detail::EngineTrialRunner>(
        context, [options](EngineTrialContext& engine) { return std::make_unique<EngineTensorParallelTrial>(engine, options); }));
  };
  const std::string yaml =
      "name: tensor-parallel\nentrypoint: ./tensor_parallel\nhyperparameters: {lr: 0.01}\n"
      "engine: {train_batch_size: 32, gradient_accumulation_steps: 2, zero_optimization: {stage: " +
      std::to_string(zero) + ", stage3_param_persistence_threshold: 0}}\nsearcher: {name: single, metric: validation_loss, smaller_is_better: true, "
      "max_length: {batches: 20}}\nmin_validation_period: {batches: 10}\nresources: {slots_per_trial: " +
      std::to_string(comm.size()) + "}\n";
  return run_training(config_from(yaml), factory, comm, loop);
}

// On 2 ranks one replica of 2 parts (micro-batch 32 / (2 steps x 1 replica) = 16), on 4 two
// replicas with ZeRO-1 over them (micro-batch 8): within 1e-6 of the whole MLP on one rank.
TEST(ModelParallel, AnEngineTrialWithItsOwnUnitTrainsLikeTheWholeModelOnOneRank) {
  comm::MpiCommunicator world(env().world());
  const std::string dir = testing_mpi::shared_dir("hpctrial-model-parallel", "engine");
  const int replicas = world.size() / kParts;
  std::vector<torch::Tensor> split, reference;
  std::int64_t micro = 0;
  EngineTensorParallelTrial::Options options;
  options.parts = kParts;
  options.parameters_out = &split;
  options.micro_batch_out = &micro;
  const LoopResult parallel = train_engine(world, dir, replicas > 1 ? 1 : 0, options);
  EXPECT_EQ(micro, 32 / (2 * replicas));
  comm::LocalCommunicator alone;
  EngineTensorParallelTrial::Options whole_options;
  whole_options.parameters_out = &reference;
  const LoopResult one = train_engine(alone, dir + "/reference-" + std::to_string(world.rank()), 0, whole_options);
  const auto gathered = whole(world, split);
  ASSERT_EQ(gathered.size(), reference.size());
  for (std::size_t i = 0; i < gathered.size(); ++i) {
    const double scale = reference[i].abs().max().item<double>() + 1e-12;
    EXPECT_LT((gathered[i] - reference[i]).abs().max().item<double>() / scale, 1e-6) << "parameter " << i;
  }
  EXPECT_NEAR(parallel.last_validation.at("validation_loss"), one.last_validation.at("validation_loss"), 1e-6);

  // A unit set once an engine holds batch sizes over every rank is refused.
  options = {};
  options.parts = kParts;
  options.unit_after_wrap = true;
  try {
    train_engine(world, dir + "/late", 0, options);
    ADD_FAILURE() << "set_mpu after wrap_model_engine was accepted";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), testing::HasSubstr("call set_mpu before wrap_model_engine"));
  }
  MPI_Barrier(env().world());
  if (env().is_chief()) std::filesystem::remove_all(dir);
}

// A tensor-parallel run loaded on as many ranks, each its own part: the run's weights, bit for
// bit, and its evaluation; on one process, where the trial builds the model whole, refused.
TEST(LoadTrial, ATensorParallelCheckpointLoadsOnItsRanksAndEvaluatesAsTheRun) {
  comm::MpiCommunicator world(env().world());
  const std::string dir = testing_mpi::shared_dir("hpctrial-model-parallel", "load");
  std::vector<torch::Tensor> trained, loaded_parameters;
  TensorParallelTrial::Options options;
  options.parts = kParts;
  options.parameters_out = &trained;
  const LoopResult result = train(world, dir, 30, options);
  const auto factory = [](TensorParallelTrial::Options o) -> TrialFactory {
    return [o](TrialContext& context) { return std::unique_ptr<Trial>(std::make_unique<TensorParallelTrial>(context, o)); };
  };
  options.parameters_out = &loaded_parameters;
  {
    LoadOptions load;
    load.communicator = &world;
    const LoadedTrial loaded = load_trial_from_checkpoint(dir + "/checkpoints", factory(options), load);
    EXPECT_NEAR(testing_mpi::mean_evaluation(loaded, "validation_loss"),
                result.last_validation.at("validation_loss").number(), 1e-6);
  }
  ASSERT_EQ(loaded_parameters.size(), trained.size());
  for (std::size_t i = 0; i < trained.size(); ++i) EXPECT_TRUE(torch::equal(loaded_parameters[i], trained[i])) << i;
  if (env().is_chief()) {
    TensorParallelTrial::Options whole;
    try {
      load_trial_from_checkpoint(dir + "/checkpoints", factory(whole));
      ADD_FAILURE() << "a model of " << kParts << " parts loaded whole";
    } catch (const ConfigError& e) {
      EXPECT_THAT(e.what(), testing::HasSubstr("a model split into 2 parts"));
    }
  }
  MPI_Barrier(env().world());
  if (env().is_chief()) std::filesystem::remove_all(dir);
}

}  // namespace model_parallel_test
}  // namespace hpctrial::trainer
