// Gradient averaging through the TrialContext on 2 and 4 ranks: the mean after one backward,
// after loss.backward() called directly, after two backward passes in one batch (with and
// without zeroing between), across batches when gradients are not zeroed; buckets start while
// backward still runs; and mixing the two kinds of backward is a clear error.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <atomic>
#include <functional>
#include <vector>

#include "hpctrial/core/error.h"
#include "hpctrial/comm/communicator.h"
#include "hpctrial/trainer.h"
#include "mpi_test_env.h"

namespace hpctrial {
namespace gradient_sync_test {  // named: the target compiles its sources together (UNITY_BUILD)

using testing::HasSubstr;
using testing_mpi::env;

// Counts the async all-reduces that pass through it.
class CountingCommunicator final : public comm::Communicator {
 public:
  explicit CountingCommunicator(comm::Communicator& inner) : inner_(inner) {}
  using Communicator::allreduce;
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  comm::WorkHandle allreduce_async(void* data, std::size_t count, comm::DType dtype,
                                           comm::ReduceOp op) override {
    ++launched;
    return inner_.allreduce_async(data, count, dtype, op);
  }
  comm::WorkHandle broadcast_async(void* data, std::size_t bytes, int root) override {
    return inner_.broadcast_async(data, bytes, root);
  }
  comm::WorkHandle reduce_scatter_async(const void* send, void* recv, std::size_t count, comm::DType dtype,
                                        comm::ReduceOp op) override {
    return inner_.reduce_scatter_async(send, recv, count, dtype, op);
  }
  comm::WorkHandle allgather_async(const void* send, void* recv, std::size_t count, comm::DType dtype) override {
    return inner_.allgather_async(send, recv, count, dtype);
  }
  comm::WorkHandle send_async(const void* data, std::size_t count, comm::DType dtype, int peer) override {
    return inner_.send_async(data, count, dtype, peer);
  }
  comm::WorkHandle recv_async(void* data, std::size_t count, comm::DType dtype, int peer) override {
    return inner_.recv_async(data, count, dtype, peer);
  }
  void broadcast(std::string& bytes, int root) override { inner_.broadcast(bytes, root); }
  using Communicator::allgather;
  std::vector<std::string> allgather(const std::string& bytes) override { return inner_.allgather(bytes); }
  std::vector<std::string> gather(const std::string& bytes, int root) override { return inner_.gather(bytes, root); }
  void barrier() override { inner_.barrier(); }
  std::unique_ptr<comm::Communicator> split(int color, int key) override { return inner_.split(color, key); }
  std::atomic<int> launched{0};

 private:
  comm::Communicator& inner_;
};

class GradientSyncTest : public testing::Test {
 protected:
  GradientSyncTest() : world_(env().world()), comm_(world_) {}

  std::unique_ptr<TrialContext> make_context(double bucket_cap_mb = 25,
                                             core::GradientCompression compression = core::GradientCompression::kNone) {
    trainer::TrialSettings settings;
    settings.hparams = {{"global_batch_size", 2 * world_.size()}};
    settings.bucket_cap_mb = bucket_cap_mb;
    settings.gradient_compression = compression;
    settings.distributed = {world_.rank(), world_.size(), world_.rank(), world_.size(), 1};
    auto context = std::make_unique<TrialContext>(settings, comm_);
    model_ = context->wrap_model(torch::nn::Linear(3, 2));
    optimizer_ = context->wrap_optimizer(
        std::make_shared<torch::optim::SGD>(model_->parameters(), torch::optim::SGDOptions(0.0)));
    context->broadcast_model_state();  // as the loop does on a fresh start
    context->start_training();
    return context;
  }

