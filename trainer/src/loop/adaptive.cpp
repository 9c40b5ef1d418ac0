// The loop's adaptive batch (optimizations.adaptive_batch_size; docs/adaptive.md): each step's
// gain and learning-rate factor, its measurements, and the choice of the next shape, which the
// chief makes and every rank takes at the same step boundary.
#include <torch/torch.h>

#include <cmath>
#include <fstream>

#include "hpctrial/core/error.h"
#include "hpctrial/core/experiment_dir.h"
#include "hpctrial/core/files.h"
#include "hpctrial/core/text.h"
#include "hpctrial/core/logging.h"
#include "hpctrial/trainer/engine_trial.h"
#include "loop/loop.h"
#include "state/state_io.h"

namespace hpctrial::trainer::detail {
namespace {

// AdaptDL's AdamGradientNoiseScale (adaptdl/torch/gradient_noise_scale.py), for LibTorch's Adam
// and AdamW: each parameter's preconditioner sqrt(v / (1 - beta2^step)) + eps from its second
// moment once it has taken 5 steps (undefined, the identity, before that and for a parameter the
// optimizer does not hold).
template <typename State, typename Options>
std::vector<torch::Tensor> adam_preconditioners(const torch::optim::Optimizer& optimizer,
                                                const std::vector<torch::Tensor>& parameters) {
  std::unordered_map<const void*, torch::Tensor> found;
  for (const auto& group : optimizer.param_groups()) {
    const auto& options = static_cast<const Options&>(group.options());
    const double beta2 = std::get<1>(options.betas());
    for (const auto& p : group.params()) {
      const auto it = optimizer.state().find(optimizer_state_key(p));
      if (it == optimizer.state().end()) continue;
      const auto& state = static_cast<const State&>(*it->second);
      if (state.step() < 5) continue;
      const double correction = 1 - std::pow(beta2, static_cast<double>(state.step()));
      found[p.unsafeGetTensorImpl()] = (state.exp_avg_sq().sqrt() / std::sqrt(correction)).add_(options.eps());
    }
  }
  std::vector<torch::Tensor> out;
  out.reserve(parameters.size());
  for (const auto& p : parameters) {
    const auto it = found.find(p.unsafeGetTensorImpl());
    out.push_back(it == found.end() ? torch::Tensor() : it->second);
  }
  return out;
}

// ... and Adam started afresh, as AdaptDL does when the batch's scale changes: both moments zero,
// no step taken (max_exp_avg_sq, AMSGrad's, is kept, as AdaptDL keeps it).
template <typename State>
void reset_adam_moments(torch::optim::Optimizer& optimizer) {
  torch::NoGradGuard no_grad;
  for (auto& [key, base] : optimizer.state()) {
    auto& state = static_cast<State&>(*base);
    if (state.step() == 0) continue;
    state.exp_avg().zero_();
    state.exp_avg_sq().zero_();
    state.step(0);
  }
}

}  // namespace

void Loop::setup_adaptive() {
  const core::AdaptiveBatch& config = config_.optimizations.adaptive_batch_size;
  if (!config.enabled) return;
  if (train_loader_->is_stream()) {
    throw ConfigError("optimizations.adaptive_batch_size needs an indexed dataset: the batch changes size as it "
                      "trains, and each rank's StreamDataset reads its own records in its own batches; return a "
                      "Dataset from build_training_data_loader, or turn the adaptive batch off");
  }
  if (context_->has_model_parallelism()) {
    throw ConfigError("optimizations.adaptive_batch_size with a model split over ranks (a model-parallel unit, "
                      "or engine.pipeline): the adaptive batch measures the gradient noise across whole replicas of "
                      "the model and reshapes every rank's batch alike, which hpctrial does not do for a model in "
                      "parts; turn the adaptive batch off, or train the model whole on each rank");
  }
  if (context_->optimizers().size() != 1) {
    throw ConfigError("optimizations.adaptive_batch_size scales the learning rate of one optimizer by the gain of "
                      "the gradients it steps with; the trial wraps " + std::to_string(context_->optimizers().size()) +
                      " optimizers");
  }
  core::AdaptiveBatch resolved = config;
  torch::optim::Optimizer* optimizer = context_->optimizers().front().get();
  const bool adam = dynamic_cast<torch::optim::Adam*>(optimizer) != nullptr ||
                    dynamic_cast<torch::optim::AdamW*>(optimizer) != nullptr;
  resolved.scaling_rule = resolve_scaling_rule(config.scaling_rule, adam);
  if (config.scaling_rule == core::ScalingRule::kAuto) {
    core::log_info("adaptive batch: the learning rate follows {} (the optimizer is {}an Adam or AdamW)",
                   to_string(resolved.scaling_rule), adam ? "" : "not ");
  }
  adaptive_ = std::make_unique<AdaptiveBatchState>(resolved, global_batch_, records_per_epoch_, comm_.size());
  context_->measure_gradient_noise(true);
  // As AdaptDL's optimizer step: the step's own gradients in the estimate before its gain and LR
  // factor are taken (scaling_rules.py, run_step after _final_callback).
  context_->set_gradient_norms_listener([this](const TrialContext::GradientNorms& norms) {
    adaptive_->fold_norms(GradientNorms{norms.local_sqr, norms.global_sqr, norms.local_micro_batches});
    context_->set_lr_factor(adaptive_->lr_factor());
    if (micro_in_step_ + 1 == loop_accumulation()) context_->set_epoch_end(adaptive_->epoch_after_step() != step_epoch_);
  });
  // AdamScale named in the config is AdaptDL's AdamScale() passed to AdaptiveDataParallel: the
  // noise of Adam-preconditioned gradients; `auto` measures the raw ones, as AdaptDL's default does.
  if (config.scaling_rule == core::ScalingRule::kAdamScale) {
    const auto& engine = context_->engine_config();
    if (!adam) {
      core::log_info("adaptive batch: adamscale measures the gradient noise as it is: the optimizer is not an Adam "
                     "or AdamW, whose second moments precondition it");
    } else if (engine && engine->zero_stage > 0) {
      core::log_info("adaptive batch: adamscale measures the gradient noise as it is: under ZeRO each rank holds "
                     "Adam's second moments of its shard only");
    } else {
      const bool adamw = dynamic_cast<torch::optim::AdamW*>(optimizer) != nullptr;
      context_->precondition_gradient_noise([optimizer, adamw](const std::vector<torch::Tensor>& parameters) {
        return adamw ? adam_preconditioners<torch::optim::AdamWParamState, torch::optim::AdamWOptions>(*optimizer, parameters)
                     : adam_preconditioners<torch::optim::AdamParamState, torch::optim::AdamOptions>(*optimizer, parameters);
      });
      reset_adam_ = adamw ? reset_adam_moments<torch::optim::AdamWParamState>
                          : reset_adam_moments<torch::optim::AdamParamState>;
      preconditioned_optimizer_ = optimizer;
    }
  }
  // An engine trial's loop batch is a whole step: the engine accumulates its micro-batches.
  engine_runner_ = dynamic_cast<EngineTrialRunner*>(trial_.get());
}

void Loop::start_adaptive_step() {
  if (preconditioned_optimizer_ != nullptr && adaptive_->take_scale_change()) reset_adam_(*preconditioned_optimizer_);
  adaptive_->start_step();
  if (!engine_runner_) context_->set_aggregation(adaptive_->shape().accumulation, batches_trained_);
  context_->set_lr_factor(adaptive_->lr_factor());
  progress_before_step_ = adaptive_->progress();
  step_epoch_ = adaptive_->epoch();
  step_started_ = Clock::now();
}

bool Loop::end_adaptive_micro_batch() {
  for (std::int64_t i = engine_runner_ ? adaptive_->shape().accumulation : 1; i > 0; --i) adaptive_->end_micro_batch();
  if (++micro_in_step_ < loop_accumulation()) return false;
  micro_in_step_ = 0;
  const double sync = context_->take_sync_wait_seconds();
  double seconds = std::chrono::duration<double>(Clock::now() - step_started_).count();
  if (options_.adaptive_step_seconds) {
    const BatchShape& shape = adaptive_->shape();
    seconds = options_.adaptive_step_seconds(shape.local_batch, shape.accumulation, shape.ranks);
  }
  // What the adaptive batch costs a step: measuring the gradients' norms (inside train_batch), and
  // updating the estimates.
  timings_.add("adaptive_norms", std::chrono::duration_cast<Clock::duration>(
                                     std::chrono::duration<double>(context_->take_estimator_seconds())));
  {
    detail::PhaseTimings::Scope t(timings_, "adaptive_update");
    const bool modelled = static_cast<bool>(options_.adaptive_step_seconds);
    adaptive_->end_step(seconds, modelled ? (comm_.size() > 1 ? options_.adaptive_sync_seconds : 0.0) : sync);
  }
  last_step_epoch_ = step_epoch_;
  return true;
}

// A collective at a step boundary every rank reaches alike: the chief's choice, broadcast.
void Loop::decide_adaptive_batch() {
  if (!adaptive_->decision_due()) return;
  std::int64_t shape[3] = {0, 0, 0};
  BatchChoice choice;
  if (chief()) {
    choice = adaptive_->decide();
    shape[0] = choice.shape.local_batch;
    shape[1] = choice.shape.accumulation;
    shape[2] = choice.shape.ranks;
  }
  comm_.broadcast_async(shape, sizeof shape, 0)->wait();
  const BatchShape chosen{shape[0], shape[1], static_cast<int>(shape[2])};
  const bool changed = chosen != adaptive_->shape();
  if (changed && chief()) {
    core::log_info("adaptive batch: {} records a step ({} x {} micro-batch(es) x {} ranks) after step {}{}; gain {:.3f}, "
                   "goodput {:.1f} base records/s", chosen.global(), chosen.local_batch, chosen.accumulation,
                   chosen.ranks, adaptive_->steps(), choice.exploring ? ", measuring a larger local batch" : "",
                   choice.gain, choice.goodput);
  }
  adaptive_->apply(chosen);
  if (changed) restart_training_data();
}

bool Loop::adaptive_period_reached(const Period& period) const {
  if (period.batches <= 0 || micro_in_step_ != 0) return false;
  const auto every = static_cast<double>(period.batches);
  return std::floor(adaptive_->progress() / every + 1e-9) > std::floor(progress_before_step_ / every + 1e-9);
}

void Loop::record_run(const std::vector<std::string>& placement) const {
  nlohmann::json line = {{"started", core::utc_now_iso()},
                         {"ranks", comm_.size()},
                         {"batches", batches_trained_},
                         {"restart", restart_count_}};
  if (adaptive_) {
    const BatchShape& shape = adaptive_->shape();
    line["batch"] = shape.global();
    line["local_batch"] = shape.local_batch;
    line["accumulation"] = shape.accumulation;
  } else {
    line["batch"] = global_batch_;
    line["local_batch"] = context_->per_slot_batch_size();
    line["accumulation"] = config_.optimizations.aggregation_frequency;
  }
  // What started the ranks and what they ran in: the config the launcher started them from says.
  line["launcher"] = core::mpi_name(config_.launcher.mpi);
  if (const core::Container& container = config_.container; !container.image.empty()) {
    line["container"] = {{"runtime", core::runtime_name(container.runtime)}, {"image", container.image}};
  }
  if (!source_checkpoint_.empty()) line["source_checkpoint"] = source_checkpoint_;
  // Which level of checkpoints it resumed from: the shared filesystem's, the copies in node memory,
  // or those and the partners' copies of the ranks that lost theirs (which rank's came from which).
  if (!resumed_from_.empty()) {
    const char* level = !resumed_from_memory_ ? "shared_fs" : memory_moves_.empty() ? "memory" : "partner";
    line["resumed_from"] = {{"level", level}, {"checkpoint", resumed_from_}};
    for (const auto& [owner, keeper] : memory_moves_) {
      line["resumed_from"]["from_partners"].push_back({{"rank", owner}, {"partner", keeper}});
    }
  }
  if (!options_.code_digest.empty()) line["code"] = options_.code_digest;
  line["placement"] = nlohmann::json::array();
  for (const std::string& place : placement) line["placement"].push_back(nlohmann::json::parse(place));
  const std::string runs = core::TrialLayout{options_.trial_dir}.runs_file();
  std::ofstream out(runs, std::ios::app);
  out << line.dump() << "\n";
  if (!out) core::log_warning("cannot record this run in {}", runs);
}

void Loop::record_elastic_preference() const {
  const core::Resources& resources = config_.resources;
  if (!chief() || !adaptive_ || !resources.elastic()) return;
  const int slots = adaptive_->preferred_ranks(resources.min_slots(), resources.slots_per_trial, resources.slots_per_node);
  try {
    core::write_file_atomic(core::TrialLayout{options_.trial_dir}.elastic_file(),
                            nlohmann::json{{"preferred_slots", slots}}.dump() + "\n");
  } catch (const Error& e) {
    core::log_warning("the preferred size of the next run was not recorded: {}", e.what());
  }
}

// The batches read ahead were cut for the old shape: the order goes on from the records trained,
// in batches of the new one.
void Loop::restart_training_data() {
  prefetcher_.reset();
  sampler_.reset();
  start_training_data(data_seed_);
}

}  // namespace hpctrial::trainer::detail
