// Batches of every form, collation, datasets read by sample or by batch, loader options, and a
// trial trained on named, nested batches.
#include "hpctrial/trainer/batch.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <atomic>
#include <set>

#include "../../support/temp_dir.h"
#include "hpctrial/trainer/data.h"
#include "test_trial.h"

namespace hpctrial::trainer {
namespace batch_test {  // named: the target compiles its sources together (UNITY_BUILD)

using testing::ElementsAre;
using testing::HasSubstr;
using testing_support::TempDir;
using namespace testing_trial;

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "no error";
}

Batch sample(std::int64_t i) {
  return Batch::map({{"x", torch::full({2}, static_cast<float>(i))},
                     {"parts", Batch::list({torch::tensor(i), Batch(torch::ones({1}) * i, torch::tensor(-i))})}});
}

TEST(Batch, EveryFormAnswersWhatItHolds) {
  const Batch pair(torch::ones({4, 3}), torch::zeros({4}));
  EXPECT_EQ(pair.kind(), Batch::Kind::kPair);
  EXPECT_EQ(pair.size(), 2u);
  EXPECT_EQ(pair.num_samples(), 4);
  EXPECT_EQ(pair.tensors().size(), 2u);

  const Batch one(torch::ones({5}));
  EXPECT_EQ(one.kind(), Batch::Kind::kTensor);
  EXPECT_EQ(one.tensor().size(0), 5);

  const Batch nested = sample(3);
  EXPECT_EQ(nested.kind(), Batch::Kind::kMap);
  EXPECT_THAT(nested.keys(), ElementsAre("x", "parts"));
  EXPECT_TRUE(nested.contains("parts"));
  EXPECT_FALSE(nested.contains("y"));
  EXPECT_EQ(nested["parts"].kind(), Batch::Kind::kList);
  EXPECT_EQ(nested["parts"][0].tensor().item<std::int64_t>(), 3);
  EXPECT_EQ(nested["parts"][1].target.item<std::int64_t>(), -3);
  EXPECT_EQ(nested.tensors().size(), 4u);  // x, the index, and the pair's two
  EXPECT_EQ(nested.num_samples(), 2);
  EXPECT_EQ(Batch().kind(), Batch::Kind::kEmpty);
  EXPECT_EQ(Batch().num_samples(), 0);
}

TEST(Batch, AWrongAccessSaysWhatTheBatchIs) {
  const Batch nested = sample(1);
  EXPECT_THAT(error_of([&] { nested["y"]; }), HasSubstr("batch[\"y\"]: no such entry; the batch is a map {x, parts}"));
  EXPECT_THAT(error_of([&] { nested["parts"][2]; }), HasSubstr("the batch is a sequence of 2"));
  EXPECT_THAT(error_of([&] { nested.tensor(); }), HasSubstr("the batch is a map {x, parts}, not one tensor"));
  EXPECT_THAT(error_of([&] { Batch(torch::ones({1}), torch::ones({1}))[0]; }), HasSubstr("use batch.data and batch.target"));
  EXPECT_THAT(error_of([&] { Batch::map({{"a", torch::ones({1})}, {"a", torch::ones({1})}}); }),
              HasSubstr("the key \"a\" is given twice"));
}

TEST(Batch, MapTensorsKeepsTheStructure) {
  Batch moved = sample(2).map_tensors([](const torch::Tensor& t) { return t.to(torch::kFloat64) + 1; });
  EXPECT_THAT(moved.keys(), ElementsAre("x", "parts"));
  EXPECT_EQ(moved["x"].tensor().scalar_type(), torch::kFloat64);
  EXPECT_DOUBLE_EQ(moved["parts"][0].tensor().item<double>(), 3.0);
  EXPECT_DOUBLE_EQ(moved["parts"][1].target.item<double>(), -1.0);
  // A pair without a target stays without one.
  const Batch unlabelled = Batch(torch::ones({2}), torch::Tensor()).map_tensors([](const torch::Tensor& t) { return t * 2; });
  EXPECT_FALSE(unlabelled.target.defined());
  EXPECT_DOUBLE_EQ(unlabelled.data.sum().item<double>(), 4.0);
}

TEST(Collate, StacksEveryFormLikeDefaultCollate) {
  const Batch batch = collate({sample(0), sample(1), sample(2)});
  EXPECT_THAT(batch.keys(), ElementsAre("x", "parts"));
  EXPECT_EQ(batch["x"].tensor().sizes(), (std::vector<std::int64_t>{3, 2}));
  EXPECT_TRUE(torch::equal(batch["parts"][0].tensor(), torch::tensor({0, 1, 2})));
  EXPECT_EQ(batch["parts"][1].data.sizes(), (std::vector<std::int64_t>{3, 1}));
  EXPECT_TRUE(torch::equal(batch["parts"][1].target, torch::tensor({0, -1, -2})));
}

TEST(Collate, SamplesThatDoNotMatchNameTheSampleAndTheEntry) {
  Batch odd = sample(1);
  odd["x"] = Batch(torch::ones({3}));
  EXPECT_THAT(error_of([&] { collate({sample(0), odd}); }),
              HasSubstr("sample 1 has batch[\"x\"] of shape [3] Float where sample 0 has [2] Float"));
  EXPECT_THAT(error_of([&] { collate({sample(0), Batch(torch::ones({2}))}); }),
              HasSubstr("sample 1 is a tensor [2] at batch where sample 0 is a map {x, parts}"));
  EXPECT_THAT(error_of([] { collate({}); }), HasSubstr("no samples"));
}

// Samples by index only: the default get_batch collates them.
class SampleDataset : public Dataset {
 public:
  explicit SampleDataset(std::uint64_t n) : n_(n) {}
  std::uint64_t size() const override { return n_; }
  Batch get(std::int64_t index) override {
    ++reads;
    return sample(index);
  }
  std::atomic<int> reads{0};

