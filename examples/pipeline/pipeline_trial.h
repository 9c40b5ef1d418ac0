// The mlp example's classifier as a pipeline: its layers cut into the stages engine.pipeline
// asks for, each rank building and training its own stage's layers; the 1F1B schedule runs a
// global batch's micro-batches through the stages in ModelEngine::train_batch.
#pragma once

#include <torch/torch.h>

#include <hpctrial/trainer.h>

#include <memory>
#include <string>
#include <vector>

namespace pipeline_example {

// features -> hidden -> hidden -> hidden -> classes, GELU between: 8 layers, 4 with parameters.
inline std::vector<hpctrial::LayerSpec> classifier_layers(std::int64_t features, std::int64_t hidden,
                                                          std::int64_t classes) {
  const auto gelu = [] { return hpctrial::LayerSpec::function("gelu", [](const torch::Tensor& x) { return torch::gelu(x); }); };
  return {hpctrial::LayerSpec::of<torch::nn::Linear>(features, hidden), gelu(),
          hpctrial::LayerSpec::of<torch::nn::Linear>(hidden, hidden),   gelu(),
          hpctrial::LayerSpec::of<torch::nn::Linear>(hidden, hidden),   gelu(),
          hpctrial::LayerSpec::of<torch::nn::Linear>(hidden, classes),
          hpctrial::LayerSpec::function("log_softmax", [](const torch::Tensor& x) { return torch::log_softmax(x, 1); })};
}

class ClassifierTrial : public hpctrial::EngineTrial {
 public:
  explicit ClassifierTrial(hpctrial::EngineTrialContext& context) : context_(context) {
    const auto& data = context.data_config();
    const std::string x = data.value("x_dataset", "x");
    const std::string y = data.value("y_dataset", "y");
    train_ = std::make_shared<hpctrial::Hdf5Dataset>(required(data, "train"), x, y);
    validation_ = std::make_shared<hpctrial::Hdf5Dataset>(required(data, "validation"), x, y);
    // Only this rank's stage of the layers is built.
    model_ = context.pipeline_module(
        classifier_layers(train_->sample_shape().at(0), context.hparam<std::int64_t>("hidden"),
                          context.hparam<std::int64_t>("classes")),
        [](const torch::Tensor& output, const torch::Tensor& target) { return torch::nll_loss(output, target); });
    auto optimizer = std::make_shared<torch::optim::AdamW>(
        model_->parameters(), torch::optim::AdamWOptions(context.hparam<double>("learning_rate")).weight_decay(0.01));
    // Stepped by the engine once per global batch.
    auto scheduler = std::make_shared<torch::optim::StepLR>(*optimizer, /*step_size=*/150, /*gamma=*/0.5);
    engine_ = context.wrap_model_engine(std::make_shared<hpctrial::ModelEngine>(model_, optimizer, scheduler));
  }

  // Called once per global batch: every micro-batch through every stage, then one step.
  hpctrial::Metrics train_batch(hpctrial::DataIterator& data, std::int64_t /*epoch_idx*/,
                                std::int64_t /*batch_idx*/) override {
    return {{"loss", engine_->train_batch(data)}};
  }

  hpctrial::Metrics evaluate_batch(hpctrial::DataIterator& data, std::int64_t /*batch_idx*/) override {
    return {{"validation_loss", engine_->eval_batch(data)}};
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
  hpctrial::PipelineModule model_{nullptr};
  std::shared_ptr<hpctrial::ModelEngine> engine_;
};

}  // namespace pipeline_example
