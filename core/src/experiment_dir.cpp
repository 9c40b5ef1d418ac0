#include "hpctrial/core/experiment_dir.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "hpctrial/core/error.h"
#include "hpctrial/core/files.h"
#include "hpctrial/core/json_file.h"
#include "hpctrial/core/launch_contract.h"
#include "hpctrial/core/text.h"

namespace hpctrial::core {
namespace fs = std::filesystem;
using json = nlohmann::json;

json read_json_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) return json::object();
  try {
    json j = json::parse(in);
    return j.is_object() ? j : json::object();
  } catch (const json::exception& e) {
    throw IoError(path + " is not valid JSON (" + e.what() + "); remove it or restore it from a backup");
  }
}

void write_json_file(const std::string& path, const json& value) {
  write_file_atomic(path, value.dump(2, ' ', false, json::error_handler_t::replace) + "\n");
}

std::string default_experiment_dir(const std::string& name) { return (fs::path("runs") / name).string(); }

std::string experiment_of_output(const std::string& output_file) {
  if (output_file.empty()) return "";
  const fs::path dir = fs::path(output_file).parent_path();
  const ExperimentLayout layout{dir.string()};
  return fs::exists(layout.state()) && fs::exists(layout.config()) ? layout.dir : "";
}

std::string checkpoint_dir(const ExperimentConfig& config, const std::string& trial_dir, int trial_id) {
  if (config.checkpoint_storage.host_path.empty()) return (fs::path(trial_dir) / "checkpoints").string();
  fs::path base(config.checkpoint_storage.host_path);
  if (base.is_relative() && !config.source_path.empty()) base = fs::path(config.source_path).parent_path() / base;
  return (base / ("trial-" + std::to_string(trial_id))).string();
}

std::vector<RecordedJob> recorded_jobs(const ExperimentLayout& layout) {
  const json state = read_json_file(layout.state());
  std::vector<RecordedJob> jobs;
  if (!state.contains("jobs") || !state["jobs"].is_array()) return jobs;
  for (const auto& j : state["jobs"]) {
    if (!j.is_object()) continue;
    jobs.push_back({j.value("id", std::string()), j.value("scheduler", std::string()),
                    j.value("submitted", std::string()), j.value("trial", -1)});
  }
  return jobs;
}

std::optional<RecordedJob> latest_job(const ExperimentLayout& layout) {
  const json state = read_json_file(layout.state());
  const std::string id = state.value("job_id", std::string());
  if (id.empty()) return std::nullopt;
  RecordedJob job{id, state.value("scheduler", std::string()), ""};
  for (const auto& recorded : recorded_jobs(layout)) {
    if (recorded.id == id) job.submitted = recorded.submitted;
  }
  return job;
}

void record_job(const ExperimentLayout& layout, const std::string& scheduler, const std::string& id, int trial) {
  // The subjobs of an array job may each record their successor at the same moment.
  const UniqueFd lock(::open((layout.dir + "/.experiment.lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
  if (lock.get() >= 0) ::flock(lock.get(), LOCK_EX);  // released when closed
  json state = read_json_file(layout.state());
  state["scheduler"] = scheduler;
  state["job_id"] = id;
  if (!state["jobs"].is_array()) state["jobs"] = json::array();
  json record = {{"id", id}, {"scheduler", scheduler}, {"submitted", utc_now_iso()}};
  if (trial >= 0) record["trial"] = trial;
  state["jobs"].push_back(record);
  write_json_file(layout.state(), state);
}

TrialProgress trial_progress(const ExperimentLayout& layout, int trial_id) {
  const std::string trial_dir = layout.trial_dir(trial_id);
  TrialProgress p;
  for (const auto& [rank, record] : read_heartbeats(heartbeat_dir(trial_dir))) {
    if (rank == 0) p.reported_step = record.step;
  }
  const json state = read_json_file(launcher_state_file(trial_dir));
  p.starts = state.value("starts", 0);
  p.failures = state.value("failures", 0);
  std::ifstream records(trial_dir + "/failures.jsonl");
  for (std::string line; std::getline(records, line);) {
    try {
      p.last_failure = json::parse(line).value("reason", std::string());
    } catch (const json::exception&) {
      // a record cut short by a crash: the one before stands
    }
  }
  std::ifstream runs(runs_file(trial_dir));
  for (std::string line; std::getline(runs, line);) {
    try {
      const json j = json::parse(line);
      p.runs.push_back({j.value("started", std::string()), j.value("ranks", 0), j.value("batch", std::int64_t{0}),
                        j.value("local_batch", std::int64_t{0}), j.value("accumulation", std::int64_t{1}),
                        j.value("batches", std::int64_t{0})});
    } catch (const json::exception&) {
      // a line cut short by a crash
    }
  }
  return p;
}

std::optional<int> preferred_slots(const std::string& trial_dir, const Resources& resources) {
  if (!resources.elastic()) return std::nullopt;
  json state;
  try {
    state = read_json_file(elastic_file(trial_dir));
  } catch (const IoError&) {
    return std::nullopt;  // cut short by a crash: the run asks for what the config says
  }
  const auto it = state.find("preferred_slots");
  if (it == state.end() || !it->is_number_integer()) return std::nullopt;
  const int per_node = resources.slots_per_node;
  const int slots = std::clamp(it->get<int>(), resources.min_slots(), resources.slots_per_trial);
  return std::max(resources.min_slots(), slots / per_node * per_node);
}

void request_stop(const ExperimentLayout& layout, int trial_id, const std::string& reason, const std::string& job) {
  request_stop(layout.trial_dir(trial_id), reason, job);
}

void request_stop(const std::string& trial_dir, const std::string& reason, const std::string& job) {
  json request{{"reason", reason}, {"time", utc_now_iso()}};
  if (!job.empty()) request["job"] = job;
  write_file_atomic(stop_file(trial_dir), request.dump() + "\n");
}

std::string stop_reason(const std::string& trial_dir) {
  std::ifstream in(stop_file(trial_dir));
  if (!in) return "";
  try {
    const json j = json::parse(in);
    return j.is_object() ? j.value("reason", std::string("requested")) : std::string("requested");
  } catch (const json::exception&) {
    return "requested";  // a stop request all the same
  }
}

bool stop_requested_for(const std::string& trial_dir, const std::string& job) {
  if (job.empty()) return false;
  std::ifstream in(stop_file(trial_dir));
  if (!in) return false;
  try {
    const json j = json::parse(in);
    return j.is_object() && j.value("job", std::string()) == job;
  } catch (const json::exception&) {
    return false;
  }
}

}  // namespace hpctrial::core
