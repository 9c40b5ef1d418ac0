// A pipeline's checkpoint on another number of stages. Each stage writes its part of the model
// (model_parallel/<stage>/...) with its layers named by their index in the whole pipeline
// ("layer<i>.<name>") and its optimizers' parameter names beside their state, so that any other
// partition finds each layer, and each parameter's optimizer state, in the part that held it.
// Internal to the trainer.
#pragma once

#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <cstddef>
#include <map>
#include <string>
#include <vector>

#include "hpctrial/checkpoint/format.h"
#include "hpctrial/trainer/trial_context.h"

namespace hpctrial::trainer::detail {

class ShardedOptimizer;

// An optimizer's parameters by group, in the order its checkpoint numbers their state: the
// optimizer's own, or the model's parameters that ZeRO (`sharded`, when not null) took over.
using ParameterGroups = std::vector<std::vector<torch::Tensor>>;
ParameterGroups parameter_groups(torch::optim::Optimizer& optimizer, const ShardedOptimizer* sharded);

// The names of the parameters in that order, as "<model index>/<parameter name>" of the
// context's wrapped models; null for a parameter that no wrapped model holds.
nlohmann::json parameter_names(TrialContext& context, const ParameterGroups& groups);

// The checkpoint of a pipeline written in `parts_in_file` stages, as this rank's stage would
// have written it in the run's partition (prefix `part`, `parts` parts): its layers' tensors and
// optimizer state taken from whichever part held them, everything else as it is (the buffers are
// shared, not copied). ConfigError naming the tensor when a layer is in no part, or in the file
// beyond the pipeline's layers.
checkpoint::Contents repartition(const checkpoint::Contents& contents, const std::string& path, TrialContext& context,
                                 const std::map<std::size_t, ShardedOptimizer*>& sharded, const std::string& part,
                                 int parts, int parts_in_file);

// Whether one of the context's wrapped models is a pipeline's stage (a PipelineModule).
bool has_pipeline_module(const TrialContext& context);

// The weights alone of such a checkpoint, as this rank's stage would have written them (prefix
// `part`): the model tensors of the file's `parts_in_file` stages, renamed, nothing else.
checkpoint::Contents repartition_weights(const checkpoint::Contents& contents, const std::string& path,
                                         TrialContext& context, const std::string& part);

}  // namespace hpctrial::trainer::detail
