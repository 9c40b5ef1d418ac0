// ZeRO-3 around the trial's code: a model of layers built partitioned (DeepSpeed's zero.Init)
// and gathered one layer at a time, the parameters whole for the trial's own code (DeepSpeed's
// GatheredParameters), and the parameter and gradient elements a rank holds.
#include <algorithm>
#include <exception>
#include <iterator>
#include <map>
#include <memory>
#include <vector>
#include <string>
#include <utility>

#include "hpctrial/core/error.h"
#include "hpctrial/core/logging.h"
#include "hpctrial/trainer/engine_trial.h"
#include "hpctrial/trainer/pipeline.h"
#include "hpctrial/comm/communicator.h"
#include "parallel/zero.h"

namespace hpctrial::trainer {

PipelineModule EngineTrialContext::layered_module(std::vector<LayerSpec> layers, PipelineLoss loss) {
  if (pipe_) {
    throw ConfigError("context.layered_module: the experiment config has engine.pipeline; build the pipeline's "
                      "stage with context.pipeline_module(layers, loss)");
  }
  PipelineOptions options;
  options.seed = context_.trial_seed();
  if (zero_stage_ == 3 && context_.data_parallel_size() > 1) {
    if (!partitions_) {
      // offload_param on nvme: each part on the disk from the moment it is cut.
      const auto& config = context_.engine_config();
      std::unique_ptr<detail::PartSpill> spill;
      if (config && config->offload_param.device == "nvme") {
        spill = std::make_unique<detail::PartSpill>(config->offload_param.nvme_path,
                                                    "engine.zero_optimization.offload_param.nvme_path");
      }
      partitions_ = std::make_shared<detail::PartitionStore>(context_.communicator_for(context_.device()),
                                                             std::move(spill));
    }
    options.after_build = [store = partitions_](torch::nn::Module& layer) { store->partition(layer); };
  }
  return PipelineModule(std::move(layers), std::move(loss), 0, options);
}

void EngineTrialContext::check_partitions_taken() const {
  if (partitions_ && !partitions_->empty()) {
    throw ConfigError("context.layered_module built " + std::to_string(partitions_->elements()) + " parameter "
                      "element(s) of this rank partitioned (ZeRO stage 3) that no wrapped engine's optimizer steps; "
                      "build each engine's optimizer over its layered module's parameters and wrap the engine");
  }
}

std::int64_t ModelEngine::parameter_elements() const {
  if (sharded_) return sharded_->parameter_elements();
  std::int64_t sum = 0;
  for (const auto& p : model_->parameters()) sum += p.numel();
  return sum;
}

std::int64_t ModelEngine::gradient_elements() const {
  if (sharded_) return sharded_->gradient_elements();
  std::int64_t sum = 0;
  for (const auto& p : model_->parameters()) sum += p.grad().defined() ? p.grad().numel() : 0;
  return sum;
}

namespace {

// A layer's parameters by group.
using Where = std::map<std::size_t, std::vector<std::size_t>>;

// A layer's parameters kept for its backward, by group: emptied and refilled, or `held`
// gathered throughout (stage3_max_reuse_distance) and released once backward has passed.
struct Kept final : PipelineModuleImpl::LayerFetch::Kept {
  detail::ShardedOptimizer* sharded = nullptr;
  std::vector<detail::ShardedOptimizer::Kept> groups;
  Where held;
  void refill() override {
    for (auto& kept : groups) sharded->refill(kept);
  }
  void empty() override {
    for (auto& kept : groups) sharded->empty(kept);
    for (const auto& [group, params] : held) sharded->release(group, params);
    held.clear();
  }
};

// The prefetch, by DeepSpeed's rule: while a layer runs, at most min(stage3_prefetch_bucket_size,
// stage3_max_live_parameters - what is gathered or on its way) elements more started, a
// parameter at a time in the order the layers use them (a kept layer's of a group at once).
void prefetch_layers(PipelineModuleImpl::LayerFetch& fetch, detail::ShardedOptimizer* sharded,
                     const std::shared_ptr<std::map<std::size_t, Where>>& layers) {
  const std::int64_t bucket = sharded->options().prefetch_elements;
  const std::int64_t most = sharded->options().max_live_elements;
  if (bucket <= 0) return;
  const auto room = [sharded, bucket, most] { return std::min(bucket, most - sharded->live_elements()); };
  fetch.prefetch = [sharded, layers, room](std::size_t index, bool forward) {
    const std::int64_t budget = room();
    std::int64_t started = 0;
    const auto start = [&](const Where& where) {
      for (const auto& [group, params] : where) {
        if (started < budget) started += sharded->prefetch(group, params, budget - started);
      }
    };
    if (forward) {
      for (auto it = layers->upper_bound(index); it != layers->end() && started < budget; ++it) start(it->second);
    } else {
      for (auto it = std::make_reverse_iterator(layers->lower_bound(index)); it != layers->rend() && started < budget;
           ++it) {
        start(it->second);
      }
    }
  };
  fetch.prefetch_kept = [sharded, room](const std::vector<std::shared_ptr<PipelineModuleImpl::LayerFetch::Kept>>& kept,
                                        std::size_t before) {
    const std::int64_t budget = room();
    std::int64_t started = 0;
    for (std::size_t r = before; r-- > 0 && started < budget;) {
      for (auto& group : static_cast<Kept&>(*kept[r]).groups) {
        if (started < budget) started += sharded->start_refill(group);
      }
    }
  };
}

// By layer, the elements of the parameters of the layers after it. DeepSpeed's
// stage3_max_reuse_distance: between a layer's forward and its backward, those layers run forward
// and then backward, using twice these elements; fewer than the distance, and the layer stays
// gathered.
std::shared_ptr<std::map<std::size_t, std::int64_t>> elements_after(const std::map<std::size_t, Where>& layers,
                                                                   const detail::ShardedOptimizer& sharded) {
  auto after = std::make_shared<std::map<std::size_t, std::int64_t>>();
  std::int64_t later = 0;
  for (auto it = layers.rbegin(); it != layers.rend(); ++it) {
    (*after)[it->first] = later;
    for (const auto& [group, params] : it->second) {
      for (const std::size_t i : params) later += sharded.layout(group).numels[i];
    }
  }
  return after;
}

}  // namespace

void ModelEngine::fetch_layers() {
  auto* module = dynamic_cast<PipelineModuleImpl*>(model_.get());
  if (!sharded_ || !sharded_->partitions_parameters() || module == nullptr || pipeline_) return;
  // Each layer's parameters by group, in the same order on every rank.
  auto layers = std::make_shared<std::map<std::size_t, Where>>();
  for (std::size_t index = module->first_layer(); index < module->end_layer(); ++index) {
    for (const auto& p : module->layer(index).ptr()->parameters()) {
      if (const auto at = sharded_->locate(p)) (*layers)[index][at->first].push_back(at->second);
    }
  }
  detail::ShardedOptimizer* sharded = sharded_.get();
  // What each layer's last gather gathered: release and keep let go of that only, and leave
  // what was whole already (a GatheredParameters scope's) as it was.
  auto gathered = std::make_shared<std::map<std::size_t, Where>>();
  auto fetch = std::make_shared<PipelineModuleImpl::LayerFetch>();
  fetch->gather = [sharded, layers, gathered](std::size_t index) {
    Where& mine = (*gathered)[index];
    mine.clear();
    if (const auto it = layers->find(index); it != layers->end()) {
      for (const auto& [group, params] : it->second) {
        for (const std::size_t i : params) {
          if (!sharded->is_gathered(group, i)) mine[group].push_back(i);
        }
        sharded->gather(group, params);
      }
    }
  };
  fetch->release = [sharded, gathered](std::size_t index) {
    for (const auto& [group, params] : (*gathered)[index]) sharded->release(group, params);
  };
  const auto after = elements_after(*layers, *sharded);
  const std::int64_t reuse = sharded->options().max_reuse_elements;
  fetch->keep = [sharded, gathered, after, reuse](std::size_t index) -> std::shared_ptr<PipelineModuleImpl::LayerFetch::Kept> {
    auto kept = std::make_shared<Kept>();
    kept->sharded = sharded;
    const auto at = after->find(index);
    if (at != after->end() && at->second < reuse / 2 + reuse % 2) {  // 2 x after < reuse, without overflow
      kept->held = (*gathered)[index];
      return kept;
    }
    for (const auto& [group, params] : (*gathered)[index]) kept->groups.push_back(sharded->keep(group, params));
    return kept;
  };
  prefetch_layers(*fetch, sharded, layers);
  module->fetch_layers(std::move(fetch));
  fetches_layers_ = true;
}

GatheredParameters ModelEngine::gathered_parameters(std::optional<int> modifier_rank) {
  const int replicas = context().data_parallel_size();
  if (modifier_rank && (*modifier_rank < 0 || *modifier_rank >= replicas)) {
    throw ConfigError("gathered_parameters: modifier rank " + std::to_string(*modifier_rank) + " is not a "
                      "data-parallel rank (0 to " + std::to_string(replicas - 1) + ")");
  }
  return GatheredParameters(*this, modifier_rank);
}

GatheredParameters::GatheredParameters(ModelEngine& engine, std::optional<int> modifier_rank)
    : engine_(&engine), modifier_rank_(modifier_rank), exceptions_(std::uncaught_exceptions()) {
  if (engine.sharded_) {
    released_ = engine.sharded_->released();
    engine.sharded_->gather_all();
  }
}

GatheredParameters::GatheredParameters(GatheredParameters&& other) noexcept
    : engine_(std::exchange(other.engine_, nullptr)),
      modifier_rank_(other.modifier_rank_),
      released_(std::move(other.released_)),
      exceptions_(other.exceptions_) {}

GatheredParameters::~GatheredParameters() {
  if (engine_ == nullptr) return;
  detail::ShardedOptimizer* sharded = engine_->sharded_.get();
  // Unwinding: no collective, which the other ranks may never enter.
  const bool unwinding = std::uncaught_exceptions() > exceptions_;
  try {
    if (modifier_rank_ && !unwinding) {
      if (sharded != nullptr) {
        sharded->broadcast_whole(*modifier_rank_);
      } else if (engine_->context().data_parallel_size() > 1) {
        torch::NoGradGuard no_grad;
        comm::Communicator& comm = engine_->context().data_parallel_communicator();
        for (auto& p : engine_->model_->parameters()) {
          auto host = p.detach().to(torch::kCPU).contiguous();
          comm.broadcast_async(host.data_ptr(), host.nbytes(), *modifier_rank_)->wait();
          p.copy_(host);
        }
      }
    }
    if (sharded != nullptr) {
      for (const auto& [group, param] : released_) sharded->release(group, {param});
    }
  } catch (const std::exception& e) {
    // A destructor cannot throw; the ranks' next collective fails with the cause.
    core::log_error("gathered_parameters: ending the gathered parameters failed: {}", e.what());
  }
}

}  // namespace hpctrial::trainer
