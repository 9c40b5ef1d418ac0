// What the ranks' records say of how an attempt ended, once mpirun has.
#include <errno.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "hpctrial/core/env.h"
#include "hpctrial/core/logging.h"
#include "supervisor.h"

namespace hpctrial::launcher::detail {

bool Supervisor::all_ranks_exited(int np, int code) const {
  if (static_cast<int>(beats_.size()) < np) return false;
  const std::string host = core::host_name();
  for (const auto& [rank, record] : beats_) {
    if (!record.end || record.end->kind != core::RankEnd::Kind::kExit || record.end->code != code) return false;
    if (record.host != host) continue;
    const auto status = detail::zombie_status(record.pid);
    const bool gone = !status && ::kill(record.pid, 0) != 0 && errno == ESRCH;
    if (!gone && !(status && WIFEXITED(*status) && WEXITSTATUS(*status) == code)) return false;
  }
  return true;
}

bool Supervisor::mpirun_set_up() {
  if (Clock::now() - started_ > kMpirunSetUp || !beats_.empty()) return true;
  for (const auto& [rank, record] : core::read_heartbeats(trial_.heartbeat_dir())) beats_[rank] = record;
  return !beats_.empty();
}

void Supervisor::pass_stop_to_ranks() {
  ::kill(child_, SIGUSR2);
  for (const auto& [rank, pid] : rank_processes(child_, tasks_)) {
    if (beats_.count(rank) != 0) ::kill(pid, SIGUSR2);
  }
}

bool Supervisor::finished_despite_warning() {
  const int status = attempt_->status;
  if (!attempt_->stop_requested || !WIFSIGNALED(status) || WTERMSIG(status) != SIGUSR2) return false;
  for (const auto& [rank, record] : core::read_heartbeats(trial_.heartbeat_dir())) beats_[rank] = record;
  if (!all_ranks_exited(np_, kExitFinished)) return false;
  core::log_info("mpirun ended of the warning it was passed as the ranks finished; every rank had finished");
  return true;
}

}  // namespace hpctrial::launcher::detail
