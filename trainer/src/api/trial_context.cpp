#include "hpctrial/trainer/trial_context.h"

#include "hpctrial/trainer/summary_writer.h"

#include <torch/cuda.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <chrono>
#include <cstring>
#include <map>

#include "hpctrial/core/error.h"
#include "api/devices.h"
#include "parallel/autocast.h"
#include "parallel/gradient_sync.h"
#include "hpctrial/core/logging.h"
#include "hpctrial/comm/communicator.h"

namespace hpctrial::trainer {
namespace {

// The slot's devices (docs/trial-api.md, "Devices"); none on the CPU. With GPUs, the ranks
// first tell each other their node and CUDA_VISIBLE_DEVICES (one all-gather at start-up), so that
// a rank knows whether it sees devices of its own or its node's.
std::vector<torch::Device> choose_devices(const TrialSettings& settings, comm::Communicator& communicator) {
  if (settings.gpus_per_slot == 0) return {};
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  const char* visible_env = std::getenv("CUDA_VISIBLE_DEVICES");
  const std::string visible_devices = visible_env != nullptr ? visible_env : "";
  const auto key = [](const std::string& text) { return static_cast<std::int64_t>(std::hash<std::string>{}(text)); };
  const std::int64_t mine[2] = {key(host), key(visible_devices)};
  std::vector<std::int64_t> all(2 * static_cast<std::size_t>(communicator.size()));
  communicator.allgather(mine, all.data(), 2, comm::DType::kInt64);
  bool own = true;
  for (int r = 0; r < communicator.size(); ++r) {
    if (r != communicator.rank() && all[2 * r] == mine[0] && all[2 * r + 1] == mine[1]) own = false;
  }
  detail::SlotDeviceQuery query;
  query.gpus_per_slot = settings.gpus_per_slot;
  query.visible = static_cast<int>(torch::cuda::device_count());
  query.rank = settings.distributed.rank;
  query.local_rank = settings.distributed.local_rank;
  query.local_size = settings.distributed.local_size;
  query.own_devices = own && communicator.size() > 1;
  query.node = host;
  query.visible_devices = visible_devices;
  std::vector<torch::Device> devices;
  for (const int index : detail::slot_device_indices(query)) {
    devices.emplace_back(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
  }
  return devices;
}

std::string names_of(const nlohmann::json& object) {
  std::string names;
  for (auto it = object.begin(); it != object.end(); ++it) names += (names.empty() ? "" : ", ") + it.key();
  return names.empty() ? "none" : names;
}

// Refuses an optimizer with a parameter whose gradient the sync does not average across ranks.
void require_parameters_in_gradient_sync(torch::optim::Optimizer& optimizer, const detail::GradientSync& sync) {
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      if (p.requires_grad() && p.numel() > 0 && !sync.covers(p)) {
        throw ConfigError("step_optimizer: the optimizer has a parameter (shape " + c10::str(p.sizes()) +
                          ") that belongs to no wrapped model, so its gradient would not be averaged "
                          "across ranks; wrap the model that owns it with context.wrap_model");
      }
    }
  }
}

// Zeroes the optimizer's gradients in place, as LibTorch 1.x's zero_grad() does, rather than
// setting them to none as 2.x's does by default: the gradients stay views of the all-reduce
// buckets, whatever the version. Returns the optimizer's parameters.
std::vector<torch::Tensor> zero_gradients_in_place(torch::optim::Optimizer& optimizer) {
  std::vector<torch::Tensor> parameters;
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      torch::Tensor& grad = p.mutable_grad();
      if (grad.defined()) {
        grad.detach_();
        grad.zero_();
      }
      parameters.push_back(p);
    }
  }
  return parameters;
}

}  // namespace

TrialContext::TrialContext(TrialSettings settings, comm::Communicator& communicator,
                           comm::Communicator* device_communicator)
    : settings_(std::move(settings)),
      communicator_(communicator),
      device_communicator_(device_communicator),
      data_communicator_(&communicator),
      data_device_communicator_(device_communicator),
      devices_(choose_devices(settings_, communicator)),
      device_(devices_.empty() ? torch::Device(torch::kCPU) : devices_.front()),
      accumulators_(std::make_unique<detail::Accumulators>(communicator)) {
  if (device_.is_cuda()) {
    core::log_info("trains on {}{}", device_.str(),
                   device_communicator_ != nullptr ? " (gradients all-reduced by NCCL)" : "");
  }
  mpu_.data_parallel_rank = settings_.distributed.rank;
  mpu_.data_parallel_world_size = settings_.distributed.size;
  resolve_global_batch_size(settings_.distributed.size);
}

