// LR schedulers that LibTorch 1.x lacks, with PyTorch's semantics and names.
//
// ReduceLROnPlateau (torch.optim.lr_scheduler.ReduceLROnPlateau): lowers every param group's
// learning rate by `factor` once the metric has not improved for more than `patience` steps.
// It steps on a metric, not on a count, so it is not wrapped with wrap_lr_scheduler: the
// reference's recipe steps it from a callback's on_validation_end, which runs on the chief
// alone; hpctrial then gives every rank the chief's learning rates before the next batch
// (docs/trial-api.md, "State changed on the chief"). The callback's state_dict() returns the
// scheduler's, so that a resumed run goes on counting where it stopped.
#pragma once

#include <nlohmann/json.hpp>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <string>
#include <vector>

namespace hpctrial::trainer {

struct ReduceLROnPlateauOptions {
  std::string mode = "min";            // "min": lower is better; "max": higher is better
  double factor = 0.1;                 // new_lr = lr * factor; below 1
  std::int64_t patience = 10;          // steps without improvement tolerated
  double threshold = 1e-4;             // what counts as an improvement ...
  std::string threshold_mode = "rel";  // ... relative to the best ("rel") or absolute ("abs")
  std::int64_t cooldown = 0;           // steps after a reduction before counting again
  std::vector<double> min_lr = {0.0};  // one for all groups, or one per group
  double eps = 1e-8;                   // a change smaller than this is not made
};

class ReduceLROnPlateau {
 public:
  // std::invalid_argument for options PyTorch refuses (factor >= 1, an unknown mode, a min_lr
  // list of another length than the param groups).
  explicit ReduceLROnPlateau(torch::optim::Optimizer& optimizer, ReduceLROnPlateauOptions options = {});

  // One step with the metric's latest value (NaN counts as no improvement).
  void step(double metric);

  double best() const { return best_; }
  std::int64_t num_bad_epochs() const { return num_bad_epochs_; }
  std::int64_t cooldown_counter() const { return cooldown_counter_; }
  std::int64_t last_epoch() const { return last_epoch_; }

  // best (non-finite values as "Infinity"/"-Infinity"/"NaN"), num_bad_epochs, cooldown_counter,
  // last_epoch; load_state_dict throws std::invalid_argument on anything else.
  nlohmann::json state_dict() const;
  void load_state_dict(const nlohmann::json& state);

 private:
  bool is_better(double metric) const;
  void reduce_lr();

  torch::optim::Optimizer& optimizer_;
  ReduceLROnPlateauOptions options_;
  double best_;
  std::int64_t num_bad_epochs_ = 0;
  std::int64_t cooldown_counter_ = 0;
  std::int64_t last_epoch_ = 0;
};

}  // namespace hpctrial::trainer
