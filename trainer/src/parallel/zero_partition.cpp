// ZeRO stage 3's partitioned parameters: each parameter's whole value gathered from every
// rank's part when it is used, and released after (DeepSpeed's partition_parameters.py).
#include <algorithm>
#include <chrono>
#include <exception>
#include <memory>
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

void ShardedOptimizer::gather(std::size_t g, const std::vector<std::size_t>& params) {
  if (options_.stage != 3) return;  // every parameter is whole already
  land_prefetched(g, params);
  Group& group = groups_.at(g);
  std::vector<std::size_t> wanted;
  for (const std::size_t i : params) {
    if (group.gathered.at(i) || std::find(wanted.begin(), wanted.end(), i) != wanted.end()) continue;
    wanted.push_back(i);
  }
  if (wanted.empty()) return;
  const auto gathering = launch_gather(g, wanted, false);
  for (std::size_t k = 0; k < wanted.size(); ++k) {
    auto whole = torch::empty(group.shapes[wanted[k]], group.flat.options());
    land(*gathering, k, whole);
    group.params[wanted[k]].set_data(whole);
    group.gathered[wanted[k]] = true;
  }
}

std::int64_t ShardedOptimizer::prefetch(std::size_t g, const std::vector<std::size_t>& params, std::int64_t room) {
  if (options_.stage != 3) return 0;
  const Group& group = groups_.at(g);
  const auto on_its_way = [&](std::size_t i) {
    for (const auto& gathering : prefetched_) {
      if (gathering->group != g) continue;
      for (std::size_t k = 0; k < gathering->params.size(); ++k) {
        if (gathering->params[k] == i && !gathering->landed[k]) return true;
      }
    }
    return false;
  };
  std::vector<std::size_t> wanted;
  std::int64_t started = 0;
  for (const std::size_t i : params) {
    if (started >= room) break;
    if (group.gathered.at(i) || std::find(wanted.begin(), wanted.end(), i) != wanted.end() || on_its_way(i)) continue;
    wanted.push_back(i);
    started += group.layout.numels[i];
  }
  if (wanted.empty()) return 0;
  prefetched_.push_back(launch_gather(g, wanted, true));
  return started;
}

std::int64_t ShardedOptimizer::start_refill(Kept& kept) {
  if (kept.params.empty() || kept.pending) return 0;
  const Group& group = groups_.at(kept.group);
  bool filled = true;  // a second backward over the graph: refilled already
  for (const std::size_t i : kept.params) filled = filled && group.gathered[i];
  if (filled) return 0;
  kept.pending = launch_gather(kept.group, kept.params, true);
  return kept.pending->elements;
}

std::int64_t ShardedOptimizer::live_elements() const {
  std::int64_t sum = on_the_way_;
  for (const auto& group : groups_) {
    for (const auto& p : group.params) sum += options_.stage == 3 ? p.numel() : 0;
  }
  return sum;
}

void ShardedOptimizer::land_prefetched(std::size_t g, const std::vector<std::size_t>& params) {
  Group& group = groups_.at(g);
  for (auto it = prefetched_.begin(); it != prefetched_.end();) {
    Gathering& gathering = **it;
    bool done = true;
    for (std::size_t k = 0; gathering.group == g && k < gathering.params.size(); ++k) {
      const std::size_t i = gathering.params[k];
      if (!gathering.landed[k] && std::find(params.begin(), params.end(), i) != params.end() && !group.gathered[i]) {
        auto whole = torch::empty(group.shapes[i], group.flat.options());
        land(gathering, k, whole);
        group.params[i].set_data(whole);
        group.gathered[i] = true;
      }
      done = done && gathering.landed[k];
    }
    it = gathering.group == g && done ? prefetched_.erase(it) : it + 1;
  }
}

std::shared_ptr<ShardedOptimizer::Gathering> ShardedOptimizer::launch_gather(std::size_t g,
                                                                             const std::vector<std::size_t>& wanted,
                                                                             bool ahead) {
  Group& group = groups_.at(g);
  auto gathering = std::make_shared<Gathering>();
  gathering->group = g;
  gathering->params = wanted;
  gathering->landed.assign(wanted.size(), false);
  gathering->version = parts_version_;
  std::vector<torch::Tensor> mine;
  std::vector<torch::Tensor> parts;  // the optimizer's own tensors, which the swap knows
  std::int64_t columns = 0;
  for (const std::size_t i : wanted) {
    mine.push_back(group.parts[i].detach());
    parts.push_back(group.parts[i]);
    gathering->columns.push_back(columns);
    gathering->numels.push_back(group.layout.numels[i]);
    columns += group.layout.buckets[i].part;
    gathering->elements += group.layout.numels[i];
  }
  // Every rank's parts of the wanted parameters, rank by rank; parts swapped out are read in for
  // it, and let go after. Ahead of use, the parts are copied: a step or a swap may change them
  // while the all-gather reads.
  torch::NoGradGuard no_grad;
  if (swapper_) swapper_->bring_in(parts);
  gathering->send = mine.size() == 1 && !ahead ? mine.front() : torch::cat(mine);
  gathering->all = torch::empty({comm_.size(), columns}, group.flat.options());
  const auto count = static_cast<std::size_t>(columns);
  if (ahead) {
    comm::Communicator& comm = prefetch_comm_ ? *prefetch_comm_ : comm_;
    gathering->work = comm.allgather_async(gathering->send.data_ptr(), gathering->all.data_ptr(), count,
                                            comm::DType::kFloat32);
    gathering->on_the_way = &on_the_way_;
    on_the_way_ += gathering->elements;
  } else {
    comm_.allgather(gathering->send.data_ptr(), gathering->all.data_ptr(), count, comm::DType::kFloat32);
  }
  if (swapper_) swapper_->let_go(parts, false);
  return gathering;
}