  // This rank's loss: a sum over a batch of two rows of (rank + 1) x scale: the weight gradient
  // is 2 (rank + 1) x scale everywhere, the bias gradient 2.
  torch::Tensor loss(float scale = 1.0f) {
    return model_->forward(torch::full({2, 3}, static_cast<float>(world_.rank() + 1) * scale)).sum();
  }
  // The mean over ranks of that weight gradient.
  double mean_weight_gradient() const { return static_cast<double>(world_.size() + 1); }

  // Steps and returns the weight gradient the optimizer saw (captured after averaging).
  double step(TrialContext& context, bool zero = true) {
    double seen = -1;
    context.step_optimizer(*optimizer_, [&](std::vector<torch::Tensor>& parameters) {
      seen = parameters.front().grad().mean().item<double>();
    }, zero);
    return seen;
  }

  comm::MpiCommunicator world_;
  CountingCommunicator comm_;
  torch::nn::Linear model_{nullptr};
  std::shared_ptr<torch::optim::SGD> optimizer_;
};

TEST_F(GradientSyncTest, OneBackwardGivesTheMeanOverRanks) {
  auto context = make_context();
  context->set_loop_position(true, false, 0);
  context->backward(loss());
  EXPECT_DOUBLE_EQ(step(*context), mean_weight_gradient());
  EXPECT_DOUBLE_EQ(model_->bias.grad().sum().item<double>(), 0.0) << "not zeroed after the step";
  context->set_loop_position(false, false, 1);
  context->backward(loss());
  EXPECT_DOUBLE_EQ(step(*context), mean_weight_gradient());
}

TEST_F(GradientSyncTest, LossBackwardCalledDirectlyIsAveragedToo) {
  auto context = make_context();
  context->set_loop_position(true, false, 0);
  loss().backward();
  EXPECT_DOUBLE_EQ(step(*context), mean_weight_gradient());
}

TEST_F(GradientSyncTest, TwoBackwardPassesInOneBatch) {
  auto context = make_context();
  context->set_loop_position(true, false, 0);
  context->backward(loss());
  EXPECT_DOUBLE_EQ(step(*context), mean_weight_gradient());
  context->backward(loss());  // zeroed in between: the mean of the second pass alone
  EXPECT_DOUBLE_EQ(step(*context, /*zero=*/false), mean_weight_gradient());
  context->backward(2 * loss());  // not zeroed: the earlier mean plus this one's
  EXPECT_DOUBLE_EQ(step(*context), 3 * mean_weight_gradient());
}

TEST_F(GradientSyncTest, GradientsKeptAcrossBatchesAccumulateMeans) {
  auto context = make_context();
  context->set_loop_position(true, false, 0);
  context->backward(loss());
  EXPECT_DOUBLE_EQ(step(*context, /*zero=*/false), mean_weight_gradient());
  context->set_loop_position(false, false, 1);
  context->backward(loss());
  EXPECT_DOUBLE_EQ(step(*context), 2 * mean_weight_gradient());
}

TEST_F(GradientSyncTest, CompressionRoundsToItsSixteenBits) {
  // 1 + 2^-10 is a float16 but not a bfloat16: float16 keeps it to within its precision,
  // bfloat16 rounds it away - both within a few roundings (one per rank and partial sum) of the
  // exact mean.
  const float value = 1.0f + 1.0f / 1024;
  const double exact = mean_weight_gradient() * value;
  for (auto [compression, precision] : {std::pair{core::GradientCompression::kFloat16, 1.0 / 1024},
                                        std::pair{core::GradientCompression::kBFloat16, 1.0 / 128}}) {
    auto context = make_context(25, compression);
    context->set_loop_position(true, false, 0);
    context->backward(loss(value));
    const double seen = step(*context);
    EXPECT_LE(std::abs(seen - exact) / exact, precision) << core::to_string(compression);
    if (compression == core::GradientCompression::kBFloat16) {
      EXPECT_NE(seen, exact) << "bf16 rounded nothing";
    }
  }
}

TEST_F(GradientSyncTest, MixingBothKindsOfBackwardIsAClearError) {
  auto context = make_context();
  context->set_loop_position(true, false, 0);
  context->backward(loss());
  loss().backward();
  try {
    step(*context);
    ADD_FAILURE() << "mixed backward passes were accepted";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("call context.backward for every backward pass"));
  }
}

TEST_F(GradientSyncTest, BucketsStartWhileBackwardStillRuns) {
  // Two layers, a bucket per parameter: the second layer's gradients come first in backward,
  // and their all-reduce must have started before backward reaches the first layer.
  trainer::TrialSettings settings;
  settings.hparams = {{"global_batch_size", 2 * world_.size()}};
  settings.bucket_cap_mb = 1e-6;
  settings.distributed = {world_.rank(), world_.size(), world_.rank(), world_.size(), 1};
  TrialContext context(settings, comm_);
  auto first = context.wrap_model(torch::nn::Linear(3, 4));
  auto second = context.wrap_model(torch::nn::Linear(4, 1));
  auto optimizer = context.wrap_optimizer(std::make_shared<torch::optim::SGD>(
      std::vector<torch::Tensor>{first->weight, first->bias, second->weight, second->bias}, torch::optim::SGDOptions(0.1)));
  context.broadcast_model_state();
  context.start_training();
  int launched_when_first_layer_reached = -1;
  first->weight.register_hook([&](const torch::Tensor& grad) {
    launched_when_first_layer_reached = comm_.launched.load();
    return grad;
  });
  context.set_loop_position(true, false, 0);
  const int before = comm_.launched.load();
  context.backward(second->forward(torch::relu(first->forward(torch::ones({2, 3})))).sum());
  EXPECT_GE(launched_when_first_layer_reached - before, 2) << "no bucket started before backward finished";
  EXPECT_EQ(comm_.launched.load() - before, 4);  // one per parameter
  context.step_optimizer(*optimizer);
}

// What each parameter's gradient is, averaged over the ranks, when every rank r runs
// `local(r, weight, bias)` on leaf copies of the model's parameters.
std::vector<torch::Tensor> reference_mean(const torch::nn::Linear& model, int ranks,
                                          const std::function<void(int, torch::Tensor&, torch::Tensor&)>& local) {
  std::vector<torch::Tensor> mean = {torch::zeros_like(model->weight), torch::zeros_like(model->bias)};
  for (int r = 0; r < ranks; ++r) {
    auto weight = model->weight.detach().clone().requires_grad_(true);
    auto bias = model->bias.detach().clone().requires_grad_(true);
    local(r, weight, bias);
    mean[0] += weight.grad().detach() / ranks;
    mean[1] += bias.grad().detach() / ranks;
  }
  return mean;
}

std::vector<torch::Tensor> step_and_capture(TrialContext& context, torch::optim::Optimizer& optimizer) {
  std::vector<torch::Tensor> seen;
  context.step_optimizer(optimizer, [&](std::vector<torch::Tensor>& parameters) {
    for (const auto& p : parameters) seen.push_back(p.grad().detach().clone());
  });
  return seen;
}

torch::Tensor input_of(int rank) { return torch::full({2, 3}, static_cast<float>(rank + 1)); }

TEST_F(GradientSyncTest, ANonScalarLossTakesItsGradient) {
  auto context = make_context();
  context->set_loop_position(true, false, 0);
  const torch::Tensor outputs = model_->forward(input_of(world_.rank()));  // [2, 2]
  context->backward(outputs, torch::ones_like(outputs));
  EXPECT_DOUBLE_EQ(step(*context), mean_weight_gradient());
}

TEST_F(GradientSyncTest, RetainGraphGoesThroughTheGraphTwice) {
  auto context = make_context();
  context->set_loop_position(true, false, 0);
  const torch::Tensor l = loss();
  context->backward(l, {}, /*retain_graph=*/true);
  context->backward(l);
  EXPECT_DOUBLE_EQ(step(*context), 2 * mean_weight_gradient());
}

TEST_F(GradientSyncTest, CreateGraphLeavesTheRanksOwnDifferentiableGradientsAndAveragesThemAtTheStep) {
  // A second backward through the gradients (a Hessian-vector product): the step sees the mean
  // over ranks of gradient + d|gradient|^2/dparameters.
  auto context = make_context();
  const auto local = [](int rank, torch::Tensor& weight, torch::Tensor& bias) {
    torch::nn::functional::linear(input_of(rank), weight, bias).pow(2).sum().backward({}, true, true);
    weight.grad().pow(2).sum().backward();
  };
  const auto expected = reference_mean(model_, world_.size(), local);
  torch::Tensor own_weight = model_->weight.detach().clone().requires_grad_(true);
  torch::Tensor own_bias = model_->bias.detach().clone().requires_grad_(true);
  torch::nn::functional::linear(input_of(world_.rank()), own_weight, own_bias).pow(2).sum().backward();

  context->set_loop_position(true, false, 0);
  context->backward(model_->forward(input_of(world_.rank())).pow(2).sum(), {}, {}, /*create_graph=*/true);
  ASSERT_TRUE(model_->weight.grad().requires_grad()) << "the gradient lost its graph";
  EXPECT_TRUE(torch::allclose(model_->weight.grad(), own_weight.grad())) << "not this rank's own gradient";
  context->backward(model_->weight.grad().pow(2).sum());
  const auto seen = step_and_capture(*context, *optimizer_);
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_TRUE(torch::allclose(seen[0], expected[0], 1e-5, 1e-4)) << seen[0] << expected[0];
  EXPECT_TRUE(torch::allclose(seen[1], expected[1], 1e-5, 1e-4)) << seen[1] << expected[1];

  // The next step is an ordinary one again, averaged while backward runs.
  context->set_loop_position(false, false, 1);
  const int before = comm_.launched.load();
  context->backward(loss());
  EXPECT_GT(comm_.launched.load(), before);
  EXPECT_DOUBLE_EQ(step(*context), mean_weight_gradient());
}

TEST_F(GradientSyncTest, AGradientPenaltyFromAutogradGradIsAveraged) {
  // WGAN-GP's form: the penalty's gradients come from torch::autograd::grad(create_graph), and
  // one context.backward of loss + penalty.
  auto context = make_context();
  const auto penalised = [](const torch::Tensor& input, const torch::Tensor& weight, const torch::Tensor& bias) {
    const auto input_leaf = input.clone().requires_grad_(true);
    const auto out = torch::nn::functional::linear(input_leaf, weight, bias).pow(2).sum();
    const auto grad = torch::autograd::grad({out}, {input_leaf}, {}, true, true)[0];
    return out + grad.pow(2).sum();
  };
  const auto expected = reference_mean(model_, world_.size(), [&](int rank, torch::Tensor& w, torch::Tensor& b) {
    penalised(input_of(rank), w, b).backward();
  });
  context->set_loop_position(true, false, 0);
  context->backward(penalised(input_of(world_.rank()), model_->weight, model_->bias));
  const auto seen = step_and_capture(*context, *optimizer_);
  EXPECT_TRUE(torch::allclose(seen[0], expected[0], 1e-5, 1e-4)) << seen[0] << expected[0];
  EXPECT_TRUE(torch::allclose(seen[1], expected[1], 1e-5, 1e-4)) << seen[1] << expected[1];
}

TEST_F(GradientSyncTest, CreateGraphAfterAnOrdinaryBackwardInTheStepIsAClearError) {
  auto context = make_context();
  context->set_loop_position(true, false, 0);
  context->backward(loss());
  try {
    context->backward(loss(), {}, {}, /*create_graph=*/true);
    ADD_FAILURE() << "accepted";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("make the create_graph backward the first of the step"));
  }
}

}  // namespace gradient_sync_test
}  // namespace hpctrial
