// The rank side of the launcher's contract, besides signals and exit codes (internal):
// - StopFile: the chief looks, at most once a second, for the stop request the launcher (or
//   `hpctrial pause`) writes where a signal may not reach the ranks ($HPCTRIAL_STOP_FILE).
// - Heartbeat: each rank writes the last step it finished to $HPCTRIAL_HEARTBEAT_DIR/rank-<N>,
//   once a second, for the launcher's hang watchdog.
// - AbortWatch: every rank looks, twice a second, for the file the launcher writes when it ends
//   an attempt ($HPCTRIAL_ABORT_FILE, on the shared filesystem), and kills itself when it
//   appears: ranks on other nodes, which the launcher cannot signal, do not wait in a collective
//   with a dead peer until mpirun's SIGKILL timeout.
// - FaultPlan: $HPCTRIAL_FAULT, the fault-injection hook of the tests: faults keyed by rank,
//   step, phase and restart count, e.g. "rank1:step7:sigkill" or "rank0:restart0:validation:exit3";
//   several separated by commas. Actions: exit<N>, sigkill, segv, abort, throw, hang.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <optional>
#include <string>
#include <vector>

namespace hpctrial::trainer::detail {

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

class Heartbeat {
 public:
  Heartbeat(const std::string& dir, int rank);
  ~Heartbeat();
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;
  // Records the last finished step; a thread of its own writes it out once a second.
  void beat(long long step);

 private:
  void write(long long step);

  int fd_ = -1;
  std::atomic<long long> step_{-1};
  std::mutex mutex_;
  std::condition_variable stop_;
  bool stopping_ = false;
  std::thread thread_;
};

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

enum class FaultPhase { kBatch, kValidation, kCheckpoint };

class FaultPlan {
 public:
  // Parses the spec; ConfigError naming HPCTRIAL_FAULT and the bad word.
  FaultPlan(const std::string& spec, int rank, int restart_count);
  // Acts when a fault matches this rank, restart, phase and step (batches trained so far).
  void at(FaultPhase phase, long long step) const;
  bool empty() const { return faults_.empty(); }

 private:
  struct Fault {
    std::optional<long long> step;
    FaultPhase phase = FaultPhase::kBatch;
    std::string action;
    std::string text;
  };
  std::vector<Fault> faults_;  // only those for this rank and restart
  int rank_;
};

}  // namespace hpctrial::trainer::detail
