// The launcher's supervision of one mpirun per attempt, and the exit protocol across attempts.
#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <iostream>
#include <map>
#include <set>
#include <sstream>

#include "hpctrial/core/batch_job.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/files.h"
#include "hpctrial/core/launch_contract.h"
#include "hpctrial/core/logging.h"
#include "hpctrial/core/search.h"
#include "hpctrial/core/shell_quote.h"
#include "hpctrial/core/text.h"
#include "hpctrial/mpi_launcher/launcher.h"
#include "hpctrial/pbs/batch_script.h"
#include "hpctrial/pbs/client.h"
#include "hpctrial/slurm/client.h"
#include "launcher_internal.h"

extern char** environ;

namespace hpctrial::mpi_launcher {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using nlohmann::json;

constexpr auto kKillGrace = std::chrono::seconds(5);  // SIGTERM to mpirun, then SIGKILL to all
constexpr auto kHeartbeatCheck = std::chrono::seconds(1);
constexpr auto kHeartbeatCheckStopping = std::chrono::milliseconds(50);

std::string describe_seconds(std::int64_t seconds) {
  return seconds < 120 ? std::to_string(seconds) + " s" : core::format_duration(seconds);
}

// The signals the launcher handles, read from a signalfd in its poll loop.
class SignalFd {
 public:
  SignalFd() {
    sigemptyset(&set_);
    for (int s : {SIGINT, SIGTERM, SIGUSR1, SIGUSR2, SIGCHLD}) sigaddset(&set_, s);
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

// Every process below the launcher (ranks orphaned by a dead mpirun come to it: it is their
// subreaper), from /proc.
std::vector<pid_t> descendants() {
  std::map<pid_t, std::vector<pid_t>> children;
  DIR* d = ::opendir("/proc");
  if (d == nullptr) return {};
  while (const dirent* entry = ::readdir(d)) {
    const pid_t pid = static_cast<pid_t>(std::atoi(entry->d_name));
    if (pid <= 0) continue;
    std::ifstream in(std::string("/proc/") + entry->d_name + "/stat");
    std::string stat;
    if (!std::getline(in, stat)) continue;
    const auto close = stat.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(stat.substr(close + 2));
    char state;
    pid_t ppid;
    if (rest >> state >> ppid) children[ppid].push_back(pid);
  }
  ::closedir(d);
  std::vector<pid_t> out;
  std::vector<pid_t> unvisited = {::getpid()};
  while (!unvisited.empty()) {
    const pid_t p = unvisited.back();
    unvisited.pop_back();
    for (pid_t c : children[p]) {
      out.push_back(c);
      unvisited.push_back(c);
    }
  }
  return out;
}

// Reaps every ended child; mpirun's status goes to `mpirun_status` when it is among them.
void reap(pid_t mpirun, std::optional<int>* mpirun_status) {
  for (int status = 0;;) {
    const pid_t ended = ::waitpid(-1, &status, WNOHANG);
    if (ended <= 0) return;
    if (ended == mpirun && mpirun_status != nullptr) *mpirun_status = status;
  }
}

// SIGKILL to mpirun's process group and every process below the launcher; reaps them.
void kill_everything(pid_t mpirun, std::optional<int>* mpirun_status) {
  if (mpirun > 0) ::kill(-mpirun, SIGKILL);
  for (int round = 0; round < 3; ++round) {
    const auto left = descendants();
    if (left.empty()) break;
    for (pid_t p : left) ::kill(p, SIGKILL);
    ::usleep(20000);
    reap(mpirun, mpirun_status);
  }
  reap(mpirun, mpirun_status);
}

// mpirun's children on this host (each the parent of one rank) by rank, from the rank number
// Open MPI gives them in their environment.
std::map<int, pid_t> rank_processes(pid_t mpirun) {
  std::map<int, pid_t> out;
  for (pid_t pid : descendants()) {
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string text;
    if (!std::getline(stat, text) || text.rfind(')') == std::string::npos) continue;
    std::istringstream rest(text.substr(text.rfind(')') + 2));
    char state;
    pid_t ppid = 0;
    if (!(rest >> state >> ppid) || ppid != mpirun) continue;
    std::ifstream environ_file("/proc/" + std::to_string(pid) + "/environ", std::ios::binary);
    for (std::string entry; std::getline(environ_file, entry, '\0');) {
      if (entry.rfind("OMPI_COMM_WORLD_RANK=", 0) == 0) {
        try {
          out[std::stoi(entry.substr(21))] = pid;
        } catch (const std::exception&) {
        }
      }
    }
  }
  return out;
}

// SIGKILL to every process below the launcher except mpirun: once a rank has failed, the
// others are stuck in collectives, and mpirun would give them the whole grace
// (odls_base_sigkill_timeout) before it kills them. mpirun then reports the failure and exits.
void kill_ranks(pid_t mpirun) {
  for (pid_t p : descendants()) {
    if (p != mpirun) ::kill(p, SIGKILL);
  }
}

struct Spawned {
  pid_t pid = -1;
  int out_fd = -1;
  int err_fd = -1;
};

// Starts mpirun in a process group of its own (so that a Ctrl-C on the terminal reaches only
// the launcher, which turns it into a stop request), killed when the launcher dies.
Spawned spawn_mpirun(const MpirunCommand& command) {
  std::vector<std::string> env_strings;
  std::set<std::string> overridden;
  for (const auto& [name, value] : command.env) {
    env_strings.push_back(name + "=" + value);
    overridden.insert(name);
  }
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry = *e;
    if (overridden.count(entry.substr(0, entry.find('='))) == 0) env_strings.push_back(entry);
  }
  std::vector<char*> envp, argv;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> args = command.argv;
  for (auto& s : args) argv.push_back(s.data());
  argv.push_back(nullptr);

  int out[2], err[2], report[2];
  if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0 || ::pipe2(report, O_CLOEXEC) != 0) {
    core::throw_errno("cannot create pipes for mpirun", errno);
  }
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) core::throw_errno("cannot fork to start mpirun", errno);
  if (pid == 0) {
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // its ranks notice within seconds and end
    if (::getppid() != parent) ::_exit(127);
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    const int null = ::open("/dev/null", O_RDONLY);
    ::dup2(null, STDIN_FILENO);
    ::dup2(out[1], STDOUT_FILENO);
    ::dup2(err[1], STDERR_FILENO);
    if (!command.working_dir.empty() && ::chdir(command.working_dir.c_str()) != 0) {
      const int e = errno;
      (void)!::write(report[1], &e, sizeof e);  // the parent reads it; nothing to do if it cannot
      ::_exit(127);
    }
    ::execvpe(argv[0], argv.data(), envp.data());
    const int e = errno;
    (void)!::write(report[1], &e, sizeof e);
    ::_exit(127);
  }
  ::setpgid(pid, pid);
  ::close(out[1]);
  ::close(err[1]);
  ::close(report[1]);
  int child_errno = 0;
  const ssize_t n = ::read(report[0], &child_errno, sizeof child_errno);
  ::close(report[0]);
  if (n == static_cast<ssize_t>(sizeof child_errno)) {
    ::waitpid(pid, nullptr, 0);
    ::close(out[0]);
    ::close(err[0]);
    throw IoError("cannot start " + command.argv.front() + " (in " + command.working_dir + "): " +
                  std::strerror(child_errno) + "; install Open MPI (scripts/install-deps.sh) or set HPCTRIAL_MPIRUN");
  }
  ::fcntl(out[0], F_SETFL, O_NONBLOCK);
  ::fcntl(err[0], F_SETFL, O_NONBLOCK);
  return {pid, out[0], err[0]};
}

