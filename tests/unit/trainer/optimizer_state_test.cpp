// Optimizer state survives a checkpoint file for every LibTorch optimizer: an optimizer
// restored from the file takes the same next steps as the one that never stopped.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <torch/torch.h>

#include "state/state_io.h"
#include "hpctrial/trainer/lr_schedulers.h"
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

// The options of every param group go to another optimizer of the type through their text:
// the learning rate and every other hyperparameter, as hooks on the chief change them.
TEST_P(OptimizerState, OptionsTextCarriesEveryHyperparameter) {
  const Factory& make = GetParam().second;
  auto model = make_model();
  auto changed = make(model->parameters());
  changed->param_groups()[0].options().set_lr(0.0123);
  auto other = make(model->parameters());
  const std::string text = optimizer_options_text(*changed);
  EXPECT_NE(optimizer_options_text(*other), text);
  load_optimizer_options_text(*other, text, "optimizer 0");
  EXPECT_EQ(other->param_groups()[0].options().get_lr(), 0.0123);
  EXPECT_EQ(optimizer_options_text(*other), text);
}

std::string fingerprint(torch::optim::Optimizer& optimizer) {
  std::string bytes;
  append_optimizer_options_fingerprint(optimizer, bytes);
  return bytes;
}

// The bytes compared around hooks on the chief change with every field of the options text: each
// field of the text is changed in turn (a number, a flag, a value that may be absent) and loaded
// into an optimizer of the type, whose fingerprint then differs from the unchanged one's.
TEST_P(OptimizerState, TheFingerprintChangesWithEveryFieldOfTheOptionsText) {
  const Factory& make = GetParam().second;
  auto model = make_model();
  auto reference = make(model->parameters());
  EXPECT_EQ(fingerprint(*make(model->parameters())), fingerprint(*reference)) << "the same options, the same bytes";
  const nlohmann::json text = nlohmann::json::parse(optimizer_options_text(*reference));
  const nlohmann::json& group = text.at("groups").at(0);
  ASSERT_GE(group.size(), 5u) << text.dump();
  for (const auto& [key, value] : group.items()) {
    nlohmann::json changed = text;
    nlohmann::json& field = changed["groups"][0][key];
    if (value.is_boolean()) field = !value.get<bool>();
    else if (value.is_number_integer()) field = value.get<std::int64_t>() + 1;
    else if (value.is_number()) field = value.get<double>() + 0.125;
    else if (value.is_array()) field[0] = value[0].get<double>() * 0.5;  // betas
    else if (value.is_null()) field = key == "line_search_fn" ? nlohmann::json("strong_wolfe") : nlohmann::json(7);
    else field = nullptr;
    auto other = make(model->parameters());
    load_optimizer_options_text(*other, changed.dump(), "optimizer 0");
    EXPECT_NE(optimizer_options_text(*other), text.dump()) << key;
    EXPECT_NE(fingerprint(*other), fingerprint(*reference)) << GetParam().first << ": " << key << " changed";
  }
}

TEST(OptimizerState, OptionsTextCarriesMomentumAndRefusesAnotherType) {
  auto model = make_model();
  torch::optim::SGD chiefs(model->parameters(), torch::optim::SGDOptions(0.5).momentum(0.9).nesterov(true).weight_decay(0.01));
  torch::optim::SGD mine(model->parameters(), torch::optim::SGDOptions(0.1));
  load_optimizer_options_text(mine, optimizer_options_text(chiefs), "optimizer 0");
  const auto& options = static_cast<const torch::optim::SGDOptions&>(mine.param_groups()[0].options());
  EXPECT_EQ(options.lr(), 0.5);
  EXPECT_EQ(options.momentum(), 0.9);
  EXPECT_TRUE(options.nesterov());
  EXPECT_EQ(options.weight_decay(), 0.01);
  torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(0.1));
  try {
    load_optimizer_options_text(adam, optimizer_options_text(chiefs), "optimizer 0 changed on the chief");
    ADD_FAILURE() << "SGD options were loaded into Adam";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), testing::HasSubstr("optimizer 0 changed on the chief is a sgd optimizer of 1 parameter "
                                             "groups there and a adam optimizer of 1 here"));
  }
}

// An optimizer class of the trial's own: its options travel as LibTorch's archive.
class PlainDescent : public torch::optim::Optimizer {
 public:
  PlainDescent(std::vector<torch::Tensor> params, double lr)
      : Optimizer({torch::optim::OptimizerParamGroup(std::move(params))}, std::make_unique<torch::optim::SGDOptions>(lr)) {}
  torch::Tensor step(LossClosure) override {
    torch::NoGradGuard no_grad;
    for (auto& group : param_groups()) {
      for (auto& p : group.params()) {
        if (p.grad().defined()) p.add_(p.grad(), -group.options().get_lr());
      }
    }
    return {};
  }
};

TEST(OptimizerState, OptionsTextOfAnotherOptimizerClassRoundTrips) {
  auto model = make_model();
  PlainDescent chiefs(model->parameters(), 0.25);
  PlainDescent mine(model->parameters(), 0.1);
  load_optimizer_options_text(mine, optimizer_options_text(chiefs), "optimizer 0");
  EXPECT_EQ(mine.param_groups()[0].options().get_lr(), 0.25);
}

