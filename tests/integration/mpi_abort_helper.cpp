// Under mpirun, one rank fails in the way argv names while the others wait in a collective that
// would hang forever without the failure handling:
//   mpi_abort_helper abort RANK CODE   - RANK ends the job through MpiEnvironment::abort(CODE)
//   mpi_abort_helper hang RANK SECONDS - RANK stops answering at step 3; the collective watchdog
//                                        (timeout SECONDS) must end the job
#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "hpctrial/comm/communicator.h"
#include "hpctrial/comm/mpi_environment.h"
#include "hpctrial/comm/watchdog.h"

namespace {

using namespace hpctrial::comm;

int run_hang(const MpiEnvironment& environment, int stuck_rank, int seconds) {
  Watchdog watchdog(environment.world(), {std::chrono::seconds(seconds), {}, 1, {}});
  MpiCommunicator comm(environment.world(), &watchdog);
  std::vector<float> gradients(1000, 1.0f);
  for (int step = 0; step < 10; ++step) {
    comm.set_step(step);
    if (step == 3 && environment.rank() == stuck_rank) std::this_thread::sleep_for(std::chrono::minutes(10));
    comm.allreduce_async(gradients.data(), gradients.size(), DType::kFloat32, ReduceOp::kSum)->wait();
    comm.any(false);
  }
  watchdog.finish();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  MpiEnvironment environment(&argc, &argv);
  const std::string mode = argc > 1 ? argv[1] : "abort";
  const int rank = argc > 2 ? std::atoi(argv[2]) : 1;
  const int value = argc > 3 ? std::atoi(argv[3]) : 7;
  if (mode == "hang") return run_hang(environment, rank, value);
  if (environment.rank() == rank) {
    environment.abort(value, "injected failure: the data file vanished");
  }
  MPI_Barrier(environment.world());
  MPI_Barrier(environment.world());
  return 0;
}
