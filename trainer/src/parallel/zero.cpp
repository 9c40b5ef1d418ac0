#include "parallel/zero.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <utility>

#include "parallel/gradient_sync.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/logging.h"
#include "state/state_io.h"
#include "state/state_io.h"

namespace hpctrial::trainer::detail {

FlatLayout flat_layout(const std::vector<std::int64_t>& numels, int ranks, std::int64_t bucket_elements) {
  FlatLayout layout;
  layout.numels = numels;
  layout.bucket_of.assign(numels.size(), 0);
  // Walking back from the last parameter, each bucket [first, end) closes before passing the cap.
  std::vector<FlatLayout::Bucket> backwards;
  std::int64_t filled = 0;
  for (std::size_t k = numels.size(); k-- > 0;) {
    if (!backwards.empty() && backwards.back().first != backwards.back().end && filled + numels[k] <= bucket_elements) {
      backwards.back().first = k;
      filled += numels[k];
      continue;
    }
    FlatLayout::Bucket bucket;
    bucket.first = k;
    bucket.end = k + 1;
    backwards.push_back(bucket);
    filled = numels[k];
  }
  layout.buckets.assign(backwards.rbegin(), backwards.rend());
  layout.offsets.assign(numels.size(), 0);
  for (std::size_t b = 0; b < layout.buckets.size(); ++b) {
    auto& bucket = layout.buckets[b];
    bucket.begin = layout.size;
    std::int64_t elements = 0;
    for (std::size_t k = bucket.first; k < bucket.end; ++k) {
      layout.offsets[k] = bucket.begin + elements;
      layout.bucket_of[k] = b;
      elements += numels[k];
    }
    layout.total += elements;
    bucket.part = (elements + ranks - 1) / ranks;
    layout.size += bucket.part * ranks;
  }
  return layout;
}

std::int64_t FlatLayout::shard() const {
  std::int64_t sum = 0;
  for (const auto& bucket : buckets) sum += bucket.part;
  return sum;
}

// Runs after autograd has accumulated a parameter's gradient into its .grad.
class ShardedOptimizer::ReadyHook final : public torch::autograd::FunctionPostHook {
 public:
  ReadyHook(ShardedOptimizer* zero, std::size_t group, std::size_t param) : zero_(zero), group_(group), param_(param) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    zero_->on_gradient_ready(group_, param_);
    return outputs;
  }

 private:
  ShardedOptimizer* zero_;
  std::size_t group_, param_;
};

namespace {

// Adagrad creates its state when it is constructed, for the parameters it was given: each part
// needs its own, with the group's initial accumulator value.
void reset_adagrad_state(torch::optim::Optimizer& optimizer, std::size_t group, const torch::Tensor& part) {
  auto* adagrad = dynamic_cast<torch::optim::Adagrad*>(&optimizer);
  if (adagrad == nullptr) return;
  const auto& options = static_cast<const torch::optim::AdagradOptions&>(optimizer.param_groups()[group].options());
  auto state = std::make_unique<torch::optim::AdagradParamState>();
  state->step(0);
  state->sum(torch::full_like(part, options.initial_accumulator_value()));
  optimizer.state()[optimizer_state_key(part)] = std::move(state);
}

}  // namespace

void ShardedOptimizer::check(torch::optim::Optimizer& optimizer) {
  if (dynamic_cast<torch::optim::LBFGS*>(&optimizer) != nullptr) {
    throw ConfigError("ZeRO shards optimizer state element by element, and LBFGS's state is not per element (it "
                      "keeps a history of whole directions): keep LBFGS's state whole (no ZeRO), or use an "
                      "optimizer such as SGD, Adam, AdamW, Adagrad or RMSprop");
  }
  for (std::size_t g = 0; g < optimizer.param_groups().size(); ++g) {
    const auto& params = optimizer.param_groups()[g].params();
    for (std::size_t i = 0; i < params.size(); ++i) {
      if (params[i].scalar_type() != torch::kFloat32) {
        throw ConfigError("ZeRO: parameter " + std::to_string(i) + " of optimizer group " + std::to_string(g) +
                          " is " + std::string(c10::toString(params[i].scalar_type())) +
                          "; the sharded optimizer keeps float32 parameters: build the model in float32");
      }
    }
  }
}

