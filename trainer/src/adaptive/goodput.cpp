#include "adaptive/goodput.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>

#include "hpctrial/core/error.h"

namespace hpctrial::trainer::detail {
namespace {

// How much of the past a mean keeps at each new measurement.
constexpr double kFade = 0.9;
// Local batch sizes tried per accumulation count at most (evenly spaced beyond that).
constexpr std::int64_t kMaxCandidates = 4096;

}  // namespace

double lr_factor(core::ScalingRule rule, double scale, double gain, double progress, double warmup) {
  switch (rule) {
    case core::ScalingRule::kAuto:  // resolved before the first step (resolve_scaling_rule)
    case core::ScalingRule::kAdaScale:
      return gain;
    case core::ScalingRule::kAdamScale:
      return std::sqrt(gain);  // AdaptDL's AdamScale: AdaScale's ratio to the power 0.5
    case core::ScalingRule::kLinear:
      return scale;
    case core::ScalingRule::kSqrt:
      return std::sqrt(scale);
    case core::ScalingRule::kLegw:
      // AdaptDL's LEGWScale: the warm-up lasts `warmup` base steps at the base batch and `scale`
      // times as many at a batch `scale` times larger.
      return std::sqrt(scale) * (warmup > 0 ? std::min(1.0, progress / (warmup * scale)) : 1.0);
  }
  return 1;
}

core::ScalingRule resolve_scaling_rule(core::ScalingRule rule, bool adam) {
  if (rule != core::ScalingRule::kAuto) return rule;
  return adam ? core::ScalingRule::kAdamScale : core::ScalingRule::kAdaScale;
}

void ThroughputModel::add(Mean& mean, double value) {
  mean.sum = kFade * mean.sum + value;
  mean.count = kFade * mean.count + 1;
}

void ThroughputModel::observe(const BatchShape& shape, double compute_seconds, double step_seconds) {
  if (shape.local_batch < 1 || shape.accumulation < 1 || !(step_seconds > 0) || !(compute_seconds >= 0)) return;
  add(compute_[shape.local_batch], compute_seconds / static_cast<double>(shape.accumulation));
  if (shape.ranks > 1) add(sync_[shape.ranks], std::max(0.0, step_seconds - compute_seconds));
  fit();
}

// Weighted least squares of seconds a micro-batch on its local batch size; alpha and beta kept
// at 0 or above (a fit through noise may dip below).
void ThroughputModel::fit() {
  double w = 0, sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (const auto& [batch, mean] : compute_) {
    const double x = static_cast<double>(batch), y = mean.value(), weight = mean.count;
    w += weight;
    sx += weight * x;
    sy += weight * y;
    sxx += weight * x * x;
    sxy += weight * x * y;
  }
  if (w <= 0) return;
  const double denominator = w * sxx - sx * sx;
  if (compute_.size() < 2 || denominator <= 0) {
    alpha_ = 0;
    beta_ = sy / sx;
    return;
  }
  beta_ = (w * sxy - sx * sy) / denominator;
  alpha_ = (sy - beta_ * sx) / w;
  if (alpha_ < 0) {
    alpha_ = 0;
    beta_ = sxy / sxx;  // through the origin
  } else if (beta_ < 0) {
    beta_ = 0;
    alpha_ = sy / w;
  }
}

double ThroughputModel::micro_batch_seconds(std::int64_t local_batch) const {
  return alpha_ + beta_ * static_cast<double>(local_batch);
}

double ThroughputModel::sync_seconds(int ranks) const {
  if (ranks <= 1 || sync_.empty()) return 0;
  const auto nearest = std::min_element(sync_.begin(), sync_.end(), [&](const auto& a, const auto& b) {
    return std::abs(a.first - ranks) < std::abs(b.first - ranks);
  });
  return nearest->second.value();
}

double ThroughputModel::step_seconds(const BatchShape& shape) const {
  return static_cast<double>(shape.accumulation) * micro_batch_seconds(shape.local_batch) + sync_seconds(shape.ranks);
}

nlohmann::json ThroughputModel::state_dict() const {
  nlohmann::json compute = nlohmann::json::array(), sync = nlohmann::json::array();
  for (const auto& [batch, mean] : compute_) compute.push_back({batch, mean.sum, mean.count});
  for (const auto& [ranks, mean] : sync_) sync.push_back({ranks, mean.sum, mean.count});
  return {{"compute", compute}, {"sync", sync}};
}

void ThroughputModel::load_state_dict(const nlohmann::json& state) {
  try {
    compute_.clear();
    sync_.clear();
    for (const auto& item : state.at("compute")) {
      compute_[item.at(0).get<std::int64_t>()] = {item.at(1).get<double>(), item.at(2).get<double>()};
    }
    for (const auto& item : state.at("sync")) {
      sync_[item.at(0).get<int>()] = {item.at(1).get<double>(), item.at(2).get<double>()};
    }
  } catch (const nlohmann::json::exception& e) {
    throw ConfigError(std::string("the throughput model's state is malformed: ") + e.what());
  }
  fit();
}

namespace {

std::int64_t max_local_of(const BatchLimits& limits, int ranks) {
  const std::int64_t by_batch = std::max<std::int64_t>(1, limits.max_batch / ranks);
  return limits.max_local > 0 ? std::min(limits.max_local, by_batch) : by_batch;
}

}  // namespace

BatchShape initial_batch(const BatchLimits& limits, int ranks) {
  const std::int64_t max_local = std::max(limits.min_local, max_local_of(limits, ranks));
  const std::int64_t per_rank = (limits.base_batch + ranks - 1) / ranks;
  BatchShape shape{std::clamp(per_rank, limits.min_local, max_local), 1, ranks};
  if (per_rank > max_local && limits.accumulation) {
    shape.accumulation = std::min(limits.max_accumulation, (per_rank + max_local - 1) / max_local);
    shape.local_batch = std::clamp((per_rank + shape.accumulation - 1) / shape.accumulation, limits.min_local, max_local);
  }
  return shape;
}

BatchChoice choose_batch(const ThroughputModel& model, const GradientNoise& noise, const BatchLimits& limits,
                         int ranks, const BatchShape& current, double hysteresis) {
  const double base = static_cast<double>(limits.base_batch);
  auto evaluate = [&](const BatchShape& shape) {
    BatchChoice c;
    c.shape = shape;
    c.gain = noise.gain(static_cast<double>(shape.global()), base);
    const double seconds = model.step_seconds(shape);
    c.goodput = seconds > 0 ? base * c.gain / seconds : 0;
    return c;
  };
  const std::int64_t max_local = std::max(limits.min_local, max_local_of(limits, ranks));
  const bool current_fits = current.ranks == ranks && current.local_batch >= limits.min_local &&
                            current.local_batch <= max_local && current.global() <= limits.max_batch;
  // Exploration: the model needs two local batch sizes before it can tell the fixed cost of a
  // micro-batch from the cost of its records.
  if (current_fits && noise.ready() && model.local_batches_measured() < 2) {
    std::int64_t larger = std::min(2 * current.local_batch, max_local);
    larger = std::min(larger, limits.max_batch / (ranks * current.accumulation));
    if (larger > current.local_batch) {
      BatchChoice c = evaluate({larger, current.accumulation, ranks});
      c.exploring = true;
      return c;
    }
  }
  if (!model.ready()) return evaluate(current_fits ? current : initial_batch(limits, ranks));
  const std::int64_t max_accumulation = limits.accumulation ? limits.max_accumulation : 1;
  BatchChoice best, best_below;  // best reaching the base batch, best of those below it
  for (std::int64_t a = 1; a <= max_accumulation; ++a) {
    const std::int64_t top = std::min(max_local, limits.max_batch / (ranks * a));
    if (top < limits.min_local) break;
    const std::int64_t stride = std::max<std::int64_t>(1, (top - limits.min_local + 1) / kMaxCandidates);
    for (std::int64_t b = limits.min_local; b <= top; b += stride) {
      const BatchChoice c = evaluate({b, a, ranks});
      BatchChoice& slot = c.shape.global() >= limits.base_batch ? best : best_below;
      if (c.goodput > slot.goodput) slot = c;
    }
  }
  BatchChoice chosen = best.goodput > 0 ? best : best_below;
  if (chosen.goodput <= 0) return evaluate(current_fits ? current : initial_batch(limits, ranks));
  if (current_fits && (current.global() >= limits.base_batch || chosen.shape.global() < limits.base_batch)) {
    const BatchChoice kept = evaluate(current);
    if (!(chosen.goodput > (1 + hysteresis) * kept.goodput)) return kept;
  }
  return chosen;
}

}  // namespace hpctrial::trainer::detail
