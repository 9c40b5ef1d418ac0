// ZeRO's sharded optimizer step on 2 and 4 ranks: each rank keeps 1/N of the optimizer state,
// and the weights follow those of a replicated optimizer over averaged gradients (stage 0) for
// every element-wise LibTorch optimizer.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <tuple>
#include <optional>

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "state/sharded_checkpoint.h"
#include "parallel/zero.h"
#include "state/state_io.h"
#include "hpctrial/checkpoint/store.h"
#include "hpctrial/comm/communicator.h"
#include "hpctrial/core/error.h"
#include "mpi_test_env.h"

namespace hpctrial::trainer::detail {
namespace zero_test {  // named: the target compiles its sources together (UNITY_BUILD)

using testing::ElementsAre;
using testing::HasSubstr;
using testing_mpi::env;

TEST(FlatLayout, BucketsHoldWholeParametersPaddedToTheRanks) {
  // Filled from the last parameter back, closing a bucket before it passes 8 elements.
  const FlatLayout layout = flat_layout({6, 1, 5, 3, 20}, 4, 8);
  ASSERT_EQ(layout.buckets.size(), 3u);
  EXPECT_EQ(layout.total, 35);
  // {6, 1}: 7 elements, parts of 2; {5, 3}: 8, parts of 2; {20} alone: parts of 5.
  EXPECT_EQ(layout.buckets[0].first, 0u);
  EXPECT_EQ(layout.buckets[0].end, 2u);
  EXPECT_EQ(layout.buckets[0].part, 2);
  EXPECT_EQ(layout.buckets[1].first, 2u);
  EXPECT_EQ(layout.buckets[1].end, 4u);
  EXPECT_EQ(layout.buckets[1].begin, 8);
  EXPECT_EQ(layout.buckets[2].begin, 16);
  EXPECT_EQ(layout.buckets[2].part, 5);
  EXPECT_THAT(layout.offsets, ElementsAre(0, 6, 8, 13, 16));
  EXPECT_THAT(layout.bucket_of, ElementsAre(0, 0, 1, 1, 2));
  EXPECT_EQ(layout.size, 36);
  EXPECT_EQ(layout.shard(), 9);
  // One bucket when the cap is large: the parameters end to end, one padding element.
  const FlatLayout one = flat_layout({6, 1, 5}, 4, 1000);
  ASSERT_EQ(one.buckets.size(), 1u);
  EXPECT_THAT(one.offsets, ElementsAre(0, 6, 7));
  EXPECT_EQ(one.shard(), 3);
  EXPECT_EQ(one.size, 12);
}

TEST(PartitionLayout, EachParameterIsPaddedToTheRanksAlone) {
  // DeepSpeed's stage 3: ceil(numel / ranks) elements a rank, for each parameter on its own.
  const FlatLayout layout = partition_layout({6, 1, 5, 3, 20, 0}, 4);
  ASSERT_EQ(layout.buckets.size(), 6u);
  EXPECT_THAT(layout.offsets, ElementsAre(0, 8, 12, 20, 24, 44));
  EXPECT_THAT(layout.bucket_of, ElementsAre(0, 1, 2, 3, 4, 5));
  std::vector<std::int64_t> parts;
  for (const auto& bucket : layout.buckets) parts.push_back(bucket.part);
  EXPECT_THAT(parts, ElementsAre(2, 1, 2, 1, 5, 0));
  EXPECT_EQ(layout.total, 35);
  EXPECT_EQ(layout.size, 44);
  EXPECT_EQ(layout.shard(), 11);
}

struct NetImpl : torch::nn::Module {
  NetImpl() : a(register_module("a", torch::nn::Linear(7, 5))), b(register_module("b", torch::nn::Linear(5, 3))) {}
  torch::Tensor forward(const torch::Tensor& x) { return b->forward(torch::tanh(a->forward(x))); }
  torch::nn::Linear a, b;
};
TORCH_MODULE(Net);

Net seeded(std::uint64_t seed) {
  torch::manual_seed(seed);
  return Net();
}

// A Net seeded alike on every rank, its initial values, Adam over it, and the elements of a
// rank's parts of it at stage 3.
struct SeededNet {
  explicit SeededNet(int ranks) {
    for (const auto& p : net->parameters()) {
      initial.push_back(p.detach().clone());
      share += (p.numel() + ranks - 1) / ranks;
    }
  }
  Net net = seeded(3);
  std::vector<torch::Tensor> initial;
  torch::optim::Adam adam{net->parameters(), torch::optim::AdamOptions(0.01)};
  std::int64_t share = 0;
};

using MakeOptimizer = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>)>;

// Trains `steps` steps on this rank's own batches and returns the final parameters: with a
// replicated optimizer over averaged gradients (`zero` null), or sharded. Parameter `a.bias` gets
// no gradient on the last rank in odd steps (a branch the loss does not reach everywhere). Odd
// steps' backward does not say it ends the step (stage 1 then reduces at the step), even ones
// do; `gradient_elements`: what the last step's backward left. With zero_options->partitions,
// the Net is built partitioned into it (context.layered_module's construction) before the
// optimizer is made.
std::vector<torch::Tensor> train(const MakeOptimizer& make, const ZeroOptions* zero_options, comm::Communicator& comm,
                                 int steps, std::int64_t* state_elements = nullptr,
                                 std::int64_t* gradient_elements = nullptr,
                                 const std::function<void(ShardedOptimizer&)>& inspect = {}) {
  torch::manual_seed(3);  // the same initial weights on every rank
  Net net;
  if (zero_options != nullptr && zero_options->partitions != nullptr) zero_options->partitions->partition(*net);
  auto optimizer = make(net->parameters());
  std::unique_ptr<ShardedOptimizer> zero;
  if (zero_options != nullptr) zero = std::make_unique<ShardedOptimizer>(*optimizer, comm, *zero_options);
  for (int step = 0; step < steps; ++step) {
    torch::manual_seed(100 + 10 * step + comm.rank());  // each rank's own batch
    const auto x = torch::randn({4, 7});
    const auto y = torch::randn({4, 3});
    const bool skip_bias = step % 2 == 1 && comm.rank() == comm.size() - 1;
    if (zero) zero->gather_all();  // stage 3: every parameter whole for this forward
    const auto hidden = skip_bias ? torch::nn::functional::linear(x, net->a->weight) : net->a->forward(x);
    auto loss = torch::mse_loss(net->b->forward(torch::tanh(hidden)), y);
    if (zero) {
      zero->zero_grad();
      zero->begin_backward(step % 2 == 0);
      loss.backward();
      zero->release_all();  // stage 3: backward is done with the whole values
      zero->end_backward();
      if (gradient_elements != nullptr) *gradient_elements = zero->gradient_elements();
      zero->step();
    } else {
      optimizer->zero_grad();
      loss.backward();
      for (auto& p : net->parameters()) {
        if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
        comm.allreduce(p.grad().data_ptr(), static_cast<std::size_t>(p.numel()), comm::DType::kFloat32,
                       comm::ReduceOp::kAvg);
      }
      optimizer->step();
    }
  }
  if (state_elements != nullptr) {
    *state_elements = 0;
    for (const auto& [key, state] : optimizer->state()) {
      if (auto* adam = dynamic_cast<torch::optim::AdamParamState*>(state.get())) {
        *state_elements += adam->exp_avg().numel() + adam->exp_avg_sq().numel();
      }
    }
  }
  if (zero && inspect) inspect(*zero);
  if (zero) zero->gather_all();
  std::vector<torch::Tensor> out;
  for (const auto& p : net->parameters()) out.push_back(p.detach().clone());
  return out;
}

TEST(ShardedOptimizer, EveryElementwiseOptimizerFollowsTheReplicatedOne) {
  comm::MpiCommunicator comm(env().world());
  const std::vector<std::pair<std::string, MakeOptimizer>> optimizers = {
      {"sgd", [](std::vector<torch::Tensor> p) -> std::unique_ptr<torch::optim::Optimizer> {
         return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.01));
       }},
      {"adam", [](std::vector<torch::Tensor> p) -> std::unique_ptr<torch::optim::Optimizer> {
         return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(0.01));
       }},
      {"adamw", [](std::vector<torch::Tensor> p) -> std::unique_ptr<torch::optim::Optimizer> {
         return std::make_unique<torch::optim::AdamW>(p, torch::optim::AdamWOptions(0.01).weight_decay(0.1));
       }},
      {"adagrad", [](std::vector<torch::Tensor> p) -> std::unique_ptr<torch::optim::Optimizer> {
         return std::make_unique<torch::optim::Adagrad>(p, torch::optim::AdagradOptions(0.1).initial_accumulator_value(0.5));
       }},
      {"rmsprop", [](std::vector<torch::Tensor> p) -> std::unique_ptr<torch::optim::Optimizer> {
         return std::make_unique<torch::optim::RMSprop>(p, torch::optim::RMSpropOptions(0.01).momentum(0.5));
       }},
  };
  // Stages 1 to 3, in one bucket and in buckets of at most 16 elements (four: one per tensor;
  // stage 3: a reduction for each of a.weight and b.weight, one for the biases).
  std::vector<std::pair<std::string, ZeroOptions>> stages;
  for (int stage : {1, 2, 3}) {
    for (std::int64_t bucket : {std::int64_t{1000}, std::int64_t{16}}) {
      ZeroOptions options;
      options.stage = stage;
      options.bucket_elements = bucket;
      stages.emplace_back("stage " + std::to_string(stage) + ", buckets of " + std::to_string(bucket), options);
    }
  }
  for (const auto& [name, make] : optimizers) {
    const auto replicated = train(make, nullptr, comm, 6);
    for (const auto& [how, options] : stages) {
      const auto sharded = train(make, &options, comm, 6);
      ASSERT_EQ(sharded.size(), replicated.size());
      for (std::size_t i = 0; i < replicated.size(); ++i) {
        EXPECT_TRUE(torch::allclose(sharded[i], replicated[i], /*rtol=*/1e-6, /*atol=*/1e-7))
            << name << ", " << how << ": parameter " << i << " differs by "
            << (sharded[i] - replicated[i]).abs().max().item<float>();
      }
    }
  }
}

