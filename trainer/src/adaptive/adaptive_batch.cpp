#include "adaptive/adaptive_batch.h"

#include <cmath>
#include <limits>

#include "hpctrial/core/error.h"

namespace hpctrial::trainer::detail {

AdaptiveBatchState::AdaptiveBatchState(const core::AdaptiveBatch& config, std::int64_t base_batch,
                                       std::int64_t records_per_epoch, int ranks)
    : config_(config), records_per_epoch_(records_per_epoch), ranks_(ranks), noise_(config.smoothing), noise_before_step_(config.smoothing) {
  if (config.max_batch_size < base_batch) {
    throw ConfigError("optimizations.adaptive_batch_size.max_batch_size (" + std::to_string(config.max_batch_size) +
                      ") is below the trial's global batch size (" + std::to_string(base_batch) +
                      "), the batch it starts from; raise max_batch_size or lower the global batch size");
  }
  limits_.base_batch = base_batch;
  limits_.max_batch = config.max_batch_size;
  limits_.min_local = config.min_local_batch;
  limits_.max_local = config.max_local_batch;
  limits_.accumulation = config.gradient_accumulation;
  shape_ = initial_batch(limits_, ranks);
  warmup_ = config.legw_warmup_epochs * static_cast<double>(records_per_epoch) / static_cast<double>(base_batch);
}

std::int64_t AdaptiveBatchState::epoch_at(double progress) const {
  // A hair of tolerance: a sum of gains that should reach an epoch's end exactly may fall short
  // by rounding.
  const double epochs = progress * static_cast<double>(limits_.base_batch) / static_cast<double>(records_per_epoch_);
  return static_cast<std::int64_t>(std::floor(epochs + 1e-9));
}

void AdaptiveBatchState::start_step() {
  noise_before_step_ = noise_;
  price_step();
}

void AdaptiveBatchState::fold_norms(const GradientNorms& norms) {
  if (!measures_noise()) return;
  noise_ = noise_before_step_;
  const std::int64_t micro_batches = norms.local_micro_batches > 0 ? norms.local_micro_batches : shape_.accumulation;
  const double local = static_cast<double>(shape_.local_batch * micro_batches);
  noise_.update(norms.local_sqr, norms.global_sqr, local, static_cast<double>(shape_.global()),
                static_cast<double>(limits_.base_batch));
  price_step();
}

void AdaptiveBatchState::price_step() {
  step_gain_ = !measures_noise() ? 1.0 : noise_.gain(static_cast<double>(shape_.global()), static_cast<double>(limits_.base_batch));
  const double scale = static_cast<double>(shape_.global()) / static_cast<double>(limits_.base_batch);
  lr_factor_ = detail::lr_factor(config_.scaling_rule, scale, step_gain_, progress_ + step_gain_, warmup_);
}

void AdaptiveBatchState::end_step(double step_seconds, double sync_seconds) {
  ++steps_;
  progress_ += step_gain_;
  if (step_seconds > 0) model_.observe(shape_, std::max(0.0, step_seconds - sync_seconds), step_seconds);
}

bool AdaptiveBatchState::take_scale_change() {
  const double scale = static_cast<double>(shape_.global()) / static_cast<double>(limits_.base_batch);
  if (std::abs(scale - moments_scale_) <= 1e-8 + 1e-5 * moments_scale_) return false;  // numpy's isclose (AdaptDL's)
  moments_scale_ = scale;
  return true;
}

bool AdaptiveBatchState::decision_due() const {
  return steps_ - last_decision_step_ >= config_.decision_interval;
}

BatchChoice AdaptiveBatchState::decide() const {
  // One rank measures no noise (there is no second gradient): an estimate from a run on more
  // ranks would never be updated again, so the base batch stays, with a gain of 1. The estimate
  // is kept, for a later run on more ranks.
  if (!measures_noise()) return BatchChoice{initial_batch(limits_, ranks_)};
  return choose_batch(model_, noise_, limits_, ranks_, shape_);
}

void AdaptiveBatchState::apply(const BatchShape& shape) {
  if (shape.ranks != ranks_ || shape.local_batch < 1 || shape.accumulation < 1) {
    throw InternalError("an adaptive batch shape for " + std::to_string(shape.ranks) + " ranks applied on " +
                        std::to_string(ranks_));
  }
  shape_ = shape;
  last_decision_step_ = steps_;
}

int AdaptiveBatchState::preferred_ranks(int min, int max, int step) const {
  if (!model_.ready() || step < 1) return min;
  int best = min;
  double best_goodput = 0;
  for (int ranks = min; ranks <= max; ranks += step) {
    const double goodput = choose_batch(model_, noise_, limits_, ranks, initial_batch(limits_, ranks), 0).goodput;
    if (goodput > best_goodput * (1 + 1e-9)) {
      best = ranks;
      best_goodput = goodput;
    }
  }
  return best;
}

void AdaptiveBatchState::continue_fixed_run(std::int64_t batches) {
  records_ = batches * limits_.base_batch;
  steps_ = batches;
  last_decision_step_ = batches;
  progress_ = static_cast<double>(batches);
  moments_scale_ = 1;  // the optimizer's moments were gathered at the base batch
}

bool AdaptiveBatchState::restore(const nlohmann::json& state) {
  if (state.is_null()) return false;
  int saved_ranks = 0;
  try {
    records_ = state.at("records").get<std::int64_t>();
    steps_ = state.at("steps").get<std::int64_t>();
    last_decision_step_ = state.at("last_decision_step").get<std::int64_t>();
    progress_ = state.at("progress").get<double>();
    const auto& shape = state.at("shape");
    saved_ranks = shape.at("ranks").get<int>();
    shape_ = {shape.at("local_batch").get<std::int64_t>(), shape.at("accumulation").get<std::int64_t>(), saved_ranks};
    noise_.load_state_dict(state.at("noise"));
    model_.load_state_dict(state.at("throughput"));
    // A checkpoint written before the scale was kept: its moments were gathered at its batch.
    moments_scale_ = state.value("moments_scale", 0.0);
    if (!(moments_scale_ > 0)) moments_scale_ = static_cast<double>(shape_.global()) / static_cast<double>(limits_.base_batch);
  } catch (const nlohmann::json::exception& e) {
    throw CheckpointError(std::string("the adaptive batch state is malformed: ") + e.what());
  }
  if (records_ < 0 || steps_ < 0 || !(progress_ >= 0) || shape_.local_batch < 1 || shape_.accumulation < 1) {
    throw CheckpointError("the adaptive batch state has a negative count or an empty batch");
  }
  if (saved_ranks == ranks_) return false;
  // Another number of ranks: the model knows the step time of every local batch measured, and
  // the nearest number of ranks' all-reduce; the choice is made for this one at once.
  shape_ = {shape_.local_batch, shape_.accumulation, ranks_};
  apply(!measures_noise() ? initial_batch(limits_, ranks_)
                   : choose_batch(model_, noise_, limits_, ranks_, initial_batch(limits_, ranks_), 0).shape);
  return true;
}

nlohmann::json AdaptiveBatchState::state_dict() const {
  return {{"records", records_},
          {"steps", steps_},
          {"last_decision_step", last_decision_step_},
          {"progress", progress_},
          {"shape", {{"local_batch", shape_.local_batch}, {"accumulation", shape_.accumulation}, {"ranks", shape_.ranks}}},
          {"noise", noise_.state_dict()},
          {"throughput", model_.state_dict()},
          {"moments_scale", moments_scale_}};
}

std::map<std::string, double> AdaptiveBatchState::metrics() const {
  const double batch = static_cast<double>(shape_.global());
  const double base = static_cast<double>(limits_.base_batch);
  const double seconds = model_.ready() ? model_.step_seconds(shape_) : 0;
  std::map<std::string, double> out = {{"adaptive_gain", noise_.gain(batch, base)},
                      {"adaptive_batch_size", batch},
                      {"adaptive_local_batch_size", static_cast<double>(shape_.local_batch)},
                      {"adaptive_accumulation", static_cast<double>(shape_.accumulation)},
                      {"adaptive_lr_factor", lr_factor_},
                      {"adaptive_progress", progress_}};
  if (noise_.ready() && std::isfinite(noise_.noise_scale())) out["adaptive_noise_scale"] = noise_.noise_scale();
  if (seconds > 0) out["adaptive_goodput"] = base * noise_.gain(batch, base) / seconds;
  return out;
}

}  // namespace hpctrial::trainer::detail
