// ZeRO's sharded optimizer step on 2 and 4 ranks: each rank keeps 1/N of the optimizer state,
// and the weights follow those of a replicated optimizer over averaged gradients (stage 0) for
// every element-wise LibTorch optimizer.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>

#include "../../trainer/src/zero.h"
#include "hpctrial/comm/communicator.h"
#include "hpctrial/core/error.h"
#include "mpi_test_env.h"

namespace hpctrial::trainer::detail {
namespace {

using testing::ElementsAre;
using testing::HasSubstr;
using testing_mpi::env;

TEST(FlatLayout, ShardsAreEqualAndPiecesCoverEveryParameterOnce) {
  const FlatLayout layout = flat_layout({6, 1, 5}, 4);  // 12 elements, shards of 3
  EXPECT_EQ(layout.total, 12);
  EXPECT_EQ(layout.shard, 3);
  EXPECT_THAT(layout.offsets, ElementsAre(0, 6, 7));
  const auto one = layout.pieces(2);  // elements 6..8: all of parameter 1, the first 2 of parameter 2
  ASSERT_EQ(one.size(), 2u);
  EXPECT_EQ(one[0].param, 1u);
  EXPECT_EQ(one[0].shard_offset, 0);
  EXPECT_EQ(one[0].length, 1);
  EXPECT_EQ(one[1].param, 2u);
  EXPECT_EQ(one[1].param_offset, 0);
  EXPECT_EQ(one[1].shard_offset, 1);
  EXPECT_EQ(one[1].length, 2);
  const FlatLayout padded = flat_layout({5}, 4);  // shards of 2: the last holds padding only
  EXPECT_EQ(padded.shard, 2);
  EXPECT_EQ(padded.pieces(2).size(), 1u);
  EXPECT_EQ(padded.pieces(2)[0].length, 1);
  EXPECT_TRUE(padded.pieces(3).empty());
  std::int64_t covered = 0;
  for (int r = 0; r < 4; ++r) {
    for (const auto& piece : layout.pieces(r)) covered += piece.length;
  }
  EXPECT_EQ(covered, layout.total);
}

struct NetImpl : torch::nn::Module {
  NetImpl() : a(register_module("a", torch::nn::Linear(7, 5))), b(register_module("b", torch::nn::Linear(5, 3))) {}
  torch::Tensor forward(const torch::Tensor& x) { return b->forward(torch::tanh(a->forward(x))); }
  torch::nn::Linear a, b;
};
TORCH_MODULE(Net);

using MakeOptimizer = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>)>;

// Trains `steps` steps on this rank's own batches and returns the final parameters.
std::vector<torch::Tensor> train(const MakeOptimizer& make, bool sharded, comm::Communicator& comm, int steps,
                                 std::int64_t* state_elements = nullptr) {
  torch::manual_seed(3);  // the same initial weights on every rank
  Net net;
  auto optimizer = make(net->parameters());
  std::unique_ptr<ShardedOptimizer> zero;
  if (sharded) zero = std::make_unique<ShardedOptimizer>(*optimizer, comm);
  for (int step = 0; step < steps; ++step) {
    torch::manual_seed(100 + 10 * step + comm.rank());  // each rank's own batch
    const auto x = torch::randn({4, 7});
    const auto y = torch::randn({4, 3});
    auto loss = torch::mse_loss(net->forward(x), y);
    if (zero) {
      zero->zero_grad();
    } else {
      optimizer->zero_grad();
    }
    loss.backward();
    if (zero) {
      zero->step();
    } else {
      for (auto& p : net->parameters()) {
        comm.allreduce(p.grad().data_ptr(), static_cast<std::size_t>(p.numel()), comm::DType::kFloat32,
                       comm::ReduceOp::kAvg);
      }
      optimizer->step();
    }
  }
  if (state_elements != nullptr) {
    *state_elements = 0;
    for (const auto& [key, state] : optimizer->state()) {
      if (auto* adam = dynamic_cast<torch::optim::AdamParamState*>(state.get())) {
        *state_elements += adam->exp_avg().numel() + adam->exp_avg_sq().numel();
      }
    }
  }
  std::vector<torch::Tensor> out;
  for (const auto& p : net->parameters()) out.push_back(p.detach().clone());
  return out;
}

TEST(ShardedOptimizer, EveryElementwiseOptimizerFollowsTheReplicatedOne) {
  comm::MpiCommunicator comm(env().world());
  const std::vector<std::pair<std::string, MakeOptimizer>> optimizers = {
      {"sgd", [](std::vector<torch::Tensor> p) -> std::unique_ptr<torch::optim::Optimizer> {
         return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.01));
       }},
      {"adam", [](std::vector<torch::Tensor> p) -> std::unique_ptr<torch::optim::Optimizer> {
         return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(0.01));
       }},
      {"adamw", [](std::vector<torch::Tensor> p) -> std::unique_ptr<torch::optim::Optimizer> {
         return std::make_unique<torch::optim::AdamW>(p, torch::optim::AdamWOptions(0.01).weight_decay(0.1));
       }},
      {"adagrad", [](std::vector<torch::Tensor> p) -> std::unique_ptr<torch::optim::Optimizer> {
         return std::make_unique<torch::optim::Adagrad>(p, torch::optim::AdagradOptions(0.1).initial_accumulator_value(0.5));
       }},
      {"rmsprop", [](std::vector<torch::Tensor> p) -> std::unique_ptr<torch::optim::Optimizer> {
         return std::make_unique<torch::optim::RMSprop>(p, torch::optim::RMSpropOptions(0.01).momentum(0.5));
       }},
  };
  for (const auto& [name, make] : optimizers) {
    const auto replicated = train(make, false, comm, 6);
    const auto sharded = train(make, true, comm, 6);
    ASSERT_EQ(sharded.size(), replicated.size());
    for (std::size_t i = 0; i < replicated.size(); ++i) {
      EXPECT_TRUE(torch::allclose(sharded[i], replicated[i], /*rtol=*/1e-6, /*atol=*/1e-7))
          << name << ": parameter " << i << " differs by "
          << (sharded[i] - replicated[i]).abs().max().item<float>();
    }
  }
}