TEST(ShardedOptimizer, EachRankKeepsItsShareOfTheState) {
  comm::MpiCommunicator comm(env().world());
  const MakeOptimizer adam = [](std::vector<torch::Tensor> p) -> std::unique_ptr<torch::optim::Optimizer> {
    return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(0.01));
  };
  std::int64_t replicated = 0, sharded = 0, gradients1 = 0, gradients2 = 0;
  train(adam, nullptr, comm, 2, &replicated);
  ZeroOptions stage1;
  train(adam, &stage1, comm, 2, &sharded, &gradients1);
  const std::int64_t parameters = 7 * 5 + 5 + 5 * 3 + 3;  // 58
  const std::int64_t share = (parameters + comm.size() - 1) / comm.size();
  EXPECT_EQ(replicated, 2 * parameters);
  EXPECT_EQ(sharded, 2 * share);
  // After a backward that does not end the step, stage 1 holds every gradient; stage 2 only its
  // shard's, the rest freed.
  EXPECT_EQ(gradients1, parameters - (comm.rank() == comm.size() - 1 ? 5 : 0));  // the last rank's a.bias has none
  ZeroOptions stage2;
  stage2.stage = 2;
  stage2.bucket_elements = 16;
  std::int64_t buckets = 0;
  train(adam, &stage2, comm, 2, &sharded, &gradients2);
  for (const std::int64_t bucket : {35, 5, 15, 3}) buckets += (bucket + comm.size() - 1) / comm.size();
  EXPECT_EQ(gradients2, buckets);
  EXPECT_EQ(sharded, 2 * buckets);
}

