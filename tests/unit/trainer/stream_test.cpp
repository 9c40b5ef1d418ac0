// StreamDataset: loaders of a stream, and training that pauses and resumes part way through a
// pass (on one rank; tests/mpi/training_loop_mpi_test.cpp has the same on several).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <fstream>

#include "../../support/metric_lines.h"
#include "../../support/temp_dir.h"
#include "hpctrial/checkpoint/format.h"
#include "data/stream_reader.h"
#include "test_trial.h"

namespace hpctrial::trainer {
namespace stream_test {  // named: the target compiles its sources together (UNITY_BUILD)

using testing::ElementsAre;
using testing::HasSubstr;
using testing_support::comparable_metric_lines;
using testing_support::TempDir;
using namespace testing_trial;

// Rows 0..n-1 in order, one pass after another; `empty_pass` yields nothing.
class CountingStream : public StreamDataset {
 public:
  explicit CountingStream(std::int64_t rows, std::int64_t empty_pass = -1) : rows_(rows), empty_pass_(empty_pass) {}
  void start(std::int64_t pass) override {
    passes.push_back(pass);
    next_ = pass == empty_pass_ ? rows_ : 0;
  }
  std::optional<Batch> next() override {
    if (next_ >= rows_) return std::nullopt;
    return Batch(torch::tensor(next_++, torch::kInt64));
  }
  void skip(std::uint64_t count) override {
    skipped.push_back(count);
    next_ = std::min(rows_, next_ + static_cast<std::int64_t>(count));
  }
  std::vector<std::int64_t> passes;
  std::vector<std::uint64_t> skipped;

 private:
  std::int64_t rows_, empty_pass_, next_ = 0;
};

std::vector<std::int64_t> values(const Batch& batch) {
  const auto t = batch.tensor().contiguous();
  return {t.data_ptr<std::int64_t>(), t.data_ptr<std::int64_t>() + t.numel()};
}

TEST(StreamLoader, IteratesPassZeroInBatchesAndDropsTheShortOneOnRequest) {
  auto stream = std::make_shared<CountingStream>(10);
  DataLoader loader(stream, 4);
  EXPECT_TRUE(loader.is_stream());
  std::vector<std::vector<std::int64_t>> batches;
  for (auto batch : loader) batches.push_back(values(batch));
  EXPECT_THAT(batches, ElementsAre(ElementsAre(0, 1, 2, 3), ElementsAre(4, 5, 6, 7), ElementsAre(8, 9)));
  batches.clear();
  for (auto batch : DataLoader(stream, 4, DataLoaderOptions().drop_last(true))) batches.push_back(values(batch));
  EXPECT_THAT(batches, ElementsAre(ElementsAre(0, 1, 2, 3), ElementsAre(4, 5, 6, 7)));
  EXPECT_THAT(stream->passes, ElementsAre(0, 0)) << "each iteration reads pass 0 from its start";
  try {
    loader.dataset();
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("reads a stream (StreamDataset)"));
  }
}

TEST(StreamLoader, TheCollateFunctionStacksAStreamsSamples) {
  DataLoaderOptions options;
  options.collate([](std::vector<Batch> samples) {
    return Batch(torch::tensor(static_cast<std::int64_t>(samples.size()), torch::kInt64));
  });
  std::vector<std::int64_t> sizes;
  for (auto batch : DataLoader(std::make_shared<CountingStream>(5), 2, options)) {
    sizes.push_back(batch.tensor().item<std::int64_t>());
  }
  EXPECT_THAT(sizes, ElementsAre(2, 2, 1));
}

TEST(StreamReader, TrainingGoesOnIntoTheNextPassAndKnowsWhereItStands) {
  auto stream = std::make_shared<CountingStream>(5);
  DataLoader loader(stream, 3);
  detail::StreamReader reader(loader, {}, 0);
  EXPECT_THAT(values(reader.next()), ElementsAre(0, 1, 2));
  EXPECT_THAT(values(reader.next()), ElementsAre(3, 4, 0)) << "the short end of pass 0 is completed from pass 1";
  EXPECT_THAT(values(reader.next()), ElementsAre(1, 2, 3));
  EXPECT_EQ(reader.take_position(), (detail::StreamPosition{0, 3}));
  EXPECT_EQ(reader.take_position(), (detail::StreamPosition{1, 1}));
  EXPECT_EQ(reader.take_position(), (detail::StreamPosition{1, 4}));
  EXPECT_THROW(reader.take_position(), InternalError);

  // Resumed at pass 1, sample 4: the stream is started there and skipped forward.
  auto resumed = std::make_shared<CountingStream>(5);
  DataLoader again(resumed, 3);
  detail::StreamReader from(again, {1, 4}, 0);
  EXPECT_THAT(values(from.next()), ElementsAre(4, 0, 1));
  EXPECT_THAT(resumed->passes, ElementsAre(1, 2));
  EXPECT_THAT(resumed->skipped, ElementsAre(4u));
}

TEST(StreamReader, DropLastStartsTheNextPassInsteadOfAShortBatch) {
  DataLoader loader(std::make_shared<CountingStream>(5), 2, DataLoaderOptions().drop_last(true));
  detail::StreamReader reader(loader, {}, 0);
  EXPECT_THAT(values(reader.next()), ElementsAre(0, 1));
  EXPECT_THAT(values(reader.next()), ElementsAre(2, 3));
  EXPECT_THAT(values(reader.next()), ElementsAre(0, 1));
  reader.take_position();
  reader.take_position();
  EXPECT_EQ(reader.take_position(), (detail::StreamPosition{1, 2}));
}

TEST(StreamReader, APassWithoutSamplesIsAClearErrorNotAHang) {
  DataLoader loader(std::make_shared<CountingStream>(3, /*empty_pass=*/1), 2);
  detail::StreamReader reader(loader, {}, 3);
  reader.next();
  try {
    reader.next();
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("pass 1 of the training stream of rank 3 gave no sample"));
  }
  DataLoader short_passes(std::make_shared<CountingStream>(3), 4, DataLoaderOptions().drop_last(true));
  detail::StreamReader dropping(short_passes, {}, 0);
  try {
    dropping.next();
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("pass 0 of the training stream of rank 0 has 3 sample(s), fewer than one batch of 4"));
  }
}

