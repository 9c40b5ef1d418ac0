#include "hpctrial/rank/stop_signals.h"

#include <signal.h>
#include <string.h>

#include <initializer_list>

namespace hpctrial::rank {
namespace {

std::atomic<bool> g_stop_requested{false};

extern "C" void on_stop_signal(int) { g_stop_requested.store(true); }

constexpr int kStopSignals[] = {SIGUSR1, SIGUSR2, SIGTERM, SIGINT};

}  // namespace

void install_stop_handlers() {
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  sigset_t stop;
  sigemptyset(&stop);
  for (int signal : kStopSignals) {
    sigaction(signal, &action, nullptr);
    sigaddset(&stop, signal);
  }
  // The rank's parent starts it with the warnings blocked; one that came before is delivered now.
  pthread_sigmask(SIG_UNBLOCK, &stop, nullptr);
}

std::string replaced_stop_handlers() {
  std::string replaced;
  for (int signal : kStopSignals) {
    struct sigaction current {};
    if (sigaction(signal, nullptr, &current) != 0) continue;
    if ((current.sa_flags & SA_SIGINFO) == 0 && current.sa_handler == on_stop_signal) continue;
    replaced += (replaced.empty() ? "SIG" : ", SIG") + std::string(sigabbrev_np(signal));
  }
  return replaced;
}

const std::atomic<bool>& stop_signal_received() { return g_stop_requested; }

void clear_stop_signal() { g_stop_requested.store(false); }

}  // namespace hpctrial::rank
