// What the loop reaches inside an engine trial (internal to the trainer): the ZeRO engines'
// sharded optimizers, which checkpoints gather whole and restore into shards.
#pragma once

#include "parallel/zero.h"
#include "state/checkpointing.h"
#include "hpctrial/trainer/engine_trial.h"

namespace hpctrial::trainer::detail {

struct EngineAccess {
  static ShardedOptimizer* sharded(const ModelEngine& engine) { return engine.sharded_.get(); }
  static torch::optim::Optimizer* optimizer(const ModelEngine& engine) { return engine.optimizer_.get(); }
};

// The sharded optimizers of `trial` (an engine trial's ZeRO engines), by their index in the
// context's optimizers; empty for any other trial.
inline ShardedOptimizers sharded_optimizers(Trial& trial, const TrialContext& context) {
  ShardedOptimizers out;
  const auto* runner = dynamic_cast<const EngineTrialRunner*>(&trial);
  if (runner == nullptr) return out;
  const auto& optimizers = context.optimizers();
  for (const auto& engine : runner->engine_context().model_engines()) {
    ShardedOptimizer* sharded = EngineAccess::sharded(*engine);
    if (sharded == nullptr) continue;
    for (std::size_t i = 0; i < optimizers.size(); ++i) {
      if (optimizers[i].get() == EngineAccess::optimizer(*engine)) out[i] = sharded;
    }
  }
  return out;
}

// ZeRO stage 3's parameters whole on every rank (a collective), for the loop to write them (the
// weights of searcher.source_checkpoint).
inline void gather_partitioned(const ShardedOptimizers& sharded) {
  for (const auto& [index, optimizer] : sharded) optimizer->gather_all();
}
// After every rank wrote the same whole values into them: each rank's parts taken from them,
// and the whole values released.
inline void keep_partitioned(const ShardedOptimizers& sharded) {
  for (const auto& [index, optimizer] : sharded) {
    optimizer->keep_gathered();
    optimizer->release_all();
  }
}

}  // namespace hpctrial::trainer::detail
