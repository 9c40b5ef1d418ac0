#include "zero.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <string>

#include "hpctrial/core/error.h"
#include "state_io.h"

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
  reduce_gradients();
  update();
}

void ShardedOptimizer::reduce_gradients() {
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
}

double ShardedOptimizer::shard_grad_norm_squared() const {
  double sum = 0;
  for (const auto& group : groups_) {
    if (group.shard.grad().defined()) sum += group.shard.grad().to(torch::kFloat64).square().sum().item<double>();
  }
  return sum;
}

void ShardedOptimizer::scale_shard_grads(double factor) {
  torch::NoGradGuard no_grad;
  for (auto& group : groups_) {
    if (group.shard.grad().defined()) group.shard.mutable_grad().mul_(factor);
  }
}

void ShardedOptimizer::update() {
  const int rank = comm_.rank();
  optimizer_.step();
  for (auto& group : groups_) {
    group.shard.mutable_grad() = torch::Tensor();
    const auto shard_elements = static_cast<std::size_t>(group.layout.shard);
    auto* base = static_cast<float*>(group.flat.data_ptr());
    comm_.allgather(base + shard_elements * static_cast<std::size_t>(rank), base, shard_elements,
                    comm::DType::kFloat32);
  }
}

std::int64_t ShardedOptimizer::state_elements() const { return optimizer_state_elements(optimizer_); }

namespace {

// The tensor fields of the state of parameter `index` under `prefix` (datasets
// prefix/state/<index>/<field>, without the scalars).
std::vector<std::string> state_fields(const checkpoint::Contents& contents, const std::string& prefix, std::size_t index) {
  const std::string start = prefix + "/state/" + std::to_string(index) + "/";
  std::vector<std::string> fields;
  for (const auto& d : contents.datasets) {
    if (d.name.rfind(start, 0) != 0) continue;
    std::string field = d.name.substr(start.size());
    if (field != "scalars") fields.push_back(std::move(field));
  }
  std::sort(fields.begin(), fields.end());
  return fields;
}

}  // namespace

void ShardedOptimizer::save_whole(checkpoint::Contents& contents, const std::string& prefix) {
  checkpoint::Contents shards;
  save_optimizer(shards, "s", optimizer_);
  contents.add_text(prefix + "/type", shards.at("s/type", "the sharded optimizer").text());
  auto groups = nlohmann::json::parse(shards.at("s/param_groups", "the sharded optimizer").text());
  const std::size_t ranks = static_cast<std::size_t>(comm_.size());
  std::size_t first = 0;  // the index of the group's first parameter over all groups
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    const Group& group = groups_[g];
    nlohmann::json params = nlohmann::json::array();
    for (std::size_t i = 0; i < group.params.size(); ++i) params.push_back(first + i);
    groups[g]["params"] = params;
    // Every rank's shard has state, or none has (they step together).
    const checkpoint::Dataset* scalars = shards.find("s/state/" + std::to_string(g) + "/scalars");
    if (scalars != nullptr) {
      for (const std::string& field : state_fields(shards, "s", g)) {
        const torch::Tensor shard = tensor_of(shards.at("s/state/" + std::to_string(g) + "/" + field, "the shard"));
        if (shard.scalar_type() != torch::kFloat32 || shard.numel() != group.layout.shard) {
          throw InternalError("ZeRO: optimizer state field " + field + " is not a float32 shard");
        }
        auto whole = torch::empty({group.layout.shard * static_cast<std::int64_t>(ranks)}, shard.options());
        comm_.allgather(shard.data_ptr(), whole.data_ptr(), static_cast<std::size_t>(group.layout.shard),
                        comm::DType::kFloat32);
        for (std::size_t i = 0; i < group.params.size(); ++i) {
          const auto part = whole.narrow(0, group.layout.offsets[i], group.layout.numels[i]).view(group.params[i].sizes());
          add_tensor(contents, prefix + "/state/" + std::to_string(first + i) + "/" + field, part);
        }
      }
      for (std::size_t i = 0; i < group.params.size(); ++i) {
        contents.add_text(prefix + "/state/" + std::to_string(first + i) + "/scalars", scalars->text());
      }
    }
    first += group.params.size();
  }
  contents.add_text(prefix + "/param_groups", groups.dump());
}

void ShardedOptimizer::load_whole(const checkpoint::Contents& contents, const std::string& prefix,
                                  const std::string& file) {
  checkpoint::Contents shards;
  shards.add_text("s/type", contents.at(prefix + "/type", file).text());
  nlohmann::json groups;
  try {
    groups = nlohmann::json::parse(contents.at(prefix + "/param_groups", file).text());
  } catch (const nlohmann::json::exception& e) {
    throw CheckpointError(file + ": " + prefix + "/param_groups is not valid JSON: " + e.what());
  }
  if (!groups.is_array() || groups.size() != groups_.size()) {
    throw ConfigError(file + ": " + prefix + " has " + std::to_string(groups.is_array() ? groups.size() : 0) +
                      " parameter groups in the checkpoint and " + std::to_string(groups_.size()) +
                      " in the trial: the trial changed since the checkpoint");
  }
  const int rank = comm_.rank();
  std::size_t first = 0;
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    const Group& group = groups_[g];
    if (!groups[g].contains("params") || groups[g]["params"].size() != group.params.size()) {
      throw ConfigError(file + ": " + prefix + " group " + std::to_string(g) + " has another number of parameters "
                        "in the checkpoint than in the trial (" + std::to_string(group.params.size()) + ")");
    }
    groups[g]["params"] = nlohmann::json::array({g});
    // The state of the group's parameters, laid end to end as in the flat buffer; this rank
    // keeps its shard. Parameters without state (never stepped) contribute zeros.
    const checkpoint::Dataset* scalars = nullptr;
    std::vector<std::string> fields;
    for (std::size_t i = 0; i < group.params.size() && scalars == nullptr; ++i) {
      scalars = contents.find(prefix + "/state/" + std::to_string(first + i) + "/scalars");
      if (scalars != nullptr) fields = state_fields(contents, prefix, first + i);
    }
    if (scalars != nullptr) {
      for (const std::string& field : fields) {
        auto whole = torch::zeros({group.layout.shard * comm_.size()}, torch::kFloat32);
        for (std::size_t i = 0; i < group.params.size(); ++i) {
          const std::string name = prefix + "/state/" + std::to_string(first + i) + "/" + field;
          const checkpoint::Dataset* d = contents.find(name);
          if (d == nullptr) continue;
          const torch::Tensor part = tensor_of(*d);
          if (part.numel() != group.layout.numels[i] || part.scalar_type() != torch::kFloat32) {
            throw ConfigError(file + ": " + name + " has " + std::to_string(part.numel()) + " elements in the "
                              "checkpoint but the parameter has " + std::to_string(group.layout.numels[i]) +
                              ": the model changed since the checkpoint");
          }
          whole.narrow(0, group.layout.offsets[i], group.layout.numels[i]).copy_(part.reshape({-1}));
        }
        add_tensor(shards, "s/state/" + std::to_string(g) + "/" + field,
                   whole.narrow(0, group.layout.shard * rank, group.layout.shard));
      }
      shards.add_text("s/state/" + std::to_string(g) + "/scalars", scalars->text());
    }
    first += group.params.size();
  }
  shards.add_text("s/param_groups", groups.dump());
  load_optimizer(shards, "s", optimizer_, file);
}

void ShardedOptimizer::zero_grad() {
  for (auto& group : groups_) {
    for (auto& p : group.params) p.mutable_grad() = torch::Tensor();
  }
}

}  // namespace hpctrial::trainer::detail
