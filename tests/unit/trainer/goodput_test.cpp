// The adaptive batch's arithmetic: the gradient noise estimate, the scaling rules, the throughput
// model and the goodput choice (the harness around them: tests/mpi/adaptive_test.cpp).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "adaptive/adaptive_batch.h"
#include "adaptive/goodput.h"
#include "adaptive/gradient_noise.h"

namespace hpctrial::trainer::detail {
namespace goodput_test {  // named: the target compiles its sources together (UNITY_BUILD)

TEST(GradientNoise, ExactNormsGiveTheTrueSignalAndNoise) {
  // |G|^2 = 4, tr(S) = 64: E|g_M|^2 = 4 + 64 / M.
  GradientNoise noise;
  EXPECT_FALSE(noise.ready());
  EXPECT_EQ(noise.gain(64, 16), 1.0);
  EXPECT_EQ(noise.gain(8, 16), 0.5);  // no estimate: a smaller batch counts for its records
  noise.update(4 + 64.0 / 16, 4 + 64.0 / 64, 16, 64, 16);
  ASSERT_TRUE(noise.ready());
  EXPECT_NEAR(noise.sqr(), 4, 1e-12);
  EXPECT_NEAR(noise.var(), 64, 1e-12);
  EXPECT_NEAR(noise.noise_scale(), 16, 1e-12);
  // var per base batch of 16 is 4: r(4) = (4 + 4) / (1 + 4).
  EXPECT_NEAR(noise.gain(64, 16), 8.0 / 5.0, 1e-12);
  EXPECT_NEAR(noise.gain(16, 16), 1.0, 1e-12);
  EXPECT_NEAR(noise.gain(8, 16), 8.0 / 12.0, 1e-12);
  // One rank (no second batch size) and overflowed steps change nothing.
  noise.update(5, 5, 16, 16, 16);
  noise.update(NAN, 1, 16, 64, 16);
  EXPECT_NEAR(noise.var(), 64, 1e-12);
  GradientNoise restored;
  restored.load_state_dict(nlohmann::json::parse(noise.state_dict().dump()));
  EXPECT_EQ(restored.gain(64, 16), noise.gain(64, 16));
}

// Records drawn as x ~ N(mu, sigma^2 I) in d dimensions are the gradients of loss w.x: the
// smoothed estimate over noisy steps lands near the analytic gain.
TEST(GradientNoise, SampledGradientsEstimateTheAnalyticGain) {
  const int d = 50, b = 8;
  const double sigma = 1.0, mu = 0.6;  // |G|^2 = 18, tr(S) = 50
  for (int ranks : {2, 4}) {
    std::mt19937_64 rng(ranks);
    std::normal_distribution<double> normal(0, sigma);
    GradientNoise noise(0.99);
    for (int step = 0; step < 2000; ++step) {
      std::vector<double> global(d, 0.0);
      double local_sqr = 0;
      for (int r = 0; r < ranks; ++r) {
        std::vector<double> local(d, 0.0);
        for (int i = 0; i < b; ++i) {
          for (int k = 0; k < d; ++k) local[k] += (mu + normal(rng)) / b;
        }
        for (int k = 0; k < d; ++k) {
          local_sqr += local[k] * local[k] / ranks;
          global[k] += local[k] / ranks;
        }
      }
      double global_sqr = 0;
      for (double g : global) global_sqr += g * g;
      noise.update(local_sqr, global_sqr, b, static_cast<double>(b * ranks), b);
    }
    const double var = 50.0 / b, sqr = 18.0, scale = ranks;
    const double analytic = (var + sqr) / (var / scale + sqr);
    EXPECT_NEAR(noise.gain(b * ranks, b), analytic, 0.05 * analytic) << ranks << " ranks";
  }
}

// No rule named: AdaptDL's AdaptiveDataParallel takes AdamScale for Adam and AdamW, AdaScale otherwise.
TEST(ScalingRules, AutoIsAdamScaleForAdamAndAdaScaleForOthers) {
  using core::ScalingRule;
  EXPECT_EQ(resolve_scaling_rule(ScalingRule::kAuto, /*adam=*/true), ScalingRule::kAdamScale);
  EXPECT_EQ(resolve_scaling_rule(ScalingRule::kAuto, /*adam=*/false), ScalingRule::kAdaScale);
  EXPECT_EQ(resolve_scaling_rule(ScalingRule::kAdaScale, /*adam=*/true), ScalingRule::kAdaScale);
  EXPECT_EQ(resolve_scaling_rule(ScalingRule::kLinear, /*adam=*/true), ScalingRule::kLinear);
}

TEST(ScalingRules, EachRuleGivesItsDocumentedFactor) {
  using core::ScalingRule;
  EXPECT_EQ(lr_factor(ScalingRule::kAdaScale, 4, 2.5, 10, 0), 2.5);
  EXPECT_EQ(lr_factor(ScalingRule::kAdamScale, 4, 2.25, 10, 0), 1.5);  // AdaptDL's AdamScale: gain^0.5
  EXPECT_EQ(lr_factor(ScalingRule::kLinear, 4, 2.5, 10, 0), 4.0);
  EXPECT_EQ(lr_factor(ScalingRule::kSqrt, 4, 2.5, 10, 0), 2.0);
  EXPECT_EQ(lr_factor(ScalingRule::kLegw, 4, 2.5, 10, 0), 2.0);    // no warm-up
  // AdaptDL's LEGWScale: at scale 4 a warm-up of 100 base steps lasts 400 steps of progress.
  EXPECT_EQ(lr_factor(ScalingRule::kLegw, 4, 2.5, 100, 100), 0.5);  // a quarter of the way
  EXPECT_EQ(lr_factor(ScalingRule::kLegw, 4, 2.5, 300, 100), 1.5);
  EXPECT_EQ(lr_factor(ScalingRule::kLegw, 4, 2.5, 400, 100), 2.0);
  EXPECT_EQ(lr_factor(ScalingRule::kLegw, 1, 2.5, 50, 100), 0.5);   // at the base batch, as written
}

TEST(ThroughputModel, FitsTheFixedAndPerRecordCostsOfAMicroBatch) {
  ThroughputModel model;
  EXPECT_FALSE(model.ready());
  // 2 ms + 0.1 ms a record; 3 ms of exposed all-reduce on 2 ranks.
  model.observe({16, 1, 2}, 0.0036, 0.0066);
  EXPECT_EQ(model.local_batches_measured(), 1u);
  EXPECT_NEAR(model.micro_batch_seconds(32), 0.0072, 1e-12);  // one size: proportional
  model.observe({32, 2, 2}, 2 * 0.0052, 2 * 0.0052 + 0.003);
  EXPECT_NEAR(model.micro_batch_seconds(64), 0.0084, 1e-9);
  EXPECT_NEAR(model.sync_seconds(2), 0.003, 1e-9);
  EXPECT_NEAR(model.sync_seconds(4), 0.003, 1e-9);  // the nearest measured stands in
  EXPECT_EQ(model.sync_seconds(1), 0.0);
  EXPECT_NEAR(model.step_seconds({64, 3, 2}), 3 * 0.0084 + 0.003, 1e-9);
  ThroughputModel restored;
  restored.load_state_dict(nlohmann::json::parse(model.state_dict().dump()));
  EXPECT_NEAR(restored.step_seconds({64, 3, 2}), model.step_seconds({64, 3, 2}), 1e-12);
}

ThroughputModel fitted(double alpha, double beta, double sync) {
  ThroughputModel model;
  for (std::int64_t b : {16, 64}) model.observe({b, 1, 2}, alpha + beta * b, alpha + beta * b + sync);
  return model;
}

TEST(Goodput, NoiseMakesBiggerBatchesWorthTheirRecords) {
  const BatchLimits limits{32, 1024, 4, 256, false, 64};
  const ThroughputModel model = fitted(0.004, 0.0001, 0.002);
  GradientNoise quiet, noisy;
  quiet.update(1.0, 1.0 - 1e-9, 16, 32, 32);          // nearly no noise: gain 1
  noisy.update(1000.0 / 16, 1000.0 / 32, 16, 32, 32);  // all noise: gain = scale
  const BatchShape start{16, 1, 2};
  const BatchChoice calm = choose_batch(model, quiet, limits, 2, start);
  EXPECT_EQ(calm.shape.global(), 32) << "without noise the base batch is best";
  const BatchChoice rough = choose_batch(model, noisy, limits, 2, start);
  EXPECT_EQ(rough.shape.global(), 512) << "with only noise the largest local batch is best";
  EXPECT_EQ(rough.shape.local_batch, 256);
  EXPECT_FALSE(rough.exploring);
}

TEST(Goodput, AccumulationGoesPastTheLocalBoundWhenAllowed) {
  BatchLimits limits{32, 1024, 4, 64, true, 8};
  GradientNoise noisy;
  noisy.update(1000.0 / 16, 1000.0 / 32, 16, 32, 32);
  const BatchChoice c = choose_batch(fitted(0.004, 0.0001, 0.05), noisy, limits, 2, {16, 1, 2});
  EXPECT_EQ(c.shape.local_batch, 64);
  EXPECT_EQ(c.shape.accumulation, 8);  // the sync is dear: as many micro-batches as allowed
  limits.accumulation = false;
  EXPECT_EQ(choose_batch(fitted(0.004, 0.0001, 0.05), noisy, limits, 2, {16, 1, 2}).shape.accumulation, 1);
}

TEST(Goodput, OneMeasuredSizeIsFollowedByTryingTwiceIt) {
  const BatchLimits limits{32, 1024, 4, 256, false, 64};
  ThroughputModel model;
  model.observe({16, 1, 2}, 0.004, 0.005);
  GradientNoise noise;
  const BatchShape start{16, 1, 2};
  EXPECT_FALSE(choose_batch(model, noise, limits, 2, start).exploring) << "no noise estimate yet";
  noise.update(2.0, 1.5, 16, 32, 32);
  const BatchChoice c = choose_batch(model, noise, limits, 2, start);
  EXPECT_TRUE(c.exploring);
  EXPECT_EQ(c.shape.local_batch, 32);
}

TEST(Goodput, TheStartSplitsTheBaseBatchWithinTheBounds) {
  EXPECT_EQ(initial_batch({64, 1024, 1, 0, false, 64}, 4), (BatchShape{16, 1, 4}));
  EXPECT_EQ(initial_batch({64, 1024, 1, 0, false, 64}, 3), (BatchShape{22, 1, 3}));   // rounded up
  EXPECT_EQ(initial_batch({64, 1024, 1, 8, true, 64}, 2), (BatchShape{8, 4, 2}));     // accumulates
  EXPECT_EQ(initial_batch({64, 1024, 1, 8, false, 64}, 2), (BatchShape{8, 1, 2}));    // a smaller batch
  EXPECT_EQ(initial_batch({64, 1024, 40, 0, false, 64}, 4), (BatchShape{40, 1, 4}));  // the lower bound
}

// A state from 2 ranks whose noise makes a larger batch worth it, resumed on one rank: one rank
// measures no noise, so it keeps the base batch with a gain of 1 (the estimate is kept).
TEST(AdaptiveBatchState, OneRankKeepsTheBaseBatchWhateverEstimateItResumedWith) {
  core::AdaptiveBatch config;
  config.enabled = true;
  config.max_batch_size = 256;
  config.min_local_batch = 8;
  config.max_local_batch = 64;
  config.gradient_accumulation = true;
  config.smoothing = 0.5;
  AdaptiveBatchState two(config, 16, 4096, 2);
  for (const std::int64_t local : {8, 16}) {
    two.apply({local, 1, 2});
    for (int i = 0; i < 20; ++i) {
      two.start_step();
      // b local records, B = 2b averaged: |G|^2 = 0.02 and tr(S) = 80 per record.
      const double b = static_cast<double>(local), big = 2 * b;
      two.fold_norms(GradientNorms{0.02 + 80 / b, 0.02 + 80 / big, 0});
      two.end_step(0.004 + 0.0001 * b, 0.005 + 0.0001 * b);
    }
  }
  const BatchChoice on_two = two.decide();
  ASSERT_GT(on_two.shape.global(), 16) << "the noise makes a larger batch worth it on 2 ranks";

  AdaptiveBatchState one(config, 16, 4096, 1);
  one.restore(two.state_dict());
  EXPECT_EQ(one.shape().global(), 16);
  EXPECT_EQ(one.decide().shape.global(), 16);
  one.start_step();
  EXPECT_EQ(one.step_gain(), 1.0);
  // Steps timed on one rank, with no norms: the estimate from 2 ranks is all there is.
  for (const std::int64_t local : {16, 32}) {
    one.apply({local, 1, 1});
    for (int i = 0; i < 20; ++i) {
      one.start_step();
      one.fold_norms(GradientNorms{0.5, 0.3, 0});  // measured nowhere on one rank: no effect
      one.end_step(0.004 + 0.0001 * static_cast<double>(local), 0.004 + 0.0001 * static_cast<double>(local));
    }
  }
  EXPECT_EQ(one.decide().shape.global(), 16);
  one.apply(one.decide().shape);
  one.start_step();
  EXPECT_EQ(one.step_gain(), 1.0);
  EXPECT_EQ(one.state_dict().at("noise"), two.state_dict().at("noise")) << "the estimate is kept for more ranks";
}

// AdaptDL folds a step's own gradient statistics into its estimate before that step's learning
// rate factor and progress are taken (scaling_rules.py: _final_callback at the end of backward,
// then run_step's calculate_lr_factors(scale) and `progress += gain(scale)`). With 2 replicas and
// scale 2 (count 2): grad_sqr = (2 total - local), grad_var = (local - total) x 2, each averaged
// with weight theta = 0.999^2 and the bias correction _update_avg applies.
//   step 1, local 0.5, total 0.3: sqr 0.1, var 0.4           gain (0.4 + 0.1) / (0.2 + 0.1) = 5/3
//   step 2, local 0.4, total 0.35: sample sqr 0.3, var 0.1;
//     sqr_avg = (theta 0.1 + 0.3) / (1 + theta) = 0.20010005, var_avg = (theta 0.4 + 0.1) / (1 + theta)
//     = 0.249849925                                          gain 1.3843549194541
// So the first measured step already trains with its own noisy sample's factor (not 1), and the
// progress after two steps is 5/3 + 1.38435 (not 1 + 5/3).
TEST(AdaptiveBatchState, TheGainOfAStepFoldsInItsOwnGradientsAsAdaptDLDoes) {
  core::AdaptiveBatch config;
  config.enabled = true;
  config.max_batch_size = 256;
  config.min_local_batch = 8;
  config.max_local_batch = 64;
  config.smoothing = 0.999;
  config.scaling_rule = core::ScalingRule::kAdaScale;
  AdaptiveBatchState state(config, 16, 4096, 2);
  state.apply({16, 1, 2});
  state.start_step();
  EXPECT_EQ(state.lr_factor(), 1.0) << "before the step's gradients, nothing is known";
  state.fold_norms(GradientNorms{0.5, 0.3, 0});
  EXPECT_NEAR(state.step_gain(), 5.0 / 3.0, 1e-12);
  EXPECT_NEAR(state.lr_factor(), 5.0 / 3.0, 1e-12);
  state.end_step(0.01, 0);
  EXPECT_NEAR(state.progress(), 5.0 / 3.0, 1e-12);

  state.start_step();
  EXPECT_NEAR(state.lr_factor(), 5.0 / 3.0, 1e-12) << "until the step's own norms: the estimate so far";
  state.fold_norms(GradientNorms{0.4, 0.35, 0});
  EXPECT_NEAR(state.noise().sqr(), 0.20010004999997497, 1e-12);
  EXPECT_NEAR(state.noise().var() / 16, 0.24984992500003755, 1e-12);  // per record, var_avg / B0
  EXPECT_NEAR(state.lr_factor(), 1.384354919454149, 1e-12);
  // A second measurement in the same step (a second optimizer's) replaces the first.
  state.fold_norms(GradientNorms{0.5, 0.3, 0});
  state.fold_norms(GradientNorms{0.4, 0.35, 0});
  EXPECT_NEAR(state.lr_factor(), 1.384354919454149, 1e-12);
  state.end_step(0.01, 0);
  EXPECT_NEAR(state.progress(), 5.0 / 3.0 + 1.384354919454149, 1e-12);
  // A step that measures nothing (skipped for an overflow) keeps the estimate so far.
  state.start_step();
  state.end_step(0.01, 0);
  EXPECT_NEAR(state.progress(), 5.0 / 3.0 + 2 * 1.384354919454149, 1e-12);
}

// AdamScale's moments start afresh when a step's scale differs from the last step's: at a fresh
// run's first step, at a change of batch, and after a resume only when the batch changed there.
TEST(AdaptiveBatchState, AScaleChangeIsTheFirstStepAndEachChangeOfBatchAcrossAResume) {
  core::AdaptiveBatch config;
  config.enabled = true;
  config.max_batch_size = 256;
  config.min_local_batch = 8;
  config.max_local_batch = 64;
  AdaptiveBatchState state(config, 16, 4096, 2);
  state.apply({16, 1, 2});
  EXPECT_TRUE(state.take_scale_change()) << "a fresh run's first step";
  EXPECT_FALSE(state.take_scale_change());
  state.apply({8, 2, 2});  // another split of the same 32 records: the same scale
  EXPECT_FALSE(state.take_scale_change());
  state.apply({24, 1, 2});
  EXPECT_TRUE(state.take_scale_change());
  EXPECT_FALSE(state.take_scale_change());

  AdaptiveBatchState resumed(config, 16, 4096, 2);
  resumed.restore(state.state_dict());
  EXPECT_FALSE(resumed.take_scale_change()) << "the same batch as the checkpoint's";
  // A checkpoint written before the scale was kept: its moments are of its own batch.
  nlohmann::json older = state.state_dict();
  older.erase("moments_scale");
  AdaptiveBatchState from_older(config, 16, 4096, 2);
  from_older.restore(older);
  EXPECT_FALSE(from_older.take_scale_change());
  // Resumed on 4 ranks, the batch is chosen again: the scale changes with it.
  AdaptiveBatchState four(config, 16, 4096, 4);
  four.restore(state.state_dict());
  EXPECT_EQ(four.take_scale_change(), four.shape().global() != 48);
  // A run without an adaptive batch trained at the base batch, and this one starts at 2 ranks' 32.
  AdaptiveBatchState fixed(config, 16, 4096, 2);
  fixed.continue_fixed_run(100);
  EXPECT_EQ(fixed.take_scale_change(), fixed.shape().global() != 16);
}

}  // namespace goodput_test
}  // namespace hpctrial::trainer::detail
