// A small trial for the trainer's tests: linear regression on in-memory data, recording what
// the loop asks of it.
#pragma once

#include <torch/torch.h>

#include <hpctrial/trainer.h>

#include <algorithm>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "hpctrial/core/experiment_config.h"
#include "hpctrial/comm/communicator.h"
#include "hpctrial/trainer/random.h"
#include "hpctrial/trainer/training_loop.h"

namespace hpctrial::trainer::testing_trial {

// An experiment config from YAML text; fails the test on any config error.
inline core::ExperimentConfig config_from(const std::string& yaml) {
  core::Diagnostics d;
  const core::ConfigNode root = core::parse_config_text(yaml, "test.yaml", d);
  core::ExperimentConfig config = core::parse_experiment_config(root, d);
  if (!d.empty()) throw ConfigError(d.to_string());
  return config;
}

inline std::string base_yaml(int batches, int global_batch = 8) {
  return "name: test\nentrypoint: ./t\nsearcher: {name: single, metric: validation_loss, "
         "max_length: {batches: " + std::to_string(batches) + "}}\nhyperparameters: "
         "{global_batch_size: " + std::to_string(global_batch) + ", lr: 0.1}\n";
}

// Counts the steps of an LR scheduler (and halves nothing: learning rates stay).
class CountingScheduler : public torch::optim::LRScheduler {
 public:
  explicit CountingScheduler(torch::optim::Optimizer& optimizer) : LRScheduler(optimizer) {}
  int steps = 0;

 protected:
  std::vector<double> get_lrs() override {
    ++steps;
    return get_current_lrs();
  }
};

// A stream over the rows of (x, y): each pass is a permutation of the rows that depends on the
// pass and the seed only, and rank r of W reads its entries r, r + W, r + 2W, ...
class TensorStream : public StreamDataset {
 public:
  TensorStream(torch::Tensor x, torch::Tensor y, int rank, int size, std::uint64_t seed)
      : x_(std::move(x)), y_(std::move(y)), rank_(rank), size_(size), seed_(seed) {}

  void start(std::int64_t pass) override {
    order_.resize(static_cast<std::size_t>(x_.size(0)));
    std::iota(order_.begin(), order_.end(), 0);
    Rng rng(derive_seed(seed_, static_cast<std::uint64_t>(pass)));
    for (std::size_t i = order_.size(); i > 1; --i) std::swap(order_[i - 1], order_[rng.bounded(i)]);
    next_ = static_cast<std::size_t>(rank_);
    ++starts;
  }
  std::optional<Batch> next() override {
    if (next_ >= order_.size()) return std::nullopt;
    const std::int64_t row = order_[next_];
    next_ += static_cast<std::size_t>(size_);
    return Batch(x_[row], y_[row]);
  }

  int starts = 0;

 private:
  torch::Tensor x_, y_;
  int rank_, size_;
  std::uint64_t seed_;
  std::vector<std::int64_t> order_;
  std::size_t next_ = 0;
};

struct Record {
  std::vector<std::string> events;
  std::vector<std::pair<bool, bool>> epoch_flags;  // (is_epoch_start, is_epoch_end) per batch
  std::vector<std::int64_t> epoch_idx;
  std::vector<std::int64_t> batch_idx;
};

class LinearTrial : public Trial {
 public:
  struct Options {
    std::int64_t samples = 64;
    std::int64_t validation_samples = 0;  // the first N samples validate; 0: all of them
    bool evaluate_by_batch = true;
    bool evaluate_full = false;
    // Training and validation data as TensorStreams, sharded over the ranks.
    bool stream = false;
    bool drop_last = false;
    std::function<void(LinearTrial&)> setup;
    std::function<Metrics(LinearTrial&, Batch&)> evaluate;
    std::function<void(LinearTrial&, std::int64_t batch_idx)> after_batch;
    // Metrics train_batch reports besides the loss.
    std::function<void(Metrics&)> training_metrics;
    std::map<std::string, std::shared_ptr<Callback>> callbacks;
    ReducerSpec reducer = Reducer::kAvg;
    // Receives copies of the final parameters when the loop is done with the trial.
    std::vector<torch::Tensor>* parameters_out = nullptr;
  };

