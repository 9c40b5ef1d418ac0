// Engine trials on 2 and 4 ranks: a ModelEngine at ZeRO stage 0 trains as an ordinary Trial with
// the same model, data and optimizer does; k micro-batches accumulated equal one batch k times
// larger; clipping, the LR scheduler's pace, stop and resume; ZeRO-1 and -2 train as stage 0 and
// reshard on resume; ZeRO-3 too; mistakes are ConfigErrors on every rank alike.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <optional>

#include "../support/event_files.h"
#include "../support/read_file.h"
#include "../support/same_weights.h"
#include "../unit/trainer/test_trial.h"
#include "hpctrial/checkpoint/format.h"
#include "hpctrial/comm/communicator.h"
#include "hpctrial/comm/watchdog.h"
#include "hpctrial/trainer/engine_trial.h"
#include "hpctrial/trainer/summary_writer.h"
#include "loaded_trial_support.h"
#include "mlp_trial_support.h"
#include "mpi_test_env.h"

namespace hpctrial::trainer {
namespace engine_trial_test {  // named: the target compiles its sources together (UNITY_BUILD)

using testing::HasSubstr;
using testing_mpi::env;
using testing_mpi::bitwise_equal;
using testing_mpi::max_relative_difference;
using testing_mpi::Mlp;
using testing_mpi::mlp_dataset;
using testing_mpi::remove_dir;
using namespace testing_trial;

struct Behaviour {
  bool manual = false;          // disable_auto_grad_accumulation
  int reads_per_call = 1;       // micro-batches each auto call reads
  bool skip_step = false;       // never calls engine.step()
  bool wrap = true;             // wraps its engine
  std::int64_t loader_batch = 0;  // 0: train_micro_batch_size_per_gpu()
  std::atomic<bool>* stop = nullptr;  // set after global batch `stop_after` on `stop_rank`
  std::int64_t stop_after = -1;
  int stop_rank = 0;
  bool lbfgs = false;  // an optimizer ZeRO cannot shard
  bool summaries = false;  // writes custom/batch_idx to TensorBoard every global batch
  std::int64_t profile_batch = 0;  // set_profiler(N, M) in the constructor: N
  std::int64_t profile_last = 0;   // M (0: N)
  bool rank_files = false;  // save(path) writes files of this rank's; load(path) reads them into `loaded`
  std::map<std::string, std::string>* loaded = nullptr;  // relative path -> contents
  bool stream = false;  // reads a stream of its own, sharded by rank (a TensorStream), not a Dataset
  bool tensorboard_logging = true;  // set_enable_tensorboard_logging in the constructor
  int custom_init = -1;  // the rank that writes 0.01, 0.02... into the parameters in the constructor
  bool dropped_write = false;  // writes 42 into them without a modifier rank, then reads them back
};

struct Seen {
  std::vector<torch::Tensor> parameters;
  double lr = 0;
  std::int64_t train_batch_size = 0, micro = 0, steps = 0;
  std::vector<std::int64_t> validation_batch_idx;
  std::int64_t state_elements = 0;  // optimizer state on this rank
  c10::ScalarType forward_type = c10::ScalarType::Undefined;  // of the model's output in train_batch
  std::size_t devices = 99;        // context.devices().size()
  bool devices_are_the_trials = false;  // the same list as the TrialContext's
  std::int64_t parameter_elements = 0;  // held after the last step
  double after_dropped_write = 0;       // the largest magnitude read back after dropped_write
};

class EngineMlpTrial : public EngineTrial {
 public:
  EngineMlpTrial(EngineTrialContext& context, Behaviour setup, Seen* seen)
      : context_(context), setup_(setup), seen_(seen), data_(mlp_dataset()) {
    torch::manual_seed(static_cast<std::int64_t>(context.trial_seed()));
    model_ = Mlp();
    optimizer_ = std::make_shared<torch::optim::Adam>(model_->parameters(),
                                                      torch::optim::AdamOptions(context.hparam<double>("lr")));
    auto scheduler = std::make_shared<torch::optim::StepLR>(*optimizer_, 2, 0.5);
    engine_ = setup_.lbfgs ? std::make_shared<ModelEngine>(model_, std::make_shared<torch::optim::LBFGS>(model_->parameters()))
                           : std::make_shared<ModelEngine>(model_, optimizer_, scheduler);
    if (setup_.wrap) context.wrap_model_engine(engine_);
    if (setup_.custom_init >= 0) {
      auto whole = engine_->gathered_parameters(setup_.custom_init);
      torch::NoGradGuard no_grad;
      float value = 0;
      if (context.distributed().rank == setup_.custom_init) {
        for (auto& p : model_->parameters()) p.fill_(value += 0.01f);
      }
    }
    if (setup_.dropped_write) {
      {
        auto whole = engine_->gathered_parameters();
        torch::NoGradGuard no_grad;
        for (auto& p : model_->parameters()) p.fill_(42.0f);
      }
      auto whole = engine_->gathered_parameters();
      seen_->after_dropped_write = model_->parameters().front().abs().max().item<double>();
    }
    if (setup_.manual) context.disable_auto_grad_accumulation();
    if (!setup_.tensorboard_logging) context.set_enable_tensorboard_logging(false);
    if (setup_.profile_batch > 0) {
      context.set_profiler(setup_.profile_batch, setup_.profile_last > 0 ? setup_.profile_last : setup_.profile_batch);
    }
  }
  ~EngineMlpTrial() override {
    if (seen_ == nullptr) return;
    for (const auto& p : model_->parameters()) seen_->parameters.push_back(p.detach().clone());
    seen_->lr = optimizer_->param_groups()[0].options().get_lr();
    seen_->train_batch_size = context_.train_batch_size();
    seen_->micro = context_.train_micro_batch_size_per_gpu();
    seen_->steps = context_.gradient_accumulation_steps();
    seen_->state_elements = engine_->optimizer_state_elements();
    seen_->forward_type = forward_type_;
    seen_->devices = context_.devices().size();
    seen_->devices_are_the_trials = &context_.devices() == &context_.trial_context().devices();
  }

  Metrics train_batch(DataIterator& data, std::int64_t, std::int64_t batch_idx) override {
    const std::int64_t micro_batches = setup_.manual ? context_.gradient_accumulation_steps() : setup_.reads_per_call;
    torch::Tensor last;
    for (std::int64_t i = 0; i < micro_batches; ++i) {
      Batch batch = data.next();
      const auto out = model_->forward(batch.data);
      forward_type_ = out.scalar_type();
      last = torch::mse_loss(out, batch.target);
      engine_->backward(last);
      if (!setup_.skip_step) engine_->step();
    }
    if (seen_ != nullptr) seen_->parameter_elements = engine_->parameter_elements();
    if (setup_.summaries) context_.tensorboard_writer().add_scalar("custom/batch_idx", static_cast<double>(batch_idx));
    trained_ = batch_idx + 1;
    if (setup_.stop != nullptr && batch_idx == setup_.stop_after && context_.distributed().rank == setup_.stop_rank) {
      setup_.stop->store(true);
    }
    return {{"loss", last}};
  }
  // Per rank: its rank and the batches trained as text, bytes of every value (zeros among them) in
  // a subdirectory, and an empty file.
  void save(const std::filesystem::path& path) override {
    if (!setup_.rank_files) return EngineTrial::save(path);
    const int rank = context_.distributed().rank;
    std::ofstream(path / "rank.txt") << "rank " << rank << " after " << trained_ << " batches";
    std::filesystem::create_directories(path / "shard");
    std::string bytes;
    for (int i = 0; i < 256 * (rank + 1); ++i) bytes += static_cast<char>(i % 256);
    std::ofstream(path / "shard" / "weights.bin", std::ios::binary) << bytes;
    std::ofstream(path / "empty");
  }
  void load(const std::filesystem::path& path) override {
    if (!setup_.rank_files) return EngineTrial::load(path);
    for (const auto& entry : std::filesystem::recursive_directory_iterator(path)) {
      if (!entry.is_regular_file()) continue;
      std::ifstream in(entry.path(), std::ios::binary);
      (*setup_.loaded)[entry.path().lexically_relative(path).generic_string()] =
          std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    }
  }
  Metrics evaluate_batch(DataIterator& data, std::int64_t batch_idx) override {
    if (seen_ != nullptr) seen_->validation_batch_idx.push_back(batch_idx);
    Batch batch = data.next();
    return {{"validation_loss", torch::mse_loss(model_->forward(batch.data), batch.target)}};
  }
  DataLoader build_training_data_loader() override {
    const std::int64_t batch = setup_.loader_batch > 0 ? setup_.loader_batch : context_.train_micro_batch_size_per_gpu();
    if (setup_.stream) return {stream(context_.trial_seed()), batch};
    return {data_, batch, DataLoaderOptions()};
  }
  DataLoader build_validation_data_loader() override {
    if (setup_.stream) return {stream(0), 4};
    return {data_, 4, false};
  }
  // The data set's rows as a stream each rank reads its share of, shuffled per pass by `seed`.
  std::shared_ptr<TensorStream> stream(std::uint64_t seed) const {
    std::vector<std::int64_t> rows(data_->size());
    std::iota(rows.begin(), rows.end(), 0);
    const Batch all = data_->get_batch(rows);
    return std::make_shared<TensorStream>(all.data, all.target, context_.distributed().rank,
                                          context_.distributed().size, seed);
  }

