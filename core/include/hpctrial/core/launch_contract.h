// The contract between the launcher (host side: `hpctrial run`/`launch`) and the ranks it starts,
// owned here once so that both sides read and write the same names, codes and encodings.
//
// - Exit codes: 0 finished; 75 (EX_TEMPFAIL) stopped on request after a durable checkpoint, to be
//   resumed; 2 a mistake in the config or the command line; anything else a failure.
// - Files in a trial directory (named by core::TrialLayout, core/layout.h): the stop request
//   (written by `hpctrial pause` and the launcher, watched by the chief), one heartbeat per rank,
//   the abort file of an attempt (written by the launcher when it ends the attempt; every rank
//   that sees it kills itself), and the verdict of an attempt (written by the collective watchdog
//   before it aborts the job: which ranks it found stuck, and why).
// - The heartbeat record: a small fixed-layout text file per rank, updated in place, that says
//   where the rank is (step, phase) and, once it has ended, how (exit code, fatal signal, or an
//   abort with its message). The field writers are async-signal-safe: a fatal-signal handler and
//   an on_exit() handler use them.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "hpctrial/core/env.h"
#include "hpctrial/core/experiment_config.h"
#include "hpctrial/core/layout.h"

namespace hpctrial::core {

inline constexpr int kExitFinished = 0;
inline constexpr int kExitFailed = 1;
inline constexpr int kExitConfig = 2;
inline constexpr int kExitInvalidHP = 65;  // EX_DATAERR: the trial threw InvalidHP; never restarted
inline constexpr int kExitStopped = 75;   // EX_TEMPFAIL: checkpointed on request; resume me
inline constexpr int kExitAborted = 130;  // a second Ctrl-C: ended without a checkpoint

// The environment the launcher gives every rank.
inline constexpr const char* kEnvExperimentDir = "HPCTRIAL_EXPERIMENT_DIR";
inline constexpr const char* kEnvConfig = "HPCTRIAL_CONFIG";
inline constexpr const char* kEnvTrialId = "HPCTRIAL_TRIAL_ID";
inline constexpr const char* kEnvTrialDir = "HPCTRIAL_TRIAL_DIR";
inline constexpr const char* kEnvRestartCount = "HPCTRIAL_RESTART_COUNT";
inline constexpr const char* kEnvScheduler = "HPCTRIAL_SCHEDULER";
inline constexpr const char* kEnvJobId = "HPCTRIAL_JOB_ID";
inline constexpr const char* kEnvStopFile = "HPCTRIAL_STOP_FILE";
inline constexpr const char* kEnvHeartbeatDir = "HPCTRIAL_HEARTBEAT_DIR";
inline constexpr const char* kEnvAbortFile = "HPCTRIAL_ABORT_FILE";
inline constexpr const char* kEnvVerdictFile = "HPCTRIAL_VERDICT_FILE";
inline constexpr const char* kEnvFault = "HPCTRIAL_FAULT";
// Set by an adaptive search's worker: train to this length only (a rung), "<unit>:<value>".
inline constexpr const char* kEnvMaxLength = "HPCTRIAL_MAX_LENGTH";
// Set by an adaptive search's worker: its name in the search log's events. The trial's chief
// records each rung in the log and trains on when promoted there.
inline constexpr const char* kEnvSearchWorker = "HPCTRIAL_SEARCH_WORKER";
// The code the ranks run (core/frozen_code.h): the SHA-256 of the experiment's frozen program or
// library, or "image <reference>" in a container image; unset for code that is not frozen.
inline constexpr const char* kEnvCodeDigest = "HPCTRIAL_CODE_DIGEST";
// The launcher's run of the trial, the same for each of its attempts ("<host>-<pid>-<start>"): a
// rank's copies in node memory (checkpoint_levels.memory) made by another one are left over.
inline constexpr const char* kEnvSession = "HPCTRIAL_SESSION";

// What the launcher told a rank, read once from the environment by every rank bootstrap (trials
// and Core API programs alike). Outside the launcher (a plain `mpirun`, a test) the names are
// unset: empty strings and zero counts, and the rank does without a stop file, heartbeat, abort
// file or verdict.
struct RankContract {
  std::string experiment_dir;  // HPCTRIAL_EXPERIMENT_DIR
  std::string config;          // HPCTRIAL_CONFIG: the experiment config
  std::string trial_dir;       // HPCTRIAL_TRIAL_DIR
  int trial_id = 0;            // HPCTRIAL_TRIAL_ID
  int restart_count = 0;       // HPCTRIAL_RESTART_COUNT: the attempts of this trial before this one
  std::string scheduler;       // HPCTRIAL_SCHEDULER: "slurm", "pbs", "local", ...
  std::string job_id;          // HPCTRIAL_JOB_ID
  std::string stop_file;       // HPCTRIAL_STOP_FILE
  std::string heartbeat_dir;   // HPCTRIAL_HEARTBEAT_DIR
  std::string abort_file;      // HPCTRIAL_ABORT_FILE
  std::string verdict_file;    // HPCTRIAL_VERDICT_FILE
  std::string fault;           // HPCTRIAL_FAULT: the tests' fault-injection plan
  std::optional<Length> max_length;  // HPCTRIAL_MAX_LENGTH: this run's searcher.max_length
  std::string search_worker;         // HPCTRIAL_SEARCH_WORKER
  std::string code_digest;     // HPCTRIAL_CODE_DIGEST
  std::string session;         // HPCTRIAL_SESSION
};
// ConfigError naming the variable and its value when HPCTRIAL_TRIAL_ID or HPCTRIAL_RESTART_COUNT
// is not a whole number of 0 or more.
RankContract read_contract(const EnvSource& env);
// "batches:16" for HPCTRIAL_MAX_LENGTH, and back (ConfigError naming the text).
std::string length_text(const Length& length);
Length parse_length_text(const std::string& text);
// The config a rank trains with: the experiment's with this trial's hyperparameter values
// (core::trial_config), and the contract's max_length when a search's worker set one.
ExperimentConfig rank_config(const ExperimentConfig& experiment, const RankContract& contract);

// Where a rank is. kAgreement is the step boundary's collective (stop, validation and
// checkpoint triggers); kEvaluate is evaluate_full_dataset.
enum class RankPhase { kStartup, kBatch, kAgreement, kValidation, kEvaluate, kCheckpoint, kShutdown };
const char* phase_name(RankPhase phase);  // "startup", "batch", "agreement", ...
std::optional<RankPhase> parse_phase(std::string_view name);

// How a rank ended: exit() with a code, a fatal signal, MPI_Abort with a code after an error
// (whose message the record carries), or MPI_Abort by its collective watchdog, which ended the
// job for another rank's sake (not a failure of this one: the watchdog's verdict names the cause).
struct RankEnd {
  enum class Kind { kExit, kSignal, kAbort, kWatchdog };
  Kind kind = Kind::kExit;
  int code = 0;            // the exit or abort code, or the signal number
  long long unix_ms = 0;   // when (wall clock), to order the ends of several ranks
  bool failed() const {
    if (kind == Kind::kWatchdog) return false;
    return kind != Kind::kExit || (code != kExitFinished && code != kExitStopped);
  }
  std::string describe() const;  // "exited with code 3", "was killed by signal 11 (...)", ...
};

struct HeartbeatRecord {
  long long step = -1;  // the last step the rank finished; -1 before its first
  RankPhase phase = RankPhase::kStartup;
  int pid = 0;
  std::string host;
  std::optional<RankEnd> end;
  std::string message;  // with an abort: the error, cut to what the record holds
};

// The record's layout: one line of fixed-width fields, then a message line, padded to
// kHeartbeatSize bytes. Updating a field rewrites its bytes in place, so that a reader sees the
// record whole at any time (a field being rewritten may read torn; decode() then fails and the
// reader keeps what it had).
inline constexpr std::size_t kHeartbeatSize = 512;

// Fills `page` (kHeartbeatSize bytes) with a record of a rank that has not ended.
void heartbeat_init(char* page, long long step, RankPhase phase, int pid, std::string_view host) noexcept;
void heartbeat_put_step(char* page, long long step) noexcept;
void heartbeat_put_phase(char* page, RankPhase phase) noexcept;
void heartbeat_put_end(char* page, RankEnd end) noexcept;
void heartbeat_put_message(char* page, const char* message) noexcept;
std::optional<HeartbeatRecord> heartbeat_decode(std::string_view text);
// The records of every rank-<N> file in a heartbeat directory, by rank: one open and one read
// of kHeartbeatSize bytes a rank (65 536 ranks' records: half a second on the test machine).
std::vector<std::pair<int, HeartbeatRecord>> read_heartbeats(const std::string& dir);
// One rank's record; nullopt when it has none (yet) or it reads torn. What needs one rank's
// record reads it alone: the whole directory costs a read a rank.
std::optional<HeartbeatRecord> read_heartbeat(const std::string& dir, int rank);

// The watchdog's verdict: the ranks it found stuck (that did not arrive in a collective the
// others waited in) and its message.
struct Verdict {
  std::vector<int> culprits;
  std::string message;
  // Each rank's last operations as the watchdog knew them (its flight recorder), by rank.
  std::vector<std::pair<int, std::string>> flight;
};
std::string encode_verdict(const Verdict& verdict);
std::optional<Verdict> decode_verdict(std::string_view text);

}  // namespace hpctrial::core
