// The training order as the ranks saw it, for the tests that count records across batch changes
// and restarts: every rank's indices, batch by batch, gathered on the chief.
#pragma once

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "hpctrial/comm/communicator.h"

namespace hpctrial::testing_mpi {

// Every rank's indices, batch by batch, put back into the training order: batch k of the whole
// job is the ranks' slices of it in rank order. A collective; the order on the chief, empty elsewhere.
inline std::vector<std::int64_t> training_order(comm::Communicator& comm,
                                                const std::vector<std::vector<std::int64_t>>& seen) {
  nlohmann::json mine = seen;
  const auto all = comm.gather(mine.dump(), 0);
  std::vector<std::int64_t> order;
  if (!comm.is_chief()) return order;
  std::vector<std::vector<std::vector<std::int64_t>>> ranks;
  for (const auto& text : all) ranks.push_back(nlohmann::json::parse(text).get<std::vector<std::vector<std::int64_t>>>());
  for (std::size_t batch = 0; batch < ranks.front().size(); ++batch) {
    for (const auto& rank : ranks) order.insert(order.end(), rank.at(batch).begin(), rank.at(batch).end());
  }
  return order;
}

// Each whole pass of `records` records in `order` holds every record once; at least `passes` of them.
inline void expect_each_record_once_a_pass(const std::vector<std::int64_t>& order, std::size_t records,
                                           std::size_t passes, const std::string& what) {
  ASSERT_GE(order.size(), passes * records) << what << ": fewer than " << passes << " passes";
  for (std::size_t pass = 0; pass + 1 <= order.size() / records; ++pass) {
    std::map<std::int64_t, int> count;
    for (std::size_t i = pass * records; i < (pass + 1) * records; ++i) ++count[order[i]];
    EXPECT_EQ(count.size(), records) << what << ", pass " << pass << " skipped records";
    for (const auto& [index, n] : count) EXPECT_EQ(n, 1) << what << ", pass " << pass << ": record " << index;
  }
}

}  // namespace hpctrial::testing_mpi
