// A complete engine trial (Determined's DeepSpeedTrial): a small classifier on data it makes
// itself, trained by a ModelEngine with ZeRO-2 (see experiment.yaml's engine section). Replace
// the model, the data and the two batch functions with your own; HPCTRIAL_MAIN gives the
// program hpctrial's command line, so `hpctrial run experiment.yaml` (or mpirun) trains it.
#include <torch/torch.h>

#include <hpctrial/trainer.h>

namespace {

struct NetImpl : torch::nn::Module {
  NetImpl() : fc1(register_module("fc1", torch::nn::Linear(16, 64))), fc2(register_module("fc2", torch::nn::Linear(64, 4))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc2->forward(torch::relu(fc1->forward(x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Net);

class MyTrial : public hpctrial::EngineTrial {
 public:
  explicit MyTrial(hpctrial::EngineTrialContext& context) : context_(context) {
    torch::manual_seed(7);
    const auto x = torch::randn({2048, 16});
    const auto y = x.narrow(1, 0, 4).argmax(1);  // the class: which of the first 4 features is largest
    data_ = std::make_shared<hpctrial::TensorDataset>(x, y);
    model_ = Net();
    auto optimizer = std::make_shared<torch::optim::AdamW>(
        model_->parameters(), torch::optim::AdamWOptions(context.hparam<double>("learning_rate")));
    engine_ = context.wrap_model_engine(std::make_shared<hpctrial::ModelEngine>(model_, optimizer));
  }

  // Called gradient_accumulation_steps times per global batch, one micro-batch each.
  hpctrial::Metrics train_batch(hpctrial::DataIterator& data, std::int64_t, std::int64_t) override {
    hpctrial::Batch batch = data.next();
    auto loss = torch::cross_entropy_loss(model_->forward(batch.data), batch.target);
    engine_->backward(loss);
    engine_->step();  // steps at the end of the global batch only
    return {{"loss", loss}};
  }

  hpctrial::Metrics evaluate_batch(hpctrial::DataIterator& data, std::int64_t) override {
    hpctrial::Batch batch = data.next();
    const auto logits = model_->forward(batch.data);
    return {{"validation_loss", torch::cross_entropy_loss(logits, batch.target)},
            {"accuracy", logits.argmax(1).eq(batch.target).to(torch::kFloat32).mean()}};
  }

  hpctrial::DataLoader build_training_data_loader() override {
    return {data_, context_.train_micro_batch_size_per_gpu()};
  }
  hpctrial::DataLoader build_validation_data_loader() override { return {data_, 256, false}; }

 private:
  hpctrial::EngineTrialContext& context_;
  std::shared_ptr<hpctrial::TensorDataset> data_;
  Net model_{nullptr};
  std::shared_ptr<hpctrial::ModelEngine> engine_;
};

}  // namespace

HPCTRIAL_MAIN(MyTrial)
