#include "api/devices.h"

#include "hpctrial/core/error.h"

namespace hpctrial::trainer::detail {

std::vector<int> slot_device_indices(const SlotDeviceQuery& q) {
  const std::string g = std::to_string(q.gpus_per_slot);
  const std::string seen = q.visible_devices.empty() ? "" : " (CUDA_VISIBLE_DEVICES=" + q.visible_devices + ")";
  if (q.visible == 0) {
    throw ConfigError("resources.gpus_per_slot is " + g + " but rank " + std::to_string(q.rank) + " on " + q.node +
                      " sees no GPU (LibTorch without CUDA, or no device visible" + seen +
                      "); set resources.gpus_per_slot: 0 to train on the CPU");
  }
  int first = 0;
  if (q.own_devices) {
    if (q.visible < q.gpus_per_slot) {
      throw ConfigError("resources.gpus_per_slot is " + g + " but rank " + std::to_string(q.rank) + " on " + q.node +
                        " sees " + std::to_string(q.visible) + " device(s) of its own" + seen +
                        ": bind " + g + " GPUs to each rank, or lower resources.gpus_per_slot to " +
                        std::to_string(q.visible));
    }
  } else {
    const int needed = q.local_size * q.gpus_per_slot;
    if (q.visible < needed) {
      throw ConfigError("node " + q.node + " runs " + std::to_string(q.local_size) + " ranks with resources.gpus_per_slot " +
                        g + ", which need " + std::to_string(needed) + " GPUs, and its ranks see " +
                        std::to_string(q.visible) + seen + ": ranks would share a device. " +
                        (q.visible >= q.gpus_per_slot
                             ? "Set resources.slots_per_node to at most " + std::to_string(q.visible / q.gpus_per_slot) +
                                   " (hpctrial submit places that many ranks on a node), or request more GPUs per node"
                             : "Lower resources.gpus_per_slot to " + std::to_string(q.visible) +
                                   " or fewer and resources.slots_per_node to 1, or request more GPUs per node"));
    }
    first = q.local_rank * q.gpus_per_slot;
  }
  std::vector<int> out;
  for (int i = 0; i < q.gpus_per_slot; ++i) out.push_back(first + i);
  return out;
}

}  // namespace hpctrial::trainer::detail
