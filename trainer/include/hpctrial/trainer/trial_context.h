// What a trial gets in its constructor (Determined's PyTorchTrialContext, in LibTorch C++).
//
//   MyTrial(hpctrial::TrialContext& context) : context_(context) {
//     model_ = context.wrap_model(Net(context.hparam<int>("hidden")));
//     optimizer_ = context.wrap_optimizer(std::make_shared<torch::optim::SGD>(
//         model_->parameters(), torch::optim::SGDOptions(context.hparam<double>("lr"))));
//   }
//   Metrics train_batch(Batch& batch, int64_t epoch_idx, int64_t batch_idx) override {
//     auto loss = torch::nll_loss(model_->forward(batch.data), batch.target);
//     context_.backward(loss);
//     context_.step_optimizer(*optimizer_);
//     return {{"loss", loss}};
//   }
//
// Wrap every model before creating its optimizer (wrapping moves the model to the device).
// Several models, optimizers and schedulers may be wrapped, in any order. Used from the
// training thread only. Mistakes (an unknown hyperparameter, an optimizer stepped that was
// never wrapped) throw ConfigError or InternalError with what to change.
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "hpctrial/core/experiment_config.h"
#include "hpctrial/trainer/accumulator.h"
#include "hpctrial/trainer/data.h"
#include "hpctrial/trainer/grad_scaler.h"
#include "hpctrial/trainer/metrics.h"

namespace hpctrial::comm {
class Communicator;
}

namespace hpctrial::trainer {
namespace detail {
class GradientSync;
}

// When a wrapped LR scheduler steps, as in Determined: after every epoch; once for every batch,
// but only when the optimizer steps (with aggregation_frequency k, k times at the end of each
// group of k batches, so that the rate never changes inside a group: a schedule counted in
// batches); once for every optimizer step (a schedule counted in optimizer steps, as DeepSpeed's
// are); or only when the trial calls scheduler.step() itself.
enum class StepMode { EveryEpoch, EveryBatch, EveryOptimizerStep, Manual };

class SummaryWriter;

// Batches first..last of a run (counted from 1), recorded by the profiler.
struct ProfilerWindow {
  std::int64_t first = 0;
  std::int64_t last = 0;
};

struct DistributedContext {
  int rank = 0;
  int size = 1;
  int local_rank = 0;
  int local_size = 1;
  int node_count = 1;
  int node_index = 0;  // this rank's node among them (MPI's: ranks sharing memory)
  bool is_chief() const { return rank == 0; }
};

// Determined's ModelParallelUnit: where this rank stands when a model is split over several
// ranks (tensor-parallel layers a trial writes itself, a pipeline's stages). The ranks that hold
// the same part of the model in different replicas form its data-parallel group: gradients are
// averaged and ZeRO's shards split among them, and the training and validation data are sharded
// over the replicas, not the ranks. Without a unit, every rank is a replica of the whole model.
struct ModelParallelUnit {
  int data_parallel_rank = 0;
  int data_parallel_world_size = 1;
  // Whether this rank's metrics count (those of the ranks of one replica are usually the same
  // loss, reported once).
  bool should_report_metrics = true;
  // Whether this rank reads training and validation records. Every rank builds its loaders (they
  // set each epoch's length); on the others train_batch and evaluate_batch get batches without
  // tensors.
  bool should_build_data_loader = true;
  // This rank's data-parallel group, ranked by data_parallel_rank: made by the trial with
  // context.communicator().split(model-parallel position, data_parallel_rank). May be null with
  // one replica.
  std::shared_ptr<comm::Communicator> data_parallel_group;
};

// Where the context's settings come from (built by the harness from the experiment config).
struct TrialSettings {
  nlohmann::json hparams = nlohmann::json::object();
  nlohmann::json data_config = nlohmann::json::object();
  std::uint64_t trial_seed = 0;
  std::int64_t aggregation_frequency = 1;
  // Records a batch across the ranks; 0: hyperparameters.global_batch_size (an engine trial's
  // train_batch_size comes from its engine section).
  std::int64_t global_batch_size = 0;
  // The config's engine section, when it has one: the trial must be an engine trial.
  std::optional<core::EngineConfig> engine;
  // optimizations.adaptive_batch_size is enabled: the batch changes shape as the trial trains.
  bool adaptive_batch = false;
  double bucket_cap_mb = 25;
  core::GradientCompression gradient_compression = core::GradientCompression::kNone;
  int gpus_per_slot = 0;
  DistributedContext distributed;
  int trial_id = 0;
  std::string experiment_dir;                                          // the experiment's identity
  nlohmann::json experiment_config = nlohmann::json::object();  // the effective config
  // Where the chief's TensorBoard event files go; empty on other ranks (their writer drops all).
  std::string tensorboard_dir;
  // The config's profiling window, when profiling.enabled.
  std::optional<ProfilerWindow> profiler_window;
};

class TrialContext {
 public:
  // `communicator` reduces host memory; `device_communicator` (NCCL, may be null) GPU memory.
  TrialContext(TrialSettings settings, comm::Communicator& communicator,
               comm::Communicator* device_communicator = nullptr);
  ~TrialContext();
  TrialContext(const TrialContext&) = delete;
  TrialContext& operator=(const TrialContext&) = delete;

