// Dynamic loss scaling for float16 training (PyTorch's GradScaler, with DeepSpeed's hysteresis
// and floor). float16 cannot hold gradients below about 6e-8, so the loss is multiplied by a
// large scale before backward and the gradients divided by it before the step; a step whose
// gradients overflowed to inf or NaN is skipped and the scale backed off, and after
// growth_interval steps without one it grows again.
//
//   scaler_ = context.wrap_scaler(std::make_shared<hpctrial::GradScaler>());
//   ...
//   context.backward(scaler_->scale(loss));
//   context.step_optimizer(*optimizer_, *scaler_);  // unscales, clips, steps or skips
//
// The harness updates the scale once per batch, after train_batch (so several optimizers can
// share one scaler, as in PyTorch), and checkpoints it: a resumed run continues with the same
// scale. An engine trial's `engine.fp16` section makes one per engine.
#pragma once

#include <torch/optim/optimizer.h>

#include <nlohmann/json.hpp>

#include <cstdint>

namespace hpctrial::trainer {

struct GradScalerOptions {
  double init_scale = 65536.0;  // 2^16
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  // Steps without inf or NaN after which the scale grows (DeepSpeed's loss_scale_window).
  std::int64_t growth_interval = 2000;
  // Overflowing steps skipped at one scale before it backs off; 1 backs off at every overflow
  // (PyTorch), DeepSpeed's config default is 2. Restored when the scale grows, and, with
  // consecutive_hysteresis, by any step without an overflow (then it counts overflows in a row).
  int hysteresis = 1;
  bool consecutive_hysteresis = false;
  // The scale never backs off below this (DeepSpeed's min_loss_scale); an overflow at the floor
  // ends the run with an error, as it does in DeepSpeed: the training has diverged. 0: no floor.
  double min_scale = 0;
  // false: the scale stays init_scale (DeepSpeed's static loss_scale); a step with inf or NaN
  // gradients is still skipped.
  bool dynamic = true;
};

class GradScaler {
 public:
  explicit GradScaler(GradScalerOptions options = {});

  // loss * the current scale, for backward.
  torch::Tensor scale(const torch::Tensor& loss) const;
  double get_scale() const { return scale_; }
  const GradScalerOptions& options() const { return options_; }
  // Optimizer steps skipped because their gradients were not finite, since the run began.
  std::int64_t skipped_steps() const { return skipped_steps_; }
  // Whether the last update() saw inf or NaN gradients (its steps were skipped).
  bool last_step_skipped() const { return last_skipped_; }

  // The scale and its counters, as JSON (checkpointed by the harness).
  nlohmann::json state_dict() const;
  void load_state_dict(const nlohmann::json& state);

  // --- for step_optimizer and the engine --------------------------------------------------------
  // Divides the gradients of the optimizer's parameters by the scale and returns whether any of
  // them is inf or NaN on this rank; the iteration is then marked as overflowed.
  bool unscale(torch::optim::Optimizer& optimizer);
  // For gradients unscaled elsewhere (a ZeRO engine's shards, checked across the ranks): records
  // an unscale, and whether the gradients were not finite.
  void record_unscaled(bool overflow) {
    unscaled_ = true;
    overflow_ = overflow_ || overflow;
  }
  // Whether this iteration's gradients overflowed so far (the step must be skipped).
  bool overflowed() const { return overflow_; }
  // After the iteration's steps: backs off or grows the scale. Nothing when nothing was
  // unscaled since the last update (a batch that only accumulated gradients).
  void update();

 private:
  GradScalerOptions options_;
  double scale_;
  std::int64_t growth_tracker_ = 0;  // steps since the last overflow or growth
  int hysteresis_left_;
  std::int64_t skipped_steps_ = 0;
  bool unscaled_ = false;  // since the last update
  bool overflow_ = false;
  bool last_skipped_ = false;
};

}  // namespace hpctrial::trainer
