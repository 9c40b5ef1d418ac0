#include "hpctrial/trainer/trial_context.h"

#include <torch/cuda.h>

#include <algorithm>
#include <cstring>
#include <map>

#include "hpctrial/core/error.h"
#include "hpctrial/mpi_launcher/communicator.h"

namespace hpctrial::trainer {
namespace {

torch::Device choose_device(const TrialSettings& settings) {
  if (settings.gpus_per_slot == 0) return torch::kCPU;
  const auto visible = static_cast<int>(torch::cuda::device_count());
  if (visible == 0) {
    throw ConfigError("resources.gpus_per_slot is " + std::to_string(settings.gpus_per_slot) +
                      " but rank " + std::to_string(settings.distributed.rank) +
                      " sees no GPU (LibTorch without CUDA, or no device visible); set "
                      "resources.gpus_per_slot: 0 to train on the CPU");
  }
  return torch::Device(torch::kCUDA,
                       static_cast<c10::DeviceIndex>(settings.distributed.local_rank % visible));
}

std::string names_of(const nlohmann::json& object) {
  std::string names;
  for (auto it = object.begin(); it != object.end(); ++it) names += (names.empty() ? "" : ", ") + it.key();
  return names.empty() ? "none" : names;
}

}  // namespace

TrialContext::TrialContext(TrialSettings settings, mpi_launcher::Communicator& communicator)
    : settings_(std::move(settings)), communicator_(communicator), device_(choose_device(settings_)) {
  const auto it = settings_.hparams.find("global_batch_size");
  if (it == settings_.hparams.end()) {
    throw ConfigError("hyperparameters.global_batch_size is required: the number of records in "
                      "one batch across all slots, e.g. global_batch_size: 64");
  }
  if (!it->is_number_integer() || it->get<std::int64_t>() < 1) {
    throw ConfigError("hyperparameters.global_batch_size must be a positive integer, got " + it->dump());
  }
  global_batch_size_ = it->get<std::int64_t>();
  if (global_batch_size_ % settings_.distributed.size != 0) {
    throw ConfigError("hyperparameters.global_batch_size (" + std::to_string(global_batch_size_) +
                      ") must be a multiple of the number of slots (" +
                      std::to_string(settings_.distributed.size) + ")");
  }
}

void TrialContext::register_model(std::shared_ptr<torch::nn::Module> model) {
  if (!model) throw ConfigError("wrap_model: the model is null");
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

void TrialContext::backward(const torch::Tensor& loss) { loss.backward(); }

void TrialContext::step_optimizer(torch::optim::Optimizer& optimizer, const ClipGrads& clip_grads,
                                  bool auto_zero_grads) {
  const bool wrapped = std::any_of(optimizers_.begin(), optimizers_.end(),
                                   [&](const auto& o) { return o.get() == &optimizer; });
  if (!wrapped) {
    throw ConfigError("step_optimizer: this optimizer was not wrapped; create it with "
                      "context.wrap_optimizer(...) so its gradients are averaged and it is "
                      "checkpointed");
  }
  // Gradients accumulate until the last batch of each aggregation group.
  if ((batches_trained_ + 1) % settings_.aggregation_frequency != 0) return;
  average_gradients(optimizer);
  if (clip_grads) {
    std::vector<torch::Tensor> parameters;
    for (auto& group : optimizer.param_groups()) {
      for (auto& p : group.params()) parameters.push_back(p);
    }
    clip_grads(parameters);
  }
  optimizer.step();
  if (auto_zero_grads) optimizer.zero_grad();
}

void TrialContext::average_gradients(torch::optim::Optimizer& optimizer) {
  const double divisor =
      static_cast<double>(settings_.aggregation_frequency) * settings_.distributed.size;
  std::vector<torch::Tensor> grads;
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      if (p.grad().defined()) grads.push_back(p.mutable_grad());
    }
  }
  if (grads.empty()) return;
  if (settings_.distributed.size == 1) {
    if (divisor != 1.0) {
      torch::NoGradGuard no_grad;
      for (auto& g : grads) g.div_(divisor);
    }
    return;
  }
  // One flat host buffer per dtype, reduced in one call each.
  torch::NoGradGuard no_grad;
  std::map<c10::ScalarType, std::vector<torch::Tensor>> by_type;
  for (auto& g : grads) by_type[g.scalar_type()].push_back(g);
  for (auto& [type, tensors] : by_type) {
    std::vector<torch::Tensor> flat_parts;
    for (auto& t : tensors) flat_parts.push_back(t.reshape({-1}));
    torch::Tensor flat = torch::cat(flat_parts).to(torch::kCPU).contiguous();
    mpi_launcher::DType dtype;
    if (type == torch::kFloat32) {
      dtype = mpi_launcher::DType::kFloat32;
    } else if (type == torch::kFloat64) {
      dtype = mpi_launcher::DType::kFloat64;
    } else {
      throw NotSupported(std::string("averaging gradients of type ") + c10::toString(type) +
                         " across ranks on the CPU path; use float32 or float64 parameters");
    }
    communicator_.allreduce(flat.data_ptr(), static_cast<std::size_t>(flat.numel()), dtype,
                            mpi_launcher::ReduceOp::kSum);
    flat.div_(divisor);
    std::int64_t offset = 0;
    for (auto& t : tensors) {
      const std::int64_t n = t.numel();
      t.copy_(flat.slice(0, offset, offset + n).view(t.sizes()));
      offset += n;
    }
  }
}

void TrialContext::broadcast_model_state() {
  if (settings_.distributed.size == 1) return;
  torch::NoGradGuard no_grad;
  for (auto& model : models_) {
    std::vector<torch::Tensor> tensors;
    for (auto& p : model->parameters()) tensors.push_back(p);
    for (auto& b : model->buffers()) tensors.push_back(b);
    for (auto& t : tensors) {
      torch::Tensor host = t.to(torch::kCPU).contiguous();
      std::string bytes(static_cast<const char*>(host.data_ptr()),
                        static_cast<std::size_t>(host.nbytes()));
      communicator_.broadcast(bytes, 0);
      std::memcpy(host.data_ptr(), bytes.data(), bytes.size());
      t.copy_(host);
    }
  }
}

torch::Tensor TrialContext::to_device(const torch::Tensor& tensor) const {
  if (!tensor.defined() || tensor.device() == device_) return tensor;
  return tensor.to(device_, /*non_blocking=*/true);
}

Batch TrialContext::to_device(const Batch& batch) const {
  return {to_device(batch.data), to_device(batch.target)};
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
                                                          const std::string& name, bool for_training,
                                                          bool for_validation) {
  if (!reducer) throw ConfigError("wrap_reducer: the reducer is null");
  for (const auto& existing : reducers_) {
    if (existing.name == name) throw ConfigError("wrap_reducer: a reducer named '" + name + "' exists already");
  }
  reducers_.push_back({reducer, name, for_training, for_validation});
  return reducer;
}

std::shared_ptr<FunctionReducer> TrialContext::wrap_reducer(FunctionReducer::Function function,
                                                            const std::string& name,
                                                            bool for_training, bool for_validation) {
  auto reducer = std::make_shared<FunctionReducer>(std::move(function));
  wrap_reducer(std::static_pointer_cast<MetricReducer>(reducer), name, for_training, for_validation);
  return reducer;
}

void TrialContext::set_loop_position(bool epoch_start, bool epoch_end, std::int64_t batches_trained) {
  epoch_start_ = epoch_start;
  epoch_end_ = epoch_end;
  batches_trained_ = batches_trained;
}

}  // namespace hpctrial::trainer
