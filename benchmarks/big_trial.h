// The checkpoint benchmarks' trial: a stack of 4096 x 4096 linear layers (64 MiB of float32
// each, no bias) trained with SGD on 64 random samples; optional hooks run before each batch and
// after its optimizer step.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <memory>

#include <hpctrial/trainer.h>

namespace hpctrial_bench {

class BigTrial : public hpctrial::Trial {
 public:
  using Hook = std::function<void(std::int64_t batch_idx)>;
  BigTrial(hpctrial::TrialContext& context, int layers, Hook before = {}, Hook after = {})
      : context_(context), before_(std::move(before)), after_(std::move(after)) {
    torch::nn::Sequential net;
    for (int i = 0; i < layers; ++i) net->push_back(torch::nn::Linear(torch::nn::LinearOptions(4096, 4096).bias(false)));
    model_ = context.wrap_model(net);
    optimizer_ = context.wrap_optimizer(
        std::make_shared<torch::optim::SGD>(model_->parameters(), torch::optim::SGDOptions(1e-6)));
    data_ = std::make_shared<hpctrial::TensorDataset>(torch::randn({64, 4096}), torch::randn({64, 4096}));
  }
  hpctrial::Metrics train_batch(hpctrial::Batch& batch, std::int64_t, std::int64_t batch_idx) override {
    if (before_) before_(batch_idx);
    auto loss = torch::mse_loss(model_->forward(batch.data), batch.target);
    context_.backward(loss);
    context_.step_optimizer(*optimizer_);
    if (after_) after_(batch_idx);
    return {{"loss", loss}};
  }
  hpctrial::Metrics evaluate_batch(hpctrial::Batch& batch) override {
    return {{"validation_loss", torch::mse_loss(model_->forward(batch.data), batch.target)}};
  }
  hpctrial::DataLoader build_training_data_loader() override { return {data_, context_.per_slot_batch_size()}; }
  hpctrial::DataLoader build_validation_data_loader() override { return {data_, 64, false}; }

 private:
  hpctrial::TrialContext& context_;
  Hook before_;
  Hook after_;
  torch::nn::Sequential model_{nullptr};
  std::shared_ptr<torch::optim::SGD> optimizer_;
  std::shared_ptr<hpctrial::TensorDataset> data_;
};

}  // namespace hpctrial_bench