struct Attempt {
  int status = 0;          // mpirun's wait status
  bool stop_requested = false;
  std::string stop_reason;
  bool aborted = false;    // a second Ctrl-C
  bool grace_expired = false;  // SIGTERM, and the ranks did not finish within the grace
  std::string hang;        // the hang watchdog's message, when it ended the attempt
};

class Supervisor {
 public:
  Supervisor(const core::ExperimentConfig& config, const core::Allocation& allocation, std::string trial_dir)
      : config_(config), allocation_(allocation), trial_dir_(std::move(trial_dir)) {}

  Attempt run(const MpirunCommand& command, SignalFd& signals) {
    Attempt a;
    attempt_ = &a;
    detail::RankOutput output(trial_dir_ + "/logs", STDOUT_FILENO, STDERR_FILENO);
    output_ = &output;
    const Spawned child = spawn_mpirun(command);
    child_ = child.pid;
    mpirun_status_.reset();
    abort_file_.clear();
    verdict_file_.clear();
    abort_written_ = false;
    failure_ = {};
    for (const auto& [name, value] : command.env) {
      if (name == core::kEnvAbortFile) abort_file_ = value;
      if (name == core::kEnvVerdictFile) verdict_file_ = value;
    }
    const auto started = Clock::now();
    started_ = started;
    last_progress_ = started;
    last_heartbeat_check_ = started;
    beats_.clear();
    rank_processes_.clear();
    missing_ranks_.clear();
    single_host_ = command.hostfile_path.empty();
    zombies_.clear();
    rank_failure_.reset();
    stopped_at_ = {};
    stop_finished_ = false;
    constexpr Clock::time_point kNever = Clock::time_point::max();
    Clock::time_point term_at = kNever, kill_at = kNever, deadline = kNever;
    if (allocation_.end_time) {
      const auto left = *allocation_.end_time - std::chrono::system_clock::now() -
                        std::chrono::seconds(config_.scheduler.preemption_grace_seconds);
      deadline = started + std::chrono::duration_cast<Clock::duration>(left);
    }
    bool out_open = true, err_open = true, exited = false;
    Clock::time_point exited_at = kNever, mpirun_kill_at = kNever, ranks_kill_at = kNever;
    char buffer[65536];
    while (out_open || err_open || !exited) {
      pollfd fds[3] = {{signals.fd(), POLLIN, 0}, {out_open ? child.out_fd : -1, POLLIN, 0},
                       {err_open ? child.err_fd : -1, POLLIN, 0}};
      // While the ranks stop, look closely: their exits end the attempt.
      const bool stopping = a.stop_requested || stopped_at_ != Clock::time_point{};
      ::poll(fds, 3, stopping ? 50 : 250);
      for (int i = 1; i <= 2; ++i) {
        if (fds[i].fd < 0 || (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
        const ssize_t n = ::read(fds[i].fd, buffer, sizeof buffer);
        if (n > 0) {
          output.feed(buffer, static_cast<std::size_t>(n), i == 2);
        } else if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
          (i == 1 ? out_open : err_open) = false;
        }
      }
      for (int signal; (signal = signals.next()) != 0;) {
        if (signal == SIGCHLD) continue;  // reaped below
        if (signal == SIGINT && a.stop_requested && a.stop_reason == "interrupt") {
          core::log_warning("second Ctrl-C: aborting now, without a checkpoint");
          a.aborted = true;
          abort_attempt();
          kill_everything(child.pid, &mpirun_status_);
        } else if (signal == SIGINT) {
          request_stop("interrupt");
          core::log_info("stopping after the current step with a checkpoint; press Ctrl-C again to abort now");
        } else if (signal == SIGTERM) {
          // Not forwarded: the scheduler signals every process of the job itself, and a second
          // TERM makes mpirun kill the ranks at once. A stop request reaches them if it did not.
          request_stop("terminate");
          if (term_at == kNever) {
            term_at = Clock::now() + std::chrono::seconds(config_.scheduler.preemption_grace_seconds);
            core::log_info("SIGTERM: waiting up to {} for the ranks' checkpoint",
                           describe_seconds(config_.scheduler.preemption_grace_seconds));
          }
        } else {
          request_stop("preemption");
        }
      }
      // mpirun, and ranks orphaned by it (the launcher is their subreaper).
      reap(child.pid, &mpirun_status_);
      if (!exited && mpirun_status_) {
        exited = true;
        exited_at = Clock::now();
        a.status = *mpirun_status_;
      }
      const auto now = Clock::now();
      if (exited && (out_open || err_open) && now - exited_at > std::chrono::seconds(2)) {
        // mpirun is gone but something below it still holds its output: no orphans.
        kill_everything(child.pid, &mpirun_status_);
        if (now - exited_at > std::chrono::seconds(4)) out_open = err_open = false;
      }
      if (exited) continue;
      // A rank that failed: end the others now (mpirun would give them the whole grace), then
      // mpirun, if it does not end by itself.
      if (!rank_failure_ && (rank_failure_ = find_failed_rank(now, output.mpirun_text()))) {
        // Without the rank's own code, mpirun's words are the only other witness, and ranks the
        // launcher killed first would muddle them: a moment for mpirun's report first. (mpirun
        // itself would wait odls_base_sigkill_timeout, the preemption grace, before it ends the
        // others.)
        const bool exact = rank_failure_->exit_code || rank_failure_->signal;
        if (exact) {
          core::log_warning("rank {} {}: ending the other ranks", rank_failure_->rank, rank_failure_->how);
          abort_attempt();
          kill_ranks(child.pid);
          mpirun_kill_at = now + std::chrono::seconds(1);
        } else {
          core::log_warning("rank {} {}: the job ends", rank_failure_->rank, rank_failure_->how);
          ranks_kill_at = now + std::chrono::seconds(1);
        }
      }
      // Ranks stopped on request: mpirun would give the stragglers the whole grace before it
      // kills them, though they only finish; end them after a moment.
      // Every rank has ended with 75, though mpirun, which saw a non-zero exit, would hold on to
      // them until its SIGKILL timeout; nothing is left to wait for.
      if (stopped_at_ != Clock::time_point{} && !stop_finished_ &&
          (now - stopped_at_ > std::chrono::seconds(2) || all_ranks_stopped(command.np))) {
        stop_finished_ = true;
        abort_attempt();  // every checkpoint is durable: the stragglers only finish
        kill_everything(child.pid, &mpirun_status_);
      }
      if (now >= ranks_kill_at) {
        abort_attempt();
        kill_ranks(child.pid);
        ranks_kill_at = kNever;
        mpirun_kill_at = now + std::chrono::seconds(1);
      }
      if (now >= mpirun_kill_at) {
        kill_everything(child.pid, &mpirun_status_);
        mpirun_kill_at = kNever;
      }
      if (now >= deadline && !a.stop_requested) {
        core::log_info("{} job {} ends in {}: asking the ranks to checkpoint and stop", allocation_.scheduler,
                       allocation_.job_id, describe_seconds(config_.scheduler.preemption_grace_seconds));
        request_stop("deadline");
      }
      if (now >= term_at && kill_at == kNever) {
        core::log_warning("the ranks did not stop within scheduler.preemption_grace; ending them");
        a.grace_expired = true;
        abort_attempt();
        ::kill(child.pid, SIGTERM);
        kill_at = now + kKillGrace;
      }
      if (now >= kill_at) {
        kill_everything(child.pid, &mpirun_status_);
        kill_at = kNever;
        term_at = kNever;
      }
      if (now - last_heartbeat_check_ >= (stopping ? kHeartbeatCheckStopping : kHeartbeatCheck) && a.hang.empty()) {
        last_heartbeat_check_ = now;
        check_progress(now, command.np, child.pid);
      }
    }
    output.flush();
    kill_everything(child.pid, &mpirun_status_);  // nothing outlives the attempt
    const bool good_end = a.hang.empty() && (stop_finished_ || (WIFEXITED(a.status) && (WEXITSTATUS(a.status) == kExitFinished ||
                                                                                        WEXITSTATUS(a.status) == kExitStopped)));
    if (!good_end) {
      abort_attempt();
      output.show_held();
    }
    ::close(child.out_fd);
    ::close(child.err_fd);
    if (!good_end) {
      // Read now, with every rank ended: a record read during the attempt may predate its end.
      const auto records = core::read_heartbeats(core::heartbeat_dir(trial_dir_));
      for (const auto& [rank, record] : records) beats_[rank] = record;
      std::ifstream verdict_in(verdict_file_);
      const std::string verdict_text((std::istreambuf_iterator<char>(verdict_in)), {});
      // After the launcher's own hang watch ended the attempt, what mpirun reports are the ranks
      // it killed: only the ranks' records and the watchdog's verdict name a culprit.
      const bool hung = !a.hang.empty();
      failure_ = detail::attribute_failure(records, core::decode_verdict(verdict_text),
                                           hung ? std::string() : output.mpirun_text(),
                                           hung ? std::nullopt : rank_failure_);
    }
    if (failure_.rank >= 0) failure_tail_ = output.tail(failure_.rank);
    mpirun_tail_ = output.tail(-1);
    output_ = nullptr;
    attempt_ = nullptr;
    return a;
  }

  bool stop_finished() const { return stop_finished_; }
  const detail::RankFailure& failure() const { return failure_; }
  const std::vector<std::string>& failure_tail() const { return failure_tail_; }
  const std::vector<std::string>& mpirun_tail() const { return mpirun_tail_; }
  std::map<int, long long> steps() const {
    std::map<int, long long> out;
    for (const auto& [rank, record] : beats_) out[rank] = record.step;
    return out;
  }

 private:
  void request_stop(std::string reason) {
    if (attempt_->stop_requested) return;
    // `hpctrial pause` writes its request before it signals: its reason stands.
    const std::string recorded = detail::stop_reason(trial_dir_);
    if (!recorded.empty()) reason = recorded;
    attempt_->stop_requested = true;
    attempt_->stop_reason = reason;
    if (!recorded.empty()) {
      ::kill(child_, SIGUSR2);
      core::log_info("stop requested ({}): the ranks checkpoint after their current step", reason);
      return;
    }
    try {
      detail::write_stop_request(trial_dir_, reason);
    } catch (const Error& e) {
      core::log_warning("cannot record the stop request ({}); the signal still reaches the ranks", e.what());
    }
    ::kill(child_, SIGUSR2);  // mpirun forwards it to every rank
    core::log_info("stop requested ({}): the ranks checkpoint after their current step", reason);
  }

  // A rank that failed while mpirun still runs: one that recorded a failed end (its exit code,
  // fatal signal or abort: exact, on any host), one mpirun reported, or one of this host seen
  // ended without a record (killed by SIGKILL, say) - after a moment for mpirun's report, which
  // says which signal. A rank that stopped on request (75) means the others are only finishing.
  std::optional<detail::RankFailure> find_failed_rank(Clock::time_point now, const std::string& mpirun_text) {
    for (const auto& [rank, record] : beats_) {
      if (record.end && record.end->kind == core::RankEnd::Kind::kExit && record.end->code == kExitStopped) {
        if (stopped_at_ == Clock::time_point{}) stopped_at_ = now;
        return std::nullopt;
      }
    }
    detail::RankFailure f;
    for (const auto& [rank, record] : beats_) {
      if (record.end && record.end->failed() && (f.rank < 0 || record.end->unix_ms < beats_[f.rank].end->unix_ms)) {
        f.rank = rank;
      }
    }
    if (f.rank >= 0) {
      const core::RankEnd& end = *beats_[f.rank].end;
      (end.kind == core::RankEnd::Kind::kSignal ? f.signal : f.exit_code) = end.code;
      f.how = end.describe();
      return f;
    }
    // A watchdog ended the job: its verdict names the cause once the attempt is over.
    for (const auto& [rank, record] : beats_) {
      if (record.end && record.end->kind == core::RankEnd::Kind::kWatchdog) {
        f.rank = rank;
        f.how = record.end->describe();
        return f;
      }
    }
    if (mpirun_text.find("MPI_ABORT was invoked") != std::string::npos ||
        mpirun_text.find("mpirun noticed that process rank") != std::string::npos) {
      f = detail::parse_mpirun_failure(mpirun_text);
      if (f.rank >= 0) return f;
    }
    for (int rank : missing_ranks_) {
      if (rank_processes_.count(rank) == 0) rank_processes_[rank] = -1;  // never seen alive
    }
    // A rank of this host that ended before it could write its record (MPI_Init failed, a full
    // disk) or where the launcher cannot read it (its directory removed): only its process says
    // so - a zombie of mpirun's (which reaps late while it waits to kill the others) says how.
    for (const auto& [rank, pid] : rank_processes_) {
      const auto status = detail::zombie_status(pid);
      const bool gone = pid < 0 || status || (::kill(pid, 0) != 0 && errno == ESRCH);
      if (!gone) continue;
      if (const auto it = beats_.find(rank); it != beats_.end()) {
        if (it->second.end) continue;  // its record says how it ended
        const auto fresh = fresh_record(rank);
        if (fresh && fresh->end) {
          beats_[rank] = *fresh;
          return find_failed_rank(now, mpirun_text);
        }
        if (fresh && !status) continue;  // the record is there: the checks below judge it
      } else if (auto fresh = fresh_record(rank)) {  // it ended after the launcher last read the records
        beats_[rank] = *fresh;
        return find_failed_rank(now, mpirun_text);
      }
      const auto first_seen = zombies_.emplace(rank, now).first->second;
      if (status) {
        if (const auto failure = failure_of_status(rank, *status, now - first_seen)) return failure;
        continue;
      }
      if (now - first_seen < std::chrono::milliseconds(500)) continue;
      f = {};
      f.rank = rank;
      f.how = "ended without a record of how (before it wrote one, or where it could not be read; see its output)";
      return f;
    }
    char host[256] = "";
    ::gethostname(host, sizeof host - 1);
    std::optional<detail::RankFailure> found;
    for (const auto& [rank, record] : beats_) {
      if (record.host != host) continue;
      const auto status = detail::zombie_status(record.pid);
      const bool gone = !status && ::kill(record.pid, 0) != 0 && errno == ESRCH;
      if (!status && !gone) continue;
      const auto first_seen = zombies_.emplace(rank, now).first->second;
      f = {};
      f.rank = rank;
      f.host = record.host;
      if (status) {
        if (auto failure = failure_of_status(rank, *status, now - first_seen)) {
          failure->host = record.host;
          if (!found) found = failure;
        }
        continue;
      }
      if (record.end && record.end->kind == core::RankEnd::Kind::kExit) {
        if (now - first_seen < std::chrono::seconds(1)) continue;  // finishing: mpirun reaps it now
        f.exit_code = 0;
        f.how = core::RankEnd{core::RankEnd::Kind::kExit, 0, 0}.describe();
      } else if (record.end) {
        continue;  // ended as its record says, and not by failing (its watchdog ended the job)
      } else {
        // Its parent (hpctrial _rank) records the end just after it; the record read a moment
        // ago may predate that: read it again.
        if (now - first_seen < std::chrono::milliseconds(500)) continue;
        const auto fresh = fresh_record(rank);
        if (fresh && fresh->end) {
          beats_[rank] = *fresh;
          return find_failed_rank(now, mpirun_text);
        }
        // Gone without a record of its end: SIGKILL (the OOM killer, say). mpirun knows which
        // signal, and says so once the other ranks have ended.
        f.how = "ended without an exit code (killed by a signal, or crashed)";
      }
      if (!found) found = f;
    }
    return found;
  }

  // A rank of this host whose process ended with wait status `status`, seen ended for `seen`:
  // its failure, or none - it stopped on request (75), or exited 0 a moment ago (finishing:
  // mpirun reaps it now).
  static std::optional<detail::RankFailure> failure_of_status(int rank, int status, Clock::duration seen) {
    detail::RankFailure f;
    f.rank = rank;
    if (WIFSIGNALED(status)) {
      f.signal = WTERMSIG(status);
      f.how = "was killed by signal " + std::to_string(*f.signal) + " (" + ::strsignal(*f.signal) + ")";
    } else if (WEXITSTATUS(status) == kExitStopped) {
      return std::nullopt;
    } else if (WEXITSTATUS(status) != 0) {
      f.exit_code = WEXITSTATUS(status);
      f.how = "exited with code " + std::to_string(*f.exit_code);
    } else {
      if (seen < std::chrono::seconds(1)) return std::nullopt;
      f.exit_code = 0;
      f.how = core::RankEnd{core::RankEnd::Kind::kExit, 0, 0}.describe();
    }
    return f;
  }

  std::optional<core::HeartbeatRecord> fresh_record(int rank) const {
    std::ifstream in(core::heartbeat_file(core::heartbeat_dir(trial_dir_), rank), std::ios::binary);
    return core::heartbeat_decode(std::string((std::istreambuf_iterator<char>(in)), {}));
  }

  // Ranks on other hosts, which only mpirun can signal (and mpirun gives them the whole grace),
  // end themselves on seeing this file.
  void abort_attempt() {
    if (abort_written_ || abort_file_.empty()) return;
    abort_written_ = true;
    try {
      core::write_file_atomic(abort_file_, core::utc_now_iso() + "\n");
    } catch (const Error& e) {
      core::log_warning("cannot write {} ({}); ranks on other hosts end only when mpirun ends them", abort_file_,
                        e.what());
    }
  }

  // True when each of the `np` ranks has ended with 75: by its record, and those of this host
  // also seen ended (a zombie of mpirun's, or reaped).
  bool all_ranks_stopped(int np) const {
    if (static_cast<int>(beats_.size()) < np) return false;
    char host[256] = "";
    ::gethostname(host, sizeof host - 1);
    for (const auto& [rank, record] : beats_) {
      if (!record.end || record.end->kind != core::RankEnd::Kind::kExit || record.end->code != kExitStopped) {
        return false;
      }
      if (record.host != host) continue;
      const auto status = detail::zombie_status(record.pid);
      const bool gone = !status && ::kill(record.pid, 0) != 0 && errno == ESRCH;
      if (!gone && !(status && WIFEXITED(*status) && WEXITSTATUS(*status) == kExitStopped)) return false;
    }
    return true;
  }

  void check_progress(Clock::time_point now, int np, pid_t child) {
    const auto live = rank_processes(child);
    for (const auto& [rank, pid] : live) rank_processes_.emplace(rank, pid);
    // Every rank runs on this host: one whose process is missing once mpirun has started them
    // all has ended, whether or not the launcher ever saw it or its record.
    missing_ranks_.clear();
    if (single_host_ && now - started_ > std::chrono::seconds(3)) {
      for (int rank = 0; rank < np; ++rank) {
        if (live.count(rank) == 0) missing_ranks_.push_back(rank);
      }
    }
    bool progressed = false;
    for (auto& [rank, record] : core::read_heartbeats(core::heartbeat_dir(trial_dir_))) {
      const auto it = beats_.find(rank);
      if (it == beats_.end() || it->second.step != record.step || record.end) progressed = true;
      beats_[rank] = std::move(record);
    }
    if (progressed) {
      last_progress_ = now;
      return;
    }
    const auto limit = std::chrono::seconds(config_.launcher.hang_timeout_seconds);
    if (now - last_progress_ < limit) return;
    std::string where;
    std::vector<int> silent;
    for (int rank = 0; rank < np; ++rank) {
      const auto it = beats_.find(rank);
      if (it == beats_.end() || it->second.step < 0) {
        silent.push_back(rank);
      } else {
        where += (where.empty() ? "" : ", ") + ("rank " + std::to_string(rank) + " at step " +
                                                std::to_string(it->second.step) + " (" +
                                                core::phase_name(it->second.phase) + ")");
      }
    }
    std::string message = "no rank finished a training step for " +
                          describe_seconds(config_.launcher.hang_timeout_seconds) + " (launcher.hang_timeout)";
    if (!where.empty()) message += "; last finished steps: " + where;
    if (!silent.empty()) {
      std::string list;
      for (int r : silent) list += (list.empty() ? "" : ", ") + std::to_string(r);
      message += std::string(where.empty() ? "; " : "; ") + (silent.size() == 1 ? "rank " : "ranks ") + list +
                 " never finished a step";
    }
    message += "; ending the attempt";
    core::log_error("{}", message);
    attempt_->hang = message;
    abort_attempt();
    ::kill(child, SIGTERM);
    kill_everything(child, &mpirun_status_);
  }

  const core::ExperimentConfig& config_;
  const core::Allocation& allocation_;
  std::string trial_dir_;
  Attempt* attempt_ = nullptr;
  detail::RankOutput* output_ = nullptr;
  pid_t child_ = -1;
  std::optional<int> mpirun_status_;
  Clock::time_point last_progress_, last_heartbeat_check_;
  std::map<int, core::HeartbeatRecord> beats_;
  std::map<int, pid_t> rank_processes_;  // mpirun's children on this host, by rank; -1: never seen
  std::vector<int> missing_ranks_;       // ranks without a process, when all run on this host
  bool single_host_ = false;
  Clock::time_point started_;
  std::map<int, Clock::time_point> zombies_;  // ranks seen ended, and since when
  std::optional<detail::RankFailure> rank_failure_;
  Clock::time_point stopped_at_{};  // when a rank was first seen to have exited 75
  bool stop_finished_ = false;     // the stragglers of a stop were ended by the launcher
  std::string abort_file_;         // $HPCTRIAL_ABORT_FILE of the attempt
  std::string verdict_file_;       // $HPCTRIAL_VERDICT_FILE of the attempt
  bool abort_written_ = false;
  detail::RankFailure failure_;
  std::vector<std::string> failure_tail_, mpirun_tail_;
};

// The entrypoint must exist before any rank is started.
// A bare program name is looked up as mpirun will: on the PATH the config's environment sets,
// else on the launcher's own.
void check_entrypoint(const core::ExperimentConfig& config, const std::string& working_dir,
                      const core::EnvSource& env) {
  const bool library = config.entrypoint.kind == core::Entrypoint::Kind::kLibrary;
  const std::string program = library ? config.entrypoint.library : config.entrypoint.argv.front();
  if (program.find('/') == std::string::npos) {
    if (library) return;
    std::string path = env.get("PATH").value_or("");
    for (const auto& var : config.environment) {
      if (var.name == "PATH") path = core::expand_env_references(var.value, env, "environment.PATH");
    }
    std::stringstream dirs(path);
    for (std::string dir; std::getline(dirs, dir, ':');) {
      if (!dir.empty() && ::access((dir + "/" + program).c_str(), X_OK) == 0) return;
    }
    throw ConfigError("entrypoint: " + program + " is not a program on PATH; give its path, e.g. ./" + program);
  }
  fs::path path(program);
  if (path.is_relative() && !working_dir.empty()) path = fs::path(working_dir) / path;
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    throw ConfigError("entrypoint: " + path.string() + " does not exist; build it, or fix entrypoint in the config");
  }
  if (!library && ::access(path.c_str(), X_OK) != 0) {
    throw ConfigError("entrypoint: " + path.string() + " is not executable (chmod +x it, or fix entrypoint)");
  }
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exit code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    return "signal " + std::to_string(WTERMSIG(status)) + " (" + ::strsignal(WTERMSIG(status)) + ")";
  }
  return "status " + std::to_string(status);
}

}  // namespace

