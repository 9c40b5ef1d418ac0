#include "hpctrial/mpi_launcher/communicator.h"

#include <gtest/gtest.h>

#include "mpi_test_env.h"

namespace hpctrial::mpi_launcher {
namespace {

using testing_mpi::env;

TEST(MpiCommunicator, AllreduceEveryTypeAndOp) {
  MpiCommunicator comm(env().world());
  const int r = comm.rank(), n = comm.size();
  std::vector<double> d = {static_cast<double>(r), 1.5, -static_cast<double>(r)};
  comm.allreduce(d, ReduceOp::kSum);
  EXPECT_EQ(d, (std::vector<double>{n * (n - 1) / 2.0, 1.5 * n, -n * (n - 1) / 2.0}));

  std::vector<float> f = {static_cast<float>(r)};
  comm.allreduce(f.data(), f.size(), DType::kFloat32, ReduceOp::kMax);
  EXPECT_EQ(f[0], static_cast<float>(n - 1));

  std::vector<std::int64_t> i = {r + 10, (std::int64_t{1} << 40) + r};
  comm.allreduce(i.data(), i.size(), DType::kInt64, ReduceOp::kMin);
  EXPECT_EQ(i, (std::vector<std::int64_t>{10, std::int64_t{1} << 40}));
}

TEST(MpiCommunicator, AllreduceSplitsLargeMessages) {
  MpiCommunicator comm(env().world());
  std::vector<float> big((std::size_t{40} << 20) / sizeof(float) + 3, 1.0f);  // > 2 pieces
  comm.allreduce(big.data(), big.size(), DType::kFloat32, ReduceOp::kSum);
  EXPECT_EQ(big.front(), static_cast<float>(comm.size()));
  EXPECT_EQ(big.back(), static_cast<float>(comm.size()));
}

TEST(MpiCommunicator, BroadcastAllgatherAndAgreement) {
  MpiCommunicator comm(env().world());
  std::string value = comm.rank() == 1 ? std::string("from rank 1\0 with nul", 21) : "";
  comm.broadcast(value, 1);
  EXPECT_EQ(value, std::string("from rank 1\0 with nul", 21));

  const auto all = comm.allgather(std::string(static_cast<std::size_t>(comm.rank()), 'x'));
  ASSERT_EQ(all.size(), static_cast<std::size_t>(comm.size()));
  for (int i = 0; i < comm.size(); ++i) EXPECT_EQ(all[static_cast<std::size_t>(i)], std::string(static_cast<std::size_t>(i), 'x'));

  EXPECT_TRUE(comm.any(comm.rank() == comm.size() - 1));
  EXPECT_FALSE(comm.any(false));
  comm.barrier();
}

TEST(LocalCommunicator, IsAWorldOfOne) {
  LocalCommunicator comm;
  std::vector<double> d = {2.0};
  comm.allreduce(d, ReduceOp::kSum);
  EXPECT_EQ(d[0], 2.0);
  EXPECT_EQ(comm.allgather("a"), std::vector<std::string>{"a"});
  EXPECT_TRUE(comm.any(true));
  EXPECT_TRUE(comm.is_chief());
}

}  // namespace
}  // namespace hpctrial::mpi_launcher
