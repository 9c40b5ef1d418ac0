// A checkpoint's model as one state: the tensors of wrapped model `model` by their names in the
// model, joined from wherever the run that wrote it kept them (docs/checkpoint-format.md):
//
//   model/<m>/<name>                        a model whole on every rank (ZeRO's runs too: the
//                                           weights are whole in the file)
//   model_parallel/<k>/model/<m>/<name>     part k of a model split over ranks; a pipeline's
//                                           stages name their layers by their index in the whole
//                                           model ("layer<i>.<name>"), so its parts join into it
//   [model_parallel/<k>/]meta/modules/<m>   JSON: the names of every submodule, tensors or not
//
// The parts of a model the trial splits itself (tensor parallelism) join only through the
// trial's code: one part is taken at a time (`part`), or the model is loaded on as many ranks.
// What `hpctrial checkpoint export` writes, and what load_trial_from_checkpoint reads.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "hpctrial/checkpoint/format.h"

namespace hpctrial::checkpoint {

struct ModelTensor {
  std::string name;         // in the model: "fc1.weight", "layer3.bias"
  const Dataset* dataset;   // in the contents it was taken from
};

// How the file's model lies: its number of parts, and whether they are a pipeline's stages.
struct ModelParts {
  int parts = 1;
  bool pipeline = false;
};
// From meta/model_parallel; CheckpointError naming `path` for a malformed record.
ModelParts model_parts(const Contents& contents, const std::string& path);

struct ModelState {
  std::vector<ModelTensor> tensors;  // in name order
  // Every submodule's name ("fc1", "layer1", "block.0"), those without tensors too; empty for a
  // file written before checkpoints listed them.
  std::vector<std::string> modules;
};

// Model `model`; with `part`, only that part's. ConfigError naming `path` and what to do for a
// model the file lacks, a part it lacks, and a model split by the trial without a part.
ModelState model_state(const Contents& contents, const std::string& path, int model,
                       std::optional<int> part = std::nullopt);

}  // namespace hpctrial::checkpoint