// The global batch of the trial's hyperparameters, a whole number of records for each of
// `replicas` (an engine trial's comes resolved).
void TrialContext::resolve_global_batch_size(int replicas) {
  if (settings_.global_batch_size > 0) {
    global_batch_size_ = settings_.global_batch_size;  // a whole number of records per replica
    return;
  }
  const auto it = settings_.hparams.find("global_batch_size");
  if (it == settings_.hparams.end()) {
    throw ConfigError("hyperparameters.global_batch_size is required: the number of records in "
                      "one batch across all slots, e.g. global_batch_size: 64");
  }
  if (!it->is_number_integer() || it->get<std::int64_t>() < 1) {
    throw ConfigError("hyperparameters.global_batch_size must be a positive integer, got " + it->dump());
  }
  const std::int64_t requested = it->get<std::int64_t>();
  const std::string what = replicas == settings_.distributed.size ? "ranks" : "data-parallel replicas";
  if (requested < replicas) {
    throw ConfigError("hyperparameters.global_batch_size (" + std::to_string(requested) +
                      ") is smaller than the number of " + what + " (" + std::to_string(replicas) +
                      "): every " + (replicas == settings_.distributed.size ? "rank" : "replica") +
                      " needs at least one record a batch");
  }
  const std::int64_t before = global_batch_size_;
  global_batch_size_ = requested / replicas * replicas;
  if (global_batch_size_ != requested && global_batch_size_ != before && settings_.distributed.is_chief()) {
    core::log_warning("hyperparameters.global_batch_size {} is not a multiple of the {} {}: each trains {} "
                      "records a batch, {} in all",
                      requested, replicas, what, requested / replicas, global_batch_size_);
  }
}

TrialContext::LrFactor::LrFactor(torch::optim::Optimizer& optimizer, double factor)
    : optimizer_(factor != 1 ? &optimizer : nullptr) {
  if (optimizer_ == nullptr) return;
  for (auto& group : optimizer.param_groups()) {
    saved_.push_back(group.options().get_lr());
    group.options().set_lr(saved_.back() * factor);
  }
}

TrialContext::LrFactor::~LrFactor() {
  if (optimizer_ == nullptr) return;
  std::size_t i = 0;
  for (auto& group : optimizer_->param_groups()) group.options().set_lr(saved_.at(i++));
}

void TrialContext::set_aggregation(std::int64_t frequency, std::int64_t first_batch) {
  if (frequency < 1) throw InternalError("set_aggregation: " + std::to_string(frequency) + " batches a step");
  settings_.aggregation_frequency = frequency;
  aggregation_origin_ = first_batch;
  if (gradient_sync_) gradient_sync_->set_aggregation_frequency(frequency);
}

void TrialContext::measure_gradient_noise(bool on) {
  measure_noise_ = on;
  if (gradient_sync_) gradient_sync_->measure_norms(on);
}

void TrialContext::precondition_gradient_noise(NoisePreconditioner preconditioner) {
  noise_preconditioner_ = std::move(preconditioner);
  if (gradient_sync_) gradient_sync_->precondition_norms(noise_preconditioner_);
}

void TrialContext::record_gradient_norms(const GradientNorms& norms, double seconds) {
  estimator_seconds_ += seconds;
  if (gradient_norms_listener_) gradient_norms_listener_(norms);
}

double TrialContext::take_sync_wait_seconds() {
  return std::exchange(sync_wait_seconds_, 0.0) + (gradient_sync_ ? gradient_sync_->take_wait_seconds() : 0.0);
}

double TrialContext::take_estimator_seconds() {
  const double measured = gradient_sync_ ? gradient_sync_->take_measure_seconds() : 0.0;
  return std::exchange(estimator_seconds_, 0.0) + measured;
}

