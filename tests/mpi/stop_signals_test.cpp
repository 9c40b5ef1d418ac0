// The stop handlers are installed after MPI, the watchdog's and communicator's threads and NCCL
// (where a GPU is visible) are up, and stay ours: some NCCL builds and MPI libraries install
// handlers of their own.
#include <signal.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "../../trainer/src/stop_signals.h"
#include "hpctrial/core/error.h"
#include "hpctrial/mpi_launcher/communicator.h"
#include "hpctrial/mpi_launcher/nccl_communicator.h"
#include "hpctrial/mpi_launcher/watchdog.h"
#include "mpi_test_env.h"

namespace hpctrial {
namespace {

using testing_mpi::env;

TEST(StopSignals, StayOursAfterMpiAndNcclStart) {
  mpi_launcher::Watchdog watchdog(env().world(), {std::chrono::seconds(60), {}, 1, {}});
  mpi_launcher::MpiCommunicator comm(env().world(), &watchdog);
  std::vector<float> v(4, 1.0f);
  comm.allreduce_async(v.data(), v.size(), mpi_launcher::DType::kFloat32, mpi_launcher::ReduceOp::kSum)->wait();
  std::unique_ptr<mpi_launcher::Communicator> nccl;
  if (mpi_launcher::nccl_available()) {
    try {
      nccl = mpi_launcher::make_nccl_communicator(env().world(), env().local_rank(), &watchdog);
    } catch (const CommError& e) {
      std::printf("[rank %d] NCCL not started here: %s\n", env().rank(), e.what());
    }
  }
  trainer::detail::install_stop_handlers();
  EXPECT_EQ(trainer::detail::replaced_stop_handlers(), "");
  ::raise(SIGUSR2);
  EXPECT_TRUE(trainer::detail::stop_signal_received().load());
  comm.barrier();
  watchdog.finish();
}

TEST(StopSignals, AReplacedHandlerIsNoticed) {
  trainer::detail::install_stop_handlers();
  ::signal(SIGUSR1, SIG_IGN);
  EXPECT_EQ(trainer::detail::replaced_stop_handlers(), "SIGUSR1");
  trainer::detail::install_stop_handlers();
  EXPECT_EQ(trainer::detail::replaced_stop_handlers(), "");
}

}  // namespace
}  // namespace hpctrial
