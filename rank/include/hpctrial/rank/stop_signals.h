// SIGUSR1, SIGUSR2, SIGTERM and SIGINT as stop requests. Used by every rank the launcher starts.
//
// Install them after MPI and NCCL are initialised: some NCCL builds and MPI libraries install
// handlers of their own, and the last one installed wins.
#pragma once

#include <atomic>
#include <string>

namespace hpctrial::rank {

// Installs handlers that only set the flag (no I/O, no allocation), then unblocks the signals in
// the calling thread (the rank's parent starts a rank with SIGUSR1 and SIGUSR2 blocked, so that a
// warning that comes before the handlers waits for them); idempotent.
void install_stop_handlers();
// The stop signals whose handler is no longer ours (e.g. "SIGUSR1"), comma-separated; empty
// when all are.
std::string replaced_stop_handlers();
// Set once any of the signals arrived.
const std::atomic<bool>& stop_signal_received();
// Forgets a stop signal once it was acted on: a process that trains again after stopping.
void clear_stop_signal();

}  // namespace hpctrial::rank
