#include "state/replica_check.h"

#include <torch/torch.h>

#include <algorithm>
#include <map>
#include <set>

#include "hpctrial/checkpoint/format.h"
#include "hpctrial/comm/communicator.h"
#include "hpctrial/core/error.h"
#include "hpctrial/trainer/trial_context.h"
#include "parallel/zero.h"
#include "state/state_io.h"

namespace hpctrial::trainer::detail {
namespace {

template <typename Int>
std::int64_t sum_as(const void* data, std::size_t count) {
  const auto* values = static_cast<const Int*>(data);
  std::uint64_t sum = 0;  // unsigned: wraps, as the device's int64 sum does
  for (std::size_t i = 0; i < count; ++i) sum += static_cast<std::uint64_t>(static_cast<std::int64_t>(values[i]));
  return static_cast<std::int64_t>(sum);
}

// The integer sum of the tensor's bits, as a 0-d int64 tensor on its device: each element read
// as the signed integer of its size, so that any change of any bit changes the sum unless
// another change cancels it exactly. On the CPU, one pass without a temporary.
torch::Tensor bit_sum(const torch::Tensor& tensor) {
  const torch::Tensor flat = tensor.detach().contiguous().view({-1});
  const auto size = static_cast<std::size_t>(flat.element_size());
  const c10::ScalarType as = size % 8 == 0   ? torch::kInt64
                             : size % 4 == 0 ? torch::kInt32
                             : size % 2 == 0 ? torch::kInt16
                                             : torch::kInt8;
  if (!flat.device().is_cpu()) return flat.view(as).sum(torch::kInt64);
  const void* data = flat.data_ptr();
  const std::size_t bytes = static_cast<std::size_t>(flat.numel()) * size;
  std::int64_t sum = 0;
  switch (as) {
    case torch::kInt64: sum = sum_as<std::int64_t>(data, bytes / 8); break;
    case torch::kInt32: sum = sum_as<std::int32_t>(data, bytes / 4); break;
    case torch::kInt16: sum = sum_as<std::int16_t>(data, bytes / 2); break;
    default: sum = sum_as<std::int8_t>(data, bytes); break;
  }
  return torch::tensor(sum, torch::kInt64);
}

std::string ranks_text(const std::vector<int>& ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  constexpr std::size_t kShown = 8;
  for (std::size_t k = 0; k < ranks.size() && k < kShown; ++k) out += (k ? ", " : "") + std::to_string(ranks[k]);
  if (ranks.size() > kShown) out += " and " + std::to_string(ranks.size() - kShown) + " more";
  return out;
}

// "rank 0 holds 1234, ranks 1, 2, 3 hold 5678": the largest group first.
std::string holders_text(const std::vector<std::int64_t>& values, const std::vector<std::int64_t>& ranks) {
  std::map<std::int64_t, std::vector<int>> by_value;
  for (std::size_t r = 0; r < values.size(); ++r) by_value[values[r]].push_back(static_cast<int>(ranks[r]));
  std::vector<std::pair<std::int64_t, std::vector<int>>> groups(by_value.begin(), by_value.end());
  std::stable_sort(groups.begin(), groups.end(), [](const auto& a, const auto& b) {
    return a.second.size() != b.second.size() ? a.second.size() > b.second.size() : a.second.front() < b.second.front();
  });
  std::string out;
  for (const auto& [value, ranks] : groups) {
    if (!out.empty()) out += "; ";
    out += ranks_text(ranks) + (ranks.size() == 1 ? " holds " : " hold ") + std::to_string(value);
  }
  return out;
}

}  // namespace

ReplicaChecksums replica_checksums(TrialContext& context, const ShardedOptimizers& sharded) {
  ReplicaChecksums out;
  std::vector<torch::Tensor> sums;
  const auto add = [&](const std::string& name, const torch::Tensor& tensor) {
    out.names.push_back(name);
    sums.push_back(bit_sum(tensor));
  };
  // ZeRO-3's parameters have no replicas: each rank holds its own part of them.
  std::set<const void*> partitioned;
  for (const auto& [index, optimizer] : sharded) {
    if (!optimizer->partitions_parameters()) continue;
    for (const auto& group : optimizer->parameter_groups()) {
      for (const auto& p : group) partitioned.insert(p.unsafeGetTensorImpl());
    }
  }
  const auto& models = context.models();
  for (std::size_t i = 0; i < models.size(); ++i) {
    for (const auto& item : models[i]->named_parameters()) {
      if (partitioned.count(item.value().unsafeGetTensorImpl()) != 0) continue;
      add("model/" + std::to_string(i) + "/" + item.key(), item.value());
    }
  }
  checkpoint::Contents texts;
  const auto& optimizers = context.optimizers();
  for (std::size_t i = 0; i < optimizers.size(); ++i) {
    if (sharded.count(i) != 0) continue;  // each rank holds its own shard
    for (const auto& d : view_optimizer(texts, "optimizer/" + std::to_string(i), *optimizers[i])) add(d.name, d.tensor);
  }
  // One copy to the host where every sum lives on one device (one synchronization on a GPU).
  const bool one_device = std::all_of(sums.begin(), sums.end(), [&](const torch::Tensor& s) {
    return s.device() == sums.front().device();
  });
  if (!sums.empty() && one_device) {
    const torch::Tensor host = torch::stack(sums).to(torch::kCPU);
    const auto* values = host.data_ptr<std::int64_t>();
    out.sums.assign(values, values + host.numel());
  } else {
    for (const auto& s : sums) out.sums.push_back(s.item<std::int64_t>());
  }
  for (const auto& d : texts.datasets) {
    out.names.push_back(d.name);
    out.sums.push_back(static_cast<std::int64_t>(checkpoint::crc32c(d.data->data(), d.nbytes())));
  }
  return out;
}

void check_replicas(comm::Communicator& comm, const ReplicaChecksums& mine, const std::string& when, int world_rank) {
  if (comm.size() == 1) return;
  // Bitwise complements turn the minimum into a maximum: one all-reduce gives both.
  const auto n = static_cast<std::int64_t>(mine.sums.size());
  std::int64_t count[2] = {n, ~n};
  comm.allreduce(count, 2, comm::DType::kInt64, comm::ReduceOp::kMax);
  if (count[0] != ~count[1]) {
    throw DivergenceError("the ranks' replicas differ " + when + ": the ranks hold different numbers of parameters "
                          "and optimizer state tensors (this rank " + std::to_string(n) + ", others up to " +
                          std::to_string(count[0]) + "); every rank must build the same model and optimizers");
  }
  std::vector<std::int64_t> both(2 * mine.sums.size());
  for (std::size_t i = 0; i < mine.sums.size(); ++i) {
    both[i] = mine.sums[i];
    both[mine.sums.size() + i] = ~mine.sums[i];
  }
  comm.allreduce(both.data(), both.size(), comm::DType::kInt64, comm::ReduceOp::kMax);
  std::size_t first = 0;
  while (first < mine.sums.size() && both[first] == ~both[mine.sums.size() + first]) ++first;
  if (first == mine.sums.size()) return;
  std::vector<std::int64_t> values(static_cast<std::size_t>(comm.size()));
  comm.allgather(&mine.sums[first], values.data(), 1, comm::DType::kInt64);
  // Named by their ranks in the world (`comm` may be a data-parallel group).
  std::vector<std::int64_t> ranks(static_cast<std::size_t>(comm.size()));
  const std::int64_t me = world_rank < 0 ? comm.rank() : world_rank;
  comm.allgather(&me, ranks.data(), 1, comm::DType::kInt64);
  const std::string& name = mine.names[first];
  const bool options = name.size() > 13 && name.compare(name.size() - 13, 13, "/param_groups") == 0;
  throw DivergenceError(
      "the ranks' replicas differ " + when + ": " + name + (options ? " (the optimizer's options, such as its "
                                                                      "learning rate)" : "") +
      " is not the same on every rank (checksums: " + holders_text(values, ranks) + "). Every rank must make the same "
      "changes to the model and optimizers: code that runs on the chief alone (a branch on the rank; in "
      "on_validation_end or on_checkpoint_end anything but optimizer options and LR scheduler steps, which every "
      "rank is given) must not change them; otherwise a rank computed differently "
      "(a faulty node). Training stops here, before replicas that differ are averaged or checkpointed");
}

}  // namespace hpctrial::trainer::detail
