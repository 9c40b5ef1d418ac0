#include "hpctrial/trainer/sampler.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <set>

#include "hpctrial/core/error.h"
#include "hpctrial/trainer/random.h"

namespace hpctrial::trainer {
namespace sampler_test {  // named: the target compiles its sources together (UNITY_BUILD)

using testing::ElementsAre;
using testing::HasSubstr;

// Global batch `k` assembled from every rank's slice, in rank order.
std::vector<std::int64_t> global_batch(std::uint64_t n, std::uint64_t seed, std::uint64_t g, int world,
                                       std::uint64_t k) {
  std::vector<std::int64_t> all;
  for (int r = 0; r < world; ++r) {
    TrainingSampler sampler(StreamOrder(n, seed, true), g, r, world, k * g);
    const auto slice = sampler.next_batch();
    EXPECT_EQ(slice.size(), g / static_cast<std::uint64_t>(world));
    all.insert(all.end(), slice.begin(), slice.end());
  }
  return all;
}

TEST(TrainingSampler, GlobalBatchesDoNotDependOnTheNumberOfRanks) {
  const std::uint64_t n = 1000, g = 24;
  for (std::uint64_t k : {0, 1, 41, 42, 100}) {  // 41 and 42 straddle the first epoch's end
    const auto reference = global_batch(n, 7, g, 1, k);
    for (int world : {2, 3, 4, 6, 8}) {
      EXPECT_EQ(global_batch(n, 7, g, world, k), reference) << "batch " << k << ", " << world << " ranks";
    }
  }
}

TEST(TrainingSampler, ResumesExactlyAtAnyPosition) {
  const std::uint64_t n = 97, g = 8;  // epochs end mid-batch
  TrainingSampler straight(StreamOrder(n, 3, true), g, 1, 2);
  std::vector<std::vector<std::int64_t>> batches;
  for (int i = 0; i < 60; ++i) batches.push_back(straight.next_batch());
  for (std::uint64_t k : {0, 1, 12, 13, 30, 59}) {
    TrainingSampler resumed(StreamOrder(n, 3, true), g, 1, 2, k * g);
    for (std::uint64_t i = k; i < 60; ++i) {
      ASSERT_EQ(resumed.next_batch(), batches[i]) << "resumed at batch " << k << ", batch " << i;
    }
  }
  EXPECT_EQ(straight.position(), 60 * g);
}

TEST(TrainingSampler, AnEpochSeesEverySampleExactlyOnce) {
  const std::uint64_t n = 120, g = 12;
  for (int world : {1, 2, 3, 4}) {
    std::vector<TrainingSampler> ranks;
    for (int r = 0; r < world; ++r) ranks.emplace_back(StreamOrder(n, 11, true), g, r, world);
    for (int epoch = 0; epoch < 3; ++epoch) {
      std::multiset<std::int64_t> seen;
      for (std::uint64_t b = 0; b < n / g; ++b) {
        for (auto& sampler : ranks) {
          for (auto index : sampler.next_batch()) seen.insert(index);
        }
      }
      ASSERT_EQ(seen.size(), n);
      for (std::int64_t i = 0; i < static_cast<std::int64_t>(n); ++i) {
        ASSERT_EQ(seen.count(i), 1u) << "sample " << i << ", epoch " << epoch << ", " << world << " ranks";
      }
    }
  }
}

TEST(TrainingSampler, SetEpochContinuesAnEpochAtAnIndexAsElasticSamplerDoes) {
  const std::uint64_t n = 96, g = 8;
  StreamOrder order(n, 5, true);
  TrainingSampler straight(order, g, 0, 2);
  for (int i = 0; i < 15; ++i) straight.next_batch();  // epoch 1, index 24
  EXPECT_EQ(straight.epoch(), 1u);
  EXPECT_EQ(straight.index(), 24u);
  // Resumed on 4 ranks at the saved (epoch, index): the rest of epoch 1, each sample once.
  std::multiset<std::int64_t> seen;
  for (int r = 0; r < 4; ++r) {
    TrainingSampler resumed(order, g, r, 4);
    resumed.set_epoch(1, 24);
    while (resumed.epoch() == 1) {
      for (auto index : resumed.next_batch()) seen.insert(index);
    }
  }
  StreamOrder reference(n, 5, true);
  std::multiset<std::int64_t> expected;
  for (std::uint64_t p = n + 24; p < 2 * n; ++p) expected.insert(static_cast<std::int64_t>(reference.at(p)));
  EXPECT_EQ(seen, expected);
  TrainingSampler fresh(order, g, 0, 1);
  fresh.set_epoch(3);
  EXPECT_EQ(fresh.position(), 3 * n);
  try {
    fresh.set_epoch(2, n + 1);
    FAIL() << "an index past the epoch was taken";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("set_epoch(2, 97): an epoch has 96 records"));
  }
}

TEST(StreamOrder, EpochsAreDifferentPermutationsFixedBySeed) {
  StreamOrder a(50, 1, true), b(50, 1, true), c(50, 2, true);
  std::vector<std::uint64_t> epoch0, epoch1, other_seed;
  for (std::uint64_t p = 0; p < 50; ++p) {
    epoch0.push_back(a.at(p));
    other_seed.push_back(c.at(p));
  }
  for (std::uint64_t p = 50; p < 100; ++p) epoch1.push_back(a.at(p));
  EXPECT_NE(epoch0, epoch1);
  EXPECT_NE(epoch0, other_seed);
  for (std::uint64_t p = 0; p < 50; ++p) EXPECT_EQ(b.at(p), epoch0[p]);
  // Random access in any order gives the same values.
  EXPECT_EQ(a.at(3), epoch0[3]);
  EXPECT_EQ(a.at(77), epoch1[27]);
}

TEST(StreamOrder, TheOrderIsPinned) {
  // The data order of existing experiments must never change: these values are fixed.
  StreamOrder order(10, 42, true);
  std::vector<std::uint64_t> first;
  for (std::uint64_t p = 0; p < 10; ++p) first.push_back(order.at(p));
  EXPECT_THAT(first, ElementsAre(3, 8, 4, 2, 1, 6, 9, 0, 7, 5));
  EXPECT_EQ(derive_seed(42, 0), 5043374705829640723ULL);
}

// append() is at() of each position, across epochs, shuffled or not, with a prefix epoch or not.
TEST(StreamOrder, AppendGivesWhatAtGivesPositionByPosition) {
  for (const bool shuffle : {true, false}) {
    for (const std::uint64_t per_epoch : {0, 7}) {
      for (const std::uint64_t first : {0, 5, 13, 29}) {
        StreamOrder by_position(23, 4, shuffle, per_epoch), by_run(23, 4, shuffle, per_epoch);
        std::vector<std::int64_t> appended = {-1};
        by_run.append(first, 40, appended);
        ASSERT_EQ(appended.size(), 41u);
        EXPECT_EQ(appended[0], -1) << "appended after what was there";
        for (std::uint64_t i = 0; i < 40; ++i) {
          EXPECT_EQ(static_cast<std::uint64_t>(appended[i + 1]), by_position.at(first + i))
              << "shuffle " << shuffle << ", records_per_epoch " << per_epoch << ", position " << first + i;
        }
      }
    }
  }
}

TEST(StreamOrder, WithoutShuffleIsSequentialAndRecordsPerEpochTakesAPrefix) {
  StreamOrder plain(5, 9, false);
  for (std::uint64_t p = 0; p < 12; ++p) EXPECT_EQ(plain.at(p), p % 5);
  StreamOrder prefix(100, 9, true, 10);
  std::set<std::uint64_t> epoch;
  for (std::uint64_t p = 0; p < 10; ++p) epoch.insert(prefix.at(p));
  EXPECT_EQ(epoch.size(), 10u);
  EXPECT_EQ(prefix.epoch_of(10), 1u);
}

// ElasticSampler.__len__'s counterpart: 100 records an epoch in global batches of 12 over 4 ranks
// (3 each) are 8 whole batches - 24 records a rank - and 4 records of a ninth batch, which go to
// rank 0 (3) and rank 1 (1): 27, 25, 24, 24, every record once (AdaptDL: ceil(100 / 4) = 25 each,
// padded by repeating a record). From index 50: 4 whole batches and 2 records, 14, 12, 12, 12.
TEST(TrainingSampler, RemainingInEpochCountsThisRanksRecordsOfTheEpoch) {
  const StreamOrder order(100, 3, true);
  const std::vector<std::uint64_t> from_start = {27, 25, 24, 24}, from_50 = {14, 12, 12, 12};
  for (int r = 0; r < 4; ++r) {
    TrainingSampler sampler(order, 12, r, 4);
    EXPECT_EQ(sampler.remaining_in_epoch(), from_start[static_cast<std::size_t>(r)]) << "rank " << r;
    sampler.set_epoch(0, 50);
    EXPECT_EQ(sampler.remaining_in_epoch(), from_50[static_cast<std::size_t>(r)]) << "rank " << r;
    // What the batches hand this rank before the epoch's end, position by position.
    std::uint64_t taken = 0;
    for (std::uint64_t first = 50; first < 100; first += 12) {
      const std::uint64_t mine = first + static_cast<std::uint64_t>(r) * 3;
      for (std::uint64_t p = mine; p < mine + 3; ++p) taken += p < 100 ? 1 : 0;
    }
    EXPECT_EQ(sampler.remaining_in_epoch(), taken) << "rank " << r;
    sampler.set_epoch(1, 99);  // the epoch's last record: rank 0's
    EXPECT_EQ(sampler.remaining_in_epoch(), r == 0 ? 1u : 0u);
  }
}

TEST(TrainingSampler, ImpossibleSizesAreClearErrors) {
  try {
    StreamOrder(0, 1, true);
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("the training dataset is empty"));
  }
  try {
    StreamOrder(10, 1, true, 11);
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("records_per_epoch (11) is larger than the training dataset (10 records)"));
  }
  try {
    TrainingSampler(StreamOrder(10, 1, true), 10, 0, 3);
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("global batch size (10) must be a positive multiple of the number of ranks (3)"));
  }
}

