#include "hpctrial/pbs/job_environment.h"

#include <ctime>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>

#include "hpctrial/core/batch_job.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/text.h"

namespace hpctrial::pbs {
namespace {

constexpr std::size_t kMaxNodeFileBytes = 64u << 20;
constexpr int kDefaultKillDelay = 10;  // PBS's, where the queue sets no kill_delay

std::map<std::string, std::string> qstat_fields(const std::string& qstat_output) {
  std::map<std::string, std::string> fields;
  std::stringstream in(qstat_output);
  for (std::string line; std::getline(in, line);) {
    const auto eq = line.find(" = ");
    if (eq == std::string::npos) continue;
    fields[core::trim(line.substr(0, eq))] = core::trim(line.substr(eq + 3));
  }
  return fields;
}

}  // namespace

bool is_valid_job_id(const std::string& id) {
  static const std::regex pattern(R"([0-9]{1,12}(\[[0-9]{0,9}\])?(\.[A-Za-z0-9._-]{1,253})?)");
  return std::regex_match(id, pattern);
}

std::vector<core::Host> parse_node_file(const std::string& text, const std::string& path) {
  std::vector<core::Host> hosts;
  std::map<std::string, std::size_t> index;
  std::stringstream in(text);
  int number = 0;
  for (std::string line; std::getline(in, line);) {
    ++number;
    line = core::trim(line);
    if (line.empty()) continue;
    if (!core::is_valid_host_name(line)) {
      throw SchedulerError(path + ":" + std::to_string(number) + ": \"" + line + "\" is not a host name");
    }
    const auto [it, added] = index.emplace(line, hosts.size());
    if (added) {
      hosts.push_back({line, 1});
    } else {
      ++hosts[it->second].slots;
    }
  }
  if (hosts.empty()) throw SchedulerError(path + " (PBS_NODEFILE) names no host");
  return hosts;
}

void apply_qstat(const std::string& qstat_output, core::Allocation& a) {
  const std::map<std::string, std::string> fields = qstat_fields(qstat_output);
  if (const auto it = fields.find("run_count"); it != fields.end()) {
    if (it->second.empty() || it->second.size() > 6 || it->second.find_first_not_of("0123456789") != std::string::npos) {
      throw SchedulerError("qstat -f " + a.job_id + " printed run_count = " + it->second + "; expected a number");
    }
    a.restart_count = std::max(0, std::stoi(it->second) - 1);
  }
  const auto stime = fields.find("stime");
  const auto walltime = fields.find("Resource_List.walltime");
  if (stime == fields.end() || walltime == fields.end()) return;
  std::tm tm{};
  const char* end = ::strptime(stime->second.c_str(), "%a %b %d %H:%M:%S %Y", &tm);
  if (end == nullptr || *end != '\0') {
    throw SchedulerError("qstat -f " + a.job_id + " printed stime = " + stime->second + "; expected e.g. Sat Nov 21 04:00:00 2026");
  }
  tm.tm_isdst = -1;
  static const std::regex hms(R"(([0-9]{1,6}):([0-5][0-9]):([0-5][0-9]))");
  std::smatch m;
  if (!std::regex_match(walltime->second, m, hms)) {
    throw SchedulerError("qstat -f " + a.job_id + " printed Resource_List.walltime = " + walltime->second +
                         "; expected HH:MM:SS");
  }
  const long seconds = std::stol(m[1]) * 3600 + std::stol(m[2]) * 60 + std::stol(m[3]);
  a.end_time = std::chrono::system_clock::from_time_t(std::mktime(&tm)) + std::chrono::seconds(seconds);
}

void apply_queue(const std::string& qstat_output, core::Allocation& a) {
  a.kill_delay_seconds = kDefaultKillDelay;
  const auto fields = qstat_fields(qstat_output);
  const auto it = fields.find("kill_delay");
  if (it == fields.end()) return;
  if (it->second.empty() || it->second.size() > 7 || it->second.find_first_not_of("0123456789") != std::string::npos) {
    throw SchedulerError("qstat -Qf printed kill_delay = " + it->second + " for the queue of PBS job " + a.job_id +
                         "; expected seconds");
  }
  a.kill_delay_seconds = std::stoi(it->second);
}

std::optional<core::Allocation> job_allocation(const core::EnvSource& env, const core::CommandRunner& run) {
  const auto job_id = env.get("PBS_JOBID");
  if (!job_id) return std::nullopt;
  if (!is_valid_job_id(*job_id)) throw SchedulerError("PBS_JOBID is \"" + *job_id + "\", which is not a PBS job id");
  core::Allocation a;
  a.scheduler = "pbs";
  a.job_id = *job_id;
  const auto node_file = env.get("PBS_NODEFILE");
  if (!node_file || node_file->empty()) throw SchedulerError("PBS_NODEFILE is not set in PBS job " + a.job_id);
  std::ifstream in(*node_file, std::ios::binary);
  if (!in) throw SchedulerError("cannot read PBS_NODEFILE " + *node_file);
  std::string text;
  text.resize(kMaxNodeFileBytes + 1);
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<std::size_t>(in.gcount()));
  if (text.size() > kMaxNodeFileBytes) throw SchedulerError("PBS_NODEFILE " + *node_file + " is larger than 64 MiB");
  a.hosts = parse_node_file(text, *node_file);
  const core::RunResult qstat = run({"qstat", "-f", a.job_id}, {});
  if (qstat.ok()) apply_qstat(qstat.out, a);
  // The time between PBS's SIGTERM (a qdel, the walltime) and its SIGKILL.
  if (const auto queue = env.get("PBS_QUEUE"); queue && core::is_plain_word(*queue) && (*queue)[0] != '-') {
    const core::RunResult q = run({"qstat", "-Qf", *queue}, {});
    if (q.ok()) apply_queue(q.out, a);
  }
  return a;
}

}  // namespace hpctrial::pbs
