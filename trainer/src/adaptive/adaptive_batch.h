// The adaptive batch of one trial (optimizations.adaptive_batch_size; docs/adaptive.md): the
// batch shape it trains with now, the statistical progress made, and what decides the next
// shape - the gradient noise estimate and the step-time model. Internal to the trainer; no
// LibTorch. The loop drives it (loop/adaptive.cpp):
//
//   start_step()                  before a step's first micro-batch: its gain, its LR factor
//   end_micro_batch()             after each micro-batch: the records it took
//   fold_norms(norms)             once the step's gradients are averaged, before the optimizer
//                                 steps: the noise estimate, then the gain and LR factor again
//   end_step(seconds)             after the step: progress, the step-time model
//   decision_due() / decide()     every decision_interval steps: the chief chooses, every rank
//   apply(shape)                  takes the broadcast choice
//
// Everything is the same on every rank but the step-time model, which only the chief's decisions
// use (and its checkpoint keeps). Plain value; not thread-safe.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "adaptive/goodput.h"
#include "adaptive/gradient_noise.h"
#include "hpctrial/core/experiment_config.h"

namespace hpctrial::trainer::detail {

// One step's squared gradient norms: the ranks' mean of their own gradients' and the averaged
// gradient's (see gradient_noise.h). A rank's own gradient spans `local_micro_batches` of the
// step's micro-batches (0: all of them; a ZeRO-2 engine measures only its last).
struct GradientNorms {
  double local_sqr = 0;
  double global_sqr = 0;
  std::int64_t local_micro_batches = 0;
};

class AdaptiveBatchState {
 public:
  // `base_batch`: the trial's global batch size; `records_per_epoch`: an epoch's records.
  AdaptiveBatchState(const core::AdaptiveBatch& config, std::int64_t base_batch, std::int64_t records_per_epoch,
                     int ranks);

  // A checkpoint's state (null: a fresh start). The shape is kept when the ranks are as many as
  // when it was saved, and chosen again for this number otherwise; returns whether it was.
  bool restore(const nlohmann::json& state);
  // A checkpoint of the same trial without an adaptive batch: `batches` of the base batch were
  // trained, and so many steps of progress made.
  void continue_fixed_run(std::int64_t batches);
  nlohmann::json state_dict() const;

  const BatchShape& shape() const { return shape_; }
  std::int64_t base_batch() const { return limits_.base_batch; }
  // Records taken from the training order (its position), steps made, and progress in steps of
  // the base batch (AdaScale's scale-invariant iterations).
  std::int64_t records() const { return records_; }
  std::int64_t steps() const { return steps_; }
  double progress() const { return progress_; }
  // The statistical epoch the progress is in: progress x base batch / records_per_epoch.
  std::int64_t epoch_at(double progress) const;
  std::int64_t epoch() const { return epoch_at(progress_); }

  // The step about to run: its gain (progress it will make) and the learning rate's factor, from
  // the estimates so far - what the step keeps when it measures no norms (one rank, a skipped
  // step).
  void start_step();
  // The step's own norms, measured once its gradients are averaged: folded into the estimate, and
  // the step's gain and LR factor computed again from it, as AdaptDL's optimizer step does after
  // its `_final_callback` (scaling_rules.py). Called again in the same step (a second optimizer),
  // the later norms replace the earlier.
  void fold_norms(const GradientNorms& norms);
  double step_gain() const { return step_gain_; }
  double lr_factor() const { return lr_factor_; }
  // The epoch the step ends in: differs from epoch() when the step completes one.
  std::int64_t epoch_after_step() const { return epoch_at(progress_ + step_gain_); }
  void end_micro_batch() { records_ += shape_.local_batch * shape_.ranks; }
  // The step's seconds, all in and exposed gradient all-reduce.
  void end_step(double step_seconds, double sync_seconds);

  // AdamScale's preconditioned noise: whether the step about to run has another scale (batch /
  // base batch) than the last step asked about - AdaptDL starts Adam's moments afresh then. The
  // first step of a fresh run has; a resumed run's first step has only when its batch changed.
  bool take_scale_change();

  bool decision_due() const;
  // The chief's choice for the next steps.
  BatchChoice decide() const;
  // Every rank: train with `shape` from the next step.
  void apply(const BatchShape& shape);

  // The number of ranks from `min` to `max` (in steps of `step`) with the best goodput the model
  // expects, each with its best batch; the fewest among equals. `min` until the model is fitted.
  int preferred_ranks(int min, int max, int step) const;

  // gain, noise scale, goodput, batch, local batch, accumulation, lr factor, progress: what a
  // training report adds.
  std::map<std::string, double> metrics() const;
  const GradientNoise& noise() const { return noise_; }
  const ThroughputModel& model() const { return model_; }

 private:
  // Whether this run measures the gradient noise: across ranks, so not on one. A run that does
  // not keeps the base batch and a gain of 1, whatever estimate a checkpoint brought.
  bool measures_noise() const { return ranks_ > 1; }
  // step_gain_ and lr_factor_ from the estimate in noise_.
  void price_step();

  core::AdaptiveBatch config_;
  BatchLimits limits_;
  std::int64_t records_per_epoch_;
  int ranks_;
  BatchShape shape_;
  GradientNoise noise_;
  GradientNoise noise_before_step_;  // fold_norms() folds into this
  ThroughputModel model_;
  std::int64_t records_ = 0;
  std::int64_t steps_ = 0;
  std::int64_t last_decision_step_ = 0;
  double progress_ = 0;
  double step_gain_ = 1;
  double lr_factor_ = 1;
  double warmup_ = 0;  // LEGW's, in base steps
  double moments_scale_ = 0;  // take_scale_change()'s last scale; 0 before the first step
};

}  // namespace hpctrial::trainer::detail
