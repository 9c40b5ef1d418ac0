#include "hpctrial/trainer/engine_trial.h"

#include <torch/nn/utils/clip_grad.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include "parallel/autocast.h"
#include "api/engine_access.h"
#include "hpctrial/comm/communicator.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/logging.h"
#include "state/state_io.h"
#include "parallel/zero.h"

namespace hpctrial::trainer {

DataIterator::DataIterator(std::vector<Batch> batches, std::string what)
    : batches_(std::move(batches)), what_(std::move(what)) {}

Batch DataIterator::next() {
  if (!has_next()) {
    throw ConfigError("DataIterator::next: " +
                      (batches_.size() == 1 ? "the one " + what_ + " has"
                                            : "all " + std::to_string(batches_.size()) + " " + what_ + "es have") +
                      " been read already" +
                      (what_ == "micro-batch"
                           ? "; with automatic accumulation train_batch reads one micro-batch a call, after "
                             "context.disable_auto_grad_accumulation() gradient_accumulation_steps() of them"
                           : "; evaluate_batch reads one batch a call"));
  }
  return batches_[taken_++];
}

// --- ModelEngine ------------------------------------------------------------------------------

ModelEngine::ModelEngine(std::shared_ptr<torch::nn::Module> model, std::shared_ptr<torch::optim::Optimizer> optimizer,
                         std::shared_ptr<torch::optim::LRScheduler> lr_scheduler)
    : model_(std::move(model)), optimizer_(std::move(optimizer)), lr_scheduler_(std::move(lr_scheduler)) {
  if (!model_) throw ConfigError("ModelEngine: the model is null");
  if (!optimizer_) throw ConfigError("ModelEngine: the optimizer is null; build it over the model's parameters");
}

ModelEngine::~ModelEngine() = default;

std::int64_t ModelEngine::optimizer_state_elements() const {
  return sharded_ ? sharded_->state_elements() : detail::optimizer_state_elements(*optimizer_);
}

TrialContext& ModelEngine::context() const {
  if (context_ == nullptr) {
    throw ConfigError("ModelEngine: the engine was not wrapped; pass it to context.wrap_model_engine(...) in the "
                      "trial's constructor");
  }
  return *context_;
}

// The context's gradient averaging counts micro-batches: it reduces on the last of each step.
void ModelEngine::at_micro_step() const { context().set_micro_step(micro_steps_); }

void ModelEngine::use_grad_scaler(std::shared_ptr<GradScaler> scaler) {
  if (context_ != nullptr) {
    throw ConfigError("ModelEngine::use_grad_scaler: the engine is wrapped already; set the scaler before "
                      "context.wrap_model_engine(...)");
  }
  scaler_ = std::move(scaler);
}

namespace {
[[noreturn]] void refuse_on_pipeline(const char* call) {
  throw ConfigError(std::string("ModelEngine::") + call + " on a pipeline engine: its forward, backward and step "
                    "run together over the stages; call engine.train_batch(data) once a global batch instead");
}
}  // namespace

void ModelEngine::backward(const torch::Tensor& unscaled_loss) {
  if (pipeline_) refuse_on_pipeline("backward");
  at_micro_step();
  const torch::Tensor loss = scaler_ ? scaler_->scale(unscaled_loss) : unscaled_loss;
  if (!sharded_) {
    context_->backward(loss);
    return;
  }
  // Backward's gradients are averaged into this rank's shard as they come: in every micro-batch
  // (ZeRO-2), or in the last of the step (ZeRO-1; the ones before accumulate here).
  const detail::AutocastPause pause;  // backward runs in the types forward chose
  const bool boundary = is_gradient_accumulation_boundary();
  sharded_->begin_backward(boundary, boundary && context_->measuring_gradient_noise());
  struct Disarm {
    detail::ShardedOptimizer& zero;
    bool done = false;
    ~Disarm() {
      if (!done) zero.disarm();
    }
  } disarm{*sharded_};
  if (accumulation_steps_ > 1) {
    (loss / static_cast<double>(accumulation_steps_)).backward();
  } else {
    loss.backward();
  }
  disarm.done = true;
  sharded_->end_backward();
  // A model of layers: a layer backward left gathered (its input a leaf) is released for the
  // next micro-batch's forward, which gathers one layer at a time again.
  if (fetches_layers_) sharded_->release_all();
}

bool ModelEngine::is_gradient_accumulation_boundary() const {
  return (micro_steps_ + 1 - micro_origin_) % accumulation_steps_ == 0;
}

void ModelEngine::step() {
  if (pipeline_) refuse_on_pipeline("step");
  at_micro_step();
  const bool boundary = is_gradient_accumulation_boundary();
  if (sharded_) {
    ++micro_steps_;
    if (boundary) sharded_step();
    return;
  }
  TrialContext::ClipGrads clip;
  if (gradient_clipping_ > 0) {
    clip = [max_norm = gradient_clipping_](std::vector<torch::Tensor>& parameters) {
      torch::nn::utils::clip_grad_norm_(parameters, max_norm);
    };
  }
  // Steps on the boundary only; a step whose gradients overflowed is skipped, and so is the
  // scheduler's (as in DeepSpeed).
  const bool stepped =
      scaler_ ? context_->step_optimizer(*optimizer_, *scaler_, clip) : context_->step_optimizer(*optimizer_, clip);
  if (stepped && lr_scheduler_) lr_scheduler_->step();
  ++micro_steps_;
}

// The gradients averaged into this rank's shards, clipped by their global norm, the shards
// stepped and gathered into every rank's parameters.
// With loss scaling, the shards are unscaled first, and the step is skipped on every rank when
// any rank's shard is not finite: the global sum of squares, in float64, is then inf or NaN
// (float32 gradients cannot overflow it).
// With an adaptive batch, the same all-reduce carries the ranks' squared norms of their own
// gradients, measured as the last backward handed them to the reduce-scatters: at stage 1 the
// step's whole accumulated gradient, at stage 2 its last micro-batch's (divided by the
// accumulation steps, as its loss was).
void ModelEngine::sharded_step() {
  sharded_->reduce_gradients();
  const double unscale = scaler_ ? 1.0 / scaler_->get_scale() : 1.0;
  if (scaler_) sharded_->scale_shard_grads(unscale);
  const bool measure = context_->measuring_gradient_noise();
  double sums[2] = {0, 0};  // the squared norm of the averaged gradient; the ranks' own
  if (gradient_clipping_ > 0 || scaler_ || measure) {
    const auto started = std::chrono::steady_clock::now();
    sums[0] = sharded_->shard_grad_norm_squared();
    if (measure) sums[1] = sharded_->take_local_norm_squared();
    context_->data_parallel_communicator().allreduce(sums, measure ? 2 : 1, comm::DType::kFloat64,
                                                     comm::ReduceOp::kSum);
    if (measure) {
      const bool whole = sharded_->stage() == 1 || accumulation_steps_ == 1;
      const double micro = whole ? 1.0 : static_cast<double>(accumulation_steps_);
      TrialContext::GradientNorms norms;
      norms.global_sqr = sums[0];
      norms.local_sqr = sums[1] / context_->data_parallel_size() * unscale * unscale * micro * micro;
      norms.local_micro_batches = whole ? 0 : 1;
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count() +
                             sharded_->take_measure_seconds();
      if (std::isfinite(sums[0])) context_->record_gradient_norms(norms, seconds);
    }
  }
  const double squares = sums[0];
  const bool skip = scaler_ && !std::isfinite(squares);
  if (scaler_) scaler_->record_unscaled(skip);
  if (gradient_clipping_ > 0 && !skip) {
    // As torch::nn::utils::clip_grad_norm_ does.
    const double factor = gradient_clipping_ / (std::sqrt(squares) + 1e-6);
    if (factor < 1) sharded_->scale_shard_grads(factor);
  }
  if (!skip) {
    context_->before_optimizer_step();
    const TrialContext::LrFactor scaled(*optimizer_, context_->lr_factor());
    sharded_->update();
  }
  sharded_->zero_grad();
  if (lr_scheduler_ && !skip) lr_scheduler_->step();
  context_->add_sync_wait_seconds(sharded_->take_wait_seconds());
}

// --- EngineTrialContext -------------------------------------------------------------------------

EngineTrialContext::EngineTrialContext(TrialContext& context) : context_(context) {
  const auto& engine = context.engine_config();
  if (!engine && context.aggregation_frequency() != 1) {
    throw ConfigError("optimizations.aggregation_frequency is " + std::to_string(context.aggregation_frequency()) +
                      ", but an engine trial accumulates gradients over engine.gradient_accumulation_steps "
                      "micro-batches; add `engine: {gradient_accumulation_steps: " +
                      std::to_string(context.aggregation_frequency()) +
                      "}` to the experiment config and remove aggregation_frequency");
  }
  if (engine && (engine->pipeline.stages > 1 || engine->pipeline.as_one_stage)) set_up_pipeline(engine->pipeline);
  resolve_batch();
  if (engine) {
    gradient_clipping_ = engine->gradient_clipping;
    zero_stage_ = engine->zero_stage;
    if (engine->bf16) context.configure_mixed_precision(torch::kBFloat16);
    if (const auto& fp16 = engine->fp16; fp16.enabled) {
      context.configure_mixed_precision(torch::kFloat16);
      GradScalerOptions scaling;
      scaling.dynamic = fp16.loss_scale == 0;
      scaling.init_scale = scaling.dynamic ? std::ldexp(1.0, fp16.initial_scale_power) : fp16.loss_scale;
      scaling.growth_interval = fp16.loss_scale_window;
      scaling.hysteresis = fp16.hysteresis;
      scaling.consecutive_hysteresis = fp16.consecutive_hysteresis;
      scaling.min_scale = scaling.dynamic ? fp16.min_loss_scale : 0;
      fp16_ = scaling;
    }
  }
}

// The loop resolved the engine section into the global batch and the accumulation steps, over
// the data-parallel replicas it knew of (the ranks, or a pipeline's replicas).
void EngineTrialContext::resolve_batch() {
  const std::int64_t replicas = context_.data_parallel_size();
  batch_.train_batch_size = context_.global_batch_size();
  batch_.accumulation_steps = context_.aggregation_frequency();
  batch_.micro_batch_size = batch_.train_batch_size / (replicas * batch_.accumulation_steps);
}

void EngineTrialContext::set_mpu(ModelParallelUnit unit) {
  if (pipe_) {
    throw ConfigError("set_mpu: engine.pipeline makes the model-parallel unit itself (stages x replicas); remove "
                      "engine.pipeline to split the model yourself, or leave the unit to the pipeline");
  }
  if (!engines_.empty()) {
    throw ConfigError("set_mpu: an engine is wrapped already, with batch sizes over every rank; call set_mpu "
                      "before wrap_model_engine");
  }
  context_.set_mpu(std::move(unit));
  const auto& engine = context_.engine_config();
  const int replicas = context_.data_parallel_size();
  if (engine) {
    // DeepSpeed's rule over the unit's data-parallel world: train = micro x accumulation x replicas.
    std::optional<std::int64_t> global_batch_size;
    if (const auto it = context_.hparams().find("global_batch_size"); it != context_.hparams().end()) {
      global_batch_size = it->get<std::int64_t>();  // checked by the loop already
    }
    std::string error;
    const auto batch = core::resolve_engine_batch(*engine, global_batch_size, replicas, error);
    if (!batch) {
      throw ConfigError("engine: " + error + " (with " + std::to_string(replicas) +
                        " data-parallel replica(s) of the model-parallel unit)");
    }
    context_.set_engine_batch(batch->train_batch_size, batch->accumulation_steps);
  }
  resolve_batch();
  if (context_.distributed().is_chief()) {
    core::log_info("engine: with the model-parallel unit, train_batch_size {} = micro-batch {} x {} accumulation "
                   "step(s) x {} data-parallel replica(s)", batch_.train_batch_size, batch_.micro_batch_size,
                   batch_.accumulation_steps, replicas);
  }
}

std::shared_ptr<ModelEngine> EngineTrialContext::wrap_model_engine(std::shared_ptr<ModelEngine> engine) {
  if (!engine) throw ConfigError("wrap_model_engine: the engine is null");
  if (engine->context_ != nullptr) throw ConfigError("wrap_model_engine: this engine is wrapped already");
  context_.wrap_model(engine->model_);
  context_.wrap_optimizer(engine->optimizer_);
  // The engine steps its scheduler once per global batch; the loop only checkpoints it.
  if (engine->lr_scheduler_) context_.wrap_lr_scheduler(engine->lr_scheduler_, StepMode::Manual);
  if (!engine->scaler_ && fp16_) engine->scaler_ = std::make_shared<GradScaler>(*fp16_);
  const auto& scalers = context_.scalers();  // engines may share one scaler
  if (engine->scaler_ && std::find(scalers.begin(), scalers.end(), engine->scaler_) == scalers.end()) {
    context_.wrap_scaler(engine->scaler_);
  }
  if (pipe_) attach_pipeline(*engine);
  engine->context_ = &context_;
  engine->train_batch_size_ = batch_.train_batch_size;
  engine->micro_batch_size_ = batch_.micro_batch_size;
  engine->accumulation_steps_ = batch_.accumulation_steps;
  engine->gradient_clipping_ = gradient_clipping_;
  engine->zero_stage_ = zero_stage_;
  engine->steps_origin_ = steps_origin_;
  engine->micro_origin_ = micro_origin_;
  engine->micro_steps_ = micro_steps_before(current_train_batch_);
  const auto& config = context_.engine_config();
  const bool swaps = config && config->offload_optimizer.device == "nvme";
  if (zero_stage_ >= 1 && context_.data_parallel_size() == 1 && !swaps) {
    // Nothing to shard on one rank: the engine steps as at stage 0 (the same checkpoints).
    detail::ShardedOptimizer::check(*engine->optimizer_);
  } else if (zero_stage_ >= 1) {
    context_.exclude_from_gradient_sync(engine->model_);
    detail::ZeroOptions zero;
    zero.stage = zero_stage_;
    if (config) {
      zero.bucket_elements = config->reduce_bucket_size;
      zero.persistence_threshold = config->param_persistence_threshold;
      zero.model_persistence_threshold = config->model_persistence_threshold;
      zero.prefetch_elements = config->prefetch_bucket_size;
      zero.max_live_elements = config->max_live_parameters;
      zero.max_reuse_elements = config->max_reuse_distance;
    }
    if (swaps) {
      detail::SwapOptions swap;
      swap.nvme_path = config->offload_optimizer.nvme_path;
      swap.key = "engine.zero_optimization.offload_optimizer.nvme_path";
      swap.sub_group_elements = config->sub_group_size;
      swap.buffer_count = config->offload_optimizer.buffer_count;
      swap.parameters = config->offload_param.device == "nvme";
      zero.swap = swap;
    }
    zero.partitions = partitions_.get();
    engine->sharded_ = std::make_unique<detail::ShardedOptimizer>(
        *engine->optimizer_, context_.communicator_for(context_.device()), zero);
    engine->fetch_layers();
  }
  engines_.push_back(engine);
  return engine;
}

void EngineTrialContext::begin_global_batch(std::int64_t batch_idx) {
  current_train_batch_ = batch_idx;
  for (auto& engine : engines_) engine->micro_steps_ = micro_steps_before(batch_idx);
  context_.set_micro_step(micro_steps_before(batch_idx));
  gather_parameters();
}

void EngineTrialContext::gather_parameters() {
  for (auto& engine : engines_) {
    if (engine->sharded_ && !engine->fetches_layers_) engine->sharded_->gather_all();
  }
}

void EngineTrialContext::reshape(std::int64_t batch_idx, std::int64_t micro_batch, std::int64_t accumulation) {
  if (micro_batch < 1 || accumulation < 1) {
    throw InternalError("an engine batch of " + std::to_string(accumulation) + " micro-batch(es) of " +
                        std::to_string(micro_batch));
  }
  micro_origin_ = micro_steps_before(batch_idx);
  steps_origin_ = batch_idx;
  batch_.micro_batch_size = micro_batch;
  batch_.accumulation_steps = accumulation;
  batch_.train_batch_size = micro_batch * accumulation * context_.data_parallel_size();
  for (auto& engine : engines_) {
    engine->train_batch_size_ = batch_.train_batch_size;
    engine->micro_batch_size_ = micro_batch;
    engine->accumulation_steps_ = accumulation;
    engine->steps_origin_ = steps_origin_;
    engine->micro_origin_ = micro_origin_;
    engine->micro_steps_ = micro_origin_;
  }
  // The context's gradient averaging (stage 0) counts micro-batches from here.
  context_.set_aggregation(accumulation, micro_origin_);
}

// --- EngineTrialRunner ------------------------------------------------------------------------

namespace detail {

EngineTrialRunner::EngineTrialRunner(TrialContext& context, const Make& make)
    : context_(std::make_unique<EngineTrialContext>(context)) {
  trial_ = make(*context_);
  if (!trial_) throw ConfigError("the engine trial factory returned no trial");
  context_->check_partitions_taken();
  if (context_->model_engines().empty()) {
    throw ConfigError("the engine trial wrapped no model engine; build a ModelEngine from the model and its "
                      "optimizer and pass it to context.wrap_model_engine(...) in the constructor");
  }
  if (context_->pipeline_stages() > 1) {
    for (const auto& engine : context_->model_engines()) {
      if (!engine->is_pipeline()) {
        throw ConfigError("engine.pipeline.stages is " + std::to_string(context_->pipeline_stages()) +
                          ", but a wrapped engine's model is not a pipeline; build it with "
                          "context.pipeline_module(layers, loss), or remove engine.pipeline");
      }
    }
  }
}

EngineTrialRunner::~EngineTrialRunner() = default;

DataLoader EngineTrialRunner::build_training_data_loader() {
  DataLoader loader = trial_->build_training_data_loader();
  const std::int64_t micro = context_->train_micro_batch_size_per_gpu();
  const std::int64_t steps = context_->gradient_accumulation_steps();
  if (loader.batch_size() != micro) {
    throw ConfigError("build_training_data_loader: the batch size is " + std::to_string(loader.batch_size()) +
                      " but train_micro_batch_size_per_gpu is " + std::to_string(micro) +
                      " (from the engine section and hyperparameters.global_batch_size); use "
                      "context.train_micro_batch_size_per_gpu()");
  }
  collate_micro_->store(micro);
  // An adaptive batch may accumulate later: its loader splits from the start.
  if (steps == 1 && !context_->trial_context().adaptive_batch()) return loader;
  // The loop reads this rank's share of a global batch at once; the runner splits it.
  DataLoaderOptions options = loader.options();
  if (options.collate()) {
    // A custom collate (padding) sees each micro-batch's samples alone, as it would in DeepSpeed.
    listed_micro_batches_ = true;
    options.collate([collate = options.collate(), micro_now = collate_micro_](std::vector<Batch> samples) {
      const auto micro = static_cast<std::size_t>(micro_now->load());
      std::vector<Batch> micro_batches;
      for (std::size_t start = 0; start < samples.size(); start += micro) {
        const auto end = std::min(samples.size(), start + micro);
        micro_batches.push_back(collate(std::vector<Batch>(samples.begin() + static_cast<std::ptrdiff_t>(start),
                                                           samples.begin() + static_cast<std::ptrdiff_t>(end))));
      }
      return Batch::list(std::move(micro_batches));
    });
  }
  if (loader.is_stream()) return DataLoader(loader.stream(), micro * steps, options);
  return DataLoader(loader.dataset_ptr(), micro * steps, options);
}

void EngineTrialRunner::reshape(std::int64_t batch_idx, std::int64_t micro_batch, std::int64_t accumulation) {
  context_->reshape(batch_idx, micro_batch, accumulation);
  collate_micro_->store(micro_batch);
}

DataLoader EngineTrialRunner::build_validation_data_loader() { return trial_->build_validation_data_loader(); }

Metrics EngineTrialRunner::train_batch(Batch& batch, std::int64_t epoch_idx, std::int64_t batch_idx) {
  const std::int64_t micro = context_->train_micro_batch_size_per_gpu();
  const std::int64_t steps = context_->gradient_accumulation_steps();
  std::vector<Batch> micro_batches;
  if (batch.tensors().empty()) {
    // A pipeline stage that reads no data: as many micro-batches, without records.
    micro_batches.resize(static_cast<std::size_t>(steps));
  } else if (listed_micro_batches_) {
    micro_batches = batch.items();
  } else if (steps == 1) {
    micro_batches.push_back(batch);
  } else {
    const std::int64_t samples = batch.num_samples();
    if (samples != micro * steps) {
      throw InternalError("engine trial: a batch of " + std::to_string(samples) + " samples, not " +
                          std::to_string(micro * steps) + " (" + std::to_string(steps) + " micro-batches of " +
                          std::to_string(micro) + ")");
    }
    for (std::int64_t i = 0; i < steps; ++i) {
      micro_batches.push_back(
          batch.map_tensors([&](const torch::Tensor& t) { return t.narrow(0, i * micro, micro); }));
    }
  }
  DataIterator data(std::move(micro_batches), "micro-batch");
  context_->begin_global_batch(batch_idx);
  const std::int64_t calls = context_->auto_grad_accumulation() ? steps : 1;
  std::map<std::string, std::pair<torch::Tensor, int>> sums;
  for (std::int64_t call = 0; call < calls; ++call) {
    const Metrics metrics = trial_->train_batch(data, epoch_idx, batch_idx);
    for (const auto& [name, metric] : metrics) {
      auto& [sum, count] = sums[name];
      sum = count == 0 ? metric.tensor() : sum + metric.tensor();
      ++count;
    }
  }
  const std::string how = context_->pipeline_stages() > 1
                              ? "with engine.pipeline, train_batch trains the global batch in one call of "
                                "engine.train_batch(data)"
                          : context_->auto_grad_accumulation()
                              ? "with automatic accumulation, each call of train_batch trains one micro-batch: "
                                "data.next(), engine.backward(loss), engine.step()"
                              : "with disable_auto_grad_accumulation(), train_batch trains every micro-batch of the "
                                "global batch: data.next(), engine.backward(loss), engine.step() for each";
  if (data.remaining() != 0) {
    throw ConfigError("train_batch read " + std::to_string(data.taken()) + " of the " + std::to_string(steps) +
                      " micro-batches of global batch " + std::to_string(batch_idx) + "; " + how);
  }
  const auto& engines = context_->model_engines();
  for (std::size_t i = 0; i < engines.size(); ++i) {
    const std::int64_t stepped = engines[i]->micro_steps() - context_->micro_steps_before(batch_idx);
    if (stepped != steps) {
      throw ConfigError("train_batch called step() on model engine " + std::to_string(i) + " " +
                        std::to_string(stepped) + " time(s) in global batch " + std::to_string(batch_idx) + ", not " +
                        std::to_string(steps) + " (gradient_accumulation_steps); " + how);
    }
  }
  Metrics averaged;
  for (auto& [name, entry] : sums) averaged.emplace(name, entry.second == 1 ? entry.first : entry.first / entry.second);
  return averaged;
}

Metrics EngineTrialRunner::evaluate_batch(Batch& batch) {
  // A new validation: the batch index starts again from 0.
  const std::int64_t trained = context_->current_train_batch();
  if (trained != validated_at_) {
    validated_at_ = trained;
    validation_batch_ = 0;
  }
  DataIterator data({batch}, "validation batch");
  context_->gather_parameters();
  return trial_->evaluate_batch(data, validation_batch_++);
}

}  // namespace detail
}  // namespace hpctrial::trainer
