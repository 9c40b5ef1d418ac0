// Adaptive batches in engine trials on 2 and 4 ranks: the noise scale and gain a ModelEngine
// measures are the data's at ZeRO stages 0, 1 and 2, with and without accumulated micro-batches; a batch
// that changes shape steps the optimizer once per global batch, sees every record once a pass,
// and trains stages 0 and 1 alike; a stop and resume at stage 2 is bitwise the run not stopped.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "../unit/trainer/test_trial.h"
#include "hpctrial/comm/communicator.h"
#include "hpctrial/trainer/engine_trial.h"
#include "mlp_trial_support.h"
#include "mpi_test_env.h"
#include "record_order.h"

namespace hpctrial::trainer {
namespace engine_adaptive_test {  // named: the target compiles its sources together (UNITY_BUILD)

using testing_mpi::env;
using testing_mpi::training_order;
using testing_mpi::max_relative_difference;
using testing_trial::config_from;

std::string shared_dir(const std::string& name) { return testing_mpi::shared_dir("hpctrial-engine-adaptive", name); }

struct Outcome {
  std::vector<torch::Tensor> parameters;
  std::int64_t global_steps = 0;  // the engine's optimizer steps
};

struct TrialSetup {
  bool regression = false;
  std::int64_t records = 4096;
  std::vector<std::vector<std::int64_t>>* seen = nullptr;  // this rank's indices, global batch by global batch
  Outcome* out = nullptr;
  std::atomic<bool>* stop = nullptr;  // set after global batch `stop_after` on `stop_rank`
  std::int64_t stop_after = -1;
  int stop_rank = 0;
};

// Records x ~ N(mu, sigma^2 I) in 100 dimensions; the loss mean(w.x) has the per-record gradient
// x whatever w is: |G|^2 = 100 mu^2, tr(S) = 100 sigma^2 (as the Trial's test in adaptive_test.cpp).
// The regression trial learns y = x.w* + noise from standard normal records instead.
class NoiseEngineTrial : public EngineTrial {
 public:
  static constexpr int kDims = 100;
  static constexpr double kMu = 0.3, kSigma = 1.0;

  NoiseEngineTrial(EngineTrialContext& context, TrialSetup setup) : context_(context), setup_(setup) {
    torch::manual_seed(11);
    const int dims = setup_.regression ? 8 : kDims;
    auto x = setup_.regression ? torch::randn({setup_.records, dims}) : torch::randn({setup_.records, dims}) * kSigma + kMu;
    auto index = torch::arange(setup_.records, torch::kFloat32).unsqueeze(1);
    auto y = setup_.regression
                 ? x.matmul(torch::linspace(-1, 1, dims)).unsqueeze(1) + 0.5 * torch::randn({setup_.records, 1})
                 : torch::zeros({setup_.records, 1});
    data_ = std::make_shared<TensorDataset>(x, torch::cat({y, index}, 1));
    torch::manual_seed(static_cast<std::int64_t>(context.trial_seed()));
    model_ = torch::nn::Linear(torch::nn::LinearOptions(dims, 1).bias(setup_.regression));
    auto optimizer = std::make_shared<torch::optim::SGD>(model_->parameters(),
                                                         torch::optim::SGDOptions(context.hparam<double>("lr")));
    engine_ = context.wrap_model_engine(std::make_shared<ModelEngine>(model_, optimizer));
  }
  ~NoiseEngineTrial() override {
    if (setup_.out == nullptr) return;
    setup_.out->parameters.clear();
    for (const auto& p : model_->parameters()) setup_.out->parameters.push_back(p.detach().clone());
    setup_.out->global_steps = engine_->global_steps();
  }

