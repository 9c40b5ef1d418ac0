// The mlp example's classifier as an engine trial: a ModelEngine owns the step, accumulating
// gradients over micro-batches and clipping them, as the experiment's engine: section says.
#pragma once

#include <torch/torch.h>

#include <hpctrial/trainer.h>

#include <memory>
#include <string>

namespace engine_example {

struct ClassifierImpl : torch::nn::Module {
  ClassifierImpl(std::int64_t features, std::int64_t hidden, std::int64_t classes)
      : fc1(register_module("fc1", torch::nn::Linear(features, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, hidden))),
        out(register_module("out", torch::nn::Linear(hidden, classes))) {}

  torch::Tensor forward(torch::Tensor x) {
    x = torch::gelu(fc1->forward(x));
    x = torch::gelu(fc2->forward(x));
    return torch::log_softmax(out->forward(x), /*dim=*/1);
  }

  torch::nn::Linear fc1, fc2, out;
};
TORCH_MODULE(Classifier);

class ClassifierTrial : public hpctrial::EngineTrial {
 public:
  explicit ClassifierTrial(hpctrial::EngineTrialContext& context) : context_(context) {
    const auto& data = context.data_config();
    const std::string x = data.value("x_dataset", "x");
    const std::string y = data.value("y_dataset", "y");
    train_ = std::make_shared<hpctrial::Hdf5Dataset>(required(data, "train"), x, y);
    validation_ = std::make_shared<hpctrial::Hdf5Dataset>(required(data, "validation"), x, y);

    model_ = Classifier(train_->sample_shape().at(0), context.hparam<std::int64_t>("hidden"),
                        context.hparam<std::int64_t>("classes"));
    auto optimizer = std::make_shared<torch::optim::AdamW>(
        model_->parameters(), torch::optim::AdamWOptions(context.hparam<double>("learning_rate")).weight_decay(0.01));
    // Stepped by the engine once per global batch.
    auto scheduler = std::make_shared<torch::optim::StepLR>(*optimizer, /*step_size=*/150, /*gamma=*/0.5);
    engine_ = context.wrap_model_engine(std::make_shared<hpctrial::ModelEngine>(model_, optimizer, scheduler));
  }

  // Called gradient_accumulation_steps times per global batch, one micro-batch each.
  hpctrial::Metrics train_batch(hpctrial::DataIterator& data, std::int64_t /*epoch_idx*/,
                                std::int64_t /*batch_idx*/) override {
    hpctrial::Batch batch = data.next();
    auto loss = torch::nll_loss(model_->forward(batch.data), batch.target);
    engine_->backward(loss);
    engine_->step();
    return {{"loss", loss}};
  }

  hpctrial::Metrics evaluate_batch(hpctrial::DataIterator& data, std::int64_t /*batch_idx*/) override {
    hpctrial::Batch batch = data.next();
    auto output = model_->forward(batch.data);
    auto accuracy = output.argmax(1).eq(batch.target).to(torch::kFloat64).mean();
    return {{"validation_loss", torch::nll_loss(output, batch.target)}, {"accuracy", accuracy}};
  }

  hpctrial::DataLoader build_training_data_loader() override {
    return {train_, context_.train_micro_batch_size_per_gpu()};
  }
  hpctrial::DataLoader build_validation_data_loader() override { return {validation_, 256, /*shuffle=*/false}; }

 private:
  static std::string required(const nlohmann::json& data, const std::string& key) {
    if (!data.contains(key) || !data.at(key).is_string()) {
      throw hpctrial::ConfigError("data." + key + ": give the path of the HDF5 file, e.g. data/" + key +
                                  ".h5 (mlp_make_dataset writes a synthetic one)");
    }
    return data.at(key).get<std::string>();
  }

  hpctrial::EngineTrialContext& context_;
  std::shared_ptr<hpctrial::Hdf5Dataset> train_, validation_;
  Classifier model_{nullptr};
  std::shared_ptr<hpctrial::ModelEngine> engine_;
};

}  // namespace engine_example