// Stage 2 takes each gradient into its bucket as soon as backward produces it: the last layer's
// gradients are freed while backward is still in the first layer.
TEST(ShardedOptimizer, StageTwoFreesEachBucketDuringBackward) {
  comm::MpiCommunicator comm(env().world());
  torch::manual_seed(3);
  Net net;
  torch::optim::SGD sgd(net->parameters(), 0.1);
  ZeroOptions options;
  options.stage = 2;
  options.bucket_elements = 20;  // {a.weight}, {a.bias}, {b.weight, b.bias}
  ShardedOptimizer zero(sgd, comm, options);
  ASSERT_EQ(zero.layout(0).buckets.size(), 3u);
  // A hook on a.weight's gradient runs before its accumulator: by then b's buckets are gone.
  std::vector<bool> seen;
  net->a->weight.register_hook([&](torch::Tensor grad) {
    seen = {net->b->weight.grad().defined(), net->b->bias.grad().defined()};
    return grad;
  });
  const auto loss = net->forward(torch::randn({4, 7})).sum();
  zero.begin_backward();
  loss.backward();
  zero.end_backward();
  EXPECT_THAT(seen, ElementsAre(false, false));
  for (const auto& p : net->parameters()) EXPECT_FALSE(p.grad().defined());
  for (std::size_t b = 0; b < 3; ++b) EXPECT_TRUE(zero.part(0, b).grad().defined()) << "bucket " << b;
}

// Stage 3: a rank holds its part of each parameter and nothing else until it gathers them.
TEST(ShardedOptimizer, StageThreeHoldsOnlyItsPartsOfTheParameters) {
  comm::MpiCommunicator comm(env().world());
  SeededNet seeded(comm.size());
  Net& net = seeded.net;
  const std::vector<torch::Tensor>& initial = seeded.initial;
  const std::int64_t share = seeded.share;
  ZeroOptions options;
  options.stage = 3;
  options.bucket_elements = 16;
  ShardedOptimizer zero(seeded.adam, comm, options);
  EXPECT_EQ(zero.parameter_elements(), share);
  const auto params = net->parameters();
  for (std::size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(params[i].numel(), 0) << "parameter " << i << " is held whole";
    EXPECT_FALSE(zero.is_gathered(0, i));
  }
  // The parts are this rank's slices of the initial values, zero-padded.
  for (std::size_t i = 0; i < params.size(); ++i) {
    const auto& part = zero.part(0, i);
    const std::int64_t n = initial[i].numel(), lo = std::min(comm.rank() * part.numel(), n);
    const std::int64_t hi = std::min(lo + part.numel(), n);
    EXPECT_TRUE(torch::equal(part.narrow(0, 0, hi - lo), initial[i].reshape({-1}).narrow(0, lo, hi - lo)));
    EXPECT_EQ(part.narrow(0, hi - lo, part.numel() - (hi - lo)).abs().sum().item<float>(), 0.0f);
  }
  zero.gather(0, {2, 0});
  EXPECT_TRUE(torch::equal(params[0], initial[0]));
  EXPECT_TRUE(torch::equal(params[2], initial[2]));
  EXPECT_EQ(params[1].numel(), 0);
  EXPECT_EQ(zero.parameter_elements(), share + 35 + 15);
  zero.release(0, {0});
  EXPECT_EQ(params[0].numel(), 0);
  zero.gather_all();
  for (std::size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(torch::equal(params[i], initial[i])) << i;
  // A step leaves every parameter released; gathered again, they hold the step's values.
  zero.zero_grad();
  zero.begin_backward();
  torch::mse_loss(net->forward(torch::ones({4, 7})), torch::zeros({4, 3})).backward();
  zero.end_backward();
  EXPECT_EQ(zero.gradient_elements(), share) << "whole gradients were kept";
  zero.step();
  for (std::size_t i = 0; i < params.size(); ++i) EXPECT_EQ(params[i].numel(), 0) << i;
  zero.gather_all();
  EXPECT_FALSE(torch::equal(params[0], initial[0]));
  // set_whole writes a rank's part of a whole value.
  zero.release_all();
  zero.set_whole(0, 3, torch::full({3}, 7.0f));
  zero.gather(0, {3});
  EXPECT_TRUE(torch::equal(params[3], torch::full({3}, 7.0f)));
}

// stage3_param_persistence_threshold: the small parameters stay whole on every rank, within the
// model's bound, first come first kept (DeepSpeed's rule); a step gathers their new values, and
// the others step exactly as without persistence.
TEST(ShardedOptimizer, StageThreeKeepsPersistentParametersWholeAndTheirValuesCurrent) {
  comm::MpiCommunicator comm(env().world());
  const auto run = [&](std::int64_t threshold, std::vector<torch::Tensor>* after) {
    torch::manual_seed(3);
    Net net;
    std::vector<torch::Tensor> initial;
    for (const auto& p : net->parameters()) initial.push_back(p.detach().clone());
    torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(0.01));
    ZeroOptions options;
    options.stage = 3;
    options.persistence_threshold = threshold;
    options.model_persistence_threshold = 19;  // 5 fits; 15 more would not; 3 more does
    ShardedOptimizer zero(adam, comm, options);
    const auto params = net->parameters();  // of 35, 5, 15 and 3 elements
    std::vector<bool> persistent;
    for (std::size_t i = 0; i < params.size(); ++i) persistent.push_back(zero.is_persistent(0, i));
    if (threshold > 0) {
      EXPECT_THAT(persistent, ElementsAre(false, true, false, true));
      EXPECT_TRUE(torch::equal(params[1], initial[1]));
      EXPECT_TRUE(torch::equal(params[3], initial[3]));
      EXPECT_EQ(params[0].numel(), 0);
      std::int64_t share = 0;
      for (const std::int64_t n : {35, 5, 15, 3}) share += (n + comm.size() - 1) / comm.size();
      EXPECT_EQ(zero.parameter_elements(), share + 5 + 3);
    }
    for (int step = 0; step < 3; ++step) {
      zero.gather_all();
      zero.release(0, {1});  // refused for a persistent parameter
      EXPECT_EQ(params[1].numel(), threshold > 0 ? 5 : 0);
      if (threshold > 0) {
        const ShardedOptimizer::Kept kept = zero.keep(0, {0, 1, 2, 3});
        EXPECT_THAT(kept.params, ElementsAre(0, 2)) << "a persistent parameter was kept for refilling";
      }
      zero.gather_all();
      zero.zero_grad();
      zero.begin_backward();
      torch::mse_loss(net->forward(torch::ones({4, 7}) * (step + 1)), torch::zeros({4, 3})).backward();
      zero.end_backward();
      zero.step();
      for (std::size_t i = 0; i < params.size(); ++i) {
        EXPECT_EQ(params[i].numel() > 0, threshold > 0 && persistent[i]) << "parameter " << i << " after a step";
      }
      // The whole values the step left are the parts' (gathered anew).
      if (threshold > 0) {
        const auto held = params[3].detach().clone();
        zero.release_all();
        EXPECT_TRUE(torch::equal(params[3], held));
      }
    }
    zero.gather_all();
    for (const auto& p : params) after->push_back(p.detach().clone());
  };
  std::vector<torch::Tensor> partitioned, persistent;
  run(0, &partitioned);
  run(15, &persistent);
  ASSERT_EQ(partitioned.size(), persistent.size());
  for (std::size_t i = 0; i < partitioned.size(); ++i) {
    EXPECT_TRUE(torch::equal(partitioned[i], persistent[i])) << "parameter " << i << " stepped otherwise";
  }
}