  // A context for calling a trial's methods by hand, outside any launcher (Determined's
  // from_config, for debugging): `MyTrial trial(*context); trial.train_batch(batch, 0, 0);`. One
  // process (the context owns its communicator); the config at `config_path` with `overrides`
  // (--set assignments), its hyperparameters those of trial `trial_id` of its searcher; the
  // device resources.gpus_per_slot asks for. ConfigError naming the file and key for a config
  // that does not load.
  static std::unique_ptr<TrialContext> from_config(const std::string& config_path,
                                                   const std::vector<std::string>& overrides = {}, int trial_id = 0);

  // --- models, optimizers, schedulers -----------------------------------------------------
  // Moves the model to device() and registers it for gradient averaging and checkpoints.
  // Works with module holders (TORCH_MODULE types, torch::nn::Linear...) and shared_ptrs.
  template <typename Holder>
  Holder wrap_model(Holder model) {
    model->to(device());
    register_model(model.ptr());
    return model;
  }
  template <typename Module>
  std::shared_ptr<Module> wrap_model(std::shared_ptr<Module> model) {
    model->to(device());
    register_model(model);
    return model;
  }

  template <typename Optimizer>
  std::shared_ptr<Optimizer> wrap_optimizer(std::shared_ptr<Optimizer> optimizer) {
    register_optimizer(optimizer);
    return optimizer;
  }

  template <typename Scheduler>
  std::shared_ptr<Scheduler> wrap_lr_scheduler(std::shared_ptr<Scheduler> scheduler, StepMode mode) {
    register_lr_scheduler(scheduler, mode);
    return scheduler;
  }

  // loss.backward(gradient, retain_graph, create_graph), as in PyTorch: `gradient` for a loss
  // that is not a scalar, retain_graph to go through the graph again, create_graph to make the
  // gradients differentiable (a Hessian-vector product, a penalty on the gradient). Gradients
  // accumulate over aggregation_frequency batches. On more than one rank, the all-reduce of each
  // bucket starts as soon as backward has produced it, overlapping the rest of backward (use
  // this rather than loss.backward()). With create_graph, .grad holds this rank's own
  // gradients, with their graph, until step_optimizer averages them: no overlap for that step.
  void backward(const torch::Tensor& loss, const torch::Tensor& gradient = {},
                c10::optional<bool> retain_graph = c10::nullopt, bool create_graph = false);
  // On the last batch of each aggregation group: waits for the gradient all-reduce (averaging
  // across ranks and batches), calls clip_grads on the model's parameters (e.g.
  // torch::nn::utils::clip_grad_norm_), steps, and zeroes the gradients in place (they are
  // never set to none, with any LibTorch version) unless auto_zero_grads is false. On other
  // batches it does nothing, so gradients keep accumulating. Returns whether the optimizer
  // stepped (step an LR scheduler only then).
  using ClipGrads = std::function<void(std::vector<torch::Tensor>& parameters)>;
  bool step_optimizer(torch::optim::Optimizer& optimizer, const ClipGrads& clip_grads = {},
                      bool auto_zero_grads = true);
  // The same with loss scaling (the loss was context.backward(scaler.scale(loss))): the averaged
  // gradients are divided by the scale before clip_grads, and the step is skipped when any of
  // this optimizer's is inf or NaN (on every rank alike; false is returned then). The harness
  // updates the scale after train_batch.
  bool step_optimizer(torch::optim::Optimizer& optimizer, GradScaler& scaler, const ClipGrads& clip_grads = {},
                      bool auto_zero_grads = true);
  // Registers a GradScaler, whose scale is then checkpointed and updated after each batch.
  std::shared_ptr<GradScaler> wrap_scaler(std::shared_ptr<GradScaler> scaler);

