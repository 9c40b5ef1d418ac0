// The adaptive batch under the real loop, on 2 and 4 ranks: the gain measured on a problem whose
// gradient mean and variance are known, the learning rate each scaling rule gives, a run stopped
// by SIGUSR2 and resumed bitwise, and a resume on fewer ranks that sees every record once a pass.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <signal.h>
#include <unistd.h>

#include <array>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "hpctrial/rank/stop_signals.h"
#include "../unit/trainer/test_trial.h"
#include "hpctrial/comm/communicator.h"
#include "mpi_test_env.h"
#include "state/state_io.h"
#include "record_order.h"

namespace hpctrial::trainer {
namespace adaptive_test {  // named: the target compiles its sources together (UNITY_BUILD)

using testing_mpi::env;
using testing_mpi::training_order;
using testing_trial::config_from;

std::string shared_dir(const std::string& name) { return testing_mpi::shared_dir("hpctrial-adaptive", name); }

// SGD that remembers the learning rate of each step it takes.
class RecordingSgd : public torch::optim::SGD {
 public:
  using SGD::SGD;
  torch::Tensor step(LossClosure closure = nullptr) override {
    lrs.push_back(param_groups().at(0).options().get_lr());
    return SGD::step(std::move(closure));
  }
  std::vector<double> lrs;
};

// Records x ~ N(mu, sigma^2 I) in `dims` dimensions; the loss mean(w.x) has the per-record
// gradient x whatever w is: |G|^2 = dims mu^2, tr(S) = dims sigma^2. The target holds each
// record's index; the regression trial learns y = x.w* + noise from the same records.
class AdaptiveTrial : public Trial {
 public:
  struct Options {
    bool regression = false;
    std::int64_t records = 4096;
    std::vector<double>* lrs = nullptr;                      // the chief's, step by step
    std::vector<std::vector<std::int64_t>>* seen = nullptr;  // this rank's indices, batch by batch
    std::vector<torch::Tensor>* parameters_out = nullptr;
    std::int64_t signal_after = -1;  // raise SIGUSR2 on `signal_rank` after this batch
    int signal_rank = 0;
    // With it: an EveryBatch and an EveryOptimizerStep scheduler, and per batch as it starts the
    // optimizer steps taken before it and the two schedulers' steps; then their final steps.
    std::vector<std::array<std::int64_t, 3>>* schedule = nullptr;
    std::pair<int, int>* scheduled = nullptr;
  };
  static constexpr int kDims = 100;
  static constexpr double kMu = 0.3, kSigma = 1.0;

  AdaptiveTrial(TrialContext& context, Options options) : context_(context), options_(options) {
    torch::manual_seed(11);
    const int dims = options_.regression ? 8 : kDims;
    auto x = options_.regression ? torch::randn({options_.records, dims})
                                 : torch::randn({options_.records, dims}) * kSigma + kMu;
    auto index = torch::arange(options_.records, torch::kFloat32).unsqueeze(1);
    auto y = options_.regression ? x.matmul(torch::linspace(-1, 1, dims)).unsqueeze(1) + 0.5 * torch::randn({options_.records, 1})
                                 : torch::zeros({options_.records, 1});
    dataset_ = std::make_shared<TensorDataset>(x, torch::cat({y, index}, 1));
    torch::manual_seed(static_cast<std::int64_t>(context.trial_seed()));
    model_ = context.wrap_model(torch::nn::Linear(torch::nn::LinearOptions(dims, 1).bias(options_.regression)));
    optimizer_ = context.wrap_optimizer(std::make_shared<RecordingSgd>(
        model_->parameters(), torch::optim::SGDOptions(context.hparam<double>("lr"))));
    if (options_.schedule != nullptr) {
      every_batch_ = context.wrap_lr_scheduler(std::make_shared<testing_trial::CountingScheduler>(*optimizer_),
                                               StepMode::EveryBatch);
      every_step_ = context.wrap_lr_scheduler(std::make_shared<testing_trial::CountingScheduler>(*optimizer_),
                                              StepMode::EveryOptimizerStep);
    }
  }
  ~AdaptiveTrial() override {
    if (options_.scheduled != nullptr && every_batch_) *options_.scheduled = {every_batch_->steps, every_step_->steps};
    if (options_.lrs != nullptr) *options_.lrs = optimizer_->lrs;
    if (options_.parameters_out != nullptr) {
      options_.parameters_out->clear();
      for (const auto& p : model_->parameters()) options_.parameters_out->push_back(p.detach().clone());
    }
  }

