// launcher.startup_hook (Determined's startup-hook.sh): the user's command, run once on each node
// of an attempt before its ranks start, with the ranks' environment and in their container,
// started as they are (mpirun or srun, one task a node). Its output goes to the launcher's log,
// each line marked as the hook's. Internal to the launcher.
#pragma once

#include <optional>
#include <string>

#include "hpctrial/core/allocation.h"
#include "hpctrial/core/env.h"
#include "hpctrial/core/experiment_config.h"
#include "hpctrial/core/subprocess.h"
#include "hpctrial/launcher/launcher.h"

namespace hpctrial::launcher::detail {

// A hook that failed: the exit code the launcher ends with (the hook's own status), and what it
// tells the user (the command, the status and the hook's last lines).
struct HookFailure {
  int exit_code = 1;
  std::string message;
};

// The command that runs `config`'s hook once on each node of `allocation` (this machine outside a
// job), as build_mpirun_command starts the ranks.
MpirunCommand startup_hook_command(const core::ExperimentConfig& config, const core::Allocation& allocation,
                                   const LaunchOptions& options, int restart_count, const core::EnvSource& env);

// Runs the hook (none: nothing) and waits, at most launcher.hang_timeout; nullopt when it
// succeeded on every node.
std::optional<HookFailure> run_startup_hook(const core::ExperimentConfig& config, const core::Allocation& allocation,
                                            const LaunchOptions& options, int restart_count,
                                            const core::EnvSource& env);

}  // namespace hpctrial::launcher::detail