// Stage 3's prefetch: an all-gather started ahead lands the same values as a gather, is counted
// while on its way, takes parameters in order until the room is used (the one that crosses it
// still taken), and is dropped when a step changes the parts; a kept parameter's refill started
// ahead fills its storage as refill() does.
TEST(ShardedOptimizer, StageThreePrefetchLandsTheValuesAGatherWould) {
  comm::MpiCommunicator comm(env().world());
  SeededNet seeded(comm.size());
  const std::vector<torch::Tensor>& initial = seeded.initial;
  ZeroOptions options;
  options.stage = 3;
  ShardedOptimizer zero(seeded.adam, comm, options);
  const auto params = seeded.net->parameters();  // of 35, 5, 15 and 3 elements
  const std::int64_t share = seeded.share;
  EXPECT_EQ(zero.prefetch(0, {1, 2, 3}, 6), 5 + 15);  // 5 < 6: the 15 crosses it
  EXPECT_EQ(zero.prefetch(0, {1, 2, 3}, 100), 3) << "a parameter on its way was started again";
  EXPECT_EQ(zero.live_elements(), 23);
  EXPECT_EQ(zero.parameter_elements(), share + 23);
  EXPECT_EQ(params[1].numel(), 0) << "a prefetch gathered before its gather";
  zero.gather(0, {0, 1});  // 1 lands, 0 is gathered now
  EXPECT_TRUE(torch::equal(params[0], initial[0]));
  EXPECT_TRUE(torch::equal(params[1], initial[1]));
  EXPECT_EQ(params[2].numel(), 0);
  EXPECT_EQ(zero.live_elements(), 35 + 5 + 15 + 3);
  zero.gather_all();
  for (std::size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(torch::equal(params[i], initial[i])) << i;
  EXPECT_EQ(zero.live_elements(), 58);
  // A refill started ahead.
  ShardedOptimizer::Kept kept = zero.keep(0, {0, 2});
  EXPECT_EQ(zero.live_elements(), 5 + 3);
  EXPECT_EQ(zero.start_refill(kept), 35 + 15);
  EXPECT_EQ(zero.start_refill(kept), 0);
  zero.refill(kept);
  EXPECT_TRUE(torch::equal(params[0], initial[0]));
  EXPECT_TRUE(torch::equal(params[2], initial[2]));
  EXPECT_EQ(kept.storages[0].unsafeGetStorageImpl(), params[0].storage().unsafeGetStorageImpl());
  // On their way across a step: dropped, and the gather brings the step's values.
  zero.release_all();
  EXPECT_EQ(zero.prefetch(0, {0, 1, 2, 3}, 1000), 58);
  zero.zero_grad();
  zero.begin_backward();
  zero.end_backward();
  // A gradient of ones on every rank: Adam's first step moves each element by its learning rate.
  for (std::size_t b = 0; b < params.size(); ++b) zero.part(0, b).mutable_grad() = torch::ones_like(zero.part(0, b));
  zero.update();
  EXPECT_EQ(zero.live_elements(), 0);
  zero.gather_all();
  EXPECT_FALSE(torch::equal(params[0], initial[0]));
  EXPECT_NEAR((initial[0] - params[0]).abs().max().item<float>(), 0.01f, 1e-6f);
}


// A parameter whose part has 64 Ki elements or more is all-gathered alone into the buffer that
// becomes its value (padded: the buffer holds every rank's whole part); the small ones travel
// together and are copied out. Both land the initial values, blocking, ahead, and refilled.
TEST(ShardedOptimizer, StageThreeGathersALargePartIntoItsOwnBufferAndSmallOnesTogether) {
  comm::MpiCommunicator comm(env().world());
  torch::manual_seed(5);
  torch::nn::Sequential net(torch::nn::Linear(1001, 263), torch::nn::Linear(263, 3));
  const auto params = net->parameters();  // 263263, 263, 789 and 3 elements
  std::vector<torch::Tensor> initial;
  for (const auto& p : params) initial.push_back(p.detach().clone());
  torch::optim::Adam adam(params, torch::optim::AdamOptions(0.01));
  ZeroOptions options;
  options.stage = 3;
  ShardedOptimizer zero(adam, comm, options);
  const std::int64_t part = (263263 + comm.size() - 1) / comm.size();
  ASSERT_GE(part, 65536) << "the test's large parameter has a part under the bound";
  const auto padded = static_cast<std::size_t>(part * comm.size()) * sizeof(float);
  ASSERT_GT(padded, 263263 * sizeof(float));
  const auto expect_initial = [&](const char* how) {
    for (std::size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(torch::equal(params[i], initial[i])) << how << " " << i;
    EXPECT_EQ(params[0].storage().nbytes(), padded) << how << ": the weight was copied out of its all-gather";
    for (std::size_t i = 1; i < params.size(); ++i) {
      EXPECT_EQ(params[i].storage().nbytes(), static_cast<std::size_t>(params[i].numel()) * sizeof(float)) << how << " " << i;
    }
  };
  zero.gather_all();
  expect_initial("gathered");
  zero.release_all();
  EXPECT_EQ(zero.prefetch(0, {0, 1, 2, 3}, 1), 263263) << "the first parameter crosses the bound";
  EXPECT_EQ(zero.prefetch(0, {0, 1, 2, 3}, 10000), 263 + 789 + 3);
  zero.gather_all();
  expect_initial("prefetched");
  ShardedOptimizer::Kept kept = zero.keep(0, {0, 1, 2, 3});
  for (std::size_t k = 0; k < kept.storages.size(); ++k) EXPECT_EQ(kept.storages[k].nbytes(), 0u) << k;
  EXPECT_EQ(zero.start_refill(kept), 263263 + 263 + 789 + 3);
  zero.refill(kept);
  expect_initial("refilled");
  EXPECT_EQ(kept.storages[0].unsafeGetStorageImpl(), params[0].storage().unsafeGetStorageImpl());
  zero.empty(kept);
  zero.refill(kept);  // blocking this time
  expect_initial("refilled again");
}

// offload_optimizer with device nvme: the state in a swap file between steps.
class StateSwap : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("hpctrial-swap-" + std::to_string(::getpid()) + "-" + std::to_string(comm_.rank()));
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  SwapOptions swap(std::int64_t sub_group_elements, int buffer_count, const std::filesystem::path& where = {},
                   bool parameters = false) const {
    SwapOptions o;
    o.parameters = parameters;
    o.nvme_path = where.empty() ? dir_ : where;
    o.key = "engine.zero_optimization.offload_optimizer.nvme_path";
    o.sub_group_elements = sub_group_elements;
    o.buffer_count = buffer_count;
    return o;
  }
  comm::MpiCommunicator comm_{env().world()};
  std::filesystem::path dir_;
};

// The step of each sub-group in turn, its state read from the file and written back, is bitwise
// the step in memory, for every element-wise optimizer at every stage: with one sub-group and
// with several, the next one read ahead or not (Adam's two moments and RMSprop's two buffers
// fill two buffers; Adagrad's sum, one), and at stage 3 with the parameters' parts swapped too
// (offload_param). Between steps no state is in memory (nor, so swapped, any part), and the
// file is the rank's own and goes with the optimizer.
TEST_F(StateSwap, TheStateInAFileStepsBitwiseAsInMemory) {
  const std::vector<std::pair<std::string, MakeOptimizer>> optimizers = {
      {"adam", [](std::vector<torch::Tensor> p) -> std::unique_ptr<torch::optim::Optimizer> {
         return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(0.01));
       }},
      {"sgd", [](std::vector<torch::Tensor> p) -> std::unique_ptr<torch::optim::Optimizer> {
         return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.1).momentum(0.9));
       }},
      {"adagrad", [](std::vector<torch::Tensor> p) -> std::unique_ptr<torch::optim::Optimizer> {
         return std::make_unique<torch::optim::Adagrad>(p, torch::optim::AdagradOptions(0.1).initial_accumulator_value(0.5));
       }},
      {"rmsprop", [](std::vector<torch::Tensor> p) -> std::unique_ptr<torch::optim::Optimizer> {
         return std::make_unique<torch::optim::RMSprop>(p, torch::optim::RMSpropOptions(0.01).momentum(0.5));
       }},
  };
  for (const auto& [name, make] : optimizers) {
    for (int stage : {1, 2, 3}) {
      ZeroOptions in_memory;
      in_memory.stage = stage;
      in_memory.bucket_elements = 16;
      const auto expected = train(make, &in_memory, comm_, 6);
      for (const auto& [sub_group, buffers, parameters] :
           {std::tuple{std::int64_t{1'000'000'000}, 4, false}, {8, 4, false}, {8, 2, false},
            {1'000'000'000, 4, stage == 3}, {8, 2, stage == 3}}) {
        const std::string how = name + ", stage " + std::to_string(stage) + ", sub-groups of " +
                                std::to_string(sub_group) + ", " + std::to_string(buffers) + " buffers" +
                                (parameters ? ", parameters swapped" : "");
        ZeroOptions swapped = in_memory;
        swapped.swap = swap(sub_group, buffers, {}, parameters);
        std::filesystem::path file;
        const auto got = train(make, &swapped, comm_, 6, nullptr, nullptr, [&](ShardedOptimizer& zero) {
          ASSERT_NE(zero.swapper(), nullptr);
          file = zero.swapper()->file();
          EXPECT_EQ(zero.state_elements(), 0) << how << ": state is in memory between steps";
          if (parameters) {
            EXPECT_EQ(zero.parameter_elements(), 0) << how << ": a part is in memory between steps";
          } else if (stage == 3) {
            EXPECT_GT(zero.parameter_elements(), 0) << how;
          }
          EXPECT_GT(zero.swapper()->swapped_elements(), 0) << how;
          EXPECT_EQ(zero.swapper()->sub_groups() > 1, sub_group == 8) << how;
          EXPECT_TRUE(zero.swapper()->direct()) << how << ": " << dir_ << " refused direct I/O";
          EXPECT_EQ(file.parent_path().parent_path(), dir_);
          EXPECT_EQ(std::filesystem::status(file).permissions(),
                    std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
          EXPECT_EQ(std::filesystem::status(file.parent_path()).permissions(), std::filesystem::perms::owner_all);
        });
        ASSERT_EQ(got.size(), expected.size());
        for (std::size_t i = 0; i < got.size(); ++i) {
          EXPECT_TRUE(torch::equal(got[i], expected[i])) << how << ": parameter " << i << " differs by "
                                                         << (got[i] - expected[i]).abs().max().item<float>();
        }
        EXPECT_FALSE(file.empty());
        EXPECT_FALSE(std::filesystem::exists(file.parent_path())) << how << ": the swap directory was left";
      }
    }
  }
}

// A model built partitioned with offload_param on nvme (DeepSpeed's zero.Init with remote_device
// nvme): each part goes to the disk as it is cut, so that no part is in memory from construction
// on; the swap takes them over, and the steps are bitwise those of the parts built in memory.
// The parts' file is unlinked as it is made: nothing is left of it.
TEST_F(StateSwap, PartsBuiltPartitionedGoToTheDiskAsTheyAreCut) {
  const MakeOptimizer adam = [](std::vector<torch::Tensor> p) -> std::unique_ptr<torch::optim::Optimizer> {
    return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(0.01));
  };
  const std::string key = "engine.zero_optimization.offload_param.nvme_path";
  ZeroOptions options;
  options.stage = 3;
  options.bucket_elements = 16;
  options.swap = swap(8, 2, {}, true);
  PartitionStore in_memory(comm_);
  options.partitions = &in_memory;
  const auto expected = train(adam, &options, comm_, 6);
  EXPECT_TRUE(in_memory.empty());

  torch::manual_seed(3);
  Net net;
  PartitionStore built(comm_, std::make_unique<PartSpill>(dir_, key));
  built.partition(*net);
  EXPECT_EQ(built.elements(), SeededNet(comm_.size()).share);
  EXPECT_EQ(built.bytes_in_memory(), 0) << "a part is in memory before a swap takes it over";
  for (const auto& p : net->parameters()) EXPECT_EQ(p.storage().nbytes(), 0u);
  EXPECT_TRUE(std::filesystem::is_empty(dir_)) << "the parts' file is left in " << dir_;

  PartitionStore spilled(comm_, std::make_unique<PartSpill>(dir_, key));
  options.partitions = &spilled;
  const auto got = train(adam, &options, comm_, 6, nullptr, nullptr, [](ShardedOptimizer& zero) {
    EXPECT_EQ(zero.parameter_elements(), 0) << "a part is in memory between steps";
  });
  EXPECT_TRUE(spilled.empty());
  ASSERT_EQ(got.size(), expected.size());
  for (std::size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(torch::equal(got[i], expected[i])) << "parameter " << i;
  EXPECT_TRUE(std::filesystem::is_empty(dir_)) << "a file is left in " << dir_;
  // A spill where no file can be made names the key and the path.
  try {
    PartSpill nowhere(dir_ / "missing", key);
    ADD_FAILURE() << "a spill was made in a missing directory";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr(key + " " + (dir_ / "missing").string() + " is not a directory"));
  }
}

TEST_F(StateSwap, ANvmePathThatIsNotADirectoryIsNamed) {
  torch::manual_seed(3);
  Net net;
  torch::optim::Adam adam(net->parameters());
  ZeroOptions options;
  options.swap = swap(8, 4, dir_ / "missing");
  try {
    ShardedOptimizer zero(adam, comm_, options);
    ADD_FAILURE() << "a missing nvme_path was taken";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("engine.zero_optimization.offload_optimizer.nvme_path " + (dir_ / "missing").string() +
                                    " is not a directory"));
  }
}

// Saved whole or in pieces, swapped state is what the same state in memory saves; loaded into a
// swapped optimizer, it steps on as the in-memory one does.
TEST_F(StateSwap, SwappedStateSavesAndLoadsAsInMemory) {
  struct Trained {
    Net net;
    std::unique_ptr<torch::optim::Adam> adam;
    std::unique_ptr<ShardedOptimizer> zero;
  };
  const auto make = [&](const std::optional<SwapOptions>& swapping) {
    torch::manual_seed(3);  // the same initial weights
    Trained t;
    t.adam = std::make_unique<torch::optim::Adam>(t.net->parameters(), torch::optim::AdamOptions(0.01));
    ZeroOptions options;
    options.stage = 3;
    options.swap = swapping;
    t.zero = std::make_unique<ShardedOptimizer>(*t.adam, comm_, options);
    return t;
  };
  const auto step = [&](Trained& t, int seed) {
    torch::manual_seed(seed + comm_.rank());
    t.zero->zero_grad();
    t.zero->gather_all();
    t.zero->begin_backward();
    torch::mse_loss(t.net->forward(torch::randn({4, 7})), torch::randn({4, 3})).backward();
    t.zero->release_all();
    t.zero->end_backward();
    t.zero->step();
  };
  for (const bool parameters : {false, true}) {
    SCOPED_TRACE(parameters ? "parameters swapped" : "state swapped");
    Trained memory = make(std::nullopt), swapped = make(swap(8, 4, {}, parameters));
    for (int k = 0; k < 2; ++k) {
      step(memory, 100 + k);
      step(swapped, 100 + k);
    }
    checkpoint::Contents a, b;
    memory.zero->save_whole(a, "optimizer/0");
    swapped.zero->save_whole(b, "optimizer/0");
    ASSERT_EQ(a.datasets.size(), b.datasets.size());
    for (const auto& d : a.datasets) {
      const checkpoint::Dataset* other = b.find(d.name);
      ASSERT_NE(other, nullptr) << d.name;
      ASSERT_EQ(other->nbytes(), d.nbytes()) << d.name;
      EXPECT_EQ(std::memcmp(other->data->data(), d.data->data(), d.nbytes()), 0) << d.name;
    }
    ShardedSave pieces_a, pieces_b;
    memory.zero->save_shards(pieces_a, "optimizer/0");
    swapped.zero->save_shards(pieces_b, "optimizer/0");
    const std::vector<std::vector<std::string>> names = {{"a.weight", "a.bias", "b.weight", "b.bias"}};
    memory.zero->save_parameter_shards(pieces_a, names);
    swapped.zero->save_parameter_shards(pieces_b, names);
    ASSERT_EQ(pieces_a.pieces.size(), pieces_b.pieces.size());
    for (std::size_t i = 0; i < pieces_a.pieces.size(); ++i) EXPECT_EQ(pieces_a.pieces[i].crc, pieces_b.pieces[i].crc) << i;
    EXPECT_EQ(swapped.zero->state_elements(), 0) << "a save read the state into memory";
    if (parameters) {
      EXPECT_EQ(swapped.zero->parameter_elements(), 0) << "a save read a part into memory";
    }
    // The pieces map the swap file; the steps after the save write the state elsewhere in it, so
    // that a checkpoint still being written keeps the bytes of its batch.
    step(swapped, 300);
    step(swapped, 301);
    for (const auto& piece : pieces_b.pieces) {
      EXPECT_EQ(checkpoint::crc32c(static_cast<const char*>(piece.buffer->data()) + piece.from, piece.size), piece.crc);
    }
    // Loaded into a fresh swapped optimizer (the parameters set to the trained ones), it steps on
    // as the trained one in memory.
    Trained loaded = make(swap(8, 2, {}, parameters));
    memory.zero->gather_all();
    for (std::size_t i = 0; i < memory.net->parameters().size(); ++i) {
      loaded.zero->set_whole(0, i, memory.net->parameters()[i].detach());
    }
    memory.zero->release_all();
    loaded.zero->load_whole(a, "optimizer/0", "ckpt.h5");
    EXPECT_EQ(loaded.zero->state_elements(), 0) << "a load left the state in memory";
    step(memory, 200);
    step(loaded, 200);
    memory.zero->gather_all();
    loaded.zero->gather_all();
    for (std::size_t i = 0; i < memory.net->parameters().size(); ++i) {
      EXPECT_TRUE(torch::equal(memory.net->parameters()[i], loaded.net->parameters()[i])) << i;
    }
  }
}

TEST(ShardedOptimizer, LbfgsIsRefused) {
  comm::MpiCommunicator comm(env().world());
  Net net;
  torch::optim::LBFGS lbfgs(net->parameters());
  try {
    ShardedOptimizer zero(lbfgs, comm);
    ADD_FAILURE() << "LBFGS was sharded";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("LBFGS's state is not per element"));
  }
}

TEST(ShardedOptimizer, AParameterThatIsNotFloat32IsRefused) {
  comm::MpiCommunicator comm(env().world());
  torch::nn::Linear layer(3, 2);
  layer->to(torch::kFloat64);
  torch::optim::SGD sgd(layer->parameters(), 0.1);
  try {
    ShardedOptimizer zero(sgd, comm);
    ADD_FAILURE() << "a double parameter was sharded";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("parameter 0 of optimizer group 0 is Double"));
    EXPECT_THAT(e.what(), HasSubstr("build the model in float32"));
  }
}


