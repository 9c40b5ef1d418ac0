// Pieces of the launcher's host side, apart so that tests can reach them.
#pragma once

#include <nlohmann/json.hpp>

#include <deque>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "hpctrial/core/allocation.h"
#include "hpctrial/core/files.h"
#include "hpctrial/core/launch_contract.h"
#include "hpctrial/core/layout.h"

namespace hpctrial::launcher::detail {

// "the launcher of slurm job 12, pid 34 on node1": who holds a trial's lock, written into it.
std::string launcher_name(const core::Allocation& allocation);
// This launcher's run of its trial (HPCTRIAL_SESSION), the same for each attempt it starts.
std::string launch_session();
void name_holder(const core::UniqueFd& lock, const std::string& path, const core::Allocation& allocation);
// The trial's launcher lock (its lease), taken without waiting; an invalid fd while another
// launcher holds it.
core::UniqueFd try_lock_trial(const std::string& trial_dir);

// Splits mpirun's --tag-output stream ("[1,3]<stdout>:text") into lines per rank: each line
// goes to the launcher's own stdout or stderr as "[rank 3] text" and to the trial's
// logs/rank-3.log; untagged lines (mpirun's own) as they are, and to logs/mpirun.log.
// Keeps the last lines of each rank for failure records.
// One line of mpirun's tagged output ("[1,3]<stderr>:text") or srun's labelled output
// ("  3: text"): the rank, the text, and whether it came from stderr; nullopt for a line of
// mpirun's or srun's own.
struct TaggedLine {
  int rank = -1;
  std::string text;
  bool from_stderr = false;
};
std::optional<TaggedLine> untag_line(const std::string& line, bool srun_labels);

class RankOutput {
 public:
  // `srun_labels`: the lines come from `srun --label` ("3: text") rather than from mpirun's
  // --tag-output ("[1,3]<stdout>: text").
  RankOutput(core::TrialLayout trial, int out_fd, int err_fd, bool srun_labels = false);
  ~RankOutput();
  RankOutput(const RankOutput&) = delete;
  RankOutput& operator=(const RankOutput&) = delete;

  // Bytes read from mpirun's stdout (from_stderr false) or stderr.
  void feed(const char* data, std::size_t size, bool from_stderr);
  // Writes out partial last lines.
  void flush();
  // The last lines of `rank` (-1: mpirun's own), oldest first.
  std::vector<std::string> tail(int rank) const;
  // Everything mpirun itself printed (untagged), for reading its reasons.
  const std::string& mpirun_text() const { return mpirun_text_; }
  // mpirun's boxed reports ("------" ... "------") are held back: after a good end (0, or 75
  // from every rank) they only repeat what the launcher says; after a failure they are shown.
  void show_held();

 private:
  void line(const std::string& text, bool from_stderr);
  int log_fd(int rank);

  core::TrialLayout trial_;
  int out_fd_, err_fd_;
  std::string pending_[2];
  std::map<int, int> fds_;
  std::map<int, std::deque<std::string>> tails_;
  std::string mpirun_text_;
  std::string held_;
  bool in_box_ = false;
  bool srun_labels_ = false;
};

// The rank whose failure ended an attempt, and how it failed.
struct RankFailure {
  int rank = -1;
  std::optional<int> exit_code;
  std::optional<int> signal;
  std::string host;
  std::string how;      // "exited with code 3", "was killed by signal 9 (Killed)", ...
  std::string phase;    // where it was (core::RankPhase's name); empty: unknown
  long long step = -1;  // the last step it finished
  std::string message;  // its own words, when it recorded an error
  bool by_watchdog = false;  // its collective watchdog ended the job, after writing its verdict
  // Where every rank was, by the watchdog's flight recorder (its verdict), when a watchdog ended the job.
  std::vector<std::pair<int, std::string>> flight;
};
// What mpirun said about the first rank that failed.
RankFailure parse_mpirun_failure(const std::string& mpirun_text);

// Which rank's failure ended an attempt, from the most exact witness to the least: the earliest
// failure a rank recorded (core::HeartbeatRecord: its exit code, fatal signal or abort, written by
// the rank or its parent), else the watchdog's verdict (the rank it found stuck), else the
// launcher's own reading of a rank's status, else what mpirun reported, else `observed`. The phase and step
// come from the failing rank's record where it has one.
RankFailure attribute_failure(const std::vector<std::pair<int, core::HeartbeatRecord>>& records,
                              const std::optional<core::Verdict>& verdict, const std::string& mpirun_text,
                              const std::optional<RankFailure>& observed);

// The wait status of a process that has ended but was not reaped by its parent yet (mpirun's
// ranks on this host, read from /proc/PID/stat); nullopt while it runs or once it is gone.
std::optional<int> zombie_status(int pid);

// The tasks Slurm's SLURM_STEP_TASKS_PER_NODE ("2(x3),1": a count, repeated) puts on node
// `node` (counted from 0), as text; nullopt where the text does not say.
std::optional<std::string> tasks_on_node(const std::string& per_node, int node);
// What torchrun sets for each rank, which each rank's parent sets from Open MPI's or Slurm's
// variables (MASTER_ADDR and MASTER_PORT the launcher sets, the same for every rank).
inline constexpr const char* kTorchRankVariables[] = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"};

}  // namespace hpctrial::launcher::detail
