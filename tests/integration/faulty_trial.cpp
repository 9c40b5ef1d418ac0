// A trial program that fails on purpose, for the fault tests: on rank hyperparameters.fail_rank
// at batch hyperparameters.fail_batch it throws (fail_mode: throw), stops answering
// (fail_mode: hang), or prints bytes that are not UTF-8 and throws an error holding some
// (fail_mode: binary, as a library dying mid-message does); with hyperparameters.fail_node, only
// on that Slurm node. It prints "injected <mode> at <unix ms>" just before. With
// hyperparameters.batch_ms, each batch also sleeps that long (a trial waiting on its device), so
// that the ranks leave the CPU to the scheduler's daemons in the Slurm tests. With
// hyperparameters.full_validation, it validates with evaluate_full_dataset (on the chief). With
// hyperparameters.nan_from_batch, validation after that many batches reports NaN (a diverged run).
// With $FAULTY_TRIAL_START_MS, each rank sleeps that long before main() does anything, as a rank
// still loading its libraries on a busy node does, having created a file named after its pid in
// the folder $FAULTY_TRIAL_START_MARKS.
// A callback's on_validation_end (which runs on the chief alone) halves the learning rate with
// hyperparameters.halve_lr_on_validation (every rank is given it), the model's weights with
// halve_weight_on_validation (replicas made to differ); hyperparameters.nudge_rank and
// nudge_batch change one weight on that rank after that batch (a rank computing differently).
// With data.table, each rank prints the path it was given and the file's first line.
#include <unistd.h>

#include <torch/torch.h>

#include <hpctrial/trainer.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <cstdio>
#include <map>
#include <stdexcept>
#include <string>
#include <thread>

namespace {

class HalveOnValidation : public hpctrial::Callback {
 public:
  HalveOnValidation(torch::optim::Optimizer& optimizer, bool weights) : optimizer_(optimizer), weights_(weights) {}
  void on_validation_end(const hpctrial::MetricValues&) override {
    for (auto& group : optimizer_.param_groups()) {
      if (weights_) {
        torch::NoGradGuard no_grad;
        for (auto& p : group.params()) p.mul_(0.5);
        continue;
      }
      auto& options = static_cast<torch::optim::SGDOptions&>(group.options());
      options.lr(options.lr() / 2);
    }
  }