std::shared_ptr<Accumulator> TrialContext::make_accumulator(std::string name, Accumulator::Values initial) {
  return accumulators_->make(std::move(name), std::move(initial));
}

TrialContext::~TrialContext() = default;

void TrialContext::register_model(std::shared_ptr<torch::nn::Module> model) {
  if (!model) throw ConfigError("wrap_model: the model is null");
  if (gradient_sync_) {
    throw ConfigError("wrap_model: a model was wrapped after training started; wrap every model in "
                      "the trial's constructor");
  }
  models_.push_back(std::move(model));
}

void TrialContext::register_optimizer(std::shared_ptr<torch::optim::Optimizer> optimizer) {
  if (!optimizer) throw ConfigError("wrap_optimizer: the optimizer is null");
  optimizers_.push_back(std::move(optimizer));
}

void TrialContext::register_lr_scheduler(std::shared_ptr<torch::optim::LRScheduler> scheduler,
                                         StepMode mode) {
  if (!scheduler) throw ConfigError("wrap_lr_scheduler: the scheduler is null");
  schedulers_.push_back({std::move(scheduler), mode});
}

detail::GradientSync& TrialContext::gradient_sync() {
  if (!gradient_sync_) {
    std::vector<torch::Tensor> parameters;
    for (const auto& model : models_) {
      if (std::find(unsynced_models_.begin(), unsynced_models_.end(), model.get()) != unsynced_models_.end()) continue;
      for (const auto& p : model->parameters()) parameters.push_back(p);
    }
    detail::GradientSync::Options options;
    options.bucket_cap_mb = settings_.bucket_cap_mb;
    options.compression = settings_.gradient_compression;
    options.aggregation_frequency = settings_.aggregation_frequency;
    gradient_sync_ =
        std::make_unique<detail::GradientSync>(parameters, *data_communicator_, data_device_communicator_, options);
    gradient_sync_->measure_norms(measure_noise_);
    gradient_sync_->precondition_norms(noise_preconditioner_);
  }
  return *gradient_sync_;
}

void TrialContext::configure_mixed_precision(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::ScalarType::BFloat16:
      mixed_precision_ = dtype;
      return;
    case c10::ScalarType::Float:
      mixed_precision_ = c10::ScalarType::Undefined;
      return;
    case c10::ScalarType::Half:
      if (!device_.is_cuda()) {
        throw NotSupported("configure_mixed_precision(torch::kFloat16) on the CPU: LibTorch's CPU autocast computes in "
                           "bfloat16 only; use torch::kBFloat16 (float32's range, no loss scaling), or train on a GPU "
                           "(resources.gpus_per_slot)");
      }
      mixed_precision_ = dtype;
      return;
    default:
      throw ConfigError(std::string("configure_mixed_precision: ") + c10::toString(dtype) +
                        " is not a mixed precision; use torch::kBFloat16, or torch::kFloat32 for none");
  }
}

void TrialContext::backward(const torch::Tensor& loss, const torch::Tensor& gradient,
                            c10::optional<bool> retain_graph, bool create_graph) {
  const detail::AutocastPause pause;  // backward runs in the types forward chose
  if (data_parallel_size() == 1) {
    loss.backward(gradient, retain_graph, create_graph);
    return;
  }
  detail::GradientSync& sync = gradient_sync();
  // With create_graph the gradients keep their graph for a second backward, so they must be the
  // trial's own; the mean over ranks is then formed at the optimizer step instead.
  const bool scaled = sync.begin_backward(batches_trained_, is_sync_batch(), /*prescale=*/!create_graph);
  try {
    if (!scaled) {
      loss.backward(gradient, retain_graph, create_graph);
    } else if (gradient.defined()) {
      loss.backward(gradient * sync.loss_scale(), retain_graph, create_graph);
    } else {
      (loss * sync.loss_scale()).backward({}, retain_graph, create_graph);
    }
  } catch (...) {
    sync.end_backward();
    throw;
  }
  sync.end_backward();
}

std::shared_ptr<GradScaler> TrialContext::wrap_scaler(std::shared_ptr<GradScaler> scaler) {
  if (!scaler) throw ConfigError("wrap_scaler: the scaler is null");
  if (std::find(scalers_.begin(), scalers_.end(), scaler) != scalers_.end()) {
    throw ConfigError("wrap_scaler: this scaler is wrapped already");
  }
  scalers_.push_back(scaler);
  return scaler;
}

