// The partner level over real MPI: each rank's copy travels to its partner, which keeps it as
// the slots' rules say; a rank that lost its copies gets them back from the partner bit for bit;
// a rank with no copy sends a header of zeros and its partner keeps nothing new. The ranks are
// given two "nodes" by turns (every rank here shares one machine).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <tuple>
#include <vector>

#include "../support/temp_dir.h"
#include "hpctrial/checkpoint/memory_slots.h"
#include "hpctrial/comm/communicator.h"
#include "hpctrial/rank/partner_copies.h"
#include "mpi_test_env.h"

namespace hpctrial {
namespace {

using checkpoint::MemorySlots;
using testing_mpi::env;

std::vector<double> state_of(int rank, std::int64_t batches) {
  std::vector<double> v(100000 + 17 * rank);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<double>(rank * 1000 + batches) + 0.25 * i;
  v[1] = std::numeric_limits<double>::quiet_NaN();
  v[2] = -std::numeric_limits<double>::infinity();
  return v;
}

void put(MemorySlots& slots, int rank, std::int64_t batches) {
  const std::vector<double> v = state_of(rank, batches);
  auto copy = slots.begin(batches, {{"model/w", core::DType::kFloat64, {static_cast<std::int64_t>(v.size())},
                                     v.size() * sizeof(double)}}, {{"batches", std::to_string(batches)}});
  copy.set_crc32c(0, checkpoint::copy_crc32c(copy.data(0), v.data(), v.size() * sizeof(double)));
  copy.commit();
}

void expect_state(const MemorySlots& slots, int rank, std::int64_t batches) {
  const auto loaded = slots.load(batches);
  const std::vector<double> want = state_of(rank, batches);
  const auto& w = loaded.contents.at("model/w", loaded.path);
  ASSERT_EQ(w.nbytes(), want.size() * sizeof(double)) << "rank " << rank;
  EXPECT_EQ(std::memcmp(w.data->data(), want.data(), w.nbytes()), 0) << "rank " << rank << "'s copy of " << batches;
}

// Sends this rank's copy (none when `have` is false) and keeps those of its sources.
void exchange(comm::Communicator& c, const rank::Partners& p, MemorySlots& own, std::map<int, MemorySlots>& kept,
              std::int64_t batches, bool have) {
  std::vector<char> no_header;
  std::optional<MemorySlots::Image> image;
  if (have) image = own.image(batches);
  auto sends = rank::send_copy(c, image, p.send_to, no_header);
  for (const int source : p.receive_from) {
    const auto got = rank::receive_copy(c, kept.at(source), source);
    EXPECT_EQ(got.value_or(-1), have ? batches : -1) << "from rank " << source;
  }
  for (auto& s : sends) s->wait();
}

TEST(PartnerCopies, TravelToThePartnerAndBackBitForBit) {
  comm::MpiCommunicator c(env().world());
  const int me = c.rank();
  std::vector<int> nodes;
  for (int r = 0; r < c.size(); ++r) nodes.push_back(r % 2);
  const rank::Partners p = rank::partners_of(nodes, me);
  ASSERT_GE(p.send_to, 0);
  testing_support::TempDir dir;
  std::filesystem::create_directory(dir.path() / "own");
  auto own = std::make_unique<MemorySlots>((dir.path() / "own").string());
  std::map<int, MemorySlots> kept;
  for (const int source : p.receive_from) {
    std::filesystem::create_directory(rank::partner_dir(dir.path().string(), source));
    kept.emplace(std::piecewise_construct, std::forward_as_tuple(source),
                 std::forward_as_tuple(rank::partner_dir(dir.path().string(), source)));
  }
  for (const std::int64_t batches : {10, 20, 30}) {
    put(*own, me, batches);
    exchange(c, p, *own, kept, batches, true);
  }
  exchange(c, p, *own, kept, 40, false);  // no copy of 40 anywhere: the two newest stay
  EXPECT_EQ(rank::partner_sources(dir.path().string()), p.receive_from);
  for (const int source : p.receive_from) {
    EXPECT_EQ(kept.at(source).held(), (std::vector<std::int64_t>{30, 20}));
    expect_state(kept.at(source), source, 30);
    expect_state(kept.at(source), source, 20);
  }
  // Rank 1 loses its node's memory; its partner sends its copy of 20 back.
  const int lost = 1;
  if (me == lost) {
    own.reset();
    std::filesystem::remove_all(dir.path() / "own");
    std::filesystem::create_directory(dir.path() / "own");
    own = std::make_unique<MemorySlots>((dir.path() / "own").string());
    EXPECT_TRUE(own->held().empty());
  }
  const int keeper = rank::partners_of(nodes, lost).send_to;
  std::vector<char> no_header;
  std::vector<comm::WorkHandle> sends;
  if (me == keeper) sends = rank::send_copy(c, kept.at(lost).image(20), lost, no_header);
  if (me == lost) {
    EXPECT_EQ(rank::receive_copy(c, *own, keeper).value_or(-1), 20);
  }
  for (auto& s : sends) s->wait();
  if (me == lost) {
    EXPECT_EQ(own->held(), (std::vector<std::int64_t>{20}));
    expect_state(*own, lost, 20);
  }
  c.barrier();
}

}  // namespace
}  // namespace hpctrial