ShardedOptimizer::ShardedOptimizer(torch::optim::Optimizer& optimizer, comm::Communicator& communicator,
                                   ZeroOptions options)
    : optimizer_(optimizer), comm_(communicator), options_(options) {
  check(optimizer);
  if (options_.stage != 1 && options_.stage != 2) {
    throw InternalError("ShardedOptimizer: ZeRO stage " + std::to_string(options_.stage));
  }
  const int ranks = comm_.size();
  const int rank = comm_.rank();
  std::size_t first_part = 0;
  for (std::size_t g = 0; g < optimizer_.param_groups().size(); ++g) {
    auto& param_group = optimizer_.param_groups()[g];
    Group group;
    group.params = param_group.params();
    std::vector<std::int64_t> numels;
    for (const auto& p : group.params) numels.push_back(p.numel());
    group.layout = flat_layout(numels, ranks, std::max<std::int64_t>(1, options_.bucket_elements));
    const auto tensor_options = torch::TensorOptions().dtype(torch::kFloat32).device(
        group.params.empty() ? torch::Device(torch::kCPU) : group.params.front().device());
    group.flat = torch::zeros({group.layout.size}, tensor_options);
    {
      torch::NoGradGuard no_grad;
      for (std::size_t i = 0; i < group.params.size(); ++i) {
        auto& p = group.params[i];
        auto view = group.flat.narrow(0, group.layout.offsets[i], numels[i]).view(p.sizes());
        view.copy_(p.detach());
        p.set_data(view);
        p.mutable_grad() = torch::Tensor();
      }
    }
    // Leaves of their own over the same memory: the optimizer steps them in place, into `flat`.
    for (const auto& bucket : group.layout.buckets) {
      group.parts.push_back(group.flat.narrow(0, bucket.begin + bucket.part * rank, bucket.part).detach());
    }
    // The optimizer forgets the whole parameters (no state was made for them yet, but Adagrad's)
    // and steps the parts.
    for (const auto& p : group.params) optimizer_.state().erase(optimizer_state_key(p));
    param_group.params() = group.parts;
    for (const auto& part : group.parts) reset_adagrad_state(optimizer_, g, part);
    group.first_part = first_part;
    first_part += group.parts.size();
    reduction_of_.emplace_back(group.layout.buckets.size());
    for (std::size_t b = group.layout.buckets.size(); b-- > 0;) {
      reduction_of_.back()[b] = reductions_.size();
      Reduction reduction;
      reduction.group = g;
      reduction.bucket = b;
      reductions_.push_back(std::move(reduction));
    }
    groups_.push_back(std::move(group));
  }
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    for (std::size_t i = 0; i < groups_[g].params.size(); ++i) {
      auto accumulator = torch::autograd::impl::grad_accumulator(groups_[g].params[i]);
      if (!accumulator) continue;  // a parameter that does not require gradients
      hook_keys_.push_back(accumulator->add_post_hook(std::make_unique<ReadyHook>(this, g, i)));
      accumulators_.push_back(std::move(accumulator));  // keeps the accumulator, and so the hook, alive
    }
  }
}

ShardedOptimizer::~ShardedOptimizer() {
  for (std::size_t k = 0; k < accumulators_.size(); ++k) accumulators_[k]->del_post_hook(hook_keys_[k]);
  for (auto& reduction : reductions_) {
    if (!reduction.work) continue;
    try {
      reduction.work->wait();
    } catch (const std::exception& e) {
      core::log_warning("a gradient reduce-scatter failed while shutting down: {}", e.what());
    }
  }
}

void ShardedOptimizer::begin_backward(bool reduce, bool measure) {
  if (options_.stage == 1 && !reduce) return;  // stage 1 accumulates whole gradients until the step's backward
  std::lock_guard<std::mutex> lock(mutex_);
  measuring_ = measure;
  local_sqr_ = 0;
  for (auto& reduction : reductions_) {
    const auto& bucket = groups_[reduction.group].layout.buckets[reduction.bucket];
    reduction.waiting = bucket.end - bucket.first;
    reduction.launched = false;
  }
  next_launch_ = 0;
  armed_ = true;
}

void ShardedOptimizer::on_gradient_ready(std::size_t group, std::size_t param) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!armed_) return;  // a backward outside begin/end_backward: reduce_gradients() takes it
  Reduction& reduction = reductions_[reduction_of_[group][groups_[group].layout.bucket_of[param]]];
  if (reduction.launched || reduction.waiting == 0) return;
  take_gradient(reduction, param);
  if (--reduction.waiting > 0) return;
  while (next_launch_ < reductions_.size() && reductions_[next_launch_].waiting == 0) launch(reductions_[next_launch_++]);
}

void ShardedOptimizer::end_backward() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!armed_) return;
  armed_ = false;
  reduce_rest();
  measuring_ = false;
}

void ShardedOptimizer::disarm() {
  std::lock_guard<std::mutex> lock(mutex_);
  armed_ = false;
  measuring_ = false;
}

void ShardedOptimizer::take_gradient(Reduction& reduction, std::size_t param) {
  Group& group = groups_[reduction.group];
  const auto& bucket = group.layout.buckets[reduction.bucket];
  torch::NoGradGuard no_grad;
  if (!reduction.send.defined()) reduction.send = torch::zeros({bucket.part * comm_.size()}, group.flat.options());
  torch::Tensor& grad = group.params[param].mutable_grad();
  if (!grad.defined()) return;
  reduction.send.narrow(0, group.layout.offsets[param] - bucket.begin, group.layout.numels[param]).copy_(grad.reshape({-1}));
  grad = torch::Tensor();
}