  // --- device -------------------------------------------------------------------------------
  // The device models and batches go to: the CPU, or the first of the slot's GPUs.
  torch::Device device() const { return device_; }
  // Every GPU of this rank's slot (resources.gpus_per_slot of them; empty on the CPU), for a
  // model the trial splits over them itself. Ranks never share a device: too few GPUs on a node
  // for its ranks end the run at start-up, naming the node and the counts.
  const std::vector<torch::Device>& devices() const { return devices_; }
  torch::Tensor to_device(const torch::Tensor& tensor) const;
  Batch to_device(const Batch& batch) const;

  // --- mixed precision ----------------------------------------------------------------------
  // Runs train_batch and evaluate_batch under autocast, as torch.autocast does: matrix
  // products, convolutions and the other ops autocast lowers compute in `dtype`, the ops that
  // need the range (losses, softmax, norms) in float32, and the parameters, their gradients and
  // the optimizer stay float32 (the master weights). backward() runs outside it. torch::kBFloat16
  // on the CPU and on GPUs; torch::kFloat16 on GPUs only (LibTorch's CPU autocast is bfloat16
  // only), with a wrapped GradScaler; torch::kFloat32 turns it off. Call it in the trial's
  // constructor; an engine trial's `engine.bf16` and `engine.fp16` sections call it.
  void configure_mixed_precision(c10::ScalarType dtype);
  // The autocast type, or ScalarType::Undefined when the trial computes in its own types.
  c10::ScalarType mixed_precision() const { return mixed_precision_; }

  // --- configuration ------------------------------------------------------------------------
  // The trial's value of hyperparameter `name` as T; ConfigError naming the hyperparameter
  // when it is missing or of another type.
  template <typename T>
  T hparam(const std::string& name) const {
    const nlohmann::json& value = hparam_value(name);
    try {
      return value.get<T>();
    } catch (const nlohmann::json::exception&) {
      throw_hparam_type(name, value);
    }
  }
  const nlohmann::json& hparams() const { return settings_.hparams; }
  // The experiment config's `data:` section.
  const nlohmann::json& data_config() const { return settings_.data_config; }
  std::int64_t global_batch_size() const { return global_batch_size_; }
  // global_batch_size // ranks; global_batch_size() is then per_slot_batch_size() * ranks (the
  // remainder of a global batch that does not split evenly is dropped, with a warning).
  // With a model-parallel unit, the global batch is split over the data-parallel replicas instead.
  std::int64_t per_slot_batch_size() const { return global_batch_size_ / data_parallel_size(); }
  std::uint64_t trial_seed() const { return settings_.trial_seed; }
  const DistributedContext& distributed() const { return settings_.distributed; }

  // --- model parallelism --------------------------------------------------------------------
  // Sets this rank's ModelParallelUnit (Determined's set_mpu): call it in the trial's constructor,
  // on every rank, before wrapping models into an engine or starting anything collective. The
  // ranks' units must agree (as many replicas everywhere, each replica's ranks alike); the harness
  // checks them once the trial is built. ConfigError for a unit that does not fit the ranks.
  void set_mpu(ModelParallelUnit unit);
  // The unit: the one set, or the world's (every rank its own replica).
  const ModelParallelUnit& mpu() const { return mpu_; }
  bool has_model_parallelism() const { return data_parallel_size() != settings_.distributed.size; }
  int data_parallel_rank() const { return mpu_.data_parallel_rank; }
  int data_parallel_size() const { return mpu_.data_parallel_world_size; }
  // The communicator of this rank's data-parallel group (the world without a unit).
  comm::Communicator& data_parallel_communicator() const { return *data_communicator_; }

  // --- position in the loop (valid inside train_batch) ---------------------------------------
  bool is_epoch_start() const { return epoch_start_; }
  bool is_epoch_end() const { return epoch_end_; }