  Metrics train_batch(DataIterator& data, std::int64_t, std::int64_t batch_idx) override {
    Batch batch = data.next();
    if (setup_.seen != nullptr) {
      if (batch_idx != last_batch_) setup_.seen->emplace_back();
      const auto index = batch.target.select(1, 1).to(torch::kInt64).contiguous();
      setup_.seen->back().insert(setup_.seen->back().end(), index.data_ptr<std::int64_t>(),
                                 index.data_ptr<std::int64_t>() + index.numel());
    }
    last_batch_ = batch_idx;
    const auto out = model_->forward(batch.data).squeeze(1);
    const auto loss = setup_.regression ? torch::mse_loss(out, batch.target.select(1, 0)) : out.mean();
    engine_->backward(loss);
    engine_->step();
    if (setup_.stop != nullptr && batch_idx == setup_.stop_after && !data.has_next() &&
        context_.distributed().rank == setup_.stop_rank) {
      setup_.stop->store(true);
    }
    return {{"loss", loss}};
  }
  Metrics evaluate_batch(DataIterator& data, std::int64_t) override {
    Batch batch = data.next();
    return {{"validation_loss", torch::mse_loss(model_->forward(batch.data).squeeze(1), batch.target.select(1, 0))}};
  }
  DataLoader build_training_data_loader() override { return {data_, context_.train_micro_batch_size_per_gpu()}; }
  DataLoader build_validation_data_loader() override { return {data_, 64, false}; }