void ShardedOptimizer::launch(Reduction& reduction) {
  const Group& group = groups_[reduction.group];
  const auto& bucket = group.layout.buckets[reduction.bucket];
  if (!reduction.send.defined()) reduction.send = torch::zeros({bucket.part * comm_.size()}, group.flat.options());
  reduction.recv = torch::empty({bucket.part}, group.flat.options());
  if (measuring_) {
    const auto started = std::chrono::steady_clock::now();
    local_sqr_ += squared_norm(reduction.send, reduction.send.numel());
    measure_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  }
  reduction.work = comm_.reduce_scatter_async(reduction.send.data_ptr(), reduction.recv.data_ptr(),
                                              static_cast<std::size_t>(bucket.part), comm::DType::kFloat32,
                                              comm::ReduceOp::kAvg);
  reduction.launched = true;
}

void ShardedOptimizer::complete(Reduction& reduction) {
  if (!reduction.work) return;
  comm::WorkHandle work = std::move(reduction.work);
  reduction.work.reset();
  const auto started = std::chrono::steady_clock::now();
  work->wait();
  wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  torch::Tensor& grad = groups_[reduction.group].parts[reduction.bucket].mutable_grad();
  if (grad.defined()) {
    torch::NoGradGuard no_grad;
    grad.add_(reduction.recv);
  } else {
    grad = reduction.recv;
  }
  reduction.send = torch::Tensor();
  reduction.recv = torch::Tensor();
}

void ShardedOptimizer::reduce_rest() {
  for (auto& reduction : reductions_) {
    if (reduction.launched) continue;
    const auto& bucket = groups_[reduction.group].layout.buckets[reduction.bucket];
    for (std::size_t k = bucket.first; k < bucket.end; ++k) take_gradient(reduction, k);
    launch(reduction);
  }
  for (auto& reduction : reductions_) complete(reduction);
}

void ShardedOptimizer::step() {
  reduce_gradients();
  update();
}

void ShardedOptimizer::reduce_gradients() {
  std::lock_guard<std::mutex> lock(mutex_);
  // Gradients that no armed backward took (stage 1 between the step's backwards, a backward
  // outside begin/end_backward): reduced now, if any rank has some (every rank must then take part).
  double left = 0;
  for (const auto& group : groups_) {
    for (const auto& p : group.params) left += p.grad().defined() ? 1 : 0;
  }
  comm_.allreduce(&left, 1, comm::DType::kFloat64, comm::ReduceOp::kMax);
  if (left == 0) return;
  for (auto& reduction : reductions_) reduction.launched = false;
  reduce_rest();
}

double ShardedOptimizer::shard_grad_norm_squared() const {
  double sum = 0;
  for (const auto& group : groups_) {
    for (const auto& part : group.parts) {
      if (part.grad().defined()) sum += part.grad().to(torch::kFloat64).square().sum().item<double>();
    }
  }
  return sum;
}

double ShardedOptimizer::take_local_norm_squared() {
  std::lock_guard<std::mutex> lock(mutex_);
  return std::exchange(local_sqr_, 0.0);
}

double ShardedOptimizer::take_measure_seconds() {
  std::lock_guard<std::mutex> lock(mutex_);
  return std::exchange(measure_seconds_, 0.0);
}

double ShardedOptimizer::take_wait_seconds() {
  std::lock_guard<std::mutex> lock(mutex_);
  return std::exchange(wait_seconds_, 0.0);
}

void ShardedOptimizer::scale_shard_grads(double factor) {
  torch::NoGradGuard no_grad;
  for (auto& group : groups_) {
    for (auto& part : group.parts) {
      if (part.grad().defined()) part.mutable_grad().mul_(factor);
    }
  }
}

void ShardedOptimizer::update() {
  const auto rank = static_cast<std::size_t>(comm_.rank());
  optimizer_.step();
  std::vector<comm::WorkHandle> gathers;
  for (auto& group : groups_) {
    auto* base = static_cast<float*>(group.flat.data_ptr());
    for (const auto& bucket : group.layout.buckets) {
      const auto part = static_cast<std::size_t>(bucket.part);
      float* start = base + bucket.begin;
      gathers.push_back(comm_.allgather_async(start + part * rank, start, part, comm::DType::kFloat32));
    }
  }
  const auto started = std::chrono::steady_clock::now();
  for (auto& work : gathers) work->wait();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  }
  for (auto& group : groups_) {
    for (auto& part : group.parts) part.mutable_grad() = torch::Tensor();
  }
}

std::int64_t ShardedOptimizer::state_elements() const { return optimizer_state_elements(optimizer_); }

std::int64_t ShardedOptimizer::gradient_elements() const {
  std::int64_t sum = 0;
  for (const auto& group : groups_) {
    for (const auto& p : group.params) sum += p.grad().defined() ? p.grad().numel() : 0;
    for (const auto& part : group.parts) sum += part.grad().defined() ? part.grad().numel() : 0;
  }
  return sum;
}

void ShardedOptimizer::zero_grad() {
  for (auto& group : groups_) {
    for (auto& p : group.params) p.mutable_grad() = torch::Tensor();
    for (auto& part : group.parts) part.mutable_grad() = torch::Tensor();
  }
}

}  // namespace hpctrial::trainer::detail