  // --- the run -----------------------------------------------------------------------------
  // The effective experiment config (defaults filled in, the trial's hyperparameter values in
  // `hyperparameters`), as JSON: Determined's get_experiment_config().
  const nlohmann::json& experiment_config() const { return settings_.experiment_config; }
  int trial_id() const { return settings_.trial_id; }
  // The experiment directory, which identifies an experiment in hpctrial (Determined's numeric
  // experiment id has no counterpart without a master).
  const std::string& experiment_id() const { return settings_.experiment_dir; }
  // The index of the batch being trained (batches trained before it), from 0.
  std::int64_t current_train_batch() const { return batches_trained_; }
  // optimizations.aggregation_frequency: batches whose gradients make one optimizer step (an
  // engine trial's gradient_accumulation_steps).
  std::int64_t aggregation_frequency() const { return settings_.aggregation_frequency; }
  // The config's engine section, when it has one.
  const std::optional<core::EngineConfig>& engine_config() const { return settings_.engine; }

  // --- TensorBoard and the profiler -----------------------------------------------------------
  // The trial's TensorBoard writer (summary_writer.h), Determined's get_tensorboard_writer(): the
  // chief's event files under <trial dir>/tensorboard/, which also hold every training and
  // validation metric and the phase timings; on other ranks its calls do nothing.
  SummaryWriter& tensorboard_writer();
  // Determined's get_tensorboard_path(): the folder of the event files; empty on other ranks.
  const std::string& tensorboard_path() const { return settings_.tensorboard_dir; }
  // Determined's set/get_enable_tensorboard_logging: whether the harness writes its metrics
  // (training, validation, system) into the event files as well as metrics.jsonl; true by
  // default. The trial's own tensorboard_writer() calls are written either way. Any time, on the
  // chief (where the event files are); it holds from the next metrics written.
  void set_enable_tensorboard_logging(bool enable) { tensorboard_logging_ = enable; }
  bool get_enable_tensorboard_logging() const { return tensorboard_logging_; }
  // Records batches begin_batch to end_batch (counted from 1) with LibTorch's profiler, into a
  // Chrome trace per rank under <trial dir>/tensorboard/traces/ (Determined's set_profiler; the
  // config's profiling section does the same). Call it in the constructor, alike on every rank.
  // ConfigError when the batches are not 1 <= begin_batch <= end_batch.
  void set_profiler(std::int64_t begin_batch, std::int64_t end_batch);
  const std::optional<ProfilerWindow>& profiler_window() const { return settings_.profiler_window; }

  // --- stopping -----------------------------------------------------------------------------
  // Ends the trial early (Determined's semantics): the ranks agree on it at the step boundary
  // (the end of the aggregation group), then the trial validates, checkpoints and finishes as
  // complete: exit 0, nothing resumes it, and a search goes on with its next trial. A stop from
  // outside (a signal, `hpctrial pause`) is a pause instead.
  void set_stop_requested(bool stop) { stop_requested_ = stop; }
  bool get_stop_requested() const { return stop_requested_; }

  // --- custom reducers ----------------------------------------------------------------------
  // Registers a MetricReducer reported as metric `name` in training and/or validation; without
  // a name (std::nullopt, Determined's name=None) its result is an object of metrics by name.
  std::shared_ptr<MetricReducer> wrap_reducer(std::shared_ptr<MetricReducer> reducer,
                                              std::optional<std::string> name = std::nullopt,
                                              bool for_training = true, bool for_validation = true);
  // Determined's function form: update(value) collects, `function` gets every rank's values.
  std::shared_ptr<FunctionReducer> wrap_reducer(FunctionReducer::Function function,
                                                std::optional<std::string> name = std::nullopt,
                                                bool for_training = true, bool for_validation = true);

  // --- accumulators (AdaptDL's) -------------------------------------------------------------
  // A new Accumulator (accumulator.h), summed across the ranks and saved in every checkpoint: a
  // resumed trial's accumulators hold the sums they had, on any number of ranks. Make them in the
  // constructor, or at least in the same order on every rank; an empty name is "accumulator<i>".
  // `initial`: the sums it starts with, the same on every rank (AdaptDL's Accumulator(*args,
  // **kwargs)); a restored one's saved sums replace them.
  std::shared_ptr<Accumulator> make_accumulator(std::string name = {}, Accumulator::Values initial = {});

