// The gradient noise of a training run, estimated as Pollux and AdaptDL do (after McCandlish et
// al., "An Empirical Model of Large-Batch Training", appendix A), and what follows from it: the
// AdaScale gain and the statistical progress of a step. Internal to the trainer; no LibTorch.
//
// Each optimizer step gives two squared norms of the same step's gradients: |g_small|^2 of one
// rank's gradient (b records) - averaged over the ranks - and |g_big|^2 of the all-reduced one
// (B = ranks x b records). Since E|g_M|^2 = |G|^2 + tr(S)/M for the true gradient G and the
// per-record covariance S,
//   |G|^2 ~ (B |g_big|^2 - b |g_small|^2) / (B - b)        tr(S) ~ (|g_small|^2 - |g_big|^2) / (1/b - 1/B)
// are unbiased; each is smoothed by an exponential moving average (bias-corrected, a step of B
// records weighing as much as B/B0 steps of the base batch B0). With one rank there is no
// second norm and no estimate.
//
// Relative to the base batch B0, a step of B = s B0 records makes as much progress as
//   r(s) = (var + sqr) / (var / s + sqr),   var = tr(S) / B0,  sqr = |G|^2
// steps of B0 (AdaScale's gain, 1 <= r <= s); with no estimate yet, r = 1.
//
// Plain value; not thread-safe.
#pragma once

#include <nlohmann/json.hpp>

namespace hpctrial::trainer::detail {

class GradientNoise {
 public:
  // `smoothing`: the moving averages' weight of the past per base-batch step, in [0, 1).
  explicit GradientNoise(double smoothing = 0.999) : smoothing_(smoothing) {}

  // One step's norms: `local_sqr` the ranks' mean of |g_small|^2 over `local_batch` records each,
  // `global_sqr` |g_big|^2 over `global_batch` records; `base_batch` is B0. Ignored when the
  // batches are equal (one rank) or a norm is not finite (a skipped, overflowed step).
  void update(double local_sqr, double global_sqr, double local_batch, double global_batch, double base_batch);

  bool ready() const { return weight_ > 0; }
  // The smoothed |G|^2 and tr(S) (per record); 0 until ready().
  double sqr() const;
  double var() const;
  // tr(S) / |G|^2: the batch size in records at which noise and signal are equal (B_noise);
  // infinite while |G|^2 is estimated at 0 or below.
  double noise_scale() const;
  // r(s) for s = batch / base_batch, between 1 and s; until ready(), 1 for s >= 1 and s below.
  double gain(double batch, double base_batch) const;

  nlohmann::json state_dict() const;
  // ConfigError for a malformed state.
  void load_state_dict(const nlohmann::json& state);

 private:
  double smoothing_;
  double sqr_sum_ = 0;  // the moving averages, before bias correction
  double var_sum_ = 0;
  double weight_ = 0;   // the sum of the weights they hold
};

}  // namespace hpctrial::trainer::detail
