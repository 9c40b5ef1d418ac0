// The pipeline's partitions (uniform, balanced, explicit) against DeepSpeed's results, and
// the 1F1B schedule: its order on the first and last stage, and for every small pipeline that
// each micro-batch runs forward then backward once, that no stage holds more activations than
// it says, that the stages together never wait on each other forever, and that with forwards and
// backwards of one tick each they finish in 2 (M + S - 1) ticks (the 1F1B bubble).
#include "parallel/pipeline_plan.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>

#include "hpctrial/core/error.h"

namespace hpctrial::trainer::detail {
namespace pipeline_plan_test {  // named: the target compiles its sources together (UNITY_BUILD)

using Bounds = std::vector<std::size_t>;
using testing::HasSubstr;

TEST(PipelinePartition, UniformGivesTheFirstStagesTheLayersLeftOver) {
  EXPECT_EQ(partition_uniform(8, 2), (Bounds{0, 4, 8}));
  EXPECT_EQ(partition_uniform(10, 4), (Bounds{0, 3, 6, 8, 10}));  // as DeepSpeed's partition_uniform
  EXPECT_EQ(partition_uniform(5, 1), (Bounds{0, 5}));
  EXPECT_EQ(partition_uniform(4, 4), (Bounds{0, 1, 2, 3, 4}));
  try {
    partition_uniform(3, 4);
    ADD_FAILURE() << "3 layers filled 4 stages";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("a pipeline of 3 layer(s) cannot fill 4 stages: each stage holds one layer or "
                                    "more; use fewer stages (engine.pipeline.stages)"));
  }
}

// DeepSpeed's partition_balanced (deepspeed/runtime/utils.py at 38327e0, lines 583-621): the
// expected bounds are what its dynamic program returns for the same weights, run by hand in
// Python (its numpy arrays as lists of floats).
TEST(PipelinePartition, BalancedCutsWhereDeepSpeedsPartitionBalancedDoes) {
  EXPECT_EQ(partition_balanced(std::vector<std::int64_t>(8, 10), 2), (Bounds{0, 4, 8}));
  EXPECT_EQ(partition_balanced(std::vector<std::int64_t>(8, 10), 4), (Bounds{0, 2, 4, 6, 8}));
  EXPECT_EQ(partition_balanced({1, 1, 1, 1, 100, 1, 1, 1}, 3), (Bounds{0, 4, 5, 8}));
  EXPECT_EQ(partition_balanced({0, 5, 0, 5, 0}, 2), (Bounds{0, 3, 5}));
  EXPECT_EQ(partition_balanced({0, 0, 0}, 3), (Bounds{0, 1, 2, 3}));
  // An embedding, equal blocks and a head: stages of 70, 80 and 60, the smallest spread (20).
  EXPECT_EQ(partition_balanced({50, 20, 20, 20, 20, 20, 20, 40}, 3), (Bounds{0, 2, 6, 8}));
  EXPECT_THROW(partition_balanced({1, 2}, 3), ConfigError);
}

// A GPT-2-like model: an embedding of 39 383 808 parameters (50 257 x 768 tokens and 1 024 x 768
// positions), 12 blocks of 7 087 872, a LayerNorm of 1 536 and an untied head of 38 597 376. On 2
// to 8 stages, DeepSpeed's cuts; with the embedding frozen (its parameters do not train, so
// _count_layer_params counts 0), other cuts; and `type:block`, which weighs each block 1.
TEST(PipelinePartition, AGpt2LikeModelIsCutAsDeepSpeedCutsIt) {
  std::vector<std::int64_t> gpt = {39383808};
  for (int i = 0; i < 12; ++i) gpt.push_back(7087872);
  gpt.push_back(1536);
  gpt.push_back(38597376);
  const std::vector<Bounds> expected = {
      {0, 7, 15},          {0, 3, 11, 15},          {0, 1, 7, 13, 15},          {0, 1, 5, 9, 14, 15},
      {0, 1, 4, 7, 10, 14, 15}, {0, 1, 4, 7, 9, 11, 14, 15}, {0, 1, 3, 5, 7, 9, 11, 14, 15}};
  std::vector<std::int64_t> frozen = gpt;
  frozen[0] = 0;
  const std::vector<Bounds> expected_frozen = {
      {0, 10, 15},         {0, 7, 13, 15},          {0, 5, 9, 14, 15},          {0, 4, 7, 10, 14, 15},
      {0, 4, 7, 9, 11, 14, 15}, {0, 3, 5, 7, 9, 11, 14, 15}, {0, 3, 5, 7, 9, 11, 12, 14, 15}};
  std::vector<std::int64_t> blocks(15, 0);
  for (int i = 1; i <= 12; ++i) blocks[static_cast<std::size_t>(i)] = 1;
  const std::vector<Bounds> expected_type = {
      {0, 7, 15},          {0, 5, 9, 15},           {0, 4, 7, 10, 15},          {0, 4, 7, 9, 11, 15},
      {0, 3, 5, 7, 9, 11, 15},  {0, 3, 5, 7, 9, 11, 12, 15},  {0, 3, 5, 7, 9, 10, 11, 12, 15}};
  for (int stages = 2; stages <= 8; ++stages) {
    const auto i = static_cast<std::size_t>(stages - 2);
    EXPECT_EQ(partition_balanced(gpt, stages), expected[i]) << stages << " stages";
    EXPECT_EQ(partition_balanced(frozen, stages), expected_frozen[i]) << stages << " stages, embedding frozen";
    EXPECT_EQ(partition_balanced(blocks, stages), expected_type[i]) << stages << " stages, type:block";
  }
  // On 6 stages: the embedding alone, 3 + 3 + 3 blocks, 3 blocks and the LayerNorm, the head
  // alone - no stage holding only the LayerNorm.
  EXPECT_EQ(partition_balanced(gpt, 6), (Bounds{0, 1, 4, 7, 10, 14, 15}));
}

TEST(PipelinePartition, ExplicitBoundsAreCheckedWithTheFix) {
  EXPECT_EQ(partition_explicit({0, 1, 8}, 8, 2), (Bounds{0, 1, 8}));
  try {
    partition_explicit({0, 4}, 8, 2);
    ADD_FAILURE();
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("the pipeline's stage bounds [0, 4] name 2 bounds; 2 stages need 3: the first "
                                    "layer of each stage, then 8 (the number of layers)"));
  }
  try {
    partition_explicit({0, 4, 4, 8}, 8, 3);
    ADD_FAILURE();
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("leave stage 1 without a layer"));
  }
  EXPECT_THROW(partition_explicit({1, 4, 8}, 8, 2), ConfigError);
  EXPECT_THROW(partition_explicit({0, 4, 7}, 8, 2), ConfigError);
}

