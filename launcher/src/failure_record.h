// A failed attempt as the launcher records it: the failure record (failures.jsonl), the restart
// or the end it leads to, and the node a restart leaves out when the ranks failed there twice.
#pragma once

#include <nlohmann/json.hpp>

#include <optional>
#include <string>
#include <vector>

#include "hpctrial/core/experiment_config.h"
#include "hpctrial/core/scheduler.h"
#include "hpctrial/launcher/launcher.h"
#include "supervisor.h"

namespace hpctrial::launcher::detail {

// What a failed attempt leads to: the launcher's exit code when the trial is not restarted, and
// the node its restart leaves out (empty: none).
struct FailureOutcome {
  std::optional<int> exit_code;
  std::string left_out;
};

// The nodes left out of `job` (the launcher state's excluded_nodes; IoError naming `path`, the
// file, for an entry that is no node).
std::vector<std::string> excluded_nodes(const nlohmann::json& state, const std::string& job, const std::string& path);

// The job's nodes the ranks run on, in the hostfile's order: every host of the allocation; with
// resources.spare_nodes, the first the ranks need of those this job has not given up to a spare
// (the launcher state's spared_nodes).
std::vector<core::Host> nodes_in_use(const core::ExperimentConfig& config, const core::Allocation& allocation,
                                     const nlohmann::json& state, const std::string& state_path);

// A failed attempt: records it in the trial's failures.jsonl and its launcher state. The
// launcher's exit code when the trial is not restarted (failed while stopping, past
// max_restarts, its directory removed), none to restart it; the node a restart leaves out (added
// to the state's excluded_nodes). With spare nodes, a spare takes the place in `in_use` of the
// node the failed rank ran on (the state's spared_nodes); only with none left is a node left out.
FailureOutcome record_failure(const Supervisor& supervisor, const Attempt& a, int code,
                              const core::ExperimentConfig& config, const LaunchOptions& options,
                              const core::Allocation& allocation, const std::string& trial_dir,
                              nlohmann::json& state, int starts, int failures, std::string& previous,
                              std::vector<core::Host>& in_use);

}  // namespace hpctrial::launcher::detail
