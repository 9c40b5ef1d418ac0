#include <torch/torch.h>

#include <ATen/Context.h>

#include <regex>

#include "hpctrial/core/error.h"
#include "hpctrial/trainer/pipeline.h"
#include "parallel/pipeline_plan.h"

namespace hpctrial::trainer {
namespace {

// A function of a tensor as a module without parameters.
class FunctionLayerImpl : public torch::nn::Module {
 public:
  explicit FunctionLayerImpl(std::function<torch::Tensor(const torch::Tensor&)> function)
      : function_(std::move(function)) {}
  torch::Tensor forward(const torch::Tensor& input) { return function_(input); }

 private:
  std::function<torch::Tensor(const torch::Tensor&)> function_;
};
TORCH_MODULE(FunctionLayer);

torch::nn::AnyModule build_layer(const LayerSpec& spec, std::uint64_t seed, std::size_t index) {
  torch::manual_seed(seed + index);
  torch::nn::AnyModule layer = spec.build();
  if (layer.is_empty()) throw ConfigError("pipeline layer " + std::to_string(index) + " (" + spec.name() + ") built no module");
  return layer;
}

// DeepSpeed's "type:REGEX" (pipe/module.py _find_layer_type): 1 for each layer whose name the
// regular expression finds, case-insensitive; an error when none does.
std::vector<std::int64_t> layers_of_type(const std::vector<LayerSpec>& specs, const std::string& pattern) {
  std::regex type;
  try {
    type = std::regex(pattern, std::regex::ECMAScript | std::regex::icase);
  } catch (const std::regex_error& e) {
    throw ConfigError("the pipeline's partition_method type:" + pattern + " is not a regular expression: " + e.what());
  }
  std::vector<std::int64_t> weights;
  std::string names;
  for (const auto& spec : specs) {
    weights.push_back(std::regex_search(spec.name(), type) ? 1 : 0);
    names += (names.empty() ? "" : ", ") + spec.name();
  }
  if (std::count(weights.begin(), weights.end(), 1) == 0) {
    throw ConfigError("the pipeline's partition_method type:" + pattern + " finds no layer to balance; the layers are " +
                      names);
  }
  return weights;
}

std::vector<std::size_t> partition(const std::vector<LayerSpec>& specs, const PipelineOptions& options) {
  const std::string& method = options.partition_method;
  if (method == "uniform") return detail::partition_uniform(specs.size(), options.stages);
  if (method == "explicit") return detail::partition_explicit(options.bounds, specs.size(), options.stages);
  if (method.rfind("type:", 0) == 0) return detail::partition_balanced(layers_of_type(specs, method.substr(5)), options.stages);
  if (method != "parameters") {
    throw ConfigError("the pipeline's partition_method is '" + method +
                      "'; it is one of parameters, uniform, type:REGEX or a list of stage bounds");
  }
  if (options.stages == 1) return {0, specs.size()};
  // Each layer is built once, alone, to count the parameters that train (DeepSpeed's
  // _count_layer_params: requires_grad only, so frozen layers weigh nothing).
  std::vector<std::int64_t> weights;
  for (std::size_t i = 0; i < specs.size(); ++i) {
    std::int64_t count = 0;
    for (const auto& parameter : build_layer(specs[i], options.seed, i).ptr()->parameters()) {
      if (parameter.requires_grad()) count += parameter.numel();
    }
    weights.push_back(count);
  }
  return detail::partition_balanced(weights, options.stages);
}

// The generators a recomputed forward must draw from as the first one did (dropout): the CPU's,
// and the device's where the input lies on one.
std::vector<at::Generator> generators(const torch::Device& device) {
  std::vector<at::Generator> all = {at::globalContext().defaultGenerator(torch::kCPU)};
  if (device.is_cuda()) all.push_back(at::globalContext().defaultGenerator(device));
  return all;
}

// A run of layers whose activations are not kept: forward runs them without autograd; backward
// runs them again from the saved input (with the same random draws) and back-propagates through
// that, as PyTorch's (reentrant) torch.utils.checkpoint does.
struct CheckpointedSegment : public torch::autograd::Function<CheckpointedSegment> {
  using Run = std::function<torch::Tensor(const torch::Tensor&)>;

  using Around = std::function<void()>;

