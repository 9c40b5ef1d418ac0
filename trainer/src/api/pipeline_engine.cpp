// The engine trial's pipeline parallelism (engine.pipeline): the grid of stages and replicas, the
// stage's PipelineModule, and ModelEngine::train_batch / eval_batch over the 1F1B runner.
#include <torch/torch.h>

#include <chrono>
#include <cmath>

#include "hpctrial/comm/communicator.h"
#include "hpctrial/core/error.h"
#include "hpctrial/trainer/engine_trial.h"
#include "parallel/pipeline_runner.h"
#include "parallel/zero.h"

namespace hpctrial::trainer {

// --- the grid ---------------------------------------------------------------------------------

// Ranks = stages x replicas: stage rank % stages, replica rank / stages, so that a pipeline's
// neighbours are consecutive ranks (on one node where the ranks fill nodes in order). The
// stages of a replica are its pipe; the ranks of one stage in every replica its data-parallel
// group, over which the loop shards the data and the engine averages gradients.
void EngineTrialContext::set_up_pipeline(const core::EngineConfig::Pipeline& pipeline) {
  comm::Communicator& world = context_.communicator();
  const int stages = pipeline.stages;
  if (world.size() % stages != 0) {
    throw ConfigError("engine.pipeline.stages (" + std::to_string(stages) + ") does not divide the " +
                      std::to_string(world.size()) + " ranks; make resources.slots_per_trial a multiple of it");
  }
  stage_ = world.rank() % stages;
  const int replica = world.rank() / stages;
  pipe_ = world.split(replica, stage_);
  ModelParallelUnit unit;
  unit.data_parallel_rank = replica;
  unit.data_parallel_world_size = world.size() / stages;
  unit.should_report_metrics = stage_ == stages - 1;  // the last stage computed the loss
  unit.should_build_data_loader = stage_ == 0 || stage_ == stages - 1;  // the inputs, the targets
  unit.data_parallel_group = world.split(stage_, replica);
  context_.set_mpu(std::move(unit));
}

int EngineTrialContext::pipeline_stages() const { return pipe_ ? pipe_->size() : 1; }

PipelineModule EngineTrialContext::pipeline_module(std::vector<LayerSpec> layers, PipelineLoss loss) const {
  const auto& engine = context_.engine_config();
  if (!pipe_ || !engine) {
    throw ConfigError("context.pipeline_module: the experiment config has no engine.pipeline; add "
                      "`engine: {pipeline: {stages: 2}}` (the ranks must be a multiple of the stages)");
  }
  PipelineOptions options;
  options.stages = engine->pipeline.stages;
  options.partition_method = engine->pipeline.partition_method;
  for (const auto bound : engine->pipeline.bounds) options.bounds.push_back(static_cast<std::size_t>(bound));
  options.activation_checkpoint_interval = engine->pipeline.activation_checkpoint_interval;
  options.seed = context_.trial_seed();
  return PipelineModule(std::move(layers), std::move(loss), stage_, options);
}

// A pipeline engine's runner, over this rank's pipe. The engine averages its gradients itself,
// after the schedule, so the context's gradient buckets leave its model out.
void EngineTrialContext::attach_pipeline(ModelEngine& engine) {
  auto* module = dynamic_cast<PipelineModuleImpl*>(engine.model_.get());
  if (module == nullptr) {
    throw ConfigError("wrap_model_engine: engine.pipeline.stages is " + std::to_string(pipeline_stages()) +
                      ", but the engine's model is not a pipeline; build it with context.pipeline_module(layers, "
                      "loss), or remove engine.pipeline");
  }
  if (module->stages() != pipeline_stages() || module->stage() != stage_) {
    throw ConfigError("wrap_model_engine: the engine's PipelineModule is stage " + std::to_string(module->stage()) +
                      " of " + std::to_string(module->stages()) + ", but this rank runs stage " +
                      std::to_string(stage_) + " of " + std::to_string(pipeline_stages()) +
                      " (engine.pipeline); build it with context.pipeline_module(layers, loss)");
  }
  if (zero_stage_ >= 2) {
    throw ConfigError("engine.zero_optimization.stage " + std::to_string(zero_stage_) + " with engine.pipeline: a "
                      "pipeline accumulates each micro-batch's gradients in the stage until the schedule ends, "
                      "which the partitioned gradients of ZeRO-2 and ZeRO-3 cannot (DeepSpeed refuses them too); use stage 0 "
                      "or 1");
  }
  if (fp16_) {
    throw NotSupported("engine.fp16 with engine.pipeline: hpctrial's pipeline does not scale losses yet; use "
                       "`bf16: {enabled: true}` (no loss scaling needed), or train without the pipeline");
  }
  context_.exclude_from_gradient_sync(engine.model_);
  engine.pipeline_ = std::make_unique<detail::PipelineRunner>(*module, *pipe_);
}

// --- the engine's global batch ----------------------------------------------------------------

namespace {

// The first stage's inputs and the last stage's targets of the micro-batches in `data` (the
// other stages' micro-batches hold no records).
void stage_tensors(DataIterator& data, const PipelineModuleImpl& module, std::vector<torch::Tensor>& inputs,
                   std::vector<torch::Tensor>& targets) {
  while (data.has_next()) {
    const Batch batch = data.next();
    const auto take = [](const torch::Tensor& tensor, const char* stage, const char* what,
                         std::vector<torch::Tensor>& into) {
      if (!tensor.defined()) {
        throw ConfigError(std::string("the pipeline's ") + stage + " stage got a batch without " + what +
                          ": the loaders' batches must be (data, target) pairs, the inputs of the first layer and "
                          "the targets of the loss");
      }
      into.push_back(tensor);
    };
    if (module.is_first_stage()) take(batch.data, "first", "data", inputs);
    if (module.is_last_stage()) take(batch.target, "last", "a target", targets);
  }
}

}  // namespace

torch::Tensor ModelEngine::train_batch(DataIterator& data) {
  if (!pipeline_) {
    throw ConfigError("ModelEngine::train_batch is a pipeline engine's (engine.pipeline, a model from "
                      "context.pipeline_module); this engine trains with engine.backward(loss) and engine.step()");
  }
  at_micro_step();
  if (data.remaining() != static_cast<std::size_t>(accumulation_steps_)) {
    throw ConfigError("ModelEngine::train_batch: the data holds " + std::to_string(data.remaining()) +
                      " micro-batch(es), not gradient_accumulation_steps (" + std::to_string(accumulation_steps_) +
                      "); pass the DataIterator train_batch was given, unread");
  }
  std::vector<torch::Tensor> inputs, targets;
  stage_tensors(data, static_cast<const PipelineModuleImpl&>(*model_), inputs, targets);
  const double loss = pipeline_->train(inputs, targets, accumulation_steps_);
  micro_steps_ += accumulation_steps_;
  pipeline_step();
  return torch::tensor(loss, torch::kFloat64);
}

torch::Tensor ModelEngine::eval_batch(DataIterator& data) {
  if (!pipeline_) {
    throw ConfigError("ModelEngine::eval_batch is a pipeline engine's (engine.pipeline); this engine validates "
                      "with the trial's own forward pass");
  }
  std::vector<torch::Tensor> inputs, targets;
  const auto batches = static_cast<std::int64_t>(data.remaining());
  stage_tensors(data, static_cast<const PipelineModuleImpl&>(*model_), inputs, targets);
  return torch::tensor(pipeline_->evaluate(inputs, targets, batches), torch::kFloat64);
}

// After the schedule: the stage's gradients (the mean over the global batch's micro-batches)
// averaged over the replicas - all-reduced, or reduce-scattered into ZeRO-1's shards - then
// clipped by the norm of every stage's together, the optimizer and the LR scheduler stepped once.
void ModelEngine::pipeline_step() {
  TrialContext& c = context();
  const bool clip = gradient_clipping_ > 0;
  if (sharded_) {
    sharded_->reduce_gradients();
    if (clip) {
      double squares = sharded_->shard_grad_norm_squared();
      c.data_parallel_communicator().allreduce(&squares, 1, comm::DType::kFloat64, comm::ReduceOp::kSum);
      const double factor = gradient_clipping_ / (std::sqrt(pipeline_->sum_over_stages(squares)) + 1e-6);
      if (factor < 1) sharded_->scale_shard_grads(factor);
    }
    c.before_optimizer_step();
    {
      const TrialContext::LrFactor scaled(*optimizer_, c.lr_factor());
      sharded_->update();
    }
    sharded_->zero_grad();
    c.add_sync_wait_seconds(sharded_->take_wait_seconds());
  } else {
    if (c.data_parallel_size() > 1) {
      const auto started = std::chrono::steady_clock::now();
      torch::NoGradGuard no_grad;
      std::vector<torch::Tensor> gradients;
      for (auto& parameter : model_->parameters()) {
        if (!parameter.grad().defined()) parameter.mutable_grad() = torch::zeros_like(parameter);
        gradients.push_back(parameter.grad());
      }
      if (!gradients.empty()) {
        std::vector<torch::Tensor> parts;
        for (const auto& g : gradients) parts.push_back(g.reshape({-1}));
        // Over the host, in float32 (the parameters' type; bf16 autocast keeps them float32).
        torch::Tensor flat = torch::cat(parts).to(torch::kCPU, torch::kFloat32).contiguous();
        c.data_parallel_communicator().allreduce(flat.data_ptr<float>(), static_cast<std::size_t>(flat.numel()),
                                                 comm::DType::kFloat32, comm::ReduceOp::kAvg);
        std::int64_t offset = 0;
        for (auto& g : gradients) {
          g.copy_(flat.slice(0, offset, offset + g.numel()).view(g.sizes()));
          offset += g.numel();
        }
      }
      c.add_sync_wait_seconds(std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
    }
    if (clip) pipeline_->clip_grad_norm(gradient_clipping_);
    c.before_optimizer_step();
    {
      const TrialContext::LrFactor scaled(*optimizer_, c.lr_factor());
      optimizer_->step();
    }
    optimizer_->zero_grad();
  }
  if (lr_scheduler_) lr_scheduler_->step();
}

}  // namespace hpctrial::trainer
