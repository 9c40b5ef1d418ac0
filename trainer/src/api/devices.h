// Which CUDA devices a rank's slot trains on (internal to the trainer, free of LibTorch).
//
// A slot has resources.gpus_per_slot devices. A rank whose CUDA_VISIBLE_DEVICES differs from the
// other ranks' of its node sees its own devices (Slurm's --gpu-bind, a per-rank launcher): it
// takes the first gpus_per_slot of them. Ranks that see the same devices split them: local rank
// r takes devices r*g .. r*g+g-1. Ranks never share a device silently: too few devices for the
// node's ranks end the run, naming the node and the counts.
#pragma once

#include <string>
#include <vector>

namespace hpctrial::trainer::detail {

struct SlotDeviceQuery {
  int gpus_per_slot = 0;
  int visible = 0;  // the devices this rank sees
  int rank = 0;
  int local_rank = 0;
  int local_size = 1;
  bool own_devices = false;  // this rank's CUDA_VISIBLE_DEVICES is its own, unlike its node peers'
  std::string node;
  std::string visible_devices;  // CUDA_VISIBLE_DEVICES as the rank has it, for messages
};

// The indices (among the visible devices) of the slot's devices; ConfigError when there are
// none or too few.
std::vector<int> slot_device_indices(const SlotDeviceQuery& query);

}  // namespace hpctrial::trainer::detail
