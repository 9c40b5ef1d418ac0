// A multi-layer perceptron classifier on any HDF5 file with a float matrix of samples and an
// integer vector of labels. The experiment's data: section names the files and datasets.
#pragma once

#include <torch/torch.h>

#include <hpctrial/trainer.h>

#include <memory>
#include <string>

namespace mlp_example {

struct MlpImpl : torch::nn::Module {
  MlpImpl(std::int64_t features, std::int64_t hidden, std::int64_t classes)
      : fc1(register_module("fc1", torch::nn::Linear(features, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, hidden))),
        out(register_module("out", torch::nn::Linear(hidden, classes))) {}

  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(fc1->forward(x));
    x = torch::relu(fc2->forward(x));
    return torch::log_softmax(out->forward(x), /*dim=*/1);
  }

  torch::nn::Linear fc1, fc2, out;
};
TORCH_MODULE(Mlp);

class MlpTrial : public hpctrial::Trial {
 public:
  explicit MlpTrial(hpctrial::TrialContext& context) : context_(context) {
    const auto& data = context.data_config();
    const std::string x = data.value("x_dataset", "x");
    const std::string y = data.value("y_dataset", "y");
    train_ = std::make_shared<hpctrial::Hdf5Dataset>(required(data, "train"), x, y);
    validation_ = std::make_shared<hpctrial::Hdf5Dataset>(required(data, "validation"), x, y);

    // A configuration that cannot train is the trial's own verdict: a search replaces it.
    if (context.hparam<std::int64_t>("hidden") < 1) {
      throw hpctrial::InvalidHP("hidden: " + std::to_string(context.hparam<std::int64_t>("hidden")) +
                                " units: the model needs at least one hidden unit");
    }
    model_ = context.wrap_model(Mlp(train_->sample_shape().at(0), context.hparam<std::int64_t>("hidden"),
                                    context.hparam<std::int64_t>("classes")));
    optimizer_ = context.wrap_optimizer(std::make_shared<torch::optim::SGD>(
        model_->parameters(),
        torch::optim::SGDOptions(context.hparam<double>("learning_rate")).momentum(0.9)));
    scheduler_ = context.wrap_lr_scheduler(
        std::make_shared<torch::optim::StepLR>(*optimizer_, /*step_size=*/1, /*gamma=*/0.7),
        hpctrial::StepMode::EveryEpoch);
  }

  hpctrial::Metrics train_batch(hpctrial::Batch& batch, std::int64_t /*epoch_idx*/,
                                std::int64_t /*batch_idx*/) override {
    auto loss = torch::nll_loss(model_->forward(batch.data), batch.target);
    context_.backward(loss);
    context_.step_optimizer(*optimizer_);
    return {{"loss", loss}};
  }

  hpctrial::Metrics evaluate_batch(hpctrial::Batch& batch) override {
    auto output = model_->forward(batch.data);
    auto accuracy = output.argmax(1).eq(batch.target).to(torch::kFloat64).mean();
    return {{"validation_loss", torch::nll_loss(output, batch.target)}, {"accuracy", accuracy}};
  }

  // Batch inference (predict.yaml): each record's log-probabilities and the class it is given.
  hpctrial::Predictions predict_batch(hpctrial::Batch& batch) override {
    auto output = model_->forward(batch.data);
    return {{"log_probabilities", output}, {"class", output.argmax(1)}};
  }

  hpctrial::DataLoader build_training_data_loader() override {
    return {train_, context_.per_slot_batch_size()};
  }
  hpctrial::DataLoader build_validation_data_loader() override {
    return {validation_, context_.per_slot_batch_size(), /*shuffle=*/false};
  }

  Mlp& model() { return model_; }

 private:
  static std::string required(const nlohmann::json& data, const std::string& key) {
    if (!data.contains(key) || !data.at(key).is_string()) {
      throw hpctrial::ConfigError("data." + key + ": give the path of the HDF5 file, e.g. data/" +
                                  key + ".h5 (mlp_make_dataset writes a synthetic one)");
    }
    return data.at(key).get<std::string>();
  }

  hpctrial::TrialContext& context_;
  std::shared_ptr<hpctrial::Hdf5Dataset> train_, validation_;
  Mlp model_{nullptr};
  std::shared_ptr<torch::optim::SGD> optimizer_;
  std::shared_ptr<torch::optim::StepLR> scheduler_;
};

}  // namespace mlp_example