  Metrics train_batch(Batch& batch, std::int64_t, std::int64_t batch_idx) override {
    const auto y = batch.target.select(1, 0);
    if (options_.seen != nullptr) {
      const auto index = batch.target.select(1, 1).to(torch::kInt64);
      options_.seen->emplace_back(index.data_ptr<std::int64_t>(), index.data_ptr<std::int64_t>() + index.numel());
    }
    if (options_.schedule != nullptr) {
      options_.schedule->push_back({static_cast<std::int64_t>(optimizer_->lrs.size()), every_batch_->steps,
                                    every_step_->steps});
    }
    const auto out = model_->forward(batch.data).squeeze(1);
    const auto loss = options_.regression ? torch::mse_loss(out, y) : out.mean();
    context_.backward(loss);
    context_.step_optimizer(*optimizer_);
    if (batch_idx + 1 == options_.signal_after && context_.distributed().rank == options_.signal_rank) {
      ::raise(SIGUSR2);
    }
    return {{"loss", loss}};
  }
  Metrics evaluate_batch(Batch& batch) override {
    return {{"validation_loss", torch::mse_loss(model_->forward(batch.data).squeeze(1), batch.target.select(1, 0))}};
  }
  DataLoader build_training_data_loader() override { return {dataset_, context_.per_slot_batch_size()}; }
  DataLoader build_validation_data_loader() override { return {dataset_, 64, false}; }

 private:
  TrialContext& context_;
  Options options_;
  std::shared_ptr<TensorDataset> dataset_;
  torch::nn::Linear model_{nullptr};
  std::shared_ptr<RecordingSgd> optimizer_;
  std::shared_ptr<testing_trial::CountingScheduler> every_batch_, every_step_;
};

// Adam that remembers, for each step it takes, the steps its state had taken before it (AdaptDL
// starts them afresh when the batch changes) and the records this rank trained the step on.
class RecordingAdam : public torch::optim::Adam {
 public:
  using Adam::Adam;
  torch::Tensor step(LossClosure closure = nullptr) override {
    const auto& p = param_groups().at(0).params().at(0);
    const auto it = state().find(detail::optimizer_state_key(p));
    steps_before.push_back(it == state().end() ? 0 : static_cast<const torch::optim::AdamParamState&>(*it->second).step());
    records.push_back(std::exchange(pending_records, 0));
    return Adam::step(std::move(closure));
  }
  std::vector<std::int64_t> steps_before;
  std::vector<std::int64_t> records;
  std::int64_t pending_records = 0;
};

// The quadratic loss 0.5 |w - x|^2 averaged over records x, in 100 dimensions, minimised by Adam:
// the per-record gradient w - x has the mean w - mu and the covariance diag(s^2). Half the
// coordinates have much signal and little noise (mu 1, s 0.1), half the opposite (mu 0.1, s 2), so
// Adam's preconditioner changes the noise scale several times over. w starts at 0.
class AdamQuadraticTrial : public Trial {
 public:
  struct Options {
    double lr = 0;  // 0: the gradients' distribution never changes
    torch::Tensor* records_out = nullptr;
    std::vector<std::int64_t>* steps_before = nullptr;  // RecordingAdam's
    std::vector<std::int64_t>* step_records = nullptr;
  };
  static constexpr int kDims = 100;
  static constexpr std::int64_t kRecords = 4096;