// A sharded checkpoint: every rank writes its parts of the optimizer state into the one file,
// which holds exactly what gathering the state whole (save_whole) would have written.
class ShardedCheckpoint : public testing::Test {
 protected:
  void SetUp() override {
    if (env().is_chief()) {
      dir_ = (std::filesystem::temp_directory_path() / ("hpctrial-zero-ckpt-" + std::to_string(::getpid()))).string();
      std::filesystem::remove_all(dir_);
    }
    comm_.broadcast(dir_, 0);
    torch::manual_seed(3);
    net_ = Net();
    optimizer_ = std::make_unique<torch::optim::Adam>(net_->parameters(), torch::optim::AdamOptions(0.01));
    ZeroOptions options;
    options.stage = 2;
    options.bucket_elements = 16;  // four buckets, so that parts split parameters
    zero_ = std::make_unique<ShardedOptimizer>(*optimizer_, comm_, options);
    for (int step = 0; step < 2; ++step) {
      torch::manual_seed(100 + step + comm_.rank());
      zero_->zero_grad();
      zero_->begin_backward();
      torch::mse_loss(net_->forward(torch::randn({4, 7})), torch::randn({4, 3})).backward();
      zero_->end_backward();
      zero_->step();
    }
    if (env().is_chief()) store_ = std::make_unique<checkpoint::CheckpointStore>(dir_, checkpoint::StoreOptions{});
  }
  void TearDown() override {
    comm_.barrier();
    if (env().is_chief()) std::filesystem::remove_all(dir_);
  }
  // The chief's datasets: the small ones of the sharded save, and the progress.
  checkpoint::Contents chief_contents(const ShardedSave& mine) {
    checkpoint::Contents contents = mine.whole;
    contents.add_text("progress", R"({"batches": 2})");
    contents.attributes[checkpoint::kBatchesAttribute] = "2";
    return contents;
  }

