// Engine trials (Determined's DeepSpeedTrial, in LibTorch C++): the trial hands its model,
// optimizer and LR scheduler to a ModelEngine (the counterpart of deepspeed.initialize), which
// owns the step: micro-batch accumulation, gradient averaging across ranks, clipping. The
// batch sizes come from the experiment config's `engine:` section, in DeepSpeed's key names
// (docs/engine-trials.md).
//
//   class MyTrial : public hpctrial::EngineTrial {
//    public:
//     explicit MyTrial(hpctrial::EngineTrialContext& context) : context_(context) {
//       model_ = Net();
//       auto optimizer = std::make_shared<torch::optim::AdamW>(model_->parameters(), ...);
//       engine_ = context.wrap_model_engine(std::make_shared<hpctrial::ModelEngine>(model_, optimizer));
//     }
//     Metrics train_batch(DataIterator& data, int64_t epoch_idx, int64_t batch_idx) override {
//       Batch batch = data.next();  // one micro-batch
//       auto loss = torch::nll_loss(model_->forward(batch.data), batch.target);
//       engine_->backward(loss);
//       engine_->step();  // steps at the end of the global batch only
//       return {{"loss", loss}};
//     }
//     ...
//   };
//   HPCTRIAL_MAIN(MyTrial)
//
// The harness calls train_batch gradient_accumulation_steps times per global batch, each call
// taking one micro-batch, unless the trial calls context.disable_auto_grad_accumulation(): then
// train_batch is called once and runs every micro-batch itself (backward and step each).
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>

#include <nlohmann/json.hpp>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "hpctrial/trainer/callback.h"
#include "hpctrial/trainer/data.h"
#include "hpctrial/trainer/grad_scaler.h"
#include "hpctrial/trainer/metrics.h"
#include "hpctrial/trainer/pipeline.h"
#include "hpctrial/trainer/trial.h"
#include "hpctrial/trainer/trial_context.h"

namespace hpctrial::trainer {

namespace detail {
class PartitionStore;
class ShardedOptimizer;
class PipelineRunner;
struct EngineAccess;
}  // namespace detail

// The micro-batches of one global batch on this rank (training), or the one batch being
// validated: Determined's dataloader_iter. The batches are already on the context's device.
class DataIterator {
 public:
  explicit DataIterator(std::vector<Batch> batches, std::string what = "batch");
  // The next micro-batch; ConfigError when there is none left, naming how many there were.
  Batch next();
  bool has_next() const { return taken_ < batches_.size(); }
  std::size_t remaining() const { return batches_.size() - taken_; }
  std::size_t taken() const { return taken_; }

 private:
  std::vector<Batch> batches_;
  std::size_t taken_ = 0;
  std::string what_;
};

class EngineTrialContext;
class ModelEngine;

// DeepSpeed's GatheredParameters, from ModelEngine::gathered_parameters(): while it lives, the
// engine's parameters are whole on every rank (at ZeRO stage 3 gathered from the ranks' parts;
// at other stages they are whole anyway). Every data-parallel rank makes and ends it alike (both
// are collectives). Made with a modifier rank (a data-parallel rank), what that rank wrote into
// the parameters is kept when it ends: broadcast to every rank, which takes its parts from it
// (a custom initialisation after wrapping). Without one, writes at stage 3 are not kept (at
// other stages they are written into the parameters themselves), and parameters that were
// released before are released again.
class GatheredParameters {
 public:
  GatheredParameters(GatheredParameters&& other) noexcept;
  GatheredParameters& operator=(GatheredParameters&&) = delete;
  GatheredParameters(const GatheredParameters&) = delete;
  GatheredParameters& operator=(const GatheredParameters&) = delete;
  // Ends it; while an exception unwinds, the parameters are only released (no collective).
  ~GatheredParameters();