 private:
  EngineTrialContext& context_;
  TrialSetup setup_;
  std::shared_ptr<TensorDataset> data_;
  torch::nn::Linear model_{nullptr};
  std::shared_ptr<ModelEngine> engine_;
  std::int64_t last_batch_ = -1;
};

// A step's time as a fixed cost per micro-batch, a cost per record and an all-reduce.
double modelled_seconds(std::int64_t local_batch, std::int64_t accumulation, int ranks) {
  return static_cast<double>(accumulation) * (0.004 + 0.0001 * static_cast<double>(local_batch)) + (ranks > 1 ? 0.003 : 0);
}

// The same with an all-reduce that costs more than the micro-batches: accumulating amortizes it.
double costly_sync_seconds(std::int64_t local_batch, std::int64_t accumulation, int ranks) {
  return static_cast<double>(accumulation) * (0.0005 + 0.0001 * static_cast<double>(local_batch)) + (ranks > 1 ? 0.02 : 0);
}

struct AdaptiveRun {
  LoopResult result;
  std::vector<nlohmann::json> training_lines;  // the chief's
};

using StepSeconds = double (*)(std::int64_t, std::int64_t, int);

AdaptiveRun train(comm::Communicator& comm, const std::string& yaml, const std::string& dir, TrialSetup setup,
                  StepSeconds step_seconds = modelled_seconds) {
  LoopOptions loop;
  loop.trial_dir = dir;
  loop.progress_interval_s = 0;
  loop.report_period_batches = 1;
  loop.experiment_seed = 3;
  loop.distributed = {comm.rank(), comm.size(), comm.rank(), comm.size(), 1};
  loop.external_stop = setup.stop;
  loop.adaptive_step_seconds = step_seconds;
  loop.adaptive_sync_seconds = step_seconds == costly_sync_seconds ? 0.02 : 0.0;
  TrialFactory factory = [&](TrialContext& context) {
    return std::unique_ptr<Trial>(std::make_unique<detail::EngineTrialRunner>(
        context, [&](EngineTrialContext& c) { return std::make_unique<NoiseEngineTrial>(c, setup); }));
  };
  AdaptiveRun out;
  out.result = run_training(config_from(yaml), factory, comm, loop);
  if (comm.is_chief()) {
    std::ifstream in(dir + "/metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
      auto j = nlohmann::json::parse(line);
      if (j["kind"] == "training") out.training_lines.push_back(j);
    }
  }
  return out;
}

std::string yaml(std::int64_t base, int stage, const std::string& adaptive, std::int64_t length) {
  return "name: adaptive-engine\nentrypoint: ./t\nsearcher: {name: single, metric: validation_loss, max_length: "
         "{batches: " + std::to_string(length) + "}}\nhyperparameters: {global_batch_size: " + std::to_string(base) +
         ", lr: 0.01}\nengine: {zero_optimization: {stage: " + std::to_string(stage) +
         ", stage3_param_persistence_threshold: 0}}\noptimizations:\n  adaptive_batch_size: {enabled: true, " + adaptive + "}\n";
}

// AdaScale's gain for a batch of `batch` records against the base batch `base` on the trial's data.
double analytic_gain(double batch, double base) {
  const double var = NoiseEngineTrial::kDims * NoiseEngineTrial::kSigma * NoiseEngineTrial::kSigma / base;
  const double sqr = NoiseEngineTrial::kDims * NoiseEngineTrial::kMu * NoiseEngineTrial::kMu;
  return (var + sqr) / (var / (batch / base) + sqr);
}

// At every stage, 8 records a micro-batch a rank, in 300 steps:
//   - one micro-batch a step against a base batch of 8: the scale is the number of ranks, and the
//     measured gain is within 10 % of the analytic one;
//   - two micro-batches a step, the base batch itself (the local bound of 8 makes it accumulate):
//     at ZeRO-2 a rank's own gradient is its last micro-batch's alone, and the noise scale
//     measured from it is the data's all the same.
// The noise scale is within 15 % of tr(S) / |G|^2 = 1 / mu^2 records.
TEST(EngineAdaptiveBatch, TheNoiseAnEngineMeasuresIsTheDatasAtEveryStage) {
  comm::MpiCommunicator comm(env().world());
  const int ranks = comm.size();
  for (const int accumulation : {1, 2}) {
    for (const int stage : {0, 1, 2}) {
      const std::string what = "stage " + std::to_string(stage) + ", " + std::to_string(accumulation) + " micro-batch(es)";
      const std::string dir = shared_dir("noise-" + std::to_string(stage) + "-" + std::to_string(accumulation));
      const std::int64_t base = accumulation == 1 ? 8 : 16 * ranks;
      const std::string adaptive = "max_batch_size: " + std::to_string(8 * ranks * accumulation) +
                                   ", local_batch_size_bounds: [8, 8], gradient_accumulation: " +
                                   (accumulation == 1 ? "false" : "true") + ", smoothing: 0.99";
      const AdaptiveRun run = train(comm, yaml(base, stage, adaptive, 300), dir, {});
      if (comm.is_chief()) {
        ASSERT_FALSE(run.training_lines.empty()) << what;
        const auto& last = run.training_lines.back()["metrics"];
        const double batch = last["adaptive_batch_size"].get<double>();
        EXPECT_EQ(batch, 8.0 * ranks * accumulation) << what;
        EXPECT_EQ(last["adaptive_accumulation"].get<double>(), accumulation) << what;
        EXPECT_NEAR(last["adaptive_noise_scale"].get<double>(), 1.0 / (0.3 * 0.3), 0.15 / (0.3 * 0.3)) << what;
        if (accumulation == 1) {
          const double analytic = analytic_gain(batch, static_cast<double>(base));
          EXPECT_NEAR(last["adaptive_gain"].get<double>(), analytic, 0.1 * analytic) << what;
        }
        std::filesystem::remove_all(dir);
      }
      comm.barrier();
    }
  }
}

// From a base batch of 4 on data whose noise scale is 11 records, with all-reduces that cost
// more than micro-batches: the batch grows, past what 8 records a rank make, by accumulating.
const std::string kChanging = "max_batch_size: 256, local_batch_size_bounds: [2, 8], gradient_accumulation: true, "
                              "decision_interval: 4";

// A batch that grows into accumulated micro-batches: each global batch is one optimizer step,
// each pass over the 512 records sees every one once, and stages 0 and 1 (whose ranks measure the
// same whole gradients) choose the same shapes and end with the same weights. Stage 2 trains too.
TEST(EngineAdaptiveBatch, AChangingBatchStepsOnceAGlobalBatchAndSeesEachRecordOnceAPass) {
  comm::MpiCommunicator comm(env().world());
  std::map<int, Outcome> outcomes;
  std::map<int, std::vector<double>> shapes;
  for (const int stage : {0, 1, 2}) {
    const std::string dir = shared_dir("changing-" + std::to_string(stage));
    std::vector<std::vector<std::int64_t>> seen;
    TrialSetup setup;
    setup.records = 512;
    setup.seen = &seen;
    setup.out = &outcomes[stage];
    const AdaptiveRun run = train(comm, yaml(4, stage, kChanging, 160), dir, setup, costly_sync_seconds);
    EXPECT_EQ(outcomes[stage].global_steps, run.result.batches_trained) << "stage " << stage;
    const std::vector<std::int64_t> order = training_order(comm, seen);
    if (comm.is_chief()) {
      std::set<double> accumulations;
      for (const auto& line : run.training_lines) {
        shapes[stage].push_back(line["metrics"]["adaptive_batch_size"].get<double>());
        accumulations.insert(line["metrics"]["adaptive_accumulation"].get<double>());
      }
      EXPECT_GT(std::set<double>(shapes[stage].begin(), shapes[stage].end()).size(), 1u)
          << "stage " << stage << ": " << nlohmann::json(shapes[stage]).dump() << " last "
          << run.training_lines.back().dump();
      EXPECT_GT(*accumulations.rbegin(), 1.0) << "stage " << stage << ": never accumulated";
      testing_mpi::expect_each_record_once_a_pass(order, 512, 2, "stage " + std::to_string(stage));
      std::filesystem::remove_all(dir);
    }
    comm.barrier();
  }
  if (comm.is_chief()) {
    EXPECT_EQ(shapes[0], shapes[1]);
  }
  EXPECT_LT(max_relative_difference(outcomes[0].parameters, outcomes[1].parameters), 1e-5);
}

// ZeRO-2 with a changing, accumulating batch: stopped after global batch 13 (by the chief, then
// by the last rank) and resumed on as many ranks, it ends bitwise where the run not stopped does.
TEST(EngineAdaptiveBatch, AStopAndAResumeAtStageTwoIsBitwiseTheUninterruptedRun) {
  comm::MpiCommunicator comm(env().world());
  const std::string straight_dir = shared_dir("straight");
  TrialSetup base;
  base.records = 512;
  Outcome straight;
  base.out = &straight;
  const AdaptiveRun reference = train(comm, yaml(4, 2, kChanging, 80), straight_dir, base, costly_sync_seconds);
  if (comm.is_chief()) {
    std::set<double> batches;
    for (const auto& line : reference.training_lines) batches.insert(line["metrics"]["adaptive_batch_size"].get<double>());
    EXPECT_GT(batches.size(), 1u) << "the batch never changed: the test would not test a change";
  }
  for (const int stopping_rank : {0, comm.size() - 1}) {
    const std::string dir = shared_dir("stop-" + std::to_string(stopping_rank));
    std::atomic<bool> stop{false};
    Outcome resumed;
    TrialSetup setup = base;
    setup.out = &resumed;
    setup.stop = &stop;
    setup.stop_after = 13;
    setup.stop_rank = stopping_rank;
    const AdaptiveRun paused = train(comm, yaml(4, 2, kChanging, 80), dir, setup, costly_sync_seconds);
    EXPECT_TRUE(paused.result.stopped_early) << "stopped by rank " << stopping_rank;
    stop = false;
    setup.stop_after = -1;
    const AdaptiveRun rest = train(comm, yaml(4, 2, kChanging, 80), dir, setup, costly_sync_seconds);
    EXPECT_FALSE(rest.result.stopped_early);
    ASSERT_EQ(resumed.parameters.size(), straight.parameters.size());
    for (std::size_t i = 0; i < straight.parameters.size(); ++i) {
      EXPECT_TRUE(torch::equal(resumed.parameters[i], straight.parameters[i]))
          << "stopped by rank " << stopping_rank << ": parameter " << i;
    }
    if (comm.is_chief()) std::filesystem::remove_all(dir);
    comm.barrier();
  }
  if (comm.is_chief()) std::filesystem::remove_all(straight_dir);
}

}  // namespace engine_adaptive_test
}  // namespace hpctrial::trainer
