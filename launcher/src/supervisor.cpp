#include "supervisor.h"

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>

#include "hpctrial/core/env.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/experiment_dir.h"
#include "hpctrial/core/files.h"
#include "hpctrial/core/logging.h"
#include "hpctrial/core/text.h"

namespace hpctrial::launcher::detail {
namespace {

constexpr auto kKillGrace = std::chrono::seconds(5);  // SIGTERM to mpirun, then SIGKILL to all
constexpr auto kHeartbeatCheck = std::chrono::seconds(1);
constexpr auto kHeartbeatCheckStopping = std::chrono::milliseconds(50);
constexpr auto kMpirunReapSingleHost = std::chrono::milliseconds(200);
constexpr Clock::time_point kNever = Clock::time_point::max();

}  // namespace

Attempt Supervisor::run(const MpirunCommand& command, SignalFd& signals) {
  Attempt a;
  attempt_ = &a;
  detail::RankOutput output(trial_, STDOUT_FILENO, STDERR_FILENO, command.srun);
  output_ = &output;
  const core::Child child = spawn_mpirun(command);
  begin(command, child.pid);
  Loop loop;
  if (allocation_.end_time) {
    const auto left = *allocation_.end_time - std::chrono::system_clock::now() -
                      std::chrono::seconds(config_.scheduler.preemption_grace_seconds);
    loop.deadline = started_ + std::chrono::duration_cast<Clock::duration>(left);
  }
  bool out_open = true, err_open = true, exited = false;
  Clock::time_point exited_at = kNever;
  char buffer[65536];
  while (out_open || err_open || !exited) {
    pollfd fds[3] = {{signals.fd(), POLLIN, 0}, {out_open ? child.out.get() : -1, POLLIN, 0},
                     {err_open ? child.err.get() : -1, POLLIN, 0}};
    // While the ranks stop, or are ended after a rank's failure, look closely: their exits end
    // the attempt, and the next one starts as soon as they have.
    const bool stopping = a.stop_requested || stopped_at_ != Clock::time_point{};
    ::poll(fds, 3, stopping || rank_failure_ ? 50 : 250);
    for (int i = 1; i <= 2; ++i) {
      if (fds[i].fd < 0 || (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
      const ssize_t n = ::read(fds[i].fd, buffer, sizeof buffer);
      if (n > 0) {
        output.feed(buffer, static_cast<std::size_t>(n), i == 2);
      } else if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
        (i == 1 ? out_open : err_open) = false;
      }
    }
    handle_signals(signals, loop);
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
      kill_everything(child.pid, &mpirun_status_, tasks_);
      if (now - exited_at > std::chrono::seconds(4)) out_open = err_open = false;
    }
    if (exited) continue;
    supervise(now, command.np, stopping, loop);
  }
  finish();
  output_ = nullptr;
  attempt_ = nullptr;
  return a;
}

void Supervisor::begin(const MpirunCommand& command, pid_t child) {
  child_ = child;
  np_ = command.np;
  mpirun_status_.reset();
  abort_file_.clear();
  verdict_file_.clear();
  abort_written_ = false;
  failure_ = {};
  for (const auto& [name, value] : command.env) {
    if (name == core::kEnvAbortFile) abort_file_ = value;
    if (name == core::kEnvVerdictFile) verdict_file_ = value;
  }
  started_ = Clock::now();
  last_progress_ = started_;
  last_heartbeat_check_ = started_;
  beats_.clear();
  rank_processes_.clear();
  missing_ranks_.clear();
  // Under srun a rank not yet seen may still wait for its step's resources: only ranks seen and
  // srun's own report count.
  single_host_ = !command.srun && command.hostfile_path.empty();
  tasks_ = command.srun && !abort_file_.empty() ? std::string(core::kEnvAbortFile) + "=" + abort_file_ : "";
  zombies_.clear();
  rank_failure_.reset();
  stopped_at_ = {};
  stop_finished_ = false;
  stop_signal_pending_ = false;
}

// Ctrl-C asks for a stop, a second one aborts; SIGTERM asks for a stop and starts the grace;
// SIGHUP (a closed terminal), USR1/USR2 (a warning, a pause on Slurm), URG (a pause on PBS) ask for one.
void Supervisor::handle_signals(SignalFd& signals, Loop& loop) {
  for (int signal; (signal = signals.next()) != 0;) {
    if (signal == SIGCHLD) continue;  // reaped below
    if (signal == SIGINT && attempt_->stop_requested && attempt_->stop_reason == "interrupt") {
      core::log_warning("second Ctrl-C: aborting now, without a checkpoint");
      attempt_->aborted = true;
      abort_attempt();
      kill_everything(child_, &mpirun_status_, tasks_);
    } else if (signal == SIGINT) {
      request_stop("interrupt");
      core::log_info("stopping after the current step with a checkpoint; press Ctrl-C again to abort now");
    } else if (signal == SIGTERM) {
      // Not forwarded: the scheduler signals every process of the job itself, and a second
      // TERM makes mpirun kill the ranks at once. A stop request reaches them if it did not.
      request_stop("terminate");
      if (loop.term_at == kNever) {
        const std::int64_t grace = config_.scheduler.preemption_grace_seconds;
        loop.term_at = Clock::now() + std::chrono::seconds(grace);
        const auto& kill_delay = allocation_.kill_delay_seconds;  // PBS's SIGKILL may come first
        const bool sooner = kill_delay && *kill_delay < grace;
        core::log(sooner ? core::LogLevel::kWarning : core::LogLevel::kInfo, "SIGTERM: waiting up to {} for the "
                  "ranks' checkpoint{}", describe_seconds(grace), !sooner ? "" : ", but " + allocation_.scheduler +
                  " kills job " + allocation_.job_id + " " + describe_seconds(*kill_delay) + " after its SIGTERM "
                  "(the queue's kill_delay) unless it was deleted with a longer `qdel -W` (`hpctrial kill` gives "
                  "scheduler.preemption_grace)");
      }
    } else {
      if (signal == SIGURG) core::log_info("SIGURG: a pause of the job (hpctrial pause); passing it to the ranks");
      request_stop(signal == SIGHUP ? "hangup" : signal == SIGURG ? "pause" : "preemption");
    }
  }
}

// What the launcher does while mpirun runs: a failed rank ends the others, a finished stop ends
// the stragglers, the kill timers, the job's deadline, the grace after SIGTERM, the hang watch.
void Supervisor::supervise(Clock::time_point now, int np, bool stopping, Loop& loop) {
  // A rank's record read (below, every 50 ms while stopping): mpirun has set itself up.
  if (stop_signal_pending_ && (!beats_.empty() || now - started_ > kMpirunSetUp)) {
    stop_signal_pending_ = false;
    pass_stop_to_ranks();
  }
  // A rank that failed: end the others now (mpirun would give them the whole grace), then
  // mpirun, if it does not end by itself.
  if (!rank_failure_ && (rank_failure_ = find_failed_rank(now, output_->mpirun_text()))) {
    // Without the rank's own code or a watchdog's verdict, mpirun's words are the only other
    // witness, and ranks the launcher killed first would muddle them: a moment for mpirun's
    // report first. (mpirun would wait odls_base_sigkill_timeout before it ends the others.)
    const bool exact = rank_failure_->exit_code || rank_failure_->signal || rank_failure_->by_watchdog;
    if (exact) {
      core::log_warning("rank {} {}: ending the other ranks", rank_failure_->rank, rank_failure_->how);
      abort_attempt();
      kill_ranks(child_, tasks_);
      // Its report is not needed: a moment to reap its ranks here, a second for daemons elsewhere.
      loop.mpirun_kill_at = now + (single_host_ ? kMpirunReapSingleHost : std::chrono::seconds(1));
    } else {
      core::log_warning("rank {} {}: the job ends", rank_failure_->rank, rank_failure_->how);
      loop.ranks_kill_at = now + std::chrono::seconds(1);
    }
  }
  // Ranks stopped on request (exit 75 recorded): mpirun would hold the stragglers, which only
  // finish, until its SIGKILL timeout. End them after a moment, or once every rank has ended.
  if (stopped_at_ != Clock::time_point{} && !stop_finished_ &&
      (now - stopped_at_ > std::chrono::seconds(2) || all_ranks_exited(np, kExitStopped))) {
    stop_finished_ = true;
    abort_attempt();  // every checkpoint is durable: the stragglers only finish
    kill_everything(child_, &mpirun_status_, tasks_);
  }
  if (now >= loop.ranks_kill_at) {
    abort_attempt();
    kill_ranks(child_, tasks_);
    loop.ranks_kill_at = kNever;
    loop.mpirun_kill_at = now + std::chrono::seconds(1);
  }
  if (now >= loop.mpirun_kill_at) {
    kill_everything(child_, &mpirun_status_, tasks_);
    loop.mpirun_kill_at = kNever;
  }
  if (now >= loop.deadline && !attempt_->stop_requested) {
    core::log_info("{} job {} ends in {}: asking the ranks to checkpoint and stop", allocation_.scheduler,
                   allocation_.job_id, describe_seconds(config_.scheduler.preemption_grace_seconds));
    request_stop("deadline");
  }
  // A stop request of the job (a search's worker paused; PBS sends no signal), looked for each second.
  if (!attempt_->stop_requested && allocation_.in_job() && now >= loop.job_request_check) {
    loop.job_request_check = now + kHeartbeatCheck;
    if (!core::job_stop_reason(experiment_, allocation_).empty()) request_stop("pause");
  }
  if (now >= loop.term_at && loop.kill_at == kNever) {
    core::log_warning("the ranks did not stop within scheduler.preemption_grace; ending them");
    attempt_->grace_expired = true;
    abort_attempt();
    ::kill(child_, SIGTERM);
    loop.kill_at = now + kKillGrace;
  }
  if (now >= loop.kill_at) {
    kill_everything(child_, &mpirun_status_, tasks_);
    loop.kill_at = kNever;
    loop.term_at = kNever;
  }
  if (now - last_heartbeat_check_ >= (stopping ? kHeartbeatCheckStopping : kHeartbeatCheck) && attempt_->hang.empty()) {
    last_heartbeat_check_ = now;
    check_progress(now, np, child_);
  }
}

// Everything has ended: the output flushed, nothing left behind, and after a failure, which
// rank failed and how, read from every witness.
void Supervisor::finish() {
  output_->flush();
  kill_everything(child_, &mpirun_status_, tasks_);  // nothing outlives the attempt
  if (finished_despite_warning()) attempt_->status = 0;
  const int status = attempt_->status;
  const bool good_end = attempt_->hang.empty() &&
                        (stop_finished_ || (WIFEXITED(status) && (WEXITSTATUS(status) == kExitFinished ||
                                                                  WEXITSTATUS(status) == kExitStopped)));
  if (!good_end) {
    abort_attempt();
    output_->show_held();
    // Read now, with every rank ended: a record read during the attempt may predate its end.
    const auto records = core::read_heartbeats(trial_.heartbeat_dir());
    for (const auto& [rank, record] : records) beats_[rank] = record;
    std::ifstream verdict_in(verdict_file_);
    const std::string verdict_text((std::istreambuf_iterator<char>(verdict_in)), {});
    // After the launcher's own hang watch ended the attempt, what mpirun reports are the ranks
    // it killed: only the ranks' records and the watchdog's verdict name a culprit.
    const bool hung = !attempt_->hang.empty();
    failure_ = detail::attribute_failure(records, core::decode_verdict(verdict_text),
                                         hung ? std::string() : output_->mpirun_text(),
                                         hung ? std::nullopt : rank_failure_);
  }
  if (failure_.rank >= 0) failure_tail_ = output_->tail(failure_.rank);
  mpirun_tail_ = output_->tail(-1);
}

std::map<int, long long> Supervisor::steps() const {
  std::map<int, long long> out;
  for (const auto& [rank, record] : beats_) out[rank] = record.step;
  return out;
}

void Supervisor::request_stop(std::string reason) {
  if (attempt_->stop_requested) return;
  // The ranks first: mpirun forwards SIGUSR2 to every rank once it has set itself up (a younger
  // one would die of it: the signal then waits for the first rank, in supervise); the record
  // below is read and written durably after, which would cost a fast trial hundreds of steps.
  const bool young = !mpirun_set_up();
  if (!young) pass_stop_to_ranks();
  // `hpctrial pause` writes its request (the trial's, or a worker's job's) before it signals.
  const std::string recorded = core::stop_reason(trial_.dir), for_job = core::job_stop_reason(experiment_, allocation_);
  if (!recorded.empty() || !for_job.empty()) reason = recorded.empty() ? for_job : recorded;
  attempt_->stop_requested = true;
  attempt_->stop_reason = reason;
  bool on_disk = !recorded.empty();
  try {
    if (!on_disk) core::request_stop(trial_.dir, reason);
    on_disk = true;
  } catch (const Error& e) {
    core::log_warning("cannot record the stop request ({}); the signal still reaches the ranks", e.what());
  }
  if (young && !on_disk) pass_stop_to_ranks();
  if (young && on_disk) stop_signal_pending_ = true;
  core::log_info("stop requested ({}): the ranks checkpoint after their current step", reason);
}

std::optional<detail::RankFailure> Supervisor::find_failed_rank(Clock::time_point now, const std::string& mpirun_text) {
  // A scan that read a rank's record again (the rank ended after the launcher last read the
  // records) starts over with it.
  for (;;) {
    if (any_rank_stopped()) {
      if (stopped_at_ == Clock::time_point{}) stopped_at_ = now;
      return std::nullopt;
    }
    if (auto failure = failure_of_records()) return failure;
    if (mpirun_text.find("MPI_ABORT was invoked") != std::string::npos ||
        mpirun_text.find("mpirun noticed that process rank") != std::string::npos ||
        mpirun_text.find("srun: error: ") != std::string::npos) {
      if (auto failure = detail::parse_mpirun_failure(mpirun_text); failure.rank >= 0) return failure;
    }
    Scan scan = failure_of_ended_processes(now);
    if (scan.reread) continue;
    if (scan.failure) return scan.failure;
    scan = failure_of_local_records(now);
    if (scan.reread) continue;
    return scan.failure;
  }
}

bool Supervisor::any_rank_stopped() const {
  for (const auto& [rank, record] : beats_) {
    if (record.end && record.end->kind == core::RankEnd::Kind::kExit && record.end->code == kExitStopped) return true;
  }
  return false;
}

std::optional<detail::RankFailure> Supervisor::failure_of_records() const {
  // The first rank to record a failed end.
  const core::RankEnd* first = nullptr;
  detail::RankFailure f;
  for (const auto& [rank, record] : beats_) {
    if (record.end && record.end->failed() && (!first || record.end->unix_ms < first->unix_ms)) {
      first = &*record.end;
      f.rank = rank;
    }
  }
  if (first) {
    (first->kind == core::RankEnd::Kind::kSignal ? f.signal : f.exit_code) = first->code;
    f.how = first->describe();
    return f;
  }
  // A watchdog ended the job: its verdict names the cause once the attempt is over.
  for (const auto& [rank, record] : beats_) {
    if (record.end && record.end->kind == core::RankEnd::Kind::kWatchdog) {
      f.rank = rank;
      f.by_watchdog = true;  // its verdict is written
      f.how = record.end->describe();
      return f;
    }
  }
  return std::nullopt;
}

bool Supervisor::reread_ended(int rank) {
  const auto fresh = fresh_record(rank);
  if (!fresh || !fresh->end) return false;
  beats_[rank] = *fresh;
  return true;
}

Supervisor::Scan Supervisor::failure_of_ended_processes(Clock::time_point now) {
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
        return {std::nullopt, true};
      }
      if (fresh && !status) continue;  // the record is there: the local scan judges it
    } else if (auto fresh = fresh_record(rank)) {  // it ended after the launcher last read the records
      beats_[rank] = *fresh;
      return {std::nullopt, true};
    }
    const auto first_seen = zombies_.emplace(rank, now).first->second;
    if (status) {
      if (auto failure = failure_of_status(rank, *status, now - first_seen)) return {failure, false};
      continue;
    }
    if (now - first_seen < std::chrono::milliseconds(500)) continue;
    detail::RankFailure f;
    f.rank = rank;
    f.how = "ended without a record of how (before it wrote one, or where it could not be read; see its output)";
    return {f, false};
  }
  return {};
}