  LinearTrial(TrialContext& context, Options options, Record* record)
      : context_(context), options_(std::move(options)), record_(record) {
    torch::manual_seed(0);  // the data, not the weights: the weights follow the trial seed
    auto x = torch::randn({options_.samples, 3});
    auto y = x.matmul(torch::tensor({1.0f, -2.0f, 0.5f})).unsqueeze(1) + 0.3;
    dataset_ = std::make_shared<TensorDataset>(x, y);
    const std::int64_t n = options_.validation_samples > 0 ? options_.validation_samples : options_.samples;
    validation_set_ = std::make_shared<TensorDataset>(x.slice(0, 0, n), y.slice(0, 0, n));
    torch::manual_seed(static_cast<std::int64_t>(context.trial_seed()));
    model = context.wrap_model(torch::nn::Linear(3, 1));
    optimizer = context.wrap_optimizer(std::make_shared<torch::optim::SGD>(
        model->parameters(), torch::optim::SGDOptions(context.hparam<double>("lr"))));
    if (options_.setup) options_.setup(*this);
  }

  ~LinearTrial() override {
    if (options_.parameters_out != nullptr) {
      for (const auto& p : model->parameters()) options_.parameters_out->push_back(p.detach().clone());
    }
  }

  Metrics train_batch(Batch& batch, std::int64_t epoch_idx, std::int64_t batch_idx) override {
    if (record_) {
      record_->epoch_flags.emplace_back(context_.is_epoch_start(), context_.is_epoch_end());
      record_->epoch_idx.push_back(epoch_idx);
      record_->batch_idx.push_back(batch_idx);
    }
    auto loss = torch::mse_loss(model->forward(batch.data), batch.target);
    context_.backward(loss);
    context_.step_optimizer(*optimizer);
    if (options_.after_batch) options_.after_batch(*this, batch_idx);
    if (options_.training_metrics) {
      Metrics metrics = loss;
      options_.training_metrics(metrics);
      return metrics;
    }
    return loss;  // a bare loss tensor: reported as "loss"
  }

  Metrics evaluate_batch(Batch& batch) override {
    if (!options_.evaluate_by_batch) return Trial::evaluate_batch(batch);
    if (options_.evaluate) return options_.evaluate(*this, batch);
    return {{"validation_loss", torch::mse_loss(model->forward(batch.data), batch.target)}};
  }

  MetricValues evaluate_full_dataset(DataLoader& loader) override {
    if (!options_.evaluate_full) return Trial::evaluate_full_dataset(loader);
    double total = 0;
    std::int64_t count = 0;
    for (auto batch : loader) {
      total += torch::mse_loss(model->forward(batch.data), batch.target, torch::Reduction::Sum).item<double>();
      count += batch.data.size(0);
    }
    return {{"validation_loss", total / static_cast<double>(count)}, {"samples", static_cast<double>(count)}};
  }

  DataLoader build_training_data_loader() override {
    if (options_.stream) {
      return {stream(*dataset_, context_.trial_seed()), context_.per_slot_batch_size(),
              DataLoaderOptions().drop_last(options_.drop_last)};
    }
    return {dataset_, context_.per_slot_batch_size(), DataLoaderOptions().drop_last(options_.drop_last)};
  }
  DataLoader build_validation_data_loader() override {
    if (options_.stream) return {stream(*validation_set_, 0), context_.per_slot_batch_size()};
    return {validation_set_, context_.per_slot_batch_size(), false};
  }
  std::shared_ptr<TensorStream> stream(TensorDataset& rows, std::uint64_t seed) {
    const auto all = rows.get_batch([&] {
      std::vector<std::int64_t> indices(rows.size());
      std::iota(indices.begin(), indices.end(), 0);
      return indices;
    }());
    return std::make_shared<TensorStream>(all.data, all.target, context_.distributed().rank,
                                          context_.distributed().size, seed);
  }
  std::map<std::string, std::shared_ptr<Callback>> build_callbacks() override { return options_.callbacks; }
  ReducerSpec evaluation_reducer() override { return options_.reducer; }

  TrialContext& context_;
  Options options_;
  Record* record_;
  std::shared_ptr<TensorDataset> dataset_;
  std::shared_ptr<TensorDataset> validation_set_;
  torch::nn::Linear model{nullptr};
  std::shared_ptr<torch::optim::SGD> optimizer;
};

// Runs the loop on one rank with a fresh trial.
struct Run {
  LoopResult result;
  std::vector<torch::Tensor> parameters;
};

inline Run run(const std::string& yaml, LinearTrial::Options options, const std::string& trial_dir,
               Record* record = nullptr, std::uint32_t seed = 7) {
  const core::ExperimentConfig config = config_from(yaml);
  comm::LocalCommunicator communicator;
  LoopOptions loop;
  loop.trial_dir = trial_dir;
  loop.experiment_seed = seed;
  loop.progress_interval_s = 0;
  Run out;
  options.parameters_out = &out.parameters;
  TrialFactory factory = [&](TrialContext& context) {
    return std::unique_ptr<Trial>(std::make_unique<LinearTrial>(context, options, record));
  };
  out.result = run_training(config, factory, communicator, loop);
  return out;
}

}  // namespace hpctrial::trainer::testing_trial