void print_launch_plan(const core::ExperimentConfig& config, const LaunchOptions& options, const core::EnvSource& env,
                       const core::CommandRunner& run) {
  const core::Allocation allocation = detect_allocation(env, run);
  const MpirunCommand command = build_mpirun_command(config, allocation, options, 0, env);
  std::string line;
  for (const auto& arg : command.argv) line += (line.empty() ? "" : " ") + core::shell_quote(arg, "argument");
  std::cout << "# in " << command.working_dir << " (" << allocation.scheduler
            << (allocation.job_id.empty() ? "" : " job " + allocation.job_id) << ")\n";
  for (const auto& [name, value] : command.env) {
    // Only the contract's own values: the config's environment may hold secrets.
    if (name.rfind("HPCTRIAL_", 0) == 0) std::cout << name << "=" << core::shell_quote(value, name) << " \\\n";
  }
  std::cout << line << "\n";
  if (!command.hostfile.empty()) std::cout << "# hostfile " << command.hostfile_path << ":\n" << command.hostfile;
}

namespace {

// Every rank stopped after a durable checkpoint inside a job: the trial goes back to the queue to
// resume (held when the user paused it). On Slurm the job requeues itself. PBS lets no ordinary
// user requeue a job: the job that resumes the trial is submitted instead, to start once this one
// has ended. A SIGTERM without warning is the scheduler's own doing (a cancel, an admin's requeue
// or rerun, a preemption): it decides what follows.
void hand_over(const core::Allocation& allocation, const std::string& reason, const core::ExperimentConfig& config,
               const LaunchOptions& options, const core::EnvSource& env, const core::CommandRunner& run) {
  if (!allocation.in_job() || reason == "terminate" || reason == "interrupt") return;
  const bool hold = reason == "pause";
  const auto runner = [&run](const std::vector<std::string>& argv, const core::RunOptions&) { return run(argv); };
  if (allocation.scheduler == "slurm") {
    try {
      slurm::Client(runner).requeue(allocation.job_id, hold);
      core::log_info("slurm job {} requeued after run {} of this job{}", allocation.job_id,
                     allocation.restart_count + 1,
                     hold ? " and held: `hpctrial activate " + allocation.job_id + "` resumes it" : "");
    } catch (const Error& e) {
      core::log_error("cannot requeue slurm job {} ({}); the checkpoint is durable: submit the experiment again to "
                      "resume", allocation.job_id, e.what());
    }
    return;
  }
  if (allocation.scheduler != "pbs") return;
  const ExperimentLayout layout{options.experiment_dir};
  try {
    // A job of this trial alone (a search's array job is not submitted again); the values from
    // the submitter's environment are in this job's own, passed on by name.
    const std::string script = layout.trial_dir(options.trial_id) + "/resume.pbs";
    core::write_file_atomic(script, pbs::render_batch_script(config, {layout.dir, core::self_program(), options.trial_id}));
    pbs::Client::Submit submit;
    submit.script = script;
    submit.hold = hold;
    submit.after = allocation.job_id;
    for (const auto& var : config.scheduler.environment) {
      if (!core::refers_to_submitter(var.value)) continue;
      if (const auto value = env.get(var.name)) submit.env.emplace_back(var.name, *value);
    }
    const std::string id = pbs::Client(runner).submit(submit);
    record_job(layout, "pbs", id, options.trial_id);
    core::log_info("pbs job {} submitted to resume trial {} once job {} has ended{}", id, options.trial_id,
                   allocation.job_id, hold ? "; it is held: `hpctrial activate " + id + "` releases it" : "");
  } catch (const Error& e) {
    core::log_error("cannot submit the pbs job that resumes trial {} ({}); the checkpoint is durable: submit the "
                    "experiment again to resume", options.trial_id, e.what());
  }
}

}  // namespace

