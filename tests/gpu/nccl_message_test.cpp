// NcclCommunicator's messages between two ranks, each on a GPU of its own (NCCL refuses two ranks
// on one GPU): a pipeline's activations one way and its gradients the other, on a communicator
// for each direction, with the watchdog counting them. Skips where fewer than 2 GPUs are visible.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <vector>

#include "hpctrial/comm/nccl_communicator.h"
#include "hpctrial/comm/watchdog.h"
#include "mpi_test_env.h"

namespace hpctrial {
namespace {

using testing_mpi::env;

TEST(NcclCommunicator, SendsAndReceivesDeviceMemoryBothWays) {
  int devices = 0;
  const cudaError_t rc = cudaGetDeviceCount(&devices);
  comm::MpiCommunicator host(env().world());
  // Every rank skips or none does, so that the collectives below match.
  std::vector<double> fewest = {static_cast<double>(rc == cudaSuccess ? devices : 0)};
  host.allreduce(fewest, comm::ReduceOp::kMin);
  if (fewest[0] < 2) GTEST_SKIP() << "fewer than 2 GPUs visible: NCCL needs a GPU for each rank";
  comm::Watchdog watchdog(env().world(), {std::chrono::seconds(60), {}, 1, {}, nullptr});
  auto world = comm::make_nccl_communicator(env().world(), env().local_rank(), &watchdog);
  const int rank = world->rank(), other = 1 - rank;
  // The two directions of a pair of stages, each its own communicator.
  auto down = world->split(0, rank);
  auto up = world->split(0, rank);
  const std::size_t n = (std::size_t{1} << 20) + 3;
  std::vector<float> activation(n), gradient(n);
  for (std::size_t i = 0; i < n; ++i) {
    activation[i] = static_cast<float>(i % 1009) + 0.25f;
    gradient[i] = -static_cast<float>(i % 997);
  }
  float *send = nullptr, *recv = nullptr;
  ASSERT_EQ(cudaMalloc(&send, n * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&recv, n * sizeof(float)), cudaSuccess);
  const auto& mine = rank == 0 ? activation : gradient;
  ASSERT_EQ(cudaMemcpy(send, mine.data(), n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  // Rank 0 sends its activation down while rank 1 sends its gradient up: they cross.
  auto& outgoing = rank == 0 ? *down : *up;
  auto& incoming = rank == 0 ? *up : *down;
  auto sent = outgoing.send_async(send, n, comm::DType::kFloat32, other);
  auto received = incoming.recv_async(recv, n, comm::DType::kFloat32, other);
  EXPECT_TRUE(received->wait(std::chrono::seconds(60)));
  EXPECT_TRUE(sent->wait(std::chrono::seconds(60)));
  std::vector<float> back(n);
  ASSERT_EQ(cudaMemcpy(back.data(), recv, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(back, rank == 0 ? gradient : activation);
  cudaFree(send);
  cudaFree(recv);
  down.reset();
  up.reset();
  world.reset();
  watchdog.finish();
}

}  // namespace
}  // namespace hpctrial