 private:
  friend class ModelEngine;
  GatheredParameters(ModelEngine& engine, std::optional<int> modifier_rank);
  ModelEngine* engine_;
  std::optional<int> modifier_rank_;
  std::vector<std::pair<std::size_t, std::size_t>> released_;  // (group, parameter) gathered on entry
  int exceptions_ = 0;
};

// The model, its optimizer and an optional LR scheduler, stepped as one (deepspeed.initialize's
// engine). Built by the trial, then handed to context.wrap_model_engine(), which applies the
// experiment's engine section and moves the model to the device. The optimizer must be built
// over the model's parameters before wrapping. Forward passes call the trial's own model.
class ModelEngine {
 public:
  ModelEngine(std::shared_ptr<torch::nn::Module> model, std::shared_ptr<torch::optim::Optimizer> optimizer,
              std::shared_ptr<torch::optim::LRScheduler> lr_scheduler = nullptr);
  ~ModelEngine();
  ModelEngine(const ModelEngine&) = delete;
  ModelEngine& operator=(const ModelEngine&) = delete;
  // A module holder (Net, torch::nn::Linear...).
  template <typename Contained>
  ModelEngine(torch::nn::ModuleHolder<Contained> model, std::shared_ptr<torch::optim::Optimizer> optimizer,
              std::shared_ptr<torch::optim::LRScheduler> lr_scheduler = nullptr)
      : ModelEngine(std::shared_ptr<torch::nn::Module>(model.ptr()), std::move(optimizer),
                    std::move(lr_scheduler)) {}

  // loss.backward() for one micro-batch: the gradients accumulate over the global batch and
  // are averaged over its micro-batches and the ranks (at stage 0 on more than one rank, the
  // all-reduce overlaps backward; at stage 1, the step reduce-scatters them).
  void backward(const torch::Tensor& loss);
  // After each micro-batch's backward. At the end of the global batch (the accumulation
  // boundary): clips the gradients to engine.gradient_clipping, steps the optimizer and the LR
  // scheduler, and zeroes the gradients; on other micro-batches it does nothing.
  void step();
  // Whether the next step() is the one that steps the optimizer.
  bool is_gradient_accumulation_boundary() const;

  // A pipeline engine (its model the PipelineModule of context.pipeline_module(), with
  // engine.pipeline in the config): one global batch, DeepSpeed's train_batch. Every micro-batch
  // of `data` goes forward and backward through the stages in the 1F1B schedule (the inputs read
  // on the first stage, the targets on the last); then the gradients are averaged over the
  // data-parallel replicas and clipped to engine.gradient_clipping by their norm over every
  // stage, and the optimizer and the LR scheduler step once. Returns the mean loss, on every
  // rank. A collective of the pipeline's ranks; train_batch of the trial calls it once.
  torch::Tensor train_batch(DataIterator& data);
  // The same forward only, for the validation batch in `data`; the loss on every rank.
  torch::Tensor eval_batch(DataIterator& data);
  bool is_pipeline() const { return pipeline_ != nullptr; }
  // Loss scaling: backward() scales the loss, and the step divides the gradients by the scale
  // and is skipped, with the LR scheduler's, when any of them is inf or NaN on any rank.
  // engine.fp16 gives every engine one from its settings; a trial that keeps parts of its model
  // in float16 itself can set its own, before wrapping the engine.
  void use_grad_scaler(std::shared_ptr<GradScaler> scaler);
  GradScaler* grad_scaler() const { return scaler_.get(); }

  torch::nn::Module& module() const { return *model_; }
  const std::shared_ptr<torch::nn::Module>& module_ptr() const { return model_; }
  torch::optim::Optimizer& optimizer() const { return *optimizer_; }
  torch::optim::LRScheduler* lr_scheduler() const { return lr_scheduler_.get(); }
  void train(bool on = true) { model_->train(on); }
  void eval() { model_->eval(); }

