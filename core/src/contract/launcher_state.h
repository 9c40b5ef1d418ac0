// What a trial's launcher state (launcher-state.json) records of the launcher's decisions, as
// `describe` shows them: a hand-over that failed, the nodes left out, the spares that took over.
#pragma once

#include <nlohmann/json.hpp>

#include <string>

#include "hpctrial/core/experiment_dir.h"

namespace hpctrial::core::detail {

// Fills `progress`'s failed_hand_over, excluded_nodes and spared_nodes from `state`, read from
// `path`; IoError naming the file for an entry of the wrong kind.
void read_launcher_decisions(const nlohmann::json& state, const std::string& path, TrialProgress& progress);

}  // namespace hpctrial::core::detail
