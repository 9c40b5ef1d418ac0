// Faults in a distributed trial end the whole job, quickly and with a message naming the rank:
// one rank throwing, and one rank that stops answering (the collective watchdog).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <regex>

#include "../support/temp_dir.h"
#include "hpctrial/core/subprocess.h"

namespace hpctrial {
namespace fault_test {  // named: the target compiles its sources together (UNITY_BUILD)

using testing::HasSubstr;
using testing_support::TempDir;

struct Outcome {
  core::RunResult result;
  double seconds_after_fault = -1;  // from the injected fault to the end of mpirun
};

Outcome run_faulty(TempDir& dir, int ranks, int fail_rank, const std::string& mode) {
  const std::string config = dir.write("exp.yaml",
      "name: faulty\nentrypoint: ./faulty_trial\n"
      "searcher: {name: single, metric: validation_loss, max_length: {batches: 100000}}\n"
      "hyperparameters: {global_batch_size: 16, fail_rank: " + std::to_string(fail_rank) +
      ", fail_batch: 20, fail_mode: " + mode + "}\n"
      "optimizations: {collective_timeout: 3s}\n");
  core::RunOptions options;
  options.timeout = std::chrono::seconds(120);
  options.env_set = {{"OMPI_ALLOW_RUN_AS_ROOT", "1"}, {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"}};
  Outcome outcome;
  outcome.result = core::run_process({HPCTRIAL_MPIRUN, "-np", std::to_string(ranks), "--oversubscribe",
                                      HPCTRIAL_FAULTY_TRIAL, "--config", config, "--trial-dir",
                                      (dir.path() / "run").string(), "--progress-seconds", "0"},
                                     options);
  const auto end = std::chrono::duration_cast<std::chrono::milliseconds>(
      std::chrono::system_clock::now().time_since_epoch()).count();
  std::smatch match;
  if (std::regex_search(outcome.result.out, match, std::regex("injected " + mode + " at ([0-9]+)"))) {
    outcome.seconds_after_fault = static_cast<double>(end - std::stoll(match[1])) / 1000.0;
  }
  return outcome;
}

TEST(Faults, OneRankThrowingEndsEveryRankWithItsMessage) {
  TempDir dir;
  const auto outcome = run_faulty(dir, 4, 2, "throw");
  const auto& r = outcome.result;
  EXPECT_FALSE(r.timed_out) << "the job hung after one rank threw";
  EXPECT_EQ(r.exit_code, 1) << r.describe() << "\n" << r.err;
  ASSERT_GE(outcome.seconds_after_fault, 0) << r.out;
  std::printf("[ measured ] job ended %.1f s after rank 2 threw\n", outcome.seconds_after_fault);
  EXPECT_LT(outcome.seconds_after_fault, 10);
  EXPECT_THAT(r.err, HasSubstr("[rank 2] fatal on "));
  EXPECT_THAT(r.err, HasSubstr("injected failure: the batch could not be decoded; aborting the job"));
}

TEST(Faults, OneRankHangingIsEndedByTheWatchdog) {
  TempDir dir;
  const auto outcome = run_faulty(dir, 2, 1, "hang");
  const auto& r = outcome.result;
  EXPECT_FALSE(r.timed_out) << "the watchdog did not end the job";
  EXPECT_EQ(r.exit_code, 1) << r.describe() << "\n" << r.err;
  ASSERT_GE(outcome.seconds_after_fault, 0) << r.out;
  std::printf("[ measured ] job ended %.1f s after rank 1 stopped answering (timeout 3 s)\n",
              outcome.seconds_after_fault);
  EXPECT_LT(outcome.seconds_after_fault, 15);
  EXPECT_THAT(r.err, HasSubstr("[rank 0] watchdog: "));
  EXPECT_THAT(r.err, HasSubstr(", step 20) has not finished after "));
  EXPECT_THAT(r.err, HasSubstr("rank 1 did not arrive: rank 1 is at step 20"));
}

}  // namespace fault_test
}  // namespace hpctrial
