// The rank side of the launcher's contract (core/launch_contract.h), besides signals and exit
// codes, for every rank the launcher starts (trials and Core API programs alike):
// - StopFile: the chief looks, at most once a second, for the stop request the launcher (or
//   `hpctrial pause`) writes where a signal may not reach the ranks ($HPCTRIAL_STOP_FILE).
// - RankRecord: each rank's step, phase and end in $HPCTRIAL_HEARTBEAT_DIR/rank-<N>, for the
//   launcher's hang watch and its failure records.
// - AbortWatch: every rank looks, twice a second, for the file the launcher writes when it ends
//   an attempt ($HPCTRIAL_ABORT_FILE, on the shared filesystem), and kills itself when it
//   appears: ranks on other nodes, which the launcher cannot signal, do not wait in a collective
//   with a dead peer until mpirun's SIGKILL timeout.
// - FaultPlan: $HPCTRIAL_FAULT, the fault-injection hook of the tests: faults keyed by rank,
//   step, phase and restart count, e.g. "rank1:step7:sigkill" or "rank0:restart0:validation:exit3";
//   several separated by commas. Phases: startup (once set up, before the first step), batch
//   (the default), agreement (the step boundary's collective), validation, evaluate
//   (evaluate_full_dataset), checkpoint. Actions: exit<N>, sigkill, segv, abort, throw, hang;
//   nodeloss: this rank's folder in node memory (its copies, and those it keeps for partners)
//   removed, then sigkill, as the loss of its node would take them.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <optional>
#include <string>
#include <vector>

#include "hpctrial/core/launch_contract.h"

namespace hpctrial::rank {

class StopFile {
 public:
  explicit StopFile(std::string path) : path_(std::move(path)) {}
  // True once the file exists (checked at most once a second).
  bool requested();

 private:
  std::string path_;
  std::chrono::steady_clock::time_point last_{};
  bool seen_ = false;
};

// The rank's record for the launcher (core/launch_contract.h): where it is (step, phase) and,
// once it has ended, how. The record is a page of $HPCTRIAL_HEARTBEAT_DIR/rank-<N> mapped into
// memory, so that a step or phase change is a store of a few bytes and survives even a SIGKILL;
// a thread of its own flushes it to the file once a second, for launchers on other hosts. How
// the rank ends is recorded by an on_exit() handler (exit codes), a handler of the fatal
// signals (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT; chained to the handler they had), and
// record_abort() before MPI_Abort. One per process; construct it once MPI knows the rank.
// The record itself stays mapped until the process ends, so that its end can be recorded.
class RankRecord {
 public:
  // Creates and maps the file. IoError naming the path when it cannot be written (a full disk).
  RankRecord(const std::string& dir, int rank);
  ~RankRecord();  // stops the flushing thread
  RankRecord(const RankRecord&) = delete;
  RankRecord& operator=(const RankRecord&) = delete;
  // IoError naming the file once flushing it has failed (ENOSPC on a filesystem that allocates
  // on rewrite, EIO): the launcher could no longer follow this rank.
  void check() const;
  // The process's record, or null.
  static const RankRecord* current();

 private:
  std::string path_;
  std::atomic<int> error_{0};
  std::mutex mutex_;
  std::condition_variable stop_;
  bool stopping_ = false;
  std::thread thread_;
};

// Cheap (a store into the mapped record); no-ops before a RankRecord exists.
void record_step(long long step) noexcept;
void record_phase(core::RankPhase phase) noexcept;
core::RankPhase current_phase() noexcept;
// Records `phase` while it lives, then the phase before it; not while an exception unwinds it,
// so that a failure is recorded in the phase where it happened.
class PhaseRecord {
 public:
  explicit PhaseRecord(core::RankPhase phase) noexcept
      : previous_(current_phase()), exceptions_(std::uncaught_exceptions()) {
    record_phase(phase);
  }
  ~PhaseRecord() {
    if (std::uncaught_exceptions() == exceptions_) record_phase(previous_);
  }
  PhaseRecord(const PhaseRecord&) = delete;
  PhaseRecord& operator=(const PhaseRecord&) = delete;

 private:
  core::RankPhase previous_;
  int exceptions_;
};

// The collective watchdog of this rank is ending the job because of another rank (or because
// this rank's training thread stopped answering): recorded as such, so that the exit MPI_Abort
// makes is not taken for this rank's failure; the watchdog's verdict says what happened.
void record_watchdog_abort() noexcept;

// Records that this rank fails with `code` and why, and writes the record out: call it just
// before MPI_Abort.
void record_abort(int code, const std::string& message) noexcept;

// Records now that this rank exits with `code`, before MPI_Finalize: call it once nothing is
// left to do but finalize. Open MPI's finalize waits on its daemons, and after a scheduler's
// SIGTERM to every process of a multi-node job (a requeue, a preemption) they no longer answer;
// the launcher, reading the record, ends a rank that waits there instead of the scheduler's
// SIGKILL at the end of its KillWait.
void record_exit(int code) noexcept;

class AbortWatch {
 public:
  explicit AbortWatch(std::string path);  // an empty path watches nothing
  ~AbortWatch();
  AbortWatch(const AbortWatch&) = delete;
  AbortWatch& operator=(const AbortWatch&) = delete;

 private:
  std::string path_;
  std::mutex mutex_;
  std::condition_variable stop_;
  bool stopping_ = false;
  std::thread thread_;
};

using FaultPhase = core::RankPhase;

class FaultPlan {
 public:
  // Parses the spec; ConfigError naming HPCTRIAL_FAULT and the bad word.
  FaultPlan(const std::string& spec, int rank, int restart_count);
  // Acts when a fault matches this rank, restart, phase and step (batches trained so far).
  // `writer`: on the thread that writes this rank's part of a checkpoint (the word `writer`, or
  // `shards`), in the middle of its pieces of a sharded one, before the chief publishes a whole one.
  void at(FaultPhase phase, long long step, bool writer = false) const;
  bool empty() const { return faults_.empty(); }
  // The folder of this rank's copies in node memory, which `nodeloss` removes.
  void set_node_memory(std::string dir) { node_memory_ = std::move(dir); }

 private:
  struct Fault {
    std::optional<long long> step;
    FaultPhase phase = FaultPhase::kBatch;
    bool writer = false;
    std::string action;
    std::string text;
  };
  std::vector<Fault> faults_;  // only those for this rank and restart
  int rank_;
  std::string node_memory_;
};

}  // namespace hpctrial::rank
