// This build has no NCCL: the device communicator does not exist, and says so.
#include "hpctrial/core/error.h"
#include "hpctrial/comm/nccl_communicator.h"

namespace hpctrial::comm {

bool nccl_available() { return false; }

std::unique_ptr<Communicator> make_nccl_communicator(MPI_Comm, int, Watchdog*) {
  throw NotSupported("this build of hpctrial has no NCCL (CUDA and NCCL were not found when it was "
                     "configured), so gradients cannot be reduced on GPUs");
}

}  // namespace hpctrial::comm