  // Optimizer steps taken (global batches trained), and micro-batches stepped.
  std::int64_t global_steps() const { return steps_origin_ + (micro_steps_ - micro_origin_) / accumulation_steps_; }
  std::int64_t micro_steps() const { return micro_steps_; }
  // The engine section, resolved: records a step across the ranks, a micro-batch, micro-batches a step.
  std::int64_t train_batch_size() const { return train_batch_size_; }
  std::int64_t train_micro_batch_size_per_gpu() const { return micro_batch_size_; }
  std::int64_t gradient_accumulation_steps() const { return accumulation_steps_; }
  double gradient_clipping() const { return gradient_clipping_; }
  int zero_stage() const { return zero_stage_; }
  // The elements of optimizer state this rank holds: all of it at stage 0, 1/N at stage 1.
  std::int64_t optimizer_state_elements() const;
  // The elements of the model's parameters this rank holds now: all of them but at ZeRO stage 3,
  // where its parts and whatever is gathered.
  std::int64_t parameter_elements() const;
  // The elements of gradients this rank holds now: the model's whole ones, and at ZeRO stages 1
  // to 3 its parts' and what is not reduced yet.
  std::int64_t gradient_elements() const;
  // The parameters whole while the returned object lives (GatheredParameters above), e.g.:
  //   { auto whole = engine->gathered_parameters(0);
  //     if (context.distributed().rank == 0) init(engine->module()); }  // every rank keeps rank 0's
  GatheredParameters gathered_parameters(std::optional<int> modifier_rank = std::nullopt);

 private:
  friend class EngineTrialContext;
  friend class GatheredParameters;
  friend struct detail::EngineAccess;
  TrialContext& context() const;
  void at_micro_step() const;
  // ZeRO stage 3 on a PipelineModule that is not a pipeline: its layers gathered one by one.
  void fetch_layers();
  void sharded_step();
  void pipeline_step();

  std::shared_ptr<torch::nn::Module> model_;
  std::shared_ptr<torch::optim::Optimizer> optimizer_;
  std::shared_ptr<torch::optim::LRScheduler> lr_scheduler_;
  TrialContext* context_ = nullptr;  // set by wrap_model_engine
  std::unique_ptr<detail::ShardedOptimizer> sharded_;  // ZeRO stage 1
  std::unique_ptr<detail::PipelineRunner> pipeline_;   // a pipeline engine's stage
  std::shared_ptr<GradScaler> scaler_;
  std::int64_t micro_steps_ = 0;
  // Where the current accumulation began (an adaptive batch changes it as it trains): global
  // batches and micro-batches trained then.
  std::int64_t steps_origin_ = 0;
  std::int64_t micro_origin_ = 0;
  std::int64_t train_batch_size_ = 0;
  std::int64_t micro_batch_size_ = 0;
  std::int64_t accumulation_steps_ = 1;
  double gradient_clipping_ = 0;
  int zero_stage_ = 0;
  bool fetches_layers_ = false;  // fetch_layers() took over the gathering
};

// What an engine trial gets in its constructor (Determined's DeepSpeedTrialContext).
class EngineTrialContext {
 public:
  // Built by the harness around the trial's TrialContext; ConfigError when the config's batch
  // sizes do not agree with the number of ranks.
  explicit EngineTrialContext(TrialContext& context);
  EngineTrialContext(const EngineTrialContext&) = delete;
  EngineTrialContext& operator=(const EngineTrialContext&) = delete;

  // DeepSpeedTrialContext.from_config: a context for calling an engine trial's methods by hand,
  // outside any launcher (TrialContext::from_config's, which it owns):
  //   auto context = EngineTrialContext::from_config("exp.yaml");
  //   MyTrial trial(*context);
  //   DataIterator batches({batch});  trial.train_batch(batches, 0, 0);
  static std::unique_ptr<EngineTrialContext> from_config(const std::string& config_path,
                                                         const std::vector<std::string>& overrides = {},
                                                         int trial_id = 0);

  // Registers the engine: its model moves to device() and is averaged across ranks and
  // checkpointed with its optimizer and LR scheduler (which the engine steps). Wrap every engine
  // in the trial's constructor. The first engine's batch sizes are the trial's.
  std::shared_ptr<ModelEngine> wrap_model_engine(std::shared_ptr<ModelEngine> engine);
  const std::vector<std::shared_ptr<ModelEngine>>& model_engines() const { return engines_; }

  // train_batch is then called once per global batch, and runs its micro-batches itself:
  // gradient_accumulation_steps of them, each with backward() and step() on every engine.
  void disable_auto_grad_accumulation() { auto_grad_accumulation_ = false; }
  bool auto_grad_accumulation() const { return auto_grad_accumulation_ && !pipe_; }

