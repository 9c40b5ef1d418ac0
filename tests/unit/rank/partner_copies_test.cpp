// The partner level's ring of nodes: each rank's partner is on the next node, at its place among
// that node's ranks; every rank's copies are kept by exactly one other rank; one node has none.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <vector>

#include "../../support/temp_dir.h"
#include "hpctrial/rank/partner_copies.h"

namespace hpctrial::rank {
namespace {

// Every rank's partner and sources, checked to agree: r sends to p exactly when p receives from r.
std::vector<int> ring(const std::vector<int>& nodes) {
  std::vector<int> send_to;
  std::map<int, std::vector<int>> receives;
  for (int r = 0; r < static_cast<int>(nodes.size()); ++r) {
    const Partners p = partners_of(nodes, r);
    send_to.push_back(p.send_to);
    receives[r] = p.receive_from;
  }
  for (int r = 0; r < static_cast<int>(nodes.size()); ++r) {
    std::vector<int> sources;
    for (int s = 0; s < static_cast<int>(nodes.size()); ++s) {
      if (send_to[static_cast<std::size_t>(s)] == r) sources.push_back(s);
    }
    EXPECT_EQ(receives[r], sources) << "rank " << r;
    if (send_to[static_cast<std::size_t>(r)] >= 0) {
      EXPECT_NE(nodes[static_cast<std::size_t>(send_to[static_cast<std::size_t>(r)])], nodes[static_cast<std::size_t>(r)])
          << "rank " << r << "'s partner is on its own node";
    }
  }
  return send_to;
}

TEST(PartnerCopies, ThePartnersFormARingOfTheNodes) {
  EXPECT_EQ(ring({0, 0, 0, 0}), (std::vector<int>{-1, -1, -1, -1})) << "one node: no partner";
  EXPECT_EQ(ring({0, 0, 1, 1}), (std::vector<int>{2, 3, 0, 1}));
  EXPECT_EQ(ring({0, 1, 2}), (std::vector<int>{1, 2, 0}));
  EXPECT_EQ(ring({0, 1, 0, 1}), (std::vector<int>{1, 0, 3, 2})) << "ranks placed by turns";
  EXPECT_EQ(ring({7, 7, 3, 3}), (std::vector<int>{2, 3, 0, 1})) << "any numbering of the nodes";
  // Nodes with fewer ranks: a rank keeps the copies of more than one.
  EXPECT_EQ(ring({0, 0, 0, 1}), (std::vector<int>{3, 3, 3, 0}));
  EXPECT_EQ(partners_of({0, 0, 0, 1}, 3).receive_from, (std::vector<int>{0, 1, 2}));
}

TEST(PartnerCopies, TheFoldersOfKeptCopiesNameTheirRanks) {
  testing_support::TempDir dir;
  const std::string rank_dir = dir.path().string();
  EXPECT_EQ(partner_dir(rank_dir, 3), rank_dir + "/partner-3");
  for (const char* name : {"partner-3", "partner-12", "partner-", "partner-x", "slot-0", "partner-1"}) {
    std::filesystem::create_directory(dir.path() / name);
  }
  EXPECT_EQ(partner_sources(rank_dir), (std::vector<int>{1, 3, 12}));
}

}  // namespace
}  // namespace hpctrial::rank
