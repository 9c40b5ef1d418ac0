#include "hpctrial/comm/mpi_environment.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <numeric>
#include <vector>

#include "hpctrial/core/error.h"
#include "hpctrial/comm/mpi_check.h"
#include "mpi_test_env.h"

namespace hpctrial::comm {
namespace {

using testing_mpi::env;

TEST(MpiEnvironment, RankAndSizeMatchTheWorld) {
  int rank = -1, size = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  EXPECT_EQ(env().rank(), rank);
  EXPECT_EQ(env().size(), size);
  EXPECT_GE(env().size(), 2);
  EXPECT_EQ(env().is_chief(), rank == 0);
}

TEST(MpiEnvironment, EveryRankIsCountedOnce) {
  std::vector<int> ranks(static_cast<std::size_t>(env().size()), -1);
  const int mine = env().rank();
  HPCTRIAL_MPI_CHECK(MPI_Allgather(&mine, 1, MPI_INT, ranks.data(), 1, MPI_INT, env().world()));
  std::vector<int> expected(ranks.size());
  std::iota(expected.begin(), expected.end(), 0);
  EXPECT_EQ(ranks, expected);
}

TEST(MpiEnvironment, OneNodeMeansLocalRankIsWorldRank) {
  // mpirun on this machine places every rank on one node.
  EXPECT_EQ(env().node_count(), 1);
  EXPECT_EQ(env().node_index(), 0);
  EXPECT_EQ(env().local_rank(), env().rank());
  EXPECT_EQ(env().local_size(), env().size());
  int node_size = 0;
  MPI_Comm_size(env().node(), &node_size);
  EXPECT_EQ(node_size, env().size());
}

TEST(MpiEnvironment, HostnameIsThisMachine) {
  char host[256] = {};
  ASSERT_EQ(gethostname(host, sizeof host - 1), 0);
  EXPECT_EQ(env().hostname(), std::string(host));
}

TEST(MpiEnvironment, ProvidesThreadMultiple) {
  EXPECT_EQ(env().thread_level(), MpiEnvironment::ThreadLevel::kMultiple);
}

TEST(MpiEnvironment, ASecondEnvironmentIsRefused) {
  try {
    MpiEnvironment second;
    FAIL() << "a second MpiEnvironment was constructed";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("already initialized"), std::string::npos) << e.what();
  }
}

TEST(MpiCheck, AFailedCallBecomesCommErrorWithMpisText) {
  int value = 1;
  try {
    // A root outside the communicator is an MPI_ERR_ROOT, returned (MPI_ERRORS_RETURN).
    HPCTRIAL_MPI_CHECK(MPI_Bcast(&value, 1, MPI_INT, env().size() + 5, env().world()));
    FAIL() << "MPI_Bcast with an invalid root succeeded";
  } catch (const CommError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("MPI_Bcast"), std::string::npos) << message;
    EXPECT_NE(message.find("rank " + std::to_string(env().rank())), std::string::npos) << message;
    EXPECT_NE(message.find("root"), std::string::npos) << message;
  }
}

}  // namespace
}  // namespace hpctrial::comm