  // `before` and `after` (may be null): called before the recomputation and after its backward
  // (ZeRO-3 gathers the segment's parameters and releases them).
  static torch::Tensor forward(torch::autograd::AutogradContext* context, const torch::Tensor& input, Run* run,
                               Around* before = nullptr, Around* after = nullptr) {
    context->save_for_backward({input});
    context->saved_data["run"] = reinterpret_cast<std::int64_t>(run);
    context->saved_data["before"] = reinterpret_cast<std::int64_t>(before);
    context->saved_data["after"] = reinterpret_cast<std::int64_t>(after);
    std::vector<torch::Tensor> states;
    for (auto& generator : generators(input.device())) states.push_back(generator.get_state());
    context->saved_data["random"] = states;
    const torch::NoGradGuard no_grad;
    return (*run)(input);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* context,
                                                 torch::autograd::variable_list gradients) {
    auto* run = reinterpret_cast<Run*>(context->saved_data["run"].toInt());
    auto* before = reinterpret_cast<Around*>(context->saved_data["before"].toInt());
    auto* after = reinterpret_cast<Around*>(context->saved_data["after"].toInt());
    const torch::Tensor input = context->get_saved_variables()[0].detach().requires_grad_(true);
    if (before != nullptr) (*before)();
    auto now = generators(input.device());
    const auto saved = context->saved_data["random"].toTensorVector();
    std::vector<torch::Tensor> current;
    for (std::size_t i = 0; i < now.size(); ++i) {
      current.push_back(now[i].get_state());
      now[i].set_state(saved[i]);
    }
    torch::Tensor output;
    {
      const torch::AutoGradMode enabled(true);
      output = (*run)(input);
    }
    for (std::size_t i = 0; i < now.size(); ++i) now[i].set_state(current[i]);
    torch::autograd::backward({output}, {gradients[0]});
    if (after != nullptr) (*after)();
    return {input.grad(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

LayerSpec::LayerSpec(std::string name, Build build) : name_(std::move(name)), build_(std::move(build)) {
  if (!build_) throw ConfigError("LayerSpec '" + name_ + "': no function builds the layer");
}

LayerSpec LayerSpec::function(std::string name, std::function<torch::Tensor(const torch::Tensor&)> function) {
  if (!function) throw ConfigError("LayerSpec::function '" + name + "': the function is empty");
  return LayerSpec(std::move(name), [function] { return torch::nn::AnyModule(FunctionLayer(function)); });
}

torch::nn::AnyModule LayerSpec::build() const { return build_(); }

PipelineModuleImpl::PipelineModuleImpl(std::vector<LayerSpec> layers, PipelineLoss loss, int stage,
                                       PipelineOptions options)
    : specs_(std::move(layers)), loss_(std::move(loss)), stage_(stage), options_(std::move(options)) {
  if (!loss_) throw ConfigError("PipelineModule: the loss function is empty; the last stage computes it");
  if (options_.activation_checkpoint_interval < 0) {
    throw ConfigError("the pipeline's activation_checkpoint_interval is " +
                      std::to_string(options_.activation_checkpoint_interval) + "; it is 0 (none) or more");
  }
  bounds_ = partition(specs_, options_);
  if (stage_ < 0 || stage_ >= options_.stages) {
    throw InternalError("pipeline stage " + std::to_string(stage_) + " of " + std::to_string(options_.stages));
  }
  for (std::size_t i = first_layer(); i < end_layer(); ++i) {
    layers_.push_back(build_layer(specs_[i], options_.seed, i));
    if (options_.after_build) options_.after_build(*layers_.back().ptr());
    register_module("layer" + std::to_string(i), layers_.back().ptr());
  }
  // The segments of activation checkpointing, kept while any backward may run them again.
  const auto interval = static_cast<std::size_t>(options_.activation_checkpoint_interval);
  for (std::size_t first = 0; interval > 0 && first < layers_.size(); first += interval) {
    const std::size_t end = std::min(layers_.size(), first + interval);
    segments_.push_back(std::make_unique<Segment>([this, first, end](const torch::Tensor& x) {
      torch::Tensor y = x;
      for (std::size_t i = first; i < end; ++i) y = layers_[i].forward(y);
      return y;
    }));
    // DeepSpeed's _is_checkpointable (pipe/module.py): a segment without parameters is run as it
    // is - recomputing it saves little and its backward would reach no parameter.
    bool parameters = false;
    for (std::size_t i = first; i < end; ++i) parameters = parameters || !layers_[i].ptr()->parameters().empty();
    recomputed_.push_back(parameters);
  }
}

torch::nn::AnyModule& PipelineModuleImpl::layer(std::size_t index) {
  if (index < first_layer() || index >= end_layer()) {
    throw InternalError("pipeline layer " + std::to_string(index) + " is not on stage " + std::to_string(stage_));
  }
  return layers_[index - first_layer()];
}

void PipelineModuleImpl::fetch_layers(std::shared_ptr<const LayerFetch> fetch) {
  fetch_ = std::move(fetch);
  layer_runs_.clear();
  layer_gathers_.clear();
  layer_releases_.clear();
  for (std::size_t k = 0; fetch_ && k < layers_.size(); ++k) {
    const std::size_t index = first_layer() + k;
    layer_runs_.push_back(std::make_unique<Segment>([this, k](const torch::Tensor& x) { return layers_[k].forward(x); }));
    layer_gathers_.push_back(std::make_unique<std::function<void()>>([this, index] {
      fetch_->gather(index);
      if (fetch_->prefetch) fetch_->prefetch(index, false);  // backward recomputes the layers before next
    }));
    layer_releases_.push_back(std::make_unique<std::function<void()>>([this, index] { fetch_->release(index); }));
  }
}

namespace {

// Backward over a forward whose layers kept their parameters (LayerFetch::keep): each layer's
// refilled before its backward (a hook on its output's gradient) and emptied once backward has
// passed its input (a hook on the input's gradient, which runs before the node that made the
// input). Autograd runs the nodes made later first, so by then every node of the layer has run.
// A tensor that is one layer's input and the previous layer's output empties the first before
// it refills the second, so that backward holds one layer at a time. A layer stays gathered
// until the step where that order does not hold: its input is a leaf (whose hook runs in its
// gradient accumulator, which autograd runs first), or its output is its input (written in place).
// After a layer's refill, the layers before it are prefetched.
struct KeptRun {
  torch::Tensor input, output;
  std::shared_ptr<PipelineModuleImpl::LayerFetch::Kept> kept;
};

void hook_kept_layers(const std::vector<KeptRun>& runs, const std::shared_ptr<const PipelineModuleImpl::LayerFetch>& fetch) {
  using Kept = std::shared_ptr<PipelineModuleImpl::LayerFetch::Kept>;
  auto kept = std::make_shared<std::vector<Kept>>();
  for (const auto& run : runs) kept->push_back(run.kept);
  struct Actions {
    torch::Tensor tensor;
    std::vector<Kept> empties;
    std::vector<std::size_t> refills;  // indices into `kept`
  };
  std::vector<Actions> at;
  const auto of = [&at](const torch::Tensor& t) -> Actions& {
    for (auto& a : at) {
      if (a.tensor.unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) return a;
    }
    at.push_back({t, {}, {}});
    return at.back();
  };
  for (std::size_t r = 0; r < runs.size(); ++r) {
    const KeptRun& run = runs[r];
    const bool own_output = run.input.unsafeGetTensorImpl() == run.output.unsafeGetTensorImpl();
    if (run.input.requires_grad() && run.input.grad_fn() && !own_output) of(run.input).empties.push_back(run.kept);
    of(run.output).refills.push_back(r);
  }
  for (auto& a : at) {
    a.tensor.register_hook(
        [kept, fetch, empties = std::move(a.empties), refills = std::move(a.refills)](const torch::Tensor&) {
          for (const auto& k : empties) k->empty();
          for (const std::size_t r : refills) {
            (*kept)[r]->refill();
            if (fetch->prefetch_kept) fetch->prefetch_kept(*kept, r);
          }
        });
  }
}

}  // namespace

torch::Tensor PipelineModuleImpl::fetched_forward(torch::Tensor input) {
  if (options_.activation_checkpoint_interval > 0) return recomputed_forward(std::move(input));
  const bool graph = torch::GradMode::is_enabled();
  std::vector<KeptRun> runs;
  for (std::size_t k = 0; k < layers_.size(); ++k) {
    if (layers_[k].ptr()->parameters().empty()) {
      input = layers_[k].forward(input);
      continue;
    }
    const std::size_t index = first_layer() + k;
    fetch_->gather(index);
    if (fetch_->prefetch) fetch_->prefetch(index, true);
    torch::Tensor output = layers_[k].forward(input);
    if (graph && output.requires_grad() && fetch_->keep) {
      runs.push_back({input, output, fetch_->keep(index)});
    } else {
      fetch_->release(index);
    }
    input = std::move(output);
  }
  hook_kept_layers(runs, fetch_);
  return input;
}

torch::Tensor PipelineModuleImpl::recomputed_forward(torch::Tensor input) {
  const bool recompute = is_training() && torch::GradMode::is_enabled();
  for (std::size_t k = 0; k < layers_.size(); ++k) {
    if (layers_[k].ptr()->parameters().empty()) {
      input = layers_[k].forward(input);
      continue;
    }
    fetch_->gather(first_layer() + k);
    if (fetch_->prefetch) fetch_->prefetch(first_layer() + k, true);
    if (recompute) {
      // The layer's input takes a gradient, or backward would never reach its parameters.
      if (!input.requires_grad()) input = input.detach().requires_grad_(true);
      input = CheckpointedSegment::apply(input, layer_runs_[k].get(), layer_gathers_[k].get(), layer_releases_[k].get());
    } else {
      input = layers_[k].forward(input);
    }
    (*layer_releases_[k])();
  }
  return input;
}

torch::Tensor PipelineModuleImpl::forward(torch::Tensor input) {
  if (fetch_) return fetched_forward(std::move(input));
  const auto interval = static_cast<std::size_t>(options_.activation_checkpoint_interval);
  if (interval == 0 || !is_training() || !torch::GradMode::is_enabled()) {
    for (auto& layer : layers_) input = layer.forward(input);
    return input;
  }
  for (std::size_t s = 0; s < segments_.size(); ++s) {
    if (!recomputed_[s]) {
      input = (*segments_[s])(input);
      continue;
    }
    // A recomputed segment's input must take a gradient, or backward would never reach its
    // parameters.
    if (!input.requires_grad()) input = input.detach().requires_grad_(true);
    CheckpointedSegment::Around* none = nullptr;
    input = CheckpointedSegment::apply(input, segments_[s].get(), none, none);
  }
  return input;
}

}  // namespace hpctrial::trainer
