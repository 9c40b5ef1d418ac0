#include "hpctrial/pbs/client.h"

#include <pwd.h>
#include <cstdlib>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <ctime>
#include <functional>
#include <map>
#include <sstream>

#include "hpctrial/core/error.h"
#include "hpctrial/core/text.h"
#include "hpctrial/pbs/job_environment.h"

namespace hpctrial::pbs {
namespace {

using json = nlohmann::json;

std::string command_line(const std::vector<std::string>& argv) {
  std::string line;
  for (const auto& word : argv) line += (line.empty() ? "" : " ") + word;
  return line;
}

// "host:/path" -> "/path"
std::string without_host(const std::string& path) {
  const std::size_t colon = path.find(':');
  return colon == std::string::npos ? path : path.substr(colon + 1);
}

std::optional<int> to_int(const std::string& text) {
  if (text.empty() || text.size() > 9 || text.find_first_not_of("-0123456789") != std::string::npos) return std::nullopt;
  try {
    return std::stoi(text);
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

// A value of the JSON, which PBS prints as a number or a string depending on the attribute.
std::string text_of(const json& value) {
  if (value.is_string()) return value.get<std::string>();
  if (value.is_number_integer()) return std::to_string(value.get<long long>());
  // A large count printed as a float (queue_rank: 1.79600756305727e+15), its last digit lost.
  if (value.is_number_float() && std::abs(value.get<double>()) < 9e15 &&
      value.get<double>() == std::floor(value.get<double>())) {
    return std::to_string(static_cast<long long>(value.get<double>()));
  }
  return value.dump();
}

JobInfo from_fields(const std::string& id, const std::function<std::optional<std::string>(const std::string&)>& field) {
  JobInfo j;
  j.id = id;
  j.name = field("Job_Name").value_or("");
  j.owner = field("Job_Owner").value_or("");
  j.state = field("job_state").value_or("");
  j.run_count = to_int(field("run_count").value_or("")).value_or(0);
  if (const auto status = field("Exit_status")) j.exit_status = to_int(*status);
  j.output_path = without_host(field("Output_Path").value_or(""));
  j.start_time = field("stime").value_or("");
  j.exec_host = field("exec_host").value_or("");
  j.priority = field("Priority").value_or("0");
  j.queue = field("queue").value_or("");
  j.mpiprocs = to_int(field("Resource_List.mpiprocs").value_or("")).value_or(0);
  return j;
}

// Every line qstat wrote to stderr names a job it does not know: the others were printed.
bool only_unknown_jobs(const core::RunResult& r) {
  std::istringstream lines(r.err);
  bool any = false;
  for (std::string line; std::getline(lines, line);) {
    if (core::trim(line).empty()) continue;
    if (line.find("Unknown Job Id") == std::string::npos && line.find("Unknown job id") == std::string::npos) return false;
    any = true;
  }
  return any;
}

}  // namespace

std::string user_name() {
  if (const passwd* pw = ::getpwuid(::getuid()); pw != nullptr && pw->pw_name != nullptr) return pw->pw_name;
  if (const char* user = std::getenv("USER"); user != nullptr && *user != '\0') return user;
  return std::to_string(::getuid());
}

bool JobInfo::active() const {
  return state == "Q" || state == "H" || state == "W" || state == "R" || state == "E" || state == "B" ||
         state == "S" || state == "U" || state == "T" || state == "M";
}

std::vector<JobInfo> parse_qstat_json(const std::string& text, const std::string& command) {
  json root;
  try {
    root = json::parse(text);
  } catch (const json::exception& e) {
    throw SchedulerError("cannot read the JSON of `" + command + "`: " + e.what());
  }
  std::vector<JobInfo> jobs;
  if (!root.is_object() || !root.contains("Jobs")) return jobs;  // no job matched
  const json& all = root["Jobs"];
  if (!all.is_object()) throw SchedulerError("`" + command + "` printed \"Jobs\" that is not an object");
  for (auto it = all.begin(); it != all.end(); ++it) {
    const json& fields = it.value();
    if (!fields.is_object()) throw SchedulerError("`" + command + "`: job " + it.key() + " is not an object");
    jobs.push_back(from_fields(it.key(), [&](const std::string& key) -> std::optional<std::string> {
      // "Resource_List.mpiprocs": a member of the object Resource_List in the JSON.
      const auto dot = key.find('.');
      const json* in = &fields;
      if (dot != std::string::npos) {
        const auto outer = fields.find(key.substr(0, dot));
        if (outer == fields.end() || !outer->is_object()) return std::nullopt;
        in = &*outer;
      }
      const auto f = in->find(dot == std::string::npos ? key : key.substr(dot + 1));
      if (f == in->end()) return std::nullopt;
      return text_of(*f);
    }));
  }
  return jobs;
}

std::vector<JobInfo> parse_qstat_text(const std::string& text, const std::string& command) {
  std::vector<JobInfo> jobs;
  std::string id;
  std::map<std::string, std::string> fields;
  std::string last_key;
  auto finish = [&] {
    if (id.empty()) return;
    jobs.push_back(from_fields(id, [&](const std::string& key) -> std::optional<std::string> {
      const auto f = fields.find(key);
      if (f == fields.end()) return std::nullopt;
      return f->second;
    }));
    fields.clear();
    last_key.clear();
  };
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("Job Id:", 0) == 0) {
      finish();
      id = core::trim(line.substr(7));
      continue;
    }
    if (!line.empty() && line[0] == '\t' && !last_key.empty()) {  // a long value, continued
      fields[last_key] += core::trim(line);
      continue;
    }
    const std::size_t eq = line.find(" = ");
    if (eq == std::string::npos || id.empty()) continue;
    last_key = core::trim(line.substr(0, eq));
    fields[last_key] = core::trim(line.substr(eq + 3));
  }
  finish();
  if (jobs.empty() && !core::trim(text).empty()) {
    throw SchedulerError("cannot read `" + command + "`: no \"Job Id:\" line in " + core::trim(text).substr(0, 200));
  }
  return jobs;
}

core::RunResult Client::checked(const std::vector<std::string>& argv, const core::RunOptions& options) const {
  core::RunResult r = run_(argv, options);
  if (!r.ok()) throw SchedulerError(r.describe());
  return r;
}

std::string Client::submit(const Submit& s) const {
  core::RunOptions options;
  options.env_set = s.env;
  std::vector<std::string> argv = {"qsub"};
  if (s.hold) argv.push_back("-h");
  if (!s.after.empty()) {
    if (!is_valid_job_id(s.after)) throw SchedulerError("\"" + s.after + "\" is not a PBS job id to depend on");
    argv.insert(argv.end(), {"-W", "depend=afterany:" + s.after});
  }
  if (!s.env.empty()) {
    std::string names;
    for (const auto& [name, value] : s.env) names += (names.empty() ? "" : ",") + name;
    argv.insert(argv.end(), {"-v", names});
  }
  argv.push_back(s.script);
  const core::RunResult r = checked(argv, options);
  const std::string id = core::trim(r.out);
  if (!is_valid_job_id(id)) throw SchedulerError("qsub answered \"" + id + "\", not a job id");
  return id;
}

void Client::hold(const std::string& job) const { checked({"qhold", job}); }

void Client::release(const std::string& job) const { checked({"qrls", job}); }

void Client::set_priority(const std::string& job, int priority) const {
  checked({"qalter", "-p", std::to_string(priority), job});
}

void Client::move(const std::string& job, const std::string& queue) const { checked({"qmove", queue, job}); }

void Client::swap_order(const std::string& a, const std::string& b) const { checked({"qorder", a, b}); }

bool Client::signal(const std::string& job, const std::string& signal) const {
  return run_({"qsig", "-s", signal, job}, {}).ok();
}

void Client::cancel(const std::string& job, std::optional<int> kill_delay_seconds) const {
  std::vector<std::string> argv = {"qdel"};
  if (kill_delay_seconds) argv.insert(argv.end(), {"-W", std::to_string(std::max(0, *kill_delay_seconds))});
  argv.push_back(job);
  checked(argv);
}

std::optional<std::vector<JobInfo>> Client::qstat(const std::vector<std::string>& args, bool as_json) const {
  std::vector<std::string> argv;
  std::string command;
  core::RunResult r;
  if (as_json) {
    argv = {"qstat", "-f", "-F", "json", "-x"};
    argv.insert(argv.end(), args.begin(), args.end());
    command = command_line(argv);
    r = run_(argv, {});
    if (r.ok()) return parse_qstat_json(r.out, command);
    if (only_unknown_jobs(r)) {
      auto known = parse_qstat_json(r.out.empty() ? "{}" : r.out, command);
      if (known.empty()) return std::nullopt;
      return known;
    }
  }
  // Several jobs, or a refusal of -F json: an older PBS without it, or a real failure, which the
  // text form then reports.
  argv = {"qstat", "-f", "-x"};
  argv.insert(argv.end(), args.begin(), args.end());
  command = command_line(argv);
  r = run_(argv, {});
  if (!r.ok()) {
    if (!only_unknown_jobs(r)) throw SchedulerError(r.describe());
    auto known = parse_qstat_text(r.out, command);
    if (known.empty()) return std::nullopt;
    return known;
  }
  return parse_qstat_text(r.out, command);
}

std::vector<JobInfo> Client::jobs(const std::vector<std::string>& ids) const {
  if (ids.empty()) return {};
  std::vector<std::string> args;
  if (std::any_of(ids.begin(), ids.end(), [](const std::string& id) { return id.find("[]") != std::string::npos; })) {
    args.push_back("-t");
  }
  if (ids.size() > kJobsByName) {
    // qstat asks for each job named on a connection of its own, each from a reserved port
    // (pbs_iff): a few hundred at once leave none ("all reserved ports in use") and stall it for
    // a minute. Every job, on one connection, then only those asked for.
    std::vector<JobInfo> wanted;
    for (JobInfo& job : qstat(args, false).value_or(std::vector<JobInfo>{})) {
      const std::size_t open = job.id.find('[');
      const std::string array = open == std::string::npos ? "" : job.id.substr(0, open + 1) + job.id.substr(job.id.find(']'));
      if (std::find(ids.begin(), ids.end(), job.id) != ids.end() ||
          (!array.empty() && std::find(ids.begin(), ids.end(), array) != ids.end())) {
        wanted.push_back(std::move(job));
      }
    }
    return wanted;
  }
  args.insert(args.end(), ids.begin(), ids.end());
  // As text: given several jobs, OpenPBS 23.06 prints only the first one as JSON.
  return qstat(args, false).value_or(std::vector<JobInfo>{});
}

std::optional<JobInfo> Client::job(const std::string& id) const {
  auto jobs = qstat({id});
  if (!jobs || jobs->empty()) return std::nullopt;
  return jobs->front();
}

std::vector<std::string> Client::queued_in_order(const std::string& user, const std::string& queue) const {
  std::vector<std::string> ids;
  std::istringstream lines(checked({"qselect", "-u", user, "-s", "Q", "-q", queue}).out);
  for (std::string line; std::getline(lines, line);) {
    line = core::trim(line);
    if (line.empty()) continue;
    if (!is_valid_job_id(line)) throw SchedulerError("qselect -u " + user + " printed \"" + line + "\", not a job id");
    ids.push_back(line);
  }
  return ids;
}

std::vector<JobInfo> Client::user_jobs(const std::string& user, std::time_t since) const {
  // qstat refuses -u beside -f ("conflicting options"): qselect names the jobs, and qstat
  // describes them. No user: every user's.
  std::vector<std::string> ids;
  const std::vector<std::string> whose = user.empty() ? std::vector<std::string>{} : std::vector<std::string>{"-u", user};
  const auto add = [&](const std::string& text) {
    std::istringstream lines(text);
    for (std::string line; std::getline(lines, line);) {
      line = core::trim(line);
      if (line.empty()) continue;
      if (!is_valid_job_id(line)) throw SchedulerError("qselect printed \"" + line + "\", not a job id");
      if (std::find(ids.begin(), ids.end(), line) == ids.end()) ids.push_back(line);
    }
  };
  std::vector<std::string> live{"qselect"};
  live.insert(live.end(), whose.begin(), whose.end());
  add(checked(live).out);
  std::tm local{};
  ::localtime_r(&since, &local);
  char when[32];
  std::strftime(when, sizeof when, "%Y%m%d%H%M", &local);
  // Ended ones too, where the server keeps job history (a server without fails this).
  std::vector<std::string> ended_argv{"qselect", "-x"};
  ended_argv.insert(ended_argv.end(), whose.begin(), whose.end());
  ended_argv.push_back(std::string("-tm.gt.") + when);
  const core::RunResult ended = run_(ended_argv, {});
  if (ended.ok()) add(ended.out);
  std::vector<JobInfo> listed;
  for (JobInfo& job : jobs(ids)) {
    if (user.empty() || job.owner.substr(0, job.owner.find('@')) == user) listed.push_back(std::move(job));
  }
  return listed;
}

}  // namespace hpctrial::pbs
