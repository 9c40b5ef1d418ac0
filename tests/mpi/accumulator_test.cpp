// Accumulators on 1, 2 and 4 ranks: every rank's updates summed at the guard and at checkpoints,
// the same bits on every rank, mistakes that fail every rank alike, and sums that survive a
// restart at another number of ranks - of the registry alone and of a trial paused by the loop.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <atomic>
#include <filesystem>

#include "../unit/trainer/test_trial.h"
#include "hpctrial/comm/communicator.h"
#include "hpctrial/comm/watchdog.h"
#include "hpctrial/trainer/accumulator.h"
#include "mpi_test_env.h"

namespace hpctrial::trainer {
namespace {

using testing::HasSubstr;
using testing_mpi::env;
using namespace testing_trial;

TEST(Accumulator, SumsEveryRanksUpdatesInSynchronizedMode) {
  comm::MpiCommunicator comm(env().world());
  const int rank = comm.rank(), size = comm.size();
  Accumulator accum("validation", comm);
  accum["loss_sum"] += 0.1 * (rank + 1);
  accum["total"] += 10;
  accum["rank" + std::to_string(rank)] += 1;  // keys that only one rank has
  {
    auto guard = accum.synchronized();
    EXPECT_EQ(accum.size(), static_cast<std::size_t>(2 + size));
    double expected = 0;
    for (int r = 0; r < size; ++r) expected += 0.1 * (r + 1);  // in rank order, as the accumulator adds
    EXPECT_EQ(accum.at("loss_sum"), expected);
    EXPECT_EQ(accum.at("total"), 10.0 * size);
    for (int r = 0; r < size; ++r) EXPECT_EQ(accum.at("rank" + std::to_string(r)), 1.0);
    accum["loss_avg"] = accum["loss_sum"] / accum["total"];
  }
  // The same bits everywhere: the chief's sums, broadcast, equal every rank's.
  std::string mine = accum.state_dict().dump(), chiefs = mine;
  comm.broadcast(chiefs, 0);
  EXPECT_EQ(mine, chiefs);
  accum["total"] += 1;
  auto guard = accum.synchronized();
  EXPECT_EQ(accum.at("total"), 11.0 * size);
  EXPECT_TRUE(accum.contains("loss_avg"));
}

TEST(Accumulator, RanksThatSynchronizeDifferentAccumulatorsFailAlike) {
  comm::MpiCommunicator comm(env().world());
  if (comm.size() == 1) GTEST_SKIP() << "needs two ranks";
  Accumulator a("a", comm), b("b", comm);
  try {
    auto guard = (comm.rank() == 0 ? a : b).synchronized();
    ADD_FAILURE() << "rank " << comm.rank() << " synchronized";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("ranks synchronize different accumulators at the same point"));
  }
  comm.barrier();
}

TEST(Accumulators, RanksThatMadeDifferentAccumulatorsFailAlikeAtACheckpoint) {
  comm::MpiCommunicator comm(env().world());
  if (comm.size() == 1) GTEST_SKIP() << "needs two ranks";
  detail::Accumulators registry(comm);
  registry.make("train");
  if (comm.rank() == comm.size() - 1) registry.make("extra");
  try {
    registry.synchronize_all();
    ADD_FAILURE() << "rank " << comm.rank() << " synchronized";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("the ranks made different accumulators"));
    EXPECT_THAT(e.what(), HasSubstr("make the same accumulators in the same order on every rank"));
  }
  comm.barrier();
}