  // engine.pipeline: this rank's stage of the pipeline (stage = rank % stages, its data-parallel
  // replica rank / stages), and the PipelineModule of it built from the whole model's layers
  // (only this stage's are constructed, each from the trial's seed and its index). Hand the
  // module to a ModelEngine; train_batch is then called once per global batch and calls the
  // engine's train_batch(data). ConfigError without engine.pipeline.
  PipelineModule pipeline_module(std::vector<LayerSpec> layers, PipelineLoss loss) const;
  int pipeline_stage() const { return stage_; }

  // A model of layers on this rank, trained with engine.backward(loss) and engine.step() (not a
  // pipeline: no engine.pipeline), each layer built from the trial's seed and its index. At ZeRO
  // stage 3 on more than one rank its layers are partitioned as they are built (DeepSpeed's
  // zero.Init): each layer's parameters are cut into this rank's parts at once, so that no rank
  // ever holds the whole model, and the engine gathers one layer at a time. Hand it to a
  // ModelEngine with an optimizer over its parameters; ConfigError with engine.pipeline.
  PipelineModule layered_module(std::vector<LayerSpec> layers, PipelineLoss loss);
  int pipeline_stages() const;

  // A model-parallel unit of the trial's own (DeepSpeed's mpu, Determined's set_mpu; fields in
  // trial_context.h): call it in the constructor, before wrap_model_engine. The engine section is
  // then resolved over the unit's data-parallel replicas (train_batch_size = micro-batch x
  // accumulation steps x replicas), gradients are averaged and ZeRO shards over its
  // data_parallel_group, and the loop samples, reports and checkpoints as the unit says.
  // ConfigError with engine.pipeline (which sets the unit itself) or after an engine is wrapped.
  void set_mpu(ModelParallelUnit unit);
  const ModelParallelUnit& mpu() const { return context_.mpu(); }
  // Every rank of the trial (to split into the unit's groups, as on TrialContext).
  comm::Communicator& communicator() const { return context_.communicator(); }

  // The engine section, resolved for this run's ranks (over the data-parallel replicas).
  std::int64_t train_batch_size() const { return batch_.train_batch_size; }
  std::int64_t train_micro_batch_size_per_gpu() const { return batch_.micro_batch_size; }
  std::int64_t gradient_accumulation_steps() const { return batch_.accumulation_steps; }

  // The index of the global batch being trained (global batches trained before it), from 0.
  std::int64_t current_train_batch() const { return current_train_batch_; }
  bool is_epoch_start() const { return context_.is_epoch_start(); }
  bool is_epoch_end() const { return context_.is_epoch_end(); }

  // As on TrialContext (Determined's get_hparams / get_hparam: hparams() / hparam<T>()).
  template <typename T>
  T hparam(const std::string& name) const {
    return context_.hparam<T>(name);
  }
  const nlohmann::json& hparams() const { return context_.hparams(); }
  const nlohmann::json& data_config() const { return context_.data_config(); }
  const nlohmann::json& experiment_config() const { return context_.experiment_config(); }
  int trial_id() const { return context_.trial_id(); }
  const std::string& experiment_id() const { return context_.experiment_id(); }
  std::uint64_t trial_seed() const { return context_.trial_seed(); }
  const DistributedContext& distributed() const { return context_.distributed(); }
  torch::Device device() const { return context_.device(); }
  // Every GPU of this rank's slot (resources.gpus_per_slot of them, device() first; empty on the
  // CPU), for a model the trial splits over them itself; as on TrialContext.
  const std::vector<torch::Device>& devices() const { return context_.devices(); }
  torch::Tensor to_device(const torch::Tensor& tensor) const { return context_.to_device(tensor); }
  Batch to_device(const Batch& batch) const { return context_.to_device(batch); }
  void set_stop_requested(bool stop) { context_.set_stop_requested(stop); }
  bool get_stop_requested() const { return context_.get_stop_requested(); }
  // Determined's get_tensorboard_writer / get_tensorboard_path and set_profiler, as on
  // TrialContext: the chief's event files, and a Chrome trace per rank of the window's global
  // batches (counted from 1).
  SummaryWriter& tensorboard_writer() { return context_.tensorboard_writer(); }
  const std::string& tensorboard_path() const { return context_.tensorboard_path(); }
  void set_enable_tensorboard_logging(bool enable) { context_.set_enable_tensorboard_logging(enable); }
  bool get_enable_tensorboard_logging() const { return context_.get_enable_tensorboard_logging(); }
  void set_profiler(std::int64_t begin_batch, std::int64_t end_batch) { context_.set_profiler(begin_batch, end_batch); }
  std::shared_ptr<MetricReducer> wrap_reducer(std::shared_ptr<MetricReducer> reducer,
                                              std::optional<std::string> name = std::nullopt,
                                              bool for_training = true, bool for_validation = true) {
    return context_.wrap_reducer(std::move(reducer), name, for_training, for_validation);
  }
  std::shared_ptr<FunctionReducer> wrap_reducer(FunctionReducer::Function function,
                                                std::optional<std::string> name = std::nullopt,
                                                bool for_training = true, bool for_validation = true) {
    return context_.wrap_reducer(std::move(function), name, for_training, for_validation);
  }

