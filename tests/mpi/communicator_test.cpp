// Every collective of MpiCommunicator on 2 and 4 ranks: each type and reduction, odd and empty
// sizes, reduce-scatter and all-gather of typed blocks (in place, and split into pieces), the
// async handles (several in flight, mixed with synchronous calls), messages between ranks (in
// order, crossing, large, inside split groups) and the same calls on the world of one.
#include "hpctrial/comm/communicator.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>

#include "float16.h"
#include "hpctrial/core/error.h"
#include "hpctrial/comm/watchdog.h"
#include "mpi_test_env.h"

namespace hpctrial::comm {
namespace {

using testing::HasSubstr;
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

  std::vector<std::int32_t> i32 = {r, -r};
  comm.allreduce(i32.data(), i32.size(), DType::kInt32, ReduceOp::kSum);
  EXPECT_EQ(i32, (std::vector<std::int32_t>{n * (n - 1) / 2, -n * (n - 1) / 2}));

  std::vector<std::uint8_t> u = {static_cast<std::uint8_t>(r), 200};
  comm.allreduce(u.data(), u.size(), DType::kUInt8, ReduceOp::kMax);
  EXPECT_EQ(u, (std::vector<std::uint8_t>{static_cast<std::uint8_t>(n - 1), 200}));
}

TEST(MpiCommunicator, AverageDividesBySizeAndRefusesIntegers) {
  MpiCommunicator comm(env().world());
  const int r = comm.rank(), n = comm.size();
  std::vector<float> f = {static_cast<float>(2 * r), 3.0f};
  comm.allreduce(f.data(), f.size(), DType::kFloat32, ReduceOp::kAvg);
  EXPECT_FLOAT_EQ(f[0], static_cast<float>(n - 1));
  EXPECT_FLOAT_EQ(f[1], 3.0f);
  std::vector<double> d = {static_cast<double>(r)};
  comm.allreduce(d, ReduceOp::kAvg);
  EXPECT_DOUBLE_EQ(d[0], (n - 1) / 2.0);
  std::int64_t i = 1;
  try {
    comm.allreduce(&i, 1, DType::kInt64, ReduceOp::kAvg);
    ADD_FAILURE() << "an integer average was accepted";
  } catch (const CommError& e) {
    EXPECT_THAT(e.what(), HasSubstr("an average of int64 values is not defined"));
  }
}

TEST(MpiCommunicator, SixteenBitFloatsReduceAndRound) {
  MpiCommunicator comm(env().world());
  const int r = comm.rank(), n = comm.size();
  // Values exact in 16 bits, and sums that stay exact: the result is exact too.
  std::vector<std::uint16_t> half = {detail::float_to_half(0.5f * static_cast<float>(r)),
                                     detail::float_to_half(-1.25f)};
  comm.allreduce(half.data(), half.size(), DType::kFloat16, ReduceOp::kSum);
  EXPECT_EQ(detail::half_to_float(half[0]), 0.25f * static_cast<float>(n * (n - 1)));
  EXPECT_EQ(detail::half_to_float(half[1]), -1.25f * static_cast<float>(n));
  std::vector<std::uint16_t> bf = {detail::float_to_bfloat16(static_cast<float>(r) * 4.0f)};
  comm.allreduce(bf.data(), bf.size(), DType::kBFloat16, ReduceOp::kMax);
  EXPECT_EQ(detail::bfloat16_to_float(bf[0]), 4.0f * static_cast<float>(n - 1));
  std::vector<std::uint16_t> avg = {detail::float_to_bfloat16(8.0f)};
  comm.allreduce(avg.data(), avg.size(), DType::kBFloat16, ReduceOp::kAvg);
  EXPECT_EQ(detail::bfloat16_to_float(avg[0]), 8.0f);
}

TEST(Float16, ConversionsRoundToNearestEven) {
  EXPECT_EQ(detail::float_to_half(1.0f), 0x3c00);
  EXPECT_EQ(detail::float_to_half(65504.0f), 0x7bff);
  EXPECT_EQ(detail::float_to_half(65520.0f), 0x7c00);  // halfway to infinity rounds up
  EXPECT_EQ(detail::float_to_half(-0.0f), 0x8000);
  EXPECT_EQ(detail::float_to_half(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(detail::float_to_half(std::ldexp(1.0f, -25)), 0x0000);  // halfway, to even
  EXPECT_EQ(detail::float_to_half(1.0f + std::ldexp(1.0f, -11)), 0x3c00);  // halfway, to even
  EXPECT_EQ(detail::float_to_half(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  EXPECT_TRUE(std::isnan(detail::half_to_float(detail::float_to_half(std::nanf("")))));
  for (std::uint32_t h = 0; h < 0x7c00; ++h) {  // every finite positive half round-trips
    ASSERT_EQ(detail::float_to_half(detail::half_to_float(static_cast<std::uint16_t>(h))), h);
  }
  EXPECT_EQ(detail::float_to_bfloat16(1.0f), 0x3f80);
  EXPECT_EQ(detail::bfloat16_to_float(detail::float_to_bfloat16(3.140625f)), 3.140625f);
  EXPECT_EQ(detail::float_to_bfloat16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);  // halfway, to even
}

TEST(MpiCommunicator, OddAndEmptySizes) {
  MpiCommunicator comm(env().world());
  for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{1001}}) {
    std::vector<float> v(count, static_cast<float>(comm.rank() + 1));
    comm.allreduce(v.data(), v.size(), DType::kFloat32, ReduceOp::kSum);
    const float expected = static_cast<float>(comm.size() * (comm.size() + 1) / 2);
    for (float x : v) ASSERT_EQ(x, expected) << "count " << count;
    comm.allreduce_async(v.data(), v.size(), DType::kFloat32, ReduceOp::kSum)->wait();
  }
  std::string empty = comm.rank() == 0 ? "" : "ignored";
  comm.broadcast(empty, 0);
  EXPECT_EQ(empty, "");
  const auto all = comm.allgather("");
  EXPECT_EQ(all, std::vector<std::string>(static_cast<std::size_t>(comm.size()), ""));
  comm.broadcast_async(nullptr, 0, 0)->wait();
}

TEST(MpiCommunicator, AllreduceSplitsLargeMessages) {
  MpiCommunicator comm(env().world());
  std::vector<float> big((std::size_t{40} << 20) / sizeof(float) + 3, 1.0f);  // > 2 pieces
  comm.allreduce(big.data(), big.size(), DType::kFloat32, ReduceOp::kSum);
  EXPECT_EQ(big.front(), static_cast<float>(comm.size()));
  EXPECT_EQ(big.back(), static_cast<float>(comm.size()));
  std::vector<char> bytes((std::size_t{33} << 20) + 5, comm.rank() == 1 ? 'b' : 'x');
  comm.broadcast_async(bytes.data(), bytes.size(), 1)->wait();
  EXPECT_EQ(bytes.front(), 'b');
  EXPECT_EQ(bytes.back(), 'b');
}

TEST(MpiCommunicator, BroadcastAllgatherGatherAndAgreement) {
  MpiCommunicator comm(env().world());
  std::string value = comm.rank() == 1 ? std::string("from rank 1\0 with nul", 21) : "";
  comm.broadcast(value, 1);
  EXPECT_EQ(value, std::string("from rank 1\0 with nul", 21));

  const auto all = comm.allgather(std::string(static_cast<std::size_t>(comm.rank()), 'x'));
  ASSERT_EQ(all.size(), static_cast<std::size_t>(comm.size()));
  for (int i = 0; i < comm.size(); ++i) EXPECT_EQ(all[static_cast<std::size_t>(i)], std::string(static_cast<std::size_t>(i), 'x'));

  const int root = comm.size() - 1;
  const auto gathered = comm.gather(std::string(static_cast<std::size_t>(comm.rank()) * 3, 'g'), root);
  if (comm.rank() == root) {
    ASSERT_EQ(gathered.size(), static_cast<std::size_t>(comm.size()));
    for (int i = 0; i < comm.size(); ++i) EXPECT_EQ(gathered[static_cast<std::size_t>(i)].size(), static_cast<std::size_t>(3 * i));
  } else {
    EXPECT_TRUE(gathered.empty());
  }

  EXPECT_TRUE(comm.any(comm.rank() == comm.size() - 1));
  EXPECT_FALSE(comm.any(false));
  comm.barrier();
}

TEST(MpiCommunicator, AsyncHandlesRunInOrderBesideSynchronousCalls) {
  MpiCommunicator comm(env().world());
  const int n = comm.size();
  // Several buckets in flight at once, of different types, while the caller runs
  // synchronous collectives; each wait() returns with its own result.
  std::vector<std::vector<float>> buckets;
  std::vector<double> doubles(333, 1.0);
  std::vector<WorkHandle> handles;
  for (int b = 0; b < 6; ++b) buckets.emplace_back(static_cast<std::size_t>(1000 * b + 1), static_cast<float>(b));
  for (auto& bucket : buckets) {
    handles.push_back(comm.allreduce_async(bucket.data(), bucket.size(), DType::kFloat32, ReduceOp::kSum));
  }
  handles.push_back(comm.allreduce_async(doubles.data(), doubles.size(), DType::kFloat64, ReduceOp::kAvg));
  EXPECT_TRUE(comm.any(comm.rank() == 0));
  std::string text = comm.rank() == 0 ? "sync while async" : "";
  comm.broadcast(text, 0);
  EXPECT_EQ(text, "sync while async");
  for (auto& h : handles) h->wait();
  for (std::size_t b = 0; b < buckets.size(); ++b) {
    EXPECT_EQ(buckets[b].front(), static_cast<float>(b * static_cast<std::size_t>(n)));
    EXPECT_EQ(buckets[b].back(), static_cast<float>(b * static_cast<std::size_t>(n)));
  }
  EXPECT_EQ(doubles.front(), 1.0);
  // wait(timeout) returns false while a collective cannot finish, true once it has.
  std::vector<float> late(10, 1.0f);
  WorkHandle slow;
  if (comm.rank() == 0) {
    slow = comm.allreduce_async(late.data(), late.size(), DType::kFloat32, ReduceOp::kSum);
    EXPECT_FALSE(slow->wait(std::chrono::milliseconds(50))) << "finished before the other ranks joined";
  }
  comm.barrier();  // rank 0 has polled before the others issue theirs
  if (comm.rank() != 0) slow = comm.allreduce_async(late.data(), late.size(), DType::kFloat32, ReduceOp::kSum);
  EXPECT_TRUE(slow->wait(std::chrono::seconds(60)));
  EXPECT_EQ(late[9], static_cast<float>(n));
}

TEST(MpiCommunicator, MistakesAreClearErrors) {
  MpiCommunicator comm(env().world());
  try {
    std::string s;
    comm.broadcast(s, comm.size());
    ADD_FAILURE() << "a root outside the world was accepted";
  } catch (const CommError& e) {
    EXPECT_THAT(e.what(), HasSubstr("broadcast: root rank " + std::to_string(comm.size()) + " is not in 0.."));
  }
  EXPECT_THROW(comm.gather("x", -1), CommError);
}

TEST(MpiCommunicator, ReportsEveryCollectiveToTheWatchdog) {
  Watchdog watchdog(env().world(), {std::chrono::seconds(60), {}, 1, {}, nullptr});
  MpiCommunicator comm(env().world(), &watchdog);
  comm.set_step(17);
  EXPECT_EQ(watchdog.step(), 17);
  std::vector<float> v(5, 1.0f);
  comm.allreduce(v.data(), v.size(), DType::kFloat32, ReduceOp::kSum);
  comm.allreduce_async(v.data(), v.size(), DType::kFloat32, ReduceOp::kSum)->wait();
  comm.barrier();
  // Two collectives seen so far plus the barrier: the next one is the fourth.
  const std::uint64_t next = watchdog.enter("probe");
  watchdog.leave(next);
  EXPECT_EQ(next, 4u);
  watchdog.finish();
}

// Block b of rank r's send buffer holds 100*r + 10*b + i at index i: rank r receives
// sum over ranks of (100*q + 10*r + i) in its block.
std::vector<double> blocks_of(int rank, int size, std::size_t count) {
  std::vector<double> send(count * static_cast<std::size_t>(size));
  for (int b = 0; b < size; ++b) {
    for (std::size_t i = 0; i < count; ++i) send[b * count + i] = 100.0 * rank + 10.0 * b + static_cast<double>(i);
  }
  return send;
}

TEST(MpiCommunicator, ReduceScatterGivesEachRankItsBlockReduced) {
  MpiCommunicator comm(env().world());
  const int r = comm.rank(), n = comm.size();
  for (const std::size_t count : {std::size_t{1}, std::size_t{5}}) {
    const auto send = blocks_of(r, n, count);
    std::vector<double> recv(count);
    comm.reduce_scatter(send.data(), recv.data(), count, DType::kFloat64, ReduceOp::kSum);
    for (std::size_t i = 0; i < count; ++i) {
      EXPECT_EQ(recv[i], 100.0 * n * (n - 1) / 2 + n * (10.0 * r + static_cast<double>(i))) << count << " " << i;
    }
    comm.reduce_scatter(send.data(), recv.data(), count, DType::kFloat64, ReduceOp::kAvg);
    EXPECT_DOUBLE_EQ(recv[0], 50.0 * (n - 1) + 10.0 * r);
    comm.reduce_scatter(send.data(), recv.data(), count, DType::kFloat64, ReduceOp::kMax);
    EXPECT_EQ(recv[0], 100.0 * (n - 1) + 10.0 * r);
  }
  // In place: the result lands in this rank's own block of the send buffer.
  auto inplace = blocks_of(r, n, 3);
  comm.reduce_scatter(inplace.data(), inplace.data() + 3 * r, 3, DType::kFloat64, ReduceOp::kMin);
  EXPECT_EQ(inplace[3 * r + 2], 10.0 * r + 2);
  // 16-bit floats and integers.
  std::vector<std::uint16_t> bf(static_cast<std::size_t>(n), detail::float_to_bfloat16(2.0f * static_cast<float>(r)));
  std::uint16_t bf_out = 0;
  comm.reduce_scatter(bf.data(), &bf_out, 1, DType::kBFloat16, ReduceOp::kSum);
  EXPECT_EQ(detail::bfloat16_to_float(bf_out), static_cast<float>(n * (n - 1)));
  std::vector<std::int64_t> ints(static_cast<std::size_t>(n), std::int64_t{1} << 40);
  std::int64_t int_out = 0;
  comm.reduce_scatter(ints.data(), &int_out, 1, DType::kInt64, ReduceOp::kSum);
  EXPECT_EQ(int_out, n * (std::int64_t{1} << 40));
  EXPECT_THROW(comm.reduce_scatter(ints.data(), &int_out, 1, DType::kInt64, ReduceOp::kAvg), CommError);
}

TEST(MpiCommunicator, AllgatherPutsEachRanksValuesInItsBlock) {
  MpiCommunicator comm(env().world());
  const int r = comm.rank(), n = comm.size();
  const std::vector<float> mine = {static_cast<float>(r), 0.5f + static_cast<float>(r)};
  std::vector<float> all(2 * static_cast<std::size_t>(n), -1.0f);
  comm.allgather(mine.data(), all.data(), 2, DType::kFloat32);
  for (int b = 0; b < n; ++b) {
    EXPECT_EQ(all[2 * b], static_cast<float>(b));
    EXPECT_EQ(all[2 * b + 1], 0.5f + static_cast<float>(b));
  }
  // In place: this rank's values are already in its block.
  std::vector<std::int32_t> ids(static_cast<std::size_t>(n), -1);
  ids[static_cast<std::size_t>(r)] = 7 * r;
  comm.allgather(ids.data() + r, ids.data(), 1, DType::kInt32);
  for (int b = 0; b < n; ++b) EXPECT_EQ(ids[b], 7 * b);
}

// More than one piece of 16 MiB in all: each call carries a piece of every block.
TEST(MpiCommunicator, ReduceScatterAndAllgatherSplitLargeMessages) {
  MpiCommunicator comm(env().world());
  const int r = comm.rank(), n = comm.size();
  const std::size_t count = (std::size_t{24} << 20) / sizeof(float) / static_cast<std::size_t>(n) + 3;
  std::vector<float> send(count * static_cast<std::size_t>(n));
  for (std::size_t k = 0; k < send.size(); ++k) send[k] = static_cast<float>(k % 1000) + static_cast<float>(r);
  std::vector<float> shard(count);
  comm.reduce_scatter(send.data(), shard.data(), count, DType::kFloat32, ReduceOp::kSum);
  const float ranks = static_cast<float>(n * (n - 1) / 2);
  for (const std::size_t i : {std::size_t{0}, count / 2, count - 1}) {
    const std::size_t k = static_cast<std::size_t>(r) * count + i;
    EXPECT_EQ(shard[i], static_cast<float>(n) * static_cast<float>(k % 1000) + ranks) << i;
  }
  // In place over the same pieces.
  comm.reduce_scatter(send.data(), send.data() + r * count, count, DType::kFloat32, ReduceOp::kSum);
  EXPECT_EQ(send[r * count + count - 1], shard[count - 1]);
  std::vector<float> all(count * static_cast<std::size_t>(n));
  comm.allgather(shard.data(), all.data(), count, DType::kFloat32);
  for (int b = 0; b < n; ++b) {
    const std::size_t k = static_cast<std::size_t>(b) * count + count - 1;
    EXPECT_EQ(all[k], static_cast<float>(n) * static_cast<float>(k % 1000) + ranks) << b;
  }
  std::fill(all.begin(), all.end(), 0.0f);
  std::copy(shard.begin(), shard.end(), all.begin() + r * count);
  comm.allgather(all.data() + r * count, all.data(), count, DType::kFloat32);
  EXPECT_EQ(all[count - 1], static_cast<float>(n) * static_cast<float>((count - 1) % 1000) + ranks);
}

TEST(MpiCommunicator, AsyncReduceScatterAndAllgatherRunInOrder) {
  MpiCommunicator comm(env().world());
  const int r = comm.rank(), n = comm.size();
  const auto send = blocks_of(r, n, 4);
  std::vector<double> shard(4), all(4 * static_cast<std::size_t>(n));
  auto scattered = comm.reduce_scatter_async(send.data(), shard.data(), 4, DType::kFloat64, ReduceOp::kAvg);
  scattered->wait();
  auto gathered = comm.allgather_async(shard.data(), all.data(), 4, DType::kFloat64);
  std::vector<double> flag = {1.0};
  comm.allreduce(flag, ReduceOp::kSum);  // a synchronous call while the gather may be in flight
  gathered->wait();
  EXPECT_EQ(flag[0], static_cast<double>(n));
  for (int b = 0; b < n; ++b) EXPECT_DOUBLE_EQ(all[4 * b + 1], 50.0 * (n - 1) + 10.0 * b + 1);
}

// The layout of model parallelism on 4 ranks: two copies of a model cut in two. The ranks of one
// copy (0-1, 2-3) and the ranks of one part (0-2, 1-3) each talk among themselves; a key reverses
// the order; the groups report to the watchdog of the communicator they came from.
TEST(MpiCommunicator, SplitGivesEachGroupItsOwnCollectives) {
  Watchdog watchdog(env().world(), {std::chrono::seconds(60), {}, 1, {}, nullptr});
  MpiCommunicator world(env().world(), &watchdog);
  const int rank = world.rank(), size = world.size();
  const int parts = size % 2 == 0 ? 2 : 1;
  const auto copy = world.split(rank / parts, rank);  // the ranks of one copy of the model
  const auto part = world.split(rank % parts, rank);  // the ranks that hold the same part
  EXPECT_EQ(copy->size(), parts);
  EXPECT_EQ(copy->rank(), rank % parts);
  EXPECT_EQ(part->size(), size / parts);
  EXPECT_EQ(part->rank(), rank / parts);
  // Sums stay in their group: the copy's ranks, and the part's.
  std::vector<double> v = {static_cast<double>(rank)};
  copy->allreduce(v, ReduceOp::kSum);
  const int first = rank / parts * parts;
  EXPECT_EQ(v[0], parts == 2 ? 2.0 * first + 1 : static_cast<double>(rank));
  std::vector<double> w = {static_cast<double>(rank)};
  part->allreduce_async(w.data(), 1, DType::kFloat64, ReduceOp::kSum)->wait();
  double expected = 0;
  for (int r = rank % parts; r < size; r += parts) expected += r;
  EXPECT_EQ(w[0], expected);
  EXPECT_EQ(part->allgather(std::to_string(rank)).size(), static_cast<std::size_t>(size / parts));
  // The key orders the group: reversed, the last rank is the group's chief.
  const auto reversed = world.split(0, size - rank);
  EXPECT_EQ(reversed->rank(), size - 1 - rank);
  std::string chief = std::to_string(rank);
  reversed->broadcast(chief, 0);
  EXPECT_EQ(chief, std::to_string(size - 1));
  EXPECT_THROW(world.split(-1, 0), CommError);
  const std::uint64_t before = watchdog.enter("probe");
  watchdog.leave(before);
  copy->barrier();
  const std::uint64_t after = watchdog.enter("probe");
  watchdog.leave(after);
  EXPECT_EQ(after, before + 2) << "the group's barrier was reported";
  watchdog.finish();
}

// Every rank sends to both neighbours of a ring and receives from both, all posted before any
// wait: the sends cross, in three rounds of 1, 1000 and 2^20 values (MPI's eager and rendezvous
// protocols), each round's message behind the last one. A round's value names sender, round and
// direction, so that a message taken out of order or from the wrong rank fails.
TEST(MpiCommunicator, MessagesArriveInOrderWhileTheyCrossBetweenRanks) {
  Watchdog watchdog(env().world(), {std::chrono::seconds(60), {}, 1, {}, nullptr});
  MpiCommunicator comm(env().world(), &watchdog);
  const int r = comm.rank(), n = comm.size();
  const int next = (r + 1) % n, previous = (r + n - 1) % n;
  const std::vector<std::size_t> sizes = {1, 1000, std::size_t{1} << 20};
  std::vector<std::vector<float>> to_next, to_previous, from_previous, from_next;
  std::vector<WorkHandle> works;
  for (std::size_t round = 0; round < sizes.size(); ++round) {
    to_next.emplace_back(sizes[round], static_cast<float>(1000 * r + 10 * round + 1));
    to_previous.emplace_back(sizes[round], static_cast<float>(1000 * r + 10 * round + 2));
    from_previous.emplace_back(sizes[round], -1.0f);
    from_next.emplace_back(sizes[round], -1.0f);
  }
  for (std::size_t round = 0; round < sizes.size(); ++round) {
    works.push_back(comm.send_async(to_next[round].data(), sizes[round], DType::kFloat32, next));
    works.push_back(comm.send_async(to_previous[round].data(), sizes[round], DType::kFloat32, previous));
  }
  for (std::size_t round = 0; round < sizes.size(); ++round) {
    works.push_back(comm.recv_async(from_previous[round].data(), sizes[round], DType::kFloat32, previous));
    works.push_back(comm.recv_async(from_next[round].data(), sizes[round], DType::kFloat32, next));
  }
  for (auto& work : works) work->wait();
  for (std::size_t round = 0; round < sizes.size(); ++round) {
    // With 2 ranks, next and previous are the same rank: its two messages of a round arrive in
    // the order it sent them (to next first).
    EXPECT_EQ(from_previous[round].front(), static_cast<float>(1000 * previous + 10 * round + 1));
    EXPECT_EQ(from_next[round].back(), static_cast<float>(1000 * next + 10 * round + 2)) << round;
    EXPECT_EQ(std::count(from_previous[round].begin(), from_previous[round].end(), from_previous[round][0]),
              static_cast<std::ptrdiff_t>(sizes[round]));
  }
  // Every message was reported, then left: the next operation has the next id, and nothing waits.
  const std::uint64_t probe = watchdog.enter("probe");
  watchdog.leave(probe);
  EXPECT_EQ(probe, 4 * sizes.size() + 1);
  watchdog.finish();
}

// The stages of a pipeline: each pair of ranks of a split group passes a message down and one
// back, on the group's ranks, while the world is busy with a collective of its own.
TEST(MpiCommunicator, AGroupsRanksMessageEachOtherByTheirRankInTheGroup) {
  Watchdog watchdog(env().world(), {std::chrono::seconds(60), {}, 1, {}, nullptr});
  MpiCommunicator world(env().world(), &watchdog);
  const int rank = world.rank();
  if (world.size() % 2 != 0) GTEST_SKIP() << "pairs need an even number of ranks";
  const auto pipe = world.split(rank / 2, rank);
  const int stage = pipe->rank(), other = 1 - stage;
  std::vector<double> sum = {1.0};
  auto reduction = world.allreduce_async(sum.data(), 1, DType::kFloat64, ReduceOp::kSum);
  std::int64_t mine = 100 * rank, theirs = -1;
  auto sent = pipe->send_async(&mine, 1, DType::kInt64, other);
  auto received = pipe->recv_async(&theirs, 1, DType::kInt64, other);
  received->wait();
  sent->wait();
  reduction->wait();
  EXPECT_EQ(theirs, 100 * (rank / 2 * 2 + other));
  EXPECT_EQ(sum[0], world.size());
  watchdog.finish();
}

TEST(MpiCommunicator, AMessageToItselfOrOutsideTheGroupIsAClearError) {
  MpiCommunicator comm(env().world());
  float value = 0;
  try {
    comm.send_async(&value, 1, DType::kFloat32, comm.rank());
    ADD_FAILURE() << "a message to the rank itself was accepted";
  } catch (const CommError& e) {
    EXPECT_THAT(e.what(), HasSubstr("send: peer rank " + std::to_string(comm.rank()) + " is not another rank of 0.." +
                                    std::to_string(comm.size() - 1) + " (this is rank " +
                                    std::to_string(comm.rank()) + ")"));
  }
  EXPECT_THROW(comm.recv_async(&value, 1, DType::kFloat32, comm.size()), CommError);
  EXPECT_THROW(comm.recv_async(&value, 1, DType::kFloat32, -1), CommError);
}

TEST(LocalCommunicator, IsAWorldOfOne) {
  LocalCommunicator comm;
  std::vector<double> d = {2.0};
  comm.allreduce(d, ReduceOp::kSum);
  EXPECT_EQ(d[0], 2.0);
  comm.allreduce(d, ReduceOp::kAvg);
  EXPECT_EQ(d[0], 2.0);
  EXPECT_TRUE(comm.allreduce_async(d.data(), 1, DType::kFloat64, ReduceOp::kSum)->wait(std::chrono::milliseconds(0)));
  EXPECT_TRUE(comm.broadcast_async(d.data(), 8, 0)->wait(std::chrono::milliseconds(0)));
  EXPECT_EQ(comm.allgather("a"), std::vector<std::string>{"a"});
  EXPECT_EQ(comm.gather("a", 0), std::vector<std::string>{"a"});
  EXPECT_THROW(comm.gather("a", 1), CommError);
  std::int64_t i = 0;
  EXPECT_THROW(comm.allreduce(&i, 1, DType::kInt64, ReduceOp::kAvg), CommError);
  EXPECT_TRUE(comm.any(true));
  EXPECT_TRUE(comm.is_chief());
  const std::vector<float> block = {1.0f, 2.0f};
  std::vector<float> out(2);
  comm.reduce_scatter(block.data(), out.data(), 2, DType::kFloat32, ReduceOp::kAvg);
  EXPECT_EQ(out, block);
  out.assign(2, 0.0f);
  comm.allgather(block.data(), out.data(), 2, DType::kFloat32);
  EXPECT_EQ(out, block);
  const auto group = comm.split(3, 7);
  EXPECT_EQ(group->size(), 1);
  EXPECT_EQ(group->rank(), 0);
  EXPECT_THROW(comm.split(-1, 0), CommError);
  EXPECT_THROW(comm.send_async(out.data(), 2, DType::kFloat32, 0), CommError);  // no peer
  EXPECT_THROW(comm.recv_async(out.data(), 2, DType::kFloat32, 1), CommError);
}

}  // namespace
}  // namespace hpctrial::comm
