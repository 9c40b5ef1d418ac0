// What the loop reaches inside an engine trial (internal to the trainer): the ZeRO engines'
// sharded optimizers, which checkpoints gather whole and restore into shards.
#pragma once

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

}  // namespace hpctrial::trainer::detail