 private:
  std::uint64_t n_;
};

class NeitherDataset : public Dataset {
 public:
  std::uint64_t size() const override { return 4; }
};

TEST(Dataset, ReadsBySampleOrByBatchWhicheverItImplements) {
  SampleDataset by_sample(10);
  const Batch batch = by_sample.get_batch({4, 7});
  EXPECT_TRUE(torch::equal(batch["parts"][0].tensor(), torch::tensor({4, 7})));

  TensorDataset by_batch(torch::arange(12).view({6, 2}), torch::arange(6));
  const Batch one = by_batch.get(4);
  EXPECT_TRUE(torch::equal(one.data, torch::tensor({8, 9})));
  EXPECT_EQ(one.target.item<std::int64_t>(), 4);

  // Only get_batch: the default get takes row 0 of a batch of one.
  class BatchOnly : public Dataset {
   public:
    std::uint64_t size() const override { return 3; }
    Batch get_batch(const std::vector<std::int64_t>& indices) override {
      return Batch::map({{"i", torch::tensor(indices)}});
    }
  } batch_only;
  EXPECT_EQ(batch_only.get(2)["i"].tensor().item<std::int64_t>(), 2);

  NeitherDataset neither;
  EXPECT_THAT(error_of([&] { neither.get_batch({0, 1}); }), HasSubstr("overrides neither get(index) nor get_batch(indices)"));
  EXPECT_THAT(error_of([&] { neither.get(0); }), HasSubstr("overrides neither"));
}

TEST(DataLoader, ACollateFunctionSeesTheSamplesOfEachBatch) {
  auto dataset = std::make_shared<SampleDataset>(10);
  std::vector<std::size_t> seen;
  DataLoader loader(dataset, 4,
                    DataLoaderOptions().shuffle(false).collate([&](std::vector<Batch> samples) {
                      seen.push_back(samples.size());
                      // Only the index of each sample, summed: a reduction no stacking gives.
                      torch::Tensor total = torch::zeros({}, torch::kInt64);
                      for (const auto& s : samples) total += s["parts"][0].tensor();
                      return Batch(total);
                    }));
  std::vector<std::int64_t> totals;
  for (const auto& batch : loader) totals.push_back(batch.tensor().item<std::int64_t>());
  EXPECT_THAT(totals, ElementsAre(0 + 1 + 2 + 3, 4 + 5 + 6 + 7, 8 + 9));
  EXPECT_THAT(seen, ElementsAre(4, 4, 2));
}

TEST(DataLoader, DropLastLeavesOutTheShortBatch) {
  auto dataset = std::make_shared<SampleDataset>(10);
  DataLoader loader(dataset, 4, DataLoaderOptions().drop_last(true));
  std::vector<std::int64_t> sizes;
  for (const auto& batch : loader) sizes.push_back(batch.num_samples());
  EXPECT_THAT(sizes, ElementsAre(4, 4));
  DataLoader exact(dataset, 5, DataLoaderOptions().drop_last(true));
  sizes.clear();
  for (const auto& batch : exact) sizes.push_back(batch.num_samples());
  EXPECT_THAT(sizes, ElementsAre(5, 5));
}

// Regression on samples {"x": features, "extra": [index, weight]}, "y": target}.
class NamedSampleDataset : public Dataset {
 public:
  explicit NamedSampleDataset(std::int64_t n) {
    torch::manual_seed(0);
    x_ = torch::randn({n, 3});
    y_ = x_.matmul(torch::tensor({1.0f, -2.0f, 0.5f})).unsqueeze(1) + 0.3;
  }
  std::uint64_t size() const override { return static_cast<std::uint64_t>(x_.size(0)); }
  Batch get(std::int64_t i) override {
    return Batch::map({{"x", x_[i]}, {"extra", Batch::list({torch::tensor(i), torch::ones({1})})}, {"y", y_[i]}});
  }

