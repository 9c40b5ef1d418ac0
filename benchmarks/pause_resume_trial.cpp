// The trial that benchmarks/pause_resume submits: hyperparameters.state_mib MiB of float32
// parameters (in 4 MiB tensors, plain SGD, so the checkpoint holds that much state), trained on
// a small regression. Each step touches every parameter (a full gradient, all-reduced, and an
// SGD update), so a checkpoint always holds fresh values. Rank 0 prints the wall-clock time at
// which the first step of each run ends, and, with hyperparameters.timed_steps: T, the time at
// which each of the T steps after it ends:
//   first step of this run: batch N ended at <unix ms>
//   step t of this run: batch M ended at <unix ms>        (t = 1 ... T)
#include <torch/torch.h>

#include <hpctrial/trainer.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

namespace {

constexpr std::int64_t kChunkFloats = 1 << 20;  // 4 MiB of float32

class StateImpl : public torch::nn::Module {
 public:
  explicit StateImpl(std::int64_t mib) : head_(register_module("head", torch::nn::Linear(8, 1))) {
    for (std::int64_t i = 0; i < mib / 4; ++i) {
      chunks_.push_back(register_parameter("chunk" + std::to_string(i), torch::zeros({kChunkFloats})));
    }
  }
  // The head's prediction, plus a small term that gives every state value a gradient.
  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor out = head_->forward(x);
    for (const auto& chunk : chunks_) out = out + 1e-6 * chunk.sum();
    return out;
  }

 private:
  torch::nn::Linear head_;
  std::vector<torch::Tensor> chunks_;
};
TORCH_MODULE(State);

class StateTrial : public hpctrial::Trial {
 public:
  explicit StateTrial(hpctrial::TrialContext& context) : context_(context) {
    auto x = torch::randn({256, 8});
    dataset_ = std::make_shared<hpctrial::TensorDataset>(x, x.sum(1, true));
    model_ = context.wrap_model(State(context.hparam<std::int64_t>("state_mib")));
    // step_ms (optional): the time a step's computation takes on its device, slept before the
    // optimizer steps while the CPU is free (benchmarks/recovery).
    if (context.hparams().contains("step_ms")) step_ms_ = context.hparam<std::int64_t>("step_ms");
    if (context.hparams().contains("timed_steps")) timed_steps_ = context.hparam<std::int64_t>("timed_steps");
    optimizer_ = context.wrap_optimizer(
        std::make_shared<torch::optim::SGD>(model_->parameters(), torch::optim::SGDOptions(0.01)));
  }

  hpctrial::Metrics train_batch(hpctrial::Batch& batch, std::int64_t, std::int64_t batch_idx) override {
    auto loss = torch::mse_loss(model_->forward(batch.data), batch.target);
    context_.backward(loss);
    if (step_ms_ > 0) std::this_thread::sleep_for(std::chrono::milliseconds(step_ms_));
    context_.step_optimizer(*optimizer_);
    const bool timed = steps_ <= timed_steps_;
    if (timed && context_.distributed().rank == 0) {
      const auto now = std::chrono::duration_cast<std::chrono::milliseconds>(
          std::chrono::system_clock::now().time_since_epoch());
      const std::string which = steps_ == 0 ? std::string("first step") : "step " + std::to_string(steps_);
      std::printf("%s of this run: batch %lld ended at %lld\n", which.c_str(), static_cast<long long>(batch_idx),
                  static_cast<long long>(now.count()));
      std::fflush(stdout);
    }
    ++steps_;
    return {{"loss", loss}};
  }

  hpctrial::Metrics evaluate_batch(hpctrial::Batch& batch) override {
    return {{"validation_loss", torch::mse_loss(model_->forward(batch.data), batch.target)}};
  }
  hpctrial::DataLoader build_training_data_loader() override { return {dataset_, context_.per_slot_batch_size()}; }
  hpctrial::DataLoader build_validation_data_loader() override {
    return {dataset_, context_.per_slot_batch_size(), false};
  }

 private:
  hpctrial::TrialContext& context_;
  std::shared_ptr<hpctrial::TensorDataset> dataset_;
  State model_{nullptr};
  std::shared_ptr<torch::optim::SGD> optimizer_;
  std::int64_t steps_ = 0;  // trained in this run
  std::int64_t step_ms_ = 0;
  std::int64_t timed_steps_ = 0;
};

}  // namespace

HPCTRIAL_MAIN(StateTrial)
