// A model cut into pipeline stages (DeepSpeed's PipelineModule, in LibTorch C++): a sequence of
// layers, each given as how to build it, and a loss. A rank builds and allocates the layers of
// its own stage only; its forward() runs them.
//
//   std::vector<hpctrial::LayerSpec> layers = {
//       hpctrial::LayerSpec::of<torch::nn::Linear>(784, 256),
//       hpctrial::LayerSpec::function("relu", [](const torch::Tensor& x) { return torch::relu(x); }),
//       ...
//   };
//   PipelineModule net(layers, loss, stage, {.stages = 4});  // usually from the engine's context
//
// Each layer is built from the seed and its index in the whole sequence (torch::manual_seed(seed
// + index) just before its factory runs), so a pipeline of any number of stages starts from the
// same weights, and so does the same sequence on one rank.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/pimpl.h>
#include <c10/util/Type.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace hpctrial::trainer {

// One layer of a pipeline: a name and how to build it.
class LayerSpec {
 public:
  using Build = std::function<torch::nn::AnyModule()>;
  LayerSpec(std::string name, Build build);

  // A module holder and its constructor's arguments: LayerSpec::of<torch::nn::Linear>(784, 256).
  template <typename Holder, typename... Args>
  static LayerSpec of(Args... args) {
    return LayerSpec(c10::demangle_type<typename Holder::ContainedType>(),
                     [args...] { return torch::nn::AnyModule(Holder(args...)); });
  }
  // A function of a tensor without parameters (an activation, a reshape).
  static LayerSpec function(std::string name, std::function<torch::Tensor(const torch::Tensor&)> function);

  const std::string& name() const { return name_; }
  torch::nn::AnyModule build() const;

 private:
  std::string name_;
  Build build_;
};

// The loss of the last stage's output for a micro-batch and its target.
using PipelineLoss = std::function<torch::Tensor(const torch::Tensor& output, const torch::Tensor& target)>;

struct PipelineOptions {
  int stages = 1;
  // "parameters" (balance the parameter counts), "uniform" (balance the layer counts) or
  // "explicit" (`bounds`: the first layer of each stage, then the number of layers).
  std::string partition_method = "parameters";
  std::vector<std::size_t> bounds;
  // Every this many layers of a stage are one segment whose activations are recomputed in
  // backward instead of kept (0: none).
  int activation_checkpoint_interval = 0;
  std::uint64_t seed = 0;
  // Called on each layer of this stage as soon as it is built (ZeRO-3's partitioned
  // construction: EngineTrialContext::layered_module).
  std::function<void(torch::nn::Module& layer)> after_build;
};

class PipelineModuleImpl : public torch::nn::Module {
 public:
  // Builds the layers of `stage` (0 .. options.stages - 1); ConfigError for a partition that
  // does not fit the layers.
  PipelineModuleImpl(std::vector<LayerSpec> layers, PipelineLoss loss, int stage, PipelineOptions options);

  // This stage's layers, in order.
  torch::Tensor forward(torch::Tensor input);
  torch::Tensor loss(const torch::Tensor& output, const torch::Tensor& target) const { return loss_(output, target); }

  int stage() const { return stage_; }
  int stages() const { return options_.stages; }
  bool is_first_stage() const { return stage_ == 0; }
  bool is_last_stage() const { return stage_ == options_.stages - 1; }
  // Where each stage's layers start, and the number of layers: stage s holds [bounds[s], bounds[s + 1]).
  const std::vector<std::size_t>& bounds() const { return bounds_; }
  // By activation-checkpointing segment of this stage: whether backward recomputes it (it holds
  // a parameter, as DeepSpeed's _is_checkpointable asks); the others keep their activations.
  const std::vector<bool>& recomputed_segments() const { return recomputed_; }
  std::size_t first_layer() const { return bounds_[static_cast<std::size_t>(stage_)]; }
  std::size_t end_layer() const { return bounds_[static_cast<std::size_t>(stage_) + 1]; }
  std::size_t layer_count() const { return specs_.size(); }
  // The layer of global index `index`, held by this stage.
  torch::nn::AnyModule& layer(std::size_t index);
  const PipelineOptions& options() const { return options_; }

  // ZeRO stage 3, set by the engine that wraps the module (when it is not a pipeline): around
  // each layer that holds parameters, gather(index) before it runs and release(index) after.
  // In a forward that builds a graph, keep(index) releases it instead: the activations saved for
  // backward may be views of its whole parameters (linear's transposed weight), so their
  // storages stay, their bytes freed; before the layer's backward refill() gathers the values
  // back into them, and once backward has passed the layer empty() frees them again, as
  // DeepSpeed's hooks around each module's backward do. With activation_checkpoint_interval set,
  // each layer is a segment of activation checkpointing of its own instead, gathered again when
  // backward recomputes it. Optional, the prefetch: prefetch(index, forward) after gather(index)
  // starts gathering the layers that run next (after it in a forward, before it in a
  // recomputation); prefetch_kept(kept, before) after a kept layer's refill() starts refilling
  // those backward reaches next: kept[before - 1], kept[before - 2], ... (the forward's in order).
  struct LayerFetch {
    struct Kept {
      virtual ~Kept() = default;
      virtual void refill() = 0;
      virtual void empty() = 0;
    };
    std::function<void(std::size_t)> gather, release;
    std::function<std::shared_ptr<Kept>(std::size_t)> keep;
    std::function<void(std::size_t, bool)> prefetch;
    std::function<void(const std::vector<std::shared_ptr<Kept>>&, std::size_t)> prefetch_kept;
  };
  void fetch_layers(std::shared_ptr<const LayerFetch> fetch);

 private:
  torch::Tensor fetched_forward(torch::Tensor input);
  torch::Tensor recomputed_forward(torch::Tensor input);

  std::vector<LayerSpec> specs_;
  PipelineLoss loss_;
  int stage_ = 0;
  PipelineOptions options_;
  std::vector<std::size_t> bounds_;
  std::vector<torch::nn::AnyModule> layers_;  // this stage's
  using Segment = std::function<torch::Tensor(const torch::Tensor&)>;
  std::vector<std::unique_ptr<Segment>> segments_;  // of activation checkpointing
  std::vector<bool> recomputed_;                    // by segment: whether it holds a parameter
  std::shared_ptr<const LayerFetch> fetch_;
  // By layer of this stage, with fetch_: running it, and gathering and releasing it around its
  // recomputation.
  std::vector<std::unique_ptr<Segment>> layer_runs_;
  std::vector<std::unique_ptr<std::function<void()>>> layer_gathers_, layer_releases_;
};
TORCH_MODULE(PipelineModule);

}  // namespace hpctrial::trainer
