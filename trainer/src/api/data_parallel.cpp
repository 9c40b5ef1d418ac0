// The data-parallel view of a TrialContext: its model-parallel unit, the data-parallel group's
// communicators, and the replicas' common start.
#include <map>

#include "hpctrial/comm/communicator.h"
#include "hpctrial/core/error.h"
#include "hpctrial/trainer/trial_context.h"
#include "parallel/gradient_sync.h"

namespace hpctrial::trainer {

void TrialContext::set_mpu(ModelParallelUnit unit) {
  const std::string rank = "set_mpu on rank " + std::to_string(settings_.distributed.rank) + ": ";
  if (training_started_) {
    throw ConfigError(rank + "called after training started; set the unit in the trial's constructor");
  }
  if (mpu_set_) throw ConfigError(rank + "called twice; a trial has one model-parallel unit");
  const int ranks = settings_.distributed.size;
  const int replicas = unit.data_parallel_world_size;
  if (replicas < 1 || ranks % replicas != 0) {
    throw ConfigError(rank + "data_parallel_world_size is " + std::to_string(replicas) + ", which does not divide the " +
                      std::to_string(ranks) + " ranks into replicas of equal size");
  }
  if (unit.data_parallel_rank < 0 || unit.data_parallel_rank >= replicas) {
    throw ConfigError(rank + "data_parallel_rank is " + std::to_string(unit.data_parallel_rank) +
                      ", outside 0 .. data_parallel_world_size - 1 (" + std::to_string(replicas - 1) + ")");
  }
  const auto& group = unit.data_parallel_group;
  if (replicas > 1 && !group) {
    throw ConfigError(rank + "data_parallel_group is null with " + std::to_string(replicas) +
                      " replicas; make it with context.communicator().split(model-parallel position, "
                      "data_parallel_rank)");
  }
  if (group && (group->size() != replicas || group->rank() != unit.data_parallel_rank)) {
    throw ConfigError(rank + "data_parallel_group has " + std::to_string(group->size()) + " rank(s) and ranks this one " +
                      std::to_string(group->rank()) + ", but the unit says data_parallel_world_size " +
                      std::to_string(replicas) + " and data_parallel_rank " + std::to_string(unit.data_parallel_rank) +
                      "; split it with key data_parallel_rank among the ranks of one model-parallel position");
  }
  if (settings_.distributed.rank == 0 && unit.data_parallel_rank != 0) {
    throw ConfigError(rank + "the chief (rank 0) has data_parallel_rank " + std::to_string(unit.data_parallel_rank) +
                      "; number the replicas so that rank 0 is in the first");
  }
  mpu_ = std::move(unit);
  mpu_set_ = true;
  // One replica and no group: a group of this rank alone.
  if (!mpu_.data_parallel_group) mpu_.data_parallel_group = std::make_shared<comm::LocalCommunicator>();
  data_communicator_ = mpu_.data_parallel_group.get();
  // The device communicator spans the world: a smaller group's gradients go through the host.
  data_device_communicator_ = replicas == ranks ? device_communicator_ : nullptr;
  resolve_global_batch_size(replicas);
}

void TrialContext::set_engine_batch(std::int64_t global_batch, std::int64_t accumulation) {
  if (training_started_) throw InternalError("set_engine_batch after training started");
  settings_.global_batch_size = global_batch;
  global_batch_size_ = global_batch;
  set_aggregation(accumulation, 0);
}

comm::Communicator& TrialContext::communicator_for(const torch::Device& device) const {
  if (device.is_cpu()) return *data_communicator_;
  if (data_device_communicator_ == nullptr) {
    if (device_communicator_ != nullptr) {
      throw NotSupported("tensors on " + device.str() + " of a data-parallel group smaller than the world need a "
                         "device communicator of that group, which hpctrial does not make yet; train this "
                         "model-parallel trial on the CPU (resources.gpus_per_slot: 0), or without ZeRO");
    }
    throw NotSupported("tensors on " + device.str() + " need a device communicator (NCCL), and this run has none; "
                       "train on the CPU (resources.gpus_per_slot: 0) or build hpctrial with CUDA and NCCL");
  }
  return *data_device_communicator_;
}

void TrialContext::start_training() {
  training_started_ = true;
  if (data_parallel_size() > 1) gradient_sync();
}

// Within each data-parallel group: the replicas of one part of the model start alike.
void TrialContext::broadcast_model_state() {
  if (data_parallel_size() == 1) return;
  torch::NoGradGuard no_grad;
  // One buffer per dtype and device, broadcast in one collective each.
  std::map<std::pair<int, std::string>, std::vector<torch::Tensor>> groups;
  for (auto& model : models_) {
    for (auto& p : model->parameters()) groups[{static_cast<int>(p.scalar_type()), p.device().str()}].push_back(p);
    for (auto& b : model->buffers()) groups[{static_cast<int>(b.scalar_type()), b.device().str()}].push_back(b);
  }
  for (auto& [key, tensors] : groups) {
    std::vector<torch::Tensor> parts;
    for (auto& t : tensors) parts.push_back(t.reshape({-1}));
    torch::Tensor flat = torch::cat(parts).contiguous();
    comm::Communicator* communicator = data_communicator_;
    if (!flat.device().is_cpu()) {
      if (data_device_communicator_ != nullptr) {
        communicator = data_device_communicator_;
      } else {
        flat = flat.to(torch::kCPU);
      }
    }
    communicator->broadcast_async(flat.data_ptr(), static_cast<std::size_t>(flat.nbytes()), 0)->wait();
    std::int64_t offset = 0;
    for (auto& t : tensors) {
      const std::int64_t n = t.numel();
      t.copy_(flat.slice(0, offset, offset + n).view(t.sizes()));
      offset += n;
    }
  }
}

}  // namespace hpctrial::trainer
