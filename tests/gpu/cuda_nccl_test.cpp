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
  ncclComm_t comm = nullptr;
  const int devices[1] = {0};
  ASSERT_EQ(ncclCommInitAll(&comm, 1, devices), ncclSuccess);
  const std::size_t n = 1024;
  std::vector<float> host(n, 2.5f);
  float* buffer = nullptr;
  ASSERT_EQ(cudaMalloc(&buffer, n * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(buffer, host.data(), n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  ASSERT_EQ(ncclAllReduce(buffer, buffer, n, ncclFloat, ncclSum, comm, stream), ncclSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  std::vector<float> back(n);
  ASSERT_EQ(cudaMemcpy(back.data(), buffer, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(back, host);  // one rank: the sum is the value itself
  cudaStreamDestroy(stream);
  cudaFree(buffer);
  ncclCommDestroy(comm);
}

}  // namespace
}  // namespace hpctrial