// Options that cannot serialize themselves (LibTorch's default throws): the learning rate travels.
struct LrOnlyOptions : torch::optim::OptimizerCloneableOptions<LrOnlyOptions> {
  explicit LrOnlyOptions(double lr) : lr(lr) {}
  double get_lr() const override { return lr; }
  void set_lr(const double value) override { lr = value; }
  double lr;
};

class LrOnlyDescent : public torch::optim::Optimizer {
 public:
  LrOnlyDescent(std::vector<torch::Tensor> params, double lr)
      : Optimizer({torch::optim::OptimizerParamGroup(std::move(params))}, std::make_unique<LrOnlyOptions>(lr)) {}
  torch::Tensor step(LossClosure) override { return {}; }
};

TEST(OptimizerState, OptionsThatCannotSerializeThemselvesGiveTheirLearningRate) {
  auto model = make_model();
  LrOnlyDescent chiefs(model->parameters(), 0.25);
  LrOnlyDescent mine(model->parameters(), 0.1);
  load_optimizer_options_text(mine, optimizer_options_text(chiefs), "optimizer 0");
  EXPECT_EQ(mine.param_groups()[0].options().get_lr(), 0.25);
}

// PyTorch's ReduceLROnPlateau, worked by hand: mode min, factor 0.5, patience 1, cooldown 1,
// threshold 0.1 relative (better: below 0.9 x best).
TEST(ReduceLROnPlateau, StepsAsPyTorchsDoes) {
  auto model = make_model();
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(1.0));
  ReduceLROnPlateauOptions options;
  options.factor = 0.5;
  options.patience = 1;
  options.cooldown = 1;
  options.threshold = 0.1;
  ReduceLROnPlateau reduce(sgd, options);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  // metric: best, bad epochs after the step, the rate after it
  // 10: best 10 | 9.5: not below 9, bad 1 | 9.2: bad 2 > 1: halve, cooldown 1 | 8.0: best 8, in
  // cooldown | 8.0: not below 7.2, bad 1 | 8.0: bad 2: halve | NaN: bad 1, cooldown zeroes it |
  // 8.0: bad 1 | 8.0: bad 2: halve.
  const std::vector<double> metrics = {10, 9.5, 9.2, 8.0, 8.0, 8.0, nan, 8.0, 8.0};
  const std::vector<double> rates = {1, 1, 0.5, 0.5, 0.5, 0.25, 0.25, 0.25, 0.125};
  for (std::size_t i = 0; i < metrics.size(); ++i) {
    reduce.step(metrics[i]);
    EXPECT_EQ(sgd.param_groups()[0].options().get_lr(), rates[i]) << "after step " << i + 1;
  }
  EXPECT_EQ(reduce.best(), 8.0);
  EXPECT_EQ(reduce.last_epoch(), 9);
}

// min_lr bounds the rate; a change smaller than eps is not made. Mode max with an absolute threshold.
TEST(ReduceLROnPlateau, MinLrBoundsTheRateAndModeMaxWantsHigher) {
  auto model = make_model();
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(1.0));
  ReduceLROnPlateauOptions options;
  options.mode = "max";
  options.patience = 0;
  options.threshold_mode = "abs";
  options.threshold = 0.5;
  options.min_lr = {0.05};
  ReduceLROnPlateau reduce(sgd, options);
  const std::vector<double> metrics = {1.0, 1.4, 2.0, 1.0, 1.0};  // 1.4 is not above 1.5
  const std::vector<double> rates = {1.0, 0.1, 0.1, 0.05, 0.05};
  for (std::size_t i = 0; i < metrics.size(); ++i) {
    reduce.step(metrics[i]);
    EXPECT_DOUBLE_EQ(sgd.param_groups()[0].options().get_lr(), rates[i]) << "after step " << i + 1;
  }
}

// The state of a scheduler that never stepped holds an infinite best: it round-trips through JSON.
TEST(ReduceLROnPlateau, StateRoundTripsAndBadOptionsAreRefused) {
  auto model = make_model();
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(1.0));
  ReduceLROnPlateau fresh(sgd);
  const nlohmann::json state = nlohmann::json::parse(fresh.state_dict().dump());
  EXPECT_EQ(state.at("best"), "Infinity");
  ReduceLROnPlateau stepped(sgd);
  stepped.step(3.0);
  stepped.load_state_dict(state);
  EXPECT_EQ(stepped.best(), std::numeric_limits<double>::infinity());
  EXPECT_EQ(stepped.last_epoch(), 0);
  EXPECT_THROW(stepped.load_state_dict(nlohmann::json{{"best", 1.0}}), std::invalid_argument);
  ReduceLROnPlateauOptions options;
  options.factor = 1.0;
  EXPECT_THROW(ReduceLROnPlateau(sgd, options), std::invalid_argument);
  options.factor = 0.1;
  options.min_lr = {0.1, 0.2};
  EXPECT_THROW(ReduceLROnPlateau(sgd, options), std::invalid_argument);
}

}  // namespace optimizer_state_test
}  // namespace hpctrial::trainer::detail
