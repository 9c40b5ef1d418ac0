// A fatal error on one rank ends the whole job through MPI_Abort - with the rank's message and
// exit code - instead of leaving the other ranks waiting forever.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "hpctrial/core/subprocess.h"

namespace hpctrial {
namespace {

using testing::HasSubstr;

core::RunResult run_ranks(int np, int failing_rank, int code) {
  core::RunOptions options;
  options.timeout = std::chrono::seconds(120);
  // Open MPI refuses root without these; CI runs as root.
  options.env_set = {{"OMPI_ALLOW_RUN_AS_ROOT", "1"}, {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"}};
  return core::run_process({HPCTRIAL_MPIRUN, "-np", std::to_string(np), "--oversubscribe",
                            HPCTRIAL_MPI_ABORT_HELPER, std::to_string(failing_rank),
                            std::to_string(code)},
                           options);
}

TEST(MpiAbort, OneFailingRankEndsTheJobWithItsCode) {
  const auto r = run_ranks(2, 1, 7);
  EXPECT_FALSE(r.timed_out) << "the job hung after one rank failed";
  EXPECT_EQ(r.exit_code, 7) << r.describe() << "\n" << r.err;
  EXPECT_THAT(r.err, HasSubstr("[rank 1] fatal on "));
  EXPECT_THAT(r.err, HasSubstr("injected failure: the data file vanished; aborting the job"));
}

TEST(MpiAbort, TheChiefFailingEndsFourRanks) {
  const auto r = run_ranks(4, 0, 9);
  EXPECT_FALSE(r.timed_out) << "the job hung after the chief failed";
  EXPECT_EQ(r.exit_code, 9) << r.describe() << "\n" << r.err;
  EXPECT_THAT(r.err, HasSubstr("[rank 0] fatal on "));
}

}  // namespace
}  // namespace hpctrial