TEST(ShardedOptimizer, EachRankKeepsItsShareOfTheState) {
  comm::MpiCommunicator comm(env().world());
  const MakeOptimizer adam = [](std::vector<torch::Tensor> p) -> std::unique_ptr<torch::optim::Optimizer> {
    return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(0.01));
  };
  std::int64_t replicated = 0, sharded = 0;
  train(adam, false, comm, 1, &replicated);
  train(adam, true, comm, 1, &sharded);
  const std::int64_t parameters = 7 * 5 + 5 + 5 * 3 + 3;  // 58
  EXPECT_EQ(replicated, 2 * parameters);
  EXPECT_EQ(sharded, 2 * ((parameters + comm.size() - 1) / comm.size()));
}

TEST(ShardedOptimizer, LbfgsIsRefused) {
  comm::MpiCommunicator comm(env().world());
  Net net;
  torch::optim::LBFGS lbfgs(net->parameters());
  try {
    ShardedOptimizer zero(lbfgs, comm);
    ADD_FAILURE() << "LBFGS was sharded";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("LBFGS's state is not per element"));
  }
}

TEST(ShardedOptimizer, AParameterThatIsNotFloat32IsRefused) {
  comm::MpiCommunicator comm(env().world());
  torch::nn::Linear layer(3, 2);
  layer->to(torch::kFloat64);
  torch::optim::SGD sgd(layer->parameters(), 0.1);
  try {
    ShardedOptimizer zero(sgd, comm);
    ADD_FAILURE() << "a double parameter was sharded";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("parameter 0 of optimizer group 0 is Double"));
    EXPECT_THAT(e.what(), HasSubstr("build the model in float32"));
  }
}

}  // namespace
}  // namespace hpctrial::trainer::detail
