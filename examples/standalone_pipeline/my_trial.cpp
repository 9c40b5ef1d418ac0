// A complete pipeline trial (Determined's DeepSpeedTrial with a PipelineEngine): a small
// classifier on data it makes itself, given as a list of layers that engine.pipeline cuts into
// stages, one stage a rank (see experiment.yaml). Each rank builds only its own stage's layers;
// engine.train_batch runs a global batch's micro-batches through the stages (the 1F1B schedule)
// and steps once. Replace the layers, the loss and the data with your own; HPCTRIAL_MAIN gives the
// program hpctrial's command line, so `hpctrial run experiment.yaml` (or mpirun) trains it.
#include <torch/torch.h>

#include <hpctrial/trainer.h>

namespace {

// 16 features -> 64 -> 64 -> 4 classes, ReLU between: 5 layers, 3 with parameters. A layer is a
// module type and its constructor's arguments, or a function of a tensor.
std::vector<hpctrial::LayerSpec> layers() {
  const auto relu = [] { return hpctrial::LayerSpec::function("relu", [](const torch::Tensor& x) { return torch::relu(x); }); };
  return {hpctrial::LayerSpec::of<torch::nn::Linear>(16, 64), relu(),
          hpctrial::LayerSpec::of<torch::nn::Linear>(64, 64), relu(),
          hpctrial::LayerSpec::of<torch::nn::Linear>(64, 4)};
}

class MyTrial : public hpctrial::EngineTrial {
 public:
  explicit MyTrial(hpctrial::EngineTrialContext& context) : context_(context) {
    torch::manual_seed(7);
    const auto x = torch::randn({2048, 16});
    const auto y = x.narrow(1, 0, 4).argmax(1);  // the class: which of the first 4 features is largest
    data_ = std::make_shared<hpctrial::TensorDataset>(x, y);
    // This rank's stage of the layers; the last stage computes the loss.
    model_ = context.pipeline_module(layers(), [](const torch::Tensor& logits, const torch::Tensor& target) {
      return torch::cross_entropy_loss(logits, target);
    });
    auto optimizer = std::make_shared<torch::optim::AdamW>(
        model_->parameters(), torch::optim::AdamWOptions(context.hparam<double>("learning_rate")));
    engine_ = context.wrap_model_engine(std::make_shared<hpctrial::ModelEngine>(model_, optimizer));
  }

  // Called once per global batch: every micro-batch through every stage, then one step. The
  // loss is the last stage's, on every rank.
  hpctrial::Metrics train_batch(hpctrial::DataIterator& data, std::int64_t, std::int64_t) override {
    return {{"loss", engine_->train_batch(data)}};
  }

  hpctrial::Metrics evaluate_batch(hpctrial::DataIterator& data, std::int64_t) override {
    return {{"validation_loss", engine_->eval_batch(data)}};
  }

  // The first stage reads the inputs, the last the labels; the loader's batch is a micro-batch.
  hpctrial::DataLoader build_training_data_loader() override {
    return {data_, context_.train_micro_batch_size_per_gpu()};
  }
  hpctrial::DataLoader build_validation_data_loader() override { return {data_, 256, false}; }

 private:
  hpctrial::EngineTrialContext& context_;
  std::shared_ptr<hpctrial::TensorDataset> data_;
  hpctrial::PipelineModule model_{nullptr};
  std::shared_ptr<hpctrial::ModelEngine> engine_;
};

}  // namespace

HPCTRIAL_MAIN(MyTrial)
