// ZeRO stage 3's all-gathers: a parameter's whole value gathered from every rank's parts when
// it is used (blocking, or ahead of use on the prefetch communicator), kept through a layer's
// backward or emptied and refilled (DeepSpeed's partition_parameters.py and
// partitioned_param_coordinator.py).
#include <algorithm>
#include <chrono>
#include <exception>
#include <memory>
#include <optional>
#include <vector>

#include "parallel/zero.h"

namespace hpctrial::trainer::detail {

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
    group.params[wanted[k]].set_data(land(*gathering, k));
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
        group.params[i].set_data(land(gathering, k));
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
  std::optional<std::size_t> coalesced;
  for (const std::size_t i : wanted) {
    const std::int64_t part = group.layout.buckets[i].part;
    const bool own = wanted.size() == 1 || part >= Gathering::kOwnGatherElements;
    if (own || !coalesced) {
      gathering->pieces.emplace_back();
      if (!own) coalesced = gathering->pieces.size() - 1;
    }
    const std::size_t p = own ? gathering->pieces.size() - 1 : *coalesced;
    Gathering::Piece& piece = gathering->pieces[p];
    gathering->piece_of.push_back(p);
    gathering->columns.push_back(piece.width);
    gathering->numels.push_back(group.layout.numels[i]);
    gathering->elements += group.layout.numels[i];
    piece.width += part;
    ++piece.members;
  }
  // This rank's parts into its block of each piece; parts swapped out are read in for it, and
  // let go once the all-gathers have started (a write of the swap that fails then fails this
  // rank's next collective, not a collective the other ranks wait in).
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> parts;  // the optimizer's own tensors, which the swap knows
  for (const std::size_t i : wanted) parts.push_back(group.parts[i]);
  if (swapper_) swapper_->bring_in(parts);
  const int rank = comm_.rank();
  for (Gathering::Piece& piece : gathering->pieces) {
    piece.all = torch::empty({comm_.size() * piece.width}, group.flat.options());
  }
  for (std::size_t k = 0; k < wanted.size(); ++k) {
    const Gathering::Piece& piece = gathering->pieces[gathering->piece_of[k]];
    piece.all.narrow(0, rank * piece.width + gathering->columns[k], parts[k].numel()).copy_(parts[k].detach());
  }
  comm::Communicator& comm = ahead && prefetch_comm_ ? *prefetch_comm_ : comm_;
  for (Gathering::Piece& piece : gathering->pieces) {
    float* all = piece.all.data_ptr<float>();
    const auto count = static_cast<std::size_t>(piece.width);
    const float* mine = all + rank * piece.width;
    if (ahead) {
      piece.work = comm.allgather_async(mine, all, count, comm::DType::kFloat32);
    } else {
      comm.allgather(mine, all, count, comm::DType::kFloat32);
    }
  }
  if (ahead) {
    gathering->on_the_way = &on_the_way_;
    on_the_way_ += gathering->elements;
  }
  if (swapper_) swapper_->let_go(parts, false);
  return gathering;
}

ShardedOptimizer::Gathering::~Gathering() {
  for (std::size_t p = 0; p < pieces.size(); ++p) {
    try {
      double waited = 0;
      finish(p, waited);
    } catch (const std::exception&) {
      // The all-gather failed: the ranks' next collective fails with the cause.
    }
  }
  for (std::size_t k = 0; on_the_way != nullptr && k < numels.size(); ++k) *on_the_way -= landed[k] ? 0 : numels[k];
}

void ShardedOptimizer::Gathering::finish(std::size_t p, double& waited) {
  Piece& piece = pieces.at(p);
  if (piece.failed) std::rethrow_exception(piece.failed);  // no parameter lands from it
  if (!piece.work) return;
  const auto started = std::chrono::steady_clock::now();
  const comm::WorkHandle done = std::move(piece.work);
  piece.work = nullptr;
  try {
    done->wait();
  } catch (...) {
    piece.failed = std::current_exception();
    throw;
  }
  waited += std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
}

torch::Tensor ShardedOptimizer::land(Gathering& gathering, std::size_t k) {
  const std::size_t p = gathering.piece_of.at(k);
  double waited = 0;
  gathering.finish(p, waited);
  if (waited > 0) {
    std::lock_guard<std::mutex> lock(mutex_);
    wait_seconds_ += waited;
  }
  torch::NoGradGuard no_grad;
  const Group& group = groups_.at(gathering.group);
  const std::size_t i = gathering.params.at(k);
  const std::int64_t part = group.layout.buckets[i].part, n = group.layout.numels[i];
  Gathering::Piece& piece = gathering.pieces[p];
  torch::Tensor whole;
  if (piece.members == 1) {  // the rank's blocks are the parameter's parts, in order: its value
    whole = piece.all.narrow(0, 0, n).view(group.shapes[i]);
    piece.all = torch::Tensor();
  } else {
    whole = torch::empty(group.shapes[i], group.flat.options());
    auto flat = whole.view({-1});
    for (std::int64_t r = 0; r * part < n; ++r) {
      const std::int64_t count = std::min(part, n - r * part);
      flat.narrow(0, r * part, count).copy_(piece.all.narrow(0, r * piece.width + gathering.columns[k], count));
    }
  }
  gathering.landed[k] = true;
  if (gathering.on_the_way != nullptr) *gathering.on_the_way -= gathering.numels[k];
  return whole;
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
  std::shared_ptr<Gathering> gathering = std::move(kept.pending);
  // Started before a step changed the parts (a backward over a graph of an earlier step).
  if (gathering && gathering->version != parts_version_) gathering.reset();
  if (!gathering) gathering = launch_gather(kept.group, kept.params, false);
  for (std::size_t k = 0; k < kept.params.size(); ++k) {
    const std::size_t i = kept.params[k];
    c10::Storage& storage = kept.storages[k];
    const auto& shape = group.shapes[i];
    torch::Tensor whole = land(*gathering, k);
    torch::Tensor into;
    if (storage.nbytes() == 0) {  // emptied: the storage takes the landed buffer over
      const c10::Storage landed = whole.storage();
      const std::size_t nbytes = landed.nbytes();
      storage.set_data_ptr_noswap(landed.set_data_ptr(c10::DataPtr(nullptr, landed.device())));
      storage.set_nbytes(nbytes);
      landed.set_nbytes(0);
      into = torch::empty({0}, group.flat.options()).set_(storage, whole.storage_offset(), shape);
    } else {  // a second backward over the graph finds it filled
      into = torch::empty({0}, group.flat.options()).set_(storage, 0, shape);
      into.copy_(whole);
    }
    whole = torch::Tensor();
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

}  // namespace hpctrial::trainer::detail
