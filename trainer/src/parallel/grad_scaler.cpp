#include "hpctrial/trainer/grad_scaler.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

#include "hpctrial/core/error.h"

namespace hpctrial::trainer {
namespace {

std::string text(double value) {
  char out[32];
  std::snprintf(out, sizeof out, "%g", value);
  return out;
}

}  // namespace

GradScaler::GradScaler(GradScalerOptions options)
    : options_(options), scale_(options.init_scale), hysteresis_left_(options.hysteresis) {
  const auto& o = options_;
  const char* wrong = !(o.init_scale > 0 && std::isfinite(o.init_scale))   ? "init_scale must be positive"
                      : !(o.growth_factor > 1 && std::isfinite(o.growth_factor)) ? "growth_factor must be above 1"
                      : !(o.backoff_factor > 0 && o.backoff_factor < 1)       ? "backoff_factor must be in (0, 1)"
                      : o.growth_interval < 1                                   ? "growth_interval must be at least 1"
                      : o.hysteresis < 1                                        ? "hysteresis must be at least 1"
                      : !(o.min_scale >= 0 && o.min_scale <= o.init_scale)
                          ? "min_scale must be between 0 and init_scale"
                          : nullptr;
  if (wrong != nullptr) {
    throw ConfigError(std::string("GradScaler: ") + wrong + " (init_scale " + text(o.init_scale) + ", growth_factor " +
                      text(o.growth_factor) + ", backoff_factor " + text(o.backoff_factor) + ", growth_interval " +
                      std::to_string(o.growth_interval) + ", hysteresis " + std::to_string(o.hysteresis) +
                      ", min_scale " + text(o.min_scale) + ")");
  }
}

torch::Tensor GradScaler::scale(const torch::Tensor& loss) const { return loss * scale_; }

bool GradScaler::unscale(torch::optim::Optimizer& optimizer) {
  torch::NoGradGuard no_grad;
  const double inverse = 1.0 / scale_;
  std::vector<torch::Tensor> finite;
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      torch::Tensor& grad = p.mutable_grad();
      grad.mul_(inverse);
      finite.push_back(torch::isfinite(grad).all());
    }
  }
  unscaled_ = true;
  // One synchronization for all the parameters.
  const bool found = !finite.empty() && !torch::stack(finite).all().item<bool>();
  if (found) overflow_ = true;
  return found;
}

void GradScaler::update() {
  if (!unscaled_) return;
  unscaled_ = false;
  last_skipped_ = overflow_;
  if (!overflow_) {
    if (options_.consecutive_hysteresis) hysteresis_left_ = options_.hysteresis;
    // At least: a resumed run may have a shorter window than the one that counted.
    if (options_.dynamic && ++growth_tracker_ >= options_.growth_interval) {
      scale_ *= options_.growth_factor;
      growth_tracker_ = 0;
      hysteresis_left_ = options_.hysteresis;
    }
    return;
  }
  overflow_ = false;
  ++skipped_steps_;
  if (!options_.dynamic) return;
  growth_tracker_ = 0;
  if (hysteresis_left_ > 1) {
    --hysteresis_left_;
    return;
  }
  if (options_.min_scale > 0 && scale_ <= options_.min_scale) {
    throw Error("the gradients overflowed to inf or NaN with the loss scale at its floor, min_loss_scale " +
                text(options_.min_scale) + " (" + std::to_string(skipped_steps_) +
                " steps skipped so far): the training has diverged; lower the learning rate, clip the gradients "
                "(gradient_clipping), or train in bfloat16 (bf16.enabled) instead");
  }
  scale_ = std::max(scale_ * options_.backoff_factor, options_.min_scale);
}

nlohmann::json GradScaler::state_dict() const {
  return {{"scale", scale_},
          {"growth_tracker", growth_tracker_},
          {"hysteresis_left", hysteresis_left_},
          {"skipped_steps", skipped_steps_},
          {"last_step_skipped", last_skipped_}};
}

void GradScaler::load_state_dict(const nlohmann::json& state) {
  try {
    const double scale = state.at("scale").get<double>();
    if (!(scale > 0 && std::isfinite(scale))) throw ConfigError("the scale is " + text(scale));
    scale_ = options_.dynamic ? scale : options_.init_scale;
    growth_tracker_ = std::max<std::int64_t>(0, state.at("growth_tracker").get<std::int64_t>());
    hysteresis_left_ = std::clamp(state.at("hysteresis_left").get<int>(), 1, options_.hysteresis);
    skipped_steps_ = state.at("skipped_steps").get<std::int64_t>();
    last_skipped_ = state.value("last_step_skipped", false);
  } catch (const nlohmann::json::exception& e) {
    throw ConfigError(std::string("GradScaler::load_state_dict: ") + e.what() + " in " + state.dump());
  }
  unscaled_ = false;
  overflow_ = false;
}

}  // namespace hpctrial::trainer