ShardedOptimizer::Gathering::~Gathering() {
  try {
    double waited = 0;
    finish(waited);
  } catch (const std::exception&) {
    // The all-gather failed: the ranks' next collective fails with the cause.
  }
  for (std::size_t k = 0; on_the_way != nullptr && k < numels.size(); ++k) *on_the_way -= landed[k] ? 0 : numels[k];
}

void ShardedOptimizer::Gathering::finish(double& waited) {
  if (!work) return;
  const auto started = std::chrono::steady_clock::now();
  const comm::WorkHandle done = std::move(work);
  work = nullptr;
  done->wait();
  waited += std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
}

void ShardedOptimizer::land(Gathering& gathering, std::size_t k, const torch::Tensor& into) {
  double waited = 0;
  gathering.finish(waited);
  if (waited > 0) {
    std::lock_guard<std::mutex> lock(mutex_);
    wait_seconds_ += waited;
  }
  torch::NoGradGuard no_grad;
  const Group& group = groups_.at(gathering.group);
  const std::size_t i = gathering.params.at(k);
  const std::int64_t part = group.layout.buckets[i].part, n = group.layout.numels[i];
  auto flat = into.view({-1});
  for (std::int64_t r = 0; r * part < n; ++r) {
    const std::int64_t count = std::min(part, n - r * part);
    flat.narrow(0, r * part, count).copy_(gathering.all[r].narrow(0, gathering.columns[k], count));
  }
  gathering.landed[k] = true;
  if (gathering.on_the_way != nullptr) *gathering.on_the_way -= gathering.numels[k];
}

void ShardedOptimizer::parts_changed() {
  ++parts_version_;
  prefetched_.clear();  // each waits for its all-gather
}

ShardedOptimizer::Kept ShardedOptimizer::keep(std::size_t g, const std::vector<std::size_t>& params) {
  Kept kept;
  kept.group = g;
  if (options_.stage != 3) return kept;
  Group& group = groups_.at(g);
  for (const std::size_t i : params) {
    if (!group.gathered.at(i) || group.persistent.at(i) ||
        std::find(kept.params.begin(), kept.params.end(), i) != kept.params.end()) {
      continue;
    }
    kept.params.push_back(i);
    kept.storages.push_back(group.params[i].storage());
  }
  empty(kept);
  return kept;
}

void ShardedOptimizer::refill(Kept& kept) {
  if (kept.params.empty()) return;
  Group& group = groups_.at(kept.group);
  c10::Allocator* allocator = c10::GetAllocator(group.flat.device().type());
  std::shared_ptr<Gathering> gathering = std::move(kept.pending);
  // Started before a step changed the parts (a backward over a graph of an earlier step).
  if (gathering && gathering->version != parts_version_) gathering.reset();
  if (!gathering) gathering = launch_gather(kept.group, kept.params, false);
  for (std::size_t k = 0; k < kept.params.size(); ++k) {
    const std::size_t i = kept.params[k];
    c10::Storage& storage = kept.storages[k];
    const auto& shape = group.shapes[i];
    const auto nbytes = static_cast<std::size_t>(c10::multiply_integers(shape)) * sizeof(float);
    if (storage.nbytes() != nbytes) {  // emptied (a second backward over the graph finds it filled)
      storage.set_data_ptr_noswap(allocator->allocate(nbytes));
      storage.set_nbytes(nbytes);
    }
    const auto into = torch::empty({0}, group.flat.options()).set_(storage, 0, shape);
    land(*gathering, k, into);
    if (group.gathered[i]) continue;  // gathered meanwhile (GatheredParameters): the same values
    group.params[i].set_data(into);
    group.gathered[i] = true;
  }
}

void ShardedOptimizer::empty(Kept& kept) {
  kept.pending.reset();  // waits for its all-gather
  Group& group = groups_.at(kept.group);
  for (std::size_t k = 0; k < kept.params.size(); ++k) {
    const std::size_t i = kept.params[k];
    c10::Storage& storage = kept.storages[k];
    if (group.gathered[i] && group.params[i].storage().unsafeGetStorageImpl() == storage.unsafeGetStorageImpl()) {
      group.params[i].set_data(torch::empty({0}, group.flat.options()));
      group.gathered[i] = false;
    }
    storage.set_data_ptr_noswap(c10::DataPtr(nullptr, storage.device()));
    storage.set_nbytes(0);
  }
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
