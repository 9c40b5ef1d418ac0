// Under mpirun, one rank fails in the way argv names while the others wait in a collective that
// would hang forever without the failure handling:
//   mpi_abort_helper abort RANK CODE   - RANK ends the job through MpiEnvironment::abort(CODE)
//   mpi_abort_helper hang RANK SECONDS - RANK stops answering at step 3; the collective watchdog
//                                        (timeout SECONDS) must end the job
//   mpi_abort_helper hang-message RANK SECONDS - the ranks pass messages round a ring; RANK stops
//                                        at step 3 before it sends
//   mpi_abort_helper hang-group RANK SECONDS - the ranks of each parity reduce in a group of their
//                                        own; RANK stops at step 3, the other group waits at a
//                                        world barrier a second after its last step
//   mpi_abort_helper hang-queued RANK SECONDS - each step queues 10 all-reduces and waits for
//                                        them; RANK stops at step 3, the others' stay queued
#include <chrono>
#include <cstdint>
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
  Watchdog watchdog(environment.world(), {std::chrono::seconds(seconds), {}, 1, {}, nullptr});
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

int run_hang_message(const MpiEnvironment& environment, int stuck_rank, int seconds) {
  Watchdog watchdog(environment.world(), {std::chrono::seconds(seconds), {}, 1, {}, nullptr});
  MpiCommunicator comm(environment.world(), &watchdog);
  const int rank = comm.rank(), size = comm.size();
  for (int step = 0; step < 10; ++step) {
    comm.set_step(step);
    if (step == 3 && rank == stuck_rank) std::this_thread::sleep_for(std::chrono::minutes(10));
    std::int64_t out = step, in = -1;
    auto sent = comm.send_async(&out, 1, DType::kInt64, (rank + 1) % size);
    comm.recv_async(&in, 1, DType::kInt64, (rank + size - 1) % size)->wait();
    sent->wait();
  }
  watchdog.finish();
  return 0;
}

int run_hang_group(const MpiEnvironment& environment, int stuck_rank, int seconds) {
  Watchdog watchdog(environment.world(), {std::chrono::seconds(seconds), {}, 1, {}, nullptr});
  MpiCommunicator world(environment.world(), &watchdog);
  const auto group = world.split(world.rank() % 2, world.rank());
  std::vector<float> gradients(100, 1.0f);
  for (int step = 0; step < 10; ++step) {
    world.set_step(step);
    if (step == 3 && world.rank() == stuck_rank) std::this_thread::sleep_for(std::chrono::minutes(10));
    group->allreduce(gradients.data(), gradients.size(), DType::kFloat32, ReduceOp::kSum);
  }
  std::this_thread::sleep_for(std::chrono::seconds(1));
  world.barrier();
  watchdog.finish();
  return 0;
}

int run_hang_queued(const MpiEnvironment& environment, int stuck_rank, int seconds) {
  Watchdog watchdog(environment.world(), {std::chrono::seconds(seconds), {}, 1, {}, nullptr});
  MpiCommunicator comm(environment.world(), &watchdog);
  std::vector<std::vector<float>> buckets(10, std::vector<float>(256, 1.0f));
  for (int step = 0; step < 10; ++step) {
    comm.set_step(step);
    if (step == 3 && environment.rank() == stuck_rank) std::this_thread::sleep_for(std::chrono::minutes(10));
    std::vector<WorkHandle> work;
    for (auto& bucket : buckets) {
      work.push_back(comm.allreduce_async(bucket.data(), bucket.size(), DType::kFloat32, ReduceOp::kSum));
    }
    for (auto& w : work) w->wait();
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
  if (mode == "hang-message") return run_hang_message(environment, rank, value);
  if (mode == "hang-group") return run_hang_group(environment, rank, value);
  if (mode == "hang-queued") return run_hang_queued(environment, rank, value);
  if (environment.rank() == rank) {
    environment.abort(value, "injected failure: the data file vanished");
  }
  MPI_Barrier(environment.world());
  MPI_Barrier(environment.world());
  return 0;
}