bool TrialContext::step_optimizer(torch::optim::Optimizer& optimizer, const ClipGrads& clip_grads,
                                  bool auto_zero_grads) {
  return step(optimizer, nullptr, clip_grads, auto_zero_grads);
}

bool TrialContext::step_optimizer(torch::optim::Optimizer& optimizer, GradScaler& scaler, const ClipGrads& clip_grads,
                                  bool auto_zero_grads) {
  if (std::none_of(scalers_.begin(), scalers_.end(), [&](const auto& s) { return s.get() == &scaler; })) {
    throw ConfigError("step_optimizer: this GradScaler was not wrapped; create it with context.wrap_scaler(...) so "
                      "its scale is updated after each batch and checkpointed");
  }
  return step(optimizer, &scaler, clip_grads, auto_zero_grads);
}

bool TrialContext::step(torch::optim::Optimizer& optimizer, GradScaler* scaler, const ClipGrads& clip_grads,
                        bool auto_zero_grads) {
  const bool wrapped = std::any_of(optimizers_.begin(), optimizers_.end(),
                                   [&](const auto& o) { return o.get() == &optimizer; });
  if (!wrapped) {
    throw ConfigError("step_optimizer: this optimizer was not wrapped; create it with "
                      "context.wrap_optimizer(...) so its gradients are averaged and it is "
                      "checkpointed");
  }
  if (!auto_zero_grads && settings_.aggregation_frequency > 1) {
    // The group's mean is formed in the gradients themselves; kept after the step, the next
    // group's would start from it. Determined requires the same.
    throw ConfigError("step_optimizer(..., auto_zero_grads = false) with optimizations.aggregation_frequency " +
                      std::to_string(settings_.aggregation_frequency) +
                      ": the gradients must be zeroed after each step when batches are aggregated; pass "
                      "auto_zero_grads = true, or set optimizations.aggregation_frequency: 1 in the experiment config");
  }
  // Gradients accumulate until the last batch of each aggregation group.
  if (!is_sync_batch()) return false;
  if (data_parallel_size() == 1) {
    // No communication at all: only the mean over the aggregated batches.
    if (settings_.aggregation_frequency > 1) divide_gradients(optimizer, static_cast<double>(settings_.aggregation_frequency));
  } else {
    detail::GradientSync& sync = gradient_sync();
    if (std::find(checked_optimizers_.begin(), checked_optimizers_.end(), &optimizer) == checked_optimizers_.end()) {
      require_parameters_in_gradient_sync(optimizer, sync);
      checked_optimizers_.push_back(&optimizer);
    }
    sync.reduce(batches_trained_);
  }
  std::optional<detail::GradientSync::Norms> norms;
  if (measuring_gradient_noise()) norms = gradient_sync().take_norms();
  // The gradients are the same on every rank now, so every rank finds the same inf or NaN.
  const bool skip = scaler != nullptr && scaler->unscale(optimizer);
  if (norms) {
    // Every rank measured its own gradient: their mean, in the scale of unscaled gradients.
    double local = norms->local_sqr;
    if (!norms->averaged) {
      const auto started = std::chrono::steady_clock::now();
      data_communicator_->allreduce(&local, 1, comm::DType::kFloat64, comm::ReduceOp::kAvg);
      estimator_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    }
    const double unscale = scaler != nullptr ? 1.0 / (scaler->get_scale() * scaler->get_scale()) : 1.0;
    if (!skip) record_gradient_norms(GradientNorms{local * unscale, norms->global_sqr * unscale, 0}, 0);
  }
  if (clip_grads && !skip) {
    std::vector<torch::Tensor> parameters;
    for (auto& group : optimizer.param_groups()) {
      for (auto& p : group.params()) parameters.push_back(p);
    }
    clip_grads(parameters);
  }
  if (!skip) {
    if (before_optimizer_step_) before_optimizer_step_();
    const LrFactor scaled(optimizer, lr_factor_);
    optimizer.step();
  }
  if (auto_zero_grads) {
    const std::vector<torch::Tensor> parameters = zero_gradients_in_place(optimizer);
    if (gradient_sync_) gradient_sync_->zeroed(parameters);
  }
  return !skip;
}