  // --- for the harness ----------------------------------------------------------------------
  TrialContext& trial_context() const { return context_; }
  // Before the global batch `batch_idx`: every engine's micro-step count starts there, and at
  // ZeRO stage 3 its parameters are gathered whole.
  void begin_global_batch(std::int64_t batch_idx);
  // ZeRO stage 3: every engine's parameters whole (a collective of the data-parallel ranks),
  // before a forward pass; the engine's step releases them.
  void gather_parameters();
  // The micro-batches trained before the global batch `batch_idx`.
  std::int64_t micro_steps_before(std::int64_t batch_idx) const {
    return micro_origin_ + (batch_idx - steps_origin_) * batch_.accumulation_steps;
  }
  // ConfigError when parameters built partitioned (layered_module) went to no wrapped engine.
  void check_partitions_taken() const;
  // The adaptive batch (docs/adaptive.md): from the global batch `batch_idx` on, each rank trains
  // `accumulation` micro-batches of `micro_batch` records a step.
  void reshape(std::int64_t batch_idx, std::int64_t micro_batch, std::int64_t accumulation);

 private:
  std::unique_ptr<TrialContext> owned_context_;  // from_config's
  TrialContext& context_;
  core::EngineBatch batch_;
  double gradient_clipping_ = 0;
  int zero_stage_ = 0;
  std::optional<GradScalerOptions> fp16_;  // engine.fp16's loss scaling
  std::vector<std::shared_ptr<ModelEngine>> engines_;
  std::shared_ptr<detail::PartitionStore> partitions_;  // layered_module's at ZeRO stage 3
  bool auto_grad_accumulation_ = true;
  // engine.pipeline: this rank's stage, and the ranks of its pipeline ranked by stage.
  void set_up_pipeline(const core::EngineConfig::Pipeline& pipeline);
  void attach_pipeline(ModelEngine& engine);
  void resolve_batch();
  int stage_ = 0;
  std::shared_ptr<comm::Communicator> pipe_;
  std::int64_t current_train_batch_ = 0;
  std::int64_t steps_origin_ = 0;  // as ModelEngine's
  std::int64_t micro_origin_ = 0;
};

// An engine trial. Implement train_batch, evaluate_batch and the two data loaders; the training
// loader's batch size is train_micro_batch_size_per_gpu().
class EngineTrial {
 public:
  virtual ~EngineTrial() = default;

  // One global batch: gradient_accumulation_steps calls, each reading one micro-batch from
  // `data` and calling engine.backward() and engine.step() (or, with auto accumulation
  // disabled, one call doing all of them). The metrics of the calls are averaged.
  virtual Metrics train_batch(DataIterator& data, std::int64_t epoch_idx, std::int64_t batch_idx) = 0;
  // One batch of this rank's share of the validation set, in `data`; batch_idx counts from 0 in
  // each validation. Metrics are reduced by evaluation_reducer(), as for a Trial.
  virtual Metrics evaluate_batch(DataIterator& data, std::int64_t batch_idx) = 0;

