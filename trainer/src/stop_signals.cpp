#include "stop_signals.h"

#include <signal.h>

#include <initializer_list>

namespace hpctrial::trainer::detail {
namespace {

std::atomic<bool> g_stop_requested{false};

extern "C" void on_stop_signal(int) { g_stop_requested.store(true); }

}  // namespace

void install_stop_handlers() {
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  for (int signal : {SIGUSR1, SIGUSR2, SIGTERM, SIGINT}) sigaction(signal, &action, nullptr);
}

const std::atomic<bool>& stop_signal_received() { return g_stop_requested; }

}  // namespace hpctrial::trainer::detail
