// Hooks into the training loop (Determined's PyTorchCallback). Override the ones you need;
// each does nothing by default. Callbacks run on every rank, in the order of their names, except
// on_validation_end, on_validation_step_end and on_checkpoint_end, which run on the chief only.
//
// A stateful callback returns its state from state_dict() and takes it back in
// load_state_dict(), so it survives a pause, preemption or restart exactly like the model.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>

#include "hpctrial/trainer/metrics.h"

namespace hpctrial::trainer {

class Callback {
 public:
  virtual ~Callback() = default;
  virtual void on_training_start() {}
  virtual void on_training_epoch_start(std::int64_t /*epoch_idx*/) {}
  virtual void on_training_epoch_end(std::int64_t /*epoch_idx*/) {}
  virtual void on_validation_start() {}
  // Before each evaluate_batch call of this rank (not called with evaluate_full_dataset).
  virtual void on_validation_step_start() {}
  // After each of the chief's evaluate_batch calls, with that batch's metrics.
  virtual void on_validation_step_end(const MetricValues& /*metrics*/) {}
  // With the reduced validation metrics; the chief only.
  virtual void on_validation_end(const MetricValues& /*metrics*/) {}
  // The durable checkpoint file (the reference passes its directory: std::filesystem::path(path)
  // .parent_path()); the chief only, once for every checkpoint, periodic and asynchronous ones too.
  virtual void on_checkpoint_end(const std::string& /*path*/) {}
  virtual void on_trial_shutdown() {}

  virtual nlohmann::json state_dict() const { return nullptr; }
  virtual void load_state_dict(const nlohmann::json& /*state*/) {}
};

}  // namespace hpctrial::trainer
