#include "hpctrial/trainer/training_loop.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>


#include <atomic>
#include <fstream>
#include <thread>

#include "parallel/autocast.h"
#include "../../support/temp_dir.h"
#include "test_trial.h"

namespace hpctrial::trainer {
namespace training_loop_test {  // named: the target compiles its sources together (UNITY_BUILD)

using testing::ElementsAre;
using testing::HasSubstr;
using testing_support::TempDir;
using namespace testing_trial;

std::vector<nlohmann::json> metric_lines(const std::string& path) {
  std::ifstream in(path);
  std::vector<nlohmann::json> lines;
  std::string line;
  while (std::getline(in, line)) lines.push_back(nlohmann::json::parse(line));
  return lines;
}

class RecordingCallback : public Callback {
 public:
  explicit RecordingCallback(std::vector<std::string>* events) : events_(events) {}
  void on_training_start() override { events_->push_back("training_start"); }
  void on_training_epoch_start(std::int64_t e) override { events_->push_back("epoch_start " + std::to_string(e)); }
  void on_training_epoch_end(std::int64_t e) override { events_->push_back("epoch_end " + std::to_string(e)); }
  void on_validation_start() override { events_->push_back("validation_start"); }
  void on_validation_end(const MetricValues& m) override {
    events_->push_back("validation_end " + std::to_string(m.count("validation_loss")));
  }
  void on_trial_shutdown() override { events_->push_back("shutdown"); }
  nlohmann::json state_dict() const override { return {{"events", events_->size()}}; }
  void load_state_dict(const nlohmann::json& state) override { loaded = state; }
  nlohmann::json loaded;