// 20 rows a pass in batches of 8: batches 2 and 4 span two passes.
std::string stream_yaml(int batches) {
  return base_yaml(batches) + "records_per_epoch: 20\nmin_validation_period: {batches: 3}\n";
}

// Trains `batches` in `dir`, asking to stop after `stop_after` batches (-1: never).
Run train_stream(const std::string& dir, int batches, std::int64_t stop_after, bool drop_last = false) {
  std::atomic<bool> stop{false};
  LinearTrial::Options options;
  options.samples = 20;
  options.stream = true;
  options.drop_last = drop_last;
  options.after_batch = [&](LinearTrial&, std::int64_t batch_idx) {
    if (batch_idx + 1 == stop_after) stop = true;
  };
  comm::LocalCommunicator communicator;
  LoopOptions loop;
  loop.trial_dir = dir;
  loop.experiment_seed = 7;
  loop.progress_interval_s = 0;
  loop.report_period_batches = 2;
  loop.external_stop = &stop;
  Run out;
  options.parameters_out = &out.parameters;
  TrialFactory factory = [&](TrialContext& context) {
    return std::unique_ptr<Trial>(std::make_unique<LinearTrial>(context, options, nullptr));
  };
  out.result = run_training(config_from(stream_yaml(batches)), factory, communicator, loop);
  return out;
}

TEST(StreamTraining, APauseAfterAnyBatchResumesExactlyWhereTheStreamStood) {
  for (const bool drop_last : {false, true}) {
    TempDir straight_dir;
    const testing_trial::Run straight = train_stream(straight_dir.path().string(), 7, -1, drop_last);
    for (std::int64_t stop = 1; stop < 7; ++stop) {
      TempDir dir;
      const testing_trial::Run paused = train_stream(dir.path().string(), 7, stop, drop_last);
      ASSERT_TRUE(paused.result.stopped_early);
      ASSERT_EQ(paused.result.batches_trained, stop);
      const testing_trial::Run resumed = train_stream(dir.path().string(), 7, -1, drop_last);
      ASSERT_EQ(resumed.parameters.size(), straight.parameters.size());
      for (std::size_t i = 0; i < straight.parameters.size(); ++i) {
        EXPECT_TRUE(torch::equal(resumed.parameters[i], straight.parameters[i]))
            << "drop_last " << drop_last << ", stop after batch " << stop << ": parameter " << i << " differs";
      }
      EXPECT_EQ(comparable_metric_lines(resumed.result.metrics_path), comparable_metric_lines(straight.result.metrics_path))
          << "drop_last " << drop_last << ", stop after batch " << stop;
    }
  }
}

