// One attempt of a trial, supervised: mpirun started and its output split per rank, the
// launcher's signals turned into stop requests, the job's deadline, a failed rank ending the
// others at once, the hang watch, and, once everything has ended, which rank failed and how.
#pragma once

#include <chrono>
#include <cstdint>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "hpctrial/core/allocation.h"
#include "hpctrial/core/experiment_config.h"
#include "hpctrial/core/launch_contract.h"
#include "hpctrial/launcher/launcher.h"
#include "launcher_internal.h"
#include "processes.h"

namespace hpctrial::launcher::detail {

using Clock = std::chrono::steady_clock;
inline constexpr auto kMpirunSetUp = std::chrono::seconds(2);  // before it, a signal would kill mpirun

// "90 s", or "2h 30m" from two minutes on.
inline std::string describe_seconds(std::int64_t seconds) {
  return seconds < 120 ? std::to_string(seconds) + " s" : core::format_duration(seconds);
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
  Supervisor(const core::ExperimentConfig& config, const core::Allocation& allocation, std::string experiment_dir,
             std::string trial_dir)
      : config_(config), allocation_(allocation), experiment_{std::move(experiment_dir)}, trial_{std::move(trial_dir)} {}

  Attempt run(const MpirunCommand& command, SignalFd& signals);

  bool stop_finished() const { return stop_finished_; }
  const detail::RankFailure& failure() const { return failure_; }
  const std::vector<std::string>& failure_tail() const { return failure_tail_; }
  const std::vector<std::string>& mpirun_tail() const { return mpirun_tail_; }
  std::map<int, long long> steps() const;

 private:
  void request_stop(std::string reason);

  // A rank that failed while mpirun still runs: one that recorded a failed end (its exit code,
  // fatal signal or abort: exact, on any host), one mpirun reported, or one of this host seen
  // ended without a record (killed by SIGKILL, say) - after a moment for mpirun's report, which
  // says which signal. A rank that stopped on request (75) means the others are only finishing.
  std::optional<detail::RankFailure> find_failed_rank(Clock::time_point now, const std::string& mpirun_text);
  // The steps of find_failed_rank. A Scan that read a rank's record again asks for a new start.
  struct Scan {
    std::optional<detail::RankFailure> failure;
    bool reread = false;
  };
  bool any_rank_stopped() const;
  std::optional<detail::RankFailure> failure_of_records() const;  // the first failed end recorded
  Scan failure_of_ended_processes(Clock::time_point now);          // rank processes seen ended
  Scan failure_of_local_records(Clock::time_point now);            // this host's ranks, by their pids
  bool reread_ended(int rank);  // reads the rank's record again; true when it now has an end

  // A rank of this host whose process ended with wait status `status`, seen ended for `seen`:
  // its failure, or none - it stopped on request (75), or exited 0 a moment ago (finishing:
  // mpirun reaps it now).
  static std::optional<detail::RankFailure> failure_of_status(int rank, int status, Clock::duration seen);

  // The timers of one attempt's poll loop (max(): not set).
  struct Loop {
    Clock::time_point term_at = Clock::time_point::max();         // SIGTERM came: the grace ends
    Clock::time_point kill_at = Clock::time_point::max();         // mpirun was sent SIGTERM: SIGKILL at
    Clock::time_point deadline = Clock::time_point::max();        // the job's end, less the grace
    Clock::time_point mpirun_kill_at = Clock::time_point::max();  // after a failed rank
    Clock::time_point ranks_kill_at = Clock::time_point::max();   // after a failed rank, no exact code
    Clock::time_point job_request_check{};                         // next look for the job's stop request
  };
  void begin(const MpirunCommand& command, pid_t child);
  void handle_signals(SignalFd& signals, Loop& loop);
  void supervise(Clock::time_point now, int np, bool stopping, Loop& loop);
  void finish();

  std::optional<core::HeartbeatRecord> fresh_record(int rank) const {
    std::ifstream in(trial_.heartbeat_file(rank), std::ios::binary);
    return core::heartbeat_decode(std::string((std::istreambuf_iterator<char>(in)), {}));
  }

  // Ranks on other hosts, which only mpirun can signal (and mpirun gives them the whole grace),
  // end themselves on seeing this file.
  void abort_attempt();

  // True when each of the `np` ranks has exited with `code` (75: stopped; 0: finished): by its
  // record, and those of this host also seen ended (a zombie of mpirun's, or reaped).
  bool all_ranks_exited(int np, int code) const;  // supervisor_ranks.cpp
  // SIGUSR2 to mpirun, which forwards it to every rank (tens of milliseconds later on a busy
  // node: hundreds of a small model's steps), and at once to each rank process of this host
  // already seen in its record (by then its parent forwards signals to it); the step's
  // agreement passes the stop to the rest.
  void pass_stop_to_ranks();  // supervisor_ranks.cpp
  // mpirun has set itself up (it forwards signals to the ranks, where a younger one would die of
  // one): it is older than kMpirunSetUp, or a rank has a record - read now if none was yet, so
  // that a stop asked for right after the start waits for no periodic read.
  bool mpirun_set_up();  // supervisor_ranks.cpp
  // mpirun ended of the USR2 the launcher passed it (a warning, a pause) just as every rank had
  // finished (exit 0): the attempt finished, and the stop was never needed.
  bool finished_despite_warning();

  void check_progress(Clock::time_point now, int np, pid_t child);

  const core::ExperimentConfig& config_;
  const core::Allocation& allocation_;
  core::ExperimentLayout experiment_;
  core::TrialLayout trial_;
  Attempt* attempt_ = nullptr;
  detail::RankOutput* output_ = nullptr;
  pid_t child_ = -1;
  int np_ = 0;  // the attempt's ranks
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
  // A stop requested while mpirun was setting itself up: its SIGUSR2 is sent once the first rank
  // is seen (mpirun then forwards signals; the ranks hold it until their handlers are in place).
  bool stop_signal_pending_ = false;
  std::string abort_file_;         // $HPCTRIAL_ABORT_FILE of the attempt
  std::string verdict_file_;       // $HPCTRIAL_VERDICT_FILE of the attempt
  std::string tasks_;              // under srun, HPCTRIAL_ABORT_FILE=..., which marks the step's tasks
  bool abort_written_ = false;
  detail::RankFailure failure_;
  std::vector<std::string> failure_tail_, mpirun_tail_;
};

}  // namespace hpctrial::launcher::detail
