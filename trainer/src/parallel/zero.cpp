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
  if (options_.swap) StateSwapper::check(*options_.swap);
  if (options_.stage < 1 || options_.stage > 3) {
    throw InternalError("ShardedOptimizer: ZeRO stage " + std::to_string(options_.stage));
  }
  const int ranks = comm_.size();
  std::size_t first_part = 0;
  std::int64_t persistent_elements = 0;
  for (std::size_t g = 0; g < optimizer_.param_groups().size(); ++g) {
    auto& param_group = optimizer_.param_groups()[g];
    Group group;
    group.params = param_group.params();
    std::vector<std::int64_t> numels;
    std::vector<std::optional<PartitionStore::Entry>> built;
    for (const auto& p : group.params) {
      built.push_back(options_.partitions != nullptr ? options_.partitions->take(p) : std::nullopt);
      if (built.back() && options_.stage != 3) throw InternalError("a parameter built partitioned below ZeRO stage 3");
      group.shapes.push_back(built.back() ? built.back()->shape : p.sizes().vec());
      numels.push_back(c10::multiply_integers(group.shapes.back()));
      // Taken before stage 3 empties the parameter: the accumulator keeps its whole shape.
      auto accumulator = torch::autograd::impl::grad_accumulator(p);
      if (!accumulator) continue;  // a parameter that does not require gradients
      hook_keys_.push_back(accumulator->add_post_hook(std::make_unique<ReadyHook>(this, g, numels.size() - 1)));
      accumulators_.push_back(std::move(accumulator));  // keeps the accumulator, and so the hook, alive
    }
    group.layout = options_.stage == 3 ? partition_layout(numels, ranks)
                                       : flat_layout(numels, ranks, std::max<std::int64_t>(1, options_.bucket_elements));
    // DeepSpeed's mark_persistent_parameters: small enough, and within the model's bound.
    group.persistent.assign(group.params.size(), false);
    for (std::size_t i = 0; options_.stage == 3 && i < numels.size(); ++i) {
      if (numels[i] > options_.persistence_threshold ||
          numels[i] > options_.model_persistence_threshold - persistent_elements) {
        continue;
      }
      group.persistent[i] = true;
      persistent_elements += numels[i];
    }
    lay_out(group, comm_.rank(), built);
    // The optimizer forgets the whole parameters (no state was made for them yet, but Adagrad's)
    // and steps the parts.
    for (const auto& p : group.params) optimizer_.state().erase(optimizer_state_key(p));
    param_group.params() = group.parts;
    for (const auto& part : group.parts) reset_adagrad_state(optimizer_, g, part);
    group.first_part = first_part;
    first_part += group.parts.size();
    groups_.push_back(std::move(group));
    plan_reductions(g);
  }
  if (options_.swap) {
    if (options_.swap->parameters && options_.stage != 3) {
      throw InternalError("ShardedOptimizer: parameters swapped below ZeRO stage 3");
    }
    options_.swap->rank = comm_.rank();
    swapper_ = std::make_unique<StateSwapper>(optimizer_, *options_.swap);
  }
  take_over_spilled();
  // The prefetch's all-gathers on a communicator of their own (a collective), as DeepSpeed's run
  // on a stream of their own: queued behind the gradients' reduce-scatters, a layer's gather
  // would wait for them.
  if (options_.stage == 3 && options_.prefetch_elements > 0) prefetch_comm_ = comm_.split(0, comm_.rank());
  if (options_.stage == 3) gather_persistent();
}

void ShardedOptimizer::lay_out(Group& group, int rank, const std::vector<std::optional<PartitionStore::Entry>>& built) {
  const auto& layout = group.layout;
  const auto tensor_options = torch::TensorOptions().dtype(torch::kFloat32).device(
      group.params.empty() ? torch::Device(torch::kCPU) : group.params.front().device());
  torch::NoGradGuard no_grad;
  group.gathered.assign(group.params.size(), options_.stage != 3);
  if (options_.stage == 3) return lay_out_parts(group, rank, built, tensor_options);
  group.flat = torch::zeros({layout.size}, tensor_options);
  for (std::size_t i = 0; i < group.params.size(); ++i) {
    auto& p = group.params[i];
    auto view = group.flat.narrow(0, layout.offsets[i], layout.numels[i]).view(p.sizes());
    view.copy_(p.detach());
    p.set_data(view);
    p.mutable_grad() = torch::Tensor();
  }
  // Leaves of their own over the same memory: the optimizer steps them in place, into `flat`.
  for (const auto& bucket : layout.buckets) {
    group.parts.push_back(group.flat.narrow(0, bucket.begin + bucket.part * rank, bucket.part).detach());
  }
}

void ShardedOptimizer::plan_reductions(std::size_t g) {
  Group& group = groups_[g];
  const auto& buckets = group.layout.buckets;
  const std::int64_t ranks = comm_.size();
  group.column.assign(buckets.size(), 0);
  reduction_of_.emplace_back(buckets.size());
  // Stages 1 and 2 reduce each bucket alone; stage 3 as many of its one-parameter buckets as
  // fit bucket_elements (padded), and at least one.
  for (std::size_t b = buckets.size(); b > 0;) {
    Reduction reduction;
    reduction.group = g;
    reduction.end = b;
    std::int64_t padded = buckets[--b].part * ranks;
    while (options_.stage == 3 && b > 0 && padded + buckets[b - 1].part * ranks <= options_.bucket_elements) {
      padded += buckets[--b].part * ranks;
    }
    reduction.first = b;
    for (std::size_t k = reduction.first; k < reduction.end; ++k) {
      group.column[k] = reduction.columns;
      reduction.columns += buckets[k].part;
      reduction_of_[g][k] = reductions_.size();
    }
    reductions_.push_back(std::move(reduction));
  }
}

