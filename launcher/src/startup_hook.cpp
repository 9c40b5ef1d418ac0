#include "startup_hook.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <filesystem>
#include <sstream>

#include "hpctrial/core/error.h"
#include "hpctrial/core/files.h"
#include "hpctrial/core/launch_contract.h"
#include "hpctrial/core/logging.h"
#include "hpctrial/core/shell_quote.h"
#include "launcher_internal.h"

namespace hpctrial::launcher::detail {
namespace {

constexpr std::size_t kLastLines = 20;

std::string command_text(const std::vector<std::string>& hook) {
  if (hook.size() == 3 && hook[0] == "/bin/sh" && hook[1] == "-c") return hook[2];
  std::string text;
  for (const auto& word : hook) text += (text.empty() ? "" : " ") + core::shell_quote(word);
  return text;
}

}  // namespace

MpirunCommand startup_hook_command(const core::ExperimentConfig& config, const core::Allocation& allocation,
                                   const LaunchOptions& options, int restart_count, const core::EnvSource& env) {
  // The ranks' command, one task a node, running the hook in place of the trial.
  core::ExperimentConfig hook = config;
  hook.resources.slots_per_node = 1;
  hook.entrypoint.kind = core::Entrypoint::Kind::kExecutable;
  hook.entrypoint.argv = config.launcher.startup_hook;
  hook.launcher.prefix.clear();
  LaunchOptions one_a_node = options;
  one_a_node.np = allocation.in_job() ? static_cast<int>(allocation.hosts.size()) : 1;
  one_a_node.rank_parent.clear();
  // The attempt's hostfile (written again for the ranks once the hook is done).
  MpirunCommand command = build_mpirun_command(hook, allocation, one_a_node, restart_count, env);
  // No grace for the hook: the ranks' (odls_base_sigkill_timeout) would keep mpirun waiting that
  // long after a hook that failed.
  const auto grace = std::find(command.argv.begin(), command.argv.end(), "odls_base_sigkill_timeout");
  if (grace != command.argv.end() && grace != command.argv.begin() && grace + 1 != command.argv.end()) {
    command.argv.erase(grace - 1, grace + 2);
  }
  return command;
}

std::optional<HookFailure> run_startup_hook(const core::ExperimentConfig& config, const core::Allocation& allocation,
                                            const LaunchOptions& options, int restart_count,
                                            const core::EnvSource& env) {
  if (config.launcher.startup_hook.empty()) return std::nullopt;
  const MpirunCommand command = startup_hook_command(config, allocation, options, restart_count, env);
  if (!command.hostfile_path.empty()) {
    core::create_directories(std::filesystem::path(command.hostfile_path).parent_path().string());
    core::write_file_atomic(command.hostfile_path, command.hostfile);
  }
  const std::string what = command_text(config.launcher.startup_hook);
  core::log_info("startup hook on {} node(s): {}", command.np, what);
  core::RunOptions run;
  run.env_set = command.env;
  run.working_dir = command.working_dir;
  run.timeout = std::chrono::seconds(config.launcher.hang_timeout_seconds);
  const core::RunResult result = core::run_process(command.argv, run);
  std::deque<std::string> last;
  for (const std::string* stream : {&result.out, &result.err}) {
    std::istringstream lines(*stream);
    for (std::string line; std::getline(lines, line);) {
      const auto tagged = untag_line(line, command.srun);
      if (!tagged) {  // mpirun's or srun's own words, not the hook's
        core::log_info("[startup hook] {}", line);
        continue;
      }
      const auto node = static_cast<std::size_t>(tagged->rank);
      const std::string where = allocation.in_job() && node < allocation.hosts.size()
                                    ? " on " + allocation.hosts[node].name : std::string();
      core::log_info("[startup hook{}] {}", where, tagged->text);
      last.push_back(tagged->text);
      if (last.size() > kLastLines) last.pop_front();
    }
  }
  if (result.ok()) return std::nullopt;
  HookFailure failure;
  std::string how;
  if (result.timed_out) {
    how = "did not finish within launcher.hang_timeout (" + std::to_string(config.launcher.hang_timeout_seconds) + " s)";
  } else if (result.signal != 0) {
    how = "was ended by signal " + std::to_string(result.signal);
  } else {
    how = "exited with status " + std::to_string(result.exit_code);
    // Its own status, unless that one means something else to the launcher's caller.
    if (result.exit_code != core::kExitStopped && result.exit_code > 0 && result.exit_code < 126) {
      failure.exit_code = result.exit_code;
    }
  }
  failure.message = "the startup hook (launcher.startup_hook: " + what + ") " + how +
                    "; the ranks were not started and the trial is not retried: fix the hook, then run or "
                    "activate the trial again";
  if (!last.empty()) {
    failure.message += ". Its last lines:";
    for (const auto& line : last) failure.message += "\n  " + line;
  }
  return failure;
}

}  // namespace hpctrial::launcher::detail