  comm::MpiCommunicator comm_{env().world()};
  std::string dir_;
  Net net_{nullptr};
  std::unique_ptr<torch::optim::Adam> optimizer_;
  std::unique_ptr<ShardedOptimizer> zero_;
  std::unique_ptr<checkpoint::CheckpointStore> store_;
};

TEST_F(ShardedCheckpoint, EveryRankWritesItsPartsIntoOneFileThatHoldsTheWholeState) {
  checkpoint::Contents whole;
  zero_->save_whole(whole, "optimizer/0");
  ShardedSave mine;
  zero_->save_shards(mine, "optimizer/0");
  EXPECT_FALSE(mine.pieces.empty()) << "rank " << comm_.rank() << " owns no part";
  const std::string path = write_sharded_checkpoint(comm_, store_.get(), chief_contents(mine), mine, {});
  EXPECT_EQ(path, dir_ + "/ckpt-2.h5");
  if (!env().is_chief()) return;
  const checkpoint::Contents read = checkpoint::read_checkpoint(path);
  EXPECT_EQ(read.datasets.size(), whole.datasets.size() + 1);  // and the progress
  for (const auto& d : whole.datasets) {
    const checkpoint::Dataset* got = read.find(d.name);
    ASSERT_NE(got, nullptr) << d.name;
    EXPECT_EQ(got->shape, d.shape) << d.name;
    ASSERT_EQ(got->nbytes(), d.nbytes()) << d.name;
    EXPECT_EQ(std::memcmp(got->data->data(), d.data->data(), d.nbytes()), 0) << d.name << " differs";
  }
  EXPECT_EQ(*store_->latest_file(), "ckpt-2.h5");
}

