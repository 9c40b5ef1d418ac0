// `inference:`: an experiment that evaluates a trained checkpoint over a dataset, in place of a
// searcher (docs/config-reference.md).
#include "config_schema.h"

#include "hpctrial/core/error.h"

namespace hpctrial::core::detail {

namespace {
constexpr const char* kExample = "inference: {checkpoint: runs/mlp, trial_id: 1, batch_size: 1024}";
}  // namespace

void read_inference(MapReader& top, const ConfigNode& node, ExperimentConfig& config) {
  Diagnostics& d = top.diagnostics();
  if (const ConfigNode* searcher = top.get("searcher")) {
    report(*searcher, "searcher", d,
           "an inference experiment (inference:) runs one trial over its data and searches nothing; remove "
           "searcher, or inference to train");
  }
  if (!expect_map(node, "inference", d, kExample)) return;
  // One trial, trained for no batch: the searcher the rest of hpctrial sees.
  config.searcher = Searcher{};
  config.searcher.max_trials = 1;
  Inference inference;
  MapReader r(&node, "inference", d);
  if (r.require("checkpoint", "checkpoint: runs/mlp (a checkpoint, a trial's checkpoints, or an experiment "
                              "directory with trial_id)") != nullptr) {
    read_path(r, "checkpoint", inference.checkpoint);
  }
  if (const ConfigNode* n = r.get("trial_id")) {
    if (auto v = read_int(*n, r.path("trial_id"), d, 0, kMaxTrials)) inference.trial_id = static_cast<int>(*v);
  }
  if (const ConfigNode* n = r.get("batch_size")) {
    if (auto v = read_int(*n, r.path("batch_size"), d, 1, kMaxLength)) inference.batch_size = *v;
  }
  if (const ConfigNode* n = r.get("progress_period")) {
    if (auto v = read_length(*n, r.path("progress_period"), d, {LengthUnit::kBatches, LengthUnit::kSeconds})) {
      if (v->value < 1) {
        report(*n, r.path("progress_period"), d, "must be at least 1 batch or 1 second");
      } else {
        inference.progress_period = *v;
      }
    }
  }
  r.finish();
  config.inference = inference;
}

}  // namespace hpctrial::core::detail