 private:
  EngineTrialContext& context_;
  Behaviour setup_;
  Seen* seen_;
  std::shared_ptr<TensorDataset> data_;
  Mlp model_{nullptr};
  std::shared_ptr<torch::optim::Adam> optimizer_;
  std::shared_ptr<ModelEngine> engine_;
  c10::ScalarType forward_type_ = c10::ScalarType::Undefined;
  std::int64_t trained_ = 0;
};

// The same model, data, optimizer and scheduler as an ordinary Trial.
class ReferenceTrial : public Trial {
 public:
  ReferenceTrial(TrialContext& context, double clip, Seen* seen) : context_(context), clip_(clip), seen_(seen), data_(mlp_dataset()) {
    torch::manual_seed(static_cast<std::int64_t>(context.trial_seed()));
    model_ = context.wrap_model(Mlp());
    optimizer_ = context.wrap_optimizer(std::make_shared<torch::optim::Adam>(
        model_->parameters(), torch::optim::AdamOptions(context.hparam<double>("lr"))));
    context.wrap_lr_scheduler(std::make_shared<torch::optim::StepLR>(*optimizer_, 2, 0.5), StepMode::EveryBatch);
  }
  ~ReferenceTrial() override {
    for (const auto& p : model_->parameters()) seen_->parameters.push_back(p.detach().clone());
    seen_->lr = optimizer_->param_groups()[0].options().get_lr();
  }
  Metrics train_batch(Batch& batch, std::int64_t, std::int64_t) override {
    auto loss = torch::mse_loss(model_->forward(batch.data), batch.target);
    context_.backward(loss);
    TrialContext::ClipGrads clip;
    if (clip_ > 0) clip = [this](std::vector<torch::Tensor>& p) { torch::nn::utils::clip_grad_norm_(p, clip_); };
    context_.step_optimizer(*optimizer_, clip);
    return {{"loss", loss}};
  }
  Metrics evaluate_batch(Batch& batch) override {
    return {{"validation_loss", torch::mse_loss(model_->forward(batch.data), batch.target)}};
  }
  DataLoader build_training_data_loader() override { return {data_, context_.per_slot_batch_size(), DataLoaderOptions()}; }
  DataLoader build_validation_data_loader() override { return {data_, 4, false}; }

