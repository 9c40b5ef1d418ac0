#include "hpctrial/slurm/client.h"

#include <unistd.h>

#include <cctype>
#include <sstream>

#include "hpctrial/core/error.h"
#include "hpctrial/core/logging.h"
#include "hpctrial/core/shell_quote.h"
#include "hpctrial/core/text.h"
#include "hpctrial/slurm/job_environment.h"

namespace hpctrial::slurm {

bool JobInfo::held() const {
  return state == "PENDING" && (reason.rfind("JobHeld", 0) == 0 || reason == "job_requeued_in_held_state");
}

std::string JobInfo::display_id() const {
  if (array_job_id.empty() || array_task.empty()) return id;
  if (array_task.find_first_not_of("0123456789") == std::string::npos) return array_job_id + "_" + array_task;
  // Tasks not started yet, "2-5" or "[2-5%2]": Slurm's own form for a set of tasks, 1234_[2-5].
  std::string set = array_task;
  if (!set.empty() && set.front() == '[') set = set.substr(1, set.find(']') - 1);
  return array_job_id + "_[" + set.substr(0, set.find('%')) + "]";
}

JobInfo parse_job_line(const std::string& line) {
  // Fields are KEY=VALUE separated by blanks; a value may itself hold blanks (a job name), so a
  // field ends only where the next " KEY=" begins.
  auto field = [&](const std::string& key) -> std::string {
    std::size_t at = 0;
    while ((at = line.find(key + "=", at)) != std::string::npos) {
      if (at == 0 || std::isspace(static_cast<unsigned char>(line[at - 1]))) break;
      at += key.size();
    }
    if (at == std::string::npos) return "";
    const std::size_t start = at + key.size() + 1;
    std::size_t end = start;
    while (end < line.size()) {
      const std::size_t blank = line.find(' ', end);
      if (blank == std::string::npos) return core::trim(line.substr(start));
      std::size_t k = blank + 1;
      while (k < line.size() && (std::isalnum(static_cast<unsigned char>(line[k])) || line[k] == '/' || line[k] == ':')) {
        ++k;
      }
      if (k < line.size() && line[k] == '=' && k > blank + 1) return line.substr(start, blank - start);
      end = blank + 1;
    }
    return core::trim(line.substr(start));
  };
  JobInfo j;
  j.id = field("JobId");
  j.name = field("JobName");
  j.state = field("JobState");
  j.reason = field("Reason");
  j.run_time = field("RunTime");
  j.std_out = field("StdOut");
  j.std_err = field("StdErr");
  j.exit_code = field("ExitCode");
  j.submit_time = field("SubmitTime");
  j.start_time = field("StartTime");
  j.node_list = field("NodeList");
  j.batch_host = field("BatchHost");
  j.partition = field("Partition");
  j.excluded_nodes = field("ExcNodeList");
  if (j.excluded_nodes == "(null)") j.excluded_nodes.clear();
  j.work_dir = field("WorkDir");
  j.array_job_id = field("ArrayJobId");
  j.array_task = field("ArrayTaskId");
  // "UserId=alice(1000)": the number
  const std::string user = field("UserId");
  const std::size_t open = user.find('(');
  if (open != std::string::npos) {
    j.user_id = user.substr(open + 1, user.find(')', open) - open - 1);
    j.user_name = user.substr(0, open);
  }
  j.priority = field("Priority");
  j.nice = field("Nice");
  try {
    j.restarts = std::stoi(field("Restarts"));
  } catch (const std::exception&) {
    j.restarts = 0;
  }
  try {
    j.num_tasks = std::stoi(field("NumTasks"));
  } catch (const std::exception&) {
    j.num_tasks = 0;
  }
  return j;
}

core::RunResult Client::checked(const std::vector<std::string>& argv, const core::RunOptions& options) const {
  core::RunResult r = run_(argv, options);
  if (!r.ok()) throw SchedulerError(r.describe());
  return r;
}

std::string Client::submit(const std::string& script, const std::vector<std::pair<std::string, std::string>>& env,
                           bool hold) const {
  core::RunOptions options;
  options.env_set = env;
  std::vector<std::string> argv = {"sbatch", "--parsable", "--export=ALL"};
  if (hold) argv.push_back("--hold");
  argv.push_back(script);
  const core::RunResult r = checked(argv, options);
  // "1234" or "1234;cluster"
  const std::string id = core::trim(r.out.substr(0, r.out.find(';')));
  if (!is_valid_job_id(id)) throw SchedulerError("sbatch answered \"" + core::trim(r.out) + "\", not a job id");
  return id;
}

void Client::requeue(const std::string& job, bool hold) const {
  checked({"scontrol", hold ? "requeuehold" : "requeue", job});
}

void Client::hold(const std::string& job) const { checked({"scontrol", "hold", job}); }

void Client::exclude_nodes(const std::string& job, const std::string& nodes) const {
  checked({"scontrol", "update", "JobId=" + job, "ExcNodeList=" + nodes});
}

int Client::partition_nodes(const std::string& partition) const {
  const core::RunResult r = run_({"scontrol", "-o", "show", "partition", partition}, {});
  const std::size_t at = r.ok() ? r.out.find("TotalNodes=") : std::string::npos;
  if (at == std::string::npos) return 0;
  try {
    return std::stoi(r.out.substr(at + std::string("TotalNodes=").size()));
  } catch (const std::exception&) {
    return 0;
  }
}

bool Client::partition_has_gpus(const std::string& partition) const {
  const core::RunResult r = run_({"scontrol", "-o", "show", "partition", partition}, {});
  if (!r.ok()) return false;
  const std::size_t at = r.out.find(" TRES=");
  return at != std::string::npos && r.out.substr(at, r.out.find(' ', at + 1) - at).find("gres/gpu") != std::string::npos;
}

void Client::release(const std::string& job) const { checked({"scontrol", "release", job}); }

void Client::update(const std::string& job, const std::vector<std::string>& fields) const {
  std::vector<std::string> argv{"scontrol", "update", "JobId=" + job};
  argv.insert(argv.end(), fields.begin(), fields.end());
  checked(argv);
}

void Client::top(const std::string& job) const { checked({"scontrol", "top", job}); }

void Client::cancel(const std::string& job) const { checked({"scancel", job}); }

std::vector<std::string> Client::program_steps(const std::string& job) const {
  std::vector<std::string> steps;
  std::istringstream lines(checked({"squeue", "-h", "-s", "-j", job, "-o", "%i"}).out);
  for (std::string line; std::getline(lines, line);) {
    const std::size_t dot = line.find('.');
    if (dot == std::string::npos || line.compare(0, dot, job) != 0) continue;
    const std::string step = line.substr(dot + 1);
    if (!step.empty() && step.find_first_not_of("0123456789") == std::string::npos) steps.push_back(line);
  }
  return steps;
}

bool Client::signal_batch(const std::string& job, const std::string& signal) const {
  // scancel asks again ten times, 5 s apart and more (95 s in all), while the controller answers
  // that the job "can not be altered now": pending, requeued or ending, no batch shell to signal.
  // --verbose says so at the first answer; a run cut short by then tells it.
  core::RunOptions options;
  options.timeout = kSignalWait;
  options.kill_grace = std::chrono::seconds(1);
  const core::RunResult r = run_({"scancel", "--batch", "--signal=" + signal, "--verbose", job}, options);
  if (r.ok()) return true;
  if (r.err.find("transitional state") != std::string::npos ||
      r.err.find("can not be altered now") != std::string::npos) {
    return false;
  }
  std::istringstream lines(r.err);
  for (std::string line; std::getline(lines, line);) {
    if (line.find("error:") != std::string::npos) throw SchedulerError("cannot signal slurm job " + job + ": " + line);
  }
  throw SchedulerError(r.describe());
}

namespace {

std::vector<JobInfo> parse_job_lines(const std::string& text, const std::string& command) {
  std::vector<JobInfo> jobs;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (core::trim(line).empty()) continue;
    JobInfo j = parse_job_line(line);
    if (j.id.empty()) throw SchedulerError("cannot read `" + command + "`: " + core::trim(line));
    jobs.push_back(std::move(j));
  }
  return jobs;
}

}  // namespace

