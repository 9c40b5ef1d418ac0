// LibTorch state to and from checkpoint datasets: tensors, optimizers, LR schedulers, the RNG.
// Internal to the trainer (the checkpoint library itself knows no LibTorch).
//
// Optimizers of the six LibTorch types keep their state as datasets, readable without our code:
//   optimizer/<i>/type            text: sgd, adam, adamw, adagrad, rmsprop or lbfgs
//   optimizer/<i>/param_groups    JSON: [{"params": [indices], "options": {"lr": ..., ...}}]
//   optimizer/<i>/state/<p>/<f>   a tensor field f of parameter p (p: its index over all groups)
//   optimizer/<i>/state/<p>/scalars  JSON of the scalar fields (step, ...)
// Other optimizer classes are stored as LibTorch's own archive (optimizer/<i>/torch_archive).
#pragma once

#include <torch/torch.h>

#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "hpctrial/checkpoint/format.h"
#include "hpctrial/core/dtype.h"

namespace hpctrial::trainer::detail {

// LibTorch keys an optimizer's per-parameter state by the parameter's TensorImpl: by the text of
// its address up to 1.x, by the address itself since 2.x.
using OptimizerStateKey = std::decay_t<decltype(std::declval<torch::optim::Optimizer&>().state())>::key_type;
template <typename Key = OptimizerStateKey>
Key optimizer_state_key(const torch::Tensor& p) {
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream text;  // what c10::guts::to_string wrote
    text << p.unsafeGetTensorImpl();
    return text.str();
  } else {
    return p.unsafeGetTensorImpl();
  }
}

// The one table between LibTorch's scalar types and hpctrial's DType (collectives and checkpoints).
// to_dtype: nullopt for a type hpctrial neither moves nor stores (complex, quantized, ...).
std::optional<core::DType> to_dtype(c10::ScalarType type);
c10::ScalarType to_scalar_type(core::DType dtype);
// to_dtype, or NotSupported for a type a checkpoint cannot hold.
checkpoint::DType checkpoint_dtype(c10::ScalarType type);

// A host copy of `tensor` (the stall of an async checkpoint).
void add_tensor(checkpoint::Contents& contents, const std::string& name, const torch::Tensor& tensor);

// Tensors whose copy is left to the checkpoint writer's thread (CPU tensors that only the
// optimizer step changes: parameters and optimizer state). Null: copy now.
struct DeferredTensor {
  std::string name;
  torch::Tensor tensor;  // shares the live storage until copied
};
using Deferred = std::vector<DeferredTensor>;
// Copies now, or defers when `deferred` is given and the tensor is on the CPU.
void add_or_defer(checkpoint::Contents& contents, Deferred* deferred, const std::string& name,
                  const torch::Tensor& tensor);
// A CPU tensor over the dataset's buffer (kept alive by the tensor); a dataset left in its file
// is read whole.
torch::Tensor tensor_of(const checkpoint::Dataset& dataset);
// Copies dataset `name` into `target`, refusing another shape or dtype with a message naming
// the tensor, the file and both shapes.
void load_into(const checkpoint::Contents& contents, const std::string& name, torch::Tensor& target,
               const std::string& file);

void save_optimizer(checkpoint::Contents& contents, const std::string& prefix, torch::optim::Optimizer& optimizer,
                    Deferred* deferred = nullptr);
// The optimizer's state as save_optimizer names it, copying no tensor: its tensors (on their
// devices, live) returned, its texts (options, scalars) added to `texts`.
Deferred view_optimizer(checkpoint::Contents& texts, const std::string& prefix, torch::optim::Optimizer& optimizer);
void load_optimizer(const checkpoint::Contents& contents, const std::string& prefix,
                    torch::optim::Optimizer& optimizer, const std::string& file);
// One parameter's state, from the datasets under `state_prefix` (prefix/state/<index>, as
// load_optimizer reads each), in place of its own; none there: it has none. For the six types.
void load_parameter_state(const checkpoint::Contents& contents, const std::string& state_prefix,
                          torch::optim::Optimizer& optimizer, const torch::Tensor& parameter, const std::string& file);
// Every param group's options (lr, momentum, betas, weight decay, ...) as text, and back:
// JSON as in param_groups for the six LibTorch types, LibTorch's archive of each group's options
// for other classes. Loading refuses another type or number of groups (ConfigError naming `what`).
std::string optimizer_options_text(torch::optim::Optimizer& optimizer);
// Appends bytes that differ whenever the text above would, made without text for the six types
// (their values' bytes; another class's text as it is): cheap enough to take around every hook.
void append_optimizer_options_fingerprint(torch::optim::Optimizer& optimizer, std::string& out);
void load_optimizer_options_text(torch::optim::Optimizer& optimizer, const std::string& text, const std::string& what);
// The elements of the optimizer's per-parameter state tensors (what it holds in memory).
std::int64_t optimizer_state_elements(torch::optim::Optimizer& optimizer);
// Whether the optimizer is one of the six types whose state is read and written field by field.
bool has_state_codec(torch::optim::Optimizer& optimizer);
// The tensors of one parameter's state (sharing their storage with the optimizer's), in the
// order save_optimizer writes them; none when it has no state yet or its type is not one of the
// six.
std::vector<torch::Tensor> parameter_state_tensors(torch::optim::Optimizer& optimizer, const torch::Tensor& parameter);

// The number of steps an LR scheduler has taken (its only state; the learning rates live in
// the optimizer's param groups).
unsigned& scheduler_step_count(torch::optim::LRScheduler& scheduler);

torch::Tensor cpu_rng_state();
void set_cpu_rng_state(const torch::Tensor& state);
// The default generator of a GPU (Philox seed and offset): dropout and torch::rand on the
// device. Only for a CUDA device.
torch::Tensor device_rng_state(const torch::Device& device);
void set_device_rng_state(const torch::Device& device, const torch::Tensor& state);

}  // namespace hpctrial::trainer::detail
