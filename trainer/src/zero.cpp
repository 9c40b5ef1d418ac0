#include "zero.h"

#include <algorithm>
#include <string>

#include "hpctrial/core/error.h"

namespace hpctrial::trainer::detail {

FlatLayout flat_layout(const std::vector<std::int64_t>& numels, int ranks) {
  FlatLayout layout;
  layout.numels = numels;
  for (const std::int64_t n : numels) {
    layout.offsets.push_back(layout.total);
    layout.total += n;
  }
  layout.shard = (layout.total + ranks - 1) / ranks;
  return layout;
}

std::vector<FlatLayout::Piece> FlatLayout::pieces(int rank) const {
  std::vector<Piece> out;
  const std::int64_t begin = shard * rank;
  const std::int64_t end = std::min(total, begin + shard);
  for (std::size_t i = 0; i < numels.size(); ++i) {
    const std::int64_t from = std::max(begin, offsets[i]);
    const std::int64_t to = std::min(end, offsets[i] + numels[i]);
    if (from < to) out.push_back({i, from - offsets[i], from - begin, to - from});
  }
  return out;
}

namespace {

// Adagrad creates its state when it is constructed, for the parameters it was given: the
// shard needs its own, with the group's initial accumulator value.
void reset_adagrad_state(torch::optim::Optimizer& optimizer, std::size_t group, const torch::Tensor& shard) {
  auto* adagrad = dynamic_cast<torch::optim::Adagrad*>(&optimizer);
  if (adagrad == nullptr) return;
  const auto& options = static_cast<const torch::optim::AdagradOptions&>(optimizer.param_groups()[group].options());
  auto state = std::make_unique<torch::optim::AdagradParamState>();
  state->step(0);
  state->sum(torch::full_like(shard, options.initial_accumulator_value()));
  optimizer.state()[c10::guts::to_string(shard.unsafeGetTensorImpl())] = std::move(state);
}

}  // namespace

ShardedOptimizer::ShardedOptimizer(torch::optim::Optimizer& optimizer, comm::Communicator& communicator)
    : optimizer_(optimizer), comm_(communicator) {
  if (dynamic_cast<torch::optim::LBFGS*>(&optimizer) != nullptr) {
    throw ConfigError("ZeRO shards optimizer state element by element, and LBFGS's state is not per element (it "
                      "keeps a history of whole directions): keep LBFGS's state whole (no ZeRO), or use an "
                      "optimizer such as SGD, Adam, AdamW, Adagrad or RMSprop");
  }
  const int ranks = comm_.size();
  for (std::size_t g = 0; g < optimizer_.param_groups().size(); ++g) {
    auto& param_group = optimizer_.param_groups()[g];
    Group group;
    group.params = param_group.params();
    std::vector<std::int64_t> numels;
    for (std::size_t i = 0; i < group.params.size(); ++i) {
      const auto& p = group.params[i];
      if (p.scalar_type() != torch::kFloat32) {
        throw ConfigError("ZeRO: parameter " + std::to_string(i) + " of optimizer group " + std::to_string(g) +
                          " is " + std::string(c10::toString(p.scalar_type())) +
                          "; the sharded optimizer keeps float32 parameters: build the model in float32");
      }
      numels.push_back(p.numel());
    }
    group.layout = flat_layout(numels, ranks);
    const auto options = torch::TensorOptions().dtype(torch::kFloat32).device(
        group.params.empty() ? torch::Device(torch::kCPU) : group.params.front().device());
    group.flat = torch::zeros({group.layout.shard * ranks}, options);
    group.flat_grad = torch::zeros({group.layout.shard * ranks}, options);
    {
      torch::NoGradGuard no_grad;
      for (std::size_t i = 0; i < group.params.size(); ++i) {
        auto& p = group.params[i];
        auto view = group.flat.narrow(0, group.layout.offsets[i], numels[i]).view(p.sizes());
        view.copy_(p.detach());
        p.set_data(view);
      }
    }
    // A leaf of its own over the same memory: the optimizer steps it in place, into `flat`.
    group.shard = group.flat.narrow(0, group.layout.shard * comm_.rank(), group.layout.shard).detach();
    // The optimizer forgets the whole parameters (no state was made for them yet, but Adagrad's)
    // and steps the shard.
    for (const auto& p : group.params) optimizer_.state().erase(c10::guts::to_string(p.unsafeGetTensorImpl()));
    param_group.params() = {group.shard};
    reset_adagrad_state(optimizer_, g, group.shard);
    groups_.push_back(std::move(group));
  }
}

void ShardedOptimizer::step() {
  const int rank = comm_.rank();
  for (auto& group : groups_) {
    const auto shard_elements = static_cast<std::size_t>(group.layout.shard);
    {
      torch::NoGradGuard no_grad;
      for (std::size_t i = 0; i < group.params.size(); ++i) {
        auto slot = group.flat_grad.narrow(0, group.layout.offsets[i], group.layout.numels[i]);
        const auto& grad = group.params[i].grad();
        if (grad.defined()) {
          slot.copy_(grad.reshape({-1}));
        } else {
          slot.zero_();
        }
      }
    }
    auto shard_grad = torch::empty({group.layout.shard}, group.flat_grad.options());
    comm_.reduce_scatter(group.flat_grad.data_ptr(), shard_grad.data_ptr(), shard_elements, comm::DType::kFloat32,
                         comm::ReduceOp::kAvg);
    group.shard.mutable_grad() = shard_grad;
  }
  optimizer_.step();
  for (auto& group : groups_) {
    group.shard.mutable_grad() = torch::Tensor();
    const auto shard_elements = static_cast<std::size_t>(group.layout.shard);
    auto* base = static_cast<float*>(group.flat.data_ptr());
    comm_.allgather(base + shard_elements * static_cast<std::size_t>(rank), base, shard_elements,
                    comm::DType::kFloat32);
  }
}

void ShardedOptimizer::zero_grad() {
  for (auto& group : groups_) {
    for (auto& p : group.params) p.mutable_grad() = torch::Tensor();
  }
}

}  // namespace hpctrial::trainer::detail