 private:
  torch::Tensor x_, y_;
};

struct NamedRecord {
  std::vector<std::vector<std::int64_t>> train_indices;  // per batch
  std::vector<std::int64_t> epochs;
  std::vector<torch::Tensor> parameters;
};

class NamedBatchTrial : public Trial {
 public:
  NamedBatchTrial(TrialContext& context, DataLoaderOptions options, NamedRecord* record)
      : context_(context), options_(std::move(options)), record_(record) {
    dataset_ = std::make_shared<NamedSampleDataset>(60);
    torch::manual_seed(static_cast<std::int64_t>(context.trial_seed()));
    model_ = context.wrap_model(torch::nn::Linear(3, 1));
    optimizer_ = context.wrap_optimizer(
        std::make_shared<torch::optim::SGD>(model_->parameters(), torch::optim::SGDOptions(0.05)));
  }
  ~NamedBatchTrial() override {
    for (const auto& p : model_->parameters()) record_->parameters.push_back(p.detach().clone());
  }

  Metrics train_batch(Batch& batch, std::int64_t epoch_idx, std::int64_t) override {
    const auto indices = batch["extra"][0].tensor();
    record_->train_indices.emplace_back(indices.data_ptr<std::int64_t>(), indices.data_ptr<std::int64_t>() + indices.numel());
    record_->epochs.push_back(epoch_idx);
    const auto prediction = model_->forward(batch["x"].tensor()) * batch["extra"][1].tensor();
    auto loss = torch::mse_loss(prediction, batch["y"].tensor());
    context_.backward(loss);
    context_.step_optimizer(*optimizer_);
    return {{"loss", loss}};
  }
  Metrics evaluate_batch(Batch& batch) override {
    return {{"validation_loss", torch::mse_loss(model_->forward(batch["x"].tensor()), batch["y"].tensor())},
            {"samples", static_cast<double>(batch.num_samples())}};
  }
  ReducerSpec evaluation_reducer() override {
    return std::map<std::string, Reducer>{{"samples", Reducer::kSum}};
  }
  DataLoader build_training_data_loader() override { return {dataset_, context_.per_slot_batch_size(), options_}; }
  DataLoader build_validation_data_loader() override {
    return {dataset_, context_.per_slot_batch_size(), DataLoaderOptions(options_).shuffle(false)};
  }

