// A trained trial loaded from its checkpoint, outside any launcher (Determined's
// load_trial_from_checkpoint_path): the trial built with its context from the config and
// hyperparameters the checkpoint carries, and its models' weights loaded, whatever wrote them:
// one rank or many, ZeRO's shards (the weights are whole in the file), a pipeline's stages (joined
// again on any number of stages, one included), a model split over ranks by the trial (each rank
// its own part, on as many parts). Nothing of the optimizers, schedulers, progress or data
// position is loaded.
//
//   auto loaded = hpctrial::load_trial_from_checkpoint<MyTrial>("exp/trial-1/checkpoints");
//   MyTrial& trial = loaded.trial<MyTrial>();   // an EngineTrial class works the same way
//   torch::NoGradGuard no_grad;
//   auto logits = trial.model()->forward(x.to(loaded.context().device()));
//
// The models are in eval() mode; call train() on them to fine-tune by hand. A model split over
// ranks loads on as many ranks, each rank running this under mpirun with the ranks'
// communicator in LoadOptions; a pipeline loads on one process (its layers as one stage) or on
// ranks that are a multiple of some number of stages.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "hpctrial/core/experiment_config.h"
#include "hpctrial/trainer/engine_trial.h"
#include "hpctrial/trainer/training_loop.h"
#include "hpctrial/trainer/trial.h"

namespace hpctrial::comm {
class Communicator;
}

namespace hpctrial::trainer {

struct LoadOptions {
  // "key=value" overrides of the checkpoint's config, as `--set` gives them (YAML values), e.g.
  // "data.validation_path=/scratch/test.h5" or "resources.gpus_per_slot=0". Hyperparameters come
  // from the checkpoint and cannot be overridden: they shape the model.
  std::vector<std::string> overrides;
  // The ranks that load together, e.g. MPI's world under mpirun; null: this process alone. Each
  // calls load_trial_from_checkpoint (a collective).
  comm::Communicator* communicator = nullptr;
  // Their GPU collectives (NCCL), for an engine that needs them; may be null.
  comm::Communicator* device_communicator = nullptr;
  // Where each rank stands on its node (its GPU); unset: each rank alone on a node.
  int local_rank = -1;
  int local_size = -1;
};

class LoadedTrial {
 public:
  LoadedTrial(LoadedTrial&&) noexcept;
  LoadedTrial& operator=(LoadedTrial&&) noexcept;
  ~LoadedTrial();

  // The trial class built from the checkpoint: a Trial, or an EngineTrial (its runner's
  // trial). std::bad_cast for a class it is not.
  template <typename TrialClass>
  TrialClass& trial() const {
    if constexpr (std::is_base_of_v<EngineTrial, TrialClass>) {
      return dynamic_cast<TrialClass&>(engine_trial());
    } else {
      return dynamic_cast<TrialClass&>(*trial_);
    }
  }
  // The trial as the training loop runs it (an engine trial's runner).
  Trial& any_trial() const { return *trial_; }
  // An engine trial itself; ConfigError when the trial is a Trial.
  EngineTrial& engine_trial() const;
  EngineTrialContext& engine_context() const;
  TrialContext& context() const { return *context_; }

  // The checkpoint file loaded, its batches trained, and the config it was written with (after
  // the overrides).
  const std::string& checkpoint_path() const { return path_; }
  std::int64_t batches_trained() const { return batches_trained_; }
  const core::ExperimentConfig& config() const { return *config_; }

 private:
  friend LoadedTrial load_trial_from_checkpoint(const std::string&, const TrialFactory&, const LoadOptions&);
  LoadedTrial();

  std::unique_ptr<comm::Communicator> alone_;  // this process alone, when no communicator was given
  std::unique_ptr<core::ExperimentConfig> config_;
  std::unique_ptr<TrialContext> context_;      // outlives trial_
  std::unique_ptr<Trial> trial_;
  std::string path_;
  std::int64_t batches_trained_ = 0;
};

// `path`: a checkpoint file, or a directory of checkpoints (its latest good one, as a resume
// would take). `factory` builds the trial as HPCTRIAL_MAIN would. CheckpointError for a file
// that does not read, ConfigError for a trial whose models do not match the checkpoint's (naming
// the tensor) or a model split into another number of parts than the ranks make.
LoadedTrial load_trial_from_checkpoint(const std::string& path, const TrialFactory& factory,
                                       const LoadOptions& options = {});

template <typename TrialClass>
LoadedTrial load_trial_from_checkpoint(const std::string& path, const LoadOptions& options = {}) {
  return load_trial_from_checkpoint(path, [](TrialContext& context) { return make_any_trial<TrialClass>(context); },
                                    options);
}

// `hpctrial checkpoint export`: model `model` of the checkpoint at `path` (a file, or a directory's
// latest good one), joined from its parts (checkpoint/model_state.h), written to `out` as a
// LibTorch archive: C++ reads it with torch::load(model, out), Python with
// torch.jit.load(out).state_dict(). Floating-point tensors are the archive's parameters, others
// its buffers. With `part`, that part of a model split over ranks. Returns the tensors written.
std::size_t export_model(const std::string& path, const std::string& out, int model = 0,
                         std::optional<int> part = std::nullopt);

}  // namespace hpctrial::trainer