TEST(ValidationBatches, EverySampleOnceAcrossRanksInOrder) {
  for (int world : {1, 2, 3, 7}) {
    std::vector<std::int64_t> all;
    for (int r = 0; r < world; ++r) {
      for (const auto& batch : validation_batches(23, 4, r, world)) {
        EXPECT_LE(batch.size(), 4u);
        all.insert(all.end(), batch.begin(), batch.end());
      }
    }
    std::vector<std::int64_t> expected(23);
    std::iota(expected.begin(), expected.end(), 0);
    EXPECT_EQ(all, expected) << world << " ranks";
  }
  EXPECT_TRUE(validation_batches(2, 4, 3, 4).empty());
}

TEST(Rng, BoundedIsUniformEnough) {
  Rng rng(5);
  std::vector<int> counts(6, 0);
  for (int i = 0; i < 60000; ++i) ++counts[rng.bounded(6)];
  for (int c : counts) EXPECT_NEAR(c, 10000, 500);
}

TEST(EpochRecords, DropLastKeepsWholeGlobalBatches) {
  EXPECT_EQ(epoch_records(60, 8, false), 60u);
  EXPECT_EQ(epoch_records(60, 8, true), 56u);
  EXPECT_EQ(epoch_records(64, 8, true), 64u);
  EXPECT_EQ(epoch_records(8, 8, true), 8u);
  try {
    epoch_records(7, 8, true);
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), testing::HasSubstr("drop_last with an epoch of 7 records and a global batch of 8"));
  }
}

}  // namespace sampler_test
}  // namespace hpctrial::trainer