std::vector<JobInfo> Client::job_tasks(const std::string& id) const {
  const core::RunResult r = run_({"scontrol", "-o", "show", "job", id}, {});
  if (!r.ok()) {
    if (r.err.find("Invalid job id") != std::string::npos) return {};
    throw SchedulerError(r.describe());
  }
  std::vector<JobInfo> tasks = parse_job_lines(r.out, "scontrol -o show job " + id);
  if (tasks.empty()) throw SchedulerError("`scontrol -o show job " + id + "` printed nothing");
  return tasks;
}

std::optional<JobInfo> Client::job(const std::string& id) const {
  std::vector<JobInfo> tasks = job_tasks(id);
  if (tasks.empty()) return std::nullopt;
  return std::move(tasks.front());
}

namespace {

// squeue answered that it cannot print JSON here: too old for --json, or its serializer plugin
// is not installed. Any other failure (the controller down) is an error of its own.
bool json_unsupported(const core::RunResult& r) {
  for (const char* words : {"--json", "unrecognized option", "invalid option", "serializer", "data_parser", "plugin"}) {
    if (r.err.find(words) != std::string::npos) return true;
  }
  return false;
}

std::string first_line(const std::string& text) { return core::trim(text.substr(0, text.find('\n'))); }

}  // namespace

std::vector<JobInfo> Client::user_jobs(core::JobOwners owners) const {
  const bool everyone = owners == core::JobOwners::kEveryone;
  std::vector<JobInfo> listed;
  if (json_ != false) {
    std::vector<std::string> argv{"squeue", "--json", "--states=all"};
    if (!everyone) argv.push_back("--me");
    const core::RunResult r = run_(argv, {});
    if (r.ok()) {
      json_ = true;
      listed = parse_jobs_json(r.out, core::shell_join(argv), std::time(nullptr));
      core::log_debug("slurm: {} job(s) from `{}`", listed.size(), core::shell_join(argv));
    } else if (json_unsupported(r)) {
      json_ = false;
      core::log_debug("slurm: `{}` cannot print JSON here ({}); reading `scontrol -o show job` instead",
                      core::shell_join(argv), first_line(r.err));
    } else {
      throw SchedulerError(r.describe());
    }
  }
  if (json_ == false) {
    const core::RunResult r = checked({"scontrol", "-o", "show", "job"});
    listed = parse_job_lines(r.out, "scontrol -o show job");
    core::log_debug("slurm: {} job(s) from `scontrol -o show job` (text)", listed.size());
  }
  if (everyone) return listed;
  // `scontrol show job`, and 22.05's squeue with --json, list every user's jobs: keep this user's.
  std::vector<JobInfo> jobs;
  const std::string uid = std::to_string(::getuid());
  for (JobInfo& j : listed) {
    if (j.user_id == uid) jobs.push_back(std::move(j));
  }
  return jobs;
}

}  // namespace hpctrial::slurm