int launch(const LaunchOptions& options, const core::EnvSource& env, const core::CommandRunner& run) {
  const ExperimentLayout layout{options.experiment_dir};
  if (!fs::exists(layout.config())) {
    throw ConfigError(layout.dir + " holds no experiment.yaml; create the experiment with `hpctrial run EXP.yaml` "
                      "or `hpctrial submit EXP.yaml`");
  }
  // The trial's own values of the search's ranges (and a clear error for a trial that does not exist).
  const core::ExperimentConfig config =
      core::trial_config(core::load_experiment_config({layout.config(), "", {}}), options.trial_id);
  core::Allocation allocation = detect_allocation(env, run);
  if (allocation.scheduler == "pbs" && !allocation.end_time && config.scheduler.time_limit_seconds && !options.dry_run) {
    // qstat did not say when the job started (a compute node that cannot reach the server): the
    // job started moments ago, and the config says how long it may run.
    allocation.end_time = std::chrono::system_clock::now() + std::chrono::seconds(*config.scheduler.time_limit_seconds);
    core::log_warning("qstat -f {} gave no start time and walltime; assuming the job ends scheduler.time_limit ({}) "
                      "from now", allocation.job_id, describe_seconds(*config.scheduler.time_limit_seconds));
  }
  const std::string trial_dir = layout.trial_dir(options.trial_id);
  const std::string state_path = trial_dir + "/launcher-state.json";

  if (options.dry_run) {
    print_launch_plan(config, options, env, run);
    return kExitFinished;
  }

  core::create_directories(trial_dir, config.checkpoint_storage.group_readable ? 0750 : 0700);
  json state = detail::read_json_file(state_path);
  int starts = state.value("starts", 0);
  int failures = options.reset_failures ? 0 : state.value("failures", 0);
  const std::string working_dir = detail::read_json_file(layout.state()).value("workdir", std::string());
  check_entrypoint(config, working_dir, env);
  ::unlink(core::stop_file(trial_dir).c_str());  // a request from an earlier run is spent
  std::error_code ignored;
  for (const auto& entry : fs::directory_iterator(trial_dir + "/launch", ignored)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("abort-", 0) == 0 || name.rfind("verdict-", 0) == 0) fs::remove(entry.path(), ignored);
  }
  ::prctl(PR_SET_CHILD_SUBREAPER, 1);
  SignalFd signals;

  while (true) {
    const MpirunCommand command = build_mpirun_command(config, allocation, options, starts, env);
    if (!command.hostfile_path.empty()) {
      core::create_directories(fs::path(command.hostfile_path).parent_path().string());
      core::write_file_atomic(command.hostfile_path, command.hostfile);
    }
    const std::string beats = core::heartbeat_dir(trial_dir);
    fs::remove_all(beats);
    core::create_directories(beats);
    state["starts"] = ++starts;
    state["failures"] = failures;
    detail::write_json_file(state_path, state);
    core::log_info("starting {} rank(s) of trial {} in {}{}", command.np, options.trial_id, trial_dir,
                   starts > 1 ? " (start " + std::to_string(starts) + ")" : "");

    Supervisor supervisor(config, allocation, trial_dir);
    const Attempt a = supervisor.run(command, signals);
    const int code = supervisor.stop_finished() ? kExitStopped : WIFEXITED(a.status) ? WEXITSTATUS(a.status) : -1;
    if (a.aborted) return kExitAborted;
    if (a.hang.empty() && code == kExitFinished) {
      ::unlink(core::stop_file(trial_dir).c_str());
      core::log_info("trial {} finished", options.trial_id);
      return kExitFinished;
    }
    if (a.hang.empty() && code == kExitStopped) {
      std::string reason = detail::stop_reason(trial_dir);  // `hpctrial pause` may have asked without a signal
      if (reason.empty()) reason = a.stop_requested ? a.stop_reason : "requested by the trial";
      core::log_info("trial {} stopped ({}) after a durable checkpoint; {}", options.trial_id, reason,
                     allocation.in_job() ? "it resumes when the job runs again"
                                         : "run the same command again to resume");
      hand_over(allocation, reason, config, options, env, run);
      return kExitStopped;
    }
    if (a.grace_expired) {
      core::log_warning("the ranks did not checkpoint within the grace; the next run resumes from the previous checkpoint");
      return 128 + SIGTERM;
    }

    // A failure: record it, then restart or give up.
    ++failures;
    const bool trial_dir_gone = !fs::is_directory(trial_dir, ignored);
    if (!trial_dir_gone) {
      state["failures"] = failures;
      detail::write_json_file(state_path, state);
    }
    const auto& f = supervisor.failure();
    json record = {{"time", core::utc_now_iso()}, {"trial_id", options.trial_id}, {"start", starts},
                   {"failure", failures}, {"mpirun", describe_status(a.status)}};
    std::string what;
    if (!a.hang.empty() && f.rank < 0) {
      record["reason"] = what = a.hang;
    } else if (f.rank >= 0) {
      record["rank"] = f.rank;
      if (f.exit_code) record["exit_code"] = *f.exit_code;
      if (f.signal) record["signal"] = *f.signal;
      if (!f.host.empty()) record["host"] = f.host;
      if (!f.phase.empty()) record["phase"] = f.phase;
      if (f.step >= 0) record["step"] = f.step;
      if (!f.message.empty()) record["message"] = f.message;
      what = "rank " + std::to_string(f.rank) + (f.host.empty() ? "" : " on " + f.host) + " " + f.how +
             (f.phase.empty() ? "" : " in its " + f.phase + " phase") +
             (f.step >= 0 ? " after step " + std::to_string(f.step) : "") +
             (f.message.empty() ? "" : ": " + f.message);
      record["reason"] = what;
      record["log_tail"] = supervisor.failure_tail();
    } else {
      what = "mpirun ended with " + describe_status(a.status);
      record["reason"] = what;
      record["log_tail"] = supervisor.mpirun_tail();
    }
    json steps = json::object();
    for (const auto& [rank, step] : supervisor.steps()) steps[std::to_string(rank)] = step;
    record["last_steps"] = steps;
    // The failing rank's own code where known (as mpirun itself reports it), else mpirun's.
    int exit_code = kExitFailed;
    if (f.exit_code && *f.exit_code != 0 && *f.exit_code != kExitStopped) {
      exit_code = *f.exit_code;
    } else if (f.signal) {
      exit_code = 128 + *f.signal;
    } else if (a.hang.empty() && f.rank < 0 && code > 0 && code != kExitStopped) {
      exit_code = code;
    }
    if (trial_dir_gone) {
      // Removed while the trial ran: nothing is left to record the failure in or to resume from.
      core::log_error("trial {} failed: {}. Its directory {} was removed while it ran, so the failure is not "
                      "recorded and the trial is not restarted", options.trial_id, what, trial_dir);
      return exit_code;
    }
    const std::string record_path = trial_dir + "/failures.jsonl";
    {
      core::UniqueFd fd(::open(record_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600));
      // Ranks' output is bytes, not always UTF-8 (a library dying mid-message): replace what is not.
      const std::string line = record.dump(-1, ' ', false, json::error_handler_t::replace) + "\n";
      if (fd.get() >= 0) core::write_fully(fd.get(), line, record_path);
    }
    if (a.stop_requested) {
      core::log_error("trial {} failed while stopping: {}; recorded in {}", options.trial_id, what, record_path);
      return exit_code;
    }
    if (failures > config.max_restarts) {
      core::log_error("trial {} failed: {}. It has failed {} time(s) and max_restarts is {}, so it is not restarted; "
                      "the failures are recorded in {}", options.trial_id, what, failures, config.max_restarts,
                      record_path);
      return exit_code;
    }
    core::log_warning("trial {} failed: {}; restarting from its latest checkpoint (restart {} of max_restarts {}); "
                      "recorded in {}", options.trial_id, what, failures, config.max_restarts, record_path);
  }
}

}  // namespace hpctrial::mpi_launcher