// Samples 0..99 in turn across the ranks: 0..39 on every rank of the world, then - after the
// state is saved - 40..99 on half of them (the world of one keeps its one). The sums equal those
// of all 100 samples, whatever took which.
TEST(Accumulators, ARestartAtAnotherWorldSizeKeepsTheSums) {
  comm::MpiCommunicator world(env().world());
  nlohmann::json saved;
  {
    detail::Accumulators registry(world);
    auto accum = registry.make("seen");
    for (int sample = world.rank(); sample < 40; sample += world.size()) {
      (*accum)["count"] += 1;
      (*accum)["sum"] += sample;
    }
    registry.synchronize_all();  // what a checkpoint does
    saved = registry.state_dict();
  }
  const int restarted_size = std::max(1, world.size() / 2);
  auto group = world.split(world.rank() < restarted_size ? 0 : 1, world.rank());
  if (world.rank() < restarted_size) {
    ASSERT_EQ(group->size(), restarted_size);
    detail::Accumulators registry(*group);
    registry.load_state_dict(saved);
    auto accum = registry.make("seen");
    for (int sample = 40 + group->rank(); sample < 100; sample += group->size()) {
      (*accum)["count"] += 1;
      (*accum)["sum"] += sample;
    }
    auto guard = accum->synchronized();
    EXPECT_EQ(accum->at("count"), 100.0);
    EXPECT_EQ(accum->at("sum"), 4950.0);
  }
  world.barrier();
}

std::string shared_dir(const std::string& name) { return testing_mpi::shared_dir("hpctrial-accum", name); }

struct AccumulatorRun {
  LoopResult result;
  Accumulator::Values sums;
};

// 7 batches of 8 records; every batch each rank adds its records and 1/size of a batch. Stopped
// after `stop_after` batches by `stopping_rank`.
AccumulatorRun train(comm::Communicator& comm, const std::string& dir, std::int64_t stop_after, int stopping_rank) {
  std::atomic<bool> stop{false};
  std::shared_ptr<Accumulator> accum;
  LinearTrial::Options options;
  options.samples = 24;
  options.setup = [&](LinearTrial& trial) { accum = trial.context_.make_accumulator("progress"); };
  options.after_batch = [&](LinearTrial& trial, std::int64_t batch_idx) {
    (*accum)["records"] += static_cast<double>(trial.context_.per_slot_batch_size());
    (*accum)["batches"] += 1.0 / comm.size();
    (*accum)["last_batch"] += 0;
    if (batch_idx + 1 == stop_after && comm.rank() == stopping_rank) stop = true;
  };
  LoopOptions loop;
  loop.trial_dir = dir;
  loop.progress_interval_s = 0;
  loop.experiment_seed = 7;
  loop.distributed = {comm.rank(), comm.size(), comm.rank(), comm.size(), 1};
  loop.external_stop = &stop;
  TrialFactory factory = [&](TrialContext& context) {
    return std::unique_ptr<Trial>(std::make_unique<LinearTrial>(context, options, nullptr));
  };
  AccumulatorRun out;
  out.result = run_training(config_from(base_yaml(7, 8)), factory, comm, loop);
  auto guard = accum->synchronized();
  out.sums = accum->values();
  return out;
}

// A trial paused after batch 3 (by the chief, then by the last rank) and resumed on half the
// ranks ends with the sums of an uninterrupted run: 56 records, 7 batches.
TEST(Accumulators, ATrialsSumsSurviveAPauseAndAResumeOnFewerRanks) {
  comm::MpiCommunicator world(env().world());
  for (const int stopping_rank : {0, world.size() - 1}) {
    const std::string dir = shared_dir("trial-" + std::to_string(stopping_rank));
    const AccumulatorRun paused = train(world, dir, 3, stopping_rank);
    EXPECT_TRUE(paused.result.stopped_early);
    EXPECT_EQ(paused.sums.at("records"), 24.0);
    const int restarted_size = std::max(1, world.size() / 2);
    auto group = world.split(world.rank() < restarted_size ? 0 : 1, world.rank());
    if (world.rank() < restarted_size) {
      const AccumulatorRun resumed = train(*group, dir, -1, 0);
      EXPECT_FALSE(resumed.result.stopped_early);
      EXPECT_EQ(resumed.result.batches_trained, 7);
      EXPECT_EQ(resumed.sums.at("records"), 56.0) << "stopped by rank " << stopping_rank;
      EXPECT_EQ(resumed.sums.at("batches"), 7.0);
    }
    world.barrier();
    if (env().is_chief()) std::filesystem::remove_all(dir);
  }
}

}  // namespace
}  // namespace hpctrial::trainer
