// Every name of the experiment and trial directory layout is spelled here, and nowhere else.
#include "hpctrial/core/layout.h"

#include <cstddef>

namespace hpctrial::core {
namespace {

// `dir`/`name`; `name` alone when `dir` is empty (relative to the working directory).
std::string join(const std::string& dir, const std::string& name) {
  if (dir.empty()) return name;
  return dir.back() == '/' ? dir + name : dir + "/" + name;
}

bool starts_with(std::string_view text, std::string_view prefix) {
  return text.substr(0, prefix.size()) == prefix;
}

constexpr std::string_view kHeartbeatPrefix = "rank-";
constexpr std::size_t kMaxRankDigits = 9;  // fits an int

}  // namespace

std::string TrialLayout::folder(int trial_id) { return "trial-" + std::to_string(trial_id); }

std::string TrialLayout::metrics_file() const { return join(dir, "metrics.jsonl"); }
std::string TrialLayout::tensorboard_dir() const { return join(dir, "tensorboard"); }
std::string TrialLayout::profiler_trace(int rank, std::int64_t first, std::int64_t last) const {
  const std::string name =
      "rank-" + std::to_string(rank) + ".batches-" + std::to_string(first) + "-" + std::to_string(last) + ".json";
  return join(join(tensorboard_dir(), "traces"), name);
}
std::string TrialLayout::effective_config() const { return join(dir, "effective-config.yaml"); }
std::string TrialLayout::core_state_file() const { return join(dir, "core-state.json"); }
std::string TrialLayout::runs_file() const { return join(dir, "runs.jsonl"); }
std::string TrialLayout::elastic_file() const { return join(dir, "elastic.json"); }
std::string TrialLayout::predictions_file() const { return join(dir, "predictions.h5"); }
std::string TrialLayout::inference_progress_file() const { return join(dir, "inference-progress.json"); }
std::string TrialLayout::default_checkpoint_dir() const { return join(dir, "checkpoints"); }

std::string TrialLayout::launcher_state_file() const { return join(dir, "launcher-state.json"); }
std::string TrialLayout::launcher_lock() const { return join(dir, ".launcher.lock"); }
std::string TrialLayout::failures_file() const { return join(dir, "failures.jsonl"); }
std::string TrialLayout::logs_dir() const { return join(dir, "logs"); }
std::string TrialLayout::rank_log(int rank) const {
  return join(logs_dir(), "rank-" + std::to_string(rank) + ".log");
}
std::string TrialLayout::mpirun_log() const { return join(logs_dir(), "mpirun.log"); }

std::string TrialLayout::stop_file() const { return join(dir, "stop-request"); }
std::string TrialLayout::launch_dir() const { return join(dir, "launch"); }
std::string TrialLayout::search_record() const { return join(dir, "search-trial.json"); }
std::string TrialLayout::hostfile() const { return join(launch_dir(), "hostfile"); }
std::string TrialLayout::launch_config() const { return join(dir, "launcher-config.yaml"); }
std::string TrialLayout::heartbeat_dir() const { return join(launch_dir(), "heartbeat"); }
std::string TrialLayout::heartbeat_file(int rank) const { return heartbeat_file(heartbeat_dir(), rank); }
std::string TrialLayout::heartbeat_file(const std::string& heartbeat_dir, int rank) {
  return join(heartbeat_dir, std::string(kHeartbeatPrefix) + std::to_string(rank));
}

namespace {

// The number after `prefix` in `name`: "<prefix><digits>", at most kMaxRankDigits digits.
std::optional<int> number_after(std::string_view name, std::string_view prefix) {
  if (!starts_with(name, prefix)) return std::nullopt;
  const std::string_view digits = name.substr(prefix.size());
  if (digits.empty() || digits.size() > kMaxRankDigits) return std::nullopt;
  int number = 0;
  for (char c : digits) {
    if (c < '0' || c > '9') return std::nullopt;
    number = number * 10 + (c - '0');
  }
  return number;
}

}  // namespace

std::optional<int> TrialLayout::heartbeat_rank(std::string_view file_name) {
  return number_after(file_name, kHeartbeatPrefix);
}

std::optional<int> TrialLayout::trial_of(std::string_view folder_name) { return number_after(folder_name, "trial-"); }

std::string TrialLayout::abort_file(int restart_count) const {
  return join(launch_dir(), "abort-" + std::to_string(restart_count));
}
std::string TrialLayout::verdict_file(int restart_count) const {
  return join(launch_dir(), "verdict-" + std::to_string(restart_count));
}
bool TrialLayout::is_attempt_file(std::string_view file_name) {
  return starts_with(file_name, "abort-") || starts_with(file_name, "verdict-");
}

std::string ExperimentLayout::config() const { return join(dir, "experiment.yaml"); }
std::string ExperimentLayout::state() const { return join(dir, "experiment.json"); }
std::string ExperimentLayout::lock_file() const { return join(dir, ".experiment.lock"); }
std::string ExperimentLayout::plot() const { return join(dir, "plot.png"); }
std::string ExperimentLayout::report() const { return join(dir, "report.html"); }
std::string ExperimentLayout::search_log() const { return join(dir, "search-events.jsonl"); }
std::string ExperimentLayout::search_lock() const { return join(dir, ".search.lock"); }
std::string ExperimentLayout::job_stop_file(const std::string& job) const { return join(dir, "stop-request." + job); }
std::string ExperimentLayout::worker_file(const std::string& job) const { return join(dir, "worker." + job + ".json"); }
TrialLayout ExperimentLayout::trial(int trial_id) const {
  return TrialLayout{join(dir, TrialLayout::folder(trial_id))};
}
std::string ExperimentLayout::trial_dir(int trial_id) const { return trial(trial_id).dir; }
std::string ExperimentLayout::job_file(const std::string& name) const { return join(dir, name); }
std::string ExperimentLayout::code_dir() const { return join(dir, "code"); }

std::string default_experiment_dir(const std::string& name) { return join("runs", name); }

std::string NodeMemoryLayout::user_dir() const { return join(root, "hpctrial-" + std::to_string(uid)); }
std::string NodeMemoryLayout::experiment_dir() const { return join(user_dir(), experiment_id); }
std::string NodeMemoryLayout::trial_dir() const { return join(experiment_dir(), "trial-" + std::to_string(trial)); }
std::string NodeMemoryLayout::session_dir() const { return join(trial_dir(), session); }
std::string NodeMemoryLayout::rank_dir() const { return join(session_dir(), "rank-" + std::to_string(rank)); }
std::string NodeMemoryLayout::lock_file(const std::string& dir) { return join(dir, ".lock"); }

}  // namespace hpctrial::core