Supervisor::Scan Supervisor::failure_of_local_records(Clock::time_point now) {
  const std::string host = core::host_name();
  std::optional<detail::RankFailure> found;
  for (const auto& [rank, record] : beats_) {
    if (record.host != host) continue;
    const auto status = detail::zombie_status(record.pid);
    const bool gone = !status && ::kill(record.pid, 0) != 0 && errno == ESRCH;
    if (!status && !gone) continue;
    const auto first_seen = zombies_.emplace(rank, now).first->second;
    detail::RankFailure f;
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
      if (reread_ended(rank)) return {std::nullopt, true};
      // Gone without a record of its end: SIGKILL (the OOM killer, say). mpirun knows which
      // signal, and says so once the other ranks have ended.
      f.how = "ended without an exit code (killed by a signal, or crashed)";
    }
    if (!found) found = f;
  }
  return {found, false};
}

std::optional<detail::RankFailure> Supervisor::failure_of_status(int rank, int status, Clock::duration seen) {
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

void Supervisor::abort_attempt() {
  if (abort_written_ || abort_file_.empty()) return;
  abort_written_ = true;
  try {
    core::write_file_atomic(abort_file_, core::utc_now_iso() + "\n");
  } catch (const Error& e) {
    core::log_warning("cannot write {} ({}); ranks on other hosts end only when mpirun ends them", abort_file_,
                      e.what());
  }
}

void Supervisor::check_progress(Clock::time_point now, int np, pid_t child) {
  const auto live = rank_processes(child, tasks_);
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
  for (auto& [rank, record] : core::read_heartbeats(trial_.heartbeat_dir())) {
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
  kill_everything(child, &mpirun_status_, tasks_);
}

}  // namespace hpctrial::launcher::detail
