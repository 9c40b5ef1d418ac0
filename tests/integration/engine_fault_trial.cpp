// An engine trial for the fault tests of state spread over the ranks: a small regression trained by
// a ModelEngine (ZeRO as the config's engine section says; Adam, so that the optimizer has state
// to shard) or, with hyperparameters.pipeline, by a PipelineModule in the config's stages. Each
// rank saves a file of its own at every checkpoint (save) holding its rank and the batches it has
// trained; given its file back on a resume (load), it checks that the file is its own and prints
//   rank R took back its file of batch B
// With hyperparameters.batch_ms, each batch also sleeps that long (a trial waiting on its device);
// with hyperparameters.own_files: false, the ranks save no files of their own (so that a
// checkpoint resumes on another number of ranks).
#include <torch/torch.h>

#include <hpctrial/trainer.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <stdexcept>
#include <string>
#include <thread>

namespace {

class EngineFaultTrial : public hpctrial::EngineTrial {
 public:
  explicit EngineFaultTrial(hpctrial::EngineTrialContext& context) : context_(context) {
    auto x = torch::randn({256, 8});
    dataset_ = std::make_shared<hpctrial::TensorDataset>(x, x.sum(1, true));
    if (context.hparams().contains("batch_ms")) batch_ms_ = context.hparam<int>("batch_ms");
    if (context.hparams().contains("own_files")) own_files_ = context.hparam<bool>("own_files");
    std::shared_ptr<torch::nn::Module> model;
    if (context.hparams().contains("pipeline") && context.hparam<bool>("pipeline")) {
      pipeline_ = context.pipeline_module(
          {hpctrial::LayerSpec::of<torch::nn::Linear>(8, 16),
           hpctrial::LayerSpec::function("tanh", [](const torch::Tensor& t) { return torch::tanh(t); }),
           hpctrial::LayerSpec::of<torch::nn::Linear>(16, 16),
           hpctrial::LayerSpec::function("tanh", [](const torch::Tensor& t) { return torch::tanh(t); }),
           hpctrial::LayerSpec::of<torch::nn::Linear>(16, 1)},
          [](const torch::Tensor& output, const torch::Tensor& target) { return torch::mse_loss(output, target); });
      model = pipeline_.ptr();
    } else {
      net_ = torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::Tanh(), torch::nn::Linear(16, 1));
      model = net_.ptr();
    }
    auto optimizer = std::make_shared<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(0.01));
    engine_ = context.wrap_model_engine(std::make_shared<hpctrial::ModelEngine>(model, optimizer));
  }

  hpctrial::Metrics train_batch(hpctrial::DataIterator& data, std::int64_t, std::int64_t batch_idx) override {
    if (batch_ms_ > 0) std::this_thread::sleep_for(std::chrono::milliseconds(batch_ms_));
    batches_ = batch_idx + 1;
    if (pipeline_) return {{"loss", engine_->train_batch(data)}};
    hpctrial::Batch batch = data.next();
    auto loss = torch::mse_loss(net_->forward(batch.data), batch.target);
    engine_->backward(loss);
    engine_->step();
    return {{"loss", loss}};
  }

  hpctrial::Metrics evaluate_batch(hpctrial::DataIterator& data, std::int64_t) override {
    if (pipeline_) return {{"validation_loss", engine_->eval_batch(data)}};
    hpctrial::Batch batch = data.next();
    return {{"validation_loss", torch::mse_loss(net_->forward(batch.data), batch.target)}};
  }

  void save(const std::filesystem::path& path) override {
    if (!own_files_) return EngineTrial::save(path);
    std::ofstream(path / "own.txt") << context_.distributed().rank << " " << batches_ << "\n";
  }
  void load(const std::filesystem::path& path) override {
    if (!own_files_) return EngineTrial::load(path);
    std::ifstream in(path / "own.txt");
    int rank = -1;
    long long batches = -1;
    in >> rank >> batches;
    if (rank != context_.distributed().rank) {
      throw std::runtime_error("rank " + std::to_string(context_.distributed().rank) + " was given rank " +
                               std::to_string(rank) + "'s file");
    }
    batches_ = batches;
    std::printf("rank %d took back its file of batch %lld\n", rank, batches);
    std::fflush(stdout);
  }

  hpctrial::DataLoader build_training_data_loader() override {
    return {dataset_, context_.train_micro_batch_size_per_gpu()};
  }
  hpctrial::DataLoader build_validation_data_loader() override {
    return {dataset_, context_.train_micro_batch_size_per_gpu(), false};
  }

 private:
  hpctrial::EngineTrialContext& context_;
  std::shared_ptr<hpctrial::TensorDataset> dataset_;
  torch::nn::Sequential net_{nullptr};
  hpctrial::PipelineModule pipeline_{nullptr};
  std::shared_ptr<hpctrial::ModelEngine> engine_;
  int batch_ms_ = 0;
  bool own_files_ = true;
  long long batches_ = 0;
};

}  // namespace

HPCTRIAL_MAIN(EngineFaultTrial)
