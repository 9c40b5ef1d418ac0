#include "hpctrial/slurm/job_environment.h"

#include <ctime>
#include <regex>
#include <sstream>

#include "hpctrial/core/error.h"
#include "hpctrial/core/text.h"

namespace hpctrial::slurm {
namespace {

int parse_count(const std::string& text, const std::string& what) {
  if (text.empty() || text.size() > 6 || text.find_first_not_of("0123456789") != std::string::npos) {
    throw SchedulerError(what + " is \"" + text + "\"; expected a number");
  }
  return std::stoi(text);
}

}  // namespace

bool is_valid_job_id(const std::string& id) {
  static const std::regex pattern(R"([0-9]{1,12}(_[0-9]{1,9})?)");
  return std::regex_match(id, pattern);
}

std::vector<int> parse_tasks_per_node(const std::string& text) {
  static const std::regex item(R"(([0-9]{1,6})(\(x([0-9]{1,6})\))?)");
  std::vector<int> out;
  std::stringstream in(text);
  for (std::string part; std::getline(in, part, ',');) {
    std::smatch m;
    if (!std::regex_match(part, m, item)) {
      throw SchedulerError("SLURM_TASKS_PER_NODE is \"" + text + "\"; expected counts like 2(x3),1");
    }
    const int tasks = std::stoi(m[1]);
    const int repeat = m[3].matched ? std::stoi(m[3]) : 1;
    if (tasks == 0 || repeat == 0 || out.size() + static_cast<std::size_t>(repeat) > 100000) {
      throw SchedulerError("SLURM_TASKS_PER_NODE is \"" + text + "\"; expected counts like 2(x3),1");
    }
    out.insert(out.end(), static_cast<std::size_t>(repeat), tasks);
  }
  if (out.empty()) throw SchedulerError("SLURM_TASKS_PER_NODE is empty");
  return out;
}

std::optional<std::chrono::system_clock::time_point> parse_end_time(const std::string& text) {
  const std::string t = core::trim(text);
  if (t.empty() || t == "N/A" || t == "Unknown" || t == "NONE" || t == "None") return std::nullopt;
  std::tm tm{};
  const char* end = ::strptime(t.c_str(), "%Y-%m-%dT%H:%M:%S", &tm);
  if (end == nullptr || *end != '\0') throw SchedulerError("squeue printed the end time \"" + t + "\"; expected 2026-11-21T05:00:00");
  tm.tm_isdst = -1;
  const std::time_t when = std::mktime(&tm);
  if (when == static_cast<std::time_t>(-1)) throw SchedulerError("squeue printed an end time out of range: \"" + t + "\"");
  return std::chrono::system_clock::from_time_t(when);
}

std::optional<core::Allocation> job_allocation(const core::EnvSource& env, const core::CommandRunner& run) {
  const auto job_id = env.get("SLURM_JOB_ID");
  if (!job_id) return std::nullopt;
  if (!is_valid_job_id(*job_id)) throw SchedulerError("SLURM_JOB_ID is \"" + *job_id + "\", which is not a Slurm job id");
  core::Allocation a;
  a.scheduler = "slurm";
  a.job_id = *job_id;
  // A task of a job array is named ARRAY_TASK: the last task to start has the array's own id as
  // SLURM_JOB_ID, and `scontrol requeue` or `squeue --jobs` of that id mean every task.
  const auto array_job = env.get("SLURM_ARRAY_JOB_ID"), array_task = env.get("SLURM_ARRAY_TASK_ID");
  if (array_job && array_task) {
    a.job_id = *array_job + "_" + *array_task;
    if (!is_valid_job_id(a.job_id)) {
      throw SchedulerError("SLURM_ARRAY_JOB_ID and SLURM_ARRAY_TASK_ID make \"" + a.job_id +
                           "\", which is not a Slurm job id");
    }
  }
  if (const auto count = env.get("SLURM_RESTART_COUNT")) a.restart_count = parse_count(*count, "SLURM_RESTART_COUNT");

  const auto nodelist = env.get("SLURM_JOB_NODELIST");
  if (!nodelist || nodelist->empty()) throw SchedulerError("SLURM_JOB_NODELIST is not set in Slurm job " + a.job_id);
  if (nodelist->size() > 65536 ||
      nodelist->find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789,.[]_-") !=
          std::string::npos) {
    throw SchedulerError("SLURM_JOB_NODELIST is \"" + *nodelist + "\", which is not a Slurm node list");
  }
  const core::RunResult hostnames = run({"scontrol", "show", "hostnames", *nodelist}, {});
  if (!hostnames.ok()) throw SchedulerError("cannot expand the node list of job " + a.job_id + ": " + hostnames.describe());
  std::stringstream lines(hostnames.out);
  for (std::string line; std::getline(lines, line);) {
    line = core::trim(line);
    if (line.empty()) continue;
    if (!core::is_valid_host_name(line)) throw SchedulerError("scontrol printed the host name \"" + line + "\", which is not valid");
    a.hosts.push_back({line, 1});
  }
  if (a.hosts.empty()) throw SchedulerError("scontrol show hostnames " + *nodelist + " printed no host");
  if (const auto tasks = env.get("SLURM_TASKS_PER_NODE")) {
    const auto counts = parse_tasks_per_node(*tasks);
    if (counts.size() != a.hosts.size()) {
      throw SchedulerError("SLURM_TASKS_PER_NODE (\"" + *tasks + "\") names " + std::to_string(counts.size()) +
                           " nodes but the job has " + std::to_string(a.hosts.size()));
    }
    for (std::size_t i = 0; i < counts.size(); ++i) a.hosts[i].slots = counts[i];
  }
  const core::RunResult end = run({"squeue", "--noheader", "--jobs", a.job_id, "--format", "%e"}, {});
  if (end.ok()) a.end_time = parse_end_time(end.out);
  return a;
}

}  // namespace hpctrial::slurm