 private:
  std::vector<std::string>* events_;
};

TEST(TrainingLoop, CallbacksSeeEveryPhaseInOrder) {
  TempDir dir;
  std::vector<std::string> events;
  LinearTrial::Options options;
  options.callbacks = {{"recorder", std::make_shared<RecordingCallback>(&events)}};
  // 64 samples, batches of 16: 4 batches an epoch; 10 batches; validation every 4 batches.
  run(base_yaml(10, 16) + "min_validation_period: {batches: 4}\n", options, dir.path().string());
  EXPECT_THAT(events, ElementsAre("training_start", "epoch_start 0", "epoch_end 0", "validation_start",
                                  "validation_end 1", "epoch_start 1", "epoch_end 1", "validation_start",
                                  "validation_end 1", "epoch_start 2", "validation_start",
                                  "validation_end 1", "shutdown"));
}

TEST(TrainingLoop, ValidatesByTimeWhenThePeriodIsInSeconds) {
  TempDir dir;
  LinearTrial::Options options;
  options.after_batch = [](LinearTrial&, std::int64_t) { std::this_thread::sleep_for(std::chrono::milliseconds(20)); };
  // 60 batches of >= 20 ms: at least 1.2 s, so a 1-second period validates once mid-run.
  const auto result = run(base_yaml(60) + "min_validation_period: {seconds: 1}\n", options, dir.path().string());
  std::vector<std::int64_t> at;
  for (const auto& line : metric_lines(result.result.metrics_path)) {
    if (line["kind"] == "validation") at.push_back(line["batches"]);
  }
  ASSERT_GE(at.size(), 2u);
  // Batches take at least 20 ms, so a second has passed by batch 50 at the latest, however
  // loaded the machine is.
  EXPECT_LE(at.front(), 50);
  EXPECT_EQ(at.back(), 60);  // and at the end
}

TEST(TrainingLoop, CallbackStateRoundTrips) {
  std::vector<std::string> events = {"a", "b"};
  RecordingCallback callback(&events);
  const nlohmann::json state = callback.state_dict();
  RecordingCallback restored(&events);
  restored.load_state_dict(state);
  EXPECT_EQ(restored.loaded, (nlohmann::json{{"events", 2}}));
  EXPECT_TRUE(Callback().state_dict().is_null());
}

TEST(TrainingLoop, EpochFlagsAndIndices) {
  TempDir dir;
  Record record;
  run(base_yaml(6, 24), {}, dir.path().string(), &record);  // 64 samples, batches of 24
  // Batches start at records 0, 24, 48 | 72, 96, 120 (epochs of 64): the epoch of a batch is
  // that of its first record; the batch whose successor starts a new epoch ends its epoch.
  EXPECT_THAT(record.epoch_idx, ElementsAre(0, 0, 0, 1, 1, 1));
  EXPECT_THAT(record.batch_idx, ElementsAre(0, 1, 2, 3, 4, 5));
  EXPECT_EQ(record.epoch_flags[0], std::make_pair(true, false));
  EXPECT_EQ(record.epoch_flags[1], std::make_pair(false, false));
  EXPECT_EQ(record.epoch_flags[2], std::make_pair(false, true));
  EXPECT_EQ(record.epoch_flags[3], std::make_pair(true, false));
  EXPECT_EQ(record.epoch_flags[4], std::make_pair(false, false));
  EXPECT_EQ(record.epoch_flags[5], std::make_pair(false, true));  // 144 is in epoch 2
}

TEST(TrainingLoop, SchedulersStepByTheirMode) {
  TempDir dir;
  std::shared_ptr<CountingScheduler> every_batch, every_epoch, manual;
  LinearTrial::Options options;
  options.setup = [&](LinearTrial& t) {
    every_batch = t.context_.wrap_lr_scheduler(std::make_shared<CountingScheduler>(*t.optimizer), StepMode::EveryBatch);
    every_epoch = t.context_.wrap_lr_scheduler(std::make_shared<CountingScheduler>(*t.optimizer), StepMode::EveryEpoch);
    manual = t.context_.wrap_lr_scheduler(std::make_shared<CountingScheduler>(*t.optimizer), StepMode::Manual);
  };
  run(base_yaml(10, 16), options, dir.path().string());  // 4 batches an epoch: epochs end at 4, 8
  EXPECT_EQ(every_batch->steps, 10);
  EXPECT_EQ(every_epoch->steps, 2);
  EXPECT_EQ(manual->steps, 0);
}

// Determined's rule with aggregation_frequency 2: an EveryBatch scheduler steps twice when the
// optimizer steps and never between the two batches of a group; EveryOptimizerStep once a group.
TEST(TrainingLoop, SchedulersNeverStepInsideAnAggregationGroup) {
  TempDir dir;
  std::shared_ptr<CountingScheduler> every_batch, every_step;
  std::vector<std::pair<int, int>> seen;  // (EveryBatch, EveryOptimizerStep) steps as each batch starts
  LinearTrial::Options options;
  options.setup = [&](LinearTrial& t) {
    every_batch = t.context_.wrap_lr_scheduler(std::make_shared<CountingScheduler>(*t.optimizer), StepMode::EveryBatch);
    every_step =
        t.context_.wrap_lr_scheduler(std::make_shared<CountingScheduler>(*t.optimizer), StepMode::EveryOptimizerStep);
  };
  options.after_batch = [&](LinearTrial&, std::int64_t) { seen.emplace_back(every_batch->steps, every_step->steps); };
  run(base_yaml(10, 16) + "optimizations: {aggregation_frequency: 2}\n", options, dir.path().string());
  EXPECT_EQ(every_batch->steps, 10);
  EXPECT_EQ(every_step->steps, 5);
  using P = std::pair<int, int>;
  EXPECT_THAT(seen, ElementsAre(P{0, 0}, P{0, 0}, P{2, 1}, P{2, 1}, P{4, 2}, P{4, 2}, P{6, 3}, P{6, 3}, P{8, 4},
                                P{8, 4}));
}

TEST(TrainingLoop, LengthsInEpochsAndRecords) {
  TempDir dir;
  Record by_epochs, by_records;
  run("name: t\nentrypoint: ./t\nsearcher: {name: single, metric: validation_loss, max_length: {epochs: 2}}\n"
      "hyperparameters: {global_batch_size: 10, lr: 0.1}\n", {}, (dir.path() / "epochs").string(), &by_epochs);
  EXPECT_EQ(by_epochs.batch_idx.size(), 13u);  // ceil(2 * 64 / 10)
  run("name: t\nentrypoint: ./t\nsearcher: {name: single, metric: validation_loss, max_length: {records: 95}}\n"
      "hyperparameters: {global_batch_size: 10, lr: 0.1}\nrecords_per_epoch: 32\n", {}, (dir.path() / "records").string(),
      &by_records);
  ASSERT_EQ(by_records.batch_idx.size(), 10u);  // ceil(95 / 10)
  EXPECT_EQ(by_records.epoch_idx.back(), 2);     // 90 / 32
}

TEST(TrainingLoop, WritesTrainingValidationAndTimingLines) {
  TempDir dir;
  const auto result = run(base_yaml(250, 8) + "min_validation_period: {batches: 100}\n", {}, dir.path().string());
  const auto lines = metric_lines(result.result.metrics_path);
  std::vector<std::string> kinds;
  std::vector<std::int64_t> batches;
  for (const auto& line : lines) {
    kinds.push_back(line["kind"]);
    batches.push_back(line["batches"]);
  }
  EXPECT_THAT(kinds, ElementsAre("training", "validation", "training", "validation", "training",
                                 "validation", "timings"));
  EXPECT_THAT(batches, ElementsAre(100, 100, 200, 200, 250, 250, 250));
  EXPECT_EQ(lines[0]["records"], 800);
  EXPECT_EQ(lines[0]["epoch"], 12);  // batch 99 starts at record 792: epoch 792 / 64
  EXPECT_TRUE(lines[0]["metrics"]["loss"].is_number()) << "the trial returns its loss tensor bare";
  EXPECT_LT(lines[5]["metrics"]["validation_loss"].get<double>(), lines[1]["metrics"]["validation_loss"].get<double>());
  for (const char* phase : {"dataloader_next", "to_device", "train_batch", "step_lr_schedulers",
                            "from_device", "reduce_metrics", "validation"}) {
    EXPECT_TRUE(lines.back()["timings"].contains(phase)) << phase;
    EXPECT_GE(lines.back()["timings"][phase]["total_s"].get<double>(), 0.0);
  }
  EXPECT_EQ(lines.back()["timings"]["train_batch"]["count"], 250);
  EXPECT_EQ(result.result.last_validation.count("validation_loss"), 1u);
}

TEST(TrainingLoop, TwoRunsAreBitwiseIdenticalAndSeedsMatter) {
  TempDir a, b, c;
  const auto first = run(base_yaml(40), {}, a.path().string());
  const auto second = run(base_yaml(40), {}, b.path().string());
  const auto other = run(base_yaml(40), {}, c.path().string(), nullptr, /*seed=*/8);
  ASSERT_EQ(first.parameters.size(), 2u);
  for (std::size_t i = 0; i < first.parameters.size(); ++i) {
    EXPECT_TRUE(torch::equal(first.parameters[i], second.parameters[i])) << i;
  }
  EXPECT_FALSE(torch::equal(first.parameters[0], other.parameters[0]));
}

// configure_mixed_precision(torch::kBFloat16): forward computes in bfloat16 in train_batch and
// evaluate_batch, the weights and gradients stay float32, backward and the rest of the loop run
// without autocast, and two runs are bitwise equal.
TEST(TrainingLoop, MixedPrecisionRunsTheBatchFunctionsUnderBfloat16Autocast) {
  TempDir a, b, c;
  std::vector<c10::ScalarType> trained, evaluated, gradients;
  std::vector<bool> autocast_in_backward;
  LinearTrial::Options options;
  options.setup = [&](LinearTrial& t) {
    t.context_.configure_mixed_precision(torch::kBFloat16);
    t.model->weight.register_hook([&](torch::Tensor grad) {
      autocast_in_backward.push_back(trainer::detail::autocast_enabled(c10::DeviceType::CPU));
      return grad;
    });
  };
  options.after_batch = [&](LinearTrial& t, std::int64_t) {
    trained.push_back(t.model->forward(torch::ones({1, 3})).scalar_type());
    gradients.push_back(t.model->weight.grad().scalar_type());
  };
  options.evaluate = [&](LinearTrial& t, Batch& batch) -> Metrics {
    const auto out = t.model->forward(batch.data);
    evaluated.push_back(out.scalar_type());
    return {{"validation_loss", torch::mse_loss(out.to(torch::kFloat32), batch.target)}};
  };
  const auto first = run(base_yaml(40), options, a.path().string());
  EXPECT_FALSE(trainer::detail::autocast_enabled(c10::DeviceType::CPU));
  ASSERT_EQ(trained.size(), 40u);
  EXPECT_EQ(trained.front(), torch::kBFloat16);
  EXPECT_EQ(trained.back(), torch::kBFloat16);
  EXPECT_EQ(gradients.back(), torch::kFloat32);
  ASSERT_EQ(autocast_in_backward.size(), 40u);
  EXPECT_EQ(std::count(autocast_in_backward.begin(), autocast_in_backward.end(), true), 0);
  ASSERT_FALSE(evaluated.empty());
  EXPECT_EQ(evaluated.back(), torch::kBFloat16);
  for (const auto& p : first.parameters) EXPECT_EQ(p.scalar_type(), torch::kFloat32);
  // The same run again: bitwise equal; in float32: close, but not equal.
  const auto second = run(base_yaml(40), options, b.path().string());
  options.setup = nullptr;
  const auto full = run(base_yaml(40), options, c.path().string());
  ASSERT_EQ(first.parameters.size(), 2u);
  for (std::size_t i = 0; i < first.parameters.size(); ++i) {
    EXPECT_TRUE(torch::equal(first.parameters[i], second.parameters[i])) << i;
    EXPECT_TRUE(torch::allclose(first.parameters[i], full.parameters[i], /*rtol=*/0.05, /*atol=*/0.05)) << i;
  }
  EXPECT_FALSE(torch::equal(first.parameters[0], full.parameters[0]));
  EXPECT_EQ(trained.size(), 120u);
  EXPECT_EQ(trained.back(), torch::kFloat32);
}

TEST(TrialContext, MixedPrecisionOnTheCpuIsBfloat16OrNone) {
  TempDir dir;
  LinearTrial::Options options;
  std::string half, integer;
  options.setup = [&](LinearTrial& t) {
    try {
      t.context_.configure_mixed_precision(torch::kFloat16);
    } catch (const NotSupported& e) {
      half = e.what();
    }
    try {
      t.context_.configure_mixed_precision(torch::kInt32);
    } catch (const ConfigError& e) {
      integer = e.what();
    }
    t.context_.configure_mixed_precision(torch::kBFloat16);
    t.context_.configure_mixed_precision(torch::kFloat32);
    EXPECT_EQ(t.context_.mixed_precision(), c10::ScalarType::Undefined);
  };
  run(base_yaml(2), options, dir.path().string());
  EXPECT_THAT(half, HasSubstr("configure_mixed_precision(torch::kFloat16) on the CPU: LibTorch's CPU autocast "
                              "computes in bfloat16 only; use torch::kBFloat16"));
  EXPECT_THAT(integer, HasSubstr("configure_mixed_precision: Int is not a mixed precision"));
}

TEST(TrainingLoop, ReducersPerMetric) {
  TempDir dir;
  LinearTrial::Options options;
  int batch = 0;
  options.evaluate = [&](LinearTrial&, Batch&) -> Metrics {
    const double v = ++batch;  // 8 validation batches: 1..8
    return {{"validation_loss", v}, {"sum", v}, {"max", v}, {"min", v}};
  };
  options.reducer = std::map<std::string, Reducer>{{"sum", Reducer::kSum}, {"max", Reducer::kMax}, {"min", Reducer::kMin}};
  const auto result = run(base_yaml(1, 8), options, dir.path().string());
  const MetricValues& m = result.result.last_validation;
  EXPECT_DOUBLE_EQ(m.at("validation_loss"), 4.5);
  EXPECT_DOUBLE_EQ(m.at("sum"), 36.0);
  EXPECT_DOUBLE_EQ(m.at("max"), 8.0);
  EXPECT_DOUBLE_EQ(m.at("min"), 1.0);
}

// Counts how many values exceeded a threshold, as a (count, total) pair per rank.
class ExceedanceReducer : public MetricReducer {
 public:
  void update(double v) {
    total_ += 1;
    count_ += v > 2.0 ? 1 : 0;
  }
  void reset() override { count_ = total_ = 0; ++resets; }
  nlohmann::json per_slot_reduce() override { return {count_, total_}; }
  MetricValue cross_slot_reduce(const std::vector<nlohmann::json>& per_slot) override {
    double c = 0, t = 0;
    for (const auto& s : per_slot) c += s[0].get<double>(), t += s[1].get<double>();
    return c / t;
  }
  int resets = 0;

