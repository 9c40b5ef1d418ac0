// The stop handlers are installed after MPI, the watchdog's and communicator's threads and NCCL
// (where a GPU is visible) are up, and stay ours: some NCCL builds and MPI libraries install
// handlers of their own.
#include <signal.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "hpctrial/rank/stop_signals.h"
#include "hpctrial/core/error.h"
#include "hpctrial/comm/communicator.h"
#include "hpctrial/comm/nccl_communicator.h"
#include "hpctrial/comm/watchdog.h"
#include "mpi_test_env.h"

namespace hpctrial {
namespace {

using testing_mpi::env;

TEST(StopSignals, StayOursAfterMpiAndNcclStart) {
  comm::Watchdog watchdog(env().world(), {std::chrono::seconds(60), {}, 1, {}, nullptr});
  comm::MpiCommunicator communicator(env().world(), &watchdog);
  std::vector<float> v(4, 1.0f);
  communicator.allreduce_async(v.data(), v.size(), comm::DType::kFloat32, comm::ReduceOp::kSum)->wait();
  std::unique_ptr<comm::Communicator> nccl;
  if (comm::nccl_available()) {
    try {
      nccl = comm::make_nccl_communicator(env().world(), env().local_rank(), &watchdog);
    } catch (const CommError& e) {
      std::printf("[rank %d] NCCL not started here: %s\n", env().rank(), e.what());
    }
  }
  rank::install_stop_handlers();
  EXPECT_EQ(rank::replaced_stop_handlers(), "");
  ::raise(SIGUSR2);
  EXPECT_TRUE(rank::stop_signal_received().load());
  communicator.barrier();
  watchdog.finish();
}

TEST(StopSignals, AReplacedHandlerIsNoticed) {
  rank::install_stop_handlers();
  ::signal(SIGUSR1, SIG_IGN);
  EXPECT_EQ(rank::replaced_stop_handlers(), "SIGUSR1");
  rank::install_stop_handlers();
  EXPECT_EQ(rank::replaced_stop_handlers(), "");
}

}  // namespace
}  // namespace hpctrial
