// main() for gtest binaries that run under mpirun: one MpiEnvironment for the whole run;
// rank 0 prints the usual report, the other ranks print only their failures; the exit code is
// non-zero on every rank when any rank failed, so mpirun reports the failure.
#include <gtest/gtest.h>

#include <cstdio>

#include "hpctrial/comm/mpi_environment.h"
#include "mpi_test_env.h"

namespace {

class FailurePrinter : public testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: failure\n%s\n", rank_,
                 result.file_name() ? result.file_name() : "?", result.line_number(),
                 result.summary());
  }

 private:
  int rank_;
};

}  // namespace

namespace hpctrial::testing_mpi {
const comm::MpiEnvironment* g_environment = nullptr;
}

int main(int argc, char** argv) {
  hpctrial::comm::MpiEnvironment environment(&argc, &argv);
  hpctrial::testing_mpi::g_environment = &environment;
  testing::InitGoogleTest(&argc, argv);
  if (environment.rank() != 0) {
    auto& listeners = testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new FailurePrinter(environment.rank()));
  }
  const int local = RUN_ALL_TESTS() == 0 ? 0 : 1;
  int any = 0;
  MPI_Allreduce(&local, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (environment.rank() == 0 && any != 0 && local == 0) {
    std::fprintf(stderr, "FAILED: a test failed on another rank (see its [rank N] lines)\n");
  }
  return any;
}
