#include "adaptive/gradient_noise.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "hpctrial/core/error.h"

namespace hpctrial::trainer::detail {

void GradientNoise::update(double local_sqr, double global_sqr, double local_batch, double global_batch,
                           double base_batch) {
  if (!(global_batch > local_batch) || !(local_batch > 0) || !(base_batch > 0)) return;
  if (!std::isfinite(local_sqr) || !std::isfinite(global_sqr)) return;
  const double sqr = (global_batch * global_sqr - local_batch * local_sqr) / (global_batch - local_batch);
  const double var = (local_sqr - global_sqr) / (1 / local_batch - 1 / global_batch);
  // theta = smoothing^(B / B0): a bigger step's estimate replaces more of the past.
  const double theta = std::pow(smoothing_, global_batch / base_batch);
  sqr_sum_ = theta * sqr_sum_ + (1 - theta) * sqr;
  var_sum_ = theta * var_sum_ + (1 - theta) * var;
  weight_ = theta * weight_ + (1 - theta);
}

double GradientNoise::sqr() const { return ready() ? sqr_sum_ / weight_ : 0; }

double GradientNoise::var() const { return ready() ? std::max(0.0, var_sum_ / weight_) : 0; }

double GradientNoise::noise_scale() const {
  if (!ready() || sqr() <= 0) return std::numeric_limits<double>::infinity();
  return var() / sqr();
}

double GradientNoise::gain(double batch, double base_batch) const {
  const double scale = batch / base_batch;
  if (scale == 1) return 1;
  // Without an estimate: no gain from a bigger batch, a whole loss from a smaller one.
  if (!ready()) return std::min(scale, 1.0);
  const double sqr = this->sqr();
  const double var = this->var() / base_batch;
  if (sqr <= 0) return scale;  // all noise: every record counts fully
  const double gain = (var + sqr) / (var / scale + sqr);
  return scale > 1 ? std::clamp(gain, 1.0, scale) : std::clamp(gain, scale, 1.0);
}

nlohmann::json GradientNoise::state_dict() const {
  return {{"sqr_sum", sqr_sum_}, {"var_sum", var_sum_}, {"weight", weight_}};
}

void GradientNoise::load_state_dict(const nlohmann::json& state) {
  try {
    sqr_sum_ = state.at("sqr_sum").get<double>();
    var_sum_ = state.at("var_sum").get<double>();
    weight_ = state.at("weight").get<double>();
  } catch (const nlohmann::json::exception& e) {
    throw ConfigError(std::string("the gradient noise state is malformed: ") + e.what());
  }
}

}  // namespace hpctrial::trainer::detail