// Stage 3: every rank writes its parts of the parameters too; the file holds them whole, as
// gathering them would, and a rank whose part is padding only writes none.
TEST_F(ShardedCheckpoint, StageThreeWritesEachRanksPartsOfTheParametersIntoTheWholeOnes) {
  torch::manual_seed(3);
  Net net;
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(0.01));
  ZeroOptions options;
  options.stage = 3;
  ShardedOptimizer zero(adam, comm_, options);
  zero.gather_all();
  zero.begin_backward();
  torch::mse_loss(net->forward(torch::randn({4, 7})), torch::randn({4, 3})).backward();
  zero.end_backward();
  zero.step();
  ShardedSave mine;
  zero.save_shards(mine, "optimizer/0");
  std::vector<std::vector<std::string>> names(1);
  for (const auto& item : net->named_parameters()) names[0].push_back("model/0/" + item.key());
  zero.save_parameter_shards(mine, names);
  const std::string path = write_sharded_checkpoint(comm_, store_.get(), chief_contents(mine), mine, {});
  zero.gather_all();
  checkpoint::Contents whole;
  zero.save_whole(whole, "optimizer/0");
  if (!env().is_chief()) return;
  const checkpoint::Contents read = checkpoint::read_checkpoint(path);
  for (const auto& item : net->named_parameters()) {
    const checkpoint::Dataset* got = read.find("model/0/" + item.key());
    ASSERT_NE(got, nullptr) << item.key();
    EXPECT_EQ(got->shape, item.value().sizes().vec()) << item.key();
    EXPECT_TRUE(torch::equal(tensor_of(*got), item.value())) << item.key() << " differs from the gathered value";
  }
  for (const auto& d : whole.datasets) {
    const checkpoint::Dataset* got = read.find(d.name);
    ASSERT_NE(got, nullptr) << d.name;
    ASSERT_EQ(got->nbytes(), d.nbytes()) << d.name;
    EXPECT_EQ(std::memcmp(got->data->data(), d.data->data(), d.nbytes()), 0) << d.name << " differs";
  }
}