TEST(StreamTraining, ThePositionIsInTheCheckpoint) {
  TempDir dir;
  const testing_trial::Run paused = train_stream(dir.path().string(), 7, 3);
  const auto contents = checkpoint::read_checkpoint(paused.result.checkpoint_path);
  const auto progress = nlohmann::json::parse(contents.at("progress", paused.result.checkpoint_path).text());
  // 3 batches of 8 from passes of 20: pass 1, 4 samples in.
  EXPECT_EQ(progress["stream_positions"], nlohmann::json::parse(R"([{"pass": 1, "offset": 4}])"));
}

TEST(StreamTraining, RecordsPerEpochIsRequired) {
  TempDir dir;
  LinearTrial::Options options;
  options.stream = true;
  try {
    run(base_yaml(3), options, dir.path().string());
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("records_per_epoch is required when the training data is a stream"));
  }
}

TEST(StreamTraining, ValidationReadsEachRanksStreamWhole) {
  TempDir dir;
  LinearTrial::Options options;
  options.stream = true;
  options.validation_samples = 12;
  std::int64_t samples = 0;
  options.evaluate = [&](LinearTrial& t, Batch& batch) {
    samples += batch.data.size(0);
    return Metrics{{"validation_loss", torch::mse_loss(t.model->forward(batch.data), batch.target)}};
  };
  run(base_yaml(3) + "records_per_epoch: 64\n", options, dir.path().string());
  EXPECT_EQ(samples, 12) << "one validation, at the end: pass 0 of the validation stream, all of it";
}

// A trial class that validates over the full dataset, made as HPCTRIAL_MAIN makes it.
std::shared_ptr<std::atomic<int>> g_step_starts;
class StepStarts : public Callback {
 public:
  void on_validation_step_start() override { ++*g_step_starts; }
};
class WholeSetTrial : public Trial {
 public:
  explicit WholeSetTrial(TrialContext& context) : context_(context) {
    model_ = context.wrap_model(torch::nn::Linear(3, 1));
    optimizer_ = context.wrap_optimizer(std::make_shared<torch::optim::SGD>(model_->parameters(), 0.1));
    data_ = std::make_shared<TensorDataset>(torch::randn({16, 3}), torch::randn({16, 1}));
  }
  Metrics train_batch(Batch& batch, std::int64_t, std::int64_t) override {
    auto loss = torch::mse_loss(model_->forward(batch.data), batch.target);
    context_.backward(loss);
    context_.step_optimizer(*optimizer_);
    return {{"loss", loss}};
  }
  MetricValues evaluate_full_dataset(DataLoader& loader) override {
    double total = 0;
    for (auto batch : loader) total += torch::mse_loss(model_->forward(batch.data), batch.target).item<double>();
    return {{"validation_loss", total}};
  }
  DataLoader build_training_data_loader() override { return {data_, context_.per_slot_batch_size()}; }
  DataLoader build_validation_data_loader() override { return {data_, context_.per_slot_batch_size(), false}; }
  std::map<std::string, std::shared_ptr<Callback>> build_callbacks() override {
    return {{"steps", std::make_shared<StepStarts>()}};
  }

 private:
  TrialContext& context_;
  torch::nn::Linear model_{nullptr};
  std::shared_ptr<torch::optim::SGD> optimizer_;
  std::shared_ptr<TensorDataset> data_;
};

TEST(TrialClass, AFullDatasetTrialRunsNoValidationStepHook) {
  g_step_starts = std::make_shared<std::atomic<int>>(0);
  TempDir dir;
  comm::LocalCommunicator communicator;
  LoopOptions loop;
  loop.trial_dir = dir.path().string();
  loop.progress_interval_s = 0;
  const auto result = run_training(config_from(base_yaml(4) + "min_validation_period: {batches: 2}\n"),
                                   [](TrialContext& context) { return make_trial<WholeSetTrial>(context); },
                                   communicator, loop);
  EXPECT_TRUE(result.last_validation.count("validation_loss"));
  EXPECT_EQ(*g_step_starts, 0) << "evaluate_full_dataset validates in one call: there is no validation step";
}

}  // namespace stream_test
}  // namespace hpctrial::trainer