TEST(Schedule1F1B, FillsThePipelineThenAlternatesThenDrains) {
  EXPECT_EQ(to_string(schedule_1f1b(4, 0, 8)), "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7");
  EXPECT_EQ(to_string(schedule_1f1b(4, 2, 8)), "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7");
  EXPECT_EQ(to_string(schedule_1f1b(4, 3, 8)), "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7");
  // Fewer micro-batches than stages: every forward first.
  EXPECT_EQ(to_string(schedule_1f1b(4, 0, 2)), "F0 F1 B0 B1");
  EXPECT_EQ(to_string(schedule_1f1b(1, 0, 3)), "F0 B0 F1 B1 F2 B2");
  EXPECT_EQ(in_flight_1f1b(4, 0, 8), 4);
  EXPECT_EQ(in_flight_1f1b(4, 3, 8), 1);
  EXPECT_EQ(in_flight_1f1b(4, 0, 2), 2);
  EXPECT_THROW(schedule_1f1b(2, 2, 4), InternalError);
  EXPECT_THROW(schedule_1f1b(2, 0, 0), InternalError);
}

// Each stage runs its schedule one operation a tick, an operation starting once what it takes
// from a neighbour was made in an earlier tick.
int ticks_to_finish(int stages, std::int64_t micro_batches) {
  std::vector<std::vector<PipeOp>> schedules;
  for (int s = 0; s < stages; ++s) schedules.push_back(schedule_1f1b(stages, s, micro_batches));
  // done[s][kind][micro-batch]: the tick it finished, or -1.
  std::vector<std::vector<std::vector<int>>> done(
      stages, std::vector<std::vector<int>>(2, std::vector<int>(static_cast<std::size_t>(micro_batches), -1)));
  std::vector<std::size_t> next(stages, 0);
  int tick = 0;
  while (true) {
    bool all = true, moved = false;
    ++tick;
    for (int s = 0; s < stages; ++s) {
      if (next[s] == schedules[s].size()) continue;
      all = false;
      const PipeOp op = schedules[s][next[s]];
      const auto mb = static_cast<std::size_t>(op.micro_batch);
      const bool forward = op.kind == PipeOp::Kind::kForward;
      const int from = forward ? s - 1 : s + 1;  // the neighbour it takes from
      const bool ready = from < 0 || from >= stages ||
                         (done[from][forward ? 0 : 1][mb] >= 0 && done[from][forward ? 0 : 1][mb] < tick);
      // A backward takes its own forward's activations too.
      const bool own = forward || (done[s][0][mb] >= 0 && done[s][0][mb] < tick);
      if (ready && own) {
        done[s][forward ? 0 : 1][mb] = tick;
        ++next[s];
        moved = true;
      }
    }
    if (all) return tick - 1;
    if (!moved) return -1;  // every stage waits: a deadlock
  }
}

TEST(Schedule1F1B, EveryPipelineFinishesInTheIdealTicksAndHoldsNoMoreThanItSays) {
  for (int stages = 1; stages <= 5; ++stages) {
    for (std::int64_t micro = 1; micro <= 9; ++micro) {
      for (int stage = 0; stage < stages; ++stage) {
        const auto ops = schedule_1f1b(stages, stage, micro);
        ASSERT_EQ(ops.size(), static_cast<std::size_t>(2 * micro));
        std::vector<int> seen(static_cast<std::size_t>(micro), 0);
        std::int64_t held = 0, most = 0;
        for (const auto& op : ops) {
          auto& state = seen[static_cast<std::size_t>(op.micro_batch)];
          if (op.kind == PipeOp::Kind::kForward) {
            EXPECT_EQ(state, 0) << "forward twice or after backward";
            state = 1;
            most = std::max(most, ++held);
          } else {
            EXPECT_EQ(state, 1) << "backward before forward";
            state = 2;
            --held;
          }
        }
        EXPECT_EQ(most, in_flight_1f1b(stages, stage, micro)) << stages << " stages, stage " << stage;
      }
      EXPECT_EQ(ticks_to_finish(stages, micro), 2 * (micro + stages - 1)) << stages << " stages, " << micro;
    }
  }
}

}  // namespace pipeline_plan_test
}  // namespace hpctrial::trainer::detail
