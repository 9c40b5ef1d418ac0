// The processes of an attempt as the launcher handles them: its signals (a signalfd), mpirun
// started with its output on pipes, and the process tree below mpirun (the launcher is its
// subreaper), to find each rank's process and to leave nothing behind.
#pragma once

#include <signal.h>
#include <sys/signalfd.h>
#include <sys/types.h>
#include <unistd.h>

#include <cerrno>

#include <map>
#include <optional>
#include <vector>

#include "hpctrial/core/error.h"
#include "hpctrial/core/subprocess.h"
#include "hpctrial/launcher/launcher.h"

namespace hpctrial::launcher::detail {

// The signals the launcher handles, read from a signalfd in its poll loop.
// A warning or a pause (USR1, USR2; URG, PBS's pause) that comes while the launcher starts
// waits, blocked, for the SignalFd: call it first. The batch script ignores USR1 and USR2 until
// the launcher is there, and an ignored signal never reaches a signalfd (URG is ignored by
// default, but held while blocked). SIGTERM, SIGINT and SIGHUP still end a launcher that has not
// started the ranks (one waiting for a trial's lock, say).
inline void hold_warning_signals() {
  sigset_t set;
  sigemptyset(&set);
  for (int s : {SIGUSR1, SIGUSR2, SIGURG}) sigaddset(&set, s);
  ::sigprocmask(SIG_BLOCK, &set, nullptr);
  for (int s : {SIGUSR1, SIGUSR2, SIGURG}) ::signal(s, SIG_DFL);
}

class SignalFd {
 public:
  SignalFd() {
    sigemptyset(&set_);
    for (int s : {SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2, SIGURG, SIGCHLD}) sigaddset(&set_, s);
    if (::sigprocmask(SIG_BLOCK, &set_, &old_) != 0) core::throw_errno("cannot block the launcher's signals", errno);
    fd_ = ::signalfd(-1, &set_, SFD_CLOEXEC | SFD_NONBLOCK);
    if (fd_ < 0) core::throw_errno("cannot create a signalfd", errno);
  }
  ~SignalFd() {
    ::close(fd_);
    ::sigprocmask(SIG_SETMASK, &old_, nullptr);
  }
  int fd() const { return fd_; }
  // The next pending signal, or 0.
  int next() {
    signalfd_siginfo info{};
    const ssize_t n = ::read(fd_, &info, sizeof info);
    return n == static_cast<ssize_t>(sizeof info) ? static_cast<int>(info.ssi_signo) : 0;
  }

 private:
  sigset_t set_{}, old_{};
  int fd_ = -1;
};

// Every process below this one (children, their children, ...), from /proc.
std::vector<pid_t> descendants();
// Reaps mpirun (its status into *mpirun_status once it ended) and any orphan handed to us.
void reap(pid_t mpirun, std::optional<int>* mpirun_status);
// `tasks`, in the three below: under srun, the NAME=value of the attempt's environment that
// marks its tasks (they are not below the launcher); empty under mpirun.
// SIGKILL to mpirun and everything below it, reaping them, and to the tasks, until nothing is left.
void kill_everything(pid_t mpirun, std::optional<int>* mpirun_status, const std::string& tasks = "");
// Open MPI's session directory of an mpirun that ran here, <tmp>/ompi.<host>.<uid>/pid.<pid>
// (tmp: orte_tmpdir_base, else TMPDIR, TEMP, TMP, else /tmp). mpirun removes it when it ends by
// itself, not when killed: 8 MiB a killed attempt in /tmp, until the node's disk is full.
std::string session_dir(pid_t mpirun);
// Removes it, once mpirun is reaped (kill_everything does).
void remove_session_dir(pid_t mpirun);
// Removes this user's session directories on this host whose process is gone - left by a
// launcher that was itself killed (spawn_mpirun does, before it starts one). Those of live
// Open MPI processes stay, whatever they are: a singleton's orted has one beside mpirun's.
void remove_stale_session_dirs();
// The rank processes of this host by rank (from their environment), zombies included: mpirun's
// children, or the tasks.
std::map<int, pid_t> rank_processes(pid_t mpirun, const std::string& tasks = "");
// SIGKILL to every process below mpirun, not mpirun itself; or to the tasks of this host.
void kill_ranks(pid_t mpirun, const std::string& tasks = "");

// Starts mpirun with the command's environment, its stdout and stderr on pipes, in a process
// group of its own (so that a Ctrl-C on the terminal reaches only the launcher, which turns it
// into a stop request), killed when the launcher dies.
core::Child spawn_mpirun(const MpirunCommand& command);

}  // namespace hpctrial::launcher::detail
