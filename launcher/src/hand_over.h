// The hand-over of a stopped trial to its scheduler, as the launcher does it: the scheduler's
// command (`scontrol requeue`, the `qsub` of the job that resumes the trial) tried again a few
// times with a growing delay, and, when it still fails, the failure recorded in the trial's
// launcher state with the command that resumes the trial by hand (`hpctrial describe` shows it).
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "hpctrial/core/experiment_dir.h"
#include "hpctrial/core/scheduler.h"
#include "hpctrial/core/subprocess.h"

namespace hpctrial::launcher::detail {

// How often a failing scheduler command runs, and the waits between: 2 s, then 6 s (a
// controller that restarts, a server that fails over, take seconds).
struct RetryPolicy {
  int tries = 3;                                         // runs of a failing command, in all
  std::chrono::milliseconds first_delay{2000};           // before the second; each later wait 3 times longer
  std::function<void(std::chrono::milliseconds)> sleep;  // empty: std::this_thread::sleep_for
};

// `run`, with a command that fails (an exit code other than 0, a signal) run again as `policy`
// says, each retry logged. A command that timed out is not run again: it may have taken effect
// (a qsub whose answer was lost). `*last_tries` is set to the runs of the latest command.
core::CommandRunner retrying_runner(core::CommandRunner run, RetryPolicy policy, std::shared_ptr<int> last_tries);

// `scheduler.hand_over(stopped)` through retrying_runner; a failure is logged and recorded in
// `trial_dir`'s launcher state (core::record_failed_hand_over). Returns it (nullopt: handed over).
// Never throws.
std::optional<core::FailedHandOver> hand_over_trial(const core::Scheduler& scheduler, core::HandOver stopped,
                                                    const std::string& trial_dir, const RetryPolicy& policy = {});

// `scheduler.hand_over(stopped)` of an adaptive search's worker (its job goes back to the queue to
// be a worker again), through retrying_runner; a failure is logged: the search loses the worker,
// not a trial (any other worker takes its trials), so nothing is recorded in a trial. Never throws.
void hand_over_worker(const core::Scheduler& scheduler, core::HandOver stopped, const RetryPolicy& policy = {});

}  // namespace hpctrial::launcher::detail
