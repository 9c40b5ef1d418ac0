#include "hpctrial/build_config.h"
#include "verb.h"

namespace hpctrial::cli {

std::vector<Verb> builtin_verbs() {
  return {
      config_verb(),
      run_verb(),
      submit_verb(),
      pause_verb(),
      activate_verb(),
      cancel_verb(),
      kill_verb(),
      jobs_verb(),
      job_verb(),
      logs_verb(),
      describe_verb(),
      report_verb(),
#if HPCTRIAL_WITH_PLOT
      plot_verb(),
#endif
      launch_verb(),
      checkpoint_verb(),
      experiment_verb(),
      new_trial_verb(),
      rank_verb(),
  };
}

}  // namespace hpctrial::cli
