// A small convolutional classifier on image-shaped HDF5 data: `x` (N x C x H x W, H and W
// multiples of 4) and `y` (N). The experiment's data: section names the files and datasets.
#pragma once

#include <torch/torch.h>

#include <hpctrial/trainer.h>

#include <memory>
#include <string>

namespace cnn_example {

struct CnnImpl : torch::nn::Module {
  CnnImpl(std::int64_t channels, std::int64_t height, std::int64_t width, std::int64_t classes)
      : conv1(register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(channels, 8, 3).padding(1)))),
        conv2(register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(8, 16, 3).padding(1)))),
        out(register_module("out", torch::nn::Linear(16 * (height / 4) * (width / 4), classes))) {}

  torch::Tensor forward(torch::Tensor x) {
    x = torch::max_pool2d(torch::relu(conv1->forward(x)), 2);
    x = torch::max_pool2d(torch::relu(conv2->forward(x)), 2);
    return torch::log_softmax(out->forward(x.flatten(1)), /*dim=*/1);
  }

  torch::nn::Conv2d conv1, conv2;
  torch::nn::Linear out;
};
TORCH_MODULE(Cnn);

class CnnTrial : public hpctrial::Trial {
 public:
  explicit CnnTrial(hpctrial::TrialContext& context) : context_(context) {
    const auto& data = context.data_config();
    const std::string x = data.value("x_dataset", "x");
    const std::string y = data.value("y_dataset", "y");
    train_ = std::make_shared<hpctrial::Hdf5Dataset>(required(data, "train"), x, y);
    validation_ = std::make_shared<hpctrial::Hdf5Dataset>(required(data, "validation"), x, y);
    const auto shape = train_->sample_shape();
    if (shape.size() != 3 || shape[1] % 4 != 0 || shape[2] % 4 != 0) {
      throw hpctrial::ConfigError("data.train: dataset '" + x + "' must hold images C x H x W with H and W "
                                  "multiples of 4");
    }
    model_ = context.wrap_model(Cnn(shape[0], shape[1], shape[2], context.hparam<std::int64_t>("classes")));
    optimizer_ = context.wrap_optimizer(std::make_shared<torch::optim::Adam>(
        model_->parameters(), torch::optim::AdamOptions(context.hparam<double>("learning_rate"))));
  }

  hpctrial::Metrics train_batch(hpctrial::Batch& batch, std::int64_t, std::int64_t) override {
    auto loss = torch::nll_loss(model_->forward(batch.data), batch.target);
    context_.backward(loss);
    context_.step_optimizer(*optimizer_, [](std::vector<torch::Tensor>& parameters) {
      torch::nn::utils::clip_grad_norm_(parameters, 5.0);
    });
    return {{"loss", loss}};
  }

  hpctrial::Metrics evaluate_batch(hpctrial::Batch& batch) override {
    auto output = model_->forward(batch.data);
    return {{"validation_loss", torch::nll_loss(output, batch.target)},
            {"accuracy", output.argmax(1).eq(batch.target).to(torch::kFloat64).mean()}};
  }

  hpctrial::DataLoader build_training_data_loader() override {
    return {train_, context_.per_slot_batch_size()};
  }
  hpctrial::DataLoader build_validation_data_loader() override {
    return {validation_, context_.per_slot_batch_size(), /*shuffle=*/false};
  }

  Cnn& model() { return model_; }

 private:
  static std::string required(const nlohmann::json& data, const std::string& key) {
    if (!data.contains(key) || !data.at(key).is_string()) {
      throw hpctrial::ConfigError("data." + key + ": give the path of the HDF5 file, e.g. data/" + key +
                                  ".h5 (cnn_make_dataset writes a synthetic one)");
    }
    return data.at(key).get<std::string>();
  }

  hpctrial::TrialContext& context_;
  std::shared_ptr<hpctrial::Hdf5Dataset> train_, validation_;
  Cnn model_{nullptr};
  std::shared_ptr<torch::optim::Adam> optimizer_;
};

}  // namespace cnn_example
