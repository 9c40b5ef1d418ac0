#include "hpctrial/core/experiment_dir.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cctype>
#include <cstdio>
#include <random>
#include <filesystem>
#include <fstream>

#include "hpctrial/core/config_compare.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/files.h"
#include "hpctrial/core/frozen_code.h"
#include "hpctrial/core/json_file.h"
#include "hpctrial/core/launch_contract.h"
#include "hpctrial/core/logging.h"
#include "hpctrial/core/paths.h"
#include "hpctrial/core/text.h"
#include "launcher_state.h"

namespace hpctrial::core {
namespace fs = std::filesystem;
using json = nlohmann::json;

std::string experiment_of_output(const std::string& output_file) {
  if (output_file.empty()) return "";
  const fs::path dir = fs::path(output_file).parent_path();
  const ExperimentLayout layout{dir.string()};
  std::error_code ec;  // another user's private directory: not one this user can read
  return fs::exists(layout.state(), ec) && fs::exists(layout.config(), ec) ? layout.dir : "";
}

bool output_in_experiment(const std::string& output_file, const std::string& experiment_dir) {
  if (output_file.empty() || experiment_dir.empty()) return false;
  const std::string dir = fs::path(output_file).parent_path().string();
  struct stat a {}, b {};
  return ::stat(dir.c_str(), &a) == 0 && ::stat(experiment_dir.c_str(), &b) == 0 && a.st_dev == b.st_dev &&
         a.st_ino == b.st_ino;
}

UniqueFd lock_experiment(const ExperimentLayout& layout) {
  const std::string path = layout.lock_file();
  UniqueFd lock(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
  if (lock.get() < 0) throw_errno("cannot open " + path, errno);
  lock_file_exclusive(lock.get(), path);
  return lock;
}

namespace {

std::optional<ExperimentIdentity> identity_in(const json& state, const std::string& path) {
  const std::string id = json_field(state, "experiment_id", std::string(), path);
  if (id.empty()) return std::nullopt;
  return ExperimentIdentity{id, json_field(state, "experiment_name", std::string(), path),
                            json_field(state, "host_folder", std::string(), path)};
}

void record_identity(json& state, const ExperimentIdentity& identity) {
  state["experiment_id"] = identity.id;
  state["experiment_name"] = identity.name;
  state["host_folder"] = identity.host_folder;
}

std::string repair_command(const ExperimentLayout& layout) {
  return "hpctrial experiment repair " + layout.dir;
}

// experiment.json, read strictly: {} where there is none; a file that is no JSON object names
// the command that rebuilds it.
json read_state(const ExperimentLayout& layout) {
  try {
    return read_json_file(layout.state());
  } catch (const IoError& e) {
    throw IoError(std::string(e.what()) + ". It is the record of the experiment's identity: rebuild it from the "
                  "experiment's checkpoints with `" + repair_command(layout) + "`");
  }
}

std::string new_experiment_id() {
  std::random_device random;
  char text[17];
  std::snprintf(text, sizeof text, "%08x%08x", random(), random());
  return text;
}

// The name as one path component (names are checked so since identities exist; older ones
// may hold anything).
std::string folder_name(std::string name) {
  for (char& c : name) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-' || c == '+')) c = '_';
  }
  if (name.empty() || name.front() == '.') name.insert(0, "x");
  return name;
}

// What shows that an experiment has begun, for messages: "trial-0 has run", "its search has a log".
std::string evidence_of_start(const ExperimentLayout& layout) {
  std::error_code ec;
  if (fs::exists(layout.search_log(), ec)) return "its search has a log, " + layout.search_log();
  for (const auto& entry : fs::directory_iterator(layout.dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (!TrialLayout::trial_of(name) || !entry.is_directory(ec)) continue;
    const TrialLayout trial{entry.path().string()};
    for (const std::string& file : {trial.launcher_state_file(), trial.runs_file(), trial.default_checkpoint_dir()}) {
      if (fs::exists(file, ec)) return name + " has run (" + file + ")";
    }
  }
  return "";
}

// The experiment's identity, from its record; IoError when the experiment has begun without one.
std::optional<ExperimentIdentity> recorded_identity(const ExperimentLayout& layout, const json& state) {
  if (auto known = identity_in(state, layout.state())) return known;
  const std::string started = evidence_of_start(layout);
  if (started.empty()) return std::nullopt;
  std::error_code ec;
  throw IoError(layout.state() + (fs::exists(layout.state(), ec) ? " records no experiment id" : " is missing") +
                ", but " + layout.dir + " holds an experiment that has begun: " + started +
                ". hpctrial never starts an experiment again over its own trials. Rebuild the record from the "
                "experiment's checkpoints with `" + repair_command(layout) + "`, or give another directory "
                "(--experiment DIR) to start a new experiment");
}

// How `given` differs from the experiment's config in what it trains: one line a key.
std::string definition_changes(const std::vector<ConfigDifference>& differences, const ExperimentConfig& recorded) {
  std::string out;
  for (const auto& d : differences) {
    if (!is_run_setting(d.key, recorded)) out += "\n  " + d.key + ": " + d.recorded + " -> " + d.given;
  }
  return out;
}

// The recorded config, or nullopt where none is; checks the one given against it once the
// experiment has begun (a trial launched, a search decided, a batch job submitted): until then a
// config that could not start (a mistyped entrypoint) may be corrected.
std::optional<ExperimentConfig> compare_with_recorded(const ExperimentLayout& layout, const ExperimentConfig& given,
                                                      const std::optional<ExperimentIdentity>& identity,
                                                      const json& state) {
  std::error_code ec;
  const bool begun = !evidence_of_start(layout).empty() ||
                     !json_field(state, "job_id", std::string(), layout.state()).empty();
  if (!fs::exists(layout.config(), ec)) {
    if (identity && begun) {
      throw IoError(layout.config() + " is missing: the config of experiment " + identity->name + " (" +
                    identity->id + ") is lost, and no other config is taken for it. Restore the file from a "
                    "backup, or give another directory (--experiment DIR) to start a new experiment");
    }
    return std::nullopt;
  }
  ExperimentConfig recorded = load_experiment_config({layout.config(), "", {}});
  if (!begun) return recorded;
  const std::string changes = definition_changes(config_differences(code_as_given(layout, recorded, given), given), recorded);
  if (!changes.empty()) {
    const std::string who = identity ? "experiment " + identity->name + " (" + identity->id + ")" : "the experiment";
    throw ConfigError(layout.config() + " is the config of " + who + ", made in " + layout.dir +
                      "; the config given differs from it in what the experiment trains:" + changes +
                      "\nAn experiment's config is fixed when it is made: undo the change to run this experiment, "
                      "or run the config as a new experiment, in another directory (--experiment DIR) or under "
                      "another name");
  }
  return recorded;
}

}  // namespace

std::optional<ExperimentIdentity> experiment_identity(const ExperimentLayout& layout) {
  return recorded_identity(layout, read_state(layout));
}

ExperimentIdentity require_experiment_identity(const ExperimentLayout& layout) {
  if (auto identity = experiment_identity(layout)) return *identity;
  throw IoError(layout.state() + " is missing, and the experiment in " + layout.dir + " has no identity: a run "
                "without one would write checkpoints no experiment owns. Make the experiment with `hpctrial run` "
                "or `hpctrial submit`, or rebuild the record with `" + repair_command(layout) + "`");
}

ExperimentIdentity ensure_experiment_identity(const ExperimentLayout& layout, const std::string& name) {
  create_directories(layout.dir);
  const UniqueFd lock = lock_experiment(layout);
  json state = read_state(layout);
  if (auto known = recorded_identity(layout, state)) return *known;
  const std::string id = new_experiment_id();
  const ExperimentIdentity identity{id, name, experiment_folder(name, id)};
  record_identity(state, identity);
  write_json_file(layout.state(), state);
  return identity;
}

std::string experiment_folder(const std::string& name, const std::string& id) { return folder_name(name) + "-" + id; }

ExperimentIdentity restore_experiment_identity(const ExperimentLayout& layout, const ExperimentIdentity& identity) {
  const UniqueFd lock = lock_experiment(layout);
  json state = json::object();
  try {
    state = read_json_file(layout.state());
  } catch (const IoError& e) {
    log_warning("{}; it is written anew, with the identity only", e.what());
  }
  if (const auto known = identity_in(state, layout.state()); known && !known->host_folder.empty()) {
    if (known->id != identity.id) {
      throw IoError(layout.state() + " records experiment " + known->name + " (" + known->id + ") already, not " +
                    identity.name + " (" + identity.id + "); nothing to rebuild");
    }
    return *known;
  }
  record_identity(state, identity);
  write_json_file(layout.state(), state);
  return identity;
}

bool experiment_started(const ExperimentLayout& layout) { return !evidence_of_start(layout).empty(); }

void check_experiment_config(const ExperimentLayout& layout, const ExperimentConfig& config) {
  std::error_code ec;
  if (!fs::exists(layout.dir, ec)) return;
  const json state = read_state(layout);
  compare_with_recorded(layout, config, recorded_identity(layout, state), state);
}

ExperimentIdentity commit_experiment_config(const ExperimentLayout& layout, const ExperimentConfig& config,
                                            const std::string& workdir) {
  create_directories(layout.dir);
  const UniqueFd lock = lock_experiment(layout);
  json state = read_state(layout);
  std::optional<ExperimentIdentity> identity = recorded_identity(layout, state);
  const std::optional<ExperimentConfig> recorded = compare_with_recorded(layout, config, identity, state);
  if (!identity) {
    const std::string id = new_experiment_id();
    identity = ExperimentIdentity{id, config.name, experiment_folder(config.name, id)};
    record_identity(state, *identity);
  }
  if (identity->host_folder.empty() && !config.checkpoint_storage.host_path.empty()) {
    const std::string& host_path = config.checkpoint_storage.host_path;
    throw ConfigError("experiment " + identity->name + " (" + identity->id + ") in " + layout.dir +
                      " was made before experiments had a folder of their own in checkpoint_storage.host_path: its "
                      "checkpoints lie in " + host_path + "/" + TrialLayout::folder(0) + " and so on, shared with "
                      "every such experiment, and hpctrial writes no new checkpoint there. Move each of its trial "
                      "folders to " + host_path + "/" + experiment_folder(identity->name, identity->id) +
                      "/, then run `" + repair_command(layout) + "`");
  }
  const std::string text = to_yaml(config);
  if (!recorded || to_yaml(*recorded) != text) {
    if (recorded) {
      for (const auto& d : config_differences(*recorded, config)) {
        log_info("{}: {} is {} for this run (it was {})", layout.config(), d.key, d.given, d.recorded);
      }
    }
    write_file_atomic(layout.config(), text);
  }
  // The identity after the config: an experiment is made once both are there.
  state["workdir"] = workdir;
  write_json_file(layout.state(), state);
  return *identity;
}

std::string checkpoint_dir(const ExperimentConfig& config, const TrialLayout& trial, int trial_id,
                           const std::optional<ExperimentIdentity>& identity) {
  const std::string& host_path = config.checkpoint_storage.host_path;
  if (host_path.empty()) return trial.default_checkpoint_dir();
  // Loading made it absolute; only a config made in code still holds a relative one.
  fs::path base(host_path);
  if (base.is_relative()) base = resolve_user_path(host_path, fs::current_path(), "checkpoint_storage.host_path");
  if (!identity) base /= config.name;
  else if (!identity->host_folder.empty()) base /= identity->host_folder;
  return (base / TrialLayout::folder(trial_id)).string();
}

std::string trial_checkpoint_dir(const ExperimentLayout& layout, int trial_id) {
  if (!fs::exists(layout.config())) {
    throw ConfigError(layout.dir + " is not an experiment directory (no " + fs::path(layout.config()).filename().string() +
                      "); give the directory `hpctrial run` or `submit` made, or a checkpoint without source_trial_id");
  }
  const std::string dir = checkpoint_dir(load_experiment_config(ConfigSources{layout.config(), "", {}}),
                                         layout.trial(trial_id), trial_id, require_experiment_identity(layout));
  if (fs::is_directory(dir)) return dir;
  throw ConfigError(layout.dir + " has no checkpoints of trial " + std::to_string(trial_id) + " (no " + dir +
                    "); `hpctrial describe " + layout.dir + "` lists its trials");
}

std::vector<RecordedJob> recorded_jobs(const ExperimentLayout& layout) {
  const json state = read_state(layout);
  std::vector<RecordedJob> jobs;
  if (!state.contains("jobs") || !state["jobs"].is_array()) return jobs;
  for (const auto& j : state["jobs"]) {
    if (!j.is_object()) continue;
    const std::string& path = layout.state();
    jobs.push_back({json_field(j, "id", std::string(), path), json_field(j, "scheduler", std::string(), path),
                    json_field(j, "submitted", std::string(), path), json_field(j, "trial", -1, path)});
  }
  return jobs;
}

std::optional<RecordedJob> latest_job(const ExperimentLayout& layout) {
  const json state = read_state(layout);
  const std::string id = json_field(state, "job_id", std::string(), layout.state());
  if (id.empty()) return std::nullopt;
  RecordedJob job{id, json_field(state, "scheduler", std::string(), layout.state()), ""};
  for (const auto& recorded : recorded_jobs(layout)) {
    if (recorded.id == id) job.submitted = recorded.submitted;
  }
  return job;
}

void record_job(const ExperimentLayout& layout, const std::string& scheduler, const std::string& id, int trial) {
  // The subjobs of an array job may each record their successor at the same moment.
  const UniqueFd lock = lock_experiment(layout);
  json state = read_state(layout);
  state["scheduler"] = scheduler;
  state["job_id"] = id;
  if (!state["jobs"].is_array()) state["jobs"] = json::array();
  json record = {{"id", id}, {"scheduler", scheduler}, {"submitted", utc_now_iso()}};
  if (trial >= 0) record["trial"] = trial;
  state["jobs"].push_back(record);
  write_json_file(layout.state(), state);
}

void record_failed_hand_over(const std::string& trial_dir, const FailedHandOver& failed) {
  const std::string path = TrialLayout{trial_dir}.launcher_state_file();
  json state = read_json_file(path);
  state[kFailedHandOverKey] = {{"time", failed.time}, {"job", failed.job}, {"tries", failed.tries},
                               {"error", failed.error}, {"resume", failed.resume}};
  write_json_file(path, state);
}

TrialProgress trial_progress(const ExperimentLayout& layout, int trial_id) {
  const TrialLayout trial = layout.trial(trial_id);
  TrialProgress p;
  if (const auto chief = read_heartbeat(trial.heartbeat_dir(), 0)) p.reported_step = chief->step;
  const std::string state_path = trial.launcher_state_file();
  const json state = read_json_file(state_path);
  p.starts = json_field(state, "starts", 0, state_path);
  p.failures = json_field(state, "failures", 0, state_path);
  detail::read_launcher_decisions(state, state_path, p);
  std::ifstream records(trial.failures_file());
  for (std::string line; std::getline(records, line);) {
    try {
      const json record = json::parse(line);
      p.last_failure = record.value("reason", std::string());
      p.last_failure_flight.clear();
      if (const auto flight = record.find("flight"); flight != record.end() && flight->is_object()) {
        for (const auto& [rank, operations] : flight->items()) {
          if (operations.is_string()) p.last_failure_flight.emplace_back(std::stoi(rank), operations.get<std::string>());
        }
        std::sort(p.last_failure_flight.begin(), p.last_failure_flight.end());
      }
    } catch (const std::exception&) {
      // a record cut short by a crash: the one before stands
    }
  }
  std::ifstream runs(trial.runs_file());
  for (std::string line; std::getline(runs, line);) {
    try {
      const json j = json::parse(line);
      TrialRun run{j.value("started", std::string()), j.value("ranks", 0), j.value("batch", std::int64_t{0}),
                   j.value("local_batch", std::int64_t{0}), j.value("accumulation", std::int64_t{1}),
                   j.value("batches", std::int64_t{0}), j.value("launcher", std::string()), {}, {}, {}, {}, {}};
      if (const auto container = j.find("container"); container != j.end() && container->is_object()) {
        run.runtime = container->value("runtime", std::string());
        run.image = container->value("image", std::string());
      }
      if (const auto in = j.find("inference"); in != j.end()) run.from_record = in->value("from_record", 0);
      if (const auto r = j.find("resumed_from"); r != j.end() && r->is_object()) run.level = r->value("level", "");
      if (const auto placement = j.find("placement"); placement != j.end() && placement->is_array()) {
        for (const json& place : *placement) {
          if (!place.is_object()) continue;
          run.placement.push_back({place.value("host", std::string()), place.value("cpus", std::string()),
                                   place.value("device", std::string())});
        }
      }
      p.runs.push_back(std::move(run));
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
    state = read_json_file(TrialLayout{trial_dir}.elastic_file());
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
  write_file_atomic(TrialLayout{trial_dir}.stop_file(), request.dump() + "\n");
}

std::string stop_reason(const std::string& trial_dir) {
  std::ifstream in(TrialLayout{trial_dir}.stop_file());
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
  std::ifstream in(TrialLayout{trial_dir}.stop_file());
  if (!in) return false;
  try {
    const json j = json::parse(in);
    return j.is_object() && j.value("job", std::string()) == job;
  } catch (const json::exception&) {
    return false;
  }
}

void request_job_stop(const ExperimentLayout& layout, const std::string& job, int restarts,
                      const std::string& reason) {
  if (job.empty() || job.find('/') != std::string::npos) throw Error("\"" + job + "\" is not a batch job's id");
  json request{{"reason", reason}, {"time", utc_now_iso()}, {"job", job}};
  if (restarts >= 0) request["restarts"] = restarts;
  write_file_atomic(layout.job_stop_file(job), request.dump() + "\n");
}

void clear_job_stop(const ExperimentLayout& layout, const std::string& job) {
  if (job.empty() || job.find('/') != std::string::npos) return;
  ::unlink(layout.job_stop_file(job).c_str());
}

std::string job_stop_reason(const ExperimentLayout& layout, const Allocation& allocation) {
  if (!allocation.in_job() || allocation.job_id.find('/') != std::string::npos) return "";
  std::ifstream in(layout.job_stop_file(allocation.job_id));
  if (!in) return "";
  try {
    const json j = json::parse(in);
    if (!j.is_object() || j.value("job", std::string()) != allocation.job_id) return "";
    const int restarts = j.value("restarts", -1);
    if (restarts >= 0 && restarts != allocation.restart_count) return "";  // for an earlier run: spent
    return j.value("reason", std::string("requested"));
  } catch (const json::exception&) {
    return "";
  }
}

void record_worker_trial(const ExperimentLayout& layout, const std::string& job, int trial) {
  if (job.empty() || job.find('/') != std::string::npos) return;  // not a batch job: no listing asks
  write_file_atomic(layout.worker_file(job), json{{"job", job}, {"trial", trial}, {"time", utc_now_iso()}}.dump() + "\n");
}

std::optional<int> worker_trial(const ExperimentLayout& layout, const std::string& job) {
  if (job.empty() || job.find('/') != std::string::npos) return std::nullopt;
  std::ifstream in(layout.worker_file(job));
  if (!in) return std::nullopt;
  try {
    const json j = json::parse(in);
    if (!j.is_object() || j.value("job", std::string()) != job) return std::nullopt;
    return std::max(-1, j.value("trial", -1));
  } catch (const json::exception&) {
    return std::nullopt;
  }
}

}  // namespace hpctrial::core
