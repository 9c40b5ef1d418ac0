// SIGUSR1, SIGUSR2, SIGTERM and SIGINT as stop requests. Internal to the trainer.
#pragma once

#include <atomic>

namespace hpctrial::trainer::detail {

// Installs handlers that only set the flag (no I/O, no allocation); idempotent.
void install_stop_handlers();
// Set once any of the signals arrived.
const std::atomic<bool>& stop_signal_received();

}  // namespace hpctrial::trainer::detail