 private:
  torch::optim::Optimizer& optimizer_;
  bool weights_;
};

class FaultyTrial : public hpctrial::Trial {
 public:
  explicit FaultyTrial(hpctrial::TrialContext& context) : context_(context) {
    auto x = torch::randn({256, 8});
    dataset_ = std::make_shared<hpctrial::TensorDataset>(x, x.sum(1, true));
    model_ = context.wrap_model(torch::nn::Linear(8, 1));
    optimizer_ = context.wrap_optimizer(
        std::make_shared<torch::optim::SGD>(model_->parameters(), torch::optim::SGDOptions(0.01)));
    if (context.data_config().contains("table")) {  // data.stage's tests: which copy it reads
      const std::string path = context.data_config()["table"];
      std::ifstream in(path);
      std::string first;
      std::getline(in, first);
      std::printf("rank %d reads %s: %s\n", context.distributed().rank, path.c_str(), first.c_str());
      std::fflush(stdout);
    }
    if (context.hparams().contains("print_torch_env") && context.hparam<bool>("print_torch_env")) {
      std::string line = "torch env";
      for (const char* name : {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) {
        const char* value = std::getenv(name);
        line += std::string(" ") + name + "=" + (value != nullptr ? value : "unset");
      }
      std::printf("%s\n", line.c_str());
      std::fflush(stdout);
    }
    if (context.hparams().contains("batch_ms")) batch_ms_ = context.hparam<int>("batch_ms");
    if (context.hparams().contains("nan_from_batch")) nan_from_batch_ = context.hparam<std::int64_t>("nan_from_batch");
    if (context.hparams().contains("nudge_rank")) {
      nudge_rank_ = context.hparam<int>("nudge_rank");
      nudge_batch_ = context.hparam<std::int64_t>("nudge_batch");
    }
  }

  std::map<std::string, std::shared_ptr<hpctrial::Callback>> build_callbacks() override {
    const auto flag = [&](const char* name) { return context_.hparams().contains(name) && context_.hparam<bool>(name); };
    if (flag("halve_weight_on_validation")) return {{"halve", std::make_shared<HalveOnValidation>(*optimizer_, true)}};
    if (flag("halve_lr_on_validation")) return {{"halve", std::make_shared<HalveOnValidation>(*optimizer_, false)}};
    return {};
  }

  // hyperparameters.fail_node: the fault fires only on that Slurm node (a node that is bad).
  bool on_fail_node() const {
    if (!context_.hparams().contains("fail_node")) return true;
    const char* node = std::getenv("SLURMD_NODENAME");
    return node != nullptr && context_.hparam<std::string>("fail_node") == node;
  }

  hpctrial::Metrics train_batch(hpctrial::Batch& batch, std::int64_t, std::int64_t batch_idx) override {
    if (context_.distributed().rank == context_.hparam<int>("fail_rank") &&
        batch_idx == context_.hparam<std::int64_t>("fail_batch") && on_fail_node()) {
      const std::string mode = context_.hparam<std::string>("fail_mode");
      const auto now = std::chrono::duration_cast<std::chrono::milliseconds>(
          std::chrono::system_clock::now().time_since_epoch());
      std::printf("injected %s at %lld\n", mode.c_str(), static_cast<long long>(now.count()));
      std::fflush(stdout);
      if (mode == "throw") throw std::runtime_error("injected failure: the batch could not be decoded");
      if (mode == "hang") std::this_thread::sleep_for(std::chrono::minutes(10));
      if (mode == "binary") {
        std::fprintf(stderr, "noise \xff\xfe\xc3 from a dying library\n");
        std::fflush(stderr);
        throw std::runtime_error("undecodable \xff\xc3 bytes");
      }
    }
    if (batch_ms_ > 0) std::this_thread::sleep_for(std::chrono::milliseconds(batch_ms_));
    batches_seen_ = batch_idx + 1;
    auto loss = torch::mse_loss(model_->forward(batch.data), batch.target);
    context_.backward(loss);
    context_.step_optimizer(*optimizer_);
    if (context_.distributed().rank == nudge_rank_ && batch_idx + 1 == nudge_batch_) {
      torch::NoGradGuard no_grad;
      model_->weight.view({-1})[3] += 1e-3;
    }
    return {{"loss", loss}};
  }

  hpctrial::Metrics evaluate_batch(hpctrial::Batch& batch) override {
    if (nan_from_batch_ >= 0 && batches_seen_ >= nan_from_batch_) {
      return {{"validation_loss", torch::tensor(std::nan(""), torch::kFloat64)}};
    }
    return {{"validation_loss", torch::mse_loss(model_->forward(batch.data), batch.target)}};
  }
  torch::nn::Linear& model() { return model_; }
  hpctrial::DataLoader build_training_data_loader() override { return {dataset_, context_.per_slot_batch_size()}; }
  hpctrial::DataLoader build_validation_data_loader() override {
    return {dataset_, context_.per_slot_batch_size(), false};
  }

 private:
  hpctrial::TrialContext& context_;
  std::shared_ptr<hpctrial::TensorDataset> dataset_;
  torch::nn::Linear model_{nullptr};
  std::shared_ptr<torch::optim::SGD> optimizer_;
  int batch_ms_ = 0;
  std::int64_t nan_from_batch_ = -1;
  int nudge_rank_ = -1;
  std::int64_t nudge_batch_ = -1;
  std::int64_t batches_seen_ = 0;
};

// The same trial validating the whole set on the chief. A trial class implements one of the two
// evaluations, so the program picks the class.
class FaultyFullValidationTrial : public FaultyTrial {
 public:
  using FaultyTrial::FaultyTrial;
  hpctrial::Metrics evaluate_batch(hpctrial::Batch& batch) override { return Trial::evaluate_batch(batch); }
  hpctrial::MetricValues evaluate_full_dataset(hpctrial::DataLoader& loader) override {
    const hpctrial::Batch all = loader.dataset().get_batch(std::vector<std::int64_t>{0, 1, 2, 3});
    return {{"validation_loss", torch::mse_loss(model()->forward(all.data), all.target).item<double>()}};
  }
};

}  // namespace

int main(int argc, char** argv) {
  if (const char* start_ms = std::getenv("FAULTY_TRIAL_START_MS")) {
    const char* marks = std::getenv("FAULTY_TRIAL_START_MARKS");
    if (marks) std::ofstream(std::string(marks) + "/" + std::to_string(::getpid()));
    std::this_thread::sleep_for(std::chrono::milliseconds(std::atoll(start_ms)));
  }
  hpctrial::trainer::check_trial_class<FaultyTrial>();
  return hpctrial::trainer::run_main(argc, argv, [](hpctrial::TrialContext& context) -> std::unique_ptr<hpctrial::Trial> {
    if (context.hparams().contains("full_validation") && context.hparam<bool>("full_validation")) {
      return std::make_unique<FaultyFullValidationTrial>(context);
    }
    return std::make_unique<FaultyTrial>(context);
  });
}
