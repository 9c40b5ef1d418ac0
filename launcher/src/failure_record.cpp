#include "failure_record.h"

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <utility>

#include "hpctrial/core/files.h"
#include "hpctrial/core/json_file.h"
#include "hpctrial/core/launch_contract.h"
#include "hpctrial/core/layout.h"
#include "hpctrial/core/logging.h"
#include "hpctrial/core/text.h"
#include "hpctrial/launcher/schedulers.h"

namespace hpctrial::launcher::detail {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exit code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    return "signal " + std::to_string(WTERMSIG(status)) + " (" + ::strsignal(WTERMSIG(status)) + ")";
  }
  return "status " + std::to_string(status);
}

// What ended an attempt that failed: its failure record (failures.jsonl), the sentence the
// launcher says, and the exit code that reports it: the failing rank's own code where known (as
// mpirun itself reports it), else mpirun's.
struct Failure {
  json record;
  std::string what;
  int exit_code = kExitFailed;
};

Failure describe_failure(const Supervisor& supervisor, const Attempt& a, int code, int trial_id, int starts,
                         int failures) {
  const auto& f = supervisor.failure();
  Failure out;
  json& record = out.record;
  std::string& what = out.what;
  record = {{"time", core::utc_now_iso()}, {"trial_id", trial_id}, {"start", starts}, {"failure", failures},
            {"mpirun", describe_status(a.status)}};
  if (!a.hang.empty() && f.rank < 0) {
    record["reason"] = what = a.hang;
  } else if (f.rank >= 0) {
    record["rank"] = f.rank;
    if (f.exit_code) record["exit_code"] = *f.exit_code;
    if (f.signal) record["signal"] = *f.signal;
    if (!f.host.empty()) record["host"] = f.host;
    if (!f.phase.empty()) record["phase"] = f.phase;
    if (f.step >= 0) record["step"] = f.step;
    if (!f.message.empty()) record["message"] = f.message;
    what = "rank " + std::to_string(f.rank) + (f.host.empty() ? "" : " on " + f.host) + " " + f.how +
           (f.phase.empty() ? "" : " in its " + f.phase + " phase") +
           (f.step >= 0 ? " after step " + std::to_string(f.step) : "") + (f.message.empty() ? "" : ": " + f.message);
    record["reason"] = what;
    record["log_tail"] = supervisor.failure_tail();
  } else {
    what = "mpirun ended with " + describe_status(a.status);
    record["reason"] = what;
    record["log_tail"] = supervisor.mpirun_tail();
  }
  json steps = json::object();
  for (const auto& [rank, step] : supervisor.steps()) steps[std::to_string(rank)] = step;
  record["last_steps"] = steps;
  if (!f.flight.empty()) {
    json flight = json::object();
    for (const auto& [rank, operations] : f.flight) flight[std::to_string(rank)] = operations;
    record["flight"] = flight;
  }
  if (f.exit_code && *f.exit_code != 0 && *f.exit_code != kExitStopped) {
    out.exit_code = *f.exit_code;
  } else if (f.signal) {
    out.exit_code = 128 + *f.signal;
  } else if (a.hang.empty() && f.rank < 0 && code > 0 && code != kExitStopped) {
    out.exit_code = code;
  }
  return out;
}

// Appends one failure record; ranks' output is bytes, not always UTF-8 (a library dying
// mid-message): what is not is replaced.
void append_failure(const std::string& record_path, const json& record) {
  core::UniqueFd fd(::open(record_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600));
  const std::string line = record.dump(-1, ' ', false, json::error_handler_t::replace) + "\n";
  if (fd.get() >= 0) core::write_fully(fd.get(), line, record_path);
}

// The node this failure's rank failed on, when an earlier failure of the same series (since
// failure 1) was there too and the job may leave it out: its scheduler can, and fewer than
// resources.max_excluded_nodes are left out of this job. Empty otherwise.
std::string node_to_leave_out(const json& failure, const std::string& record_path, const core::ExperimentConfig& config,
                              const core::Allocation& allocation, const json& state, const std::string& state_path) {
  const std::string node = failure.value("host", std::string());
  if (node.empty() || config.resources.max_excluded_nodes == 0 || !allocation.in_job()) return "";
  int before = 0;
  std::ifstream in(record_path);
  for (std::string line; std::getline(in, line);) {
    const json r = json::parse(line, nullptr, false);
    if (r.is_discarded() || !r.is_object()) continue;
    if (core::json_field(r, "failure", 0, record_path) == 1) before = 0;
    if (core::json_field(r, "host", std::string(), record_path) == node) ++before;
  }
  if (failure.value("failure", 0) == 1 || before == 0) return "";
  const std::vector<std::string> left_out = excluded_nodes(state, allocation.job_id, state_path);
  if (std::find(left_out.begin(), left_out.end(), node) != left_out.end()) return "";
  if (static_cast<int>(left_out.size()) >= config.resources.max_excluded_nodes) {
    core::log_warning("the ranks failed on node {} in two attempts, but job {} leaves {} node(s) out already "
                      "(resources.max_excluded_nodes), so the restart may run there again", node,
                      allocation.job_id, left_out.size());
    return "";
  }
  // A job that cannot run without it waits forever; a trial that fails wherever it runs (its own
  // mistake) costs one requeue to tell.
  const int left = static_cast<int>(left_out.size()) + 1;
  if (!scheduler(allocation.scheduler).can_leave_out(allocation, left, config.resources.min_nodes())) {
    core::log_warning("the ranks failed on node {} in two attempts, but job {} cannot leave it out: {} cannot, or "
                      "the job's partition has no other node for it", node, allocation.job_id, allocation.scheduler);
    return "";
  }
  return node;
}

