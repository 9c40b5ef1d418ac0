// ZeRO stage 3's partitioned parameters: each rank's parts, cut from whole values or built
// partitioned, and the whole values set, broadcast or released (DeepSpeed's
// partition_parameters.py); the all-gathers are zero_gather.cpp's.
#include <algorithm>
#include <memory>
#include <optional>
#include <string>

#include "hpctrial/core/error.h"
#include "parallel/zero.h"

#include <torch/csrc/autograd/variable.h>

namespace hpctrial::trainer::detail {

FlatLayout partition_layout(const std::vector<std::int64_t>& numels, int ranks) {
  FlatLayout layout;
  layout.numels = numels;
  for (std::size_t k = 0; k < numels.size(); ++k) {
    FlatLayout::Bucket bucket;
    bucket.first = k;
    bucket.end = k + 1;
    bucket.begin = layout.size;
    // DeepSpeed's _partition_param: padded to a multiple of the ranks, rank r owning part r.
    bucket.part = (numels[k] + ranks - 1) / ranks;
    layout.offsets.push_back(bucket.begin);
    layout.bucket_of.push_back(k);
    layout.buckets.push_back(bucket);
    layout.total += numels[k];
    layout.size += bucket.part * ranks;
  }
  return layout;
}

std::pair<std::int64_t, std::int64_t> part_range(std::int64_t numel, std::int64_t part, std::int64_t rank) {
  const std::int64_t lo = std::min(rank * part, numel);
  return {lo, std::min(lo + part, numel)};
}

void cut_part(const torch::Tensor& whole, const torch::Tensor& part, std::int64_t rank) {
  torch::NoGradGuard no_grad;
  const auto [lo, hi] = part_range(whole.numel(), part.numel(), rank);
  if (hi > lo) part.narrow(0, 0, hi - lo).copy_(whole.detach().reshape({-1}).narrow(0, lo, hi - lo));
}

void PartitionStore::partition(torch::nn::Module& module) {
  torch::NoGradGuard no_grad;
  for (auto& p : module.parameters()) {
    if (entries_.count(p.unsafeGetTensorImpl()) != 0) continue;  // a parameter shared by two layers
    Entry entry;
    entry.shape = p.sizes().vec();
    if (p.numel() > 0) comm_.broadcast_async(p.data_ptr(), p.nbytes(), 0)->wait();
    const std::int64_t part = (p.numel() + comm_.size() - 1) / comm_.size();
    entry.part = torch::zeros({part}, p.options().requires_grad(false));
    cut_part(p, entry.part, comm_.rank());
    entry.accumulator = torch::autograd::impl::grad_accumulator(p);  // while the shape is whole
    p.set_data(torch::empty({0}, p.options().requires_grad(false)));
    if (spill_ && part > 0) {
      entry.offset = spill_->write(entry.part);
      entry.spill = spill_;
    }
    entries_.emplace(p.unsafeGetTensorImpl(), std::move(entry));
  }
}

std::optional<PartitionStore::Entry> PartitionStore::take(const torch::Tensor& parameter) {
  const auto it = entries_.find(parameter.unsafeGetTensorImpl());
  if (it == entries_.end()) return std::nullopt;
  Entry entry = std::move(it->second);
  entries_.erase(it);
  return entry;
}

std::int64_t PartitionStore::elements() const {
  std::int64_t sum = 0;
  for (const auto& [impl, entry] : entries_) sum += entry.part.numel();
  return sum;
}

std::int64_t PartitionStore::bytes_in_memory() const {
  std::int64_t sum = 0;
  for (const auto& [impl, entry] : entries_) sum += static_cast<std::int64_t>(entry.part.storage().nbytes());
  return sum;
}

// Stage 3: this rank's part of each parameter, a tensor of its own (so that the swap can take
// it alone), cut from rank 0's value; those built partitioned were cut so already, and are
// kept as they are (those spilled to disk, for the swap to take over). The padding is zeros.
// `flat` only gives the parts' options.
void ShardedOptimizer::lay_out_parts(Group& group, int rank, const std::vector<std::optional<PartitionStore::Entry>>& built,
                                     const torch::TensorOptions& tensor_options) {
  const auto& layout = group.layout;
  group.flat = torch::empty({0}, tensor_options);
  for (std::size_t i = 0; i < group.params.size(); ++i) {
    if (!built[i] && layout.numels[i] > 0) {
      comm_.broadcast_async(group.params[i].data_ptr(), group.params[i].nbytes(), 0)->wait();
    }
    const std::int64_t part = layout.buckets[i].part;
    torch::Tensor mine;
    if (built[i] && built[i]->part.numel() == part && built[i]->part.is_contiguous()) {
      mine = built[i]->part.detach();  // the same storage: no copy
      if (built[i]->spill) spilled_.push_back({mine, built[i]->spill, built[i]->offset});
    } else {
      if (built[i] && built[i]->spill) throw InternalError("ZeRO: a part spilled to disk of another size");
      mine = torch::zeros({part}, tensor_options);
      if (built[i]) {
        mine.copy_(built[i]->part.reshape({-1}));
      } else {
        cut_part(group.params[i], mine, rank);
      }
    }
    group.parts.push_back(mine);
    group.params[i].set_data(torch::empty({0}, tensor_options));
    group.params[i].mutable_grad() = torch::Tensor();
  }
}

void ShardedOptimizer::take_over_spilled() {
  for (const Spilled& s : spilled_) {
    if (!swapper_ || !options_.swap->parameters) {
      throw InternalError("ZeRO: parts built partitioned were spilled to disk, and the parameters are not swapped");
    }
    swapper_->take_over(s.part, *s.spill, s.offset);
  }
  spilled_.clear();
}

std::optional<std::pair<std::size_t, std::size_t>> ShardedOptimizer::locate(const torch::Tensor& parameter) const {
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    const auto& params = groups_[g].params;
    for (std::size_t i = 0; i < params.size(); ++i) {
      if (params[i].unsafeGetTensorImpl() == parameter.unsafeGetTensorImpl()) return std::make_pair(g, i);
    }
  }
  return std::nullopt;
}