void TrialContext::divide_gradients(torch::optim::Optimizer& optimizer, double divisor) {
  torch::NoGradGuard no_grad;
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      if (p.grad().defined()) p.mutable_grad().div_(divisor);
    }
  }
}

void TrialContext::exclude_from_gradient_sync(const std::shared_ptr<torch::nn::Module>& model) {
  if (gradient_sync_) throw InternalError("exclude_from_gradient_sync after training started");
  unsynced_models_.push_back(model.get());
}

torch::Tensor TrialContext::to_device(const torch::Tensor& tensor) const {
  if (!tensor.defined() || tensor.device() == device_) return tensor;
  return tensor.to(device_, /*non_blocking=*/true);
}

Batch TrialContext::to_device(const Batch& batch) const {
  return batch.map_tensors([this](const torch::Tensor& t) { return to_device(t); });
}

const nlohmann::json& TrialContext::hparam_value(const std::string& name) const {
  const auto it = settings_.hparams.find(name);
  if (it == settings_.hparams.end()) {
    throw ConfigError("hyperparameter '" + name + "' is not in the experiment config (it has: " +
                      names_of(settings_.hparams) + "); add hyperparameters." + name + " to it");
  }
  return *it;
}

void TrialContext::throw_hparam_type(const std::string& name, const nlohmann::json& value) const {
  throw ConfigError("hyperparameter '" + name + "' is " + value.dump() + " (" + value.type_name() +
                    "), which the trial cannot read as the type it asked for");
}

std::shared_ptr<MetricReducer> TrialContext::wrap_reducer(std::shared_ptr<MetricReducer> reducer,
                                                          std::optional<std::string> name, bool for_training,
                                                          bool for_validation) {
  if (!reducer) throw ConfigError("wrap_reducer: the reducer is null");
  if (name && name->empty()) {
    throw ConfigError("wrap_reducer: the name is empty; name the metric, or pass no name (std::nullopt) for a "
                      "reducer whose result is an object of metrics");
  }
  for (const auto& existing : reducers_) {
    if (name && existing.name == name) throw ConfigError("wrap_reducer: a reducer named '" + *name + "' exists already");
  }
  std::string key = name ? *name : "unnamed reducer " + std::to_string(reducers_.size());
  reducers_.push_back({reducer, std::move(name), std::move(key), for_training, for_validation});
  return reducer;
}

std::shared_ptr<FunctionReducer> TrialContext::wrap_reducer(FunctionReducer::Function function,
                                                            std::optional<std::string> name,
                                                            bool for_training, bool for_validation) {
  auto reducer = std::make_shared<FunctionReducer>(std::move(function));
  wrap_reducer(std::static_pointer_cast<MetricReducer>(reducer), std::move(name), for_training, for_validation);
  return reducer;
}

void TrialContext::set_loop_position(bool epoch_start, bool epoch_end, std::int64_t batches_trained) {
  epoch_start_ = epoch_start;
  epoch_end_ = epoch_end;
  batches_trained_ = batches_trained;
  loop_batches_ = batches_trained;
  batch_started_ = true;
}

void TrialContext::set_micro_step(std::int64_t micro_steps) { batches_trained_ = micro_steps; }

SummaryWriter& TrialContext::tensorboard_writer() {
  if (!summary_writer_) {
    // The default step is the harness's: the batches trained once the current one is done.
    summary_writer_ = std::make_unique<SummaryWriter>(
        settings_.tensorboard_dir, [this] { return loop_batches_ + (batch_started_ ? 1 : 0); });
  }
  return *summary_writer_;
}

void TrialContext::set_profiler(std::int64_t begin_batch, std::int64_t end_batch) {
  if (begin_batch < 1 || end_batch < begin_batch) {
    throw ConfigError("set_profiler(" + std::to_string(begin_batch) + ", " + std::to_string(end_batch) +
                      "): batches are counted from 1 and the window must not end before it begins");
  }
  settings_.profiler_window = ProfilerWindow{begin_batch, end_batch};
}

}  // namespace hpctrial::trainer