  // --- for the harness ----------------------------------------------------------------------
  detail::Accumulators& accumulators() { return *accumulators_; }
  struct WrappedScheduler {
    std::shared_ptr<torch::optim::LRScheduler> scheduler;
    StepMode mode;
  };
  struct WrappedReducer {
    std::shared_ptr<MetricReducer> reducer;
    std::optional<std::string> name;  // none: the reducer reports an object of metrics
    std::string key;                  // the name, or "unnamed reducer <i>": its state's key in checkpoints
    bool for_training;
    bool for_validation;
  };
  const std::vector<std::shared_ptr<torch::nn::Module>>& models() const { return models_; }
  const std::vector<std::shared_ptr<torch::optim::Optimizer>>& optimizers() const { return optimizers_; }
  const std::vector<WrappedScheduler>& lr_schedulers() const { return schedulers_; }
  const std::vector<WrappedReducer>& reducers() const { return reducers_; }
  const std::vector<std::shared_ptr<GradScaler>>& scalers() const { return scalers_; }
  comm::Communicator& communicator() const { return communicator_; }
  void set_loop_position(bool epoch_start, bool epoch_end, std::int64_t batches_trained);
  // An adaptive step's end of epoch decided again once its own gain is known.
  void set_epoch_end(bool epoch_end) { epoch_end_ = epoch_end; }
  // An engine's micro-batches: what the gradient averaging counts (the loop's batches stay the
  // TensorBoard writer's step).
  void set_micro_step(std::int64_t micro_steps);
  // Makes every rank's parameters and buffers equal to the chief's.
  void broadcast_model_state();
  // Once the trial is built, on more than one rank: the gradient buckets and their hooks. (The
  // loop then restores every rank from one checkpoint, or broadcasts the chief's initial state.)
  void start_training();
  // Run by step_optimizer right before optimizer.step() (the checkpoint writer's copy of the
  // parameters must be done before they change); an optimizer stepped elsewhere (a ZeRO
  // engine's) calls before_optimizer_step() itself.
  void set_before_optimizer_step(std::function<void()> hook) { before_optimizer_step_ = std::move(hook); }
  void before_optimizer_step() const {
    if (before_optimizer_step_) before_optimizer_step_();
  }
  // The adaptive batch (docs/adaptive.md): from the batch `first_batch` on, a step accumulates
  // `frequency` batches; optimizer steps multiply the learning rates by `factor` (and put them
  // back after, so LR schedulers see their own); the squared norms of each step's gradients -
  // the ranks' mean of their own, and the averaged one's - are measured on more than one rank.
  void set_aggregation(std::int64_t frequency, std::int64_t first_batch);
  // An engine trial's batch resolved again over the replicas of its model-parallel unit
  // (EngineTrialContext::set_mpu), before training: `global_batch` records a step, in
  // `accumulation` micro-batches on each replica.
  void set_engine_batch(std::int64_t global_batch, std::int64_t accumulation);
  bool adaptive_batch() const { return settings_.adaptive_batch; }
  void set_lr_factor(double factor) { lr_factor_ = factor; }
  double lr_factor() const { return lr_factor_; }
  void measure_gradient_noise(bool on);
  // Whether steps measure their gradients' norms: asked for, on more than one rank.
  bool measuring_gradient_noise() const { return measure_noise_ && data_parallel_size() > 1; }
  // AdamScale's preconditioned noise (docs/adaptive.md): the norms are of the gradients divided,
  // elementwise, by `preconditioner(parameters)`'s tensor for each (undefined: by 1), asked for
  // once a step before the first is measured. Null: the gradients as they are.
  using NoisePreconditioner = std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&)>;
  void precondition_gradient_noise(NoisePreconditioner preconditioner);
  // One step's squared gradient norms: the ranks' mean of their own gradients' (over
  // `local_micro_batches` micro-batches each, 0 meaning all of the step's), and the averaged one's.
  struct GradientNorms {
    double local_sqr = 0;
    double global_sqr = 0;
    std::int64_t local_micro_batches = 0;
  };
  // A step's norms, measured once its gradients are averaged (by step_optimizer, or an optimizer
  // stepped elsewhere, a ZeRO engine's), and the seconds measuring took: handed at once to the
  // listener, which may set lr_factor() and is_epoch_end() for the optimizer step that follows.
  void record_gradient_norms(const GradientNorms& norms, double seconds);
  void set_gradient_norms_listener(std::function<void(const GradientNorms&)> listener) {
    gradient_norms_listener_ = std::move(listener);
  }
  // Seconds the steps waited for gradient collectives since the last call: the all-reduces', and
  // what an optimizer stepped elsewhere (a ZeRO engine's) adds.
  void add_sync_wait_seconds(double seconds) { sync_wait_seconds_ += seconds; }
  double take_sync_wait_seconds();
  // Seconds spent measuring the gradient noise since the last call (norms and their all-reduce).
  double take_estimator_seconds();
  // A wrapped model whose gradients something else averages (a ZeRO engine, by reduce-scatter):
  // the gradient buckets leave its parameters out. Before start_training().
  void exclude_from_gradient_sync(const std::shared_ptr<torch::nn::Module>& model);
  // The data-parallel group's communicator for tensors on `device`: the host's, or the device
  // communicator (NCCL); NotSupported for a GPU without one.
  comm::Communicator& communicator_for(const torch::Device& device) const;
  // Multiplies an optimizer's learning rates for its step, and puts them back (the adaptive
  // batch's factor; an optimizer stepped elsewhere, a ZeRO engine's, uses it too).
  class LrFactor {
   public:
    LrFactor(torch::optim::Optimizer& optimizer, double factor);
    ~LrFactor();
    LrFactor(const LrFactor&) = delete;
    LrFactor& operator=(const LrFactor&) = delete;