 private:
  TrialContext& context_;
  double clip_;
  Seen* seen_;
  std::shared_ptr<TensorDataset> data_;
  Mlp model_{nullptr};
  std::shared_ptr<torch::optim::Adam> optimizer_;
};

std::string shared_dir(const std::string& name) { return testing_mpi::shared_dir("hpctrial-engine", name); }

std::string yaml(int batches, const std::string& more, const std::string& global_batch_size = "16") {
  return "name: test\nentrypoint: ./t\nsearcher: {name: single, metric: validation_loss, max_length: {batches: " +
         std::to_string(batches) + "}}\nmin_validation_period: {batches: 3}\nhyperparameters: {lr: 0.05, "
         "global_batch_size: " + global_batch_size + "}\n" + more;
}

// With a watchdog, so that a hang fails within its timeout; `failing` runs are expected to throw
// on every rank and go without one (a watchdog says goodbye only after a good run).
LoopResult run(const std::string& config_yaml, const TrialFactory& factory, const std::string& dir,
               const std::atomic<bool>* stop = nullptr, bool failing = false, const std::string& fault = "") {
  std::optional<comm::Watchdog> watchdog;
  if (!failing) watchdog.emplace(env().world(), comm::Watchdog::Options{std::chrono::seconds(60), {}, 1, {}, nullptr});
  comm::MpiCommunicator communicator(env().world(), watchdog ? &*watchdog : nullptr);
  LoopOptions loop;
  loop.trial_dir = dir;
  loop.progress_interval_s = 0;
  loop.experiment_seed = 11;
  loop.external_stop = stop;
  loop.fault = fault;
  loop.distributed = {env().rank(), env().size(), env().rank(), env().size(), 1};
  LoopResult result = run_training(testing_trial::config_from(config_yaml), factory, communicator, loop);
  if (watchdog) watchdog->finish();
  return result;
}

std::unique_ptr<Trial> make_trial_ref(TrialContext& c, double clip, Seen* seen) {
  return std::make_unique<ReferenceTrial>(c, clip, seen);
}

std::unique_ptr<Trial> make_engine_trial_for_test(TrialContext& c, Behaviour setup, Seen* seen = nullptr) {
  return std::make_unique<detail::EngineTrialRunner>(
      c, [setup, seen](EngineTrialContext& ec) { return std::make_unique<EngineMlpTrial>(ec, setup, seen); });
}

Seen engine_run(const std::string& config_yaml, Behaviour setup, const std::string& name) {
  const std::string dir = shared_dir(name);
  Seen seen;
  run(config_yaml, [&](TrialContext& c) { return make_engine_trial_for_test(c, setup, &seen); }, dir);
  remove_dir(dir);
  return seen;
}

Seen reference_run(const std::string& config_yaml, double clip, const std::string& name) {
  const std::string dir = shared_dir(name);
  Seen seen;
  run(config_yaml, [&](TrialContext& c) { return make_trial_ref(c, clip, &seen); }, dir);
  remove_dir(dir);
  return seen;
}

// A run of `behaviour` in `dir` that `stop_rank` stops after global batch 2: 3 batches trained.
void run_stopped_after_batch_2(const std::string& config, Behaviour behaviour, int stop_rank, const std::string& dir) {
  std::atomic<bool> stop{false};
  behaviour.stop = &stop;
  behaviour.stop_after = 2;
  behaviour.stop_rank = stop_rank;
  const LoopResult first = run(config, [&](TrialContext& c) { return make_engine_trial_for_test(c, behaviour); }, dir, &stop);
  EXPECT_TRUE(first.stopped_early) << "stopped by rank " << stop_rank;
  EXPECT_EQ(first.batches_trained, 3) << "stopped by rank " << stop_rank;
}

TEST(EngineTrial, WithoutAccumulationTrainsAsAnOrdinaryTrial) {
  const Seen reference = reference_run(yaml(6, ""), 0, "ref");
  const Seen engine = engine_run(yaml(6, "engine: {train_micro_batch_size_per_gpu: " +
                                         std::to_string(16 / env().size()) + "}\n"), Behaviour{}, "stage0");
  EXPECT_LE(max_relative_difference(engine.parameters, reference.parameters), 1e-6);
  EXPECT_EQ(engine.devices, 0u) << "on the CPU a slot has no GPU";
  EXPECT_TRUE(engine.devices_are_the_trials);
  // LibTorch's StepLR(2, 0.5) halves at its 3rd and 5th step: 6 global batches, 6 steps.
  EXPECT_DOUBLE_EQ(engine.lr, 0.05 * 0.25) << "the engine steps its LR scheduler once per global batch";
  EXPECT_DOUBLE_EQ(reference.lr, engine.lr);
  // No engine section: the batch is the global batch, without accumulation.
  const Seen plain = engine_run(yaml(6, ""), Behaviour{}, "plain");
  EXPECT_TRUE(bitwise_equal(plain.parameters, engine.parameters));
  EXPECT_EQ(plain.steps, 1);
}

TEST(EngineTrial, AccumulatingKMicroBatchesEqualsOneBatchKTimesLarger) {
  const Seen reference = reference_run(yaml(6, ""), 0, "ref-acc");
  const Seen accumulated = engine_run(yaml(6, "engine: {gradient_accumulation_steps: 2}\n"), Behaviour{}, "acc");
  EXPECT_EQ(accumulated.micro, 16 / env().size() / 2);
  EXPECT_EQ(accumulated.steps, 2);
  EXPECT_LE(max_relative_difference(accumulated.parameters, reference.parameters), 1e-6);
  EXPECT_DOUBLE_EQ(accumulated.lr, reference.lr);
  Behaviour manual;
  manual.manual = true;
  const Seen by_hand = engine_run(yaml(6, "engine: {gradient_accumulation_steps: 2}\n"), manual, "manual");
  EXPECT_TRUE(bitwise_equal(by_hand.parameters, accumulated.parameters))
      << "one call running both micro-batches is the same computation as two calls";
}

TEST(EngineTrial, ClipsTheGlobalGradientNorm) {
  const Seen reference = reference_run(yaml(6, ""), 0.05, "ref-clip");
  const Seen clipped = engine_run(yaml(6, "engine: {gradient_accumulation_steps: 2, gradient_clipping: 0.05}\n"),
                                  Behaviour{}, "clip");
  EXPECT_LE(max_relative_difference(clipped.parameters, reference.parameters), 1e-6);
  const Seen unclipped = engine_run(yaml(6, "engine: {gradient_accumulation_steps: 2}\n"), Behaviour{}, "noclip");
  EXPECT_GT(max_relative_difference(clipped.parameters, unclipped.parameters), 1e-4) << "the clip did something";
}

TEST(EngineTrial, GlobalBatchSizeWinsOverTrainBatchSize) {
  const Seen seen = engine_run(yaml(2, "engine: {train_batch_size: 8, gradient_accumulation_steps: 2}\n"), Behaviour{},
                               "wins");
  EXPECT_EQ(seen.train_batch_size, 16);
  EXPECT_EQ(seen.micro, 16 / env().size() / 2);
  // Without global_batch_size, the engine section alone sets the batch.
  const Seen alone = engine_run(
      "name: test\nentrypoint: ./t\nsearcher: {name: single, metric: validation_loss, max_length: {batches: 2}}\n"
      "hyperparameters: {lr: 0.05}\nengine: {train_micro_batch_size_per_gpu: 2, gradient_accumulation_steps: 3}\n",
      Behaviour{}, "alone");
  EXPECT_EQ(alone.train_batch_size, 2 * 3 * env().size());
}

TEST(EngineTrial, ValidationBatchesCountFromZeroInEachValidation) {
  const Seen seen = engine_run(yaml(6, ""), Behaviour{}, "validation");
  // 64 samples in batches of 4 split over the ranks, validated after batches 3 and 6.
  const std::size_t per_rank = 16 / static_cast<std::size_t>(env().size());
  ASSERT_EQ(seen.validation_batch_idx.size(), 2 * per_rank);
  for (std::size_t i = 0; i < per_rank; ++i) {
    EXPECT_EQ(seen.validation_batch_idx[i], static_cast<std::int64_t>(i));
    EXPECT_EQ(seen.validation_batch_idx[per_rank + i], static_cast<std::int64_t>(i));
  }
}

// Stopped by the chief or by another rank after global batch 2 of 6, then resumed: the same
// weights and optimizer state as one uninterrupted run.
TEST(EngineTrial, StopAndResumeIsBitwiseEqualToAnUninterruptedRun) {
  const std::string config = yaml(6, "engine: {gradient_accumulation_steps: 2}\n");
  const std::string whole = shared_dir("whole");
  run(config, [&](TrialContext& c) { return make_engine_trial_for_test(c, Behaviour{}); }, whole);
  for (int stop_rank : {0, env().size() - 1}) {
    const std::string dir = shared_dir("stopped-" + std::to_string(stop_rank));
    run_stopped_after_batch_2(config, Behaviour{}, stop_rank, dir);
    const LoopResult second = run(config, [&](TrialContext& c) { return make_engine_trial_for_test(c, Behaviour{}); }, dir);
    EXPECT_EQ(second.batches_trained, 6);
    if (env().is_chief()) testing_support::expect_same_weights(whole + "/checkpoints/ckpt-6.h5", dir + "/checkpoints/ckpt-6.h5");
    remove_dir(dir);
  }
  remove_dir(whole);
}

// Data of the trial's own (what DeepSpeedTrial's disable_dataset_reproducibility_checks is for):
// a stream each rank shards and orders itself, read in micro-batches, stopped by the chief or by
// another rank part way through its first pass and resumed where each rank's stream stood.
TEST(EngineTrial, AStreamOfTheTrialsOwnResumesBitwiseWhereEachRankStood) {
  const std::string config = yaml(6, "engine: {gradient_accumulation_steps: 2}\nrecords_per_epoch: 64\n");
  Behaviour streaming;
  streaming.stream = true;
  const std::string whole = shared_dir("stream-whole");
  Seen whole_seen;
  run(config, [&](TrialContext& c) { return make_engine_trial_for_test(c, streaming, &whole_seen); }, whole);
  const Seen dataset = engine_run(config, Behaviour{}, "stream-dataset");
  EXPECT_GT(max_relative_difference(whole_seen.parameters, dataset.parameters), 1e-6)
      << "the stream's own order trains other batches than the harness's order of the Dataset";
  for (int stop_rank : {0, env().size() - 1}) {
    const std::string dir = shared_dir("stream-stopped-" + std::to_string(stop_rank));
    run_stopped_after_batch_2(config, streaming, stop_rank, dir);
    Seen resumed;
    const LoopResult second =
        run(config, [&](TrialContext& c) { return make_engine_trial_for_test(c, streaming, &resumed); }, dir);
    EXPECT_EQ(second.batches_trained, 6);
    EXPECT_TRUE(bitwise_equal(resumed.parameters, whole_seen.parameters)) << "stopped by rank " << stop_rank;
    if (env().is_chief()) testing_support::expect_same_weights(whole + "/checkpoints/ckpt-6.h5", dir + "/checkpoints/ckpt-6.h5");
    remove_dir(dir);
  }
  remove_dir(whole);
}

// The engine context's TensorBoard writer and profiler window, through a stop and a resume: the
// trial's scalars of both runs at the harness's steps, and the window's trace by every rank.
TEST(EngineTrial, TheTensorBoardWriterAndTheProfilerWindowGoOnAfterAResume) {
  const std::string config = yaml(6, "engine: {gradient_accumulation_steps: 2}\n");
  const int stop_rank = env().size() - 1;
  const std::string dir = shared_dir("tensorboard");
  std::atomic<bool> stop{false};
  Behaviour stopping;
  stopping.manual = true;  // one train_batch call a global batch, one scalar
  stopping.summaries = true;
  stopping.profile_batch = 5;
  stopping.stop = &stop;
  stopping.stop_after = 2;
  stopping.stop_rank = stop_rank;
  EXPECT_TRUE(run(config, [&](TrialContext& c) { return make_engine_trial_for_test(c, stopping); }, dir, &stop).stopped_early);
  const std::string trace = dir + "/tensorboard/traces/rank-" + std::to_string(env().rank()) + ".batches-5-5.json";
  EXPECT_FALSE(std::filesystem::exists(trace)) << "batch 5 was not trained yet";
  Behaviour resumed;
  resumed.manual = true;
  resumed.summaries = true;
  resumed.profile_batch = 5;
  EXPECT_EQ(run(config, [&](TrialContext& c) { return make_engine_trial_for_test(c, resumed); }, dir).batches_trained, 6);
  std::ifstream in(trace);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_THAT(text, HasSubstr("\"batch 5\"")) << trace;
  // The chief's checks may return early: the directory is read and removed first.
  const std::vector<std::string> files =
      env().is_chief() ? testing_support::event_files(dir + "/tensorboard") : std::vector<std::string>{};
  const auto read = testing_support::read_events(files);
  remove_dir(dir);
  if (env().is_chief()) {
    ASSERT_EQ(files.size(), 2u) << "one event file a run";
    ASSERT_TRUE(read.ok) << read.error;
    const auto custom = testing_support::scalars(read.events, "custom/batch_idx");
    ASSERT_EQ(custom.size(), 6u);
    for (std::size_t i = 0; i < custom.size(); ++i) {
      EXPECT_EQ(custom[i].first, static_cast<std::int64_t>(i) + 1) << "the step: global batches trained";
      EXPECT_EQ(custom[i].second, static_cast<double>(i));
    }
  }
}

// set_enable_tensorboard_logging(false): the harness's metrics stay out of the event files (they
// are in metrics.jsonl), the trial's own summaries go in.
TEST(EngineTrial, WithoutTensorBoardLoggingOnlyTheTrialsOwnSummariesAreInTheEventFiles) {
  const std::string dir = shared_dir("no-tensorboard-logging");
  Behaviour quiet;
  quiet.summaries = true;
  quiet.tensorboard_logging = false;
  const std::string config = yaml(6, "engine: {gradient_accumulation_steps: 1}\n");
  EXPECT_EQ(run(config, [&](TrialContext& c) { return make_engine_trial_for_test(c, quiet); }, dir).batches_trained, 6);
  const std::vector<std::string> files =
      env().is_chief() ? testing_support::event_files(dir + "/tensorboard") : std::vector<std::string>{};
  const auto read = testing_support::read_events(files);
  const std::string metrics = env().is_chief() ? testing_support::read_file(dir + "/metrics.jsonl") : "";
  remove_dir(dir);
  if (!env().is_chief()) return;
  ASSERT_TRUE(read.ok) << read.error;
  EXPECT_EQ(testing_support::scalars(read.events, "custom/batch_idx").size(), 6u);
  EXPECT_TRUE(testing_support::scalars(read.events, "training/loss").empty());
  EXPECT_TRUE(testing_support::scalars(read.events, "validation/validation_loss").empty());
  EXPECT_THAT(metrics, HasSubstr("\"kind\":\"training\""));
  EXPECT_THAT(metrics, HasSubstr("\"kind\":\"validation\""));
}

// A profiler window of global batches 2 to 5 that a stop by the chief or by another rank after
// batch 3 cuts in two: the stopped run's trace holds batches 2 and 3, the resumed run's its own
// file of batches 4 and 5, and neither overwrites the other.
TEST(EngineTrial, AProfilerWindowCutByAStopIsTracedInTwoParts) {
  const std::string config = yaml(6, "engine: {gradient_accumulation_steps: 2}\n");
  for (int stop_rank : {0, env().size() - 1}) {
    const std::string dir = shared_dir("profiler-" + std::to_string(stop_rank));
    Behaviour profiling;
    profiling.profile_batch = 2;
    profiling.profile_last = 5;
    run_stopped_after_batch_2(config, profiling, stop_rank, dir);
    EXPECT_EQ(run(config, [&](TrialContext& c) { return make_engine_trial_for_test(c, profiling); }, dir).batches_trained, 6);
    const std::string traces = dir + "/tensorboard/traces/rank-" + std::to_string(env().rank());
    const auto read = [](const std::string& path) {
      std::ifstream in(path);
      return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    };
    const std::string before = read(traces + ".batches-2-5.json");
    const std::string after = read(traces + ".batches-4-5.json");
    remove_dir(dir);
    for (int batch = 1; batch <= 6; ++batch) {
      const std::string range = "\"batch " + std::to_string(batch) + "\"";
      EXPECT_EQ(before.find(range) != std::string::npos, batch == 2 || batch == 3)
          << range << " in the stopped run's trace, stopped by rank " << stop_rank;
      EXPECT_EQ(after.find(range) != std::string::npos, batch == 4 || batch == 5)
          << range << " in the resumed run's trace, stopped by rank " << stop_rank;
    }
  }
}

// DeepSpeedTrial's save and load with a path: every rank's own files travel in the checkpoint
// and come back to the rank of the same number when it resumes (a stop by the last rank after
// batch 2: the checkpoint of 3 batches); later checkpoints hold every rank's files of then; a run
// on another number of ranks is refused, naming both numbers.
TEST(EngineTrial, EachRanksOwnFilesRoundTripThroughAStopAndAResume) {
  // Periodic checkpoints (written while training goes on) at 2 and 4, besides the stop's and the last.
  const std::string config = yaml(6, "engine: {gradient_accumulation_steps: 2}\nmin_checkpoint_period: {batches: 2}\n"
                                            "checkpoint_storage: {save_trial_latest: 10}\n");
  const std::string dir = shared_dir("rank-files");
  const int rank = env().rank();
  std::atomic<bool> stop{false};
  std::map<std::string, std::string> loaded;
  Behaviour first;
  first.rank_files = true;
  first.loaded = &loaded;
  first.stop = &stop;
  first.stop_after = 2;
  first.stop_rank = env().size() - 1;
  EXPECT_TRUE(run(config, [&](TrialContext& c) { return make_engine_trial_for_test(c, first); }, dir, &stop).stopped_early);
  EXPECT_TRUE(loaded.empty()) << "a fresh start loads nothing";
  Behaviour resumed;
  resumed.rank_files = true;
  resumed.loaded = &loaded;
  EXPECT_EQ(run(config, [&](TrialContext& c) { return make_engine_trial_for_test(c, resumed); }, dir).batches_trained, 6);
  std::string bytes;
  for (int i = 0; i < 256 * (rank + 1); ++i) bytes += static_cast<char>(i % 256);
  EXPECT_EQ(loaded, (std::map<std::string, std::string>{{"empty", ""},
                                                        {"rank.txt", "rank " + std::to_string(rank) + " after 3 batches"},
                                                        {"shard/weights.bin", bytes}}));
  if (env().is_chief()) {
    for (const int batches : {4, 6}) {
      const auto saved = checkpoint::read_checkpoint(dir + "/checkpoints/ckpt-" + std::to_string(batches) + ".h5");
      for (int r = 0; r < env().size(); ++r) {
        const auto* text = saved.find("rank_files/" + std::to_string(r) + "/rank.txt");
        EXPECT_EQ(text ? text->text() : "none", "rank " + std::to_string(r) + " after " + std::to_string(batches) + " batches");
      }
    }
    // One rank alone cannot take the files of several.
    comm::LocalCommunicator alone;
    LoopOptions loop;
    loop.trial_dir = dir;
    loop.progress_interval_s = 0;
    loop.experiment_seed = 11;
    try {
      run_training(testing_trial::config_from(yaml(8, "engine: {gradient_accumulation_steps: 2}\n")),
                   [&](TrialContext& c) { return make_engine_trial_for_test(c, resumed); }, alone, loop);
      ADD_FAILURE() << "a run on 1 rank took the files of " << env().size();
    } catch (const ConfigError& e) {
      EXPECT_THAT(e.what(), HasSubstr("holds files each of its " + std::to_string(env().size()) +
                                      " ranks saved for itself (save_files, an engine trial's save) and this run has 1 "
                                      "ranks: each rank's files are its own"));
    }
  }
  remove_dir(dir);
}

// A ZeRO-2 run of every rank loaded on one process, outside any launcher: the run's weights, bit
// for bit, and its evaluation of the validation set; nothing of its optimizer.
TEST(LoadTrial, AZeroTwoCheckpointLoadsOnOneProcessAndEvaluatesAsTheRun) {
  const std::string dir = shared_dir("zload");
  Seen trained, loaded_seen;
  const std::string config = yaml(6, "engine: {gradient_accumulation_steps: 2, zero_optimization: {stage: 2}}\n");
  const LoopResult result =
      run(config, [&](TrialContext& c) { return make_engine_trial_for_test(c, Behaviour{}, &trained); }, dir);
  {
    const LoadedTrial loaded = load_trial_from_checkpoint(
        dir + "/checkpoints", [&](TrialContext& c) { return make_engine_trial_for_test(c, Behaviour{}, &loaded_seen); });
    EXPECT_EQ(loaded.batches_trained(), 6);
    EXPECT_EQ(loaded.checkpoint_path(), dir + "/checkpoints/ckpt-6.h5");
    EXPECT_NO_THROW(loaded.trial<EngineMlpTrial>());
    EXPECT_NEAR(testing_mpi::mean_evaluation(loaded, "validation_loss"),
                result.last_validation.at("validation_loss").number(), 1e-6);
  }
  EXPECT_EQ(max_relative_difference(loaded_seen.parameters, trained.parameters), 0.0);
  EXPECT_EQ(loaded_seen.state_elements, 0);  // a fresh optimizer: no state loaded
  remove_dir(dir);
}

// A ZeRO-3 run with its optimizer state and its parameters' parts on nvme, loaded the same way:
// each rank wrote its parts, and one process reads the whole parameters with no conversion.
TEST(LoadTrial, AZeroThreeOffloadedCheckpointLoadsOnOneProcessAndEvaluatesAsTheRun) {
  const std::string dir = shared_dir("z3load");
  const std::string nvme = shared_dir("z3load-nvme");
  Seen trained, loaded_seen;
  const std::string config =
      yaml(6, "engine: {gradient_accumulation_steps: 2, zero_optimization: {stage: 3, reduce_bucket_size: 10, "
              "stage3_param_persistence_threshold: 0, offload_optimizer: {device: nvme, nvme_path: " + nvme +
              "}, offload_param: {device: nvme, nvme_path: " + nvme + "}}}\n");
  const LoopResult result =
      run(config, [&](TrialContext& c) { return make_engine_trial_for_test(c, Behaviour{}, &trained); }, dir);
  EXPECT_EQ(trained.parameter_elements, 0);  // between steps the parts were on the disk
  {
    const LoadedTrial loaded = load_trial_from_checkpoint(
        dir + "/checkpoints", [&](TrialContext& c) { return make_engine_trial_for_test(c, Behaviour{}, &loaded_seen); });
    EXPECT_EQ(loaded.batches_trained(), 6);
    EXPECT_EQ(loaded.checkpoint_path(), dir + "/checkpoints/ckpt-6.h5");
    // Whole, for the caller's own forward: 3x8 + 8 + 8 + 1 elements.
    std::int64_t elements = 0;
    for (const auto& p : loaded.context().models().at(0)->parameters()) elements += p.numel();
    EXPECT_EQ(elements, 41);
    EXPECT_NEAR(testing_mpi::mean_evaluation(loaded, "validation_loss"),
                result.last_validation.at("validation_loss").number(), 1e-6);
  }
  // The whole parameters, bit for bit as the run gathered them at its end.
  EXPECT_EQ(max_relative_difference(loaded_seen.parameters, trained.parameters), 0.0);
  EXPECT_EQ(loaded_seen.state_elements, 0);
  remove_dir(dir);
  remove_dir(nvme);
}

// ZeRO-1 and ZeRO-2: each rank steps 1/N of the optimizer state, and the weights follow stage 0's.
TEST(EngineTrialZero, StagesOneAndTwoTrainAsStageZeroWithAShareOfTheState) {
  const int ranks = env().size();
  const auto share = [ranks](std::int64_t n) { return (n + ranks - 1) / ranks; };
  const std::string engine = "engine: {gradient_accumulation_steps: 2, gradient_clipping: 0.05, zero_optimization: {stage: ";
  const Seen stage0 = engine_run(yaml(6, engine + "0}}\n"), Behaviour{}, "z0");
  const Seen stage1 = engine_run(yaml(6, engine + "1}}\n"), Behaviour{}, "z1");
  const Seen stage2 = engine_run(yaml(6, engine + "2}}\n"), Behaviour{}, "z2");
  // Buckets of at most 10 elements: {a.weight 24}, {a.bias 8}, {b.weight 8, b.bias 1}.
  const Seen buckets = engine_run(yaml(6, engine + "2, reduce_bucket_size: 10}}\n"), Behaviour{}, "z2b");
  for (const Seen* sharded : {&stage1, &stage2, &buckets}) {
    EXPECT_LE(max_relative_difference(sharded->parameters, stage0.parameters), 1e-6);
    EXPECT_DOUBLE_EQ(sharded->lr, stage0.lr);
  }
  // Adam's two moments of every parameter (3x8 + 8 + 8 + 1 = 41 elements), and this rank's share.
  EXPECT_EQ(stage0.state_elements, 2 * 41);
  EXPECT_EQ(stage1.state_elements, 2 * share(41));
  EXPECT_EQ(stage2.state_elements, 2 * share(41));
  EXPECT_EQ(buckets.state_elements, 2 * (share(24) + share(8) + share(9)));
  // Without clipping, too.
  const Seen plain0 = engine_run(yaml(6, "engine: {gradient_accumulation_steps: 2}\n"), Behaviour{}, "p0");
  for (int stage : {1, 2}) {
    const Seen plain = engine_run(yaml(6, "engine: {gradient_accumulation_steps: 2, zero_optimization: {stage: " +
                                          std::to_string(stage) + ", reduce_bucket_size: 10, stage3_param_persistence_threshold: 0}}\n"),
                                  Behaviour{}, "p" + std::to_string(stage));
    EXPECT_LE(max_relative_difference(plain.parameters, plain0.parameters), 1e-6) << "stage " << stage;
  }
}

// Stopped after global batch 2 by `stop_rank` under config `first`, then resumed under `then`
// to the end (6 batches): the resumed run's parameters. With `whole` (an uninterrupted run's
// directory), its final checkpoint must be bitwise that run's.
Seen stop_and_resume(const std::string& first, const std::string& then, int stop_rank, const std::string& whole = "") {
  const std::string dir = shared_dir("stopped");
  std::atomic<bool> stop{false};
  Behaviour stopping;
  stopping.stop = &stop;
  stopping.stop_after = 2;
  stopping.stop_rank = stop_rank;
  const LoopResult stopped =
      run(first, [&](TrialContext& c) { return make_engine_trial_for_test(c, stopping); }, dir, &stop);
  EXPECT_EQ(stopped.batches_trained, 3);
  Seen resumed;
  const LoopResult ended =
      run(then, [&](TrialContext& c) { return make_engine_trial_for_test(c, Behaviour{}, &resumed); }, dir);
  EXPECT_EQ(ended.batches_trained, 6);
  if (!whole.empty() && env().is_chief()) {
    testing_support::expect_same_weights(whole + "/checkpoints/ckpt-6.h5", dir + "/checkpoints/ckpt-6.h5");
  }
  remove_dir(dir);
  return resumed;
}

// A ZeRO-2 run stopped by the chief or by another rank resumes bitwise; its checkpoint holds the
// whole optimizer state, which a run at another stage resumes from (and the reverse).
TEST(EngineTrialZero, CheckpointsHoldTheWholeStateAndReshardOnResume) {
  const auto at_stage = [](int stage) {
    return yaml(6, "engine: {gradient_accumulation_steps: 2, zero_optimization: {stage: " + std::to_string(stage) +
                       ", reduce_bucket_size: 10, stage3_param_persistence_threshold: 0}}\n");
  };
  const std::string whole = shared_dir("zwhole");
  run(at_stage(2), [&](TrialContext& c) { return make_engine_trial_for_test(c, Behaviour{}); }, whole);
  const Seen reference = engine_run(at_stage(0), Behaviour{}, "zreference");
  for (int stop_rank : {0, env().size() - 1}) stop_and_resume(at_stage(2), at_stage(2), stop_rank, whole);
  // Stopped at one stage, resumed at another: the same run within rounding.
  for (const auto& [from, to] : {std::pair{2, 0}, std::pair{0, 2}, std::pair{1, 2}, std::pair{2, 1}}) {
    const Seen resumed = stop_and_resume(at_stage(from), at_stage(to), 0);
    EXPECT_LE(max_relative_difference(resumed.parameters, reference.parameters), 1e-5)
        << "stage " << from << " resumed at stage " << to;
  }
  remove_dir(whole);
}

// ZeRO-3: the parameters partitioned too. The weights follow stage 0's, with a share of the
// optimizer state; stopped by the chief or by the last rank it resumes bitwise, and its
// checkpoints resume at any stage (and the reverse).
TEST(EngineTrialZero, StageThreeTrainsAsStageZeroAndResumesAtAnyStage) {
  const int ranks = env().size();
  const auto share = [ranks](std::int64_t n) { return (n + ranks - 1) / ranks; };
  const auto at_stage = [](int stage) {
    return yaml(6, "engine: {gradient_accumulation_steps: 2, gradient_clipping: 0.05, zero_optimization: {stage: " +
                       std::to_string(stage) + ", reduce_bucket_size: 10, stage3_param_persistence_threshold: 0}}\n");
  };
  const Seen stage0 = engine_run(at_stage(0), Behaviour{}, "z3s0");
  const std::string whole = shared_dir("z3whole");
  Seen stage3;
  run(at_stage(3), [&](TrialContext& c) { return make_engine_trial_for_test(c, Behaviour{}, &stage3); }, whole);
  EXPECT_LE(max_relative_difference(stage3.parameters, stage0.parameters), 1e-6);
  EXPECT_DOUBLE_EQ(stage3.lr, stage0.lr);
  // Adam's two moments of this rank's part of each parameter (3x8, 8, 8 and 1 elements).
  EXPECT_EQ(stage3.state_elements, 2 * (share(24) + share(8) + share(8) + share(1)));
  // Between steps a rank holds its part of each parameter only.
  EXPECT_EQ(stage3.parameter_elements, share(24) + share(8) + share(8) + share(1));
  EXPECT_EQ(stage0.parameter_elements, 41);
  // With DeepSpeed's default stage3_param_persistence_threshold (1e5) these small parameters
  // are all persistent: whole on every rank, beside their parts; stopped, they resume bitwise.
  const std::string persistent_yaml =
      yaml(6, "engine: {gradient_accumulation_steps: 2, gradient_clipping: 0.05, zero_optimization: {stage: 3, "
              "reduce_bucket_size: 10}}\n");
  Seen persistent;
  const std::string persistent_whole = shared_dir("z3persistent");
  run(persistent_yaml, [&](TrialContext& c) { return make_engine_trial_for_test(c, Behaviour{}, &persistent); },
      persistent_whole);
  EXPECT_LE(max_relative_difference(persistent.parameters, stage0.parameters), 1e-6);
  EXPECT_EQ(persistent.parameter_elements, 41 + share(24) + share(8) + share(8) + share(1));
  for (int stop_rank : {0, ranks - 1}) stop_and_resume(persistent_yaml, persistent_yaml, stop_rank, persistent_whole);
  remove_dir(persistent_whole);
  for (int stop_rank : {0, ranks - 1}) stop_and_resume(at_stage(3), at_stage(3), stop_rank, whole);
  for (const auto& [from, to] : {std::pair{3, 0}, std::pair{3, 1}, std::pair{0, 3}, std::pair{2, 3}}) {
    const Seen resumed = stop_and_resume(at_stage(from), at_stage(to), 0);
    EXPECT_LE(max_relative_difference(resumed.parameters, stage0.parameters), 1e-5)
        << "stage " << from << " resumed at stage " << to;
  }
  remove_dir(whole);
}

// A linear layer that calls `watch` whenever it runs (forward, and its recomputation in backward).
struct WatchedLinearImpl : torch::nn::Module {
  WatchedLinearImpl(std::int64_t in, std::int64_t out, std::function<void()> watch)
      : linear(register_module("linear", torch::nn::Linear(in, out))), watch(std::move(watch)) {}
  torch::Tensor forward(const torch::Tensor& x) {
    watch();
    return linear->forward(x);
  }
  torch::nn::Linear linear;
  std::function<void()> watch;
};
TORCH_MODULE(WatchedLinear);

// x (w w): the product w w is a node of backward that leads to the parameter only, which needs
// w's gathered values after the node that gives x its gradient has run.
struct SquaredScaleImpl : torch::nn::Module {
  explicit SquaredScaleImpl(std::int64_t n) : w(register_parameter("w", torch::rand({n}) + 0.5)) {}
  torch::Tensor forward(const torch::Tensor& x) { return x * (w * w); }
  torch::Tensor w;
};
TORCH_MODULE(SquaredScale);

// A model of layers (a PipelineModule that is not a pipeline) trained with backward and step:
// at ZeRO-3 its layers are gathered one at a time. The parameter elements the rank holds are
// recorded while the middle layer runs, and between the layers in forward and in backward.
class LayeredTrial : public EngineTrial {
 public:
  // `built_bytes` (when set): the model is context.layered_module's, and gets the bytes its
  // parameters' storage holds once it is built, before it is wrapped. Otherwise the model is built
  // whole, with activation checkpointing every `interval` layers (0: none).
  LayeredTrial(EngineTrialContext& context, Seen* seen, std::int64_t* most, std::int64_t* built_bytes = nullptr,
               std::int64_t interval = 0)
      : context_(context), seen_(seen), most_(most), data_(mlp_dataset()) {
    torch::manual_seed(static_cast<std::int64_t>(context.trial_seed()));
    const auto watch = [this](const torch::Tensor& x) {
      record();
      if (x.requires_grad()) {
        x.register_hook([this](torch::Tensor grad) {
          record();
          return grad;
        });
      }
      return x;
    };
    const auto tanh = [](const torch::Tensor& x) { return torch::tanh(x); };
    const std::function<void()> in_layer = [this] { record(); };
    std::vector<LayerSpec> layers = {LayerSpec::of<torch::nn::Linear>(3, 8), LayerSpec::function("watch", watch),
                                     LayerSpec::function("tanh", tanh),
                                     LayerSpec::of<WatchedLinear>(std::int64_t{8}, std::int64_t{8}, in_layer),
                                     LayerSpec::function("watch", watch), LayerSpec::function("tanh", tanh),
                                     LayerSpec::of<SquaredScale>(std::int64_t{8}),
                                     LayerSpec::of<torch::nn::Linear>(8, 1)};
    const PipelineLoss loss = [](const torch::Tensor& out, const torch::Tensor& target) { return torch::mse_loss(out, target); };
    if (built_bytes != nullptr) {
      model_ = context.layered_module(std::move(layers), loss);
      *built_bytes = 0;
      for (const auto& p : model_->parameters()) *built_bytes += static_cast<std::int64_t>(p.storage().nbytes());
    } else {
      PipelineOptions options;
      options.seed = context.trial_seed();
      options.activation_checkpoint_interval = interval;
      model_ = PipelineModule(std::move(layers), loss, 0, options);
    }
    auto optimizer = std::make_shared<torch::optim::Adam>(model_->parameters(),
                                                          torch::optim::AdamOptions(context.hparam<double>("lr")));
    engine_ = context.wrap_model_engine(std::make_shared<ModelEngine>(model_, optimizer));
  }
  ~LayeredTrial() override {
    auto whole = engine_->gathered_parameters();
    for (const auto& p : model_->parameters()) seen_->parameters.push_back(p.detach().clone());
  }
  Metrics train_batch(DataIterator& data, std::int64_t, std::int64_t) override {
    Batch batch = data.next();
    // An input that takes a gradient too (a leaf: its hook runs before the first layer's nodes).
    const auto input = batch.data.clone().requires_grad_(true);
    auto loss = model_->loss(model_->forward(input), batch.target);
    engine_->backward(loss);
    EXPECT_TRUE(input.grad().defined());
    engine_->step();
    return {{"loss", loss}};
  }
  Metrics evaluate_batch(DataIterator& data, std::int64_t) override {
    Batch batch = data.next();
    return {{"validation_loss", model_->loss(model_->forward(batch.data), batch.target)}};
  }
  DataLoader build_training_data_loader() override { return {data_, context_.train_micro_batch_size_per_gpu()}; }
  DataLoader build_validation_data_loader() override { return {data_, 4, false}; }