 private:
  TrialContext& context_;
  DataLoaderOptions options_;
  NamedRecord* record_;
  std::shared_ptr<Dataset> dataset_;
  torch::nn::Linear model_{nullptr};
  std::shared_ptr<torch::optim::SGD> optimizer_;
};

LoopResult run_named(const std::string& yaml, const DataLoaderOptions& options, const std::string& dir,
                     NamedRecord* record, std::size_t prefetch_depth = 2) {
  comm::LocalCommunicator communicator;
  LoopOptions loop;
  loop.trial_dir = dir;
  loop.experiment_seed = 3;
  loop.progress_interval_s = 0;
  loop.prefetch_depth = prefetch_depth;
  TrialFactory factory = [&](TrialContext& context) {
    return std::unique_ptr<Trial>(std::make_unique<NamedBatchTrial>(context, options, record));
  };
  return run_training(config_from(yaml), factory, communicator, loop);
}

TEST(NamedBatches, TrainTheSameWithAnyNumberOfWorkersAndWithACustomCollate) {
  const std::string yaml = base_yaml(20, 8);
  NamedRecord serial, threaded, collated;
  TempDir a, b, c;
  run_named(yaml, DataLoaderOptions(), a.path().string(), &serial, /*prefetch_depth=*/0);
  run_named(yaml, DataLoaderOptions().workers(3), b.path().string(), &threaded, 4);
  run_named(yaml, DataLoaderOptions().workers(2).collate([](std::vector<Batch> samples) { return collate(samples); }),
            c.path().string(), &collated);
  ASSERT_EQ(serial.train_indices.size(), 20u);
  EXPECT_EQ(serial.train_indices, threaded.train_indices);
  EXPECT_EQ(serial.train_indices, collated.train_indices);
  ASSERT_EQ(serial.parameters.size(), threaded.parameters.size());
  for (std::size_t i = 0; i < serial.parameters.size(); ++i) {
    EXPECT_TRUE(torch::equal(serial.parameters[i], threaded.parameters[i]));
    EXPECT_TRUE(torch::equal(serial.parameters[i], collated.parameters[i]));
  }
}

TEST(NamedBatches, DropLastMakesEpochsWholeBatchesAndSkipsTheShortValidationBatch) {
  // 60 samples, global batch 8: epochs of 7 batches (56 samples); 16 batches reach epoch 2.
  NamedRecord record;
  TempDir dir;
  const LoopResult result =
      run_named(base_yaml(16, 8), DataLoaderOptions().drop_last(true), dir.path().string(), &record);
  ASSERT_EQ(record.epochs.size(), 16u);
  EXPECT_EQ(record.epochs[6], 0);
  EXPECT_EQ(record.epochs[7], 1);
  EXPECT_EQ(record.epochs[13], 1);
  EXPECT_EQ(record.epochs[14], 2);
  // Each epoch's 56 samples are distinct: no batch spans two epochs.
  std::set<std::int64_t> first_epoch;
  for (int b = 0; b < 7; ++b) first_epoch.insert(record.train_indices[b].begin(), record.train_indices[b].end());
  EXPECT_EQ(first_epoch.size(), 56u);
  EXPECT_DOUBLE_EQ(result.last_validation.at("samples"), 56.0);

  NamedRecord whole;
  TempDir other;
  const LoopResult all = run_named(base_yaml(16, 8), DataLoaderOptions(), other.path().string(), &whole);
  EXPECT_EQ(whole.epochs[7], 0);  // 60-sample epochs: batch 7 starts in epoch 0
  EXPECT_DOUBLE_EQ(all.last_validation.at("samples"), 60.0);
}

TEST(NamedBatches, DropLastWithAnEpochSmallerThanTheBatchIsAClearError) {
  NamedRecord record;
  TempDir dir;
  EXPECT_THAT(error_of([&] { run_named(base_yaml(4, 64), DataLoaderOptions().drop_last(true), dir.path().string(), &record); }),
              HasSubstr("drop_last with an epoch of 60 records and a global batch of 64 leaves no batch"));
}

}  // namespace batch_test
}  // namespace hpctrial::trainer
