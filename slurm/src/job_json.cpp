// `squeue --json`: Slurm's OpenAPI job records read into JobInfo, with the fields `scontrol show
// job` computes (RunTime, ExitCode "3:0", the output file's name) computed the same way.
#include <nlohmann/json.hpp>

#include <sys/wait.h>

#include <cstdint>
#include <cstdio>
#include <ctime>
#include <optional>

#include "hpctrial/core/error.h"
#include "hpctrial/slurm/client.h"

namespace hpctrial::slurm {
namespace {

using nlohmann::json;

// A number as 22.05 writes it (42, or null: not set), or as later versions do:
// {"set": true, "infinite": false, "number": 42}.
std::optional<std::int64_t> number(const json& record, const char* key) {
  const auto it = record.find(key);
  if (it == record.end() || it->is_null()) return std::nullopt;
  const json* value = &*it;
  if (value->is_object()) {
    if (!value->value("set", true) || value->value("infinite", false)) return std::nullopt;
    const auto n = value->find("number");
    if (n == value->end()) return std::nullopt;
    value = &*n;
  }
  if (value->is_number_integer()) return value->get<std::int64_t>();
  if (value->is_number_float()) return static_cast<std::int64_t>(value->get<double>());
  return std::nullopt;
}

std::string text(const json& record, const char* key) {
  const auto it = record.find(key);
  return it != record.end() && it->is_string() ? it->get<std::string>() : std::string();
}

std::string number_text(const json& record, const char* key, const std::string& unset = "") {
  const auto n = number(record, key);
  return n ? std::to_string(*n) : unset;
}

// job_state: "RUNNING" (22.05), or a list of the base state and its flags (later). As a word,
// the flag that `scontrol show job` would print before the base state (job_state_string's order).
std::string state_word(const json& record) {
  const auto it = record.find("job_state");
  if (it == record.end()) return "";
  if (it->is_string()) return it->get<std::string>();
  if (!it->is_array() || it->empty()) return "";
  for (const char* flag : {"COMPLETING", "STAGE_OUT", "CONFIGURING", "RESIZING", "REQUEUED", "REQUEUE_FED",
                           "REQUEUE_HOLD", "SPECIAL_EXIT", "STOPPED", "REVOKED", "RESV_DEL_HOLD", "SIGNALING"}) {
    for (const json& word : *it) {
      if (word.is_string() && word.get<std::string>() == flag) return flag;
    }
  }
  return it->front().is_string() ? it->front().get<std::string>() : "";
}

// "3:0": the batch script's exit status and the signal that ended it, from a wait status (22.05)
// or from {"return_code": ..., "signal": {"id": ...}} (later).
std::string exit_text(const json& record) {
  const auto it = record.find("exit_code");
  if (it == record.end() || it->is_null()) return "0:0";
  if (it->is_object()) {
    const auto signal = it->find("signal");
    std::int64_t sig = 0;
    if (signal != it->end() && signal->is_object()) sig = number(*signal, "id").value_or(0);
    return std::to_string(number(*it, "return_code").value_or(0)) + ":" + std::to_string(sig);
  }
  const int status = static_cast<int>(number(record, "exit_code").value_or(0));
  if (WIFSIGNALED(status)) return "0:" + std::to_string(WTERMSIG(status));
  return std::to_string(WIFEXITED(status) ? WEXITSTATUS(status) : 0) + ":0";
}

// Seconds as Slurm writes a duration: "00:01:23", "1-02:03:04".
std::string duration_text(std::int64_t seconds) {
  if (seconds < 0) seconds = 0;
  char out[48];
  const long long days = seconds / 86400, hours = seconds / 3600 % 24, minutes = seconds / 60 % 60, secs = seconds % 60;
  if (days > 0) {
    std::snprintf(out, sizeof out, "%lld-%02lld:%02lld:%02lld", days, hours, minutes, secs);
  } else {
    std::snprintf(out, sizeof out, "%02lld:%02lld:%02lld", hours, minutes, secs);
  }
  return out;
}

// RunTime as `scontrol show job` computes it: nothing while pending, the time before a
// suspension while suspended, else from the start to the end (now while it runs).
std::string run_time(const json& record, const std::string& state, std::time_t now) {
  const std::int64_t start = number(record, "start_time").value_or(0);
  const std::int64_t before_suspension = number(record, "pre_sus_time").value_or(0);
  if (state == "PENDING" || state == "REQUEUE_HOLD" || state == "REQUEUED" || start == 0) return duration_text(0);
  if (state == "SUSPENDED") return duration_text(before_suspension);
  const bool runs = state == "RUNNING" || state == "COMPLETING" || state == "CONFIGURING" || state == "SIGNALING";
  std::int64_t end = number(record, "end_time").value_or(0);
  if (runs || end == 0) end = now;
  const std::int64_t suspended = number(record, "suspend_time").value_or(0);
  return duration_text(suspended > 0 ? before_suspension + (end - suspended) : end - start);
}

// An epoch time as `scontrol show job` prints it (local time), "Unknown" when not set.
std::string time_text(const json& record, const char* key) {
  const std::int64_t when = number(record, key).value_or(0);
  if (when <= 0) return "Unknown";
  const std::time_t t = static_cast<std::time_t>(when);
  std::tm local{};
  ::localtime_r(&t, &local);
  char out[32];
  std::strftime(out, sizeof out, "%Y-%m-%dT%H:%M:%S", &local);
  return out;
}

JobInfo job_of(const json& record, std::time_t now) {
  JobInfo j;
  j.id = number_text(record, "job_id");
  j.name = text(record, "name");
  j.state = state_word(record);
  j.reason = text(record, "state_reason");
  j.restarts = static_cast<int>(number(record, "restart_cnt").value_or(0));
  j.run_time = run_time(record, j.state, now);
  j.exit_code = exit_text(record);
  j.submit_time = time_text(record, "submit_time");
  j.start_time = time_text(record, "start_time");
  j.node_list = text(record, "nodes");
  j.batch_host = text(record, "batch_host");
  j.partition = text(record, "partition");
  j.excluded_nodes = text(record, "excluded_nodes");
  j.work_dir = text(record, "current_working_directory");
  j.user_id = number_text(record, "user_id");
  j.user_name = text(record, "user_name");
  j.priority = number_text(record, "priority");
  j.nice = number_text(record, "nice", "0");
  j.num_tasks = static_cast<int>(number(record, "tasks").value_or(0));
  if (number(record, "array_job_id").value_or(0) > 0) {
    j.array_job_id = number_text(record, "array_job_id");
    j.array_task = number_text(record, "array_task_id");
    if (j.array_task.empty()) j.array_task = text(record, "array_task_string");  // tasks not started yet
  }
  j.std_out = expand_output_pattern(text(record, "standard_output"), j);
  j.std_err = expand_output_pattern(text(record, "standard_error"), j);
  if (j.std_err.empty()) j.std_err = j.std_out;  // as `scontrol show job` shows it: both in one file
  return j;
}

}  // namespace

std::string expand_output_pattern(const std::string& pattern, const JobInfo& job) {
  // What slurmd names the file (fname_create): an array's tasks not started yet have no task id,
  // which Slurm writes as NO_VAL; %N is the batch host, unknown until the job starts.
  const bool one_task = !job.array_task.empty() && job.array_task.find_first_not_of("0123456789") == std::string::npos;
  const std::string task = job.array_job_id.empty() || !one_task ? "4294967294" : job.array_task;
  std::string out;
  for (std::size_t i = 0; i < pattern.size(); ++i) {
    if (pattern[i] != '%' || i + 1 == pattern.size()) {
      out += pattern[i];
      continue;
    }
    std::size_t k = i + 1;
    while (k < pattern.size() && pattern[k] >= '0' && pattern[k] <= '9') ++k;
    if (k == pattern.size()) {
      out += pattern.substr(i);
      break;
    }
    const int width = k > i + 1 ? std::stoi(pattern.substr(i + 1, k - i - 1)) : 0;
    const auto padded = [&](std::string value) {
      return value.size() < static_cast<std::size_t>(width) ? std::string(width - value.size(), '0') + value : value;
    };
    std::string value;
    bool known = true;
    switch (pattern[k]) {
      case '%': value = "%"; break;
      case 'A': value = padded(job.array_job_id.empty() ? job.id : job.array_job_id); break;
      case 'a': value = padded(task); break;
      case 'J': case 'j': value = padded(job.id); break;
      case 'N': value = job.batch_host; known = !value.empty(); break;
      case 'n': case 't': value = padded("0"); break;
      case 's': value = "batch"; break;
      case 'u': value = job.user_name; known = !value.empty(); break;
      case 'x': value = job.name; break;
      default: known = false;
    }
    out += known ? value : pattern.substr(i, k - i + 1);
    i = k;
  }
  return out;
}

std::vector<JobInfo> parse_jobs_json(const std::string& text, const std::string& command, std::time_t now) {
  json document;
  try {
    document = json::parse(text);
  } catch (const json::exception& e) {
    throw SchedulerError("cannot read `" + command + "`: not JSON (" + e.what() + ")");
  }
  const auto jobs = document.is_object() ? document.find("jobs") : document.end();
  if (!document.is_object() || jobs == document.end() || !jobs->is_array()) {
    throw SchedulerError("cannot read `" + command + "`: no \"jobs\" list in what it printed");
  }
  std::vector<JobInfo> out;
  for (const json& record : *jobs) {
    if (!record.is_object()) throw SchedulerError("cannot read `" + command + "`: a job that is not a JSON object");
    JobInfo j = job_of(record, now);
    if (j.id.empty()) throw SchedulerError("cannot read `" + command + "`: a job without a job_id");
    out.push_back(std::move(j));
  }
  return out;
}

}  // namespace hpctrial::slurm