  AdamQuadraticTrial(TrialContext& context, Options options) : context_(context), options_(options) {
    torch::manual_seed(17);
    const auto signal = torch::arange(kDims) < kDims / 2;
    const auto mu = torch::where(signal, torch::full({kDims}, 1.0), torch::full({kDims}, 0.1));
    const auto s = torch::where(signal, torch::full({kDims}, 0.1), torch::full({kDims}, 2.0));
    const auto x = torch::randn({kRecords, kDims}) * s + mu;
    if (options_.records_out != nullptr) *options_.records_out = x;
    dataset_ = std::make_shared<TensorDataset>(x, torch::zeros({kRecords, 1}));
    model_ = context.wrap_model(torch::nn::Linear(torch::nn::LinearOptions(kDims, 1).bias(false)));
    {
      torch::NoGradGuard no_grad;
      model_->weight.zero_();
    }
    optimizer_ = context.wrap_optimizer(std::make_shared<RecordingAdam>(
        model_->parameters(), torch::optim::AdamOptions(options_.lr).betas({0.9, 0.99})));
  }
  ~AdamQuadraticTrial() override {
    if (options_.steps_before != nullptr) *options_.steps_before = optimizer_->steps_before;
    if (options_.step_records != nullptr) *options_.step_records = optimizer_->records;
  }

  Metrics train_batch(Batch& batch, std::int64_t, std::int64_t) override {
    const auto loss = 0.5 * (model_->weight - batch.data).pow(2).sum(1).mean();
    context_.backward(loss);
    optimizer_->pending_records += batch.data.size(0);
    context_.step_optimizer(*optimizer_);
    return {{"loss", loss}};
  }
  Metrics evaluate_batch(Batch& batch) override {
    return {{"validation_loss", 0.5 * (model_->weight - batch.data).pow(2).sum(1).mean()}};
  }
  DataLoader build_training_data_loader() override { return {dataset_, context_.per_slot_batch_size()}; }
  DataLoader build_validation_data_loader() override { return {dataset_, 512, false}; }