ShardedOptimizer::~ShardedOptimizer() {
  prefetched_.clear();  // each waits for its all-gather
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
    const auto& buckets = groups_[reduction.group].layout.buckets;
    reduction.waiting = buckets[reduction.end - 1].end - buckets[reduction.first].first;
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
  // The reductions in flight of the backward that threw: waited for (their buffers are the
  // collective's until then) and dropped, so that none is launched again while in flight.
  for (const std::size_t k : in_flight_) {
    Reduction& reduction = reductions_[k];
    try {
      if (reduction.work) reduction.work->wait();
    } catch (const std::exception&) {  // the backward's own error is the one to report
    }
    reduction.work.reset();
    reduction.send = torch::Tensor();
    reduction.recv = torch::Tensor();
  }
  in_flight_.clear();
}

void ShardedOptimizer::take_gradient(Reduction& reduction, std::size_t param) {
  Group& group = groups_[reduction.group];
  const std::size_t b = group.layout.bucket_of[param];
  const auto& bucket = group.layout.buckets[b];
  torch::NoGradGuard no_grad;
  const std::int64_t ranks = comm_.size();
  if (!reduction.send.defined()) reduction.send = torch::zeros({reduction.columns * ranks}, group.flat.options());
  torch::Tensor& grad = group.params[param].mutable_grad();
  if (!grad.defined()) return;
  const auto flat = grad.reshape({-1});
  // The parameter's elements [pos, pos + n) of its bucket; rank r's part of the bucket is
  // [r x part, (r + 1) x part), and lies in row r of the send buffer at the bucket's column.
  const std::int64_t pos = group.layout.offsets[param] - bucket.begin, n = group.layout.numels[param];
  for (std::int64_t r = pos / std::max<std::int64_t>(1, bucket.part); r < ranks; ++r) {
    const std::int64_t lo = std::max(pos, r * bucket.part), hi = std::min(pos + n, (r + 1) * bucket.part);
    if (lo >= hi) break;
    reduction.send.narrow(0, r * reduction.columns + group.column[b] + lo - r * bucket.part, hi - lo)
        .copy_(flat.narrow(0, lo - pos, hi - lo));
  }
  grad = torch::Tensor();
}

void ShardedOptimizer::launch(Reduction& reduction) {
  const Group& group = groups_[reduction.group];
  if (!reduction.send.defined()) reduction.send = torch::zeros({reduction.columns * comm_.size()}, group.flat.options());
  reduction.recv = torch::empty({reduction.columns}, group.flat.options());
  if (measuring_) {
    const auto started = std::chrono::steady_clock::now();
    local_sqr_ += squared_norm(reduction.send, reduction.send.numel());
    measure_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  }
  reduction.work = comm_.reduce_scatter_async(reduction.send.data_ptr(), reduction.recv.data_ptr(),
                                              static_cast<std::size_t>(reduction.columns), comm::DType::kFloat32,
                                              comm::ReduceOp::kAvg);
  reduction.launched = true;
  // At most two reductions in flight (DeepSpeed's max_param_reduce_events): the oldest is
  // waited for and its send buffer freed, so that backward holds two buckets, not the model.
  in_flight_.push_back(static_cast<std::size_t>(&reduction - reductions_.data()));
  while (in_flight_.size() > kMaxInFlight) {
    complete(reductions_[in_flight_.front()]);
    in_flight_.pop_front();
  }
}

void ShardedOptimizer::complete(Reduction& reduction) {
  if (!reduction.work) return;
  comm::WorkHandle work = std::move(reduction.work);
  reduction.work.reset();
  const auto started = std::chrono::steady_clock::now();
  work->wait();
  wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  Group& group = groups_[reduction.group];
  for (std::size_t b = reduction.first; b < reduction.end; ++b) {
    const auto received = reduction.recv.narrow(0, group.column[b], group.layout.buckets[b].part);
    torch::Tensor& grad = group.parts[b].mutable_grad();
    if (grad.defined()) {
      torch::NoGradGuard no_grad;
      grad.add_(received);
    } else {
      grad = received;
    }
  }
  reduction.send = torch::Tensor();
  reduction.recv = torch::Tensor();
}

void ShardedOptimizer::reduce_rest() {
  for (auto& reduction : reductions_) {
    if (reduction.launched) continue;
    const auto& buckets = groups_[reduction.group].layout.buckets;
    for (std::size_t k = buckets[reduction.first].first; k < buckets[reduction.end - 1].end; ++k) {
      take_gradient(reduction, k);
    }
    launch(reduction);
  }
  for (auto& reduction : reductions_) complete(reduction);
  in_flight_.clear();
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
  parts_changed();
  if (swapper_) {
    swapper_->step();
  } else {
    optimizer_.step();
  }
  if (options_.stage == 3) {
    // The gathered values are those before the step: the next gather brings the new ones, and
    // the persistent parameters' come now.
    for (auto& group : groups_) {
      for (std::size_t i = 0; i < group.params.size(); ++i) drop(group, i);
      for (auto& part : group.parts) part.mutable_grad() = torch::Tensor();
    }
    gather_persistent();
    return;
  }
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