// The nodes of `job` in the launcher state's list `key` (entries {node, job, ...}).
std::vector<std::string> nodes_of_job(const json& state, const char* key, const std::string& job,
                                      const std::string& path) {
  std::vector<std::string> nodes;
  const auto it = state.find(key);
  if (it == state.end() || !it->is_array()) return nodes;
  for (const json& e : *it) {
    if (e.is_object() && core::json_field(e, "job", std::string(), path) == job) {
      nodes.push_back(core::json_field(e, "node", std::string(), path));
    }
  }
  return nodes;
}

// The job's hosts that this job's failures left to spares (resources.spare_nodes).
std::vector<std::string> spared_out(const json& state, const std::string& job, const std::string& path) {
  return nodes_of_job(state, "spared_nodes", job, path);
}

bool listed(const std::vector<std::string>& names, const std::string& name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

// resources.spare_nodes: the node of the rank that failed first (the hostfile's order: rank r on
// the (r / slots_per_node)th node in use) gives its place to a spare, one of the job's nodes
// neither in use nor given up before, and is named in the failure record. With no spare left,
// the node to leave out (the job back in the queue without it, at its first failure), within
// max_excluded_nodes and where the job's partition has the nodes; empty otherwise.
std::string replace_with_spare(json& record, const core::ExperimentConfig& config, const core::Allocation& allocation,
                               json& state, const std::string& state_path, std::vector<core::Host>& in_use) {
  const int rank = record.value("rank", -1);
  const int per_node = std::max(1, std::min(config.resources.slots_per_node, config.resources.slots_per_trial));
  if (rank < 0 || static_cast<std::size_t>(rank / per_node) >= in_use.size()) return "";  // no rank names a node
  core::Host& place = in_use[static_cast<std::size_t>(rank / per_node)];
  const std::string node = place.name;
  record["node"] = node;
  std::vector<std::string> gone = spared_out(state, allocation.job_id, state_path);
  gone.push_back(node);
  for (const core::Host& host : allocation.hosts) {
    const bool used = std::any_of(in_use.begin(), in_use.end(), [&](const core::Host& h) { return h.name == host.name; });
    if (used || listed(gone, host.name)) continue;
    place = host;
    record["left_out_node"] = node;
    record["spare_node"] = host.name;
    if (!state["spared_nodes"].is_array()) state["spared_nodes"] = json::array();
    state["spared_nodes"].push_back(
        {{"node", node}, {"spare", host.name}, {"job", allocation.job_id}, {"time", core::utc_now_iso()}});
    core::write_json_file(state_path, state);
    const auto left = static_cast<long>(allocation.hosts.size() - in_use.size() - (gone.size() - 1));
    core::log_warning("the ranks failed on node {}: spare node {} takes its ranks inside job {} ({} spare node(s) "
                      "left)", node, host.name, allocation.job_id, std::max(0L, left - 1));
    return "";
  }
  const std::vector<std::string> left_out = excluded_nodes(state, allocation.job_id, state_path);
  if (config.resources.max_excluded_nodes == 0 || static_cast<int>(left_out.size()) >= config.resources.max_excluded_nodes) {
    core::log_warning("the ranks failed on node {} and job {} has no spare node left, but it leaves {} node(s) out "
                      "already (resources.max_excluded_nodes), so the restart runs there again", node,
                      allocation.job_id, left_out.size());
    return "";
  }
  const int needed = config.resources.nodes() + config.resources.spare_nodes;
  if (!scheduler(allocation.scheduler).can_leave_out(allocation, static_cast<int>(left_out.size()) + 1, needed)) {
    core::log_warning("the ranks failed on node {} and job {} has no spare node left, but it cannot leave the node "
                      "out: {} cannot, or the job's partition has no other {} node(s) for it, so the restart runs "
                      "there again", node, allocation.job_id, allocation.scheduler, needed);
    return "";
  }
  return node;
}

}  // namespace

