// Optimizer state survives a checkpoint file for every LibTorch optimizer: an optimizer
// restored from the file takes the same next steps as the one that never stopped.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <torch/torch.h>

#include "state/state_io.h"
#include "../../support/temp_dir.h"
#include "hpctrial/checkpoint/format.h"
#include "hpctrial/core/error.h"

namespace hpctrial::trainer::detail {
namespace optimizer_state_test {  // named: the target compiles its sources together (UNITY_BUILD)

using testing_support::TempDir;

using Factory = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>)>;

torch::nn::Linear make_model() {
  torch::manual_seed(3);
  return torch::nn::Linear(5, 3);
}

void train(torch::nn::Linear& model, torch::optim::Optimizer& optimizer, int steps, int seed) {
  torch::manual_seed(seed);
  for (int i = 0; i < steps; ++i) {
    const auto x = torch::randn({8, 5});
    auto closure = [&] {
      optimizer.zero_grad();
      auto loss = model->forward(x).pow(2).mean();
      loss.backward();
      return loss;
    };
    optimizer.step(closure);
  }
}

class OptimizerState : public testing::TestWithParam<std::pair<const char*, Factory>> {};

TEST_P(OptimizerState, RestoredFromAFileStepsLikeTheOriginal) {
  const Factory& make = GetParam().second;
  auto model = make_model();
  auto optimizer = make(model->parameters());
  train(model, *optimizer, 4, 10);

  TempDir dir;
  const std::string path = (dir.path() / "opt.h5").string();
  checkpoint::Contents contents;
  for (const auto& item : model->named_parameters()) add_tensor(contents, "model/0/" + item.key(), item.value());
  save_optimizer(contents, "optimizer/0", *optimizer);
  checkpoint::write_checkpoint(path, contents);

  auto copy = make_model();
  auto restored = make(copy->parameters());
  const checkpoint::Contents read = checkpoint::read_checkpoint(path);
  for (auto& item : copy->named_parameters()) load_into(read, "model/0/" + item.key(), item.value(), path);
  load_optimizer(read, "optimizer/0", *restored, path);

  train(model, *optimizer, 3, 20);
  train(copy, *restored, 3, 20);
  const auto a = model->parameters(), b = copy->parameters();
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(torch::equal(a[i], b[i])) << GetParam().first << ": parameter " << i << " differs";
  }
}

template <typename O, typename Options>
Factory factory(Options options) {
  return [options](std::vector<torch::Tensor> params) -> std::unique_ptr<torch::optim::Optimizer> {
    return std::make_unique<O>(params, options);
  };
}

INSTANTIATE_TEST_SUITE_P(
    EveryLibTorchOptimizer, OptimizerState,
    testing::Values(
        std::pair{"sgd", factory<torch::optim::SGD>(torch::optim::SGDOptions(0.1).momentum(0.9).nesterov(true))},
        std::pair{"adam", factory<torch::optim::Adam>(torch::optim::AdamOptions(0.01).amsgrad(true))},
        std::pair{"adamw", factory<torch::optim::AdamW>(torch::optim::AdamWOptions(0.01))},
        std::pair{"adagrad", factory<torch::optim::Adagrad>(torch::optim::AdagradOptions(0.1))},
        std::pair{"rmsprop", factory<torch::optim::RMSprop>(torch::optim::RMSpropOptions(0.01).momentum(0.5).centered(true))},
        std::pair{"lbfgs", factory<torch::optim::LBFGS>(torch::optim::LBFGSOptions(0.5).history_size(3).max_iter(4))}),
    [](const auto& info) { return std::string(info.param.first); });

TEST(OptimizerState, AnotherOptimizerTypeIsRefused) {
  auto model = make_model();
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1));
  checkpoint::Contents contents;
  save_optimizer(contents, "optimizer/0", sgd);
  torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(0.1));
  try {
    load_optimizer(contents, "optimizer/0", adam, "ckpt.h5");
    ADD_FAILURE() << "an SGD state was loaded into Adam";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), testing::HasSubstr("ckpt.h5: optimizer/0 was a sgd optimizer and is now adam"));
  }
}

}  // namespace optimizer_state_test
}  // namespace hpctrial::trainer::detail
