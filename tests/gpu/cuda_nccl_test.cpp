// The CUDA runtime and NCCL that this build found: linked, matching their headers, and - where
// a GPU is visible - working. Without a GPU the device tests skip and say why.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <nccl.h>

#include <vector>

namespace hpctrial {
namespace {

// Skips the calling test unless a GPU is visible; returns the device count otherwise.
#define REQUIRE_GPU()                                                                     \
  do {                                                                                    \
    int count = 0;                                                                        \
    const cudaError_t rc = cudaGetDeviceCount(&count);                                    \
    if (rc != cudaSuccess || count == 0) {                                                \
      GTEST_SKIP() << "no GPU visible: cudaGetDeviceCount says "                          \
                   << (rc != cudaSuccess ? cudaGetErrorString(rc) : "0 devices");         \
    }                                                                                     \
  } while (false)

TEST(Nccl, TheLibraryMatchesItsHeader) {
  int version = 0;
  ASSERT_EQ(ncclGetVersion(&version), ncclSuccess);
  EXPECT_EQ(version / 100, NCCL_VERSION_CODE / 100) << "nccl.h and libnccl differ";
}

TEST(Cuda, MemoryRoundTrips) {
  REQUIRE_GPU();
  std::vector<float> host(1 << 20);
  for (std::size_t i = 0; i < host.size(); ++i) host[i] = static_cast<float>(i);
  float* device = nullptr;
  ASSERT_EQ(cudaMalloc(&device, host.size() * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(device, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice),
            cudaSuccess);
  std::vector<float> back(host.size());
  ASSERT_EQ(cudaMemcpy(back.data(), device, back.size() * sizeof(float), cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_EQ(cudaFree(device), cudaSuccess);
  EXPECT_EQ(back, host);
}

TEST(Nccl, SingleGpuAllReduce) {
  REQUIRE_GPU();
  ncclComm_t communicator = nullptr;
  const int devices[1] = {0};
  ASSERT_EQ(ncclCommInitAll(&communicator, 1, devices), ncclSuccess);
  const std::size_t n = 1024;
  std::vector<float> host(n, 2.5f);
  float* buffer = nullptr;
  ASSERT_EQ(cudaMalloc(&buffer, n * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(buffer, host.data(), n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  ASSERT_EQ(ncclAllReduce(buffer, buffer, n, ncclFloat, ncclSum, communicator, stream), ncclSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  std::vector<float> back(n);
  ASSERT_EQ(cudaMemcpy(back.data(), buffer, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(back, host);  // one rank: the sum is the value itself
  cudaStreamDestroy(stream);
  cudaFree(buffer);
  ncclCommDestroy(communicator);
}

}  // namespace
}  // namespace hpctrial

// hpctrial's NcclCommunicator, bootstrapped over MPI (a singleton world of one rank here: NCCL
// refuses two ranks on one GPU).
#include "hpctrial/comm/mpi_environment.h"
#include "hpctrial/comm/nccl_communicator.h"

namespace hpctrial {
namespace {

comm::MpiEnvironment& mpi() {
  static comm::MpiEnvironment environment;
  return environment;
}

TEST(NcclCommunicator, ReducesAndBroadcastsDeviceMemory) {
  REQUIRE_GPU();
  ASSERT_TRUE(comm::nccl_available());
  auto communicator = comm::make_nccl_communicator(mpi().world(), mpi().local_rank(), nullptr);
  ASSERT_EQ(communicator->size(), 1);
  const std::size_t n = 1000003;  // odd
  std::vector<float> host(n);
  for (std::size_t i = 0; i < n; ++i) host[i] = static_cast<float>(i % 977);
  float* device = nullptr;
  ASSERT_EQ(cudaMalloc(&device, n * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(device, host.data(), n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  auto work = communicator->allreduce_async(device, n, comm::DType::kFloat32, comm::ReduceOp::kAvg);
  EXPECT_TRUE(work->wait(std::chrono::seconds(30)));
  communicator->broadcast_async(device, n * sizeof(float), 0)->wait();
  communicator->allreduce_async(device, 0, comm::DType::kFloat32, comm::ReduceOp::kSum)->wait();  // empty
  std::vector<float> back(n);
  ASSERT_EQ(cudaMemcpy(back.data(), device, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(back, host);  // one rank: the mean is the value itself
  std::string text = "over MPI";
  communicator->broadcast(text, 0);
  EXPECT_EQ(text, "over MPI");
  cudaFree(device);
}

// A world of one: each collective copies its block (out of place) or leaves it (in place).
TEST(NcclCommunicator, ReduceScattersAndAllgathersDeviceMemory) {
  REQUIRE_GPU();
  auto communicator = comm::make_nccl_communicator(mpi().world(), mpi().local_rank(), nullptr);
  const std::size_t n = 4099;
  std::vector<float> host(n);
  for (std::size_t i = 0; i < n; ++i) host[i] = static_cast<float>(i % 101) * 0.5f;
  float* send = nullptr;
  float* recv = nullptr;
  ASSERT_EQ(cudaMalloc(&send, n * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&recv, n * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(send, host.data(), n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  std::vector<float> back(n);
  communicator->reduce_scatter_async(send, recv, n, comm::DType::kFloat32, comm::ReduceOp::kSum)->wait();
  ASSERT_EQ(cudaMemcpy(back.data(), recv, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(back, host);
  ASSERT_EQ(cudaMemset(recv, 0, n * sizeof(float)), cudaSuccess);
  communicator->allgather_async(send, recv, n, comm::DType::kFloat32)->wait();
  ASSERT_EQ(cudaMemcpy(back.data(), recv, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(back, host);
  communicator->allgather_async(recv, recv, n, comm::DType::kFloat32)->wait();  // in place
  ASSERT_EQ(cudaMemcpy(back.data(), recv, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(back, host);
  cudaFree(send);
  cudaFree(recv);
}

}  // namespace
}  // namespace hpctrial