std::vector<core::Host> nodes_in_use(const core::ExperimentConfig& config, const core::Allocation& allocation,
                                     const json& state, const std::string& state_path) {
  if (config.resources.spare_nodes == 0 || !allocation.in_job()) return allocation.hosts;
  const std::vector<std::string> gone = spared_out(state, allocation.job_id, state_path);
  std::vector<core::Host> hosts;
  for (const core::Host& host : allocation.hosts) {
    if (static_cast<int>(hosts.size()) < config.resources.nodes() && !listed(gone, host.name)) hosts.push_back(host);
  }
  return hosts;
}

std::vector<std::string> excluded_nodes(const json& state, const std::string& job, const std::string& path) {
  return nodes_of_job(state, "excluded_nodes", job, path);
}

FailureOutcome record_failure(const Supervisor& supervisor, const Attempt& a, int code, const core::ExperimentConfig& config,
                              const LaunchOptions& options, const core::Allocation& allocation,
                              const std::string& trial_dir, json& state, int starts, int failures,
                              std::string& previous, std::vector<core::Host>& in_use) {
  std::error_code ignored;
  const bool trial_dir_gone = !fs::is_directory(trial_dir, ignored);
  if (!trial_dir_gone) {
    state["failures"] = failures;
    core::write_json_file(core::TrialLayout{trial_dir}.launcher_state_file(), state);
  }
  Failure failure = describe_failure(supervisor, a, code, options.trial_id, starts, failures);
  const std::string& what = failure.what;
  if (trial_dir_gone) {
    // Removed while the trial ran: nothing is left to record the failure in or to resume from.
    core::log_error("trial {} failed: {}. Its directory {} was removed while it ran, so the failure is not "
                    "recorded and the trial is not restarted", options.trial_id, what, trial_dir);
    return {failure.exit_code, ""};
  }
  const std::string record_path = core::TrialLayout{trial_dir}.failures_file();
  // The same failure at start-up as the attempt before, with no rank a step further: a
  // deterministic mistake (a file it cannot read, a bad setting), which a restart only repeats.
  const bool startup = failure.record.value("phase", std::string()) == core::phase_name(core::RankPhase::kStartup);
  const std::string signature = startup ? what + " " + failure.record.at("last_steps").dump() : std::string();
  const bool repeated = startup && signature == std::exchange(previous, signature);
  const bool restart =
      !a.stop_requested && !repeated && failures <= config.max_restarts && failure.exit_code != kExitInvalidHP;
  const std::string state_path = core::TrialLayout{trial_dir}.launcher_state_file();
  const bool spares = config.resources.spare_nodes > 0 && allocation.in_job();
  std::string leave_out;
  if (restart && spares) {
    leave_out = replace_with_spare(failure.record, config, allocation, state, state_path, in_use);
  } else if (restart) {
    leave_out = node_to_leave_out(failure.record, record_path, config, allocation, state, state_path);
  }
  if (!leave_out.empty()) {
    failure.record["left_out_node"] = leave_out;
    if (!state["excluded_nodes"].is_array()) state["excluded_nodes"] = json::array();
    json entry = {{"node", leave_out}, {"job", allocation.job_id}, {"time", core::utc_now_iso()}};
    if (spares) entry["reason"] = "no_spare_left";
    state["excluded_nodes"].push_back(entry);
    core::write_json_file(state_path, state);
  }
  append_failure(record_path, failure.record);
  if (failure.exit_code == kExitInvalidHP) {
    core::log_error("trial {} reported its hyperparameters invalid ({}); it is not restarted. Recorded in {}",
                    options.trial_id, what, record_path);
    return {failure.exit_code, ""};
  }
  if (a.stop_requested) {
    core::log_error("trial {} failed while stopping: {}; recorded in {}", options.trial_id, what, record_path);
    return {failure.exit_code, ""};
  }
  if (repeated && failures <= config.max_restarts) {
    core::log_error("trial {} failed: {}. The attempt before failed the same way at the same step, so it is not "
                    "restarted again (it would fail the same way); fix the cause and run again. The failures are "
                    "recorded in {}", options.trial_id, what, record_path);
    return {failure.exit_code, ""};
  }
  if (failures > config.max_restarts) {
    core::log_error("trial {} failed: {}. It has failed {} time(s) and max_restarts is {}, so it is not restarted; "
                    "the failures are recorded in {}", options.trial_id, what, failures, config.max_restarts,
                    record_path);
    return {failure.exit_code, ""};
  }
  core::log_warning("trial {} failed: {}; restarting from its latest checkpoint (restart {} of max_restarts {}){}; "
                    "recorded in {}", options.trial_id, what, failures, config.max_restarts,
                    leave_out.empty() ? "" : " in job " + allocation.job_id + " requeued without node " + leave_out +
                                                 ", where the ranks failed in two attempts",
                    record_path);
  return {std::nullopt, leave_out};
}

}  // namespace hpctrial::launcher::detail
