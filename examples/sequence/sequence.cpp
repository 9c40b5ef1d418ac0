// Sequence classification with batches that are not a (data, target) pair.
//
// Each sample is a map {"tokens": a sequence of 4 to 24 token ids, "label": 0 or 1}: class 0
// draws its tokens from ids 0-19, class 1 from ids 12-31. Sequences differ in length, so the
// loader's collate function pads each batch to its longest sequence and adds a mask; train_batch
// reads batch["tokens"], batch["mask"] and batch["label"], moved to the device with the rest of
// the batch. Two loader threads read ahead, and each training epoch is whole batches
// (drop_last). The trial also uses the run's getters: the learning rate warms up over the first
// batches (context.current_train_batch()), the chief names its trial and experiment once, and a
// callback ends the trial early (set_stop_requested) once validation accuracy reaches the
// hyperparameter stop_at_accuracy: the trial is then complete, and a grid goes on with the next.
//
// With `data: {source: stream}` the training samples come from a StreamDataset instead: each
// rank generates a shard of its own, pass after pass, as a reader of record files would read
// them, and a paused trial resumes each rank's stream where it stood.
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <hpctrial/trainer.h>

#include <algorithm>
#include <cstdio>
#include <optional>

namespace {

using hpctrial::Batch;

constexpr std::int64_t kVocabulary = 32;

// One sample of class `label`: a map {"tokens", "label"}.
Batch make_sequence(std::int64_t label, at::Generator& generator) {
  const std::int64_t length = torch::randint(4, 25, {1}, generator).item<std::int64_t>();
  return Batch::map({{"tokens", torch::randint(label * 12, label * 12 + 20, {length}, generator)},
                     {"label", torch::tensor(label)}});
}

class SequenceDataset final : public hpctrial::Dataset {
 public:
  SequenceDataset(std::int64_t samples, std::uint64_t seed) {
    auto generator = at::make_generator<at::CPUGeneratorImpl>(seed);
    for (std::int64_t i = 0; i < samples; ++i) samples_.push_back(make_sequence(i % 2, generator));
  }
  std::uint64_t size() const override { return samples_.size(); }
  Batch get(std::int64_t index) override { return samples_[index]; }

 private:
  std::vector<Batch> samples_;
};

// This rank's shard as a stream: each pass generates `per_pass` samples afresh, from a
// generator seeded by the seed, the rank and the pass only, so that a pass read again (after a
// resume) gives the same samples.
class SequenceStream final : public hpctrial::StreamDataset {
 public:
  SequenceStream(std::int64_t per_pass, std::uint64_t seed, int rank)
      : per_pass_(per_pass), seed_(hpctrial::derive_seed(seed, static_cast<std::uint64_t>(rank))) {}
  void start(std::int64_t pass) override {
    generator_ = at::make_generator<at::CPUGeneratorImpl>(hpctrial::derive_seed(seed_, static_cast<std::uint64_t>(pass)));
    read_ = 0;
  }
  std::optional<Batch> next() override {
    if (read_ == per_pass_) return std::nullopt;
    return make_sequence(read_++ % 2, generator_);
  }

 private:
  std::int64_t per_pass_;
  std::uint64_t seed_;
  at::Generator generator_;
  std::int64_t read_ = 0;
};

// Pads the token sequences of a batch to the longest one; the mask is 1 where a token is.
Batch pad(std::vector<Batch> samples) {
  std::int64_t longest = 0;
  for (const auto& s : samples) longest = std::max(longest, s["tokens"].tensor().size(0));
  const auto n = static_cast<std::int64_t>(samples.size());
  auto tokens = torch::zeros({n, longest}, torch::kInt64);
  auto mask = torch::zeros({n, longest});
  std::vector<torch::Tensor> labels;
  for (std::int64_t k = 0; k < n; ++k) {
    const torch::Tensor& t = samples[k]["tokens"].tensor();
    tokens[k].narrow(0, 0, t.size(0)).copy_(t);
    mask[k].narrow(0, 0, t.size(0)).fill_(1);
    labels.push_back(samples[k]["label"].tensor());
  }
  return Batch::map({{"tokens", tokens}, {"mask", mask}, {"label", torch::stack(labels)}});
}

struct SequenceNetImpl : torch::nn::Module {
  explicit SequenceNetImpl(std::int64_t width)
      : embedding(register_module("embedding", torch::nn::Embedding(kVocabulary, width))),
        classify(register_module("classify", torch::nn::Linear(width, 2))) {}
  // The mean of the embeddings of the real tokens, then a linear classifier.
  torch::Tensor forward(const torch::Tensor& tokens, const torch::Tensor& mask) {
    const auto summed = (embedding->forward(tokens) * mask.unsqueeze(2)).sum(1);
    return classify->forward(summed / mask.sum(1, /*keepdim=*/true));
  }
  torch::nn::Embedding embedding;
  torch::nn::Linear classify;
};
TORCH_MODULE(SequenceNet);

// Ends the trial once the chief's reduced validation accuracy reaches the target.
class StopAtAccuracy final : public hpctrial::Callback {
 public:
  StopAtAccuracy(hpctrial::TrialContext& context, double target) : context_(context), target_(target) {}
  void on_validation_end(const hpctrial::MetricValues& metrics) override {
    if (metrics.at("accuracy") >= target_) context_.set_stop_requested(true);
  }