 private:
  double count_ = 0, total_ = 0;
};

TEST(TrainingLoop, CustomReducersInValidationAndTraining) {
  TempDir dir;
  auto custom = std::make_shared<ExceedanceReducer>();
  std::shared_ptr<FunctionReducer> median;
  LinearTrial::Options options;
  int batch = 0;
  options.setup = [&](LinearTrial& t) {
    t.context_.wrap_reducer(custom, "share_above_2", /*for_training=*/false);
    median = t.context_.wrap_reducer(
        [](const std::vector<nlohmann::json>& values) {
          std::vector<double> v;
          for (const auto& value : values) v.push_back(value.get<double>());
          std::sort(v.begin(), v.end());
          return v.empty() ? 0.0 : v[v.size() / 2];
        },
        "median_batch");
  };
  options.evaluate = [&](LinearTrial&, Batch&) -> Metrics {
    const double v = ++batch;
    custom->update(v);
    median->update(v);
    return {{"validation_loss", v}};
  };
  options.after_batch = [&](LinearTrial&, std::int64_t batch_idx) { median->update(static_cast<double>(batch_idx)); };
  const auto result = run(base_yaml(5, 8), options, dir.path().string());
  EXPECT_DOUBLE_EQ(result.result.last_validation.at("share_above_2"), 6.0 / 8.0);
  EXPECT_DOUBLE_EQ(result.result.last_validation.at("median_batch"), 5.0);  // of 1..8
  const auto lines = metric_lines(result.result.metrics_path);
  EXPECT_DOUBLE_EQ(lines[0]["metrics"]["median_batch"].get<double>(), 2.0);  // of batches 0..4
  EXPECT_FALSE(lines[0]["metrics"].contains("share_above_2"));
  EXPECT_GE(custom->resets, 1);
}

// A custom training reducer's partial period travels in the checkpoint: paused after batch 3
// and resumed, the report at batch 6 covers batches 0..5 as an uninterrupted run's does.
TEST(TrainingLoop, CustomTrainingReducersResumeTheirPeriod) {
  auto train = [](const std::string& dir, std::int64_t stop_after) {
    std::shared_ptr<FunctionReducer> sum;
    LinearTrial::Options options;
    options.setup = [&](LinearTrial& t) {
      sum = t.context_.wrap_reducer(
          [](const std::vector<nlohmann::json>& values) {
            double total = 0;
            for (const auto& v : values) total += v.get<double>();
            return total;
          },
          "batch_sum", /*for_training=*/true, /*for_validation=*/false);
    };
    std::atomic<bool> stop{false};
    options.after_batch = [&](LinearTrial&, std::int64_t batch_idx) {
      sum->update(static_cast<double>(batch_idx));
      if (batch_idx + 1 == stop_after) stop = true;
    };
    const core::ExperimentConfig config = config_from(base_yaml(6));
    comm::LocalCommunicator communicator;
    LoopOptions loop;
    loop.trial_dir = dir;
    loop.progress_interval_s = 0;
    loop.report_period_batches = 6;
    loop.external_stop = &stop;
    TrialFactory factory = [&](TrialContext& context) {
      return std::unique_ptr<Trial>(std::make_unique<LinearTrial>(context, options, nullptr));
    };
    return run_training(config, factory, communicator, loop);
  };
  TempDir straight, paused;
  train(straight.path().string(), -1);
  EXPECT_TRUE(train(paused.path().string(), 3).stopped_early);
  const auto resumed = train(paused.path().string(), -1);
  auto training_sum = [](const std::string& path) {
    for (const auto& line : metric_lines(path)) {
      if (line["kind"] == "training") return line["metrics"]["batch_sum"].get<double>();
    }
    return -1.0;
  };
  EXPECT_DOUBLE_EQ(training_sum(straight.path().string() + "/metrics.jsonl"), 0 + 1 + 2 + 3 + 4 + 5);
  EXPECT_DOUBLE_EQ(training_sum(resumed.metrics_path), 0 + 1 + 2 + 3 + 4 + 5)
      << "the report after the resume lost the batches before the pause";
}

TEST(TrainingLoop, TheContextKnowsTheRunAndTheBatch) {
  TempDir dir;
  nlohmann::json config;
  std::vector<std::int64_t> current;
  std::int64_t aggregation = 0;
  LinearTrial::Options options;
  options.setup = [&](LinearTrial& t) {
    config = t.context_.experiment_config();
    aggregation = t.context_.aggregation_frequency();
  };
  options.after_batch = [&](LinearTrial& t, std::int64_t) { current.push_back(t.context_.current_train_batch()); };
  run(base_yaml(3) + "optimizations: {aggregation_frequency: 3}\n", options, dir.path().string());
  EXPECT_EQ(config["searcher"]["metric"], "validation_loss");
  EXPECT_EQ(config["searcher"]["max_length"]["batches"], 3);
  EXPECT_EQ(config["hyperparameters"]["lr"], 0.1);
  EXPECT_EQ(config["optimizations"]["aggregation_frequency"], 3);
  EXPECT_EQ(aggregation, 3);
  EXPECT_THAT(current, ElementsAre(0, 1, 2));
}

TEST(TrainingLoop, EvaluateFullDatasetRunsWhenEvaluateBatchIsNotOverridden) {
  TempDir dir;
  LinearTrial::Options options;
  options.evaluate_by_batch = false;
  options.evaluate_full = true;
  const auto result = run(base_yaml(3), options, dir.path().string());
  EXPECT_EQ(result.result.last_validation.at("samples"), 64.0);
  EXPECT_GT(result.result.last_validation.at("validation_loss"), 0.0);
}

// Which evaluation a trial class implements is known when it is compiled: HPCTRIAL_MAIN and
// TrialRegistry::add refuse (static_assert) a class with both or neither.
struct ValidatesByBatch : Trial {
  Metrics evaluate_batch(Batch&) override { return {}; }
};
struct ValidatesWholeSet : Trial {
  MetricValues evaluate_full_dataset(DataLoader&) override { return {}; }
};
struct ValidatesBothWays : ValidatesByBatch {
  MetricValues evaluate_full_dataset(DataLoader&) override { return {}; }
};
struct ValidatesNot : Trial {};

TEST(TrialClass, WhichEvaluationItOverridesIsKnownAtCompileTime) {
  static_assert(overrides_evaluate_batch<ValidatesByBatch>() && !overrides_evaluate_full_dataset<ValidatesByBatch>());
  static_assert(!overrides_evaluate_batch<ValidatesWholeSet>() && overrides_evaluate_full_dataset<ValidatesWholeSet>());
  static_assert(overrides_evaluate_batch<ValidatesBothWays>() && overrides_evaluate_full_dataset<ValidatesBothWays>(),
                "an override in a base between the class and Trial counts");
  static_assert(!overrides_evaluate_batch<ValidatesNot>() && !overrides_evaluate_full_dataset<ValidatesNot>());
  check_trial_class<ValidatesByBatch>();
  check_trial_class<ValidatesWholeSet>();
  SUCCEED();
}

TEST(TrainingLoop, NoEvaluationIsAClearError) {
  TempDir dir;
  LinearTrial::Options options;
  options.evaluate_by_batch = false;
  try {
    run(base_yaml(3), options, dir.path().string());
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("overrides neither evaluate_batch nor evaluate_full_dataset"));
  }
}

TEST(TrainingLoop, AMissingSearcherMetricNamesWhatWasReported) {
  TempDir dir;
  try {
    run("name: t\nentrypoint: ./t\nsearcher: {name: single, metric: accuracy, max_length: {batches: 2}}\n"
        "hyperparameters: {global_batch_size: 8, lr: 0.1}\n", {}, dir.path().string());
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("searcher.metric is 'accuracy' but validation reported only: validation_loss"));
  }
}