// Fails every piece write with ENOSPC.
class FullDisk : public core::FileSystem {
 public:
  ssize_t pwrite(int, const void*, std::size_t, off_t) override {
    errno = ENOSPC;
    return -1;
  }
};

// A rank whose disk is full, the chief or another: every rank fails alike, naming it, and nothing
// is published or left behind.
TEST_F(ShardedCheckpoint, ARankThatCannotWriteFailsEveryRankAndPublishesNothing) {
  ShardedSave mine;
  zero_->save_shards(mine, "optimizer/0");
  for (int failing : {0, comm_.size() - 1}) {
    FullDisk full;
    checkpoint::WriteOptions pieces;
    pieces.fs = comm_.rank() == failing ? &full : nullptr;
    std::string message;
    try {
      write_sharded_checkpoint(comm_, store_.get(), chief_contents(mine), mine, pieces);
    } catch (const CheckpointError& e) {
      message = e.what();
    }
    EXPECT_THAT(message, HasSubstr("a sharded checkpoint was not written: rank " + std::to_string(failing) +
                                   ": cannot write"));
    EXPECT_THAT(message, HasSubstr("No space left on device"));
    comm_.barrier();
    if (env().is_chief()) {
      EXPECT_TRUE(std::filesystem::is_empty(dir_)) << "a file or a temporary was left in " << dir_;
    }
  }
}

}  // namespace zero_test
}  // namespace hpctrial::trainer::detail
