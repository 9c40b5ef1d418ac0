// PBS Professional / OpenPBS commands (qsub, qhold, qrls, qdel, qstat, qselect), run by argv
// through a runner, never a shell. Every method throws SchedulerError naming the command and
// what PBS said when it fails.
//
// Job status comes from `qstat -f -F json -x` (PBS Pro 19 and later, OpenPBS), which prints
//   {"timestamp":..., "pbs_version":"...", "pbs_server":"...",
//    "Jobs":{"1234.srv":{"Job_Name":"...", "Job_Owner":"alice@login1", "job_state":"R",
//                        "run_count":1, "Exit_status":0, "Output_Path":"login1:/path", ...}}}
// and leaves "Jobs" out when no job matches. Where -F json is unknown (older PBS), the text of
// `qstat -f -x` is read instead: "Job Id: 1234.srv" then "    key = value" lines, long values
// continued on lines that start with a tab. -x asks for finished jobs too (the server's job
// history); without history a finished job is simply unknown.
#pragma once

#include <ctime>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "hpctrial/core/subprocess.h"

namespace hpctrial::pbs {

// What `qstat -f` says of a job.
struct JobInfo {
  std::string id;     // "1234.srv"; an array job "1234[].srv"; one of its subjobs "1234[3].srv"
  std::string name;   // Job_Name
  std::string owner;  // Job_Owner, "alice@login1"
  // job_state: Q queued, H held, W waiting (for its start time), R running, E exiting,
  // F finished, X a finished subjob, B an array job with subjobs started, S/U suspended,
  // T/M being moved.
  std::string state;
  int run_count = 0;
  std::optional<int> exit_status;  // once it ended
  std::string output_path;         // Output_Path without its "host:"
  std::string start_time;          // stime, as PBS prints it
  std::string exec_host;           // where it runs, "node1/0*4+node2/0*4"
  std::string priority;            // Priority, -1024..1023 (0 unless set)
  std::string queue;               // queue
  int mpiprocs = 0;                // Resource_List.mpiprocs: the ranks it asks for
  bool held() const { return state == "H"; }
  bool active() const;  // queued, held, waiting, running, exiting, begun or suspended
};

// Every job in `qstat -f -F json` output (none when "Jobs" is absent).
// The user PBS names as the owner of this process's jobs: the name of its user id.
std::string user_name();

std::vector<JobInfo> parse_qstat_json(const std::string& text, const std::string& command);
// Every job in `qstat -f` text output.
std::vector<JobInfo> parse_qstat_text(const std::string& text, const std::string& command);

class Client {
 public:
  // The default runner runs the real commands with a one-minute timeout.
  Client() : run_(core::real_command_runner()) {}
  explicit Client(core::CommandRunner run) : run_(std::move(run)) {}

  struct Submit {
    std::string script;
    // Variables qsub passes to the job by name (-v NAME,...), their values in qsub's own
    // environment, never in its argv.
    std::vector<std::pair<std::string, std::string>> env;
    bool hold = false;        // qsub -h: waits for qrls
    std::string after;        // -W depend=afterany:JOB: starts once JOB ended, however it ended
  };
  // Returns the job id qsub printed.
  std::string submit(const Submit& submit) const;
  void hold(const std::string& job) const;     // qhold: a queued job waits for qrls
  void release(const std::string& job) const;  // qrls
  void set_priority(const std::string& job, int priority) const;   // qalter -p
  void move(const std::string& job, const std::string& queue) const;  // qmove QUEUE JOB
  void swap_order(const std::string& a, const std::string& b) const;  // qorder A B
  // The user's queued jobs of `queue` in the order they go (qselect lists them so; queue_rank,
  // which says it, is shown to operators only).
  std::vector<std::string> queued_in_order(const std::string& user, const std::string& queue) const;
  // qsig -s SIGNAL: every process of a running job; false when PBS refused (the job is not
  // running any more).
  bool signal(const std::string& job, const std::string& signal) const;
  // qdel; with `kill_delay_seconds` (qdel -W N), the time a running job's processes get between
  // PBS's SIGTERM and its SIGKILL instead of the queue's kill_delay.
  void cancel(const std::string& job, std::optional<int> kill_delay_seconds = std::nullopt) const;
  // nullopt once PBS no longer knows the job.
  std::optional<JobInfo> job(const std::string& id) const;
  // What PBS knows of each of `ids`, with an array job's subjobs too, by one `qstat -f -x [-t]`
  // in text (each call takes a second or more on a busy server, and given several jobs
  // OpenPBS 23.06 prints only the first as JSON); the ids it forgot are left out.
  // More than kJobsByName ids: one `qstat -f -x` of every job the server has, those kept.
  std::vector<JobInfo> jobs(const std::vector<std::string>& ids) const;
  static constexpr std::size_t kJobsByName = 32;
  // USER's jobs (every user's when USER is empty) that PBS still knows: queued, held and
  // running (`qselect -u USER`; qstat refuses -u beside -f), and where the server keeps history those changed since `since`
  // (`qselect -x -u USER -tm.gt.TIME`: a history of weeks holds hundreds of jobs, and qstat
  // asks for each on a connection of its own), then jobs() of those.
  std::vector<JobInfo> user_jobs(const std::string& user, std::time_t since) const;

 private:
  core::RunResult checked(const std::vector<std::string>& argv, const core::RunOptions& options = {}) const;
  // qstat -f -x with `args`, as JSON where asked and this PBS can, else as text; nullopt:
  // unknown job (of several, the known ones: PBS prints those and names each unknown one on
  // stderr).
  std::optional<std::vector<JobInfo>> qstat(const std::vector<std::string>& args, bool as_json = true) const;
  core::CommandRunner run_;
};

}  // namespace hpctrial::pbs
