// Device-memory collectives over NCCL, bootstrapped over MPI.
//
// Every rank of `comm` calls make_nccl_communicator together: the rank picks its GPU (local rank
// modulo the visible devices), rank 0 calls ncclGetUniqueId, the id is broadcast with MPI_Bcast,
// and every rank calls ncclCommInitRank. The returned Communicator reduces, broadcasts,
// reduce-scatters and all-gathers device pointers on a stream of its own that first waits for
// the work queued so far on the device's default stream; wait() polls the operation's event and
// ncclCommGetAsyncError, and a failed or stuck communicator is torn down with ncclCommAbort
// (also from the watchdog, before it ends the job) - never ncclCommDestroy on the error path.
// The byte-string collectives (broadcast of a string, allgather, gather, barrier) travel over
// MPI.
//
// Built only with CUDA and NCCL (HPCTRIAL_WITH_NCCL); otherwise nccl_available() is false and
// make_nccl_communicator throws NotSupported.
#pragma once

#include <mpi.h>

#include <memory>

#include "hpctrial/comm/communicator.h"

namespace hpctrial::comm {

class Watchdog;

bool nccl_available();
std::unique_ptr<Communicator> make_nccl_communicator(MPI_Comm comm, int local_rank, Watchdog* watchdog);

}  // namespace hpctrial::comm
