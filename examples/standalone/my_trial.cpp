// A complete trial: a small regression on data it makes itself. Replace the model, the data
// and the two batch functions with your own; HPCTRIAL_MAIN gives the program hpctrial's
// command line, so `hpctrial run experiment.yaml` (or mpirun) trains it.
#include <torch/torch.h>

#include <hpctrial/trainer.h>

namespace {

class MyTrial : public hpctrial::Trial {
 public:
  explicit MyTrial(hpctrial::TrialContext& context) : context_(context) {
    torch::manual_seed(7);
    const auto x = torch::randn({1024, 16});
    const auto y = x.matmul(torch::linspace(-1, 1, 16)).unsqueeze(1) + 0.5;
    data_ = std::make_shared<hpctrial::TensorDataset>(x, y);
    model_ = context.wrap_model(torch::nn::Linear(16, 1));
    optimizer_ = context.wrap_optimizer(std::make_shared<torch::optim::SGD>(
        model_->parameters(), torch::optim::SGDOptions(context.hparam<double>("learning_rate"))));
  }

  hpctrial::Metrics train_batch(hpctrial::Batch& batch, std::int64_t, std::int64_t) override {
    auto loss = torch::mse_loss(model_->forward(batch.data), batch.target);
    context_.backward(loss);
    context_.step_optimizer(*optimizer_);
    return {{"loss", loss}};
  }

  hpctrial::Metrics evaluate_batch(hpctrial::Batch& batch) override {
    return {{"validation_loss", torch::mse_loss(model_->forward(batch.data), batch.target)}};
  }

  hpctrial::DataLoader build_training_data_loader() override { return {data_, context_.per_slot_batch_size()}; }
  hpctrial::DataLoader build_validation_data_loader() override {
    return {data_, context_.per_slot_batch_size(), false};
  }

 private:
  hpctrial::TrialContext& context_;
  std::shared_ptr<hpctrial::TensorDataset> data_;
  torch::nn::Linear model_{nullptr};
  std::shared_ptr<torch::optim::SGD> optimizer_;
};

}  // namespace

HPCTRIAL_MAIN(MyTrial)
