// The test trial (tests/unit/trainer/test_trial.h) trained by the loop on every rank of the MPI
// test's world, one slot each, under a collective watchdog.
#pragma once

#include <chrono>
#include <string>

#include "../unit/trainer/test_trial.h"
#include "hpctrial/comm/communicator.h"
#include "hpctrial/comm/watchdog.h"
#include "mpi_test_env.h"

namespace hpctrial::trainer::testing_trial {

// Every rank of the test's world, one slot each.
inline DistributedContext slots() {
  const auto& env = testing_mpi::env();
  return {env.rank(), env.size(), env.rank(), env.size(), 1};
}

// Training metrics are reported every `report_period` batches.
inline LoopResult train_on_ranks(const std::string& yaml, LinearTrial::Options options, const std::string& dir,
                                 std::int64_t report_period = 100) {
  // A hang fails the test within the watchdog's timeout instead of the test's.
  comm::Watchdog watchdog(testing_mpi::env().world(), {std::chrono::seconds(60), {}, 1, {}, nullptr});
  comm::MpiCommunicator communicator(testing_mpi::env().world(), &watchdog);
  LoopOptions loop;
  loop.trial_dir = dir;
  loop.progress_interval_s = 0;
  loop.experiment_seed = 7;
  loop.report_period_batches = report_period;
  loop.distributed = slots();
  TrialFactory factory = [&](TrialContext& context) {
    return std::unique_ptr<Trial>(std::make_unique<LinearTrial>(context, options, nullptr));
  };
  LoopResult result = run_training(config_from(yaml), factory, communicator, loop);
  watchdog.finish();
  return result;
}

}  // namespace hpctrial::trainer::testing_trial
