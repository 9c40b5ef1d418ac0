// The adaptive batch's decisions (internal to the trainer; no LibTorch): the learning-rate factor
// of each scaling rule, a model of a step's time fitted to measured ones, and the batch that
// maximises goodput = throughput x statistical efficiency, as Pollux and AdaptDL choose it.
//
// A step of `accumulation` micro-batches of `local_batch` records on each of `ranks` ranks takes
//   T(b, A, W) = A (alpha + beta b) + sync(W)
// where alpha + beta b is one micro-batch's forward and backward (fitted by least squares on the
// local batch sizes measured) and sync(W) the all-reduce time the step does not hide (measured
// per number of ranks; the nearest number measured stands in for one not measured, 0 for one rank).
// Its goodput, in records of the base batch B0 a second, is B0 r(B / B0) / T with r the AdaScale
// gain (gradient_noise.h): a bigger batch is worth its records only as far as the noise allows.
//
// Plain values; not thread-safe.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <string>

#include "adaptive/gradient_noise.h"
#include "hpctrial/core/experiment_config.h"

namespace hpctrial::trainer::detail {

// The learning rate's factor under `rule` for a batch `scale` = B / B0 times the base one:
// AdaScale the gain, AdamScale its square root, Linear the scale, Sqrt its square root, LEGW its
// square root reached linearly over the warm-up (`progress`, counting this step, and `warmup` in
// steps of the base batch; no warm-up when `warmup` is 0).
double lr_factor(core::ScalingRule rule, double scale, double gain, double progress, double warmup);
// AdaptDL's choice when the trial names no rule (kAuto): AdamScale for an Adam or AdamW
// optimizer (`adam`), AdaScale for any other. A named rule stays.
core::ScalingRule resolve_scaling_rule(core::ScalingRule rule, bool adam);

struct BatchShape {
  std::int64_t local_batch = 0;   // records a micro-batch, a rank
  std::int64_t accumulation = 1;  // micro-batches a step
  int ranks = 1;
  std::int64_t global() const { return local_batch * accumulation * ranks; }
  bool operator==(const BatchShape& o) const {
    return local_batch == o.local_batch && accumulation == o.accumulation && ranks == o.ranks;
  }
  bool operator!=(const BatchShape& o) const { return !(*this == o); }
};

class ThroughputModel {
 public:
  // One step at `shape` took `step_seconds`, of which `compute_seconds` went to its micro-batches'
  // forward and backward passes (all of them).
  void observe(const BatchShape& shape, double compute_seconds, double step_seconds);
  // The local batch sizes measured: with fewer than two, beta is taken as the measured time per
  // record and alpha as 0.
  std::size_t local_batches_measured() const { return compute_.size(); }
  bool ready() const { return !compute_.empty(); }
  double micro_batch_seconds(std::int64_t local_batch) const;
  double sync_seconds(int ranks) const;
  double step_seconds(const BatchShape& shape) const;

  nlohmann::json state_dict() const;
  void load_state_dict(const nlohmann::json& state);

 private:
  struct Mean {
    double sum = 0;
    double count = 0;
    double value() const { return count > 0 ? sum / count : 0; }
  };
  void fit();
  // Means with a memory: old measurements fade as new ones come (the machine may change).
  static void add(Mean& mean, double value);

  std::map<std::int64_t, Mean> compute_;  // local batch -> seconds a micro-batch
  std::map<int, Mean> sync_;              // ranks -> exposed sync seconds a step
  double alpha_ = 0;
  double beta_ = 0;
};

struct BatchLimits {
  std::int64_t base_batch = 1;  // B0: the trial's global batch size
  std::int64_t max_batch = 1;   // max_batch_size
  std::int64_t min_local = 1;
  std::int64_t max_local = 0;   // 0: max_batch / ranks
  bool accumulation = false;
  std::int64_t max_accumulation = 64;
};

struct BatchChoice {
  BatchShape shape;
  double goodput = 0;    // records of the base batch a second
  double gain = 1;
  bool exploring = false;  // chosen to measure another local batch size, not for its goodput
};

// The shape on `ranks` ranks with the best goodput within `limits` (global batch between B0 and
// max_batch where the local bounds allow). Until two local batch sizes are measured, and when
// the noise estimate is ready, it tries the next larger local batch (twice `current`'s, within
// the bounds) to fit the model. `current` is kept unless another is better by `hysteresis`.
BatchChoice choose_batch(const ThroughputModel& model, const GradientNoise& noise, const BatchLimits& limits,
                         int ranks, const BatchShape& current, double hysteresis = 0.05);

// The local batch and accumulation that start a run on `ranks` ranks: the base batch split over
// them (rounded up), within the local bounds - accumulating when the upper bound is too small and
// accumulation is allowed, otherwise a smaller global batch.
BatchShape initial_batch(const BatchLimits& limits, int ranks);

}  // namespace hpctrial::trainer::detail