// A training metric is one number a batch; an evaluation metric keeps one shape; the searcher
// compares numbers: each mistake is a ConfigError naming the metric and the shapes.
TEST(TrainingLoop, MetricsOfTheWrongShapeNameTheMetricAndTheShapes) {
  const auto error_of = [](const std::string& yaml, const LinearTrial::Options& options) {
    TempDir dir;
    try {
      run(yaml, options, dir.path().string());
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  LinearTrial::Options vector_in_training;
  vector_in_training.training_metrics = [](Metrics& m) { m.emplace("per_output", torch::zeros({2})); };
  EXPECT_THAT(error_of(base_yaml(2), vector_in_training),
              HasSubstr("train_batch returned the metric 'per_output' with shape [2]; a training metric is one number "
                        "a batch"));
  LinearTrial::Options growing;
  int batch = 0;
  growing.evaluate = [&](LinearTrial&, Batch&) -> Metrics {
    return {{"validation_loss", 1.0}, {"per_class", torch::zeros({2 + batch++})}};
  };
  EXPECT_THAT(error_of(base_yaml(2), growing),
              HasSubstr("evaluate_batch returned the metric 'per_class' with shape [3] after [2] on rank 0; a metric "
                        "has one shape in every batch"));
  LinearTrial::Options vector_searched;
  vector_searched.evaluate = [](LinearTrial&, Batch&) -> Metrics { return {{"validation_loss", torch::ones({2})}}; };
  EXPECT_THAT(error_of(base_yaml(2), vector_searched),
              HasSubstr("searcher.metric is 'validation_loss', which validation reported as [1.0,1.0], not a single "
                        "number"));
}

// set_stop_requested ends the trial (Determined's semantics), unlike a stop from outside: it is
// validated and checkpointed as complete, and running it again trains nothing.
TEST(TrainingLoop, SetStopRequestedEndsTheTrialCompleteAtTheStepBoundary) {
  TempDir dir;
  LinearTrial::Options options;
  options.after_batch = [](LinearTrial& t, std::int64_t batch_idx) {
    if (batch_idx == 4) t.context_.set_stop_requested(true);
  };
  Record record;
  const auto result = run(base_yaml(100), options, dir.path().string(), &record);
  EXPECT_TRUE(result.result.ended_by_trial);
  EXPECT_FALSE(result.result.stopped_early) << "a trial that ends itself is not paused";
  EXPECT_EQ(result.result.batches_trained, 5);
  EXPECT_EQ(record.batch_idx.size(), 5u);
  EXPECT_EQ(result.result.last_validation.count("validation_loss"), 1u) << "validated at its end";
  EXPECT_EQ(result.result.checkpoint_path, dir.path().string() + "/checkpoints/ckpt-5.h5");

  Record again;
  const auto rerun = run(base_yaml(100), LinearTrial::Options{}, dir.path().string(), &again);
  EXPECT_TRUE(rerun.result.ended_by_trial);
  EXPECT_EQ(rerun.result.batches_trained, 5);
  EXPECT_TRUE(again.batch_idx.empty()) << "a trial that ended itself was resumed";
}

// With aggregation, the trial's request also waits for the end of the group.
TEST(TrainingLoop, SetStopRequestedWaitsForTheEndOfTheAggregationGroup) {
  TempDir dir;
  LinearTrial::Options options;
  options.after_batch = [](LinearTrial& t, std::int64_t batch_idx) {
    if (batch_idx == 4) t.context_.set_stop_requested(true);
  };
  const auto result = run(base_yaml(100) + "optimizations: {aggregation_frequency: 4}\n", options, dir.path().string());
  EXPECT_TRUE(result.result.ended_by_trial);
  EXPECT_EQ(result.result.batches_trained, 8);
}

TEST(TrainingLoop, AnExternalStopFlagIsHonoured) {
  TempDir dir;
  std::atomic<bool> stop{true};
  const core::ExperimentConfig config = config_from(base_yaml(100));
  comm::LocalCommunicator communicator;
  LoopOptions loop;
  loop.trial_dir = dir.path().string();
  loop.progress_interval_s = 0;
  loop.external_stop = &stop;
  TrialFactory factory = [](TrialContext& context) {
    return std::unique_ptr<Trial>(std::make_unique<LinearTrial>(context, LinearTrial::Options{}, nullptr));
  };
  const LoopResult result = run_training(config, factory, communicator, loop);
  EXPECT_TRUE(result.stopped_early);
  EXPECT_EQ(result.batches_trained, 1);
}

TEST(TrainingLoop, AggregationFrequencyStepsEveryNthBatch) {
  TempDir dir;
  std::vector<torch::Tensor> weights;
  LinearTrial::Options options;
  options.after_batch = [&](LinearTrial& t, std::int64_t) { weights.push_back(t.model->weight.detach().clone()); };
  run(base_yaml(6) + "optimizations: {aggregation_frequency: 3}\n", options, dir.path().string());
  ASSERT_EQ(weights.size(), 6u);
  EXPECT_TRUE(torch::equal(weights[0], weights[1]));   // accumulating
  EXPECT_FALSE(torch::equal(weights[1], weights[2]));  // stepped after the 3rd batch
  EXPECT_TRUE(torch::equal(weights[2], weights[4]));
  EXPECT_FALSE(torch::equal(weights[4], weights[5]));
}

}  // namespace training_loop_test
}  // namespace hpctrial::trainer