 private:
  TrialContext& context_;
  Options options_;
  std::shared_ptr<TensorDataset> dataset_;
  torch::nn::Linear model_{nullptr};
  std::shared_ptr<RecordingAdam> optimizer_;
};

// A step's time as a fixed cost per micro-batch, a cost per record and an all-reduce.
double modelled_seconds(std::int64_t local_batch, std::int64_t accumulation, int ranks) {
  return static_cast<double>(accumulation) * (0.004 + 0.0001 * static_cast<double>(local_batch)) + (ranks > 1 ? 0.003 : 0);
}

struct AdaptiveRun {
  LoopResult result;
  std::vector<nlohmann::json> training_lines;  // the chief's
};

AdaptiveRun train_trial(comm::Communicator& comm, const std::string& yaml, const std::string& dir,
                        const TrialFactory& factory, bool modelled_time = true) {
  LoopOptions loop;
  loop.trial_dir = dir;
  loop.progress_interval_s = 0;
  loop.report_period_batches = 1;
  loop.experiment_seed = 3;
  loop.distributed = {comm.rank(), comm.size(), comm.rank(), comm.size(), 1};
  loop.external_stop = &rank::stop_signal_received();
  if (modelled_time) loop.adaptive_step_seconds = modelled_seconds;
  rank::install_stop_handlers();
  AdaptiveRun out;
  out.result = run_training(config_from(yaml), factory, comm, loop);
  rank::clear_stop_signal();
  if (comm.is_chief()) {
    std::ifstream in(dir + "/metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
      auto j = nlohmann::json::parse(line);
      if (j["kind"] == "training") out.training_lines.push_back(j);
    }
  }
  return out;
}

AdaptiveRun train(comm::Communicator& comm, const std::string& yaml, const std::string& dir,
                  AdaptiveTrial::Options options, bool modelled_time = true) {
  return train_trial(comm, yaml, dir, [&](TrialContext& context) {
    return std::unique_ptr<Trial>(std::make_unique<AdaptiveTrial>(context, options));
  }, modelled_time);
}

AdaptiveRun train_adam(comm::Communicator& comm, const std::string& yaml, const std::string& dir,
                       AdamQuadraticTrial::Options options) {
  return train_trial(comm, yaml, dir, [&](TrialContext& context) {
    return std::unique_ptr<Trial>(std::make_unique<AdamQuadraticTrial>(context, options));
  });
}

std::string yaml(std::int64_t base, const std::string& adaptive, std::int64_t length = 300) {
  return "name: adaptive\nentrypoint: ./t\nsearcher: {name: single, metric: validation_loss, max_length: {batches: " +
         std::to_string(length) + "}}\nhyperparameters: {global_batch_size: " + std::to_string(base) +
         ", lr: 0.01}\noptimizations:\n  adaptive_batch_size: {enabled: true, " + adaptive + "}\n";
}

// Batches of 8 records a rank (local bounds [8, 8]) against a base batch of 8: the scale is the
// number of ranks, and the gain measured over 300 steps is within 10 % of the analytic one.
TEST(AdaptiveBatch, TheMeasuredGainIsTheAnalyticOne) {
  comm::MpiCommunicator comm(env().world());
  const std::string dir = shared_dir("gain");
  const int ranks = comm.size();
  const AdaptiveRun run = train(comm, yaml(8, "max_batch_size: " + std::to_string(8 * ranks) +
                                                  ", local_batch_size_bounds: [8, 8], smoothing: 0.99"),
                                dir, {});
  if (comm.is_chief()) {
    ASSERT_FALSE(run.training_lines.empty());
    const auto& last = run.training_lines.back()["metrics"];
    const double var = AdaptiveTrial::kDims * AdaptiveTrial::kSigma * AdaptiveTrial::kSigma / 8.0;
    const double sqr = AdaptiveTrial::kDims * AdaptiveTrial::kMu * AdaptiveTrial::kMu;
    const double analytic = (var + sqr) / (var / ranks + sqr);
    const double measured = last["adaptive_gain"].get<double>();
    EXPECT_NEAR(measured, analytic, 0.1 * analytic) << ranks << " ranks";
    EXPECT_EQ(last["adaptive_batch_size"].get<double>(), 8.0 * ranks);
    EXPECT_NEAR(last["adaptive_noise_scale"].get<double>(), 1.0 / (0.3 * 0.3), 0.15 / (0.3 * 0.3));
    // AdaScale: progress is the sum of the gains, and the run ends once it reaches 300 steps of
    // the base batch - in fewer steps than 300.
    EXPECT_GE(last["adaptive_progress"].get<double>(), 300.0);
    EXPECT_LT(run.result.batches_trained, 300);
    std::filesystem::remove_all(dir);
  }
}

// Each rule's factor on the learning rate (0.01) of the optimizer's step, at scale = ranks.
TEST(AdaptiveBatch, EachScalingRuleGivesItsLearningRate) {
  comm::MpiCommunicator comm(env().world());
  const int ranks = comm.size();
  for (const std::string rule : {"linear", "sqrt", "legw", "adascale", "adamscale"}) {
    const std::string dir = shared_dir("rule-" + rule);
    std::vector<double> lrs;
    AdaptiveTrial::Options options;
    options.lrs = &lrs;
    // 4096 records an epoch, 8 a base step: LEGW's warm-up of 1/256 epoch is 2 base steps at the
    // base batch, and 2 x scale steps of progress at this one (AdaptDL's LEGWScale).
    const AdaptiveRun run = train(comm, yaml(8, "max_batch_size: " + std::to_string(8 * ranks) +
                                                    ", local_batch_size_bounds: [8, 8], scaling_rule: " + rule +
                                                    ", legw_warmup_epochs: 0.00390625", 20),
                                  dir, options);
    // 20 base batches of progress: a step makes between 1 and `ranks` of them (its gain).
    const double scale = ranks;
    EXPECT_GE(run.result.batches_trained, 20 / ranks) << rule;
    EXPECT_LE(run.result.batches_trained, 20) << rule;
    ASSERT_EQ(static_cast<std::int64_t>(lrs.size()), run.result.batches_trained) << rule;
    if (rule == "linear") {
      for (double lr : lrs) EXPECT_DOUBLE_EQ(lr, 0.01 * scale);
    } else if (rule == "sqrt") {
      for (double lr : lrs) EXPECT_DOUBLE_EQ(lr, 0.01 * std::sqrt(scale));
    } else if (rule == "legw") {
      // Progress counts gains, the first step's its own measured one, above 1 (the ranks' own
      // gradients differ) and at most the scale: sqrt(s) x r / (2 s) with 1 < r <= s.
      EXPECT_GT(lrs.at(0), 0.01 * std::sqrt(scale) * (1.0 / (2.0 * scale)));
      EXPECT_LE(lrs.at(0), 0.01 * std::sqrt(scale) * 0.5 + 1e-12);
      EXPECT_NEAR(lrs.back(), 0.01 * std::sqrt(scale), 1e-12);
      for (std::size_t i = 1; i < lrs.size(); ++i) EXPECT_GE(lrs[i], lrs[i - 1]) << "step " << i;
    } else {
      // AdaScale's factor is the gain, at most the scale; AdamScale's its square root. The first
      // step's is already its own measured one (AdaptDL's order), above 1: the ranks' own
      // gradients differ, so the estimated variance is positive.
      const double most = rule == "adascale" ? scale : std::sqrt(scale);
      for (std::size_t i = 0; i < lrs.size(); ++i) {
        EXPECT_GT(lrs[i], 0.01) << rule << " step " << i;
        EXPECT_LE(lrs[i], 0.01 * most + 1e-12) << rule << " step " << i;
      }
    }
    if (comm.is_chief()) std::filesystem::remove_all(dir);
    comm.barrier();
  }
}

// The noise scale tr(S) / |G|^2 measured over some 3000 steps of 8 records a rank (the
// preconditioned estimate is noisier than the raw one: its signal is smaller beside its noise), against the one
// computed from the records themselves: under `adamscale` (AdaptDL's AdamScale() passed to
// AdaptiveDataParallel) that of the gradients divided by Adam's preconditioner sqrt(v) + eps, v the
// expected square of the averaged gradient; under `auto` (AdaptDL's default for Adam) that of the
// gradients as they are. The two differ several times over, so each reading fails the other's test.
TEST(AdaptiveBatch, AdamScaleMeasuresTheNoiseOfAdamPreconditionedGradients) {
  comm::MpiCommunicator comm(env().world());
  const int ranks = comm.size();
  for (const std::string rule : {"adamscale", "auto"}) {
    const std::string dir = shared_dir("adam-" + rule);
    torch::Tensor x;
    AdamQuadraticTrial::Options options;
    options.records_out = &x;
    const AdaptiveRun run = train_adam(comm, yaml(8, "max_batch_size: " + std::to_string(8 * ranks) +
                                                         ", local_batch_size_bounds: [8, 8], smoothing: 0.998, "
                                                         "scaling_rule: " + rule, 6000),
                                       dir, options);
    // On the chief alone; a failed assertion leaves the lambda, not the test (the others wait).
    if (comm.is_chief()) [&] {
      ASSERT_FALSE(run.training_lines.empty()) << rule;
      // The records' own moments, in double precision: G = w - mu = -mu, S = diag(var).
      const auto records = x.to(torch::kFloat64);
      const auto g = -records.mean(0);
      const auto var = records.var(0, /*unbiased=*/false);
      const double batch = 8.0 * ranks;
      const auto divisor = (g.pow(2) + var / batch).sqrt() + 1e-8;
      const double raw = var.sum().item<double>() / g.pow(2).sum().item<double>();
      const double preconditioned = (var / divisor.pow(2)).sum().item<double>() / (g / divisor).pow(2).sum().item<double>();
      ASSERT_GT(preconditioned, 3 * raw) << "the two readings would not be told apart";
      const double expected = rule == "adamscale" ? preconditioned : raw;
      const auto& last = run.training_lines.back()["metrics"];
      const double measured = last["adaptive_noise_scale"].get<double>();
      EXPECT_NEAR(measured, expected, 0.1 * expected) << rule << " on " << ranks << " ranks (raw " << raw
                                                      << ", preconditioned " << preconditioned << ")";
      std::filesystem::remove_all(dir);
    }();
    comm.barrier();
  }
}

// AdaptDL's AdamGradientNoiseScale starts Adam's moments afresh whenever the batch's scale
// changes: each step the optimizer takes right after a change finds its state at step 0, every
// other one step further than the last. `auto` (the raw noise) never resets them.
TEST(AdaptiveBatch, AdamScaleStartsAdamsMomentsAfreshWhenTheBatchChanges) {
  comm::MpiCommunicator comm(env().world());
  const std::string adaptive = "max_batch_size: 256, local_batch_size_bounds: [2, 32], gradient_accumulation: true, "
                               "decision_interval: 4, smoothing: 0.9, scaling_rule: ";
  for (const std::string rule : {"adamscale", "auto"}) {
    const std::string dir = shared_dir("adam-reset-" + rule);
    std::vector<std::int64_t> steps_before, records;
    AdamQuadraticTrial::Options options;
    options.lr = 0.01;
    options.steps_before = &steps_before;
    options.step_records = &records;
    train_adam(comm, yaml(16, adaptive + rule, 120), dir, options);
    ASSERT_FALSE(steps_before.empty()) << rule;
    ASSERT_EQ(steps_before.size(), records.size());
    EXPECT_EQ(steps_before[0], 0) << rule;
    int changes = 0;
    for (std::size_t k = 1; k < records.size(); ++k) {
      const bool changed = records[k] != records[k - 1];
      changes += changed;
      const std::int64_t expected = rule == "adamscale" && changed ? 0 : steps_before[k - 1] + 1;
      EXPECT_EQ(steps_before[k], expected) << rule << ": step " << k << " of " << records[k] << " records a rank, after "
                                           << records[k - 1];
    }
    EXPECT_GT(changes, 0) << rule << ": the batch never changed: the test would not test a reset";
    if (comm.is_chief()) std::filesystem::remove_all(dir);
    comm.barrier();
  }
}

const std::string kElastic = "max_batch_size: 256, local_batch_size_bounds: [2, 32], gradient_accumulation: true, "
                             "decision_interval: 4";

// Stopped by SIGUSR2 (on the chief, then on the last rank) after a decision changed the batch, and
// resumed on as many ranks: the weights are bitwise those of an uninterrupted run.
TEST(AdaptiveBatch, AStopAndAResumeOnAsManyRanksIsBitwiseTheUninterruptedRun) {
  comm::MpiCommunicator comm(env().world());
  AdaptiveTrial::Options base;
  base.regression = true;
  base.records = 512;
  std::vector<torch::Tensor> straight;
  const std::string straight_dir = shared_dir("straight");
  base.parameters_out = &straight;
  const AdaptiveRun reference = train(comm, yaml(16, kElastic, 80), straight_dir, base);
  if (comm.is_chief()) {
    std::set<double> batches;
    for (const auto& line : reference.training_lines) batches.insert(line["metrics"]["adaptive_batch_size"].get<double>());
    EXPECT_GT(batches.size(), 1u) << "the batch never changed: the test would not test a change";
  }
  for (const int stopping_rank : {0, comm.size() - 1}) {
    const std::string dir = shared_dir("stop-" + std::to_string(stopping_rank));
    std::vector<torch::Tensor> resumed;
    AdaptiveTrial::Options options = base;
    options.parameters_out = &resumed;
    options.signal_after = 13;
    options.signal_rank = stopping_rank;
    const AdaptiveRun paused = train(comm, yaml(16, kElastic, 80), dir, options);
    EXPECT_TRUE(paused.result.stopped_early);
    options.signal_after = -1;
    const AdaptiveRun rest = train(comm, yaml(16, kElastic, 80), dir, options);
    EXPECT_FALSE(rest.result.stopped_early);
    ASSERT_EQ(resumed.size(), straight.size());
    for (std::size_t i = 0; i < straight.size(); ++i) {
      EXPECT_TRUE(torch::equal(resumed[i], straight[i])) << "stopped by rank " << stopping_rank << ": parameter " << i;
    }
    if (comm.is_chief()) std::filesystem::remove_all(dir);
  }
  if (comm.is_chief()) std::filesystem::remove_all(straight_dir);
}

// Stopped part way and resumed on half the ranks (the world of 2 resumes on 1), where the batch
// is chosen again: every pass over the 512 records sees each once, across the batch changes and
// the restart.
TEST(AdaptiveBatch, AResumeOnFewerRanksSeesEveryRecordOncePerPass) {
  comm::MpiCommunicator world(env().world());
  const std::string dir = shared_dir("elastic");
  AdaptiveTrial::Options options;
  options.regression = true;
  options.records = 512;
  std::vector<std::vector<std::int64_t>> before, after;
  options.seen = &before;
  options.signal_after = 40;
  options.signal_rank = world.size() - 1;
  const AdaptiveRun paused = train(world, yaml(16, kElastic, 160), dir, options);
  ASSERT_TRUE(paused.result.stopped_early);
  std::vector<std::int64_t> order = training_order(world, before);
  const int restarted = std::max(1, world.size() / 2);
  auto group = world.split(world.rank() < restarted ? 0 : 1, world.rank());
  if (world.rank() < restarted) {
    options.seen = &after;
    options.signal_after = -1;
    const AdaptiveRun rest = train(*group, yaml(16, kElastic, 160), dir, options);
    EXPECT_FALSE(rest.result.stopped_early);
    const std::vector<std::int64_t> more = training_order(*group, after);
    order.insert(order.end(), more.begin(), more.end());
    if (group->is_chief()) testing_mpi::expect_each_record_once_a_pass(order, 512, 2, "resumed on fewer ranks");
  }
  world.barrier();
  if (env().is_chief()) std::filesystem::remove_all(dir);
}

// Determined's rule under an adaptive batch whose steps accumulate micro-batches: an EveryBatch
// scheduler steps once per micro-batch (a batch of the loop), all of a step's at its optimizer
// step, and an EveryOptimizerStep scheduler once per optimizer step; neither ever steps between
// two micro-batches of one step (docs/adaptive.md, "LR schedulers").
TEST(AdaptiveBatch, PerBatchSchedulersStepOnlyWhenTheOptimizerDoes) {
  comm::MpiCommunicator comm(env().world());
  const std::string dir = shared_dir("schedulers");
  std::vector<std::array<std::int64_t, 3>> schedule;
  std::vector<double> lrs;
  std::pair<int, int> scheduled{-1, -1};
  AdaptiveTrial::Options options;
  options.regression = true;
  options.records = 512;
  options.schedule = &schedule;
  options.scheduled = &scheduled;
  options.lrs = &lrs;
  // Micro-batches of 2 records a rank: even the base batch of 16 accumulates several.
  const AdaptiveRun run = train(comm, yaml(16, "max_batch_size: 256, local_batch_size_bounds: [2, 2], "
                                               "gradient_accumulation: true, decision_interval: 4", 80),
                                dir, options);
  ASSERT_EQ(static_cast<std::int64_t>(schedule.size()), run.result.batches_trained);
  std::int64_t most_micro_batches = 0;
  for (std::size_t i = 0; i < schedule.size();) {
    // The micro-batches of optimizer step `step` are i .. end - 1.
    const std::int64_t step = schedule[i][0];
    std::size_t end = i;
    while (end < schedule.size() && schedule[end][0] == step) ++end;
    most_micro_batches = std::max(most_micro_batches, static_cast<std::int64_t>(end - i));
    for (std::size_t j = i; j < end; ++j) {
      EXPECT_EQ(schedule[j][1], static_cast<std::int64_t>(i)) << "EveryBatch at micro-batch " << j << " of step " << step;
      EXPECT_EQ(schedule[j][2], step) << "EveryOptimizerStep at micro-batch " << j << " of step " << step;
    }
    i = end;
  }
  EXPECT_GT(most_micro_batches, 1) << "no step accumulated: the test would not test accumulation";
  EXPECT_EQ(scheduled.first, run.result.batches_trained);
  EXPECT_EQ(scheduled.second, static_cast<int>(lrs.size()));
  if (comm.is_chief()) std::filesystem::remove_all(dir);
  comm.barrier();
}

// Stopped after the ranks measured a gain above 1 and resumed on one rank: one rank measures no
// noise (docs/adaptive.md, "Noise on one rank"), so from the resume on every step trains the base
// batch of 16 without accumulating, at a gain of exactly 1 and AdaScale's learning rate of 0.01,
// and makes one base step of progress - the estimate of the ranks is not used.
TEST(AdaptiveBatch, AResumeOnOneRankTrainsTheBaseBatchAtAGainOfOne) {
  comm::MpiCommunicator world(env().world());
  const std::string dir = shared_dir("one-rank");
  const std::string config = yaml(16, kElastic + ", scaling_rule: adascale", 120);
  AdaptiveTrial::Options options;
  options.signal_after = 40;
  options.signal_rank = world.size() - 1;
  const AdaptiveRun paused = train(world, config, dir, options);
  ASSERT_TRUE(paused.result.stopped_early);
  const std::int64_t stopped_at = paused.result.batches_trained;
  if (world.is_chief()) {
    ASSERT_FALSE(paused.training_lines.empty());
    EXPECT_GT(paused.training_lines.back()["metrics"]["adaptive_gain"].get<double>(), 1.05)
        << "the ranks measured no gain: the test would not test that one rank drops it";
  }
  auto group = world.split(world.rank() == 0 ? 0 : 1, world.rank());
  if (world.rank() == 0) {
    std::vector<double> lrs;
    options.lrs = &lrs;
    options.signal_after = -1;
    const AdaptiveRun rest = train(*group, config, dir, options);
    EXPECT_FALSE(rest.result.stopped_early);
    std::vector<nlohmann::json> resumed;
    for (const auto& line : rest.training_lines) {
      if (line["batches"].get<std::int64_t>() > stopped_at) resumed.push_back(line["metrics"]);
    }
    ASSERT_FALSE(resumed.empty());
    ASSERT_FALSE(lrs.empty());
    double progress = resumed.front()["adaptive_progress"].get<double>();
    for (std::size_t i = 0; i < resumed.size(); ++i) {
      EXPECT_EQ(resumed[i]["adaptive_gain"].get<double>(), 1.0) << "step " << i << " after the resume";
      EXPECT_EQ(resumed[i]["adaptive_batch_size"].get<double>(), 16.0) << "step " << i << " after the resume";
      if (i > 0) {
        progress += 1;
        EXPECT_DOUBLE_EQ(resumed[i]["adaptive_progress"].get<double>(), progress) << "step " << i;
      }
    }
    for (const double lr : lrs) EXPECT_DOUBLE_EQ(lr, 0.01);
    // 120 base steps of progress: the resumed rank makes the rest one step each and ends at the
    // step that reaches them.
    EXPECT_GE(resumed.back()["adaptive_progress"].get<double>(), 120.0);
    EXPECT_LT(resumed.back()["adaptive_progress"].get<double>() - 1.0, 120.0);
    std::filesystem::remove_all(dir);
  }
  world.barrier();
}

}  // namespace adaptive_test
}  // namespace hpctrial::trainer