  virtual DataLoader build_training_data_loader() = 0;
  virtual DataLoader build_validation_data_loader() = 0;
  virtual std::map<std::string, std::shared_ptr<Callback>> build_callbacks() { return {}; }
  virtual ReducerSpec evaluation_reducer() { return Reducer::kAvg; }

  // Extra state of the trial that must survive a resume (the engines' models, optimizers and
  // schedulers are checkpointed without this).
  virtual nlohmann::json save_state() { return nullptr; }
  virtual void load_state(const nlohmann::json& /*state*/) {}

  // DeepSpeedTrial's save(context, path) and load(context, path): files of each rank's own,
  // written into `path` (an empty private directory) at every checkpoint on every rank and given
  // back to the rank of the same number on a resume, before its first batch (Trial::save_files).
  virtual void save(const std::filesystem::path& path);
  virtual void load(const std::filesystem::path& path);
};

namespace detail {

// The Trial the loop runs for an EngineTrial: it splits each rank's share of a global batch
// into micro-batches and drives the engine trial's calls.
class EngineTrialRunner final : public Trial {
 public:
  using Make = std::function<std::unique_ptr<EngineTrial>(EngineTrialContext&)>;
  EngineTrialRunner(TrialContext& context, const Make& make);
  ~EngineTrialRunner() override;

  Metrics train_batch(Batch& batch, std::int64_t epoch_idx, std::int64_t batch_idx) override;
  Metrics evaluate_batch(Batch& batch) override;
  DataLoader build_training_data_loader() override;
  DataLoader build_validation_data_loader() override;
  std::map<std::string, std::shared_ptr<Callback>> build_callbacks() override { return trial_->build_callbacks(); }
  ReducerSpec evaluation_reducer() override { return trial_->evaluation_reducer(); }
  nlohmann::json save_state() override { return trial_->save_state(); }
  void load_state(const nlohmann::json& state) override { trial_->load_state(state); }
  void save_files(const std::filesystem::path& directory) override { trial_->save(directory); }
  void load_files(const std::filesystem::path& directory) override { trial_->load(directory); }
  EngineTrialContext& engine_context() const { return *context_; }
  EngineTrial& engine_trial() const { return *trial_; }
  // The adaptive batch's shape from the global batch `batch_idx` on (EngineTrialContext::reshape);
  // the training data must be read again in batches of micro_batch x accumulation.
  void reshape(std::int64_t batch_idx, std::int64_t micro_batch, std::int64_t accumulation);

 private:
  std::unique_ptr<EngineTrialContext> context_;  // outlives trial_
  std::unique_ptr<EngineTrial> trial_;
  bool listed_micro_batches_ = false;  // the loader's custom collate made a list of micro-batches
  // The micro-batch the custom collate cuts, read by the loader's threads.
  std::shared_ptr<std::atomic<std::int64_t>> collate_micro_ = std::make_shared<std::atomic<std::int64_t>>(0);
  std::int64_t validation_batch_ = 0;
  std::int64_t validated_at_ = -1;  // micro-batches trained when the current validation began
};

}  // namespace detail

template <typename TrialClass>
std::unique_ptr<Trial> make_engine_trial(TrialContext& context) {
  static_assert(std::is_base_of_v<EngineTrial, TrialClass>,
                "an engine trial class derives from hpctrial::trainer::EngineTrial");
  static_assert(std::is_constructible_v<TrialClass, EngineTrialContext&>,
                "an engine trial is constructed from an EngineTrialContext&");
  auto trial = std::make_unique<detail::EngineTrialRunner>(
      context, [](EngineTrialContext& c) -> std::unique_ptr<EngineTrial> { return std::make_unique<TrialClass>(c); });
  detail::TrialAccess::set_evaluates_by_batch(*trial, true);
  return trial;
}

// What HPCTRIAL_MAIN and TrialRegistry::add build: a Trial or an EngineTrial.
template <typename TrialClass>
std::unique_ptr<Trial> make_any_trial(TrialContext& context) {
  if constexpr (std::is_base_of_v<EngineTrial, TrialClass>) {
    return make_engine_trial<TrialClass>(context);
  } else {
    return make_trial<TrialClass>(context);
  }
}

}  // namespace hpctrial::trainer