 private:
  hpctrial::TrialContext& context_;
  double target_;
};

class SequenceTrial : public hpctrial::Trial {
 public:
  explicit SequenceTrial(hpctrial::TrialContext& context)
      : context_(context),
        base_lr_(context.hparam<double>("learning_rate")),
        warmup_batches_(context.hparam<std::int64_t>("warmup_batches")) {
    if (context.data_config().value("source", "memory") == "stream") {
      const auto& slots = context.distributed();
      stream_ = std::make_shared<SequenceStream>(2048 / slots.size, context.trial_seed(), slots.rank);
    } else {
      train_ = std::make_shared<SequenceDataset>(2048, 1);
    }
    validation_ = std::make_shared<SequenceDataset>(512, 2);
    model_ = context.wrap_model(SequenceNet(context.hparam<std::int64_t>("width")));
    optimizer_ = context.wrap_optimizer(
        std::make_shared<torch::optim::Adam>(model_->parameters(), torch::optim::AdamOptions(base_lr_)));
    if (context.distributed().is_chief()) {
      std::fprintf(stderr, "sequence: trial %d of experiment %s (%s), %lld batches aggregated per step\n",
                   context.trial_id(), context.experiment_config().value("name", "").c_str(),
                   context.experiment_id().empty() ? "no experiment directory" : context.experiment_id().c_str(),
                   static_cast<long long>(context.aggregation_frequency()));
    }
  }

  hpctrial::Metrics train_batch(Batch& batch, std::int64_t, std::int64_t) override {
    const double warmup = std::min(1.0, static_cast<double>(context_.current_train_batch() + 1) /
                                            static_cast<double>(std::max<std::int64_t>(1, warmup_batches_)));
    for (auto& group : optimizer_->param_groups()) group.options().set_lr(base_lr_ * warmup);
    const auto logits = model_->forward(batch["tokens"].tensor(), batch["mask"].tensor());
    auto loss = torch::cross_entropy_loss(logits, batch["label"].tensor());
    context_.backward(loss);
    context_.step_optimizer(*optimizer_);
    return {{"loss", loss}, {"learning_rate", base_lr_ * warmup}};
  }

  hpctrial::Metrics evaluate_batch(Batch& batch) override {
    const auto logits = model_->forward(batch["tokens"].tensor(), batch["mask"].tensor());
    const auto& label = batch["label"].tensor();
    return {{"validation_loss", torch::cross_entropy_loss(logits, label)},
            {"accuracy", logits.argmax(1).eq(label).to(torch::kFloat32).mean()}};
  }

  hpctrial::DataLoader build_training_data_loader() override {
    if (stream_) {  // one reader: a stream has one position
      return {stream_, context_.per_slot_batch_size(), hpctrial::DataLoaderOptions().drop_last(true).collate(pad)};
    }
    return {train_, context_.per_slot_batch_size(),
            hpctrial::DataLoaderOptions().workers(2).drop_last(true).collate(pad)};
  }
  hpctrial::DataLoader build_validation_data_loader() override {
    return {validation_, context_.per_slot_batch_size(), hpctrial::DataLoaderOptions().shuffle(false).collate(pad)};
  }
  std::map<std::string, std::shared_ptr<hpctrial::Callback>> build_callbacks() override {
    return {{"stop_at_accuracy",
             std::make_shared<StopAtAccuracy>(context_, context_.hparam<double>("stop_at_accuracy"))}};
  }

 private:
  hpctrial::TrialContext& context_;
  double base_lr_;
  std::int64_t warmup_batches_;
  std::shared_ptr<SequenceDataset> train_;  // in memory ...
  std::shared_ptr<SequenceStream> stream_;   // ... or generated as a stream
  std::shared_ptr<SequenceDataset> validation_;
  SequenceNet model_{nullptr};
  std::shared_ptr<torch::optim::Adam> optimizer_;
};

}  // namespace

HPCTRIAL_MAIN(SequenceTrial)
