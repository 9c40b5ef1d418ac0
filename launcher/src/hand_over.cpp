#include "hand_over.h"

#include <memory>
#include <thread>
#include <utility>

#include "hpctrial/core/error.h"
#include "hpctrial/core/experiment_dir.h"
#include "hpctrial/core/logging.h"
#include "hpctrial/core/text.h"

namespace hpctrial::launcher::detail {

core::CommandRunner retrying_runner(core::CommandRunner run, RetryPolicy policy, std::shared_ptr<int> last_tries) {
  if (!policy.sleep) policy.sleep = [](std::chrono::milliseconds d) { std::this_thread::sleep_for(d); };
  return [run = std::move(run), policy = std::move(policy), last_tries = std::move(last_tries)](
             const std::vector<std::string>& argv, const core::RunOptions& options) {
    std::chrono::milliseconds delay = policy.first_delay;
    for (int tries = 1;; ++tries) {
      core::RunResult r = run(argv, options);
      *last_tries = tries;
      if (r.ok() || r.timed_out || tries >= policy.tries) return r;
      core::log_warning("{} (try {} of {}); trying again in {} s", r.describe(), tries, policy.tries,
                        static_cast<double>(delay.count()) / 1000.0);
      policy.sleep(delay);
      delay *= 3;
    }
  };
}

std::optional<core::FailedHandOver> hand_over_trial(const core::Scheduler& scheduler, core::HandOver stopped,
                                                    const std::string& trial_dir, const RetryPolicy& policy) {
  auto tries = std::make_shared<int>(0);
  stopped.run = retrying_runner(std::move(stopped.run), policy, tries);
  std::optional<core::HandOverFailure> failure;
  try {
    failure = scheduler.hand_over(stopped);
  } catch (const std::exception& e) {  // the contract says never; a bug must not lose the record
    failure = core::HandOverFailure{e.what(), ""};
  }
  if (!failure) return std::nullopt;
  const core::FailedHandOver failed{core::utc_now_iso(), stopped.allocation.job_id, *tries, failure->error,
                                    failure->resume};
  std::string recorded = "recorded in " + core::TrialLayout{trial_dir}.launcher_state_file() +
                         "; `hpctrial describe " + stopped.experiment_dir + "` shows it";
  try {
    core::record_failed_hand_over(trial_dir, failed);
  } catch (const Error& e) {
    recorded = std::string("not recorded: ") + e.what();
  }
  core::log_error("trial {} stopped after a durable checkpoint, but nothing will resume it: {} ({} {}). Resume it "
                  "by hand: {} ({})", stopped.trial, failed.error, failed.tries, failed.tries == 1 ? "try" : "tries",
                  failed.resume.empty() ? "submit the experiment again" : failed.resume, recorded);
  return failed;
}

void hand_over_worker(const core::Scheduler& scheduler, core::HandOver stopped, const RetryPolicy& policy) {
  auto tries = std::make_shared<int>(0);
  stopped.run = retrying_runner(std::move(stopped.run), policy, tries);
  std::optional<core::HandOverFailure> failure;
  try {
    failure = scheduler.hand_over(stopped);
  } catch (const std::exception& e) {  // the contract says never
    failure = core::HandOverFailure{e.what(), ""};
  }
  if (!failure) return;
  core::log_error("the search worker of job {} cannot go back to the queue: {} ({} {}). The search loses this "
                  "worker, not a trial: the other workers take its trials; to have it back, submit the experiment "
                  "again once its jobs have ended{}", stopped.allocation.job_id, failure->error, *tries,
                  *tries == 1 ? "try" : "tries", failure->resume.empty() ? "" : ", or run: " + failure->resume);
}

}  // namespace hpctrial::launcher::detail