void ShardedOptimizer::gather_all() {
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    std::vector<std::size_t> all(groups_[g].params.size());
    for (std::size_t i = 0; i < all.size(); ++i) all[i] = i;
    gather(g, all);
  }
}

void ShardedOptimizer::release(std::size_t g, const std::vector<std::size_t>& params) {
  if (options_.stage != 3) return;
  Group& group = groups_.at(g);
  for (const std::size_t i : params) {
    if (!group.persistent.at(i)) drop(group, i);
  }
}

void ShardedOptimizer::drop(Group& group, std::size_t i) {
  if (options_.stage != 3 || !group.gathered.at(i)) return;
  group.params[i].set_data(torch::empty({0}, group.flat.options()));
  group.gathered[i] = false;
}

void ShardedOptimizer::gather_persistent() {
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    std::vector<std::size_t> persistent;
    for (std::size_t i = 0; i < groups_[g].params.size(); ++i) {
      if (groups_[g].persistent[i]) persistent.push_back(i);
    }
    gather(g, persistent);
  }
}

void ShardedOptimizer::release_all() {
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    std::vector<std::size_t> all(groups_[g].params.size());
    for (std::size_t i = 0; i < all.size(); ++i) all[i] = i;
    release(g, all);
  }
}

void ShardedOptimizer::set_whole(std::size_t g, std::size_t i, const torch::Tensor& whole) {
  Group& group = groups_.at(g);
  const std::int64_t n = group.layout.numels.at(i);
  if (whole.numel() != n) {
    throw InternalError("ZeRO: a whole value of " + std::to_string(whole.numel()) + " elements for a parameter of " +
                        std::to_string(n));
  }
  torch::NoGradGuard no_grad;
  const auto flat = whole.detach().reshape({-1}).to(group.flat.options());
  if (options_.stage != 3) {
    group.params[i].view({-1}).copy_(flat);
    return;
  }
  parts_changed();
  auto& part = group.parts[i];
  if (swapper_) swapper_->bring_in({part});
  part.zero_();
  cut_part(flat, part, comm_.rank());
  if (swapper_) swapper_->let_go({part}, true);
  if (group.gathered[i]) group.params[i].view({-1}).copy_(flat);
}

void ShardedOptimizer::keep_gathered() {
  if (options_.stage != 3) return;  // the parameters are views of the parts already
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    for (std::size_t i = 0; i < groups_[g].params.size(); ++i) {
      if (groups_[g].gathered[i]) set_whole(g, i, groups_[g].params[i].detach().clone());
    }
  }
}

std::vector<std::pair<std::size_t, std::size_t>> ShardedOptimizer::released() const {
  std::vector<std::pair<std::size_t, std::size_t>> out;
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    for (std::size_t i = 0; i < groups_[g].params.size(); ++i) {
      if (!groups_[g].gathered[i]) out.emplace_back(g, i);
    }
  }
  return out;
}

void ShardedOptimizer::broadcast_whole(int root) {
  for (auto& group : groups_) {
    if (options_.stage != 3) {  // the parameters and the parts are views of the buffer
      comm_.broadcast_async(group.flat.data_ptr(), group.flat.nbytes(), root)->wait();
      continue;
    }
    for (std::size_t i = 0; i < group.params.size(); ++i) {
      if (!group.gathered[i] || group.layout.numels[i] == 0) continue;
      comm_.broadcast_async(group.params[i].data_ptr(), group.params[i].nbytes(), root)->wait();
    }
  }
  keep_gathered();
}

std::int64_t ShardedOptimizer::parameter_elements() const {
  std::int64_t sum = 0;
  for (const auto& group : groups_) {
    sum += group.flat.numel();
    if (options_.stage != 3) continue;
    for (const auto& part : group.parts) sum += StateSwapper::swapped_out(part) ? 0 : part.numel();
    for (const auto& p : group.params) sum += p.numel();  // the gathered ones
  }
  return sum + on_the_way_;
}

}  // namespace hpctrial::trainer::detail
