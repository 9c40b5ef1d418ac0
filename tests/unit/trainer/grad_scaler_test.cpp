// GradScaler's arithmetic: unscaling, the skip on inf and NaN, back-off with hysteresis and a
// floor, growth after the window, a static scale, and its state.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <cmath>
#include <limits>

#include "hpctrial/core/error.h"
#include "hpctrial/trainer/grad_scaler.h"

namespace hpctrial::trainer {
namespace grad_scaler_test {  // named: the target compiles its sources together (UNITY_BUILD)

using testing::HasSubstr;

// One parameter whose gradient is set by hand.
struct Fixture {
  torch::Tensor weight = torch::zeros({4}, torch::requires_grad());
  torch::optim::SGD optimizer{{weight}, torch::optim::SGDOptions(0.1)};
  void set_grad(const torch::Tensor& grad) { weight.mutable_grad() = grad.clone(); }
};

// One iteration: gradients `bad` (inf) or finite, unscaled, then the update.
bool iterate(GradScaler& scaler, Fixture& f, bool bad) {
  f.set_grad(bad ? torch::full({4}, std::numeric_limits<float>::infinity()) : torch::ones({4}) * scaler.get_scale());
  const bool found = scaler.unscale(f.optimizer);
  scaler.update();
  return found;
}

TEST(GradScaler, ScalesTheLossAndUnscalesTheGradients) {
  GradScaler scaler;  // PyTorch's defaults
  EXPECT_EQ(scaler.get_scale(), 65536.0);
  EXPECT_EQ(scaler.scale(torch::tensor(0.5f)).item<float>(), 32768.0f);
  Fixture f;
  f.set_grad(torch::tensor({65536.0f, -131072.0f, 0.0f, 3.0f * 65536.0f}));
  EXPECT_FALSE(scaler.unscale(f.optimizer));
  EXPECT_TRUE(torch::equal(f.weight.grad(), torch::tensor({1.0f, -2.0f, 0.0f, 3.0f})));
  EXPECT_FALSE(scaler.overflowed());
}

TEST(GradScaler, InfOrNanSkipsAndHalvesTheScale) {
  for (float bad : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN()}) {
    GradScaler scaler(GradScalerOptions{1024.0});
    Fixture f;
    f.set_grad(torch::tensor({1.0f, bad, 2.0f, 3.0f}));
    EXPECT_TRUE(scaler.unscale(f.optimizer)) << bad;
    EXPECT_TRUE(scaler.overflowed());
    scaler.update();
    EXPECT_EQ(scaler.get_scale(), 512.0);
    EXPECT_TRUE(scaler.last_step_skipped());
    EXPECT_EQ(scaler.skipped_steps(), 1);
    EXPECT_FALSE(scaler.overflowed()) << "the next iteration starts clean";
  }
}

TEST(GradScaler, GrowsAfterTheWindowOfCleanSteps) {
  GradScalerOptions options;
  options.init_scale = 8;
  options.growth_interval = 3;
  GradScaler scaler(options);
  Fixture f;
  iterate(scaler, f, false);
  iterate(scaler, f, false);
  EXPECT_EQ(scaler.get_scale(), 8);
  iterate(scaler, f, false);
  EXPECT_EQ(scaler.get_scale(), 16) << "the third clean step grows it";
  iterate(scaler, f, false);
  iterate(scaler, f, true);  // an overflow restarts the window
  EXPECT_EQ(scaler.get_scale(), 8);
  iterate(scaler, f, false);
  iterate(scaler, f, false);
  EXPECT_EQ(scaler.get_scale(), 8);
  iterate(scaler, f, false);
  EXPECT_EQ(scaler.get_scale(), 16);
  EXPECT_EQ(scaler.skipped_steps(), 1);
}

TEST(GradScaler, HysteresisSkipsBeforeBackingOffAsDeepSpeedDoes) {
  GradScalerOptions options;
  options.init_scale = 64;
  options.growth_interval = 2;
  options.hysteresis = 2;
  GradScaler scaler(options);
  Fixture f;
  iterate(scaler, f, true);
  EXPECT_EQ(scaler.get_scale(), 64) << "the first overflow is skipped, the scale kept";
  iterate(scaler, f, true);
  EXPECT_EQ(scaler.get_scale(), 32);
  iterate(scaler, f, true);
  EXPECT_EQ(scaler.get_scale(), 16) << "hysteresis is spent until the scale grows again";
  iterate(scaler, f, false);
  iterate(scaler, f, false);
  EXPECT_EQ(scaler.get_scale(), 32);
  iterate(scaler, f, true);
  EXPECT_EQ(scaler.get_scale(), 32) << "growth restored the hysteresis";
  EXPECT_EQ(scaler.skipped_steps(), 4);
}

// DeepSpeed's two readings of hysteresis: by default any overflow at the scale counts (a step
// without one in between restores nothing); with consecutive_hysteresis only overflows in a row.
TEST(GradScaler, HysteresisCountsAnyOverflowUnlessConsecutive) {
  for (const bool consecutive : {false, true}) {
    GradScalerOptions options;
    options.init_scale = 64;
    options.growth_interval = 1000;
    options.hysteresis = 2;
    options.consecutive_hysteresis = consecutive;
    GradScaler scaler(options);
    Fixture f;
    iterate(scaler, f, true);
    iterate(scaler, f, false);
    iterate(scaler, f, true);
    EXPECT_EQ(scaler.get_scale(), consecutive ? 64 : 32) << "consecutive_hysteresis " << consecutive;
    iterate(scaler, f, true);
    EXPECT_EQ(scaler.get_scale(), consecutive ? 32 : 16) << "consecutive_hysteresis " << consecutive;
  }
}

TEST(GradScaler, AnOverflowAtTheFloorIsAnError) {
  GradScalerOptions options;
  options.init_scale = 4;
  options.min_scale = 2;
  GradScaler scaler(options);
  Fixture f;
  iterate(scaler, f, true);
  EXPECT_EQ(scaler.get_scale(), 2);
  try {
    iterate(scaler, f, true);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("with the loss scale at its floor, min_loss_scale 2 (2 steps skipped so far): "
                                    "the training has diverged"));
  }
}

