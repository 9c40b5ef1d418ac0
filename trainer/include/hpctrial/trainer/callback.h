// Hooks into the training loop (Determined's PyTorchCallback). Override the ones you need;
// each does nothing by default. Callbacks run on every rank, in the order of their names.
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
  virtual void on_validation_end(const MetricValues& /*metrics*/) {}
  virtual void on_checkpoint_end(const std::string& /*path*/) {}
  virtual void on_trial_shutdown() {}

  virtual nlohmann::json state_dict() const { return nullptr; }
  virtual void load_state_dict(const nlohmann::json& /*state*/) {}
};

}  // namespace hpctrial::trainer
