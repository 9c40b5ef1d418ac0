#include "hpctrial/trainer/lr_schedulers.h"

#include <algorithm>
#include <limits>
#include <stdexcept>

#include "hpctrial/core/json_file.h"

namespace hpctrial::trainer {

ReduceLROnPlateau::ReduceLROnPlateau(torch::optim::Optimizer& optimizer, ReduceLROnPlateauOptions options)
    : optimizer_(optimizer), options_(std::move(options)) {
  if (!(options_.factor < 1.0)) {
    throw std::invalid_argument("ReduceLROnPlateau: factor is " + std::to_string(options_.factor) + "; it must be below 1");
  }
  if (options_.mode != "min" && options_.mode != "max") {
    throw std::invalid_argument("ReduceLROnPlateau: mode is '" + options_.mode + "'; it is 'min' or 'max'");
  }
  if (options_.threshold_mode != "rel" && options_.threshold_mode != "abs") {
    throw std::invalid_argument("ReduceLROnPlateau: threshold_mode is '" + options_.threshold_mode +
                                "'; it is 'rel' or 'abs'");
  }
  const std::size_t groups = optimizer_.param_groups().size();
  if (options_.min_lr.size() == 1) options_.min_lr.resize(groups, options_.min_lr.front());
  if (options_.min_lr.size() != groups) {
    throw std::invalid_argument("ReduceLROnPlateau: min_lr has " + std::to_string(options_.min_lr.size()) +
                                " values for " + std::to_string(groups) + " param groups; give one, or one a group");
  }
  best_ = options_.mode == "min" ? std::numeric_limits<double>::infinity() : -std::numeric_limits<double>::infinity();
}

bool ReduceLROnPlateau::is_better(double metric) const {
  const bool rel = options_.threshold_mode == "rel";
  if (options_.mode == "min") return metric < (rel ? best_ * (1.0 - options_.threshold) : best_ - options_.threshold);
  return metric > (rel ? best_ * (options_.threshold + 1.0) : best_ + options_.threshold);
}

void ReduceLROnPlateau::reduce_lr() {
  auto& groups = optimizer_.param_groups();
  for (std::size_t i = 0; i < groups.size(); ++i) {
    const double old_lr = groups[i].options().get_lr();
    const double new_lr = std::max(old_lr * options_.factor, options_.min_lr[i]);
    if (old_lr - new_lr > options_.eps) groups[i].options().set_lr(new_lr);
  }
}

// PyTorch's step, in its order: the improvement counts first, then the cooldown, then the patience.
void ReduceLROnPlateau::step(double metric) {
  ++last_epoch_;
  if (is_better(metric)) {
    best_ = metric;
    num_bad_epochs_ = 0;
  } else {
    ++num_bad_epochs_;
  }
  if (cooldown_counter_ > 0) {
    --cooldown_counter_;
    num_bad_epochs_ = 0;
  }
  if (num_bad_epochs_ > options_.patience) {
    reduce_lr();
    cooldown_counter_ = options_.cooldown;
    num_bad_epochs_ = 0;
  }
}

nlohmann::json ReduceLROnPlateau::state_dict() const {
  return {{"best", core::json_number(best_)},
          {"num_bad_epochs", num_bad_epochs_},
          {"cooldown_counter", cooldown_counter_},
          {"last_epoch", last_epoch_}};
}

void ReduceLROnPlateau::load_state_dict(const nlohmann::json& state) {
  const auto best = state.is_object() && state.contains("best") ? core::number_of(state.at("best")) : std::nullopt;
  const auto integer = [&](const char* key) {
    if (!state.contains(key) || !state.at(key).is_number_integer()) {
      throw std::invalid_argument(std::string("ReduceLROnPlateau state: '") + key + "' is missing or not an integer in " +
                                  state.dump());
    }
    return state.at(key).get<std::int64_t>();
  };
  if (!best) throw std::invalid_argument("ReduceLROnPlateau state: 'best' is missing or not a number in " + state.dump());
  num_bad_epochs_ = integer("num_bad_epochs");
  cooldown_counter_ = integer("cooldown_counter");
  last_epoch_ = integer("last_epoch");
  best_ = *best;
}

}  // namespace hpctrial::trainer