TEST(GradScaler, AStaticScaleStaysAndStillSkips) {
  GradScalerOptions options;
  options.init_scale = 128;
  options.growth_interval = 1;
  options.dynamic = false;
  GradScaler scaler(options);
  Fixture f;
  EXPECT_TRUE(iterate(scaler, f, true));
  EXPECT_FALSE(iterate(scaler, f, false));
  EXPECT_FALSE(iterate(scaler, f, false));
  EXPECT_EQ(scaler.get_scale(), 128);
  EXPECT_EQ(scaler.skipped_steps(), 1);
}

TEST(GradScaler, UpdateWithoutAnUnscaleChangesNothing) {
  GradScalerOptions options;
  options.init_scale = 8;
  options.growth_interval = 1;
  GradScaler scaler(options);
  scaler.update();  // a batch that only accumulated gradients
  EXPECT_EQ(scaler.get_scale(), 8);
  scaler.record_unscaled(false);
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 16);
  scaler.record_unscaled(true);  // another rank's shard overflowed
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 8);
}

TEST(GradScaler, StateRoundTrips) {
  GradScalerOptions options;
  options.init_scale = 64;
  options.growth_interval = 3;
  options.hysteresis = 3;
  GradScaler scaler(options);
  Fixture f;
  iterate(scaler, f, true);
  iterate(scaler, f, true);
  iterate(scaler, f, true);
  iterate(scaler, f, false);
  GradScaler restored(options);
  restored.load_state_dict(scaler.state_dict());
  EXPECT_EQ(restored.state_dict(), scaler.state_dict());
  // Both go on alike: one more clean step grows neither, two do.
  for (GradScaler* s : {&scaler, &restored}) {
    iterate(*s, f, false);
    EXPECT_EQ(s->get_scale(), 32);
    iterate(*s, f, false);
    EXPECT_EQ(s->get_scale(), 64);
  }
  // Counted under a longer window than the resumed run's: the next clean step grows it.
  GradScalerOptions shorter = options;
  shorter.growth_interval = 2;
  GradScaler resumed(shorter);
  nlohmann::json counted = scaler.state_dict();
  counted["growth_tracker"] = 5;
  resumed.load_state_dict(counted);
  iterate(resumed, f, false);
  EXPECT_EQ(resumed.get_scale(), 128);
  EXPECT_THROW(restored.load_state_dict(nlohmann::json{{"scale", 2.0}}), ConfigError);
  EXPECT_THROW(restored.load_state_dict(nlohmann::json{{"scale", -1.0}, {"growth_tracker", 0},
                                                       {"hysteresis_left", 1}, {"skipped_steps", 0}}),
               ConfigError);
}

TEST(GradScaler, BadOptionsAreConfigErrors) {
  const auto error_of = [](GradScalerOptions options) {
    try {
      GradScaler scaler(options);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  GradScalerOptions zero_scale;
  zero_scale.init_scale = 0;
  EXPECT_THAT(error_of(zero_scale), HasSubstr("GradScaler: init_scale must be positive (init_scale 0,"));
  GradScalerOptions backoff;
  backoff.backoff_factor = 1;
  EXPECT_THAT(error_of(backoff), HasSubstr("backoff_factor must be in (0, 1)"));
  GradScalerOptions floor;
  floor.min_scale = 1e6;
  EXPECT_THAT(error_of(floor), HasSubstr("min_scale must be between 0 and init_scale"));
}

}  // namespace grad_scaler_test
}  // namespace hpctrial::trainer
