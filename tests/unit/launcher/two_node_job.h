// The allocation the launcher's command tests run in: Slurm job 4242 on two nodes of 4 slots.
#pragma once

#include "hpctrial/core/allocation.h"

namespace hpctrial::testing_launcher {

inline core::Allocation two_node_job() {
  core::Allocation a;
  a.scheduler = "slurm";
  a.job_id = "4242";
  a.hosts = {{"node1", 4}, {"node2", 4}};
  return a;
}

}  // namespace hpctrial::testing_launcher