   private:
    torch::optim::Optimizer* optimizer_;
    std::vector<double> saved_;
  };

 private:
  std::unique_ptr<comm::Communicator> owned_communicator_;  // from_config's; destroyed last
  c10::ScalarType mixed_precision_ = c10::ScalarType::Undefined;
  bool tensorboard_logging_ = true;
  void register_model(std::shared_ptr<torch::nn::Module> model);
  void register_optimizer(std::shared_ptr<torch::optim::Optimizer> optimizer);
  void register_lr_scheduler(std::shared_ptr<torch::optim::LRScheduler> scheduler, StepMode mode);
  const nlohmann::json& hparam_value(const std::string& name) const;
  [[noreturn]] void throw_hparam_type(const std::string& name, const nlohmann::json& value) const;
  void divide_gradients(torch::optim::Optimizer& optimizer, double divisor);
  bool step(torch::optim::Optimizer& optimizer, GradScaler* scaler, const ClipGrads& clip_grads, bool auto_zero_grads);
  detail::GradientSync& gradient_sync();
  bool is_sync_batch() const {
    return (batches_trained_ + 1 - aggregation_origin_) % settings_.aggregation_frequency == 0;
  }

  void resolve_global_batch_size(int replicas);

  TrialSettings settings_;
  comm::Communicator& communicator_;
  comm::Communicator* device_communicator_;
  ModelParallelUnit mpu_;
  comm::Communicator* data_communicator_;         // the world's, or the unit's group
  comm::Communicator* data_device_communicator_;  // the device communicator of that group, or null
  bool mpu_set_ = false;
  bool training_started_ = false;
  std::unique_ptr<detail::GradientSync> gradient_sync_;
  std::vector<const torch::optim::Optimizer*> checked_optimizers_;
  std::function<void()> before_optimizer_step_;
  std::vector<torch::Device> devices_;
  torch::Device device_;
  std::int64_t global_batch_size_ = 0;
  std::vector<std::shared_ptr<torch::nn::Module>> models_;
  std::vector<const torch::nn::Module*> unsynced_models_;
  std::vector<std::shared_ptr<torch::optim::Optimizer>> optimizers_;
  std::vector<WrappedScheduler> schedulers_;
  std::vector<WrappedReducer> reducers_;
  std::vector<std::shared_ptr<GradScaler>> scalers_;
  std::unique_ptr<detail::Accumulators> accumulators_;
  bool epoch_start_ = false;
  bool epoch_end_ = false;
  bool stop_requested_ = false;
  std::int64_t batches_trained_ = 0;  // the loop's batches, or an engine's micro-batches
  std::int64_t loop_batches_ = 0;     // the loop's batches trained before the current one
  std::int64_t aggregation_origin_ = 0;  // a batch that began a step
  double lr_factor_ = 1;
  bool measure_noise_ = false;
  NoisePreconditioner noise_preconditioner_;
  double estimator_seconds_ = 0;
  double sync_wait_seconds_ = 0;
  std::function<void(const GradientNorms&)> gradient_norms_listener_;
  std::unique_ptr<SummaryWriter> summary_writer_;
  bool batch_started_ = false;
};

}  // namespace hpctrial::trainer