 private:
  void record() { *most_ = std::max(*most_, engine_ ? engine_->parameter_elements() : 0); }
  EngineTrialContext& context_;
  Seen* seen_;
  std::int64_t* most_;
  std::shared_ptr<TensorDataset> data_;
  PipelineModule model_{nullptr};
  std::shared_ptr<ModelEngine> engine_;
};

TEST(EngineTrialZero, StageThreeGathersAModelOfLayersOneLayerAtATime) {
  const int ranks = env().size();
  const auto share = [ranks](std::int64_t n) { return (n + ranks - 1) / ranks; };
  const auto layered = [](int stage, std::int64_t* most, std::int64_t* built_bytes = nullptr, int persistence = 0,
                          const std::string& prefetch = "stage3_prefetch_bucket_size: 0, stage3_max_reuse_distance: 0",
                          std::int64_t interval = 0) {
    const std::string dir = shared_dir("layered" + std::to_string(stage));
    Seen seen;
    run(yaml(6, "engine: {gradient_accumulation_steps: 2, gradient_clipping: 0.05, zero_optimization: {stage: " +
                    std::to_string(stage) + ", reduce_bucket_size: 20, stage3_param_persistence_threshold: " +
                    std::to_string(persistence) + ", " + prefetch + "}}\n"),
        [&](TrialContext& c) {
          return std::make_unique<detail::EngineTrialRunner>(
              c, [&](EngineTrialContext& ec) { return std::make_unique<LayeredTrial>(ec, &seen, most, built_bytes, interval); });
        },
        dir);
    remove_dir(dir);
    return seen;
  };
  std::int64_t most0 = 0, most3 = 0;
  const Seen stage0 = layered(0, &most0);
  const Seen stage3 = layered(3, &most3);
  // Within rounding: the ranks' gradients are averaged in another order (measured: 2.5e-6 on 4
  // ranks after 6 steps of Adam, whose steps round small gradients up to the learning rate).
  EXPECT_LE(max_relative_difference(stage3.parameters, stage0.parameters), 1e-5);
  // 3x8 + 8, 8x8 + 8, 8, 8 + 1: 121 parameters, 72 in the largest layer.
  const std::int64_t parts = share(24) + share(8) + share(64) + share(8) + share(8) + share(8) + share(1);
  EXPECT_EQ(most0, 121);
  // The middle layer whole while it runs, and nothing else: the rank's parts and its 72 elements.
  EXPECT_EQ(most3, parts + 72);
  // Built partitioned (context.layered_module): once built, before any optimizer, the model's
  // parameters hold no storage on any rank; trained, it follows the others.
  std::int64_t built0 = 0, built3 = 0, most_built = 0, most_built0 = 0;
  const Seen whole = layered(0, &most_built0, &built0);
  const Seen partitioned = layered(3, &most_built, &built3);
  EXPECT_EQ(built0, 121 * 4);
  EXPECT_EQ(built3, 0);
  EXPECT_EQ(most_built, parts + 72);
  EXPECT_LE(max_relative_difference(whole.parameters, stage0.parameters), 0.0);
  EXPECT_LE(max_relative_difference(partitioned.parameters, stage3.parameters), 0.0);
  // Parameters of at most 8 elements persistent (33 elements: every bias, the scale and the last
  // weight): whole throughout, beside the parts, and the largest weight gathered on top of them;
  // the steps are those of the run with none persistent.
  std::int64_t most_persistent = 0;
  const Seen persistent = layered(3, &most_persistent, nullptr, 8);
  EXPECT_EQ(most_persistent, parts + 33 + 64);
  EXPECT_LE(max_relative_difference(persistent.parameters, stage3.parameters), 0.0);
  // Prefetched: while a layer runs, the parameters of the layers after it on their way (before
  // it, in backward), as many as stage3_prefetch_bucket_size takes (the one that crosses it
  // still taken): with 1, while the middle layer runs the scale's 8 elements; with the default,
  // every later layer's 17 then, and the most when backward reaches the middle layer's output,
  // whose 72 elements and the first layer's 32 are on their way. With stage3_max_live_parameters
  // at 72, nothing more while the middle layer is gathered. The steps are bitwise those without.
  std::int64_t most_one = 0, most_all = 0, most_bounded = 0;
  const Seen one = layered(3, &most_one, nullptr, 0, "stage3_prefetch_bucket_size: 1, stage3_max_reuse_distance: 0");
  const Seen all = layered(3, &most_all, nullptr, 0, "stage3_max_reuse_distance: 0");
  const Seen bounded = layered(3, &most_bounded, nullptr, 0, "stage3_max_live_parameters: 72, stage3_max_reuse_distance: 0");
  EXPECT_EQ(most_one, parts + 72 + 8);
  EXPECT_EQ(most_all, parts + 72 + 32);
  EXPECT_EQ(most_bounded, parts + 72);
  // stage3_max_reuse_distance: a layer stays gathered from its forward to its backward when fewer
  // elements than the distance are used in between, twice the 89 after the first layer for it:
  // at 178 the first layer is emptied as before, at 179 it stays, beside the middle layer.
  std::int64_t most_178 = 0, most_179 = 0;
  const Seen reuse_178 = layered(3, &most_178, nullptr, 0, "stage3_prefetch_bucket_size: 0, stage3_max_reuse_distance: 178");
  const Seen reuse_179 = layered(3, &most_179, nullptr, 0, "stage3_prefetch_bucket_size: 0, stage3_max_reuse_distance: 179");
  EXPECT_EQ(most_178, parts + 72);
  EXPECT_EQ(most_179, parts + 32 + 72);
  for (const Seen* other : {&one, &all, &bounded, &reuse_178, &reuse_179}) {
    EXPECT_LE(max_relative_difference(other->parameters, stage3.parameters), 0.0);
  }
  // With activation checkpointing, each layer a recomputed segment: gathered for its forward
  // and again when backward recomputes it, one at a time; prefetched, the layers after it in
  // forward (17 elements while the middle layer runs) and those before it in the recomputation
  // (the first layer's 32 while the middle layer is recomputed). The steps follow stage 0's.
  std::int64_t most_r0 = 0, most_r3 = 0, most_rp = 0;
  const Seen recomputed0 = layered(0, &most_r0, nullptr, 0, "stage3_prefetch_bucket_size: 0", 1);
  const Seen recomputed3 = layered(3, &most_r3, nullptr, 0, "stage3_prefetch_bucket_size: 0", 1);
  const Seen recomputed_prefetched = layered(3, &most_rp, nullptr, 0, "stage3_max_reuse_distance: 0", 1);
  EXPECT_EQ(most_r3, parts + 72);
  EXPECT_EQ(most_rp, parts + 72 + 32);
  EXPECT_LE(max_relative_difference(recomputed0.parameters, stage0.parameters), 0.0);
  EXPECT_LE(max_relative_difference(recomputed3.parameters, stage3.parameters), 0.0);
  EXPECT_LE(max_relative_difference(recomputed_prefetched.parameters, stage3.parameters), 0.0);
}

// GatheredParameters: what the modifier rank (the last) writes after wrapping is every rank's
// start, at stage 3 as at stage 0; without a modifier rank, stage 3 does not keep a write.
TEST(EngineTrialZero, GatheredParametersKeepTheModifierRanksWritesOnly) {
  const auto at_stage = [](int stage) {
    return yaml(6, "engine: {gradient_accumulation_steps: 2, zero_optimization: {stage: " + std::to_string(stage) +
                       ", reduce_bucket_size: 10, stage3_param_persistence_threshold: 0}}\n");
  };
  Behaviour custom;
  custom.custom_init = env().size() - 1;
  const Seen stage0 = engine_run(at_stage(0), custom, "g0");
  const Seen stage3 = engine_run(at_stage(3), custom, "g3");
  const Seen plain = engine_run(at_stage(3), Behaviour{}, "gplain");
  // Within rounding: the gradients are averaged in another order (measured: 1.02e-6 on 2 ranks).
  EXPECT_LE(max_relative_difference(stage3.parameters, stage0.parameters), 2e-6);
  EXPECT_GT(max_relative_difference(stage3.parameters, plain.parameters), 1e-2) << "the custom start was not kept";
  Behaviour dropping;
  dropping.dropped_write = true;
  const Seen dropped = engine_run(at_stage(3), dropping, "gdrop");
  EXPECT_LT(dropped.after_dropped_write, 42.0);
  EXPECT_LE(max_relative_difference(dropped.parameters, plain.parameters), 0.0);
}

// bf16 with ZeRO-2: forward in bfloat16, the weights float32. Stopped by the chief or by another
// rank and resumed, the run is bitwise equal to the uninterrupted one; resumed at stage 0, or
// at stage 2 from stage 0, within 1e-5 of it.
TEST(EngineTrialZero, BfloatSixteenStopAndResumeIsBitwise) {
  const auto at_stage = [](int stage) {
    return yaml(6, "engine: {gradient_accumulation_steps: 2, zero_optimization: {stage: " + std::to_string(stage) +
                       ", reduce_bucket_size: 10, stage3_param_persistence_threshold: 0}, bf16: {enabled: true}}\n");
  };
  const std::string whole = shared_dir("bwhole");
  Seen straight;
  run(at_stage(2), [&](TrialContext& c) { return make_engine_trial_for_test(c, Behaviour{}, &straight); }, whole);
  EXPECT_EQ(straight.forward_type, torch::kBFloat16);
  for (const auto& p : straight.parameters) EXPECT_EQ(p.scalar_type(), torch::kFloat32);
  const Seen fp32 = engine_run(yaml(6, "engine: {gradient_accumulation_steps: 2, zero_optimization: {stage: 2}}\n"),
                               Behaviour{}, "bfp32");
  EXPECT_EQ(fp32.forward_type, torch::kFloat32);
  const double from_fp32 = max_relative_difference(straight.parameters, fp32.parameters);
  EXPECT_GT(from_fp32, 0);  // bfloat16 rounded something
  EXPECT_LE(from_fp32, 0.05);
  for (int stop_rank : {0, env().size() - 1}) stop_and_resume(at_stage(2), at_stage(2), stop_rank, whole);
  for (const auto& [from, to] : {std::pair{2, 0}, std::pair{0, 2}}) {
    const Seen resumed = stop_and_resume(at_stage(from), at_stage(to), 0);
    EXPECT_LE(max_relative_difference(resumed.parameters, straight.parameters), 1e-5)
        << "stage " << from << " resumed at stage " << to;
  }
  // Its checkpoint is an ordinary float32 one: a run without bf16 resumes it.
  const Seen without = stop_and_resume(
      at_stage(2), yaml(6, "engine: {gradient_accumulation_steps: 2, zero_optimization: {stage: 2}}\n"), 0);
  EXPECT_EQ(without.forward_type, torch::kFloat32);
  remove_dir(whole);
}

// Periodic ZeRO checkpoints while training goes on: every rank writes its shard on a thread of
// its own, and the step boundaries publish the file once every rank's shard is durable. They
// hold exactly their batch's state: bitwise those the loop waits for (`async: false`).
TEST(EngineTrialZero, PeriodicCheckpointsAreWrittenByEveryRankWhileTrainingGoesOn) {
  const auto with = [](const std::string& async) {
    return yaml(6, "min_checkpoint_period: {batches: 2}\ncheckpoint_storage: {save_trial_latest: 5, async: " + async +
                       "}\nengine: {gradient_accumulation_steps: 2, zero_optimization: {stage: 2, "
                       "reduce_bucket_size: 10}}\n");
  };
  const std::string async_dir = shared_dir("async"), sync_dir = shared_dir("sync");
  const auto factory = [](TrialContext& c) { return make_engine_trial_for_test(c, Behaviour{}); };
  const LoopResult async = run(with("true"), factory, async_dir);
  const LoopResult waited = run(with("false"), factory, sync_dir);
  EXPECT_TRUE(async.timings.contains("checkpoint_settle")) << async.timings.dump();
  if (env().is_chief()) {
    for (int batch : {2, 4, 6}) {
      const std::string name = "/checkpoints/ckpt-" + std::to_string(batch) + ".h5";
      SCOPED_TRACE(name);
      testing_support::expect_same_weights(sync_dir + name, async_dir + name);
    }
    for (const auto& entry : std::filesystem::directory_iterator(async_dir + "/checkpoints")) {
      EXPECT_EQ(entry.path().filename().string().find(".tmp"), std::string::npos) << entry.path();
    }
  }
  remove_dir(async_dir);
  remove_dir(sync_dir);
}

// A rank whose shard fails to be written - the chief or another, while training goes on or
// while the loop waits - fails every rank with a CheckpointError naming it; the file is removed
// and the previous checkpoint stays the latest.
TEST(EngineTrialZero, AShardThatFailsOnAnyRankFailsEveryRankAndPublishesNothing) {
  for (const std::string async : {"true", "false"}) {
    for (int rank : {0, env().size() - 1}) {
      SCOPED_TRACE("async " + async + ", rank " + std::to_string(rank));
      const std::string dir = shared_dir("failing");
      const std::string fault = "rank" + std::to_string(rank) + ":step4:shards:throw";
      std::string message;
      try {
        run(yaml(6, "min_checkpoint_period: {batches: 2}\ncheckpoint_storage: {async: " + async +
                        "}\nengine: {zero_optimization: {stage: 2}}\n"),
            [](TrialContext& c) { return make_engine_trial_for_test(c, Behaviour{}); }, dir, nullptr, true, fault);
      } catch (const CheckpointError& e) {
        message = e.what();
      }
      EXPECT_THAT(message, HasSubstr("a sharded checkpoint was not written: rank " + std::to_string(rank) +
                                     ": injected fault " + fault));
      if (env().is_chief()) {
        std::vector<std::string> names;
        for (const auto& entry : std::filesystem::directory_iterator(dir + "/checkpoints")) {
          names.push_back(entry.path().filename().string());
        }
        std::sort(names.begin(), names.end());
        EXPECT_EQ(names, (std::vector<std::string>{"ckpt-2.h5", "latest"}));
      }
      remove_dir(dir);
    }
  }
}

// Each mistake is found alike on every rank, so every rank fails and none waits for another.
TEST(EngineTrial, MistakesAreConfigErrorsOnEveryRank) {
  const auto error_of = [](const std::string& config, Behaviour setup) {
    const std::string dir = shared_dir("error");
    std::string message;
    try {
      run(config, [&](TrialContext& c) { return make_engine_trial_for_test(c, setup); }, dir, nullptr, true);
    } catch (const ConfigError& e) {
      message = e.what();
    }
    remove_dir(dir);
    return message;
  };
  const std::string accumulating = yaml(2, "engine: {gradient_accumulation_steps: 2}\n");
  Behaviour reads_two;
  reads_two.reads_per_call = 2;
  EXPECT_THAT(error_of(accumulating, reads_two),
              HasSubstr("DataIterator::next: all 2 micro-batches have been read already; with automatic "
                        "accumulation train_batch reads one micro-batch a call"));
  Behaviour no_step;
  no_step.skip_step = true;
  EXPECT_THAT(error_of(accumulating, no_step),
              HasSubstr("train_batch called step() on model engine 0 0 time(s) in global batch 0, not 2"));
  Behaviour unwrapped;
  unwrapped.wrap = false;
  EXPECT_THAT(error_of(accumulating, unwrapped), HasSubstr("the engine trial wrapped no model engine"));
  Behaviour wrong_loader;
  wrong_loader.loader_batch = 3;
  EXPECT_THAT(error_of(accumulating, wrong_loader),
              HasSubstr("build_training_data_loader: the batch size is 3 but train_micro_batch_size_per_gpu is " +
                        std::to_string(16 / env().size() / 2)));
  Behaviour lbfgs;
  lbfgs.lbfgs = true;
  EXPECT_THAT(error_of(yaml(2, "engine: {zero_optimization: {stage: 1}}\n"), lbfgs),
              HasSubstr("ZeRO shards optimizer state element by element, and LBFGS's state is not per element"));
  EXPECT_THAT(error_of(yaml(2, "optimizations: {aggregation_frequency: 2}\n"), Behaviour{}),
              HasSubstr("an engine trial accumulates gradients over engine.gradient_accumulation_steps"));
  EXPECT_THAT(error_of(yaml(2, "engine: {gradient_accumulation_steps: 2}\n", "17"), Behaviour{}),
              HasSubstr("engine: hyperparameters.global_batch_size (which sets train_batch_size) (17) is not a multiple"));

  // An ordinary Trial with an engine section.
  const std::string dir = shared_dir("trial-with-engine");
  Seen seen;
  std::string message;
  try {
    run(accumulating, [&](TrialContext& c) { return make_trial_ref(c, 0, &seen); }, dir, nullptr, true);
  } catch (const ConfigError& e) {
    message = e.what();
  }
  EXPECT_THAT(message, HasSubstr("the experiment config has an engine section, which configures engine trials, but "
                                 "the trial is a Trial"));
  remove_dir(dir);
}

}  // namespace engine_trial_test
}  // namespace hpctrial::trainer
